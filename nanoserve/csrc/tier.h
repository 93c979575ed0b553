// The tier this module is built for, chosen by the one macro native.py sets per build
// (NANOSERVE_TIER_AVX512, for the avx512 and the amx tiers; NANOSERVE_TIER_AVXVNNI): its block
// dot products and the kernels it adds, as `tier::`.
#pragma once

#if defined(NANOSERVE_TIER_AVX512)
#include "tier_avx512.h"
#elif defined(NANOSERVE_TIER_AVXVNNI)
#include "tier_avxvnni.h"
#else
#include "tier_avx2.h"
#endif
