/* The kernel for any x86-64 (SSE2) or other target: XXH3's vector code as the compiler's flags allow. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "_checked_copy.h"

#define DKV_KERNEL dkv_copy_hash_generic
#define DKV_RECV_KERNEL dkv_recv_hash_generic
#include "_checked_copy_kernel.h"
