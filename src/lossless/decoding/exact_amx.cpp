// Exact mode's `amx` variant: avx512bf16's kernels, with bf16 calls of enough rows
// on AMX tiles (inline assembly).
// The kernels are exact_isa.h's, built here in their own namespace under their own target: one translation
// unit per variant, so the variants compile in parallel.

#include "exact_common.h"

#if defined(LOSSLESS_X86)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2")
namespace isa_amx {
#define LOSSLESS_V16_AVX512 1
#define LOSSLESS_DPBF16 1
#define LOSSLESS_AMX 1
#include "exact_isa.h"
}  // namespace isa_amx
#pragma GCC pop_options
#endif
