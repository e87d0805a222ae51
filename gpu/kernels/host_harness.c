/*
 * host_harness.c: runs the kernels of shardwire.cu on the CPU, compiled as plain C.
 *
 * host_shim.h stands in for CUDA: __global__ and __device__ vanish, threadIdx, blockIdx,
 * blockDim and gridDim are globals, and uint2 / uint4 are aligned structs. Then this file
 * includes shardwire.cu itself, so the kernel source under test is the one shipped as PTX.
 * launch() runs every (block, thread) of a grid one after the other; that is a valid
 * schedule because the kernels share nothing between threads (no shared memory, no
 * __syncthreads, each output word written by one thread).
 *
 * Build: cc -x c -std=c11 -O2 -fno-strict-aliasing host_harness.c -o harness
 *        (-I to shardwire.cu's folder when not built from it)
 * Usage (binary little-endian files; `frags` = sw_frag[], `spans` = sw_span[]):
 *   harness gather SRC DST FRAGS GRID BLOCK OUT
 *       OUT = DST after sw_gather over FRAGS, with GRID blocks of BLOCK threads
 *   harness crc BASE SPANS CHUNK MAX_CHUNKS BLOCK OUT
 *       sw_crc32c_chunks on grid (ceil(MAX_CHUNKS / BLOCK), nspans), then sw_crc32c_combine
 *       on grid ceil(nspans / BLOCK); OUT = the nspans CRCs (u32) then the nspans * MAX_CHUNKS
 *       partials, which start as 0xA5A5A5A5 so unwritten entries show.
 * Used by gpu/tests/kernels_on_cpu.rs. Exit status 0, or 1 with a message on stderr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- CUDA shim ---------------------------------------------------------------------- */
#include "host_shim.h"

#include "shardwire.cu"

/* Run `call` as every thread of grid (gx, gy) x block bx, serially. */
#define LAUNCH(gx, gy, bx, call)                                                           \
    do {                                                                                   \
        gridDim.x = (gx), gridDim.y = (gy), gridDim.z = 1;                                 \
        blockDim.x = (bx), blockDim.y = 1, blockDim.z = 1;                                 \
        for (blockIdx.y = 0; blockIdx.y < gridDim.y; blockIdx.y++)                         \
            for (blockIdx.x = 0; blockIdx.x < gridDim.x; blockIdx.x++)                     \
                for (threadIdx.x = 0; threadIdx.x < blockDim.x; threadIdx.x++)             \
                    call;                                                                  \
    } while (0)

static void die(const char *what, const char *arg)
{
    fprintf(stderr, "host_harness: %s: %s\n", what, arg);
    exit(1);
}

/* The whole file in an exactly sized allocation (so a sanitizer sees any overrun). */
static unsigned char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf;
    long n;
    if (!f || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0)
        die("cannot read", path);
    buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n)
        die("cannot read", path);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static void write_file(const char *path, const void *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0)
        die("cannot write", path);
}

static unsigned int arg_u32(const char *s)
{
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v > 0xFFFFFFFFul)
        die("not a u32", s);
    return (unsigned int)v;
}

static void *alloc_copy(const void *src, size_t len)
{
    void *p = malloc(len > 0 ? len : 1);
    if (!p)
        die("out of memory", "alloc");
    if (len > 0)
        memcpy(p, src, len);
    return p;
}

static int run_gather(char **argv)
{
    size_t src_len, dst_len, frags_len;
    unsigned char *src = read_file(argv[0], &src_len);
    unsigned char *dst = read_file(argv[1], &dst_len);
    unsigned char *raw = read_file(argv[2], &frags_len);
    unsigned int grid = arg_u32(argv[3]), block = arg_u32(argv[4]);
    unsigned int nfrags = (unsigned int)(frags_len / sizeof(sw_frag));
    sw_frag *frags = alloc_copy(raw, frags_len); /* sw_frag-aligned */
    if (frags_len % sizeof(sw_frag) != 0)
        die("frags file is not a whole number of sw_frag", argv[2]);
    LAUNCH(grid, 1, block, sw_gather(src, dst, frags, nfrags));
    write_file(argv[5], dst, dst_len);
    free(src), free(dst), free(raw), free(frags);
    return 0;
}

static int run_crc(char **argv)
{
    size_t base_len, spans_len, i;
    unsigned char *base = read_file(argv[0], &base_len);
    unsigned char *raw = read_file(argv[1], &spans_len);
    unsigned int chunk = arg_u32(argv[2]), max_chunks = arg_u32(argv[3]), block = arg_u32(argv[4]);
    unsigned int nspans = (unsigned int)(spans_len / sizeof(sw_span));
    size_t npartials = (size_t)nspans * max_chunks;
    sw_span *spans = alloc_copy(raw, spans_len);
    size_t out_len = sizeof(unsigned int) * (nspans + npartials);
    unsigned int *out = malloc(out_len > 0 ? out_len : 1);
    unsigned int *partials = out + nspans;
    if (spans_len % sizeof(sw_span) != 0)
        die("spans file is not a whole number of sw_span", argv[1]);
    if (!out || block == 0)
        die("bad arguments", "out of memory or block 0");
    for (i = 0; i < nspans + npartials; i++)
        out[i] = 0xA5A5A5A5u;
    LAUNCH((max_chunks + block - 1) / block, nspans, block,
           sw_crc32c_chunks(base, spans, nspans, chunk, partials, max_chunks));
    LAUNCH((nspans + block - 1) / block, 1, block,
           sw_crc32c_combine(spans, nspans, chunk, partials, max_chunks, out));
    write_file(argv[5], out, out_len);
    free(base), free(raw), free(spans), free(out);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 8 && strcmp(argv[1], "gather") == 0)
        return run_gather(argv + 2);
    if (argc == 8 && strcmp(argv[1], "crc") == 0)
        return run_crc(argv + 2);
    fprintf(stderr, "usage: harness gather SRC DST FRAGS GRID BLOCK OUT\n"
                    "       harness crc BASE SPANS CHUNK MAX_CHUNKS BLOCK OUT\n");
    return 1;
}
