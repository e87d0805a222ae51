/*
 * host_shim.h: what a host C compiler needs to compile shardwire.cu as plain C.
 *
 * __global__ and __device__ vanish, threadIdx, blockIdx, blockDim and gridDim become globals
 * (the caller sets them for each thread it runs), and uint2 / uint4 are aligned structs.
 * Included by host_harness.c (the CPU test of the kernels) and gpu/fakecuda/fake_cuda.c (the
 * fake libcuda of CI) before they include shardwire.cu.
 */
#ifndef SHARDWIRE_HOST_SHIM_H
#define SHARDWIRE_HOST_SHIM_H

#define __global__
#define __device__
typedef struct {
    unsigned int x, y, z;
} sw_dim3;
static sw_dim3 threadIdx, blockIdx, blockDim, gridDim;
typedef struct {
    unsigned int x, y;
} __attribute__((aligned(8))) uint2;
typedef struct {
    unsigned int x, y, z, w;
} __attribute__((aligned(16))) uint4;

#endif
