// Exact mode's `avx512` variant: AVX-512, bf16 products as fp32 fmas.
// The kernels are exact_isa.h's, built here in their own namespace under their own target: one translation
// unit per variant, so the variants compile in parallel.

#include "exact_common.h"

#if defined(LOSSLESS_X86)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
namespace isa_avx512 {
#define LOSSLESS_V16_AVX512 1
#include "exact_isa.h"
}  // namespace isa_avx512
#pragma GCC pop_options
#endif
