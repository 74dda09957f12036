/* The native checked copy's kernel (dkv/_checked_copy.c): shared by the builds of it for each instruction set. */
#ifndef DKV_CHECKED_COPY_H
#define DKV_CHECKED_COPY_H

#include <stdatomic.h>
#include <stddef.h>

typedef struct {
    const char *src;    /* the block's slot in the mapped segment */
    char *dest;         /* the caller's destination, as long as the block */
    size_t len;
    const char *prefix; /* the checksum's identity prefix (dkv.checksum.block_prefix) */
    size_t prefix_len;
} dkv_block;

#define DKV_CHECKSUM_SIZE 16

/* Copy each block's src into its dest and write XXH3-128(prefix || dest), canonical (big-endian), to
 * out + 16 * i. Called without the GIL. One build per instruction set: the same output. */
void dkv_copy_hash_generic(const dkv_block *blocks, size_t n, unsigned char *out);
void dkv_copy_hash_avx2(const dkv_block *blocks, size_t n, unsigned char *out);
int dkv_avx2_built(void); /* 1 when dkv_copy_hash_avx2 really is built for AVX2 */

/* Receive each block's len bytes into its dest, back to back from the stream socket fd, hashing each
 * (XXH3-128 of prefix || bytes) as its bytes land, a piece at a time while they are in cache; verdicts[i] is 1
 * where the digest equals expected + 16 * i, else 0. ``first`` (``first_len`` bytes) were read from the stream
 * already and begin the blocks' bytes. Waits (poll) until deadline_ns on CLOCK_MONOTONIC. Returns 0 once every
 * block is in; -ETIMEDOUT past the deadline, -EPIPE when the peer ended the stream, -errno when a receive
 * failed (the blocks after the one it was in hold nothing). Called without the GIL; src is not used. */
int dkv_recv_hash_generic(int fd, const dkv_block *blocks, size_t n, const unsigned char *expected,
                          unsigned char *verdicts, const char *first, size_t first_len, long long deadline_ns);
int dkv_recv_hash_avx2(int fd, const dkv_block *blocks, size_t n, const unsigned char *expected,
                       unsigned char *verdicts, const char *first, size_t first_len, long long deadline_ns);

/* Blocks at least this long are copied through a staging buffer and streamed to their destinations with
 * non-temporal stores (see the kernel): dkv_stream_min, DKV_STREAM_MIN unless set_stream_min() changed it. */
#define DKV_STREAM_MIN (64 * 1024)
extern atomic_size_t dkv_stream_min; /* read per block by copying threads, set by set_stream_min() */

#endif
