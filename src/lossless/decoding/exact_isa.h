// The kernels of exact mode in terms of `V16`, compiled once per instruction-set variant.
//
// `exact_kernels.cpp` includes this file four times, each time inside its own namespace and under its own
// `#pragma GCC target`, with one of LOSSLESS_V16_AVX512 / LOSSLESS_V16_AVX2 / neither (plain loops) defined and,
// for the first, LOSSLESS_DPBF16 (the AVX-512 BF16 dot product). Nothing here may depend on the variant but
// how many lanes one instruction advances: every function keeps the invariant stated at the top of
// `exact_kernels.cpp` (one fixed chain of correctly rounded IEEE operations per output), and every entry point
// runs its work under `FlushDenormals` in the thread that does it.

constexpr int64_t LANES = 16;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// Round to nearest even; a NaN becomes the canonical quiet NaN (instruction paths propagate different payloads).
template <typename T> inline T from_float(float x) { return static_cast<T>(x != x ? CANONICAL_NAN : x); }

// Sixteen float lanes: one AVX-512 register, two AVX2 registers, or a plain array. Every operation is
// lane-wise and correctly rounded (fma included), so all three give the same bits.
struct V16 {
#if defined(LOSSLESS_V16_AVX512)
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V16 load(const at::BFloat16* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static V16 load(const at::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static V16 splat(float x) { return {_mm512_set1_ps(x)}; }
  V16 fma(V16 a, V16 b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }  // this + a * b, one rounding
  V16 bit_or(V16 a) const { return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a.v), _mm512_castps_si512(v)))}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
#elif defined(LOSSLESS_V16_AVX2)
  __m256 lo, hi;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static __m256 bf8(const at::BFloat16* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V16 load(const at::BFloat16* p) { return {bf8(p), bf8(p + 8)}; }
  static V16 load(const at::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static V16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  V16 fma(V16 a, V16 b) const { return {_mm256_fmadd_ps(a.lo, b.lo, lo), _mm256_fmadd_ps(a.hi, b.hi, hi)}; }
  V16 bit_or(V16 a) const { return {_mm256_or_ps(a.lo, lo), _mm256_or_ps(a.hi, hi)}; }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
#else
  float v[LANES];
  static V16 zero() { V16 r; for (int l = 0; l < LANES; ++l) r.v[l] = 0.0f; return r; }
  template <typename T> static V16 load(const T* p) { V16 r; for (int l = 0; l < LANES; ++l) r.v[l] = to_float(p[l]); return r; }
  static V16 splat(float x) { V16 r; for (int l = 0; l < LANES; ++l) r.v[l] = x; return r; }
  V16 fma(V16 a, V16 b) const { V16 r; for (int l = 0; l < LANES; ++l) r.v[l] = std::fmaf(a.v[l], b.v[l], v[l]); return r; }
  V16 bit_or(V16 a) const {
    V16 r;
    for (int l = 0; l < LANES; ++l)
      r.v[l] = __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, a.v[l]) | __builtin_bit_cast(uint32_t, v[l]));
    return r;
  }
  void store(float* p) const { for (int l = 0; l < LANES; ++l) p[l] = v[l]; }
#endif
  // Pairs: 16 lanes of (bf16 even, bf16 odd) packed in uint32s (the even one in the low half). this + the odd
  // products, then + the even ones, each an fma (a bf16 x bf16 product is exact in fp32): what the AVX-512
  // BF16 dot-product instruction computes lane by lane under the denormal rule (inputs read as zero when
  // subnormal, results flushed), so both ways give the same bits.
  V16 dot_pairs(uint32_t xpair, const uint32_t* wpairs) const {
#if defined(LOSSLESS_DPBF16)
    return {_mm512_dpbf16_ps(v, (__m512bh)_mm512_set1_epi32(static_cast<int>(xpair)),
                             (__m512bh)_mm512_loadu_si512(wpairs))};
#else
    float even[LANES], odd[LANES];
    for (int64_t l = 0; l < LANES; ++l) {
      even[l] = __builtin_bit_cast(float, wpairs[l] << 16);
      odd[l] = __builtin_bit_cast(float, wpairs[l] & 0xFFFF0000u);
    }
    const float xe = __builtin_bit_cast(float, xpair << 16), xo = __builtin_bit_cast(float, xpair & 0xFFFF0000u);
    return fma(splat(xo), load(static_cast<const float*>(odd))).fma(splat(xe), load(static_cast<const float*>(even)));
#endif
  }
  // lanes 0..n-1 from p, zeros after (n < LANES): the tail of a row, as if it were zero-padded
  template <typename T> static V16 load_partial(const T* p, int64_t n) {
    float buf[LANES];
    for (int64_t l = 0; l < LANES; ++l) buf[l] = l < n ? to_float(p[l]) : 0.0f;
    return load(static_cast<const float*>(buf));
  }
  template <typename T> static V16 load_padded(const T* p, int64_t c, int64_t n) {  // lanes c.. of an n-long row
    return c + LANES <= n ? load(p + c) : load_partial(p + c, n - c);
  }
};

inline float tree16(const float* a) {
  float b[8], c[4];
  for (int l = 0; l < 8; ++l) b[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) c[l] = b[l] + b[l + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// exp(x) for float, from fixed operations only: x = n ln2 + r, |r| <= ln2/2, Taylor to r^7, times 2^n.
// Branch-free (selects only), so a loop over it vectorises: lane-wise, the same bits. NaN in, NaN out.
inline float exp_fixed(float x) {
  const float hi = 88.0f, lo = -87.0f;
  const bool nan = x != x;
  float xc = x > hi ? hi : (x < lo ? lo : x);
  xc = nan ? 0.0f : xc;  // no float-to-int conversion of a NaN below
  const float round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer (even)
  float n = (xc * 1.44269504088896341f + round) - round;
  float r = std::fmaf(-n, 0.693145751953125f, xc);  // ln2 split in two: the first part is exact in n * hi
  r = std::fmaf(-n, 1.42860682030941723212e-6f, r);
  float p = 1.98412698412698413e-4f;  // 1/7!
  p = std::fmaf(p, r, 1.38888888888888889e-3f);
  p = std::fmaf(p, r, 8.33333333333333333e-3f);
  p = std::fmaf(p, r, 4.16666666666666667e-2f);
  p = std::fmaf(p, r, 1.66666666666666667e-1f);
  p = std::fmaf(p, r, 0.5f);
  p = std::fmaf(p, r, 1.0f);
  p = std::fmaf(p, r, 1.0f);
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  float y = p * scale;
  return nan ? x : (x > hi ? INFINITY : (x < lo ? 0.0f : y));
}

// The linear layer. Weights are packed once (`pack_weight` in kernels.py) into panels of 16 outputs: panel p
// holds outputs 16p..16p+15, input by input, [panels, k, 16]; in bf16 two inputs at a time, [panels, k/2, 16, 2]
// (k padded to even with zeros). Output o of row r is then one chain in input order:
//   acc = 0; for i in 0..k-1: acc = fma(x[r][i], w[o][i], acc)
// in bf16: for each pair i: acc = fma(x[2i+1], w[2i+1], acc); acc = fma(x[2i], w[2i], acc)
// never split, never reassociated, whatever the blocking below does; the blocks of RB rows x JB panels only
// decide which chains advance together (so weights are read once per RB rows).
#if defined(LOSSLESS_V16_AVX512)
constexpr int RB = 4, JB = 4;  // 16 accumulators + 4 weight vectors + 1 broadcast of the 32 registers
#else
constexpr int RB = 4, JB = 2;  // AVX2: 16 registers, two per accumulator
#endif

template <typename T> constexpr bool PAIRED = std::is_same_v<T, at::BFloat16>;

// x rows as the kernel reads them: fp32 [m, k], or bf16 pairs as uint32 [m, ceil(k/2)]
template <typename T>
struct Rows {
  std::vector<float> f;
  std::vector<uint32_t> pairs;
  int64_t steps;  // chain steps per output: k, or ceil(k / 2) pairs
  Rows(const T* x, int64_t m, int64_t k) {
    if constexpr (PAIRED<T>) {
      steps = (k + 1) / 2;
      pairs.assign(static_cast<size_t>(m * steps), 0u);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < k; ++i)
          pairs[r * steps + i / 2] |= static_cast<uint32_t>(x[r * k + i].x) << (16 * (i % 2));
    } else {
      steps = k;
      f.resize(static_cast<size_t>(m * k));
      for (int64_t i = 0; i < m * k; ++i) f[i] = to_float(x[i]);
    }
  }
};

template <int R, int J, typename T>
inline void panel_block(const Rows<T>& x, int64_t r0, const T* panels, int64_t n, int64_t p0, T* out,
                        const T* bias) {
  const int64_t steps = x.steps;
  V16 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = V16::zero();
  for (int64_t i = 0; i < steps; ++i) {
    if constexpr (PAIRED<T>) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(panels) + (p0 * steps + i) * LANES;
      for (int r = 0; r < R; ++r) {
        const uint32_t xr = x.pairs[(r0 + r) * steps + i];
        for (int j = 0; j < J; ++j) acc[r][j] = acc[r][j].dot_pairs(xr, w + j * steps * LANES);
      }
    } else {
      V16 w[J];
      for (int j = 0; j < J; ++j) w[j] = V16::load(panels + ((p0 + j) * steps + i) * LANES);
      for (int r = 0; r < R; ++r) {
        const V16 xb = V16::splat(x.f[(r0 + r) * steps + i]);
        for (int j = 0; j < J; ++j) acc[r][j] = acc[r][j].fma(xb, w[j]);
      }
    }
  }
  float buf[LANES];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      acc[r][j].store(buf);
      for (int64_t l = 0; l < LANES; ++l) {
        const int64_t o = (p0 + j) * LANES + l;
        if (o < n) out[(r0 + r) * n + o] = from_float<T>(bias ? buf[l] + to_float(bias[o]) : buf[l]);
      }
    }
}

// rows r.. (fewer than RB) through panels p..p+J-1, dispatched to a block of exactly that many rows
template <int J, typename T>
inline void panel_tail(int rows, const Rows<T>& x, int64_t r, const T* panels, int64_t n, int64_t p, T* out,
                       const T* bias) {
  switch (rows) {
    case 1: panel_block<1, J>(x, r, panels, n, p, out, bias); break;
    case 2: panel_block<2, J>(x, r, panels, n, p, out, bias); break;
    case 3: panel_block<3, J>(x, r, panels, n, p, out, bias); break;
    default: TORCH_CHECK(rows == 0, "panel_tail: rows");
  }
}

template <int J, typename T>
inline void panel_all_rows(const Rows<T>& x, int64_t m, const T* panels, int64_t n, int64_t p, T* out, const T* bias) {
  // every row block reads these J panels while they sit in L2: the weights leave memory once per call
  int64_t r = 0;
  for (; r + RB <= m; r += RB) panel_block<RB, J>(x, r, panels, n, p, out, bias);
  panel_tail<J>(static_cast<int>(m - r), x, r, panels, n, p, out, bias);
}

template <typename T>
void linear_impl(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                 at::Tensor& out) {
  const FlushDenormals flush;
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  const Rows<T> rows(x.data_ptr<T>(), m, k);
  TORCH_CHECK(packed.numel() == panels * rows.steps * LANES * (PAIRED<T> ? 2 : 1),
              "linear: the packed weight does not match x (pack it with kernels.pack_weight)");
  const T* wp = packed.data_ptr<T>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    const FlushDenormals flush_here;  // the rule holds in the thread that does the work
    int64_t p = p0;
    for (; p + JB <= p1; p += JB) panel_all_rows<JB>(rows, m, wp, n, p, op, bp);
    for (; p < p1; ++p) panel_all_rows<1>(rows, m, wp, n, p, op, bp);
  });
}

// B consecutive key tiles ([B, d, 16] floats) against G queries (heads sharing these keys; query g at q + g * d):
// 16 * B scores per query, each one fma chain over d. The G * B chains advance side by side and share each load.
template <int G, int B>
inline void score_tiles(const float* q, int64_t d, const float* tiles, float* out, int64_t stride) {
  V16 acc[G][B];
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < B; ++b) acc[g][b] = V16::zero();
  for (int64_t t = 0; t < d; ++t) {
    V16 k[B];
    for (int b = 0; b < B; ++b) k[b] = V16::load(tiles + (b * d + t) * LANES);
    for (int g = 0; g < G; ++g) {
      const V16 qt = V16::splat(q[g * d + t]);
      for (int b = 0; b < B; ++b) acc[g][b] = acc[g][b].fma(qt, k[b]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int b = 0; b < B; ++b) acc[g][b].store(out + g * stride + b * LANES);
}

// C chunks of 16 head-dim lanes, t0 .. t0 + 16C, of G output rows (heads sharing these values; head g's scores at
// scores + g * stride): for each lane, one fma chain over the visible keys in key order (score_j * v_j[t]); the
// G * C chains advance side by side and share each load, never merged. `v` holds the values as fp32 rows of
// dp >= d lanes (zeros past d).
template <int G, int C>
inline void weighted_values(const float* scores, int64_t stride, const std::vector<int32_t>& keys, const float* v,
                            int64_t dp, int64_t t0, float* acc) {
  V16 sum[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sum[g][c] = V16::zero();
  for (size_t j = 0; j < keys.size(); ++j) {
    const float* vj = v + keys[j] * dp + t0;
    V16 val[C];
    for (int c = 0; c < C; ++c) val[c] = V16::load(vj + c * LANES);
    for (int g = 0; g < G; ++g) {
      const V16 s = V16::splat(scores[g * stride + j]);
      for (int c = 0; c < C; ++c) sum[g][c] = sum[g][c].fma(s, val[c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sum[g][c].store(acc + g * dp + t0 + c * LANES);
}

// One row's attention for G heads of one kv head (queries qf [G, d] in fp32): scores of every key up to the last
// visible one, then per head the max, exp and sum over the visible keys and the weighted values, each in key order.
template <int G>
inline void attend_heads(const float* qf, int64_t d, int64_t dp, const float* kt, const float* vk,
                         const std::vector<int32_t>& seen, float scale, std::vector<float>& all,
                         std::vector<float>& scores, std::vector<float>& acc, float* total) {
  const int64_t used = seen.back() / LANES + 1, stride = used * LANES;
  all.resize(static_cast<size_t>(G * stride));
  int64_t tile = 0;
  constexpr int B = G <= 2 ? 4 : (G == 3 ? 4 : 3);  // G * B accumulators within the 32 (AVX-512) registers
  for (; tile + B <= used; tile += B)
    score_tiles<G, B>(qf, d, kt + tile * d * LANES, all.data() + tile * LANES, stride);
  for (; tile < used; ++tile) score_tiles<G, 1>(qf, d, kt + tile * d * LANES, all.data() + tile * LANES, stride);
  const size_t m = seen.size(), full = m / LANES * LANES;
  scores.resize(static_cast<size_t>(G) * m);
  for (int g = 0; g < G; ++g) {
    float* sp = scores.data() + g * m;
    const float* ap = all.data() + g * stride;
    float best = -INFINITY;
    for (size_t j = 0; j < m; ++j) {
      sp[j] = ap[seen[j]] * scale;
      best = sp[j] > best ? sp[j] : best;
    }
#pragma omp simd  // lane-wise: each element the same operations, whatever the width
    for (size_t j = 0; j < m; ++j) sp[j] = exp_fixed(sp[j] - best);
    float lanes[LANES] = {0};
    for (size_t j = 0; j < full; j += LANES)
      for (int64_t l = 0; l < LANES; ++l) lanes[l] += sp[j + l];
    for (size_t j = full; j < m; ++j) lanes[j - full] += sp[j];
    total[g] = tree16(lanes);
  }
  acc.resize(static_cast<size_t>(G * dp));
  int64_t t = 0;
  constexpr int C = G <= 2 ? 4 : 2;
  for (; t + C * LANES <= dp; t += C * LANES)
    weighted_values<G, C>(scores.data(), static_cast<int64_t>(m), seen, vk, dp, t, acc.data());
  for (; t < dp; t += LANES) weighted_values<G, 1>(scores.data(), static_cast<int64_t>(m), seen, vk, dp, t, acc.data());
}

template <typename T>
void attention_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& visible,
                    double scaling, at::Tensor& out) {
  const FlushDenormals flush;
  const int64_t q = query.size(0), h = query.size(1), d = query.size(2), kvh = key.size(0), n = key.size(1);
  const int64_t groups = h / kvh, dp = (d + LANES - 1) / LANES * LANES, tiles = (n + LANES - 1) / LANES;
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();  // read once, into vf
  const bool* mp = visible.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const float scale = static_cast<float>(scaling);
  // each row's visible keys, in cache order, once for all heads
  std::vector<std::vector<int32_t>> keys(static_cast<size_t>(q));
  at::parallel_for(0, q, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row)
      for (int64_t j = 0; j < n; ++j)
        if (mp[row * n + j]) keys[row].push_back(static_cast<int32_t>(j));
  });
  std::vector<float> kt(static_cast<size_t>(kvh * tiles * d * LANES), 0.0f);  // keys [kv, tile, d, 16]
  std::vector<float> vf(static_cast<size_t>(kvh * n * dp), 0.0f);             // values [kv, n, dp]
  at::parallel_for(0, kvh * tiles, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t kv = b / tiles, tile = b % tiles;
      for (int64_t l = 0; l < LANES && tile * LANES + l < n; ++l) {
        const int64_t j = kv * n + tile * LANES + l;
        for (int64_t t = 0; t < d; ++t) {
          kt[(b * d + t) * LANES + l] = to_float(kp[j * d + t]);
          vf[j * dp + t] = to_float(vp[j * d + t]);
        }
      }
    }
  });
  // work items: (row, kv head, up to `per` of its query heads); with few rows one head per item, so every thread
  // has work (a decode step). Which heads share an item never changes a bit: each output is its own chain.
  const int64_t per = q * kvh >= 2 * at::get_num_threads() ? 4 : 1, parts = (groups + per - 1) / per;
  at::parallel_for(0, q * kvh * parts, 1, [&](int64_t a0, int64_t a1) {
    const FlushDenormals flush_here;
    std::vector<float> all, scores, acc, qf(static_cast<size_t>(4 * d));
    float total[4];
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t row = a / (kvh * parts), kv = a / parts % kvh, h0 = kv * groups + a % parts * per;
      const int64_t g_count = std::min<int64_t>(per, kv * groups + groups - h0);
      const std::vector<int32_t>& seen = keys[row];
      if (seen.empty()) {
        for (int64_t e = 0; e < g_count * d; ++e) op[(row * h + h0) * d + e] = from_float<T>(0.0f);
        continue;
      }
      for (int64_t e = 0; e < g_count * d; ++e) qf[e] = to_float(qp[(row * h + h0) * d + e]);
      const float* ktk = kt.data() + kv * tiles * d * LANES;
      const float* vk = vf.data() + kv * n * dp;
      switch (g_count) {
        case 1: attend_heads<1>(qf.data(), d, dp, ktk, vk, seen, scale, all, scores, acc, total); break;
        case 2: attend_heads<2>(qf.data(), d, dp, ktk, vk, seen, scale, all, scores, acc, total); break;
        case 3: attend_heads<3>(qf.data(), d, dp, ktk, vk, seen, scale, all, scores, acc, total); break;
        default: attend_heads<4>(qf.data(), d, dp, ktk, vk, seen, scale, all, scores, acc, total); break;
      }
      for (int64_t g = 0; g < g_count; ++g) {
        T* o = op + (row * h + h0 + g) * d;
        for (int64_t e = 0; e < d; ++e) o[e] = from_float<T>(acc[g * dp + e] / total[g]);
      }
    }
  });
}

// The Llama/Qwen RMSNorm: y = w * T(x * rsqrt(mean(x^2) + eps)), statistics in fp32; x [m, c], w [c]
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const FlushDenormals flush;
  const int64_t m = x.size(0), c = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps), count = static_cast<float>(c);
  at::parallel_for(0, m, 8, [&](int64_t i0, int64_t i1) {
    const FlushDenormals flush_here;
    for (int64_t i = i0; i < i1; ++i) {
      const T* xi = xp + i * c;
      float lanes[LANES] = {0};
      for (int64_t t = 0; t < c; ++t) {
        const float v = to_float(xi[t]);
        lanes[t % LANES] = std::fmaf(v, v, lanes[t % LANES]);
      }
      const float inv = 1.0f / std::sqrt(tree16(lanes) / count + e);
      for (int64_t t = 0; t < c; ++t)
        op[i * c + t] = from_float<T>(to_float(wp[t]) * to_float(from_float<T>(to_float(xi[t]) * inv)));
    }
  });
}

template <typename T>
void silu_impl(const at::Tensor& x, at::Tensor& out) {
  const FlushDenormals flush;
  const int64_t numel = x.numel();
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, numel, 2048, [&](int64_t i0, int64_t i1) {
    const FlushDenormals flush_here;
    for (int64_t i = i0; i < i1; ++i) {
      const float v = to_float(xp[i]);
      op[i] = from_float<T>(v / (1.0f + exp_fixed(-v)));
    }
  });
}

// The physical floor a forward is measured against: every byte of `tensors` read once, 16 fp32 lanes at a time
// (an OR of the bits, so no value can be slow), chunks of 64 KB spread over the threads. Returns the OR as a
// checksum (so nothing is optimised away).
int64_t stream(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<const uint32_t*, int64_t>> chunks;  // (start, 32-bit words)
  constexpr int64_t CHUNK = 16384;
  for (const at::Tensor& t : tensors) {
    check_cpu(t, "stream tensor");
    const int64_t words = t.numel() * t.element_size() / 4;
    const uint32_t* p = static_cast<const uint32_t*>(t.data_ptr());
    for (int64_t w = 0; w < words; w += CHUNK) chunks.emplace_back(p + w, std::min(CHUNK, words - w));
  }
  std::vector<uint32_t> seen(static_cast<size_t>(at::get_num_threads()) + 1, 0u);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
    V16 acc = V16::zero();
    uint32_t tail = 0;
    for (int64_t c = c0; c < c1; ++c) {
      const uint32_t* p = chunks[c].first;
      const int64_t words = chunks[c].second, full = words / LANES * LANES;
      for (int64_t w = 0; w < full; w += LANES) acc = acc.bit_or(V16::load(reinterpret_cast<const float*>(p + w)));
      for (int64_t w = full; w < words; ++w) tail |= p[w];
    }
    float lanes[LANES];
    acc.store(lanes);
    for (int64_t l = 0; l < LANES; ++l) tail |= __builtin_bit_cast(uint32_t, lanes[l]);
    seen[static_cast<size_t>(at::get_thread_num())] |= tail;
  });
  uint32_t all = 0;
  for (uint32_t v : seen) all |= v;
  return static_cast<int64_t>(all);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  check_linear(x, packed, n, bias);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  DISPATCH(x.scalar_type(), "linear", linear_impl<scalar>(x, packed, n, bias, out));
  return out;
}

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& visible, double scaling) {
  check_attention(query, key, value, visible);
  at::Tensor out = at::empty(query.sizes(), query.options());
  DISPATCH(query.scalar_type(), "attention", attention_impl<scalar>(query, key, value, visible, scaling, out));
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rms_norm(x, w);
  at::Tensor out = at::empty(x.sizes(), x.options());
  DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar>(x, w, eps, out));
  return out;
}

at::Tensor silu(const at::Tensor& x) {
  check_cpu(x, "x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  DISPATCH(x.scalar_type(), "silu", silu_impl<scalar>(x, out));
  return out;
}
