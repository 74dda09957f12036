/* The kernel's body, included once per instruction set with DKV_KERNEL naming it (after xxhash.h). */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define DKV_CHUNK (16 * 1024) /* copied, then hashed while it is still in L1/L2 */

#ifndef DKV_KERNEL_HELPERS
#define DKV_KERNEL_HELPERS
#if defined(__SSE2__)
/* len bytes from src (in cache: the staging buffer) to dest with non-temporal stores: the lines go to memory
 * without being read first and without filling the cache the engine's threads run in. */
static inline void dkv_stream_out(char *dest, const char *src, size_t len) {
    size_t head = (16 - ((uintptr_t)dest & 15)) & 15;
    if (head > len) {
        head = len;
    }
    memcpy(dest, src, head);
    dest += head;
    src += head;
    len -= head;
    size_t body = len & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dest + i), a);
        _mm_stream_si128((__m128i *)(dest + i + 16), b);
        _mm_stream_si128((__m128i *)(dest + i + 32), c);
        _mm_stream_si128((__m128i *)(dest + i + 48), d);
    }
    memcpy(dest + body, src + body, len - body);
}
#define DKV_CAN_STREAM 1
#else
#define DKV_CAN_STREAM 0
#endif
#endif

void DKV_KERNEL(const dkv_block *blocks, size_t n, unsigned char *out) {
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
#if DKV_CAN_STREAM
    _Alignas(64) char stage[DKV_CHUNK];
    int streamed = 0;
#endif
    for (size_t i = 0; i < n; i++) {
        const dkv_block *b = &blocks[i];
        XXH3_128bits_reset(&state);
        XXH3_128bits_update(&state, b->prefix, b->prefix_len);
#if DKV_CAN_STREAM
        if (b->len >= atomic_load_explicit(&dkv_stream_min, memory_order_relaxed)) {
            /* Copied into a staging buffer of this thread's, hashed there, and streamed out from it: what is
             * hashed is what lands (nothing else writes the stage), and the destination is written once,
             * around the cache. */
            streamed = 1;
            for (size_t at = 0; at < b->len; at += DKV_CHUNK) {
                size_t len = b->len - at < DKV_CHUNK ? b->len - at : DKV_CHUNK;
                memcpy(stage, b->src + at, len);
                XXH3_128bits_update(&state, stage, len);
                dkv_stream_out(b->dest + at, stage, len);
            }
        } else
#endif
        {
            for (size_t at = 0; at < b->len; at += DKV_CHUNK) {
                size_t len = b->len - at < DKV_CHUNK ? b->len - at : DKV_CHUNK;
                memcpy(b->dest + at, b->src + at, len);
                XXH3_128bits_update(&state, b->dest + at, len);
            }
        }
        XXH128_canonical_t canonical;
        XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
        memcpy(out + i * DKV_CHECKSUM_SIZE, &canonical, DKV_CHECKSUM_SIZE);
    }
#if DKV_CAN_STREAM
    if (streamed) {
        _mm_sfence(); /* the streamed lines are ordered before whatever says the copy ended */
    }
#endif
}

#define DKV_RECV_PIECE (256 * 1024) /* received, then hashed while it is still in cache */

#ifndef DKV_RECV_HELPERS
#define DKV_RECV_HELPERS
/* Wait until fd is readable or deadline_ns (CLOCK_MONOTONIC) passes: 0, -ETIMEDOUT or -errno. */
static int dkv_wait_readable(int fd, long long deadline_ns) {
    for (;;) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long left = deadline_ns - ((long long)now.tv_sec * 1000000000LL + now.tv_nsec);
        if (left <= 0) {
            return -ETIMEDOUT;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ms = (int)((left + 999999) / 1000000);
        int r = poll(&p, 1, ms > 1000 ? 1000 : ms);
        if (r > 0) {
            return 0; /* readable, or an error or hang-up the receive reports */
        }
        if (r < 0 && errno != EINTR) {
            return -errno;
        }
    }
}
#endif

int DKV_RECV_KERNEL(int fd, const dkv_block *blocks, size_t n, const unsigned char *expected,
                    unsigned char *verdicts, const char *first, size_t first_len, long long deadline_ns) {
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    for (size_t i = 0; i < n; i++) {
        const dkv_block *b = &blocks[i];
        XXH3_128bits_reset(&state);
        XXH3_128bits_update(&state, b->prefix, b->prefix_len);
        size_t at = 0;
        if (first_len) { /* bytes read with the reply's frame */
            size_t take = first_len < b->len ? first_len : b->len;
            memcpy(b->dest, first, take);
            XXH3_128bits_update(&state, b->dest, take);
            first += take;
            first_len -= take;
            at = take;
        }
        while (at < b->len) {
            size_t want = b->len - at < DKV_RECV_PIECE ? b->len - at : DKV_RECV_PIECE;
            ssize_t got = recv(fd, b->dest + at, want, MSG_DONTWAIT);
            if (got > 0) {
                XXH3_128bits_update(&state, b->dest + at, (size_t)got);
                at += (size_t)got;
            } else if (got == 0) {
                return -EPIPE;
            } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int waited = dkv_wait_readable(fd, deadline_ns);
                if (waited) {
                    return waited;
                }
            } else if (errno != EINTR) {
                return -errno;
            }
        }
        XXH128_canonical_t canonical;
        XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
        verdicts[i] = memcmp(&canonical, expected + i * DKV_CHECKSUM_SIZE, DKV_CHECKSUM_SIZE) == 0;
    }
    return 0;
}
