// What every translation unit of exact mode's kernels shares (see exact_kernels.cpp): the headers, the
// thread and float-mode helpers the kernels run under and the argument checks. Each variant's file includes this
// before its `#pragma GCC target`, so nothing here is built for instructions the CPU may lack.

#pragma once

#include <ATen/ATen.h>  // not torch/extension.h: the variants' files need no Python (and compile faster)
#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#define LOSSLESS_X86 1
#endif

// One definition for every file (inline): what the variants share is built for any CPU, before their targets.
namespace exact_shared {

constexpr float CANONICAL_NAN = __builtin_bit_cast(float, 0x7FC00000u);

// FTZ and DAZ for the lifetime of this object in this thread, then the caller's mode again.
struct FlushDenormals {
#if defined(LOSSLESS_X86)
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved); }
#elif defined(__aarch64__)
  uint64_t saved;
  FlushDenormals() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved | (1ull << 24)));  // FZ: inputs and results
  }
  ~FlushDenormals() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved)); }
#else
#error "exact mode's kernels need x86-64 or AArch64 (a defined denormal rule)"
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// The floating-point mode of the calling thread (MXCSR; AArch64: FPCR), to run other threads' elementwise work
// under the rules ATen's ops would have in the caller.
struct FloatMode {
#if defined(LOSSLESS_X86)
  static uint64_t get() { return _mm_getcsr(); }
  static void set(uint64_t m) { _mm_setcsr(static_cast<unsigned>(m)); }
#else
  static uint64_t get() { uint64_t m; __asm__ __volatile__("mrs %0, fpcr" : "=r"(m)); return m; }
  static void set(uint64_t m) { __asm__ __volatile__("msr fpcr, %0" : : "r"(m)); }
#endif
};

// A barrier for the threads of one parallel region: each waits, spinning, until all n have arrived. `local`
// is the waiting thread's own sense (starts at 0).
struct SpinBarrier {
  std::atomic<int> count{0}, sense{0};
  int n = 1;
  void wait(int& local) {
    local ^= 1;
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count.store(0, std::memory_order_relaxed);
      sense.store(local, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; sense.load(std::memory_order_acquire) != local; ++spins) {
#if defined(LOSSLESS_X86)
      _mm_pause();
#else
      __asm__ __volatile__("yield");
#endif
      if (spins > 100000) std::this_thread::yield();  // more threads than cores: let the others run
    }
  }
};

inline void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

// a bf16 weight packed in AMX's tile layout, [panels, chunks, 16, 32]: chunk c of panel p one B tile of
// TDPBF16PS (row i, lane l: inputs 32c + 2i low and 32c + 2i + 1 high of output 16p + l); the same bits as pair
// steps [panels, steps, 32] through every path, faster on AMX tiles, which read it in place
inline bool tile_layout(const at::Tensor& packed) {
  return packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 16 && packed.size(3) == 32;
}

inline void check_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  check_cpu(packed, "packed weight");
  TORCH_CHECK(x.dim() == 2 && (packed.dim() == 3 || tile_layout(packed)) && packed.size(0) * 16 >= n,
              "linear: x [m, k] and a packed weight [panels, steps, 16 or 32] or [panels, chunks, 16, 32] for n outputs");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: x and weight must share a dtype");
  if (bias.has_value()) check_cpu(*bias, "bias");
}

// key/value [kv, n, d]: rows of d contiguous, one after another; any stride between kv heads (a cache that grows
// in place holds each head's rows in a longer buffer)
inline void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)), what,
              " must hold its rows contiguously");
}

inline void check_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& visible) {
  for (auto* t : {&query, &visible}) check_cpu(*t, "attention input");
  check_rows(key, "attention key");
  check_rows(value, "attention value");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(), "attention: q [q,h,d], k/v [kv,n,d]");
  TORCH_CHECK(query.size(1) % key.size(0) == 0 && query.size(2) == key.size(2), "attention: head shapes");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.size(0) == query.size(0) && visible.size(1) == key.size(1),
              "attention: visible [q, n] bool");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(), "attention: dtypes");
}

inline void check_rms_norm(const at::Tensor& x, const at::Tensor& w) {
  check_cpu(x, "x");
  check_cpu(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm: x [m, c], weight [c]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and weight must share a dtype");
}

// Storage that starts at a 64-byte line (a std::vector's allocator): rows laid out in whole lines then fill whole
// lines, so threads writing different rows never write one line
template <typename U>
struct LineAligned {
  using value_type = U;
  LineAligned() = default;
  template <typename V>
  LineAligned(const LineAligned<V>&) {}
  U* allocate(size_t n) { return static_cast<U*>(::operator new(n * sizeof(U), std::align_val_t(64))); }
  void deallocate(U* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename V>
  bool operator==(const LineAligned<V>&) const { return true; }
  template <typename V>
  bool operator!=(const LineAligned<V>&) const { return false; }
};

#define DISPATCH(dtype, NAME, ...)                                                       \
  switch (dtype) {                                                                       \
    case at::kFloat: { using scalar = float; __VA_ARGS__; break; }                       \
    case at::kBFloat16: { using scalar = at::BFloat16; __VA_ARGS__; break; }             \
    case at::kHalf: { using scalar = at::Half; __VA_ARGS__; break; }                     \
    default: TORCH_CHECK(false, NAME ": fp32, bf16 or fp16 only");                      \
  }

}  // namespace exact_shared
