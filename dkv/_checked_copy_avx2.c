/* The kernel built for AVX2, chosen at import where the CPU has it (256 x 64 KiB copied and hashed on one
 * thread: 1.29 ms against 1.59 ms for the generic build, measured in one run on the development machine).
 * GCC's target pragma defines __AVX2__ for what follows, so xxhash.h picks its AVX2 code; elsewhere (another
 * compiler, another architecture) this is the generic kernel under the AVX2 name and is never preferred. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("avx2")
#define DKV_HAVE_AVX2_BUILD 1
#endif

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "_checked_copy.h"

#define DKV_KERNEL dkv_copy_hash_avx2
#define DKV_RECV_KERNEL dkv_recv_hash_avx2
#include "_checked_copy_kernel.h"

int dkv_avx2_built(void) {
#ifdef DKV_HAVE_AVX2_BUILD
    return 1;
#else
    return 0;
#endif
}
