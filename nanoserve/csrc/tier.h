// The tier this module is built for, chosen by the one macro native.py sets per build
// (NANOSERVE_TIER_AVX512, for the avx512 and the amx tiers): its block dot products and the
// kernels it adds, as `tier::`.
#pragma once

#ifdef NANOSERVE_TIER_AVX512
#include "tier_avx512.h"
#else
#include "tier_avx2.h"
#endif
