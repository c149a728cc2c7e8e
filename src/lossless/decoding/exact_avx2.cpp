// Exact mode's `avx2` variant: AVX2: V16 as two registers.
// The kernels are exact_isa.h's, built here in their own namespace under their own target: one translation
// unit per variant, so the variants compile in parallel.

#include "exact_common.h"

#if defined(LOSSLESS_X86)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
namespace isa_avx2 {
#define LOSSLESS_V16_AVX2 1
#include "exact_isa.h"
}  // namespace isa_avx2
#pragma GCC pop_options
#endif
