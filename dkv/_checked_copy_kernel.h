/* The kernel's body, included once per instruction set with DKV_KERNEL naming it (after xxhash.h). */
#include <string.h>

#define DKV_CHUNK (16 * 1024) /* copied, then hashed while it is still in L1/L2 */

void DKV_KERNEL(const dkv_block *blocks, size_t n, unsigned char *out) {
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    for (size_t i = 0; i < n; i++) {
        const dkv_block *b = &blocks[i];
        XXH3_128bits_reset(&state);
        XXH3_128bits_update(&state, b->prefix, b->prefix_len);
        for (size_t at = 0; at < b->len; at += DKV_CHUNK) {
            size_t len = b->len - at < DKV_CHUNK ? b->len - at : DKV_CHUNK;
            memcpy(b->dest + at, b->src + at, len);
            XXH3_128bits_update(&state, b->dest + at, len);
        }
        XXH128_canonical_t canonical;
        XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
        memcpy(out + i * DKV_CHECKSUM_SIZE, &canonical, DKV_CHECKSUM_SIZE);
    }
}
