// Exact mode's `scalar` variant: plain loops with hardware fma (the compiler may vectorise them: lane-wise, the
// same bits), on x86-64 and, alone, everywhere else. The kernels are exact_isa.h's, in their own namespace.

#include "exact_common.h"

#if defined(LOSSLESS_X86)
#pragma GCC push_options
#pragma GCC target("fma")
#endif
namespace isa_scalar {
#include "exact_isa.h"
}  // namespace isa_scalar
#if defined(LOSSLESS_X86)
#pragma GCC pop_options
#endif

