// The kernels of exact mode in terms of `V16`, compiled once per instruction-set variant.
//
// Each variant's file (`exact_<variant>.cpp`) includes this once, inside its own namespace and under its own
// `#pragma GCC target`, with one of LOSSLESS_V16_AVX512 / LOSSLESS_V16_AVX2 / neither (plain loops) defined and,
// for amx and avx512bf16, LOSSLESS_DPBF16 (the AVX-512 BF16 dot product; amx adds LOSSLESS_AMX, its tiles). Nothing here may depend on the variant but
// how many lanes one instruction advances: every function keeps the invariant stated at the top of
// `exact_kernels.cpp` (one fixed chain of correctly rounded IEEE operations per output), and every entry point
// runs its work under `FlushDenormals` in the thread that does it.

using namespace exact_shared;  // exact_common.h: the denormal rule, the barrier, the argument checks
#include "exact_api.h"  // the entry points' declarations and the layer stack's struct

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
  V16 add(V16 a) const { return {_mm512_add_ps(v, a.v)}; }
  V16 sub(V16 a) const { return {_mm512_sub_ps(v, a.v)}; }
  V16 mul(V16 a) const { return {_mm512_mul_ps(v, a.v)}; }
  V16 div(V16 a) const { return {_mm512_div_ps(v, a.v)}; }
  static V16 above(V16 x, V16 limit, V16 a, V16 b) { return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, limit.v, _CMP_GT_OQ), b.v, a.v)}; }
  static V16 if_nan(V16 x, V16 a, V16 b) { return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q), b.v, a.v)}; }
  static bool within(V16 x, float lo, float hi) {
    return (_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(lo), _CMP_GE_OQ) & _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(hi), _CMP_LE_OQ)) == 0xFFFF;
  }
  static bool any_past(V16 x, float limit) { return _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(limit), _CMP_NLE_UQ) != 0; }
  V16 pow2() const {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(v), _mm512_set1_epi32(127)), 23))};
  }
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
  V16 add(V16 a) const { return {_mm256_add_ps(lo, a.lo), _mm256_add_ps(hi, a.hi)}; }
  V16 sub(V16 a) const { return {_mm256_sub_ps(lo, a.lo), _mm256_sub_ps(hi, a.hi)}; }
  V16 mul(V16 a) const { return {_mm256_mul_ps(lo, a.lo), _mm256_mul_ps(hi, a.hi)}; }
  V16 div(V16 a) const { return {_mm256_div_ps(lo, a.lo), _mm256_div_ps(hi, a.hi)}; }
  static V16 above(V16 x, V16 limit, V16 a, V16 b) {
    return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, limit.lo, _CMP_GT_OQ)),
            _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, limit.hi, _CMP_GT_OQ))};
  }
  static V16 if_nan(V16 x, V16 a, V16 b) {
    return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q)),
            _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q))};
  }
  static bool within(V16 x, float lo, float hi) {
    const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
    const __m256 in = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(x.lo, l, _CMP_GE_OQ), _mm256_cmp_ps(x.lo, h, _CMP_LE_OQ)),
                                    _mm256_and_ps(_mm256_cmp_ps(x.hi, l, _CMP_GE_OQ), _mm256_cmp_ps(x.hi, h, _CMP_LE_OQ)));
    return _mm256_movemask_ps(in) == 0xFF;
  }
  static bool any_past(V16 x, float limit) {
    const __m256 l = _mm256_set1_ps(limit);
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x.lo, l, _CMP_NLE_UQ), _mm256_cmp_ps(x.hi, l, _CMP_NLE_UQ))) != 0;
  }
  static __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  V16 pow2() const { return {pow2_8(lo), pow2_8(hi)}; }
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
  V16 add(V16 a) const { V16 r; for (int l = 0; l < LANES; ++l) r.v[l] = v[l] + a.v[l]; return r; }
  V16 sub(V16 a) const { V16 r; for (int l = 0; l < LANES; ++l) r.v[l] = v[l] - a.v[l]; return r; }
  V16 mul(V16 a) const { V16 r; for (int l = 0; l < LANES; ++l) r.v[l] = v[l] * a.v[l]; return r; }
  V16 div(V16 a) const { V16 r; for (int l = 0; l < LANES; ++l) r.v[l] = v[l] / a.v[l]; return r; }
  static V16 above(V16 x, V16 limit, V16 a, V16 b) {
    V16 r;
    for (int l = 0; l < LANES; ++l) r.v[l] = x.v[l] > limit.v[l] ? a.v[l] : b.v[l];
    return r;
  }
  static V16 if_nan(V16 x, V16 a, V16 b) {
    V16 r;
    for (int l = 0; l < LANES; ++l) r.v[l] = x.v[l] != x.v[l] ? a.v[l] : b.v[l];
    return r;
  }
  static bool within(V16 x, float lo, float hi) {
    bool in = true;
    for (int l = 0; l < LANES; ++l) in = in && x.v[l] >= lo && x.v[l] <= hi;
    return in;
  }
  static bool any_past(V16 x, float limit) {
    bool past = false;
    for (int l = 0; l < LANES; ++l) past = past || !(x.v[l] <= limit);
    return past;
  }
  V16 pow2() const {
    V16 r;
    for (int l = 0; l < LANES; ++l) r.v[l] = __builtin_bit_cast(float, (static_cast<int32_t>(v[l]) + 127) << 23);
    return r;
  }
  void store(float* p) const { for (int l = 0; l < LANES; ++l) p[l] = v[l]; }
#endif
  // Pairs: 16 lanes of two bf16 packed in a uint32 (see the linear layer), this + the high products, then + the
  // low ones, each an fma (a bf16 x bf16 product is exact in fp32): what the AVX-512 BF16 dot-product instruction
  // computes lane by lane under the denormal rule (inputs read as zero when subnormal, results flushed), so this
  // and two widened fmas (`split_pairs`) give the same bits.
#if defined(LOSSLESS_DPBF16)
  V16 dot_pairs(uint32_t xpair, __m512i wpairs) const {
    return {_mm512_dpbf16_ps(v, (__m512bh)_mm512_set1_epi32(static_cast<int>(xpair)), (__m512bh)wpairs)};
  }
#endif
  // 16 lanes of pairs widened exactly to fp32: the high halves and the low halves
  static void split_pairs(const uint32_t* p, V16& high, V16& low) {
#if defined(LOSSLESS_V16_AVX512)
    const __m512i v = _mm512_loadu_si512(p);
    high = {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
    low = {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
#elif defined(LOSSLESS_V16_AVX2)
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8));
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    high = {_mm256_castsi256_ps(_mm256_and_si256(a, mask)), _mm256_castsi256_ps(_mm256_and_si256(b, mask))};
    low = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
#else
    for (int64_t l = 0; l < LANES; ++l) {
      high.v[l] = __builtin_bit_cast(float, p[l] & 0xFFFF0000u);
      low.v[l] = __builtin_bit_cast(float, p[l] << 16);
    }
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
  // (above) add, sub, mul, div: lane-wise, correctly rounded; above(x, limit, a, b): x > limit ? a : b (a NaN is
  // not above); if_nan(x, a, b): x != x ? a : b; within(x, lo, hi): every lane lo <= x <= hi (a NaN is not);
  // pow2: 2^n of lanes holding whole numbers n, -126 <= n <= 127
  // any_past(x, limit): some lane is above limit or a NaN
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

// exp_fixed of 16 lanes: the same operations in the same order, so the same bits lane by lane
// (where every lane lies in [lo, hi], the clamps and selects keep x and y: the same operations without them)
inline V16 exp_fixed(V16 x) {
  const V16 hi = V16::splat(88.0f), lo = V16::splat(-87.0f), zero = V16::zero();
  const bool inside = V16::within(x, -87.0f, 88.0f);
  V16 xc = x;
  if (!inside) xc = V16::if_nan(x, zero, V16::above(x, hi, hi, V16::above(lo, x, lo, x)));
  const V16 round = V16::splat(12582912.0f);
  const V16 n = xc.mul(V16::splat(1.44269504088896341f)).add(round).sub(round);
  const V16 minus_n = V16::splat(-1.0f).mul(n);  // exactly -n, the sign of a zero included
  V16 r = xc.fma(minus_n, V16::splat(0.693145751953125f));
  r = r.fma(minus_n, V16::splat(1.42860682030941723212e-6f));
  V16 p = V16::splat(1.98412698412698413e-4f);
  p = V16::splat(1.38888888888888889e-3f).fma(p, r);
  p = V16::splat(8.33333333333333333e-3f).fma(p, r);
  p = V16::splat(4.16666666666666667e-2f).fma(p, r);
  p = V16::splat(1.66666666666666667e-1f).fma(p, r);
  p = V16::splat(0.5f).fma(p, r);
  p = V16::splat(1.0f).fma(p, r);
  p = V16::splat(1.0f).fma(p, r);
  const V16 y = p.mul(n.pow2());
  if (inside) return y;
  return V16::if_nan(x, x, V16::above(x, hi, V16::splat(INFINITY), V16::above(lo, x, zero, y)));
}

// The linear layer. Weights are packed once (`pack_weight` in kernels.py) into panels of 16 outputs, panel p
// holding outputs 16p..16p+15 side by side, step by step: fp32 and fp16 one input a step, [panels, k, 16]; bf16
// two inputs a step as 32-bit pairs, [panels, kp / 2, 16], kp = k rounded up to a multiple of 32 (zeros past k).
//
// fp32 and fp16: output o of row r is one fma chain over its inputs in order:
//   acc = 0; for i in 0..k-1: acc = fma(x[r][i], w[o][i], acc)
// bf16: the order AMX's tile dot product (TDPBF16PS) computes, which every variant computes bit for bit. Per
// chunk of 32 inputs (32c .. 32c + 31), two fp32 chains from +0: e over the chunk's even inputs in order, o over
// its odd ones (e = fma(x[r][i], w[o][i], e) for i = 32c, 32c + 2, ..; o from 32c + 1), then
//   acc = acc + (e + o)          (acc from +0, two roundings; one chunk after another)
// A pair step holds two inputs of one parity: step 2q + p (q counts groups of four inputs) holds inputs 4q + p in
// its high half and 4q + 2 + p in its low half, the high one the first fma, as the AVX-512 BF16 dot product takes
// a pair. So e is a chunk's even steps one after another and o its odd ones, one dot product or two widened fmas
// a step; the AMX variant gives its tiles the inputs in their own order (each step's pairs taken apart again).
// A chain is never split or reassociated, whatever the blocking below does; blocks of rows x panels only decide
// which chains advance together (so weights are read once per block of rows).
//
// A call's rows go through the panels in blocks of at most RB rows (bf16 widened RW, fp32/fp16 RF), as even as
// possible (9 rows as 5 + 4, not 4 + 4 + 1: a block of one row is as slow as streaming the weights); every block
// after the first reads the panels from cache. Each weight vector is loaded once per step for all rows of a block.
constexpr int64_t CHUNK_STEPS = 16;  // bf16 pair steps per chunk of 32 inputs
// chain steps per output over k inputs: bf16 pairs, k padded to whole chunks of 32, else k
inline int64_t chain_steps(int64_t k, bool paired) { return paired ? (k + 31) / 32 * CHUNK_STEPS : k; }
// elements of a packed weight of `panels` panels whose chains take `steps` steps (a bf16 step holds a pair)
inline int64_t packed_elements(int64_t panels, int64_t steps, bool paired) {
  return panels * steps * LANES * (paired ? 2 : 1);
}
constexpr int RI = 14;  // tall blocks through one panel of up to 14 rows run e and o side by side: 14 x (e, o) = 28
                        // registers + 1 weight vector + 1 broadcast (30 of 32, no spills)
#if defined(LOSSLESS_DPBF16)
constexpr int RB = 4, JB = 2;  // bf16 dot products: 8 x (e, o, sum) = 24 registers + 2 weight vectors + 1 broadcast
constexpr int RT = 28;         // 15 to 28 rows, too many for that, run a chunk's e chains (its even steps) and then
                               // its o chains, one register a row (28 + 2): one pass over the weights for up to 28
                               // rows (a 16-row verify is one block, not two), the sums and the e in memory. More
                               // rows than that go in blocks of up to RI (32 rows as 2 x 16: 1.12x the time of 3 x 11
                               // on Zen 5, where the blocks after the first compute from cache)
// the most rows of a tall block in a call of m rows
inline int64_t tall_most(int64_t m) { return m <= RT ? RT : RI; }
#endif
#if defined(LOSSLESS_V16_AVX512)
constexpr int RF = 4, JF = 4;  // fp32/fp16: 16 accumulators + 4 weight vectors + 1 broadcast
constexpr int RW = 4, JW = 2;  // bf16 widened: 8 x (e, o, sum) = 24 registers + 4 widened weight vectors + 2 broadcasts
constexpr int JS = 2;          // calls of at most 2 rows (a decode step): 2 x 2 x (e, o, sum) + 4 widened weight vectors
#else
constexpr int RF = 4, JF = 2;  // AVX2: 16 registers, two per V16
constexpr int RW = 2, JW = 1;  // 2 x (e, o, sum): 12 registers + 2 widened weight vectors (4)
constexpr int JS = 1;
#endif

template <typename T> constexpr bool PAIRED = std::is_same_v<T, at::BFloat16>;

// bf16 products either by the dot-product instruction (the variants that have it) or as two fp32 fmas from
// weights widened once per step (exact: a bf16 is an fp32 with a shorter mantissa): the same bits. Where the
// instruction has a quarter of the fma's throughput (measured so on Intel Xeons with AMX; on AMD Zen 4 it has the
// same), the widened path computes a block of rows twice as fast. Without the instruction it is the only path.
#if defined(LOSSLESS_DPBF16)
inline bool& widen_bf16() { static bool on = false; return on; }
#else
inline bool& widen_bf16() { static bool on = true; return on; }
#endif

#if defined(LOSSLESS_AMX)
// AMX tiles take bf16 calls of at least this many rows (fewer: the dot-product path, faster there); measured by
// `choose_bf16_path`, settable for tests (`set_amx_rows`)
inline int64_t& amx_rows() { static int64_t rows = 2; return rows; }
#endif

#if defined(LOSSLESS_DPBF16)
// Seconds for `rounds` x 24 independent chains of the dot-product instruction (dot) or of fp32 fmas (!dot): the
// throughput the two paths are built from, on this core.
inline double chain_seconds(bool dot, int64_t rounds) {
  __m512 acc[24];
  for (int a = 0; a < 24; ++a) acc[a] = _mm512_set1_ps(1e-3f * static_cast<float>(a));
  __m512 w = _mm512_set1_ps(0.5f);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < rounds; ++n) {
#pragma GCC unroll 24
    for (int a = 0; a < 24; ++a)
      acc[a] = dot ? _mm512_dpbf16_ps(acc[a], (__m512bh)_mm512_castps_si512(w), (__m512bh)_mm512_castps_si512(w))
                   : _mm512_fmadd_ps(acc[a], w, w);
    __asm__ __volatile__("" : "+v"(w));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink = 0.0f;
  for (int a = 0; a < 24; ++a) sink += _mm512_cvtss_f32(acc[a]);
  __asm__ __volatile__("" : : "x"(sink));
  return seconds;
}

// the best of three chain_seconds of each kind: (dot products, fmas)
inline std::pair<double, double> best_chain_seconds(int64_t rounds) {
  double dot = 1e9, fma = 1e9;
  for (int t = 0; t < 3; ++t) {
    dot = std::min(dot, chain_seconds(true, rounds));
    fma = std::min(fma, chain_seconds(false, rounds));
  }
  return {dot, fma};
}
#endif

bool bf16_widened() { return widen_bf16(); }

inline bool& tall_blocks() { static bool on = true; return on; }

// Whether calls of more than RB bf16 rows run tall blocks (the variant with the dot-product instruction); returns
// the setting in force. Speed only: the same bits either way.
bool set_tall_blocks(bool on) {
#if defined(LOSSLESS_DPBF16)
  tall_blocks() = on;
  return tall_blocks();
#else
  (void)on;
  return false;
#endif
}

// Choose the widened path where there is a choice (the variant with the dot-product instruction); returns the
// path in force. Either gives the same bits: this is a matter of speed only.
bool set_widen_bf16(bool on) {
#if defined(LOSSLESS_DPBF16)
  widen_bf16() = on;
#else
  (void)on;
#endif
  return widen_bf16();
}

// the blocks of at most `most` rows that a call's m rows go through (see above), and the rows of block b, whose
// first row is r
inline int64_t row_blocks(int64_t m, int64_t most) { return (m + most - 1) / most; }
inline int64_t block_rows(int64_t m, int64_t r, int64_t blocks, int64_t b) { return (m - r) / (blocks - b); }

// x rows as the kernel reads them: fp32 [m, k]; bf16 pair steps as uint32 [m, stride] (or, for tall blocks, each
// block of rows chunk by chunk, [chunks, rows, 16]: a chunk's 16 steps of a row in one 64-byte line, the block's
// rows one after another, block after block) or (widened) each step's pair as fp32 (high, low) [m, kp / 2, 2], and
// for AMX tiles the rows in the inputs' own order, [16-row tiles, kp]
template <typename T>
struct Rows {
  std::vector<float> f;
  std::vector<uint32_t, LineAligned<uint32_t>> pairs;  // from a line's start (tall blocks' chunks are lines)
  std::vector<uint16_t> tiles;  // AMX: bf16 A tiles [ceil(m / 16), kp / 32, 16, 32], zeros past k and past m
  int64_t steps = 0;  // chain steps per output: k, or kp / 2 pairs
  // bf16 pairs row by row: words from one row's steps to the next; in calls of more than 4 rows `steps` padded to
  // an odd number of 64-byte lines, so the rows of a block read step i from as many different L1 sets (at a
  // multiple of 4 KB, as for k = 2,048, every row's line of a step would sit in one 8-way set and evict the others
  // at every step)
  int64_t stride = 0;
  // tall blocks (the dot-product variant, calls of more than RB rows) read a chunk's pairs of all their rows from
  // one pointer at fixed offsets (no address arithmetic per row in the loop, which the dot products' rate, two a
  // cycle on Zen 4, leaves no issue slots for) and only their own rows' lines; a line holds one row's pairs, so
  // threads filling different rows never write one line
  bool chunked = false;
  int64_t k = 0, rows = 0;
  bool widened = false, amx = false;
  Rows() = default;
  Rows(const T* x, int64_t m, int64_t k_, bool tiled = false) {
    resize(m, k_, tiled);
    for (int64_t r = 0; r < m; ++r) fill(x, r, 0, steps);
  }
  // tiled: the weights are in AMX's tile layout (`Weight::tiled`), which only the widened path and the tiles read
  void resize(int64_t m, int64_t k_, bool tiled = false) {
    k = k_;
    rows = m;
    if constexpr (PAIRED<T>) {
      steps = chain_steps(k, true);
      widened = tiled || widen_bf16();
#if defined(LOSSLESS_AMX)
      amx = m >= amx_rows();
      if (amx) tiles.assign(static_cast<size_t>((m + 15) / 16 * 16 * steps * 2), 0);
#endif
#if defined(LOSSLESS_DPBF16)
      chunked = !widened && m > RB && tall_blocks();
#endif
      // CHUNK_STEPS words are one line; calls of up to 4 rows (a decode step; blocks of at most 4 rows) need none
      stride = chunked ? steps : (m <= 4 || (steps / CHUNK_STEPS) % 2) ? steps : steps + CHUNK_STEPS;
      if (amx) return;  // a call on tiles reads the tiles alone
      if (widened) f.resize(static_cast<size_t>(m * steps * 2));
      else pairs.resize(static_cast<size_t>(m * stride));
    } else {
      steps = k;
      f.resize(static_cast<size_t>(m * k));
    }
  }
  // row r's tall block: its first row and its rows (a block of its own where x is row by row)
  std::pair<int64_t, int64_t> block_at(int64_t r) const {
#if defined(LOSSLESS_DPBF16)
    if (chunked) {
      const int64_t blocks = row_blocks(rows, tall_most(rows));
      int64_t first = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n = block_rows(rows, first, blocks, b);
        if (r < first + n) return {first, n};
        first += n;
      }
    }
#endif
    return {r, 1};
  }
  // where row r's pair of step i lies, given its block (block_at): row by row, or chunk by chunk in its block
  int64_t pair_at(int64_t r, int64_t i, std::pair<int64_t, int64_t> block) const {
    if (!chunked) return r * stride + i;
    const auto [first, n] = block;
    return first * steps + ((i / CHUNK_STEPS) * n + r - first) * CHUNK_STEPS + i % CHUNK_STEPS;
  }
  // steps s0..s1-1 of row r from x [m, k] (an input past k is a zero)
  void fill(const T* x, int64_t r, int64_t s0, int64_t s1) {
    const T* xr = x + r * k;
    if constexpr (PAIRED<T>) {
      if (amx) return fill_tiles(xr, r, s0, s1);
      const auto block = block_at(r);
      int64_t i = s0;
#if defined(LOSSLESS_V16_AVX512)
      if (!widened) {
        // whole chunks (16 steps of 32 inputs, all below k; their pairs side by side in either layout) by one byte
        // shuffle: each group of four inputs 0, 1, 2, 3 becomes the words (2 low, 0 high), (3 low, 1 high), what
        // fill_pair writes
        const __m512i order = _mm512_set4_epi32(0x0B0A0F0E, 0x09080D0C, 0x03020706, 0x01000504);
        for (; i < s1 && i % CHUNK_STEPS; ++i) fill_pair(xr, r, i, block);
        for (; i + CHUNK_STEPS <= s1 && 2 * (i + CHUNK_STEPS) <= k; i += CHUNK_STEPS)
          _mm512_storeu_si512(pairs.data() + pair_at(r, i, block),
                              _mm512_shuffle_epi8(_mm512_loadu_si512(xr + 2 * i), order));
      }
#endif
      for (; i < s1; ++i) fill_pair(xr, r, i, block);
    } else {
      for (int64_t i = s0; i < s1; ++i) f[r * k + i] = to_float(xr[i]);
    }
  }
  // AMX tiles: input j of row r, the A tiles one after another (`tiles`)
  int64_t tile_at(int64_t r, int64_t j) const { return (((r >> 4) * (steps >> 4) + (j >> 5)) * 16 + (r & 15)) * 32 + (j & 31); }
  // steps s0..s1-1 of row r as the inputs they hold, in the inputs' own order (steps 2q and 2q + 1 hold inputs
  // 4q..4q + 3: whole pairs of steps are copies of up to a chunk; the tiles past k stay zeros)
  void fill_tiles(const T* xr, int64_t r, int64_t s0, int64_t s1) {
    const auto one = [&](int64_t i) {
      const int64_t first = (i >> 1) * 4 + (i & 1);
      for (const int64_t j : {first, first + 2}) tiles[tile_at(r, j)] = j < k ? xr[j].x : 0;
    };
    int64_t i = s0;
    if (i < s1 && (i & 1)) one(i++);
    const int64_t whole = std::max(i, s1 & ~int64_t{1});
    for (int64_t j = 2 * i, j1 = std::min(2 * whole, k); j < j1;) {
      const int64_t n = std::min(j1, (j | 31) + 1) - j;  // to the chunk's end
      std::memcpy(tiles.data() + tile_at(r, j), xr + j, static_cast<size_t>(n) * sizeof(uint16_t));
      j += n;
    }
    for (i = whole; i < s1; ++i) one(i);
  }
  // pair step i of row r from xr, its row of x (an input past k is a zero), in the layouts this call's rows keep
  void fill_pair(const T* xr, int64_t r, int64_t i, std::pair<int64_t, int64_t> block) {
    const int64_t first = (i >> 1) * 4 + (i & 1), second = first + 2;  // the high input, then the low one
    const uint16_t hi = first < k ? xr[first].x : 0, lo = second < k ? xr[second].x : 0;
    if (widened) {
      f[(r * steps + i) * 2] = __builtin_bit_cast(float, static_cast<uint32_t>(hi) << 16);
      f[(r * steps + i) * 2 + 1] = __builtin_bit_cast(float, static_cast<uint32_t>(lo) << 16);
    } else {
      pairs[pair_at(r, i, block)] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
  }
  // the flat steps s0..s1-1 of rows one after another (row r's steps are r * steps ..)
  void fill_flat(const T* x, int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1;) {
      const int64_t r = s / steps, e = std::min(s1, (r + 1) * steps);
      fill(x, r, s - r * steps, e - r * steps);
      s = e;
    }
  }
};

// one packed weight of a call: its panels, outputs, where they go and its bias (or null); `sums` (fp32 [m, n])
// instead of `out` takes the product-sums themselves, started from `init` (fp32 [m, n]) instead of +0 where given
template <typename T>
struct Weight {
  const T* packed;
  int64_t n, panels;
  T* out;
  const T* bias;
  float* sums = nullptr;
  const float* init = nullptr;
  bool tiled = false;  // bf16 in AMX's tile layout (`tile_layout`), else pair steps
};

// the 16 sums of one row and panel a chain starts from: +0, or the weight's `init` (lanes past n: +0)
template <typename T>
inline V16 start_sum(const Weight<T>& w, int64_t row, int64_t panel) {
  return w.init ? V16::load_padded(w.init + row * w.n, panel * LANES, w.n) : V16::zero();
}

// 16 sums rounded to T (from_float's rule, lane-wise) into out[0..15]: AVX-512 rounds bf16 and fp32 in
// registers with from_float's own integer rule (round to nearest even on the bits, NaN to the canonical NaN),
// the other variants and fp16 lane by lane through from_float
template <typename T>
inline void store_rounded(V16 s, T* out) {
#if defined(LOSSLESS_V16_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(s.v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(s.v, s.v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, V16::if_nan(s, V16::splat(CANONICAL_NAN), s).v);
    return;
  }
#endif
  alignas(64) float buf[LANES];
  s.store(buf);
  for (int64_t l = 0; l < LANES; ++l) out[l] = from_float<T>(buf[l]);
}

// 16 lanes rounded to T and read back as floats: to_float(from_float<T>(lane)), lane-wise
template <typename T>
inline V16 rounded_lanes(V16 s) {
  if constexpr (std::is_same_v<T, float>) return V16::if_nan(s, V16::splat(CANONICAL_NAN), s);
#if defined(LOSSLESS_V16_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    alignas(32) T buf[LANES];
    store_rounded<T>(s, buf);
    return V16::load(buf);
  }
#endif
  alignas(64) float buf[LANES];
  s.store(buf);
  for (int64_t l = 0; l < LANES; ++l) buf[l] = to_float(from_float<T>(buf[l]));
  return V16::load(buf);
}

// out[i] = from_float<T>(to_float(a[i]) OP to_float(b[i])) for i < n, 16 lanes at a time (the same operation
// lane by lane, so the same bits): OP is + (ADD) or *
template <bool ADD, typename T>
inline void combine_rounded(const T* a, const T* b, int64_t n, T* out) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const V16 x = V16::load(a + i), y = V16::load(b + i);
    store_rounded<T>(ADD ? x.add(y) : x.mul(y), out + i);
  }
  for (; i < n; ++i) out[i] = from_float<T>(ADD ? to_float(a[i]) + to_float(b[i]) : to_float(a[i]) * to_float(b[i]));
}

// the 16 sums of one row and panel to the outputs that exist: + bias, rounded to T (or as they are to `sums`)
template <typename T>
inline void store_sum(const Weight<T>& w, int64_t row, int64_t panel, const float* sum) {
  if ((panel + 1) * LANES <= w.n) {  // a whole panel: the same additions and roundings, 16 lanes at once
    const int64_t o = row * w.n + panel * LANES;
    if (w.sums) return V16::load(sum).store(w.sums + o);
    return store_rounded<T>(w.bias ? V16::load(sum).add(V16::load(w.bias + panel * LANES)) : V16::load(sum), w.out + o);
  }
  for (int64_t l = 0; l < LANES; ++l) {
    const int64_t o = panel * LANES + l;
    if (o >= w.n) break;
    if (w.sums) w.sums[row * w.n + o] = sum[l];
    else w.out[row * w.n + o] = from_float<T>(w.bias ? sum[l] + to_float(w.bias[o]) : sum[l]);
  }
}

// steps ahead of the one computing that a block asks the cache for (one 64-byte line per panel and step): the
// hardware's prefetcher alone leaves a block of many rows waiting on memory
#ifndef LOSSLESS_PREFETCH
#define LOSSLESS_PREFETCH 32  // about 2 KB ahead at 64 bytes a step
#endif
constexpr int64_t PREFETCH = LOSSLESS_PREFETCH;

// Ask for the weights a block will read: blocks of up to RB rows (each weight vector feeds RB x J products)
// PREFETCH steps ahead in their own panels, into L1; tall blocks (one panel, the dot-product variant) the next
// panel's line at this step, into L2, so the memory streams while a block that reads from cache computes and the
// next block finds its panel there (the B blocks of rows reading a panel share that out: block b asks for the
// lines b, b + B, b + 2B, .., so the requests come at an even rate over all the blocks instead of queueing
// behind the first, which then waits on memory). (A prefetch past the weights' end is harmless: it never faults.)
template <int J, bool TALL>
inline void prefetch_panels(const uint32_t* w, int64_t steps) {
  if constexpr (TALL) {
    __builtin_prefetch(w + steps * LANES, 0, 2);
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) __builtin_prefetch(w + (j * steps + PREFETCH) * LANES, 0, 3);
  }
}

// fp32 and fp16: R rows x J panels, each output one chain over the inputs
template <int R, int J, typename T>
inline void panel_block(const Rows<T>& x, int64_t r0, const Weight<T>& wt, int64_t p0) {
  // every loop over r or j is unrolled, so the accumulators stay in registers
  const int64_t steps = x.steps;
  V16 acc[R][J];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[r][j] = start_sum(wt, r0 + r, p0 + j);
  for (int64_t i = 0; i < steps; ++i) {
    V16 w[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) w[j] = V16::load(wt.packed + ((p0 + j) * steps + i) * LANES);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V16 xb = V16::splat(x.f[(r0 + r) * steps + i]);
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) acc[r][j] = acc[r][j].fma(xb, w[j]);
    }
  }
  float buf[LANES];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) {
      acc[r][j].store(buf);
      store_sum(wt, r0 + r, p0 + j, buf);
    }
}

// bf16: pair step i of J panels (w: the first panel's steps, `stride` words from one panel to the next) for R rows
// into the chains acc: one dot product per pair, or (WIDE) the high then the low input's fma. Tall blocks' x
// (chunked) from xt: row r0's pair of step i, the next rows' CHUNK_STEPS words apart.
template <int R, int J, bool WIDE, bool TALL = false>
inline void pair_step(const Rows<at::BFloat16>& x, int64_t r0, const uint32_t* w, int64_t stride, int64_t i,
                      V16 (&acc)[R][J], const uint32_t* xt = nullptr) {
  if constexpr (WIDE) {
    V16 high[J], low[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) V16::split_pairs(w + j * stride + i * LANES, high[j], low[j]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* xp = x.f.data() + ((r0 + r) * x.steps + i) * 2;
      const V16 xh = V16::splat(xp[0]), xl = V16::splat(xp[1]);
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) acc[r][j] = acc[r][j].fma(xh, high[j]).fma(xl, low[j]);
    }
  } else {
#if defined(LOSSLESS_DPBF16)
    __m512i wv[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) wv[j] = _mm512_loadu_si512(w + j * stride + i * LANES);
    const uint32_t* xp = TALL ? xt : x.pairs.data() + r0 * x.stride + i;
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const uint32_t xr = xp[r * (TALL ? CHUNK_STEPS : x.stride)];
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) acc[r][j] = acc[r][j].dot_pairs(xr, wv[j]);
    }
#else
    TORCH_CHECK(false, "pair_step: no dot-product instruction in this variant");
#endif
  }
}

// bf16, weights in the tile layout (each chunk one B tile: row i holds inputs 2i low, 2i + 1 high): pair step i of
// the chains (ODD: o, else e) from the rows i & ~1 and (i & ~1) + 1 of the chunk, their high (ODD) or low halves, so
// the same inputs meet the same weights in the same order as from pair steps (step 2q: inputs 4q and 4q + 2 =
// rows 2q and 2q + 1, low; step 2q + 1: 4q + 1 and 4q + 3, high)
template <int R, int J, bool ODD>
inline void tile_pair_step(const Rows<at::BFloat16>& x, int64_t r0, const uint32_t* w, int64_t stride, int64_t i,
                           V16 (&acc)[R][J]) {
  V16 first[J], second[J];
#pragma GCC unroll 4
  for (int j = 0; j < J; ++j) {
    const uint32_t* row = w + j * stride + (i - (ODD ? 1 : 0)) * LANES;
    V16 high, low;
    V16::split_pairs(row, high, low);
    first[j] = ODD ? high : low;
    V16::split_pairs(row + LANES, high, low);
    second[j] = ODD ? high : low;
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const float* xp = x.f.data() + ((r0 + r) * x.steps + i) * 2;
    const V16 xh = V16::splat(xp[0]), xl = V16::splat(xp[1]);
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[r][j] = acc[r][j].fma(xh, first[j]).fma(xl, second[j]);
  }
}

// bf16: R rows x J panels in the AMX order: per chunk of 16 steps the chains e (even steps) and o (odd steps) from
// +0, a step of each in turn (the weights read in memory order), then sum = sum + (e + o). The sums stay in
// registers beside the chains in blocks of up to 8 outputs vectors (3 x 8 of 32 registers), else in memory. Tall
// blocks of more than RI rows run each chunk's e chains first and its o chains after (the same chains: a chain
// only ever waits on its own previous step), e kept in memory between.
constexpr int64_t TALL_AHEAD = 256;  // weight lines (16 KB) a tall block alone on its panels prefetches ahead, into L1
                                     // (into L2 the streams of 8 to 14 rows ran 5% slower on Zen 5)
template <int R, int J, int WIDE, bool TALL>
inline void pair_block(const Rows<at::BFloat16>& x, int64_t r0, const Weight<at::BFloat16>& wt, int64_t p0,
                       int64_t block = 0, int64_t blocks = 1) {
  constexpr bool HELD = R * J <= 8;
  const int64_t steps = x.steps, stride = steps * LANES;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(wt.packed) + p0 * stride;
  V16 sum[HELD ? R : 1][HELD ? J : 1];
  alignas(64) float sums[HELD ? 1 : R][HELD ? 1 : J][LANES];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) {
      if constexpr (HELD) sum[r][j] = start_sum(wt, r0 + r, p0 + j);
      else start_sum(wt, r0 + r, p0 + j).store(sums[r][j]);
    }
  int64_t ahead = block;  // the next step whose line of the next panel this block asks for (tall blocks)
  if constexpr (TALL && R > RI) {
    static_assert(J == 1 && !HELD, "pair_block: phased blocks are tall");
    alignas(64) float evens[R][LANES];
    for (int64_t c = 0; c < steps; c += CHUNK_STEPS) {
      const uint32_t* xt = x.pairs.data() + r0 * steps + c * R;  // the block's chunk (Rows::pair_at)
      for (; blocks > 1 && ahead < c + CHUNK_STEPS; ahead += blocks) prefetch_panels<J, TALL>(w + ahead * LANES, steps);
      for (int64_t p = 0; p < 2; ++p) {  // the e chains (even steps), then the o chains
        V16 a[R][1];
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) a[r][0] = V16::zero();
        for (int64_t i = c + p; i < c + CHUNK_STEPS; i += 2) {
          if (blocks == 1) __builtin_prefetch(w + (i + TALL_AHEAD) * LANES, 0, 3);
          pair_step<R, J, WIDE != 0, TALL>(x, r0, w, stride, i, a, xt + (i - c));
        }
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) {
          if (p == 0) a[r][0].store(evens[r]);
          else V16::load(sums[r][0]).add(V16::load(evens[r]).add(a[r][0])).store(sums[r][0]);
        }
      }
    }
  } else for (int64_t c = 0; c < steps; c += CHUNK_STEPS) {
    V16 e[R][J], o[R][J];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) e[r][j] = o[r][j] = V16::zero();
    const uint32_t* xt = TALL ? x.pairs.data() + r0 * steps + c * R : nullptr;  // the block's chunk (Rows::pair_at)
    for (int64_t i = c; i < c + CHUNK_STEPS; i += 2, xt += TALL ? 2 : 0) {
      if constexpr (TALL) {
        if (blocks == 1) {  // one block: the stream TALL_AHEAD lines on (into the next panel, which follows)
          __builtin_prefetch(w + (i + TALL_AHEAD) * LANES, 0, 3);
          __builtin_prefetch(w + (i + 1 + TALL_AHEAD) * LANES, 0, 3);
        } else {  // the next panel's lines shared out over the blocks of rows reading this one
          if (i == ahead) { prefetch_panels<J, TALL>(w + i * LANES, steps); ahead += blocks; }
          if (i + 1 == ahead) { prefetch_panels<J, TALL>(w + (i + 1) * LANES, steps); ahead += blocks; }
        }
      } else {
        prefetch_panels<J, TALL>(w + i * LANES, steps);
        prefetch_panels<J, TALL>(w + (i + 1) * LANES, steps);
      }
      if constexpr (WIDE == 2) {
        tile_pair_step<R, J, false>(x, r0, w, stride, i, e);
        tile_pair_step<R, J, true>(x, r0, w, stride, i + 1, o);
      } else {
        pair_step<R, J, WIDE != 0, TALL>(x, r0, w, stride, i, e, xt);
        pair_step<R, J, WIDE != 0, TALL>(x, r0, w, stride, i + 1, o, TALL ? xt + 1 : nullptr);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) {
        if constexpr (HELD) sum[r][j] = sum[r][j].add(e[r][j].add(o[r][j]));
        else V16::load(sums[r][j]).add(e[r][j].add(o[r][j])).store(sums[r][j]);
      }
  }
  alignas(64) float buf[LANES];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) {
      if constexpr (HELD) {
        sum[r][j].store(buf);
        store_sum(wt, r0 + r, p0 + j, buf);
      } else {
        store_sum(wt, r0 + r, p0 + j, sums[r][j]);
      }
    }
}

// the block of `rows` (1..R) rows from row r through panels p..p+J-1: fp32/fp16 panel_block, bf16 pair_block
template <int R, int J, int WIDE, bool TALL, typename T>
inline void block_of(int rows, const Rows<T>& x, int64_t r, const Weight<T>& wt, int64_t p, int64_t block,
                     int64_t blocks) {
  if (rows == R) {
    if constexpr (PAIRED<T>) pair_block<R, J, WIDE, TALL>(x, r, wt, p, block, blocks);
    else panel_block<R, J>(x, r, wt, p);
    return;
  }
  if constexpr (R > 1) return block_of<R - 1, J, WIDE, TALL>(rows, x, r, wt, p, block, blocks);
  TORCH_CHECK(false, "linear: a block of ", rows, " rows");
}

// panels p..p+J-1 for all m rows, in blocks of at most R rows: every block reads these J panels while they sit in
// L2, so the weights leave memory once per call
template <int R, int J, int WIDE, bool TALL, typename T>
inline void panel_all_rows(const Rows<T>& x, int64_t m, const Weight<T>& wt, int64_t p) {
  const int64_t blocks = row_blocks(m, R);
  int64_t r = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rows = block_rows(m, r, blocks, b);  // the rows left, split evenly over the blocks left
    block_of<R, J, WIDE, TALL>(static_cast<int>(rows), x, r, wt, p, b, blocks);
    r += rows;
  }
}

// panels p0..p1-1 of one weight, J at a time (the last ones one by one), blocks of at most R rows
template <int R, int J, int WIDE, bool TALL, typename T>
inline void panels_by(const Rows<T>& x, int64_t m, const Weight<T>& wt, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + J <= p1; p += J) panel_all_rows<R, J, WIDE, TALL>(x, m, wt, p);
  for (; p < p1; ++p) panel_all_rows<R, 1, WIDE, TALL>(x, m, wt, p);
}

#if defined(LOSSLESS_AMX)
// ------------------------------------------------------------------------------------------- AMX tiles
// TDPBF16PS multiplies a tile of 16 rows x 32 bf16 inputs (A) by one of 16 input pairs x 16 outputs (B, pair i of
// output n at row i, lane n: inputs 2i low, 2i + 1 high) into 16 x 16 fp32 sums (C), one chunk of 32 inputs per
// instruction, in the order above. Tiles: C in tmm0..3 (four panels), A in tmm4, B in tmm5..7. The tile
// instructions are written as inline assembly that says which memory it reads and writes (the compiler's own
// macros do not, and GCC 12's `_tile_loadconfig` declares an 8-byte operand for the 64-byte configuration).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// The tiles' shapes for calls of m rows: an instruction's time grows with the rows of its A tile (on machine C 5.3
// ns at 16 rows, 3.9 at 9, 3.1 at 1), so the last row tile of a call of up to 32 rows holds only the rows left
// (m <= 16: C and A of m rows; 16 < m <= 32: the second row tile's C tiles 2, 3 and A tile 5 of m - 16 rows);
// more rows run whole 16-row tiles, the rows past m zeros. B tiles are always 16 pairs by 16 outputs.
inline int64_t tile_shape(int64_t m) { return m <= 32 ? m : 0; }
inline int64_t& tile_shape_now() { thread_local int64_t shape = -1; return shape; }  // -1: not configured
inline void amx_configure(int64_t shape = 0) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.bytes_per_row[t] = 64;
    cfg.rows[t] = 16;
  }
  if (shape > 0 && shape <= 16) {
    for (const int t : {0, 1, 2, 3, 4}) cfg.rows[t] = static_cast<uint8_t>(shape);
  } else if (shape > 16) {
    for (const int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(shape - 16);
  }
  __asm__ __volatile__("ldtilecfg %0" : : "m"(cfg) : "memory");
  tile_shape_now() = shape;
}
inline void amx_release() { __asm__ __volatile__("tilerelease" ::: "memory"); }
#define LOSSLESS_TILE_LOAD(t, base, stride) \
  __asm__ __volatile__("tileloadd (%0,%1,1), %%tmm" #t : : "r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define LOSSLESS_TILE_STORE(t, base, stride) \
  __asm__ __volatile__("tilestored %%tmm" #t ", (%0,%1,1)" : : "r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define LOSSLESS_TILE_ZERO(t) __asm__ __volatile__("tilezero %%tmm" #t ::: "memory")
#define LOSSLESS_TILE_DP(c, a, b) __asm__ __volatile__("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")

// One chunk's 16 pair steps of one panel (parity pairs, see above) as a B tile in the instruction's own order:
// row 2q = inputs (4q, 4q + 1) = (step 2q's high, step 2q + 1's high); row 2q + 1 = (4q + 2, 4q + 3) = the lows.
inline void b_tile(const uint32_t* steps, uint32_t* tile) {
  const __mmask32 high = 0xAAAAAAAAu;  // the high half of each 32-bit pair
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    const __m512i even = _mm512_loadu_si512(steps + 2 * q * LANES), odd = _mm512_loadu_si512(steps + (2 * q + 1) * LANES);
    _mm512_store_si512(tile + 2 * q * LANES, _mm512_mask_blend_epi16(high, _mm512_srli_epi32(even, 16), odd));
    _mm512_store_si512(tile + (2 * q + 1) * LANES, _mm512_mask_blend_epi16(high, even, _mm512_slli_epi32(odd, 16)));
  }
}

// C tile t from the sums the chains start from (zeros, or the weight's init for rows r0.. of panel p)
template <int T>
inline void amx_start(const Weight<at::BFloat16>& wt, int64_t m, int64_t r0, int64_t p, float* buf) {
  if (!wt.init) {
    if constexpr (T == 0) LOSSLESS_TILE_ZERO(0);
    if constexpr (T == 1) LOSSLESS_TILE_ZERO(1);
    if constexpr (T == 2) LOSSLESS_TILE_ZERO(2);
    if constexpr (T == 3) LOSSLESS_TILE_ZERO(3);
    return;
  }
  for (int64_t r = 0; r < 16; ++r)
    (r0 + r < m ? start_sum(wt, r0 + r, p) : V16::zero()).store(buf + r * LANES);
  if constexpr (T == 0) LOSSLESS_TILE_LOAD(0, buf, 64);
  if constexpr (T == 1) LOSSLESS_TILE_LOAD(1, buf, 64);
  if constexpr (T == 2) LOSSLESS_TILE_LOAD(2, buf, 64);
  if constexpr (T == 3) LOSSLESS_TILE_LOAD(3, buf, 64);
}

template <int T>
inline void amx_finish(const Weight<at::BFloat16>& wt, int64_t m, int64_t r0, int64_t p, float* buf) {
  if constexpr (T == 0) LOSSLESS_TILE_STORE(0, buf, 64);
  if constexpr (T == 1) LOSSLESS_TILE_STORE(1, buf, 64);
  if constexpr (T == 2) LOSSLESS_TILE_STORE(2, buf, 64);
  if constexpr (T == 3) LOSSLESS_TILE_STORE(3, buf, 64);
  for (int64_t r = 0; r < 16 && r0 + r < m; ++r) store_sum(wt, r0 + r, p, buf + r * LANES);
}

// Tests on a CPU without AMX: the tile instructions written out (TDPBF16PS's order on the same tiles in memory),
// everything around them as on AMX (the tiles of x, the B tiles rebuilt, the starting sums, the stores)
inline bool& tile_emulation() { static bool on = false; return on; }

// This thread's tile configuration, held from the outermost holder to its end: a layer stack's linear step
// configures the tiles once for all the claims of panels it runs, instead of once a claim
struct TileHold {
  bool mine = false;
  explicit TileHold(bool want) {
    if (want && !tile_emulation() && !held()) {
      amx_configure();
      held() = mine = true;
    }
  }
  ~TileHold() {
    if (mine) {
      amx_release();
      held() = false;
      tile_shape_now() = -1;
    }
  }
  TileHold(const TileHold&) = delete;
  TileHold& operator=(const TileHold&) = delete;
  static bool& held() { thread_local bool on = false; return on; }
};

// J tiles of C (+=) A (16 rows of x from a, an A tile: 32 inputs a row) times the B tiles of chunk c of each panel
inline void emulated_dp(float (*c)[16][16], int J, const uint16_t* a, const uint32_t* bc,
                        int64_t panel_words) {
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < 16; ++r) {
      const uint16_t* ar = a + r * 32;
      for (int n = 0; n < 16; ++n) {
        float e = 0.0f, o = 0.0f;
        for (int i = 0; i < 16; ++i) {
          const uint32_t pair = bc[j * panel_words + i * LANES + n];
          e = std::fmaf(__builtin_bit_cast(float, static_cast<uint32_t>(ar[2 * i]) << 16),
                        __builtin_bit_cast(float, pair << 16), e);
          o = std::fmaf(__builtin_bit_cast(float, static_cast<uint32_t>(ar[2 * i + 1]) << 16),
                        __builtin_bit_cast(float, pair & 0xFFFF0000u), o);
        }
        c[j][r][n] = c[j][r][n] + (e + o);
      }
    }
}

// J (1..4) panels from p for all m rows, tiles written out (`tile_emulation`)
inline void amx_panels_emulated(const Rows<at::BFloat16>& x, int64_t m, const Weight<at::BFloat16>& wt, int64_t p,
                                int J, const uint32_t* bt, int64_t chunks) {
  const int64_t steps = x.steps, tile_words = CHUNK_STEPS * LANES;
  float c[4][16][16];
  for (int64_t r0 = 0; r0 < m; r0 += 16) {
    for (int j = 0; j < J; ++j)
      for (int64_t r = 0; r < 16; ++r)
        (wt.init && r0 + r < m ? start_sum(wt, r0 + r, p + j) : V16::zero()).store(c[j][r]);
    for (int64_t k = 0; k < chunks; ++k)
      emulated_dp(c, J, x.tiles.data() + x.tile_at(r0, 32 * k), bt + k * tile_words, chunks * tile_words);
    for (int j = 0; j < J; ++j)
      for (int64_t r = 0; r < 16 && r0 + r < m; ++r) store_sum(wt, r0 + r, p + j, c[j][r]);
  }
}

// J (1..4) panels from p for all m rows: their B tiles built once (or read in place), then the 16-row tiles of x
// through them: with J = 2, two row tiles at a time (four C tiles: each B tile loaded once for both), else one
template <int J>
inline void amx_panels(const Rows<at::BFloat16>& x, int64_t m, const Weight<at::BFloat16>& wt, int64_t p,
                       std::vector<uint32_t>& b, float* buf) {
  const int64_t steps = x.steps, chunks = steps / CHUNK_STEPS, tile_words = CHUNK_STEPS * LANES;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(wt.packed) + p * steps * LANES;
  const uint32_t* bt = w;  // the tile layout: each chunk of each panel a B tile already, in place
  if (!wt.tiled) {         // pair steps: the panels' B tiles built here, once per call
    b.resize(static_cast<size_t>(J * chunks * tile_words + LANES));
    uint32_t* built = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(b.data()) + 63) & ~uintptr_t(63));
    for (int j = 0; j < J; ++j)
      for (int64_t c = 0; c < chunks; ++c)
        b_tile(w + (j * steps + c * CHUNK_STEPS) * LANES, built + (j * chunks + c) * tile_words);
    bt = built;
  }
  if (tile_emulation()) return amx_panels_emulated(x, m, wt, p, J, bt, chunks);
  const int64_t a_tile = 16 * 32;  // bf16 from one A tile to the next (x's 16-row tiles chunk by chunk, 64 bytes a row)
  int64_t r0 = 0;
  if constexpr (J == 2) {  // two 16-row tiles at a time: each B tile loaded once for both
    for (; r0 + 16 < m; r0 += 32) {
      const uint16_t* a = x.tiles.data() + x.tile_at(r0, 0);
      amx_start<0>(wt, m, r0, p, buf);
      amx_start<1>(wt, m, r0, p + 1, buf);
      amx_start<2>(wt, m, r0 + 16, p, buf);
      amx_start<3>(wt, m, r0 + 16, p + 1, buf);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint32_t* bc = bt + c * tile_words;
        LOSSLESS_TILE_LOAD(4, a + c * a_tile, 64);
        LOSSLESS_TILE_LOAD(5, a + (chunks + c) * a_tile, 64);
        LOSSLESS_TILE_LOAD(6, bc, 64);
        LOSSLESS_TILE_DP(0, 4, 6);
        LOSSLESS_TILE_DP(2, 5, 6);
        LOSSLESS_TILE_LOAD(7, bc + chunks * tile_words, 64);
        LOSSLESS_TILE_DP(1, 4, 7);
        LOSSLESS_TILE_DP(3, 5, 7);
      }
      amx_finish<0>(wt, m, r0, p, buf);
      amx_finish<1>(wt, m, r0, p + 1, buf);
      amx_finish<2>(wt, m, r0 + 16, p, buf);
      amx_finish<3>(wt, m, r0 + 16, p + 1, buf);
    }
  }
  for (; r0 < m; r0 += 16) {
    const uint16_t* a = x.tiles.data() + x.tile_at(r0, 0);
    amx_start<0>(wt, m, r0, p, buf);
    if constexpr (J > 1) amx_start<1>(wt, m, r0, p + 1, buf);
    if constexpr (J > 2) amx_start<2>(wt, m, r0, p + 2, buf);
    if constexpr (J > 3) amx_start<3>(wt, m, r0, p + 3, buf);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* ac = a + c * a_tile;
      const uint32_t* bc = bt + c * tile_words;
      // B in tiles 6 and 7 (whole in every shape), then 5 (whole where J > 2: calls of at most 16 rows)
      LOSSLESS_TILE_LOAD(4, ac, 64);
      LOSSLESS_TILE_LOAD(6, bc, 64);
      LOSSLESS_TILE_DP(0, 4, 6);
      if constexpr (J > 1) { LOSSLESS_TILE_LOAD(7, bc + chunks * tile_words, 64); LOSSLESS_TILE_DP(1, 4, 7); }
      if constexpr (J > 2) { LOSSLESS_TILE_LOAD(5, bc + 2 * chunks * tile_words, 64); LOSSLESS_TILE_DP(2, 4, 5); }
      if constexpr (J > 3) { LOSSLESS_TILE_LOAD(6, bc + 3 * chunks * tile_words, 64); LOSSLESS_TILE_DP(3, 4, 6); }
    }
    amx_finish<0>(wt, m, r0, p, buf);
    if constexpr (J > 1) amx_finish<1>(wt, m, r0, p + 1, buf);
    if constexpr (J > 2) amx_finish<2>(wt, m, r0, p + 2, buf);
    if constexpr (J > 3) amx_finish<3>(wt, m, r0, p + 3, buf);
  }
}

// panels p0..p1-1 of one weight on AMX tiles, four at a time, in the thread that calls (its tile state is its own)
inline void amx_range(const Rows<at::BFloat16>& x, int64_t m, const Weight<at::BFloat16>& wt, int64_t p0, int64_t p1) {
  thread_local std::vector<uint32_t> b;
  alignas(64) float buf[16 * LANES];
  const TileHold hold(true);
  if (!tile_emulation() && tile_shape_now() != tile_shape(m)) amx_configure(tile_shape(m));
  int64_t p = p0;
  if (m > 16) {  // two panels at a time, two row tiles at a time (5% faster at 17 and 32 rows than one by one)
    for (; p + 2 <= p1; p += 2) amx_panels<2>(x, m, wt, p, b, buf);
  } else {
    for (; p + 4 <= p1; p += 4) amx_panels<4>(x, m, wt, p, b, buf);
  }
  for (; p < p1; ++p) amx_panels<1>(x, m, wt, p, b, buf);
}
#endif

// panels p0..p1-1 of one packed weight, for all rows
template <typename T>
inline void panel_range(const Rows<T>& x, int64_t m, const Weight<T>& wt, int64_t p0, int64_t p1) {
  if constexpr (PAIRED<T>) {
#if defined(LOSSLESS_AMX)
    if (x.amx) return amx_range(x, m, wt, p0, p1);
#endif
    if (x.widened && wt.tiled) {  // (tile-layout weights always come with widened rows: Rows::resize)
      if (m <= 2) return panels_by<2, JS, 2, false>(x, m, wt, p0, p1);
      return panels_by<RW, JW, 2, false>(x, m, wt, p0, p1);
    }
    if (x.widened) {
      if (m <= 2) return panels_by<2, JS, 1, false>(x, m, wt, p0, p1);
      return panels_by<RW, JW, 1, false>(x, m, wt, p0, p1);
    }
#if defined(LOSSLESS_DPBF16)
    if (m <= 2) return panels_by<2, 4, 0, false>(x, m, wt, p0, p1);
    if (x.chunked && m <= RT) return panels_by<RT, 1, 0, true>(x, m, wt, p0, p1);
    if (x.chunked) return panels_by<RI, 1, 0, true>(x, m, wt, p0, p1);
    return panels_by<RB, JB, 0, false>(x, m, wt, p0, p1);
#endif
  } else {
    panels_by<RF, JF, 0, false>(x, m, wt, p0, p1);
  }
}

// panels g0..g1-1 of the weights' panels counted one weight after another, for all m rows
template <typename T>
inline void linear_panels(const Rows<T>& rows, int64_t m, const std::vector<Weight<T>>& weights, int64_t g0,
                          int64_t g1) {
  int64_t first = 0;
  for (const Weight<T>& w : weights) {
    const int64_t p0 = std::max(g0, first) - first, p1 = std::min(g1, first + w.panels) - first;
    if (p0 < p1) panel_range(rows, m, w, p0, p1);
    first += w.panels;
  }
}

// x [m, k] through several packed weights (one call's q, k and v, or gate and up): one parallel region over all
// their panels, each output the chain a call of its own computes.
template <typename T>
void linear_impl(const at::Tensor& x, const std::vector<at::Tensor>& packed, std::vector<Weight<T>> weights) {
  const FlushDenormals flush;
  const int64_t m = x.size(0), k = x.size(1);
  bool tiled = false;
  for (const at::Tensor& p : packed) tiled = tiled || tile_layout(p);
  const Rows<T> rows(x.data_ptr<T>(), m, k, tiled);
  int64_t total = 0;
  for (size_t w = 0; w < packed.size(); ++w) {
    TORCH_CHECK(packed[w].numel() == packed_elements(packed[w].size(0), rows.steps, PAIRED<T>),
                "linear: the packed weight does not match x (pack it with kernels.pack_weight)");
    weights[w].packed = packed[w].data_ptr<T>();
    weights[w].panels = packed[w].size(0);
    weights[w].tiled = tile_layout(packed[w]);
    total += weights[w].panels;
  }
  at::parallel_for(0, total, 4, [&](int64_t g0, int64_t g1) {
    const FlushDenormals flush_here;  // the rule holds in the thread that does the work
    linear_panels(rows, m, weights, g0, g1);
  });
}

// B consecutive key tiles ([B, d, 16] floats) against G queries (heads sharing these keys; query g at q + g * d):
// 16 * B scores per query, each one fma chain over d. The G * B chains advance side by side and share each load.
template <int G, int B>
inline void score_tiles(const float* q, int64_t d, const float* tiles, float* out, int64_t stride) {
  V16 acc[G][B];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[g][b] = V16::zero();
  for (int64_t t = 0; t < d; ++t) {
    V16 k[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      k[b] = V16::load(tiles + (b * d + t) * LANES);
      __builtin_prefetch(tiles + ((B + b) * d + t) * LANES, 0, 3);  // the next call's tiles
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const V16 qt = V16::splat(q[g * d + t]);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[g][b] = acc[g][b].fma(qt, k[b]);
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[g][b].store(out + g * stride + b * LANES);
}

#if defined(LOSSLESS_V16_AVX512)
// 16 pairs of two-byte values (element 2t low, 2t + 1 high) widened exactly to fp32: the evens and the odds
template <typename T>
inline void widen_pairs(__m512i w, V16& even, V16& odd) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    even = {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
    odd = {_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  } else {
    even = {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(w))};
    odd = {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)))};
  }
}

// The same scores read from the cache's own rows of keys (keys [n, d] of one kv head, in T), 16 keys to a vector
// by gathers: B groups of 16 keys from key `first` (lanes past n read the last key; their scores go unused)
// against G queries, each score one fma chain over d in order, as from the tiles. bf16 and fp16 keys are gathered
// two inputs at a time and widened (exact).
template <int G, int B, typename T>
inline void score_keys(const float* q, int64_t d, const T* keys, int64_t n, int64_t first, float* out,
                       int64_t stride) {
  V16 acc[G][B];
  __m512i row[B];  // element offset of each lane's key
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i last = _mm512_set1_epi32(static_cast<int>(n - 1)), width = _mm512_set1_epi32(static_cast<int>(d));
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
    const __m512i key = _mm512_min_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(first + b * LANES))), last);
    row[b] = _mm512_mullo_epi32(key, width);
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[g][b] = V16::zero();
  int64_t t = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; t < d; ++t) {
      V16 k[B];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b)
        k[b] = {_mm512_i32gather_ps(_mm512_add_epi32(row[b], _mm512_set1_epi32(static_cast<int>(t))), keys, 4)};
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const V16 qt = V16::splat(q[g * d + t]);
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) acc[g][b] = acc[g][b].fma(qt, k[b]);
      }
    }
  } else {
    for (; t + 1 < d; t += 2) {
      V16 even[B], odd[B];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const __m512i w = _mm512_i32gather_epi32(_mm512_add_epi32(row[b], _mm512_set1_epi32(static_cast<int>(t))),
                                                 keys, 2);
        widen_pairs<T>(w, even[b], odd[b]);
      }
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const V16 qe = V16::splat(q[g * d + t]), qo = V16::splat(q[g * d + t + 1]);
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) acc[g][b] = acc[g][b].fma(qe, even[b]).fma(qo, odd[b]);
      }
    }
    if (t < d) {  // an odd head dim: the last input alone, lane by lane (a pair would read past the last key)
      V16 k[B];
      for (int b = 0; b < B; ++b) {
        float buf[LANES];
        for (int64_t l = 0; l < LANES; ++l) buf[l] = to_float(keys[std::min(first + b * LANES + l, n - 1) * d + t]);
        k[b] = V16::load(static_cast<const float*>(buf));
      }
      for (int g = 0; g < G; ++g) {
        const V16 qt = V16::splat(q[g * d + t]);
        for (int b = 0; b < B; ++b) acc[g][b] = acc[g][b].fma(qt, k[b]);
      }
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[g][b].store(out + g * stride + b * LANES);
}
#endif

#if defined(LOSSLESS_V16_AVX512)
// The same scores from the cache's key tiles of two-byte keys: B consecutive tiles [d / 2, 16] of uint32 pairs
// (key element 2t in the low half, 2t + 1 in the high half; d even), each widened exactly as score_keys widens
// its gathers, so the same chains and bits with plain loads.
template <int G, int B, typename T>
inline void score_pair_tiles(const float* q, int64_t d, const uint32_t* tiles, float* out, int64_t stride) {
  const int64_t steps = d / 2;
  V16 acc[G][B];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[g][b] = V16::zero();
  for (int64_t i = 0; i < steps; ++i) {
    V16 even[B], odd[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      const __m512i w = _mm512_loadu_si512(tiles + (b * steps + i) * LANES);
      __builtin_prefetch(tiles + ((B + b) * steps + i) * LANES, 0, 3);  // the next call's tiles: a page the hardware has not seen
      widen_pairs<T>(w, even[b], odd[b]);
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const V16 qe = V16::splat(q[g * d + 2 * i]), qo = V16::splat(q[g * d + 2 * i + 1]);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[g][b] = acc[g][b].fma(qe, even[b]).fma(qo, odd[b]);
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[g][b].store(out + g * stride + b * LANES);
}
#endif

#if defined(LOSSLESS_DPBF16)
// The same scores of bf16 keys on the dot-product instruction, which takes a pair's high half first: each key
// pair's halves swapped (element 2t high, 2t + 1 low) and each query's pairs made the same way beforehand
// (`pairs` [G, d / 2]: the queries are bf16 values widened, so their top halves are the bf16 ones), one
// instruction for the two fmas of a step, the same bits (see `dot_pairs`).
constexpr int64_t TILES_AHEAD = 6;  // key tiles the scores prefetch ahead of the ones they read (a memory's latency)
template <int G, int B>
inline void score_dot_tiles(const uint32_t* pairs, int64_t steps, const uint32_t* tiles, float* out,
                            int64_t stride) {
  V16 acc[G][B];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 6
    for (int b = 0; b < B; ++b) acc[g][b] = V16::zero();
  for (int64_t i = 0; i < steps; ++i) {
    __m512i swapped[B];
#pragma GCC unroll 6
    for (int b = 0; b < B; ++b) {
      swapped[b] = _mm512_rol_epi32(_mm512_loadu_si512(tiles + (b * steps + i) * LANES), 16);
      __builtin_prefetch(tiles + ((TILES_AHEAD + b) * steps + i) * LANES, 0, 3);  // tiles a later call reads
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 6
      for (int b = 0; b < B; ++b) acc[g][b] = acc[g][b].dot_pairs(pairs[g * steps + i], swapped[b]);
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 6
    for (int b = 0; b < B; ++b) acc[g][b].store(out + g * stride + b * LANES);
}
#endif

constexpr int64_t VALUES_AHEAD = 32;  // value rows a chain prefetches ahead of the one it reads
// C chunks of 16 head-dim lanes, t0 .. t0 + 16C, of G output rows (queries sharing these values: heads of one kv
// head, of one row or of several; query g's weights at scores + g * stride): for each lane, one fma chain over the
// weights j0 .. j1 - 1 in order (weight_j * v[key_j][t], key_j = keys[j], or j itself where keys is null), from zero
// or, resuming, from the chains' values in acc; the G * C chains advance side by side and share each load, never
// merged. `v` holds the values as rows of d, read where they lie in the cache (lanes past d read as zeros).
template <int G, int C, typename T>
inline void weighted_values(const float* scores, int64_t stride, const int32_t* keys, int64_t j0, int64_t j1,
                            const T* v, int64_t d, int64_t dp, int64_t t0, float* acc, bool resume) {
  V16 sum[G][C];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) sum[g][c] = resume ? V16::load(acc + g * dp + t0 + c * LANES) : V16::zero();
  const auto run = [&](auto whole) {  // whole: every chunk lies inside the row (no padded loads)
    for (int64_t j = j0; j < j1; ++j) {
      const T* vj = v + (keys != nullptr ? keys[j] : j) * d;
      if (keys == nullptr)  // rows in order: the row VALUES_AHEAD on (a stream the hardware loses at each page)
        for (int64_t e = 0; e < C * LANES; e += 64 / static_cast<int64_t>(sizeof(T)))
          __builtin_prefetch(vj + VALUES_AHEAD * d + t0 + e, 0, 3);
      V16 val[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        val[c] = decltype(whole)::value ? V16::load(vj + t0 + c * LANES) : V16::load_padded(vj, t0 + c * LANES, d);
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const V16 s = V16::splat(scores[g * stride + j]);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) sum[g][c] = sum[g][c].fma(s, val[c]);
      }
    }
  };
  if (t0 + C * LANES <= d) run(std::true_type{});
  else run(std::false_type{});
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) sum[g][c].store(acc + g * dp + t0 + c * LANES);
}

// every chunk of the head dim through `weighted_values`, C chunks at a time (acc: [G, dp]): with AVX-512 four
// (a head dim of 64 in one pass reads each value row whole, one stream), more than six rows in groups of six
// over each block of keys in turn (each chain still runs over the keys in order)
template <int G, typename T>
inline void weighted_value_rows(const float* scores, int64_t stride, const int32_t* keys, int64_t j0, int64_t j1,
                                const T* v, int64_t d, int64_t dp, float* acc, bool resume) {
#if defined(LOSSLESS_V16_AVX512)
  if constexpr (G > 6) {  // six rows and the rest, a block of keys at a time (the block's values read once)
    constexpr int64_t BLOCK = 64;
    int64_t jb = j0;
    do {  // at least once: no keys still sets the chains to zero (or keeps them, resuming)
      const int64_t je = std::min(j1, jb + BLOCK);
      const bool more = resume || jb > j0;
      weighted_value_rows<6>(scores, stride, keys, jb, je, v, d, dp, acc, more);
      weighted_value_rows<G - 6>(scores + 6 * stride, stride, keys, jb, je, v, d, dp, acc + 6 * dp, more);
      jb = je;
    } while (jb < j1);
    return;
  }
  constexpr int C = 4;
#else
  constexpr int C = G <= 2 ? 4 : 2;
#endif
  int64_t t = 0;
  for (; t + C * LANES <= dp; t += C * LANES) weighted_values<G, C>(scores, stride, keys, j0, j1, v, d, dp, t, acc, resume);
  for (; t < dp; t += LANES) weighted_values<G, 1>(scores, stride, keys, j0, j1, v, d, dp, t, acc, resume);
}

// how many of a row's visible keys (strictly increasing) are the cache's first ones, 0, 1, 2, ..
inline int64_t leading_keys(const std::vector<int32_t>& seen) {
  int64_t lo = 0, hi = static_cast<int64_t>(seen.size());  // seen[j] == j below lo, seen[j] > j from hi on
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (seen[mid] == mid) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

struct AttentionScratch {
  std::vector<float> all, scores, acc, qf;
  std::vector<uint32_t> pairs;  // the queries as pairs for the dot-product scores (`query_pairs`)
  std::vector<char> hit;  // the tiles an item's rows see keys in
  float total[16];
  explicit AttentionScratch(int64_t d) : qf(static_cast<size_t>(16 * d)) {}
};

// The attention of R rows for G heads of one kv head (queries qf [R * G, d] in fp32, row by row; seen: each row's
// visible keys): scores of every key up to the last one any row sees, all R * G queries sharing each key read; then
// per query the max, exp and sum over its row's visible keys; then the weighted values, each (query, lane) one
// chain in key order: over the keys every row sees first (0, 1, .., all R * G chains sharing each value read), then
// on over its own row's other keys. Out: s.acc [R * G, dp], s.total [R * G]. Which rows and heads share a call
// never changes a bit; nor does the order of the max (a set's maximum, only a zero's sign could differ, and x - 0
// and x + 0 round alike where exp reads them).
// The scores of Q queries (qf [Q, d], fp32) against the keys of tiles tile0 .. tile1 - 1 (16 keys each), into
// out + g * stride + key, B tiles at a time (which tiles share a call changes no bit: each score is its own chain):
// from the cache's key tiles (kc: fp32 [tile, d, 16] or pairs [tile, d / 2, 16]), else gathered from the keys' rows
// (kk [n, d]); without AVX-512 from fp32 tiles built for the call (kt).
#if defined(LOSSLESS_DPBF16)
constexpr int64_t MAX_STEPS = 128;  // the head dim's pairs the dot-product scores take at most
#endif
// whether score_range scores on the dot-product instruction (from the cache's bf16 key tiles), which takes the
// queries as pairs (`query_pairs`)
template <typename T>
inline bool dot_scores(const uint32_t* kc, int64_t d) {
#if defined(LOSSLESS_DPBF16)
  return std::is_same_v<T, at::BFloat16> && kc != nullptr && d % 2 == 0 && d / 2 <= MAX_STEPS && !widen_bf16();
#else
  (void)kc;
  (void)d;
  return false;
#endif
}

// the pairs of `count` queries (qf [count, d], fp32 widened from bf16) for the dot-product instruction, which
// takes a pair's high half first: element 2i in the high half, 2i + 1 in the low ([count, d / 2])
inline void query_pairs(const float* qf, int64_t count, int64_t d, uint32_t* pairs) {
  const int64_t steps = d / 2;
  for (int64_t g = 0; g < count; ++g)
    for (int64_t i = 0; i < steps; ++i)
      pairs[g * steps + i] = (__builtin_bit_cast(uint32_t, qf[g * d + 2 * i]) & 0xFFFF0000u) |
                             (__builtin_bit_cast(uint32_t, qf[g * d + 2 * i + 1]) >> 16);
}

template <int Q, typename T>
inline void score_range(const float* qf, int64_t d, const float* kt, const T* kk, int64_t n, const uint32_t* kc,
                        int64_t tile0, int64_t tile1, float* out, int64_t stride, const uint32_t* prepared = nullptr) {
  constexpr int B = Q <= 3 ? 4 : (Q <= 6 ? 3 : 2);  // Q * B accumulators within the 32 (AVX-512) registers
  int64_t tile = tile0;
  (void)prepared;
#if defined(LOSSLESS_V16_AVX512)
  (void)kt;
  if (kc != nullptr && std::is_same_v<T, float>) {  // the cache's own key tiles: fp32 [tile, d, 16]
    const float* ft = reinterpret_cast<const float*>(kc);
    for (; tile + B <= tile1; tile += B) score_tiles<Q, B>(qf, d, ft + tile * d * LANES, out + tile * LANES, stride);
    for (; tile < tile1; ++tile) score_tiles<Q, 1>(qf, d, ft + tile * d * LANES, out + tile * LANES, stride);
  } else if (kc != nullptr && d % 2 == 0) {  // pairs [tile, d / 2, 16]
    const int64_t steps = d / 2;
#if defined(LOSSLESS_DPBF16)
    if (dot_scores<T>(kc, d)) {
      constexpr int BD = Q <= 3 ? 6 : (Q <= 6 ? 4 : (Q <= 9 ? 3 : (Q <= 14 ? 2 : 1)));  // Q * BD + BD + 1 registers
      uint32_t own[Q * MAX_STEPS];
      const uint32_t* pairs = prepared;
      if (pairs == nullptr) {
        query_pairs(qf, Q, d, own);
        pairs = own;
      }
      for (; tile + BD <= tile1; tile += BD)
        score_dot_tiles<Q, BD>(pairs, steps, kc + tile * steps * LANES, out + tile * LANES, stride);
      for (; tile < tile1; ++tile) score_dot_tiles<Q, 1>(pairs, steps, kc + tile * steps * LANES, out + tile * LANES, stride);
      return;
    }
#endif
    for (; tile + B <= tile1; tile += B)
      score_pair_tiles<Q, B, T>(qf, d, kc + tile * steps * LANES, out + tile * LANES, stride);
    for (; tile < tile1; ++tile) score_pair_tiles<Q, 1, T>(qf, d, kc + tile * steps * LANES, out + tile * LANES, stride);
  } else {
    for (; tile + B <= tile1; tile += B) score_keys<Q, B>(qf, d, kk, n, tile * LANES, out + tile * LANES, stride);
    for (; tile < tile1; ++tile) score_keys<Q, 1>(qf, d, kk, n, tile * LANES, out + tile * LANES, stride);
  }
#else
  (void)kc;
  (void)kk;
  (void)n;
  for (; tile + B <= tile1; tile += B) score_tiles<Q, B>(qf, d, kt + tile * d * LANES, out + tile * LANES, stride);
  for (; tile < tile1; ++tile) score_tiles<Q, 1>(qf, d, kt + tile * d * LANES, out + tile * LANES, stride);
#endif
}

// the softmax's denominator: the sum of sp[0 .. m - 1], lane l of 16 adding keys l, l + 16, .. in order, then tree16
inline float total_of(const float* sp, int64_t m) {
  const int64_t full = m / LANES * LANES;
  float lanes[LANES] = {0};
  for (int64_t j = 0; j < full; j += LANES)
    for (int64_t l = 0; l < LANES; ++l) lanes[l] += sp[j + l];
  for (int64_t j = full; j < m; ++j) lanes[j - full] += sp[j];
  return tree16(lanes);
}

// exp(sp[j] - best) in place for j in j0 .. j1 - 1 (j0 a multiple of 16)
inline void exp_shifted(float* sp, int64_t j0, int64_t j1, float best) {
  const V16 top = V16::splat(best);
  int64_t j = j0;
  for (; j + LANES <= j1; j += LANES) exp_fixed(V16::load(sp + j).sub(top)).store(sp + j);
  for (; j < j1; ++j) sp[j] = exp_fixed(sp[j] - best);
}

// the largest of sp[j0 .. j1 - 1] (a NaN is never above; -inf where there is none), four running maxima of 16
// lanes: a set's maximum whichever order finds it (only a zero's sign could differ, which exp reads alike)
inline float largest(const float* sp, int64_t j0, int64_t j1) {
  V16 top[4] = {V16::splat(-INFINITY), V16::splat(-INFINITY), V16::splat(-INFINITY), V16::splat(-INFINITY)};
  int64_t j = j0;
  for (; j + 4 * LANES <= j1; j += 4 * LANES)
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a) {
      const V16 x = V16::load(sp + j + a * LANES);
      top[a] = V16::above(x, top[a], x, top[a]);
    }
  for (; j + LANES <= j1; j += LANES) {
    const V16 x = V16::load(sp + j);
    top[0] = V16::above(x, top[0], x, top[0]);
  }
  float most[4][LANES];
  for (int a = 0; a < 4; ++a) top[a].store(most[a]);
  float best = -INFINITY;
  for (int a = 0; a < 4; ++a)
    for (int64_t l = 0; l < LANES; ++l) best = most[a][l] > best ? most[a][l] : best;
  for (; j < j1; ++j) best = sp[j] > best ? sp[j] : best;
  return best;
}

// Marks in `hit` [tiles] the 16-key tiles holding a key some of the `count` rows sees (from the first `common`
// keys, which every row sees, on to each row's others); returns how many tiles are marked.
inline int64_t mark_tiles(const std::vector<int32_t>* const* seen, int64_t count, int64_t common,
                          std::vector<char>& hit) {
  const int64_t lead = (common + LANES - 1) / LANES;
  std::fill(hit.begin(), hit.end(), 0);
  std::fill(hit.begin(), hit.begin() + std::min<int64_t>(lead, static_cast<int64_t>(hit.size())), 1);
  for (int64_t r = 0; r < count; ++r)
    for (size_t j = static_cast<size_t>(common); j < seen[r]->size(); ++j) hit[(*seen[r])[j] / LANES] = 1;
  int64_t marked = 0;
  for (char c : hit) marked += c;
  return marked;
}

template <int R, int G, typename T>
inline void attend_rows(const float* qf, int64_t d, int64_t dp, const float* kt, const T* kk, int64_t n, const T* vk,
                        const std::vector<int32_t>* const* seen, float scale, AttentionScratch& s, const uint32_t* kc) {
  constexpr int Q = R * G;
  int64_t last = 0, common = INT64_MAX, widest = 0;
  for (int r = 0; r < R; ++r) {
    last = std::max<int64_t>(last, seen[r]->back());
    common = std::min(common, leading_keys(*seen[r]));
    widest = std::max<int64_t>(widest, static_cast<int64_t>(seen[r]->size()));
  }
  const int64_t used = last / LANES + 1, stride = used * LANES;
  std::vector<float>& all = s.all;
  all.resize(static_cast<size_t>(Q * stride));
  // only the tiles holding a key some row sees are scored (each score is its own chain, and the others' are never
  // read): a row of one sequence in a batch reads its own keys, not the whole shared cache
  s.hit.resize(static_cast<size_t>(used));
  if (mark_tiles(seen, R, common, s.hit) == used) {
    score_range<Q>(qf, d, kt, kk, n, kc, 0, used, all.data(), stride);
  } else {
    for (int64_t t0 = 0; t0 < used;) {
      if (!s.hit[t0]) {
        ++t0;
        continue;
      }
      int64_t t1 = t0;
      while (t1 < used && s.hit[t1]) ++t1;
      score_range<Q>(qf, d, kt, kk, n, kc, t0, t1, all.data(), stride);
      t0 = t1;
    }
  }
  s.scores.resize(static_cast<size_t>(Q * widest));
  for (int g = 0; g < Q; ++g) {
    const std::vector<int32_t>& sr = *seen[g / G];
    const int64_t m = static_cast<int64_t>(sr.size());
    float* sp = s.scores.data() + g * widest;
    const float* ap = all.data() + g * stride;
#pragma omp simd
    for (int64_t j = 0; j < common; ++j) sp[j] = ap[j] * scale;
    for (int64_t j = common; j < m; ++j) sp[j] = ap[sr[j]] * scale;
    exp_shifted(sp, 0, m, largest(sp, 0, m));
    s.total[g] = total_of(sp, m);
  }
  s.acc.resize(static_cast<size_t>(Q * dp));
  weighted_value_rows<Q>(s.scores.data(), widest, nullptr, 0, common, vk, d, dp, s.acc.data(), false);
  for (int r = 0; r < R; ++r) {
    const int64_t m = static_cast<int64_t>(seen[r]->size());
    if (m > common)
      weighted_value_rows<G>(s.scores.data() + r * G * widest, widest, seen[r]->data(), common, m, vk, d, dp,
                             s.acc.data() + r * G * dp, true);
  }
}

// One call's attention as work items (up to `rows_per` rows, one kv head, up to `per` of its query heads: they
// share each key and value read); one head per item only when there are fewer (row, kv head) pairs than threads,
// so every thread has work. Which rows and heads share an item never changes a bit: each output is its own chain.
template <typename T>
struct Attention {
  const T* qp;  // query [rows, h, d]
  const T* kp;  // keys of kv head j at kp + j * ks, rows of d
  const T* vp;
  T* op;  // out [rows, h, d]
  const float* kt;  // key tiles (without AVX-512), else null
  int64_t ks, vs, h, d, dp, kvh, groups, n, tiles, per, parts;
  float scale;
  const std::vector<std::vector<int32_t>>* keys;  // each row's visible keys, in cache order
  const uint32_t* kc = nullptr;  // the cache's key tiles (`KeyTiles`), kv head j at kc + j * kcs, else null
  int64_t kcs = 0;
  int64_t rows = 0, rows_per = 1;
  // split: each item's work spread over the threads in three passes (see `split_unit`), with `segs` segments of
  // keys, rows of `width` scores, the values by `qparts` parts of the queries and `chunks` chunks of 16 *
  // `lanes_c` head-dim lanes
  bool split = false;
  int64_t segs = 0, width = 0, qparts = 1, chunks = 1, lanes_c = 4;

  static constexpr int MOST_QUERIES = 9;  // rows x heads one item takes at most
  static constexpr int64_t SPLIT_KEYS = 1024;  // split from this many keys a row (below, the passes cost more)
  static constexpr int64_t SEGMENT = 512;  // keys a score unit takes (a multiple of 16)
  static constexpr int64_t SPLIT_ROWS = 17;  // the most rows a split takes (more: items, which share out evenly)
  static constexpr int64_t OWN_KEYS = 64;  // the most keys past its lead a row of a split sees

  Attention with_items(int64_t m, int threads) const {
    Attention a = *this;
    a.rows = m;
    a.per = m * kvh >= threads ? 4 : 1;
    a.parts = (groups + a.per - 1) / a.per;
    const int64_t heads = std::min(a.per, groups);
    // rows an item takes: the fewest for the busiest thread (the threads take items in contiguous shares; an
    // item costs a read of its keys and values, READ rows' worth, and its rows), the most rows on a tie
    constexpr int64_t READ = 2;
    int64_t least = INT64_MAX;
    for (int64_t r = 3; r >= 1; --r) {
      if (r > 1 && r * heads > MOST_QUERIES) continue;
      const int64_t per_block = kvh * a.parts, count = (m + r - 1) / r * per_block;
      int64_t busiest = 0;
      for (int t = 0; t < threads; ++t) {
        int64_t cost = 0;
        for (int64_t i = count * t / threads; i < count * (t + 1) / threads; ++i)
          cost += READ + std::min(r, m - i / per_block * r);
        busiest = std::max(busiest, cost);
      }
      if (busiest < least) {
        least = busiest;
        a.rows_per = r;
      }
    }
    return a.with_split(threads);
  }

  // Where every row sees the cache's first 1,024 keys or more, 0, 1, .. (a decode step, or a chain or tree of up
  // to 17 rows over a long context, each row seeing a few keys of its own past those), items would leave threads
  // idle or read each kv head's keys and values once per block of rows. Each item (all the rows, one kv head, up
  // to four of its heads) is spread over the threads instead, in three passes: scores and their maxima by
  // segments of keys; exp by the same segments; weighted values by parts of the item's queries and chunks of the
  // head dim. Every output is the same chain of the same operations as in `attend_rows` (the maximum of a set is
  // the same whichever segment finds it), so the same bits.
  Attention with_split(int threads) const {
    int64_t span = 0;  // the keys up to the last one any row sees
    bool leading = rows > 0;
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<int32_t>& k = (*keys)[r];
      const int64_t m = static_cast<int64_t>(k.size()), lead = leading_keys(k);
      // one row: every key it sees a leading one; several: each may see up to OWN_KEYS others past its lead (a tree)
      leading = leading && m > 0 && lead >= SPLIT_KEYS && m - lead <= (rows == 1 ? 0 : OWN_KEYS);
      span = std::max<int64_t>(span, m > 0 ? k.back() + 1 : 0);
    }
    const int64_t all_heads = (groups + 3) / 4, singles = rows * kvh * all_heads;
    if (threads < 2 || !leading || rows > SPLIT_ROWS || (rows == 1 && singles >= 2 * threads)) return *this;
    Attention a = *this;
    a.split = true;
    a.per = 4;
    a.parts = all_heads;
    a.rows_per = rows;
    a.width = (span + LANES - 1) / LANES * LANES;
    a.segs = (span + SEGMENT - 1) / SEGMENT;
    if (rows == 1) {
      // chunks of 64 lanes: a thread reading half of each 128-byte pair of cache lines would draw the whole
      // pair from memory all the same (the other half comes with it), so narrower chunks save no reads
      a.lanes_c = 4;
      a.chunks = (dp / LANES + 3) / 4;
      return a;
    }
    // several rows: each value unit takes every lane of a part of the item's queries; the parts that leave the
    // busiest thread the least (a part costs a read of the values, READ queries' worth, and its queries)
    a.lanes_c = dp / LANES;
    a.chunks = 1;
    constexpr int64_t READ = 5;
    const int64_t queries = rows * std::min<int64_t>(4, groups);
    int64_t least = INT64_MAX;
    for (int64_t parts_q = 1; parts_q <= 4; ++parts_q) {
      const int64_t count = a.items() * parts_q, each = (queries + parts_q - 1) / parts_q;
      const int64_t busiest = (count + threads - 1) / threads * (READ + each);
      if (busiest < least) {
        least = busiest;
        a.qparts = parts_q;
      }
    }
    return a;
  }
  int64_t items() const { return (rows + rows_per - 1) / rows_per * kvh * parts; }
  // units of split pass 0 (scores and maxima), 1 (exp) and 2 (weighted values)
  int64_t split_units(int pass) const { return items() * (pass < 2 ? segs : qparts * chunks); }

  // the scratch the threads share in a split: scores [item, query, width], maxima [item, query, segs], sums [item,
  // query, dp] (an item's queries row by row, each row's heads in order)
  struct Shared {
    std::vector<float> scores, most, acc;
    void size_for(const Attention& a) {
      const int64_t queries = a.items() * a.rows_per * a.per;
      scores.resize(static_cast<size_t>(queries * a.width));
      most.resize(static_cast<size_t>(queries * a.segs));
      acc.resize(static_cast<size_t>(queries * a.dp));
    }
  };
  std::array<int64_t, 4> shared_shape() const { return {items() * rows_per * per, width, segs, dp}; }

  // A row's keys in a split: 0 .. lead - 1, then m - lead others (`own`, in cache order, past the lead).
  struct Seen {
    int64_t lead, m;
    const int32_t* own;
  };
  Seen seen_by(int64_t row) const {
    const std::vector<int32_t>& k = (*keys)[row];
    const int64_t lead = leading_keys(k);
    return {lead, static_cast<int64_t>(k.size()), k.data() + lead};
  }

  void split_unit(int pass, int64_t u, AttentionScratch& s, Shared& w) const {
    const int64_t a = u / (pass < 2 ? segs : qparts * chunks), part = u % (pass < 2 ? segs : qparts * chunks);
    const int64_t row0 = a / (kvh * parts) * rows_per, kv = a / parts % kvh, h0 = kv * groups + a % parts * per;
    const int64_t g_count = std::min<int64_t>(per, kv * groups + groups - h0);
    const int64_t count = std::min(rows_per, rows - row0), queries = count * g_count;
    float* sc = w.scores.data() + a * rows_per * per * width;  // query q's scores at sc + q * width
    if (pass < 2) {
      float* most = w.most.data() + a * rows_per * per * segs;
      const int64_t j0 = part * SEGMENT, j1 = std::min(width, j0 + SEGMENT);
      if (pass == 0) {
        s.qf.resize(std::max(s.qf.size(), static_cast<size_t>(queries * d)));  // never shrunk: other calls' rows
        for (int64_t r = 0; r < count; ++r)
          for (int64_t e = 0; e < g_count * d; ++e) s.qf[r * g_count * d + e] = to_float(qp[((row0 + r) * h + h0) * d + e]);
        const uint32_t* kck = kc == nullptr ? nullptr : kc + kv * kcs;
        const float* ktk = kt == nullptr ? nullptr : kt + kv * tiles * d * LANES;
        const int64_t steps = d / 2;
        const bool dots = dot_scores<T>(kck, d);
        if (dots) {
          s.pairs.resize(static_cast<size_t>(queries * steps));
          query_pairs(s.qf.data(), queries, d, s.pairs.data());
        }
        // a few tiles at a time, all the queries in turns of up to nine: each key read from memory once
        constexpr int64_t TURN_TILES = 6;
        for (int64_t tb = j0 / LANES; tb < j1 / LANES; tb += TURN_TILES) {
          const int64_t te = std::min(j1 / LANES, tb + TURN_TILES);
          for (int64_t q0 = 0; q0 < queries; q0 += Attention::MOST_QUERIES) {
            const float* qf = s.qf.data() + q0 * d;
            const uint32_t* pairs = dots ? s.pairs.data() + q0 * steps : nullptr;
            const T* kk = kp + kv * ks;
            float* out = sc + q0 * width;
#define LOSSLESS_SCORES(Q) \
  case Q: score_range<Q>(qf, d, ktk, kk, n, kck, tb, te, out, width, pairs); break;
            switch (std::min<int64_t>(Attention::MOST_QUERIES, queries - q0)) {
              LOSSLESS_SCORES(1) LOSSLESS_SCORES(2) LOSSLESS_SCORES(3) LOSSLESS_SCORES(4) LOSSLESS_SCORES(5)
              LOSSLESS_SCORES(6) LOSSLESS_SCORES(7) LOSSLESS_SCORES(8) default: LOSSLESS_SCORES(9)
            }
#undef LOSSLESS_SCORES
          }
        }
      }
      for (int64_t q = 0; q < queries; ++q) {  // over the keys of the segment the query's row sees
        const Seen v = seen_by(row0 + q / g_count);
        const int64_t d1 = std::min(v.lead, j1), d0 = std::min(d1, j0);
        float* sp = sc + q * width;
        if (pass == 0) {
#pragma omp simd
          for (int64_t j = d0; j < d1; ++j) sp[j] = sp[j] * scale;
          float best = largest(sp, d0, d1);
          for (const int32_t* k = v.own; k < v.own + (v.m - v.lead); ++k)
            if (*k >= j0 && *k < j1) {
              sp[*k] = sp[*k] * scale;
              best = sp[*k] > best ? sp[*k] : best;
            }
          most[q * segs + part] = best;
        } else {
          float best = -INFINITY;
          for (int64_t p = 0; p < segs; ++p) best = most[q * segs + p] > best ? most[q * segs + p] : best;
          exp_shifted(sp, d0, d1, best);
          for (const int32_t* k = v.own; k < v.own + (v.m - v.lead); ++k)
            if (*k >= j0 && *k < j1) sp[*k] = exp_fixed(sp[*k] - best);
        }
      }
      return;
    }
    // pass 2: queries q0 .. q1 - 1 of the item, lanes t0 .. t1 - 1. Each query's scores first as its row sees
    // them (its own keys' moved next to its lead, in order: the sum and the chains read them so); then each chain
    // over the keys every row of the item sees (0 .. common - 1), and on over its own row's others.
    const int64_t each = (queries + qparts - 1) / qparts, q0 = std::min(queries, part / chunks * each);
    const int64_t q1 = std::min(queries, q0 + each), t0 = part % chunks * lanes_c * LANES;
    const int64_t t1 = std::min(dp, t0 + lanes_c * LANES);
    int64_t common = INT64_MAX;
    for (int64_t r = 0; r < count; ++r) common = std::min(common, seen_by(row0 + r).lead);
    if (chunks == 1)  // (with chunks, one row that sees only leading keys: nothing to move)
      for (int64_t q = q0; q < q1; ++q) {
        const Seen v = seen_by(row0 + q / g_count);
        float* sp = sc + q * width;
        for (int64_t i = 0; i < v.m - v.lead; ++i) sp[v.lead + i] = sp[v.own[i]];  // own[i] >= lead + i
      }
    float* acc = w.acc.data() + a * rows_per * per * dp;
    const T* vk = vp + kv * vs;
    for (int64_t t = t0; t < t1; t += 4 * LANES) {
      const int64_t c = std::min<int64_t>(4, (t1 - t) / LANES);
      chain_values(c, q0, q1, sc, nullptr, 0, common, vk, t, acc, false);
      for (int64_t q = q0; q < q1;) {  // each row's own keys, its queries together
        const int64_t row = row0 + q / g_count, end = std::min(q1, (q / g_count + 1) * g_count);
        const Seen v = seen_by(row);
        const int32_t* order = v.m > v.lead ? (*keys)[row].data() : nullptr;  // past the lead: gathered
        if (v.m > common) chain_values(c, q, end, sc, order, common, v.m, vk, t, acc, true);
        q = end;
      }
    }
    for (int64_t q = q0; q < q1; ++q) {
      const float total = total_of(sc + q * width, seen_by(row0 + q / g_count).m);
      T* o = op + ((row0 + q / g_count) * h + h0 + q % g_count) * d;
      for (int64_t e = t0; e < std::min(d, t1); ++e) o[e] = from_float<T>(acc[q * dp + e] / total);
    }
  }

  // the chains of queries q0 .. q1 - 1 (scores at sc + q * width, sums at acc + q * dp) over keys j0 .. j1 - 1 for
  // c chunks of lanes from t: up to six queries share each value read, more in turns over blocks of keys
  void chain_values(int64_t c, int64_t q0, int64_t q1, const float* sc, const int32_t* order, int64_t j0, int64_t j1,
                    const T* vk, int64_t t, float* acc, bool resume) const {
    constexpr int64_t SIX = 6, BLOCK = 64;
    const int64_t block = q1 - q0 > SIX ? BLOCK : std::max<int64_t>(1, j1 - j0);
    int64_t jb = j0;
    do {  // at least once: no keys still sets the chains to zero (or keeps them, resuming)
      const int64_t je = std::min(j1, jb + block);
      const bool more = resume || jb > j0;
      const int64_t turns = (q1 - q0 + SIX - 1) / SIX;  // groups as even as they go (a group of one waits on its chains)
      for (int64_t i = 0; i < turns; ++i) {
        const int64_t q = q0 + (q1 - q0) * i / turns, g = q0 + (q1 - q0) * (i + 1) / turns - q;
        const float* sq = sc + q * width;
        float* aq = acc + q * dp;
#define LOSSLESS_VALUES(G, C) \
  case G * 10 + C: weighted_values<G, C>(sq, width, order, jb, je, vk, d, dp, t, aq, more); break;
        switch (g * 10 + c) {
          LOSSLESS_VALUES(1, 1) LOSSLESS_VALUES(1, 2) LOSSLESS_VALUES(1, 3) LOSSLESS_VALUES(1, 4)
          LOSSLESS_VALUES(2, 1) LOSSLESS_VALUES(2, 2) LOSSLESS_VALUES(2, 3) LOSSLESS_VALUES(2, 4)
          LOSSLESS_VALUES(3, 1) LOSSLESS_VALUES(3, 2) LOSSLESS_VALUES(3, 3) LOSSLESS_VALUES(3, 4)
          LOSSLESS_VALUES(4, 1) LOSSLESS_VALUES(4, 2) LOSSLESS_VALUES(4, 3) LOSSLESS_VALUES(4, 4)
          LOSSLESS_VALUES(5, 1) LOSSLESS_VALUES(5, 2) LOSSLESS_VALUES(5, 3) LOSSLESS_VALUES(5, 4)
          LOSSLESS_VALUES(6, 1) LOSSLESS_VALUES(6, 2) LOSSLESS_VALUES(6, 3) default: LOSSLESS_VALUES(6, 4)
        }
#undef LOSSLESS_VALUES
      }
      jb = je;
    } while (jb < j1);
  }

  void item(int64_t a, AttentionScratch& s) const {
    const int64_t block = a / (kvh * parts), kv = a / parts % kvh, h0 = kv * groups + a % parts * per;
    const int64_t g_count = std::min<int64_t>(per, kv * groups + groups - h0);
    const int64_t row0 = block * rows_per, count = std::min(rows_per, rows - row0);
    bool empty = false;
    for (int64_t r = row0; r < row0 + count; ++r) empty = empty || (*keys)[r].empty();
    if (empty || !together(row0, count, s) || !block_rows(row0, count, kv, h0, g_count, s))
      for (int64_t r = row0; r < row0 + count; ++r) block_rows(r, 1, kv, h0, g_count, s);
  }

  // whether rows row0 .. row0 + count - 1 share one item: not where each sees keys in tiles mostly its own (rows of
  // different sequences of a batch, each sequence's keys together), since together they would score the union of
  // their tiles; each then goes alone
  bool together(int64_t row0, int64_t count, AttentionScratch& s) const {
    if (count < 2) return true;
    const std::vector<int32_t>* seen[3];
    int64_t last = 0, common = INT64_MAX, most = 0;
    for (int64_t r = 0; r < count; ++r) {
      seen[r] = &(*keys)[row0 + r];
      last = std::max<int64_t>(last, seen[r]->back());
      common = std::min(common, leading_keys(*seen[r]));
    }
    s.hit.resize(static_cast<size_t>(last / LANES + 1));
    for (int64_t r = 0; r < count; ++r) most = std::max(most, mark_tiles(&seen[r], 1, common, s.hit));
    return mark_tiles(seen, count, common, s.hit) * 4 <= most * 5 + 4;
  }

  // rows row0 .. row0 + count - 1 for heads h0 .. h0 + g_count - 1 of kv head kv; false where no kernel takes that many
  bool block_rows(int64_t row0, int64_t count, int64_t kv, int64_t h0, int64_t g_count, AttentionScratch& s) const {
    const std::vector<int32_t>* seen[3];
    for (int64_t r = 0; r < count; ++r) seen[r] = &(*keys)[row0 + r];
    if (count == 1 && seen[0]->empty()) {
      for (int64_t e = 0; e < g_count * d; ++e) op[(row0 * h + h0) * d + e] = from_float<T>(0.0f);
      return true;
    }
    for (int64_t r = 0; r < count; ++r)
      for (int64_t e = 0; e < g_count * d; ++e) s.qf[r * g_count * d + e] = to_float(qp[((row0 + r) * h + h0) * d + e]);
    const float* ktk = kt == nullptr ? nullptr : kt + kv * tiles * d * LANES;
    const uint32_t* kck = kc == nullptr ? nullptr : kc + kv * kcs;
    const T* vk = vp + kv * vs;
    const T* kk = kp + kv * ks;
#define LOSSLESS_ROWS(R, G) \
  case R * 10 + G: attend_rows<R, G>(s.qf.data(), d, dp, ktk, kk, n, vk, seen, scale, s, kck); break;
    switch (count * 10 + std::min<int64_t>(g_count, 4)) {
      LOSSLESS_ROWS(1, 1) LOSSLESS_ROWS(1, 2) LOSSLESS_ROWS(1, 3) LOSSLESS_ROWS(1, 4)
      LOSSLESS_ROWS(2, 1) LOSSLESS_ROWS(2, 2) LOSSLESS_ROWS(2, 3) LOSSLESS_ROWS(2, 4)
      LOSSLESS_ROWS(3, 1) LOSSLESS_ROWS(3, 2) LOSSLESS_ROWS(3, 3)
      default: return false;
    }
#undef LOSSLESS_ROWS
    for (int64_t r = 0; r < count; ++r)
      for (int64_t g = 0; g < g_count; ++g) {
        T* o = op + ((row0 + r) * h + h0 + g) * d;
        const int64_t q = r * g_count + g;
        for (int64_t e = 0; e < d; ++e) o[e] = from_float<T>(s.acc[q * dp + e] / s.total[q]);
      }
    return true;
  }
};

// key tiles b0..b1-1 of [kv, tile, d, 16] fp32 (lanes past n zeros) from keys [kv, n, d] (kv head stride ks)
template <typename T>
inline void build_tiles(const T* kp, int64_t ks, int64_t n, int64_t d, int64_t tiles, int64_t b0, int64_t b1, float* kt) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t kv = b / tiles, tile = b % tiles, valid = std::min<int64_t>(LANES, n - tile * LANES);
    const T* first = kp + kv * ks + tile * LANES * d;  // the tile's first key
    for (int64_t t = 0; t < d; ++t) {  // one 16-lane line of the tile at a time
      float* line = kt + (b * d + t) * LANES;
      for (int64_t l = 0; l < valid; ++l) line[l] = to_float(first[l * d + t]);
      for (int64_t l = valid; l < LANES; ++l) line[l] = 0.0f;
    }
  }
}

// each row's visible keys [q, n] in cache order
inline std::vector<std::vector<int32_t>> visible_keys(const bool* mp, int64_t q, int64_t n) {
  std::vector<std::vector<int32_t>> keys(static_cast<size_t>(q));
  for (int64_t row = 0; row < q; ++row)
    for (int64_t j = 0; j < n; ++j)
      if (mp[row * n + j]) keys[row].push_back(static_cast<int32_t>(j));
  return keys;
}

template <typename T>
void attention_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& visible,
                    double scaling, at::Tensor& out) {
  const FlushDenormals flush;
  const int64_t q = query.size(0), h = query.size(1), d = query.size(2), kvh = key.size(0), n = key.size(1);
  const int64_t groups = h / kvh, dp = (d + LANES - 1) / LANES * LANES, tiles = (n + LANES - 1) / LANES;
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();  // read where it lies
  const int64_t ks = key.stride(0), vs = value.stride(0);  // between kv heads (rows are contiguous)
  const bool* mp = visible.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const float scale = static_cast<float>(scaling);
  // each row's visible keys, in cache order, once for all heads
  const std::vector<std::vector<int32_t>> keys = visible_keys(mp, q, n);
  // keys [kv, tile, d, 16] in fp32, in a buffer kept by the calling thread between calls (a fresh one of a long
  // context's size costs page faults on every call); the lanes past n are zeros. AVX-512 gathers the scores'
  // keys from the cache's rows instead.
#if defined(LOSSLESS_V16_AVX512)
  float* kt = nullptr;
#else
  static thread_local std::vector<float> kt_store;
  kt_store.resize(std::max(kt_store.size(), static_cast<size_t>(kvh * tiles * d * LANES)));
  float* kt = kt_store.data();
  at::parallel_for(0, kvh * tiles, 4, [&](int64_t b0, int64_t b1) { build_tiles(kp, ks, n, d, tiles, b0, b1, kt); });
#endif
  const Attention<T> base{qp, kp, vp, op, kt, ks, vs, h, d, dp, kvh, groups, n, tiles, 1, 1, scale, &keys};
  const Attention<T> plan = base.with_items(q, at::get_num_threads());
  if (plan.split) {
    typename Attention<T>::Shared shared;
    shared.size_for(plan);
    for (int pass = 0; pass < 3; ++pass)
      at::parallel_for(0, plan.split_units(pass), 1, [&](int64_t u0, int64_t u1) {
        const FlushDenormals flush_here;
        AttentionScratch scratch(d);
        for (int64_t u = u0; u < u1; ++u) plan.split_unit(pass, u, scratch, shared);
      });
    return;
  }
  at::parallel_for(0, plan.items(), 1, [&](int64_t a0, int64_t a1) {
    const FlushDenormals flush_here;
    AttentionScratch scratch(d);
    for (int64_t a = a0; a < a1; ++a) plan.item(a, scratch);
  });
}

// one row of the RMSNorm below: x [c] -> out [c]
template <typename T>
inline void rms_row(const T* xi, const T* wp, int64_t c, float e, T* out) {
  // lane l: fma(x[t], x[t], sum) over t = l, l + 16, .. in order, 16 lanes at a time, then the tail one at a time
  V16 squares = V16::zero();
  int64_t s = 0;
  for (; s + LANES <= c; s += LANES) {
    const V16 v = V16::load(xi + s);
    squares = squares.fma(v, v);
  }
  float lanes[LANES];
  squares.store(lanes);
  for (; s < c; ++s) {
    const float v = to_float(xi[s]);
    lanes[s % LANES] = std::fmaf(v, v, lanes[s % LANES]);
  }
  const float inv = 1.0f / std::sqrt(tree16(lanes) / static_cast<float>(c) + e);
  int64_t t = 0;
  for (; t + LANES <= c; t += LANES)  // the same two roundings, 16 lanes at a time
    store_rounded<T>(V16::load(wp + t).mul(rounded_lanes<T>(V16::load(xi + t).mul(V16::splat(inv)))), out + t);
  for (; t < c; ++t) out[t] = from_float<T>(to_float(wp[t]) * to_float(from_float<T>(to_float(xi[t]) * inv)));
}

template <typename T> inline T silu_one(T x) {
  const float v = to_float(x);
  return from_float<T>(v / (1.0f + exp_fixed(-v)));
}

// silu_one of x[0..n-1] into out, 16 lanes at a time (the same operations, so the same bits)
template <typename T> inline void silu_many(const T* x, int64_t n, T* out) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const V16 v = V16::load(x + i);
    store_rounded<T>(v.div(V16::splat(1.0f).add(exp_fixed(V16::splat(-1.0f).mul(v)))), out + i);
  }
  for (; i < n; ++i) out[i] = silu_one(x[i]);
}

// The Llama/Qwen RMSNorm: y = w * T(x * rsqrt(mean(x^2) + eps)), statistics in fp32; x [m, c], w [c]
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const FlushDenormals flush;
  const int64_t m = x.size(0), c = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, m, 8, [&](int64_t i0, int64_t i1) {
    const FlushDenormals flush_here;
    for (int64_t i = i0; i < i1; ++i) rms_row(xp + i * c, wp, c, e, op + i * c);
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
    silu_many(xp + i0, i1 - i0, op + i0);
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

#if defined(LOSSLESS_AMX)
// Seconds (the best of 5, this thread) for m rows x k inputs through `panels` panels of w, on AMX tiles or not
inline double product_seconds(int64_t m, bool amx, const std::vector<at::BFloat16>& w, int64_t k, int64_t panels) {
  const int64_t saved = amx_rows();
  amx_rows() = amx ? 1 : INT64_MAX;
  std::vector<at::BFloat16> x(static_cast<size_t>(m * k)), out(static_cast<size_t>(m * panels * LANES));
  for (size_t i = 0; i < x.size(); ++i) x[i] = at::BFloat16(0.125f * static_cast<float>(static_cast<int>(i * 7 % 13) - 6));
  const Rows<at::BFloat16> rows(x.data(), m, k, true);
  amx_rows() = saved;
  const Weight<at::BFloat16> wt{w.data(), panels * LANES, panels, out.data(), nullptr, nullptr, nullptr, true};
  double best = 1e9;
  for (int t = 0; t < 5; ++t) {
    const auto start = std::chrono::steady_clock::now();
    panel_range(rows, m, wt, 0, panels);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}
#endif

// The dot-product instruction's and the fp32 fma's rate on this core, each as 16-lane instructions a second over
// 24 independent chains (the best of three): the compute a forward's products can reach at one thread, where the
// variant has the instruction (elsewhere none)
std::vector<double> product_rates() {
#if defined(LOSSLESS_DPBF16)
  const FlushDenormals flush;
  constexpr int64_t rounds = 200000;
  const auto [dot, fma] = best_chain_seconds(rounds);
  return {24.0 * rounds / dot, 24.0 * rounds / fma};
#else
  return {};
#endif
}

// Measure once which bf16 path is faster on this core and take it (the variant with the dot-product instruction;
// elsewhere the one path there is). A widened pair costs two fmas where the instruction costs one: it pays where
// the fma's throughput is at least 3x the instruction's. With AMX: from how many rows tiles beat that path (an
// M x 576 x 1536 product; tiles are taken from the fewest rows from which they are faster at every count tried).
// Every path gives the same bits. Returns whether products run widened.
bool choose_bf16_path() {
  const FlushDenormals flush;
#if defined(LOSSLESS_DPBF16)
  const auto [dot, fma] = best_chain_seconds(40000);  // about a millisecond each
  widen_bf16() = dot >= 3.0 * fma;
#endif
#if defined(LOSSLESS_AMX)
  const int64_t k = 576, panels = 96;
  std::vector<at::BFloat16> w(static_cast<size_t>(panels * k * LANES));
  for (size_t i = 0; i < w.size(); ++i) w[i] = at::BFloat16(0.0625f * static_cast<float>(static_cast<int>(i * 5 % 11) - 5));
  int64_t from = INT64_MAX;
  for (const int64_t m : {16, 8, 6, 4, 3, 2, 1}) {
    if (product_seconds(m, true, w, k, panels) >= product_seconds(m, false, w, k, panels)) break;
    from = m;
  }
  amx_rows() = from;
#endif
  return widen_bf16();
}

// The fewest rows a bf16 call takes AMX tiles from (0: this variant has none); set_amx_rows sets it (tests, speed
// only: the same bits either way) and returns it.
int64_t amx_min_rows() {
#if defined(LOSSLESS_AMX)
  return amx_rows() == INT64_MAX ? -1 : amx_rows();
#else
  return 0;
#endif
}
// Whether the amx variant writes its tile instructions out instead of running them (tests on CPUs without AMX:
// the rest of its path, the tiles' layouts included, runs as on AMX); returns the setting (false elsewhere).
bool set_tile_emulation(bool on) {
#if defined(LOSSLESS_AMX)
  tile_emulation() = on;
  return tile_emulation();
#else
  (void)on;
  return false;
#endif
}

int64_t set_amx_rows(int64_t rows) {
#if defined(LOSSLESS_AMX)
  amx_rows() = rows < 1 ? INT64_MAX : rows;
#else
  (void)rows;
#endif
  return amx_min_rows();
}

std::vector<at::Tensor> linear_many(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                                    const std::vector<int64_t>& n, const std::vector<c10::optional<at::Tensor>>& bias) {
  TORCH_CHECK(packed.size() == n.size() && packed.size() == bias.size(), "linear: one n and bias per weight");
  std::vector<at::Tensor> out;
  for (size_t w = 0; w < packed.size(); ++w) {
    check_linear(x, packed[w], n[w], bias[w]);
    out.push_back(at::empty({x.size(0), n[w]}, x.options()));
  }
  DISPATCH(x.scalar_type(), "linear", {
    std::vector<Weight<scalar>> weights;
    for (size_t w = 0; w < packed.size(); ++w)
      weights.push_back({nullptr, n[w], 0, out[w].data_ptr<scalar>(),
                         bias[w].has_value() ? bias[w]->data_ptr<scalar>() : nullptr});
    linear_impl<scalar>(x, packed, weights);
  });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  return linear_many(x, {packed}, {n}, {bias})[0];
}

// The fp32 product-sums of `linear` before any rounding to x's dtype, each chain started from init [m, n] (fp32)
// instead of +0: the order itself, as the tests check it against AMX's recorded outputs.
at::Tensor linear_sums(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& init) {
  check_linear(x, packed, n, c10::nullopt);
  check_cpu(init, "init");
  TORCH_CHECK(init.scalar_type() == at::kFloat && init.dim() == 2 && init.size(0) == x.size(0) && init.size(1) == n,
              "linear_sums: init fp32 [m, n]");
  at::Tensor sums = at::empty({x.size(0), n}, init.options());
  DISPATCH(x.scalar_type(), "linear_sums", {
    Weight<scalar> w{nullptr, n, 0, nullptr, nullptr, sums.data_ptr<float>(), init.data_ptr<float>()};
    linear_impl<scalar>(x, {packed}, {w});
  });
  return sums;
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

// ---------------------------------------------------------------------------------------- choices from logits
// What a decode reads from a row of logits: the first index of its largest value, and the n largest values'
// indices (the largest first, the earlier index first among equal values; a NaN counts as above every number, as
// torch.max takes it), with their softmax probabilities exp(x - top) / sum_j exp(x_j - top) where asked. The
// selection compares values as they are (no denormal rule: it must pick what torch.max picks); the sum runs over a
// logical 16-lane accumulator in a fixed order under the kernels' denormal rule, so every variant gives its bits.
inline bool ranks_above(float a, float b) { return a != a ? b == b : a > b; }

template <typename T>
void choices_row(const T* row, int64_t v, int64_t n, int64_t* ids, float* probs) {
  float top[8];
  int64_t filled = 0;
  auto offer = [&](float x, int64_t j) {
    if (filled == n && !ranks_above(x, top[n - 1])) return;
    int64_t at = filled < n ? filled++ : n - 1;
    for (; at > 0 && ranks_above(x, top[at - 1]); --at) {
      top[at] = top[at - 1];
      ids[at] = ids[at - 1];
    }
    top[at] = x;
    ids[at] = j;
  };
  int64_t j = 0;
  for (; j < v && filled < n; ++j) offer(to_float(row[j]), j);
  for (; j + LANES <= v; j += LANES)
    if (V16::any_past(V16::load(row + j), top[n - 1]))
      for (int64_t l = 0; l < LANES; ++l) offer(to_float(row[j + l]), j + l);
  for (; j < v; ++j) offer(to_float(row[j]), j);
  if (probs == nullptr) return;
  const FlushDenormals flush;
  const float best = top[0];
  const V16 shift = V16::splat(best);
  V16 sum = V16::zero();
  j = 0;
  for (; j + LANES <= v; j += LANES) sum = sum.add(exp_fixed(V16::load(row + j).sub(shift)));
  float lanes[LANES];
  sum.store(lanes);
  for (int64_t l = 0; j + l < v; ++l) lanes[l] = lanes[l] + exp_fixed(to_float(row[j + l]) - best);
  const float total = tree16(lanes);
  for (int64_t i = 0; i < n; ++i) probs[i] = exp_fixed(top[i] - best) / total;
}

std::vector<at::Tensor> choices(const at::Tensor& logits, int64_t n, bool with_probs) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, "choices: logits [m, V] with V >= 1");
  TORCH_CHECK(n >= 1 && n <= 8 && n <= logits.size(1), "choices: between 1 and min(8, V) choices a row");
  const int64_t m = logits.size(0), v = logits.size(1);
  at::Tensor ids = at::empty({m, n}, logits.options().dtype(at::kLong));
  at::Tensor probs = with_probs ? at::empty({m, n}, logits.options().dtype(at::kFloat)) : at::Tensor();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* pp = with_probs ? probs.data_ptr<float>() : nullptr;
  DISPATCH(logits.scalar_type(), "choices", {
    const scalar* lp = logits.data_ptr<scalar>();
    at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) choices_row(lp + r * v, v, n, ip + r * n, pp ? pp + r * n : nullptr);
    });
  });
  return with_probs ? std::vector<at::Tensor>{ids, probs} : std::vector<at::Tensor>{ids};
}

// ---------------------------------------------------------------------------------------- one decoder layer
// A Llama/Qwen3 decoder layer's AR view in two calls around the cache update, so a layer costs two calls from
// Python instead of some forty. Every step is the op the Hugging Face layer runs in exact mode, in its order:
// the kernels above for norms, projections, SiLU and attention, and ATen's own elementwise ops (the same
// calls the Hugging Face code makes: rotary products, residual adds, gate * up), so the bits cannot differ from
// the module path. An empty bias or norm weight means none. (Calls in parentheses: this file's kernels, not
// ATen's namesakes found by argument-dependent lookup.)

// t [kv, n, d] as the attention kernel reads it: rows contiguous, any stride between kv heads (a copy if not)
inline at::Tensor rows_contiguous(const at::Tensor& t) {
  return t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)) ? t : t.contiguous();
}

inline c10::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// x [m, heads, d] -> (x * cos) + (rotate_half(x) * sin), cos/sin [m, d] broadcast over the heads: what the
// Hugging Face code computes with ATen's elementwise ops, each op's result rounded to T (ATen computes bf16 and
// fp16 products and sums in fp32 and rounds once: the product of two is exact in fp32), the same rounding here;
// outside the denormal rule, as ATen's ops run.
// one head's d values at one position (its cos/sin rows)
template <typename T>
inline void rotary_head(const T* xr, const T* cr, const T* sr, int64_t d, T* o) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float rotated = i < half ? -to_float(xr[i + half]) : to_float(xr[i - half]);
    const T a = from_float<T>(to_float(xr[i]) * to_float(cr[i]));
    const T b = from_float<T>(rotated * to_float(sr[i]));
    o[i] = from_float<T>(to_float(a) + to_float(b));
  }
}

template <typename T>
void rotary_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t m = x.size(0), heads = x.size(1), d = x.size(2);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t h = 0; h < heads; ++h) rotary_head(xp + (r * heads + h) * d, cp + r * d, sp + r * d, d, op + (r * heads + h) * d);
}

inline at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && x.size(2) % 2 == 0 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rotary: x [m, heads, d], cos/sin [m, d] of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  DISPATCH(x.scalar_type(), "rotary", rotary_impl<scalar>(x, cos, sin, out));
  return out;
}

// x [m, hidden] -> {query [m, heads, d], key [1, kv, m, d], value [1, kv, m, d]}: input norm, q/k/v projections,
// the per-head q/k norms (Qwen3; empty weights: none), rotary at the rows' positions (cos/sin [m, d]).
std::vector<at::Tensor> layer_in(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& norm_w, double eps, const std::vector<at::Tensor>& packed,
                                 const std::vector<at::Tensor>& bias, const std::vector<int64_t>& n,
                                 const at::Tensor& q_norm_w, const at::Tensor& k_norm_w, double qk_eps,
                                 int64_t head_dim) {
  TORCH_CHECK(packed.size() == 3 && bias.size() == 3 && n.size() == 3, "layer_in: q, k and v projections");
  const int64_t m = x.size(0);
  const std::vector<at::Tensor> qkv = linear_many((rms_norm)(x, norm_w, eps), packed, n,
                                                 {maybe(bias[0]), maybe(bias[1]), maybe(bias[2])});
  at::Tensor q = qkv[0].view({m, -1, head_dim}), k = qkv[1].view({m, -1, head_dim}), v = qkv[2].view({m, -1, head_dim});
  if (q_norm_w.numel()) q = (rms_norm)(q.reshape({-1, head_dim}), q_norm_w, qk_eps).view({m, -1, head_dim});
  if (k_norm_w.numel()) k = (rms_norm)(k.reshape({-1, head_dim}), k_norm_w, qk_eps).view({m, -1, head_dim});
  q = rotary(q, cos, sin);
  k = rotary(k, cos, sin);
  return {q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)};
}

// The rest of the layer: attention of query [m, heads, d] over keys/values [kv, n, d] (visible [m, n]), the
// output projection, the residual add, the post-attention norm, the MLP (down(silu(gate(h)) * up(h))) and its
// residual add. packed/bias/n: o, gate, up, down.
at::Tensor layer_out(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                     const at::Tensor& visible, double scaling, const std::vector<at::Tensor>& packed,
                     const std::vector<at::Tensor>& bias, const std::vector<int64_t>& n, const at::Tensor& norm_w,
                     double eps) {
  TORCH_CHECK(packed.size() == 4 && bias.size() == 4 && n.size() == 4, "layer_out: o, gate, up and down projections");
  const int64_t m = x.size(0);
  const at::Tensor a = (attention)(q, rows_contiguous(keys), rows_contiguous(values), visible, scaling).view({m, -1});
  const at::Tensor x1 = at::add(x, (linear)(a, packed[0], n[0], maybe(bias[0])));
  const at::Tensor h = (rms_norm)(x1, norm_w, eps);
  const std::vector<at::Tensor> gate_up = linear_many(h, {packed[1], packed[2]}, {n[1], n[2]},
                                                     {maybe(bias[1]), maybe(bias[2])});
  const at::Tensor mlp = (linear)(at::mul((silu)(gate_up[0]), gate_up[1]), packed[3], n[3], maybe(bias[3]));
  return at::add(x1, mlp);
}

// ------------------------------------------------------------------------------------------- the layer stack
// Every decoder layer of one forward in one call, in one parallel region: the threads go through each layer's
// steps together (norm, q/k/v, q/k norms and rotary with the new keys and values written into the cache's
// buffers at positions n..n+m-1, attention over the first n+m, o, residual, norm, gate/up, SiLU * up, down,
// residual), a barrier between steps, each step's work split over the threads. Every value is computed by the
// same code as `layer_in` / `layer_out` compute it (the same row, head and panel functions, ATen's elementwise
// rounding under the caller's floating-point mode, the kernels' under the denormal rule), so the same bits
// and the same cache as layer by layer; what goes is the Python between the layers and the cost of starting a
// parallel region for every op. The caller makes room in the buffers first and moves the cache's length after
// (or leaves it where it was: the draft view's rows written aside).
// Stack.add: layer_in's arguments after cos/sin, the attention scaling, then layer_out's after the visibility
void Stack::add(const at::Tensor& norm_in, double eps_in, const std::vector<at::Tensor>& packed_in,
                const std::vector<at::Tensor>& bias_in, const std::vector<int64_t>& n_in, const at::Tensor& q_norm,
                const at::Tensor& k_norm, double qk_eps, int64_t head_dim, double scaling,
                const std::vector<at::Tensor>& packed_out, const std::vector<at::Tensor>& bias_out,
                const std::vector<int64_t>& n_out, const at::Tensor& norm_out, double eps_out) {
  TORCH_CHECK(packed_in.size() == 3 && bias_in.size() == 3 && n_in.size() == 3, "Stack.add: q, k and v projections");
  TORCH_CHECK(packed_out.size() == 4 && bias_out.size() == 4 && n_out.size() == 4,
              "Stack.add: o, gate, up and down projections");
  TORCH_CHECK(head_dim > 0 && n_in[0] % head_dim == 0 && n_in[1] % head_dim == 0 && n_in[1] == n_in[2] &&
                  n_in[0] % n_in[1] == 0 && n_out[1] == n_out[2] && norm_in.dim() == 1 &&
                  norm_out.sizes() == norm_in.sizes() && n_out[0] == norm_in.size(0) && n_out[3] == norm_in.size(0),
              "Stack.add: the shapes of a Llama/Qwen3 layer");
  for (const at::Tensor& t : {norm_in, norm_out}) check_cpu(t, "norm weight");
  // every tensor the forward reads as the layer's dtype, each packed weight of its outputs and inputs: checked
  // here, since nothing may throw inside the forward's parallel region
  const at::ScalarType dtype = norm_in.scalar_type();
  const int64_t hidden = norm_in.size(0);
  const auto check_packed = [&](const at::Tensor& p, const at::Tensor& bias, int64_t n, int64_t k) {
    check_cpu(p, "packed weight");
    const bool pairs = dtype == at::kBFloat16;
    TORCH_CHECK(p.scalar_type() == dtype && (p.dim() == 3 || tile_layout(p)) && p.size(0) * LANES >= n &&
                    p.numel() == packed_elements(p.size(0), chain_steps(k, pairs), pairs),
                "Stack.add: a packed weight that does not match its layer (pack it with kernels.pack_weight)");
    TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == dtype && bias.numel() == n && bias.is_contiguous()),
                "Stack.add: a bias of the layer's dtype and outputs");
  };
  for (int i = 0; i < 3; ++i) check_packed(packed_in[i], bias_in[i], n_in[i], hidden);
  check_packed(packed_out[0], bias_out[0], n_out[0], n_in[0]);
  check_packed(packed_out[1], bias_out[1], n_out[1], hidden);
  check_packed(packed_out[2], bias_out[2], n_out[2], hidden);
  check_packed(packed_out[3], bias_out[3], n_out[3], n_out[1]);
  for (const at::Tensor& t : {norm_out, q_norm, k_norm})
    TORCH_CHECK(t.numel() == 0 || t.scalar_type() == dtype, "Stack.add: norm weights of the layer's dtype");
  if (!layers.empty()) {
    const Layer& first = layers[0];
    TORCH_CHECK(first.n_in == n_in && first.n_out == n_out && first.head_dim == head_dim &&
                    first.norm_in.scalar_type() == norm_in.scalar_type(), "Stack.add: every layer of one shape and dtype");
  }
  for (const at::Tensor& t : {q_norm, k_norm})
    TORCH_CHECK(t.numel() == 0 || (t.dim() == 1 && t.size(0) == head_dim && t.is_contiguous()), "Stack.add: q/k norms [d]");
  for (const auto* group : {&packed_in, &packed_out})
    for (const at::Tensor& p : *group) tiled = tiled || tile_layout(p);
  layers.push_back({norm_in, q_norm, k_norm, norm_out, eps_in, qk_eps, scaling, eps_out, head_dim, packed_in,
                    bias_in, packed_out, bias_out, n_in, n_out});
}

// The cache's keys kept a second time as tiles, for attention's scores to read with plain loads: per kv head,
// tiles of 16 positions, [kv, tiles, steps, 16] 32-bit words, position p's step i at lane p % 16 of tile p / 16;
// a step is one fp32 key element, or for two-byte keys a pair (element 2i low, 2i + 1 high; zero past d).
template <typename T> constexpr int64_t tile_steps(int64_t d) { return sizeof(T) == 2 ? (d + 1) / 2 : d; }
inline uint32_t word_of(float v) { return __builtin_bit_cast(uint32_t, v); }
inline uint32_t word_of(at::BFloat16 v) { return v.x; }
inline uint32_t word_of(at::Half v) { return v.x; }
template <typename T>
inline void write_tile(uint32_t* tiles, int64_t tcap, int64_t kv, int64_t pos, const T* key, int64_t d) {
  uint32_t* w = tiles + ((kv * tcap + pos / LANES) * tile_steps<T>(d)) * LANES + pos % LANES;
  if constexpr (sizeof(T) == 2) {
    for (int64_t i = 0; 2 * i < d; ++i)
      w[i * LANES] = word_of(key[2 * i]) | (2 * i + 1 < d ? word_of(key[2 * i + 1]) << 16 : 0u);
  } else {
    for (int64_t i = 0; i < d; ++i) w[i * LANES] = word_of(key[i]);
  }
}

// The last Stack forward's threads, the panels its linear steps ran and how many of them a thread took from
// another's share (tests)
struct StackCounts {
  int64_t threads = 0, panels = 0, taken = 0;
};
inline StackCounts& stack_counted() { thread_local StackCounts c; return c; }  // the calling thread's last forward
inline int64_t& stack_stall() { static int64_t microseconds = 0; return microseconds; }
int64_t set_stack_stall(int64_t microseconds) { return std::exchange(stack_stall(), std::max<int64_t>(0, microseconds)); }
std::vector<int64_t> stack_counts() {
  const StackCounts& c = stack_counted();
  return {c.threads, c.panels, c.taken};
}

template <typename T>
struct StackRun {
  const Stack& stack;
  // a fused forward's draft view (null: none): rows nv.. take its q/k/v, q/k norms and o; the rest of each layer
  // (the norms, the MLP) is the AR layer's, which the draft view shares
  const Stack* views;
  int64_t m, nv, n, hidden;
  const T* cos;
  const T* sin;
  const std::vector<at::Tensor>& keys;
  const std::vector<at::Tensor>& values;
  const std::vector<at::Tensor>& tiles;  // the key tiles of each layer, valid for its first `valid` positions
  const std::vector<int64_t>& valid;
  std::vector<std::vector<int32_t>> seen;  // each row's visible keys
  // scratch, shared by the threads: the hidden rows, normed rows, projections, attention, MLP
  std::vector<T> x, xn, q, k, v, qr, a, o, g, u, act, d, kn;
  Rows<T> rows_in, rows_a, rows_h, rows_act;
  Rows<T> rows_in_d, rows_a_d;  // a fused forward's draft rows, for the draft view's projections
  std::vector<float> kt_build;  // fp32 key tiles built per layer (without AVX-512)
  SpinBarrier barrier;
  typename Attention<T>::Shared split_scratch;  // a split attention's (`Attention::with_split`)
  uint64_t caller_mode;

  StackRun(const Stack& s, const Stack* draft, int64_t verify, const at::Tensor& x0, const at::Tensor& c,
           const at::Tensor& sn, const at::Tensor& visible, const std::vector<at::Tensor>& kb,
           const std::vector<at::Tensor>& vb, const std::vector<at::Tensor>& tb, const std::vector<int64_t>& tv, int64_t n_)
      : stack(s), views(draft), m(x0.size(0)), nv(verify), n(n_), hidden(x0.size(1)), cos(c.data_ptr<T>()), sin(sn.data_ptr<T>()), keys(kb),
        values(vb), tiles(tb), valid(tv), seen(visible_keys(visible.data_ptr<bool>(), m, n_ + m)), caller_mode(FloatMode::get()) {
    int64_t nq = 0, nk = 0, inter = 0, d_max = 0, tiles_max = 0;
    for (const Stack::Layer& L : s.layers) {
      nq = std::max(nq, L.n_in[0]);
      nk = std::max(nk, L.n_in[1]);
      inter = std::max(inter, L.n_out[1]);
      d_max = std::max(d_max, L.head_dim);
      tiles_max = std::max(tiles_max, L.n_in[1] / L.head_dim * ((n + m + LANES - 1) / LANES) * L.head_dim * LANES);
    }
    const T* xp = x0.data_ptr<T>();
    x.assign(xp, xp + m * hidden);
    xn.resize(m * hidden); o.resize(m * hidden); d.resize(m * hidden);
    q.resize(m * nq); qr.resize(m * nq); a.resize(m * nq); k.resize(m * nk); v.resize(m * nk); kn.resize(m * (nq + nk));
    g.resize(m * inter); u.resize(m * inter); act.resize(m * inter);
#if !defined(LOSSLESS_V16_AVX512)
    kt_build.resize(static_cast<size_t>(tiles_max));
#else
    (void)tiles_max;
    (void)d_max;
#endif
  }

  // this thread's share [b, e) of `total` items; `unit` keeps shares in whole units (panel blocks)
  static void share(int64_t total, int t, int threads, int64_t unit, int64_t& b, int64_t& e) {
    const int64_t units = (total + unit - 1) / unit;
    b = std::min(total, units * t / threads * unit);
    e = std::min(total, units * (t + 1) / threads * unit);
  }

  // A linear step's panels, claimed 4 at a time: each thread from the front of its own share (one stream from
  // its start, as a static split reads it), then from the back of the others' shares, so a thread the machine
  // holds up is helped instead of waited for at the barrier. Which thread computes a panel never changes its
  // bits. A share's word: the step's generation (16 bits), front (24), back (24); the first thread to touch a
  // share in a step writes its bounds (every thread computes the same ones).
  struct alignas(64) Claim {
    std::atomic<uint64_t> word{0};
  };
  std::unique_ptr<Claim[]> claims;
  static constexpr int64_t CLAIM = 4;
  struct alignas(64) Count {  // each thread's, summed after the forward (`stack_counts`)
    int64_t panels = 0, taken = 0;
  };
  std::unique_ptr<Count[]> counts;

  bool claim(int owner, bool front, uint64_t gen, int64_t total, int threads, int64_t& p0, int64_t& p1) const {
    std::atomic<uint64_t>& word = claims[owner].word;
    uint64_t cur = word.load(std::memory_order_acquire);
    for (;;) {
      if (cur >> 48 != gen) {
        int64_t b, e;
        share(total, owner, threads, CLAIM, b, e);
        const uint64_t fresh = gen << 48 | static_cast<uint64_t>(b) << 24 | static_cast<uint64_t>(e);
        if (word.compare_exchange_weak(cur, fresh, std::memory_order_acq_rel, std::memory_order_acquire)) cur = fresh;
        continue;
      }
      const int64_t f = static_cast<int64_t>(cur >> 24 & 0xFFFFFF), back = static_cast<int64_t>(cur & 0xFFFFFF);
      if (f >= back) return false;
      // from the back: the piece that ends the share, so the rest stays in whole units from a unit's start
      const int64_t c = std::min(back - f, front || back % CLAIM == 0 ? CLAIM : back % CLAIM);
      const uint64_t next = gen << 48 | static_cast<uint64_t>(front ? f + c : f) << 24 |
                            static_cast<uint64_t>(front ? back : back - c);
      if (word.compare_exchange_weak(cur, next, std::memory_order_acq_rel, std::memory_order_acquire)) {
        p0 = front ? f : back - c;
        p1 = front ? f + c : back;
        return true;
      }
    }
  }

  // rows through weights: all m rows, or (a fused forward's) the first nv rows through `weights` and the rest
  // (`draft`, from its own rows) through `draft_weights`, the panels of both in one step
  struct Part {
    const Rows<T>* rows;
    int64_t m;
    std::vector<Weight<T>> weights;
    int64_t panels = 0;
  };
  static void part_panels(const std::array<Part, 2>& parts, int64_t g0, int64_t g1) {
    int64_t first = 0;
    for (const Part& part : parts) {
      const int64_t p0 = std::max(g0, first) - first, p1 = std::min(g1, first + part.panels) - first;
      if (p0 < p1) linear_panels(*part.rows, part.m, part.weights, p0, p1);
      first += part.panels;
    }
  }
  void linear(const Rows<T>& rows, std::vector<Weight<T>> weights, int t, int threads, uint64_t& step,
              const Rows<T>* draft = nullptr, std::vector<Weight<T>> draft_weights = {}) const {
    std::array<Part, 2> parts{Part{&rows, draft ? nv : m, std::move(weights)}, Part{draft, m - nv, std::move(draft_weights)}};
    if (draft == nullptr) parts[1].m = 0;
    int64_t total = 0;
    for (Part& part : parts) {
      for (const Weight<T>& w : part.weights) part.panels += w.panels;
      if (part.m == 0) part.panels = 0;
      total += part.panels;
    }
    const uint64_t gen = ++step % 0xFFFF + 1;  // 1..65535: never a fresh word's 0
    if (stack_stall() && t == threads - 1 && threads > 1)
      std::this_thread::sleep_for(std::chrono::microseconds(stack_stall()));
    const FlushDenormals flush;
#if defined(LOSSLESS_AMX)
    const TileHold hold(rows.amx || (parts[1].panels && draft->amx));
#endif
    int64_t p0, p1, own = 0, taken = 0;
    while (claim(t, true, gen, total, threads, p0, p1)) {
      part_panels(parts, p0, p1);
      own += p1 - p0;
    }
    for (int o = 1; o < threads; ++o)
      while (claim((t + o) % threads, false, gen, total, threads, p0, p1)) {
        part_panels(parts, p0, p1);
        taken += p1 - p0;
      }
    counts[t].panels += own + taken;
    counts[t].taken += taken;
  }

  static const T* bias_of(const at::Tensor& b) { return b.numel() ? b.data_ptr<T>() : nullptr; }
  static Weight<T> weight(const at::Tensor& packed, const at::Tensor& bias, int64_t n_out, T* out) {
    return {packed.data_ptr<T>(), n_out, packed.size(0), out, bias_of(bias), nullptr, nullptr, tile_layout(packed)};
  }

  // rows r0..r1-1: x += add (ATen's rounding, the caller's mode), then the norm (the kernel's) into out and rows
  // (a fused forward's draft rows, from nv on, into `draft` where given)
  void residual_norm(const T* add, const at::Tensor& w, double eps, T* out, Rows<T>& rows, int64_t r0, int64_t r1,
                     Rows<T>* draft = nullptr) {
    if (add != nullptr) {
      FloatMode::set(caller_mode);
      combine_rounded<true>(x.data() + r0 * hidden, add + r0 * hidden, (r1 - r0) * hidden, x.data() + r0 * hidden);
    }
    {
      const FlushDenormals flush;
      for (int64_t r = r0; r < r1; ++r) rms_row(x.data() + r * hidden, w.data_ptr<T>(), hidden, static_cast<float>(eps), out + r * hidden);
    }
    for (int64_t r = r0; r < r1; ++r) {
      if (draft != nullptr && r >= nv) draft->fill(out + nv * hidden, r - nv, 0, draft->steps);
      else rows.fill(out, r, 0, rows.steps);
    }
  }

  void run(int t, int threads) {
    FloatMode::set(caller_mode);  // the base every step's mode is set from
    int sense = 0;
    const auto sync = [&] { barrier.wait(sense); };
    int64_t d_most = 0;
    for (const Stack::Layer& L : stack.layers) d_most = std::max(d_most, L.head_dim);
    AttentionScratch scratch(d_most);
    std::array<int64_t, 4> split_shape{};  // what split_scratch was last sized for
    int64_t b, e;
    uint64_t step = 0;  // the linear steps so far (the same count on every thread)
    for (size_t l = 0; l < stack.layers.size(); ++l) {
      const Stack::Layer& L = stack.layers[l];
      const Stack::Layer& D = views ? views->layers[l] : L;  // the draft rows' view
      Rows<T>* rows_in_v = views ? &rows_in_d : nullptr;
      const int64_t hd = L.head_dim, nq = L.n_in[0], nk = L.n_in[1], heads = nq / hd, kvh = nk / hd;
      const int64_t inter = L.n_out[1];
      const int64_t cap = keys[l].size(2), ks = cap * hd;
      T* kc = keys[l].data_ptr<T>();
      T* vc = values[l].data_ptr<T>();
      uint32_t* tc = reinterpret_cast<uint32_t*>(tiles[l].data_ptr<int32_t>());
      const int64_t tcap = tiles[l].size(1), tstride = tcap * tile_steps<T>(hd) * LANES;
      // 1. (the previous layer's MLP residual) and the input norm, by rows
      share(m, t, threads, 1, b, e);
      residual_norm(l ? d.data() : nullptr, L.norm_in, L.eps_in, xn.data(), rows_in, b, e, rows_in_v);
      sync();
      // 2. q, k, v (a fused forward's draft rows through the draft view's)
      linear(rows_in, {weight(L.packed_in[0], L.bias_in[0], nq, q.data()), weight(L.packed_in[1], L.bias_in[1], nk, k.data()),
                       weight(L.packed_in[2], L.bias_in[2], nk, v.data())}, t, threads, step, rows_in_v,
             {weight(D.packed_in[0], D.bias_in[0], nq, q.data() + nv * nq), weight(D.packed_in[1], D.bias_in[1], nk, k.data() + nv * nk),
              weight(D.packed_in[2], D.bias_in[2], nk, v.data() + nv * nk)});
      sync();
      // 3. by (row, head): q/k norms (the kernel's), rotary (ATen's rounding), keys and values into the cache
      share(m * (heads + kvh), t, threads, 1, b, e);
      {
        const FlushDenormals flush;
        for (int64_t i = b; i < e; ++i) {
          const int64_t r = i / (heads + kvh), h = i % (heads + kvh);
          const bool is_q = h < heads;
          const T* src = is_q ? q.data() + r * nq + h * hd : k.data() + r * nk + (h - heads) * hd;
          const Stack::Layer& V = r < nv ? L : D;
          const at::Tensor& w = is_q ? V.q_norm : V.k_norm;
          T* dst = kn.data() + i * hd;
          if (w.numel()) rms_row(src, w.data_ptr<T>(), hd, static_cast<float>(V.qk_eps), dst);
          else std::copy(src, src + hd, dst);
        }
      }
      FloatMode::set(caller_mode);
      for (int64_t i = b; i < e; ++i) {
        const int64_t r = i / (heads + kvh), h = i % (heads + kvh);
        T* dst = h < heads ? qr.data() + (r * heads + h) * hd : kc + (h - heads) * ks + (n + r) * hd;
        rotary_head(kn.data() + i * hd, cos + r * hd, sin + r * hd, hd, dst);
        if (h >= heads) {
          write_tile(tc, tcap, h - heads, n + r, static_cast<const T*>(dst), hd);
          const T* vs = v.data() + r * nk + (h - heads) * hd;
          std::copy(vs, vs + hd, vc + (h - heads) * ks + (n + r) * hd);
        }
      }
      // the tiles of positions other code wrote since they were made, from the cache's keys
      const int64_t stale = n - std::min(valid[l], n);
      share(kvh * stale, t, threads, 1, b, e);
      for (int64_t i = b; i < e; ++i) {
        const int64_t kv = i / stale, pos = n - stale + i % stale;
        write_tile(tc, tcap, kv, pos, static_cast<const T*>(kc + kv * ks + pos * hd), hd);
      }
      sync();
      // 4. attention over the first n + m positions
      const int64_t keys_n = n + m, tiles_n = (keys_n + LANES - 1) / LANES, dp = (hd + LANES - 1) / LANES * LANES;
      float* kt = nullptr;
#if !defined(LOSSLESS_V16_AVX512)
      kt = kt_build.data();
      share(kvh * tiles_n, t, threads, 1, b, e);
      build_tiles(static_cast<const T*>(kc), ks, keys_n, hd, tiles_n, b, e, kt);
      sync();
#endif
      const Attention<T> plan = Attention<T>{qr.data(), kc, vc, a.data(), kt, ks, ks, heads, hd, dp, kvh, heads / kvh,
                                             keys_n, tiles_n, 1, 1, static_cast<float>(L.scaling), &seen, tc, tstride}
                                    .with_items(m, threads);
      if (plan.split) {
        const std::array<int64_t, 4> shape = plan.shared_shape();
        if (shape != split_shape) {  // the same on every thread: the plan is
          split_shape = shape;
          if (t == 0) split_scratch.size_for(plan);
          sync();
        }
        for (int pass = 0; pass < 3; ++pass) {
          share(plan.split_units(pass), t, threads, 1, b, e);
          {
            const FlushDenormals flush;
            for (int64_t i = b; i < e; ++i) plan.split_unit(pass, i, scratch, split_scratch);
          }
          sync();
        }
      } else {
        share(plan.items(), t, threads, 1, b, e);
        {
          const FlushDenormals flush;
          for (int64_t i = b; i < e; ++i) plan.item(i, scratch);
        }
        sync();
      }
      // 5. o's input
      share(m * rows_a.steps, t, threads, 1, b, e);
      {
        const int64_t split = views ? nv * rows_a.steps : e;  // a fused forward's draft rows from here
        rows_a.fill_flat(a.data(), b, std::min(e, split));
        if (e > split) rows_a_d.fill_flat(a.data() + nv * nq, std::max(b, split) - split, e - split);
      }
      sync();
      // 6. o (the draft rows' through the draft view's)
      linear(rows_a, {weight(L.packed_out[0], L.bias_out[0], hidden, o.data())}, t, threads, step,
             views ? &rows_a_d : nullptr, {weight(D.packed_out[0], D.bias_out[0], hidden, o.data() + nv * hidden)});
      sync();
      // 7. residual, post-attention norm, by rows
      share(m, t, threads, 1, b, e);
      residual_norm(o.data(), L.norm_out, L.eps_out, xn.data(), rows_h, b, e);
      sync();
      // 8. gate and up
      linear(rows_h, {weight(L.packed_out[1], L.bias_out[1], inter, g.data()),
                      weight(L.packed_out[2], L.bias_out[2], inter, u.data())}, t, threads, step);
      sync();
      // 9. SiLU(gate) (the kernel's) * up (ATen's rounding), and down's input, by pair steps of the rows (bf16: two
      // steps at a time, the four inputs of a group, as the columns computed here are a range)
      share(m * rows_act.steps, t, threads, PAIRED<T> ? 2 : 1, b, e);
      {
        const int64_t per = PAIRED<T> ? 2 : 1, steps = rows_act.steps;  // columns per step
        for (int64_t s0 = b; s0 < e;) {  // the steps of one row at a time
          const int64_t r = s0 / steps, s1 = std::min(e, (r + 1) * steps);
          const int64_t col0 = r * inter + (s0 - r * steps) * per, col1 = r * inter + std::min(inter, (s1 - r * steps) * per);
          {
            const FlushDenormals flush;
            silu_many(g.data() + col0, col1 - col0, act.data() + col0);
          }
          FloatMode::set(caller_mode);
          combine_rounded<false>(act.data() + col0, u.data() + col0, col1 - col0, act.data() + col0);
          rows_act.fill(act.data(), r, s0 - r * steps, s1 - r * steps);
          s0 = s1;
        }
      }
      sync();
      // 10. down
      linear(rows_act, {weight(L.packed_out[3], L.bias_out[3], hidden, d.data())}, t, threads, step);
      sync();
    }
    // the last layer's MLP residual
    share(m, t, threads, 1, b, e);
    FloatMode::set(caller_mode);
    combine_rounded<true>(x.data() + b * hidden, d.data() + b * hidden, (e - b) * hidden, x.data() + b * hidden);
  }
};

template <typename T>
at::Tensor stack_forward(const Stack& s, const Stack* draft, int64_t verify, const at::Tensor& x, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& visible, const std::vector<at::Tensor>& keys,
                         const std::vector<at::Tensor>& values, const std::vector<at::Tensor>& tiles,
                         const std::vector<int64_t>& valid, int64_t n, const c10::optional<at::Tensor>& norm,
                         double norm_eps) {
  StackRun<T> run(s, draft, verify, x, cos, sin, visible, keys, values, tiles, valid, n);
  const int64_t m = run.m;
  int64_t inter = 0, nq = 0;
  for (size_t l = 0; l < s.layers.size(); ++l) {
    const Stack::Layer& L = s.layers[l];
    const Stack::Layer& D = draft ? draft->layers[l] : L;
    inter = std::max(inter, L.n_out[1]);
    nq = std::max(nq, L.n_in[0]);
    const auto panels = [](const std::vector<at::Tensor>& p, size_t a, size_t b) {
      int64_t sum = 0;
      for (size_t i = a; i < b; ++i) sum += p[i].size(0);
      return sum;
    };
    const int64_t twice = draft ? 1 : 0;  // a fused forward's q/k/v and o steps take the draft view's panels too
    for (const int64_t step : {panels(L.packed_in, 0, 3) + twice * panels(D.packed_in, 0, 3),
                               panels(L.packed_out, 0, 1) + twice * panels(D.packed_out, 0, 1), panels(L.packed_out, 1, 3),
                               panels(L.packed_out, 3, 4)})  // a claim's word holds 24 bits of panels
      TORCH_CHECK(step < (int64_t{1} << 24), "Stack.forward: a linear step of 2^24 panels or more");
  }
  const bool tiled = s.tiled || (draft != nullptr && draft->tiled);  // (see Rows::resize)
  run.rows_in.resize(run.nv, run.hidden, tiled);
  run.rows_h.resize(m, run.hidden, tiled);
  run.rows_a.resize(run.nv, nq, tiled);
  run.rows_act.resize(m, inter, tiled);
  if (draft != nullptr) {
    run.rows_in_d.resize(m - run.nv, run.hidden, tiled);
    run.rows_a_d.resize(m - run.nv, nq, tiled);
  }
  const int threads = std::max(1, at::get_num_threads());
  run.claims = std::make_unique<typename StackRun<T>::Claim[]>(static_cast<size_t>(threads));
  run.counts = std::make_unique<typename StackRun<T>::Count[]>(static_cast<size_t>(threads));
#pragma omp parallel num_threads(threads)
  {
    const uint64_t own = FloatMode::get();
#pragma omp single
    run.barrier.n = omp_get_num_threads();
    run.run(omp_get_thread_num(), omp_get_num_threads());
    FloatMode::set(own);
  }
  StackCounts& counted = stack_counted();
  counted.threads = run.barrier.n;
  counted.panels = counted.taken = 0;
  for (int t = 0; t < run.barrier.n; ++t) {
    counted.panels += run.counts[t].panels;
    counted.taken += run.counts[t].taken;
  }
  if (!norm.has_value()) return at::from_blob(run.x.data(), {m, run.hidden}, x.options()).clone();
  // the model's final norm over the last layer's rows: `rms_norm`'s rows, as the norm module would compute them
  at::Tensor out = at::empty({m, run.hidden}, x.options());
  const T* xs = run.x.data();
  const T* w = norm->data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, m, 8, [&](int64_t i0, int64_t i1) {
    const FlushDenormals flush_here;
    for (int64_t i = i0; i < i1; ++i) rms_row(xs + i * run.hidden, w, run.hidden, static_cast<float>(norm_eps), o + i * run.hidden);
  });
  return out;
}

at::Tensor Stack::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& visible, const std::vector<at::Tensor>& keys,
                          const std::vector<at::Tensor>& values, const std::vector<at::Tensor>& tiles,
                          const std::vector<int64_t>& valid, int64_t n, const c10::optional<at::Tensor>& norm,
                          double norm_eps) const {
  return run(nullptr, x.size(0), x, cos, sin, visible, keys, values, tiles, valid, n, norm, norm_eps);
}

// A fused forward: the first `verify` rows through these layers (the AR view), the rest through `draft`'s q/k/v,
// q/k norms and o (the draft view) and these layers' norms and MLP, which the two views share. Every row's keys
// and values are written at its position n + r, the draft rows' past the verify rows (the caller keeps n + verify).
at::Tensor Stack::forward_views(const Stack& draft, int64_t verify, const at::Tensor& x, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& visible, const std::vector<at::Tensor>& keys,
                                const std::vector<at::Tensor>& values, const std::vector<at::Tensor>& tiles,
                                const std::vector<int64_t>& valid, int64_t n,
                                const c10::optional<at::Tensor>& norm, double norm_eps) const {
  TORCH_CHECK(x.dim() == 2 && verify >= 1 && verify <= x.size(0), "Stack.forward_views: 1 to all rows verified");
  TORCH_CHECK(draft.layers.size() == layers.size(), "Stack.forward_views: a draft view of every layer");
  for (size_t l = 0; l < layers.size(); ++l) {
    const Layer& L = layers[l];
    const Layer& D = draft.layers[l];
    bool shared = D.n_in == L.n_in && D.n_out == L.n_out && D.head_dim == L.head_dim && D.scaling == L.scaling &&
                  D.norm_in.is_same(L.norm_in) && D.norm_out.is_same(L.norm_out) && D.eps_in == L.eps_in &&
                  D.eps_out == L.eps_out;
    for (size_t i = 1; i < 4; ++i) shared = shared && D.packed_out[i].is_same(L.packed_out[i]) && D.bias_out[i].is_same(L.bias_out[i]);
    TORCH_CHECK(shared, "Stack.forward_views: the draft view shares each layer's shapes, norms and MLP");
  }
  return run(&draft, verify, x, cos, sin, visible, keys, values, tiles, valid, n, norm, norm_eps);
}

at::Tensor Stack::run(const Stack* draft, int64_t verify, const at::Tensor& x, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& visible, const std::vector<at::Tensor>& keys,
                      const std::vector<at::Tensor>& values, const std::vector<at::Tensor>& tiles,
                      const std::vector<int64_t>& valid, int64_t n,
                      const c10::optional<at::Tensor>& norm, double norm_eps) const {
  TORCH_CHECK(!layers.empty(), "Stack.forward: no layers");
  const Layer& first = layers[0];
  const int64_t m = x.size(0), d = first.head_dim, kvh = first.n_in[1] / d;
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == first.norm_in.size(0) && x.scalar_type() == first.norm_in.scalar_type(),
              "Stack.forward: x [rows, hidden] of the layers' dtype");
  for (const at::Tensor* t : {&cos, &sin}) {
    check_cpu(*t, "cos/sin");
    TORCH_CHECK(t->dim() == 2 && t->size(0) == m && t->size(1) == d && t->scalar_type() == x.scalar_type(),
                "Stack.forward: cos/sin [rows, head_dim] of x's dtype");
  }
  check_cpu(visible, "visible");
  TORCH_CHECK(n >= 0 && visible.scalar_type() == at::kBool && visible.dim() == 2 && visible.size(0) == m &&
                  visible.size(1) == n + m, "Stack.forward: visible [rows, cache + rows] bool");
  TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(),
              "Stack.forward: one key and one value buffer per layer");
  for (size_t l = 0; l < layers.size(); ++l)
    for (const at::Tensor* t : {&keys[l], &values[l]}) {
      check_cpu(*t, "cache buffer");
      TORCH_CHECK(t->dim() == 4 && t->size(0) == 1 && t->size(1) == kvh && t->size(2) >= n + m && t->size(3) == d &&
                      t->scalar_type() == x.scalar_type() && t->sizes() == keys[l].sizes(),
                  "Stack.forward: cache buffers [1, kv, cap >= cache + rows, head_dim] of x's dtype");
    }
  TORCH_CHECK(tiles.size() == layers.size() && valid.size() == layers.size(), "Stack.forward: key tiles and their "
              "valid length per layer");
  if (norm.has_value()) {
    check_cpu(*norm, "final norm weight");
    TORCH_CHECK(norm->dim() == 1 && norm->size(0) == x.size(1) && norm->scalar_type() == x.scalar_type(),
                "Stack.forward: a final norm weight [hidden] of x's dtype");
  }
  const int64_t steps = x.element_size() == 2 ? (d + 1) / 2 : d;
  for (size_t l = 0; l < layers.size(); ++l) {
    check_cpu(tiles[l], "key tiles");
    TORCH_CHECK(tiles[l].scalar_type() == at::kInt && tiles[l].dim() == 4 && tiles[l].size(0) == kvh &&
                    tiles[l].size(1) * 16 >= n + m && tiles[l].size(2) == steps && tiles[l].size(3) == 16 && valid[l] >= 0,
                "Stack.forward: key tiles [kv, tiles, steps, 16] int32 for cache + rows positions");
  }
  DISPATCH(x.scalar_type(), "Stack.forward",
           return stack_forward<scalar>(*this, draft, verify, x, cos, sin, visible, keys, values, tiles, valid, n, norm,
                                        norm_eps));
  return at::Tensor();
}
