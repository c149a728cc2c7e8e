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
// - Variants side by side. `exact_isa.h` holds the kernels once and is compiled five times, once in each
//   variant's file (exact_<variant>.cpp, its own translation unit, so the build runs them in parallel), each in its
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

#include "exact_common.h"
#include <torch/extension.h>
#include <cstring>
#include <string>

// Each variant's entry points, declared (defined in its own file, exact_<variant>.cpp, its own translation unit)
#if defined(LOSSLESS_X86)
namespace isa_amx {
#include "exact_api.h"
}
namespace isa_avx512bf16 {
#include "exact_api.h"
}
namespace isa_avx512 {
#include "exact_api.h"
}
namespace isa_avx2 {
#include "exact_api.h"
}
#endif
namespace isa_scalar {
#include "exact_api.h"
}

// The Python submodule of variant NS: its entry points (`isa_NS`, defined in exact_NS.cpp)
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
    sub.def("choices", &isa_##NS::choices, "per row: the n largest logits' ids (and softmax probabilities)");    \
    sub.def("stream", &isa_##NS::stream, "read every byte of the tensors once (the memory floor); an OR of them");  \
    sub.def("choose_bf16_path", &isa_##NS::choose_bf16_path, "time both bf16 paths once, take the faster (same bits)"); \
    sub.def("product_rates", &isa_##NS::product_rates, "this core's dot-product and fma instructions a second (or none)"); \
    sub.def("set_tall_blocks", &isa_##NS::set_tall_blocks, "bf16 calls of many rows in tall blocks (speed only)"); \
    sub.def("bf16_widened", &isa_##NS::bf16_widened, "whether bf16 products run as widened fp32 fmas");         \
    sub.def("set_widen_bf16", &isa_##NS::set_widen_bf16, "bf16 products as widened fp32 fmas (True) or dot products"); \
    sub.def("set_stack_stall", &isa_##NS::set_stack_stall, "Stack: its last thread waits before each linear step (tests)"); \
    sub.def("stack_counts", &isa_##NS::stack_counts, "Stack: the last forward's threads, panels, panels taken");   \
    sub.def("layer_in", &isa_##NS::layer_in, "a decoder layer up to the cache: norm, q/k/v, q/k norms, rotary");  \
    sub.def("layer_out", &isa_##NS::layer_out, "a decoder layer from attention on: o, residual, norm, MLP");        \
    pybind11::class_<isa_##NS::Stack>(sub, "Stack", "every decoder layer of a forward in one call")               \
        .def(pybind11::init<>())                                                                                  \
        .def("add", &isa_##NS::Stack::add, "append a layer (layer_in's and layer_out's arguments)")               \
        .def("__len__", [](const isa_##NS::Stack& s) { return s.layers.size(); })                                  \
        .def("forward", &isa_##NS::Stack::forward, "all layers over rows at cache positions n..",                 \
             pybind11::call_guard<pybind11::gil_scoped_release>())                                               \
        .def("forward_views", &isa_##NS::Stack::forward_views,                                                    \
             "a fused forward: verify rows through these layers, the rest through a draft view's",               \
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

// Rows `ids` of the weight [n, k] that kernels.pack_weight packed, gathered from its panels (a copy: the same bits
// as unpacking the weight and looking the rows up), ids in any shape -> [ids, k]. bf16 panels [p, kp/2, 32] hold
// pair steps: lane l's pair of step s at 2l (low) and 2l + 1 (high), inputs 4q..4q+3 as (4q+2 low, 4q high) in step
// 2q and (4q+3 low, 4q+1 high) in step 2q + 1; others [p, k, 16], input j of lane l at [j, l].
static torch::Tensor embedding_rows(const torch::Tensor& packed, const torch::Tensor& ids, int64_t n, int64_t k) {
  const bool tiled = exact_shared::tile_layout(packed);  // [p, chunks, 16, 32]: input j of lane l at [j / 32, j % 32 / 2, l, j % 2]
  TORCH_CHECK((tiled || (packed.dim() == 3 && packed.size(2) == 16 * (packed.scalar_type() == torch::kBFloat16 ? 2 : 1))) &&
                  packed.is_contiguous(), "embedding_rows: packed panels expected");
  TORCH_CHECK(packed.device().is_cpu() && ids.device().is_cpu(), "embedding_rows: CPU tensors expected");
  TORCH_CHECK(!ids.is_floating_point() && !ids.is_complex(), "embedding_rows: token ids must be integers");
  auto flat = ids.reshape({-1}).to(torch::kLong).contiguous();
  const int64_t m = flat.numel(),* id = flat.data_ptr<int64_t>(), panels = packed.size(0),
                steps = tiled ? packed.size(1) * 16 : packed.size(1);
  for (int64_t i = 0; i < m; ++i)
    if (id[i] < 0 || id[i] >= n || id[i] / 16 >= panels)
      throw pybind11::index_error("token ids must lie in 0.." + std::to_string(n - 1));
  auto out = torch::empty({m, k}, packed.options());
  if (packed.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(2 * steps >= k, "embedding_rows: panels shorter than the rows");
    const uint16_t* base = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t i = 0; i < m; ++i) {
      const uint16_t* lane = base + (id[i] / 16) * steps * 32 + (id[i] % 16) * 2;
      for (int64_t j = 0; j < k; ++j)
        dst[i * k + j] = tiled ? lane[j / 2 * 32 + (j & 1)] : lane[(2 * (j / 4) + (j & 1)) * 32 + ((j & 3) < 2 ? 1 : 0)];
    }
  } else {
    TORCH_CHECK(steps >= k, "embedding_rows: panels shorter than the rows");
    const int64_t size = packed.element_size();
    const char* base = static_cast<const char*>(packed.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t i = 0; i < m; ++i) {
      const char* lane = base + ((id[i] / 16) * steps * 16 + id[i] % 16) * size;
      for (int64_t j = 0; j < k; ++j)
        std::memcpy(dst + (i * k + j) * size, lane + j * 16 * size, size);
    }
  }
  return out;
}

// A tree's accepted path moved into place in a cache's buffers: in every tensor [b, h, cap, d] (contiguous), the
// entries at positions start + rows[j] copied to start + j, rows rising with rows[j] >= j (so no entry is written
// before it is read). Bytes only; each tensor's version moves on, as a write from Python would.
static void move_rows(const std::vector<torch::Tensor>& tensors, int64_t start, const std::vector<int64_t>& rows) {
  for (size_t j = 0; j < rows.size(); ++j)
    TORCH_CHECK(rows[j] >= static_cast<int64_t>(j) && (j == 0 || rows[j] > rows[j - 1]),
                "move_rows: rows must rise, each at or after its place");
  TORCH_CHECK(start >= 0, "move_rows: start must be >= 0");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor& t = tensors[i];
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 4, "move_rows: contiguous CPU [b, h, cap, d] tensors");
    TORCH_CHECK(rows.empty() || start + rows.back() < t.size(2), "move_rows: a row past the buffer's end");
    const char* a = static_cast<const char*>(t.data_ptr());
    for (size_t j = 0; j < i; ++j) {  // each buffer once: rows moved twice in one would be lost
      const char* b = static_cast<const char*>(tensors[j].data_ptr());
      TORCH_CHECK(a + t.nbytes() <= b || b + tensors[j].nbytes() <= a, "move_rows: buffers that overlap");
    }
  }
  for (const torch::Tensor& t : tensors) {
    const int64_t planes = t.size(0) * t.size(1), cap = t.size(2), bytes = t.size(3) * t.element_size();
    char* base = static_cast<char*>(t.data_ptr());
    for (int64_t p = 0; p < planes; ++p) {
      char* plane = base + p * cap * bytes;
      for (size_t j = 0; j < rows.size(); ++j)
        if (rows[j] != static_cast<int64_t>(j))
          std::memcpy(plane + (start + j) * bytes, plane + (start + rows[j]) * bytes, bytes);
    }
    t.unsafeGetTensorImpl()->bump_version();
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("request_amx", &request_amx, "ask Linux for the AMX tile state: '' when granted, else why not");
  m.def("embedding_rows", &embedding_rows, "rows of a packed weight gathered from its panels (the same bits)");
  m.def("move_rows", &move_rows, "a tree's accepted rows moved into place in cache buffers [b, h, cap, d]");
#if defined(LOSSLESS_X86)
  LOSSLESS_DEF_VARIANT(m, amx);
  LOSSLESS_DEF_VARIANT(m, avx512bf16);
  LOSSLESS_DEF_VARIANT(m, avx512);
  LOSSLESS_DEF_VARIANT(m, avx2);
#endif
  LOSSLESS_DEF_VARIANT(m, scalar);
}
