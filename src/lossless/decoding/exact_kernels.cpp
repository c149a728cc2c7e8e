// Batch-invariant CPU kernels for exact mode (built by kernels.py), the same bits on every CPU.
//
// Every output element is computed by one fixed sequence of IEEE operations that depends only on the
// inputs it reads: the row count of a call, a row's place in it, the other rows, the thread count and the
// vector width of the CPU never change it. That is what makes a verify block's rows bitwise equal to the
// same rows decoded one at a time, trees and fused forwards included.
//
// How: every output is one chain of operations in a fixed order. An fp32 or fp16 linear output is one fma chain
// over its inputs in order; a bf16 one follows the order of AMX's tile dot product (per chunk of 32 inputs, an
// fma chain over the chunk's even inputs and one over its odd inputs, each from +0, then sum + (even + odd)),
// which AMX computes in hardware and every other variant with the same roundings (weights packed in panels of 16
// outputs, so 16 chains advance side by side in one vector); an attention score is one fma chain over the head
// dim (16 keys side by side), an attention output one fma chain over the visible keys in cache order; a sum over
// keys or a norm's sum of squares runs over a logical 16-lane accumulator (lane l takes elements l, l+16, ..., the
// lanes then added in a fixed tree), elements past the end counting as zeros; exp is our own polynomial. `V16` does
// every lane operation correctly rounded (fma included) whether it maps to one AVX-512 register, two AVX2 registers
// or a plain loop, and the file is built with -ffp-contract=off and without -ffast-math (no reassociation, no fused
// multiply-add but the explicit ones); blocking and threading only decide which chains advance together.
//
// Three rules make those chains give the same bits on every machine, not only within one:
// - Variants side by side. `exact_isa.h` holds the kernels once and is compiled here five times, each in its
//   own namespace under its own `#pragma GCC target`: amx (avx512bf16's kernels, bf16 calls of enough rows on AMX
//   tiles), avx512bf16 (AVX-512 with the BF16 dot product), avx512, avx2 and scalar (plain loops; hardware fma).
//   Python picks one per call (LOSSLESS_EXACT_ISA), so any machine can run, and the tests compare, every variant
//   its CPU can execute; AMX's own recorded outputs check the order on machines without it.
// - One denormal rule: subnormal inputs read as zero and subnormal results are flushed to zero (sign kept).
//   It is the rule VDPBF16PS applies whatever MXCSR says; every kernel sets MXCSR's FTZ and DAZ bits in the
//   thread that does the work (inside each parallel chunk, restored after), so the plain fmas of the other
//   variants follow it too: under it the emulated bf16 pair (two fmas) gives the instruction's bits,
//   checked on two million adversarial pairs (subnormal inputs, products and sums, huge values).
// - A NaN output is the canonical quiet NaN: instruction paths propagate different NaN payloads.
// Outside x86-64 only the scalar variant is built, with the FZ bit of AArch64's FPCR as the denormal rule.

#include <torch/extension.h>
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

namespace {

const float CANONICAL_NAN = __builtin_bit_cast(float, 0x7FC00000u);

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

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

void check_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  check_cpu(packed, "packed weight");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(0) * 16 >= n,
              "linear: x [m, k] and a packed weight [panels, steps, 16 or 32] for n outputs");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: x and weight must share a dtype");
  if (bias.has_value()) check_cpu(*bias, "bias");
}

// key/value [kv, n, d]: rows of d contiguous, one after another; any stride between kv heads (a cache that grows
// in place holds each head's rows in a longer buffer)
void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)), what,
              " must hold its rows contiguously");
}

void check_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& visible) {
  for (auto* t : {&query, &visible}) check_cpu(*t, "attention input");
  check_rows(key, "attention key");
  check_rows(value, "attention value");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(), "attention: q [q,h,d], k/v [kv,n,d]");
  TORCH_CHECK(query.size(1) % key.size(0) == 0 && query.size(2) == key.size(2), "attention: head shapes");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.size(0) == query.size(0) && visible.size(1) == key.size(1),
              "attention: visible [q, n] bool");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(), "attention: dtypes");
}

void check_rms_norm(const at::Tensor& x, const at::Tensor& w) {
  check_cpu(x, "x");
  check_cpu(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm: x [m, c], weight [c]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and weight must share a dtype");
}

#define DISPATCH(dtype, NAME, ...)                                                       \
  switch (dtype) {                                                                       \
    case at::kFloat: { using scalar = float; __VA_ARGS__; break; }                       \
    case at::kBFloat16: { using scalar = at::BFloat16; __VA_ARGS__; break; }             \
    case at::kHalf: { using scalar = at::Half; __VA_ARGS__; break; }                     \
    default: TORCH_CHECK(false, NAME ": fp32, bf16 or fp16 only");                      \
  }

}  // namespace

#if defined(LOSSLESS_X86)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2")
namespace isa_amx {  // avx512bf16's kernels, with bf16 calls of enough rows on AMX tiles (inline assembly)
#define LOSSLESS_V16_AVX512 1
#define LOSSLESS_DPBF16 1
#define LOSSLESS_AMX 1
#include "exact_isa.h"
#undef LOSSLESS_AMX
#undef LOSSLESS_DPBF16
#undef LOSSLESS_V16_AVX512
}  // namespace isa_amx
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2")
namespace isa_avx512bf16 {
#define LOSSLESS_V16_AVX512 1
#define LOSSLESS_DPBF16 1
#include "exact_isa.h"
#undef LOSSLESS_DPBF16
#undef LOSSLESS_V16_AVX512
}  // namespace isa_avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
namespace isa_avx512 {
#define LOSSLESS_V16_AVX512 1
#include "exact_isa.h"
#undef LOSSLESS_V16_AVX512
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
namespace isa_avx2 {
#define LOSSLESS_V16_AVX2 1
#include "exact_isa.h"
#undef LOSSLESS_V16_AVX2
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("fma")  // plain loops (the compiler may vectorise them: lane-wise, the same bits)
namespace isa_scalar {
#include "exact_isa.h"
}  // namespace isa_scalar
#pragma GCC pop_options
#else
namespace isa_scalar {
#include "exact_isa.h"
}  // namespace isa_scalar
#endif

#define LOSSLESS_DEF_VARIANT(m, NS)                                                                               \
  do {                                                                                                            \
    auto sub = m.def_submodule(#NS);                                                                              \
    sub.def("linear_sums", &isa_##NS::linear_sums, "linear's fp32 product-sums, each chain from init [m, n]");     \
    sub.def("amx_min_rows", &isa_##NS::amx_min_rows, "the fewest rows a bf16 call runs on AMX tiles from (0: none)"); \
    sub.def("set_amx_rows", &isa_##NS::set_amx_rows, "AMX tiles from this many rows on (< 1: never); speed only");  \
    sub.def("set_tile_emulation", &isa_##NS::set_tile_emulation, "amx: tile instructions written out (tests)");     \
    sub.def("linear", &isa_##NS::linear, "x [m, k] @ weight[n, k]^T (+ bias) from a packed weight, each output one chain"); \
    sub.def("attention", &isa_##NS::attention, "softmax attention over each row's visible keys, in key order");   \
    sub.def("rms_norm", &isa_##NS::rms_norm, "Llama/Qwen RMSNorm, statistics in a fixed order");                  \
    sub.def("silu", &isa_##NS::silu, "x * sigmoid(x) with a fixed exp");                                          \
    sub.def("stream", &isa_##NS::stream, "read every byte of the tensors once (the memory floor); an OR of them");  \
    sub.def("choose_bf16_path", &isa_##NS::choose_bf16_path, "time both bf16 paths once, take the faster (same bits)"); \
    sub.def("set_tall_blocks", &isa_##NS::set_tall_blocks, "bf16 calls of many rows in tall blocks (speed only)"); \
    sub.def("bf16_widened", &isa_##NS::bf16_widened, "whether bf16 products run as widened fp32 fmas");         \
    sub.def("set_widen_bf16", &isa_##NS::set_widen_bf16, "bf16 products as widened fp32 fmas (True) or dot products"); \
    sub.def("layer_in", &isa_##NS::layer_in, "a decoder layer up to the cache: norm, q/k/v, q/k norms, rotary");  \
    sub.def("layer_out", &isa_##NS::layer_out, "a decoder layer from attention on: o, residual, norm, MLP");        \
    pybind11::class_<isa_##NS::Stack>(sub, "Stack", "every decoder layer of a forward in one call")               \
        .def(pybind11::init<>())                                                                                  \
        .def("add", &isa_##NS::Stack::add, "append a layer (layer_in's and layer_out's arguments)")               \
        .def("__len__", [](const isa_##NS::Stack& s) { return s.layers.size(); })                                  \
        .def("forward", &isa_##NS::Stack::forward, "all layers over rows at cache positions n..",                 \
             pybind11::call_guard<pybind11::gil_scoped_release>());                                              \
  } while (0)

// Ask Linux for the AMX tile state, once per process, before any thread uses a tile: "" when granted (or granted
// before), else why not, in a few words.
std::string request_amx() {
#if defined(LOSSLESS_X86) && defined(__linux__)
  constexpr long GET_PERM = 0x1022, REQ_PERM = 0x1023, XTILEDATA = 18;  // arch_prctl's ARCH_{GET,REQ}_XCOMP_PERM
  if (syscall(SYS_arch_prctl, REQ_PERM, XTILEDATA) != 0)
    return std::string("Linux refused the AMX tile state (arch_prctl: ") + std::strerror(errno) + ")";
  uint64_t granted = 0;
  if (syscall(SYS_arch_prctl, GET_PERM, &granted) != 0 || !(granted & (1ull << XTILEDATA)))
    return "Linux did not grant the AMX tile state";
  return "";
#else
  return "AMX tiles need Linux on x86-64";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("request_amx", &request_amx, "ask Linux for the AMX tile state: '' when granted, else why not");
#if defined(LOSSLESS_X86)
  LOSSLESS_DEF_VARIANT(m, amx);
  LOSSLESS_DEF_VARIANT(m, avx512bf16);
  LOSSLESS_DEF_VARIANT(m, avx512);
  LOSSLESS_DEF_VARIANT(m, avx2);
#endif
  LOSSLESS_DEF_VARIANT(m, scalar);
}
