// The flags of the device status word: one uint32 per device (fp4kit/runtime/status.py owns it)
// that kernels atomicOr these into instead of stopping the decode loop; the caller reads it when
// it chooses. The one list on the device side: status.py names the same flags with the same
// values for Python, and a CPU test checks that the two lists agree.
#pragma once

#define FP4_STATUS_NONFINITE_INPUT 1u        // a NaN or Inf reached an NVFP4 encoder (fp4kit.check_finite)
#define FP4_STATUS_INDEXER_INPUT 2u          // a NaN live indexer score, or a length outside [0, capacity]
#define FP4_STATUS_KV_COMP_OVERFLOW 4u       // a compressed-KV entry was dropped: its buffer was full
#define FP4_STATUS_SAMPLER_INPUT 8u          // a NaN/+Inf logit, a row without a finite one, a bad parameter
#define FP4_STATUS_TOKEN_RANGE 16u           // a token id outside [0, vocab) (row 0 was read instead)
#define FP4_STATUS_KV_INPUT 32u              // a KV count, position or compressed length out of range (clamped)
#define FP4_STATUS_EP_CAPACITY_OVERFLOW 256u // expert-parallel pairs beyond the all-to-all capacity, dropped
#define FP4_STATUS_MOE_DISPATCH 512u         // routed counts or tickets not this call's (rows clamped, no expert run)
