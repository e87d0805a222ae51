/*
 * fake_cuda.c: a TEST DOUBLE of the NVIDIA CUDA driver API (libcuda.so.1) that runs on host
 * memory, so CI exercises shardwire's real CUDA code paths (gpu/src/cuda*, the node with
 * memory = "cuda", the Python SDK's CudaRegion) on machines without a GPU. It is not a GPU,
 * not a CUDA implementation, and never a substitute for scripts/gpu-check.sh on real hardware.
 * Its devices say so: "shardwire fake CUDA device (host memory)", PCI bus ids 0000:FA:NN.0 unless
 * FAKE_CUDA_PCI_BUS_IDS names them (to match a fake sysfs tree, tests/fixtures/sysfs).
 *
 * Build: scripts/build-fakecuda (the one place with the flags); use: LD_LIBRARY_PATH=<its dir>
 * when the process STARTS (cudarc dlopens "libcuda.so", cuda-bindings "libcuda.so.1").
 *
 * WHAT IT EXPORTS: exactly the entry points shardwire-gpu and the Python SDK call (listed in
 * `procs[]` at the end, which cuGetProcAddress also serves); everything else is absent, so
 * cudarc panics "Missing symbol" when the crate starts using something new: extend the fake
 * then, with the documented semantics.
 *
 * SEMANTICS (the CUDA driver API reference; errors where the real driver errors):
 * - Init/probe: every call but cuDriverGetVersion, cuGetErrorName/String and cuGetProcAddress
 *   returns CUDA_ERROR_NOT_INITIALIZED before a cuInit(0) that succeeded. cuInit(flags != 0):
 *   INVALID_VALUE. cuDriverGetVersion: 12080. cuDeviceGetCount: 1 (FAKE_CUDA_DEVICES=N, 0..8;
 *   with 0, cuInit returns CUDA_ERROR_NO_DEVICE as the real driver does and the driver stays
 *   uninitialised: every later call, cuDeviceGetCount included, answers
 *   CUDA_ERROR_NOT_INITIALIZED; with FAKE_CUDA_PCI_BUS_IDS=BDF,BDF,... and no
 *   FAKE_CUDA_DEVICES, one device per bus id).
 * - Device identity: device N's PCI bus id is the N-th of FAKE_CUDA_PCI_BUS_IDS, else 0000:FA:NN.0;
 *   cuDeviceGetPCIBusId prints it as the driver does, "%04X:%02X:%02X.%X" (upper-case hex);
 *   cuDeviceGetByPCIBusId takes any case, with or without the domain; PCI_BUS_ID,
 *   PCI_DEVICE_ID and PCI_DOMAIN_ID attributes agree. cuDeviceGetUuid(_v2): 16 bytes derived
 *   from the bus id only (5a77fa4e-DDDD-40BB-80DD-F00000000000), so every process sees the
 *   same UUID for a device whatever its ordinal. cuCtxGetDevice: the current context's device
 *   (CUDA_ERROR_INVALID_CONTEXT without one).
 * - Memory is per device: FAKE_CUDA_MEMORY bytes each (cuMemAlloc and cuMemCreate count against
 *   the device they allocate on). A VMM allocation's memfd is named after its device's bus id
 *   ("fakecuda-vmm:pci=BDF"), the physical GPU, as a real handle carries it: an importing
 *   process maps it on ITS ordinal for that bus id (CUDA_ERROR_INVALID_DEVICE where it has no
 *   such device). FAKE_CUDA_ALLOC_LOG=<path> appends one line per cuMemCreate, cuMemAlloc and
 *   import: "<call> pid=P dev=N pci=BDF size=S" (tests check where each region lies).
 *   cuDeviceGetAttribute: DMA_BUF_SUPPORTED, VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
 *   GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
 *   UNIFIED_ADDRESSING, CAN_MAP_HOST_MEMORY, HOST_REGISTER_SUPPORTED = 1, launch limits of an
 *   sm_80 part, compute capability 8.0 (FAKE_CUDA_COMPUTE_CAPABILITY=MAJOR.MINOR, e.g. 7.5 as a
 *   Turing T4; see Modules for what it refuses then), HOST_NATIVE_ATOMIC_SUPPORTED and
 *   DIRECT_MANAGED_MEM_ACCESS_FROM_HOST = 0 as on a PCIe-attached GPU (1 with
 *   FAKE_CUDA_HOST_COHERENT=1: memory cache-coherent with the CPU, as on Grace Hopper and
 *   Grace Blackwell), MEMORY_POOLS_SUPPORTED = 0 (no stream-ordered allocator here), other
 *   known attributes 0, unknown ones INVALID_VALUE.
 *   cuDeviceTotalMem_v2: 16 GiB (FAKE_CUDA_MEMORY=<bytes>), enforced: cuMemAlloc and cuMemCreate
 *   beyond it return CUDA_ERROR_OUT_OF_MEMORY.
 * - Contexts: one primary context per device, reference counted (Retain / Release_v2; the last
 *   release destroys it with everything made in it: cuMemAlloc blocks, pinned host memory,
 *   host registrations, streams, events, modules). The current context is per thread (a stack:
 *   cuCtxSetCurrent replaces the top, Push/Pop). Calls that work in a context (allocations,
 *   streams, events, modules, launches, copies, host registration, and the VMM address-space
 *   calls cuMemAddressReserve/Free, cuMemMap/Unmap, cuMemSetAccess,
 *   cuMemGetHandleForAddressRange) return CUDA_ERROR_INVALID_CONTEXT without a current context
 *   (a missing Device::bind() shows here), CUDA_ERROR_CONTEXT_IS_DESTROYED when the current
 *   one was released. cuMemFree, cuMemFreeHost, cuMemHostUnregister, cuMemCreate/Release,
 *   export/import and cuMemGetAllocationGranularity work without one.
 * - Device memory is host memory: a device pointer is a host address. cuMemAlloc_v2 blocks
 *   and new cuMemCreate allocations are filled with 0xA5 (device memory is not zeroed), so a
 *   reader of bytes nobody wrote sees garbage. Copies (sync, async, DtoD, cuMemsetD8) must
 *   name device bytes inside ONE live allocation that the context's device may access in that
 *   direction (a cuMemAlloc block of this context, pinned host memory, a DEVICEMAP host
 *   registration (read-only with CU_MEMHOSTREGISTER_READ_ONLY), a VMM mapping with the
 *   access cuMemSetAccess granted): else CUDA_ERROR_INVALID_VALUE. This is the
 *   out-of-bounds check. Pinned host memory and registrations count only for the context
 *   that made them unless made PORTABLE (see Host memory).
 * - Streams are DEFERRED, not synchronous: work queued on a stream (async copies, memset,
 *   launches, event records) runs only when the host waits for it: cuStreamSynchronize,
 *   cuEventSynchronize, cuEventQuery (which answers CUDA_ERROR_NOT_READY once for pending work
 *   and runs it, so polling loops progress), cuCtxSynchronize, an async copy to pageable host
 *   memory (synchronous, as documented), cuModuleUnload and cuStreamDestroy, and the implicit
 *   synchronisation of freeing memory, which is per device: cuMemFree, cuMemFreeHost and
 *   cuMemHostUnregister run the work of the device whose context allocated or registered the
 *   memory, never another device's. cuMemUnmap documents no implicit synchronisation and runs
 *   nothing: work still queued that touches an unmapped (or freed) range faults with
 *   CUDA_ERROR_ILLEGAL_ADDRESS when it runs, as on a GPU. So a host that reads results before
 *   waiting sees stale bytes, and a host that rewrites a pinned source before the copy's
 *   event has completed has its new bytes copied: the ordering bugs a GPU shows only
 *   sometimes show here every time. An async H2D copy from pageable (unpinned) memory is
 *   staged at the call, as documented. The legacy default stream (0, CU_STREAM_LEGACY,
 *   CU_STREAM_PER_THREAD are all treated as it) and the synchronous copies first run the
 *   blocking streams (created with flags 0), never CU_STREAM_NON_BLOCKING ones. A queued
 *   operation that faults (see launches) makes the context's error sticky, as on a GPU:
 *   every later call in the context returns it and queued work is dropped.
 * - Synchronous copies (the driver API's "API synchronization behavior"): cuMemcpyHtoD from
 *   PAGEABLE host memory (memory not pinned for the current context) performs the legacy
 *   stream's sync first, copies the host bytes to staging memory (a buffer of the fake) and
 *   returns: "the DMA to final destination may not have completed". The staged copy is
 *   pending work of the legacy default stream and lands only when that stream is waited for:
 *   cuStreamSynchronize(0 / CU_STREAM_LEGACY / CU_STREAM_PER_THREAD), cuCtxSynchronize,
 *   before any later legacy-stream work or synchronous copy of the context runs, before a
 *   BLOCKING stream of the context runs work (the legacy stream's implicit synchronisation),
 *   and on the implicit synchronisation of frees (cuMemFree, cuMemFreeHost,
 *   cuMemHostUnregister of that device; cuModuleUnload). NOT before a CU_STREAM_NON_BLOCKING
 *   stream's work: a kernel or async copy there reads the OLD destination bytes unless the
 *   host synchronised the legacy stream first, which the real driver allows (when the host
 *   waits for everything, cuCtxSynchronize or a free, the fake runs the non-blocking streams
 *   first, so they never see such a copy). A staged copy whose destination was unmapped
 *   (cuMemUnmap runs nothing) faults when it lands, like other queued work (sticky
 *   CUDA_ERROR_ILLEGAL_ADDRESS); one left when the context is destroyed is dropped.
 *   cuMemcpyHtoD from pinned memory, and cuMemcpyDtoH (pageable or pinned destination),
 *   return with the bytes copied, after the legacy stream's pending copies.
 * - Events record a timestamp when the stream reaches them; never-recorded events are
 *   complete; cuEventElapsedTime needs two recorded, completed events created without
 *   CU_EVENT_DISABLE_TIMING (else CUDA_ERROR_INVALID_HANDLE; CUDA_ERROR_NOT_READY if pending).
 * - Modules: cuModuleLoadData takes NUL-terminated PTX text only (.version, .target,
 *   .address_size 64; a cubin or fatbin: CUDA_ERROR_NOT_SUPPORTED). The fake cannot JIT PTX:
 *   every `.entry` the PTX declares must be one of the kernels compiled INTO this library from
 *   gpu/kernels/shardwire.cu (sw_gather, sw_crc32c_chunks, sw_crc32c_combine) with the same
 *   parameter types, else CUDA_ERROR_INVALID_IMAGE (a stale or foreign PTX shows here).
 *   A `.target sm_XY` above the device's compute capability (FAKE_CUDA_COMPUTE_CAPABILITY)
 *   is CUDA_ERROR_INVALID_PTX, as the driver's JIT refuses PTX for a newer GPU.
 *   cuModuleGetFunction finds the entries the PTX declares (else CUDA_ERROR_NOT_FOUND).
 * - cuLaunchKernel: grid dims >= 1 (x < 2^31, y and z <= 65535), block <= 1024 threads
 *   (x, y <= 1024, z <= 64), shared memory <= 48 KiB, kernelParams given and `extra` NULL
 *   (the fake does not implement `extra`: CUDA_ERROR_NOT_SUPPORTED), else INVALID_VALUE. The
 *   argument values are copied at the call (pointers as 8-byte device addresses, unsigned
 *   int as 4 bytes, in the kernel's C parameter order). When the stream runs the launch, the
 *   fake works out from the arguments exactly which bytes the kernel's threads will read and
 *   write (the same arithmetic as shardwire.cu) and checks each span against the allocation
 *   its pointer argument points into, with that allocation's device access: a span outside
 *   it is CUDA_ERROR_ILLEGAL_ADDRESS (sticky; the real GPU faults asynchronously too, or
 *   silently corrupts a neighbouring allocation: the fake is stricter there). Launches that
 *   break the kernel contract of gpu/src/kernels.rs (gather frags whose destinations overlap,
 *   or, with src and dst in one buffer, a frag reading bytes the launch writes) fail with CUDA_ERROR_LAUNCH_FAILED (sticky; a GPU would race
 *   silently). Then the grid runs serially on the calling thread, every (block, thread) in
 *   turn, like gpu/kernels/host_harness.c (a valid schedule: the kernels share nothing).
 *   Faults are always printed to stderr ("fake libcuda[pid]: FAULT ...").
 * - VMM: granularity 2 MiB (MINIMUM and RECOMMENDED). cuMemCreate(size a multiple of it, prop
 *   PINNED on a DEVICE location, handle types NONE or POSIX_FILE_DESCRIPTOR, flags 0) backs
 *   the allocation with a sealed memfd named "fakecuda-vmm:pci=BDF". cuMemAddressReserve
 *   reserves PROT_NONE address space (aligned to max(alignment, granularity)), cuMemMap maps
 *   the memfd there (offset must be 0, as documented) still PROT_NONE: mapped memory is not
 *   accessible until cuMemSetAccess (PROT_READ for CU_MEM_ACCESS_FLAGS_PROT_READ, read-write
 *   for PROT_READWRITE; the range must consist of whole mappings). cuMemUnmap must name whole
 *   mappings; cuMemAddressFree a whole, unmapped reservation; cuMemRelease invalidates the
 *   handle while mappings keep the memory. cuMemExportToShareableHandle(POSIX fd) returns a
 *   new fd (a dup of the memfd) only if that handle type was requested at create (else
 *   CUDA_ERROR_INVALID_VALUE); cuMemImportFromShareableHandle takes such an fd (any other fd:
 *   INVALID_VALUE) and gives a new handle, sized by fstat.
 *   cuMemGetHandleForAddressRange(DMA_BUF_FD): page-aligned range inside one mapping of an
 *   allocation made with gpuDirectRDMACapable (else CUDA_ERROR_NOT_SUPPORTED), flags 0 or
 *   CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE (FAKE_CUDA_NO_PCIE_FLAG=1 refuses that flag
 *   with INVALID_VALUE, as a driver without it does; =2 with NOT_SUPPORTED, as drivers do for a
 *   GPU that is not cache-coherent with the CPU, every PCIe-attached one (driver 580 for an x86
 *   H200 under Firecracker), exporting without the flag; the default accepts it, so the crate's
 *   fallback runs only where a test asks; FAKE_CUDA_NO_DMABUF=1 refuses every
 *   export with NOT_SUPPORTED, flag or not, while the device attribute still says supported,
 *   as the driver of an H200 under Firecracker did). The fd is a real dma-buf over exactly
 *   those pages when /dev/udmabuf can be opened, else a dup of the allocation's memfd (good
 *   enough for code that only hands it on; its /proc link names "fakecuda").
 * - Host memory: cuMemHostAlloc (flags PORTABLE|DEVICEMAP|WRITECOMBINED), cuMemFreeHost;
 *   cuMemHostRegister_v2 checks /proc/self/maps (the range must be mapped, and writable
 *   unless CU_MEMHOSTREGISTER_READ_ONLY) and overlaps (HOST_MEMORY_ALREADY_REGISTERED);
 *   cuMemHostGetDevicePointer_v2 (flags 0) answers the host address for DEVICEMAP memory;
 *   cuMemHostUnregister needs the registered base (else HOST_MEMORY_NOT_REGISTERED).
 *   Without CU_MEMHOSTALLOC_PORTABLE / CU_MEMHOSTREGISTER_PORTABLE the memory is pinned and
 *   mapped for the context that allocated or registered it only: every other context (here,
 *   every other device's primary context) sees pageable memory (its async H2D copies stage
 *   it, its D2H copies into it are synchronous), and as a device address it is no
 *   allocation of that context: copies naming it are CUDA_ERROR_INVALID_VALUE, kernels
 *   reading it fault, cuMemHostGetDevicePointer_v2 answers CUDA_ERROR_INVALID_VALUE.
 * - cuGetProcAddress(_v2): base names ("cuMemAlloc") resolve to the version the caller's
 *   CUDA version selects ("cuMemAlloc_v2" from 3.2); per-thread-default-stream requests get
 *   the same functions (see the default stream above). Unknown: CUDA_ERROR_NOT_FOUND.
 *
 * WHAT IT CANNOT CHECK: real DMA (NIC to GPU), PTX JIT and the PTX itself (the kernels run
 * from their C source; scripts/gen-ptx --check keeps the PTX in step), timing, concurrency
 * between host and device (deferred work runs on the waiting thread, and all calls are
 * serialised by one lock), peer access, and anything device-specific (warps, caches).
 *
 * FAILURE INJECTION: FAKE_CUDA_FAIL_CALL=<entry point>:<n> makes the n-th call (from 1, counted
 *   from process start, after its arguments were checked) of cuLaunchKernel (which then answers
 *   CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES) or cuEventCreate (CUDA_ERROR_OUT_OF_MEMORY) fail without
 *   effect, as a driver may refuse one: documented errors of those calls, not sticky (the
 *   context stays usable). For tests of error paths; other entry points are not counted.
 *
 * DEBUGGING: FAKE_CUDA_LOG=1 prints every failed call with its reason to stderr, and leaks
 * (objects alive when a primary context is destroyed, VMM objects alive at exit);
 * FAKE_CUDA_LOG=2 every call (and every cuGetProcAddress lookup; FAKE_CUDA_LOG_PROCS=1 with
 * FAKE_CUDA_LOG=1 prints the failed lookups only: cuda-bindings asks for hundreds of symbols
 * the fake lacks when it loads). FAKE_CUDA_DRIVER_VERSION=<n> overrides 12080.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

#define CUAPI __attribute__((visibility("default")))

/* ---- the driver API's types and constants (cuda.h, CUDA 12.8 ABI) ---------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef struct fc_ctx *CUcontext;
typedef struct fc_stream *CUstream;
typedef struct fc_event *CUevent;
typedef struct fc_module *CUmodule;
typedef struct fc_func *CUfunction;

typedef struct {
    int type;
    int id;
} CUmemLocation;

typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation layout");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

enum { /* CUdevice_attribute (the values used by name below) */
    ATTR_MAX_THREADS_PER_BLOCK = 1,
    ATTR_PCI_BUS_ID = 33,
    ATTR_PCI_DEVICE_ID = 34,
    ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
    ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110,
    ATTR_DMA_BUF_SUPPORTED = 124,
    ATTR_MAX = 144, /* CU_DEVICE_ATTRIBUTE_MAX of CUDA 12.8 */
};

#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_ACCESS_FLAGS_PROT_NONE 0
#define CU_MEM_ACCESS_FLAGS_PROT_READ 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD 1
#define CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE 1ull
#define CU_MEMHOSTALLOC_PORTABLE 1u
#define CU_MEMHOSTALLOC_DEVICEMAP 2u
#define CU_MEMHOSTALLOC_WRITECOMBINED 4u
#define CU_MEMHOSTREGISTER_PORTABLE 1u
#define CU_MEMHOSTREGISTER_DEVICEMAP 2u
#define CU_MEMHOSTREGISTER_IOMEMORY 4u
#define CU_MEMHOSTREGISTER_READ_ONLY 8u
#define CU_STREAM_NON_BLOCKING 1u
#define CU_EVENT_BLOCKING_SYNC 1u
#define CU_EVENT_DISABLE_TIMING 2u
#define CU_EVENT_INTERPROCESS 4u
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2ull
#define CU_GET_PROC_ADDRESS_SUCCESS 0
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1
#define CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT 2

/* ---- the kernels, compiled from their source (host_shim.h, as in host_harness.c) ---------- */

#include "host_shim.h"

#include "shardwire.cu"

/* ---- state ----------------------------------------------------------------------------- */

#define MAX_DEV 8
#define GRANULARITY ((size_t)2 << 20)
#define PAGE ((size_t)4096)
#define CTX_STACK 32
#define ARGS_MAX 64
#define MAX_PARAMS 8
#define DEVICE_NAME "shardwire fake CUDA device (host memory)"
#define POISON 0xA5

struct vec {
    void **v;
    size_t n, cap;
};

struct op;

struct fc_ctx {
    int dev;
    int refs;     /* 0: not active (never retained, or destroyed by the last release) */
    CUresult sticky; /* the error that made the context unusable */
    /* The legacy default stream's pending work: synchronous H2D copies from pageable memory,
     * staged at the call, whose "DMA to final destination" has not happened yet. */
    struct op *lhead, *ltail;
};

/* A physical VMM allocation (cuMemCreate or an import). */
struct alloc {
    CUmemGenericAllocationHandle handle;
    int fd;
    size_t size;
    int dev;
    int handle_types;
    int rdma;
    int released; /* cuMemRelease was called: the handle is gone, mappings keep the memory */
    int maps;
    int accounted; /* counts against the device's memory (not for imports) */
};

struct resv {
    uintptr_t base;
    size_t size;
};

enum { R_ALLOC = 1, R_HOSTALLOC, R_HOSTREG, R_MAP };

/* Memory a copy or a kernel may name: a cuMemAlloc block, pinned host memory, a host
 * registration, or a VMM mapping. */
struct range {
    int kind;
    uintptr_t base;
    size_t size;
    size_t maplen; /* bytes mmap'd (R_ALLOC, R_HOSTALLOC) */
    struct fc_ctx *ctx; /* owner (not for R_MAP) */
    unsigned flags;     /* R_HOSTALLOC / R_HOSTREG flags */
    struct alloc *alloc; /* R_MAP */
    unsigned char access[MAX_DEV]; /* R_MAP: CU_MEM_ACCESS_FLAGS_* per device */
};

struct kernel;

enum { OP_COPY = 1, OP_MEMSET, OP_LAUNCH, OP_EVENT };

struct op {
    struct op *next;
    int kind;
    uintptr_t dst, src; /* OP_COPY, OP_MEMSET (dst) */
    size_t n;
    int dst_dev, src_dev; /* which side is device memory (checked again when run) */
    int pinned_host;      /* the host side was pinned memory at the call (checked again when run) */
    void *staging;        /* a pageable source captured at the call */
    unsigned char value;  /* OP_MEMSET */
    const struct kernel *k; /* OP_LAUNCH */
    unsigned grid[3], block[3];
    unsigned char args[ARGS_MAX];
    struct fc_event *ev; /* OP_EVENT (NULL once the event is destroyed) */
    unsigned long long gen;
};

struct fc_stream {
    struct fc_ctx *ctx;
    unsigned flags;
    struct op *head, *tail;
};

struct fc_event {
    struct fc_ctx *ctx;
    unsigned flags;
    unsigned long long rec_gen, done_gen; /* complete when equal (never recorded: 0 == 0) */
    struct fc_stream *stream; /* where last recorded; NULL: the default stream */
    struct timespec t;        /* when the stream reached the latest record */
};

struct fc_func {
    struct fc_module *mod;
    const struct kernel *k;
};

#define NKERNELS 3
struct fc_module {
    struct fc_ctx *ctx;
    int nfuncs;
    struct fc_func funcs[NKERNELS];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static struct {
    int log;
    int ndev;
    int no_pcie;
    int no_dmabuf;
    int host_coherent;        /* FAKE_CUDA_HOST_COHERENT */
    int cc_major, cc_minor;   /* FAKE_CUDA_COMPUTE_CAPABILITY */
    int version;
    unsigned long long total_mem;
    int inited;
    char fail_call[64];             /* FAKE_CUDA_FAIL_CALL: the entry point, or "" */
    unsigned long long fail_nth;    /* ... the call of it that fails (from 1) */
    unsigned long long fail_seen;   /* ... its calls so far */
    unsigned pci[MAX_DEV][4]; /* domain, bus, device, function */
    int alloc_log;            /* FAKE_CUDA_ALLOC_LOG fd, or -1 */
    struct fc_ctx ctx[MAX_DEV];
    unsigned long long used[MAX_DEV];
    struct vec ranges, resvs, allocs, streams, events, modules;
    CUmemGenericAllocationHandle next_handle;
} g;

static __thread struct fc_ctx *t_stack[CTX_STACK];
static __thread int t_depth;
static __thread char t_why[640];

/* ---- small helpers ----------------------------------------------------------------------- */

static void vpush(struct vec *a, void *p)
{
    if (a->n == a->cap) {
        a->cap = a->cap ? a->cap * 2 : 16;
        a->v = realloc(a->v, a->cap * sizeof *a->v);
        if (!a->v)
            abort();
    }
    a->v[a->n++] = p;
}

static int vfind(const struct vec *a, const void *p)
{
    for (size_t i = 0; i < a->n; i++)
        if (a->v[i] == p)
            return (int)i;
    return -1;
}

static void vdel(struct vec *a, const void *p)
{
    int i = vfind(a, p);
    if (i >= 0) {
        memmove(&a->v[i], &a->v[i + 1], (a->n - (size_t)i - 1) * sizeof *a->v);
        a->n--;
    }
}

static size_t round_up(size_t n, size_t to)
{
    return (n + to - 1) / to * to;
}

/* The API's error names and the driver's descriptions (for cuGetErrorName/String and logs). */
static const struct {
    CUresult code;
    const char *name, *text;
} errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const char *err_name(CUresult r)
{
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == r)
            return errors[i].name;
    return "CUDA_ERROR_?";
}

/* Sets the reason of the error returned (logged with FAKE_CUDA_LOG=1). */
__attribute__((format(printf, 2, 3))) static CUresult fail(CUresult r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_why, sizeof t_why, fmt, ap);
    va_end(ap);
    return r;
}

#define ENTER()                                                                              \
    do {                                                                                     \
        pthread_mutex_lock(&g_lock);                                                         \
        t_why[0] = '\0';                                                                     \
    } while (0)
#define LEAVE(name, expr) return finish(name, (expr))

static CUresult finish(const char *name, CUresult r)
{
    pthread_mutex_unlock(&g_lock);
    if (g.log >= 2 || (g.log >= 1 && r != CUDA_SUCCESS && r != CUDA_ERROR_NOT_READY))
        fprintf(stderr, "fake libcuda[%d]: %s -> %s%s%s\n", (int)getpid(), name, err_name(r),
                t_why[0] ? ": " : "", t_why);
    t_why[0] = '\0';
    return r;
}

static int env_int(const char *name, long long lo, long long hi, long long dflt)
{
    const char *s = getenv(name);
    char *end;
    long long v;
    if (!s || !*s)
        return (int)dflt;
    v = strtoll(s, &end, 10);
    if (*end || v < lo || v > hi) {
        fprintf(stderr, "fake libcuda: ignoring %s=%s (want %lld..%lld)\n", name, s, lo, hi);
        return (int)dflt;
    }
    return (int)v;
}

/* "[domain:]bus:device.function" (hex, any case) -> pci[4]; 0 if it is not one. */
static int parse_bdf(const char *s, unsigned out[4])
{
    unsigned dom = 0, bus, d, fn = 0;
    int n = -1;
    if (!((sscanf(s, "%x:%x:%x.%x%n", &dom, &bus, &d, &fn, &n) == 4 && s[n] == '\0') ||
          (n = -1, dom = 0, sscanf(s, "%x:%x.%x%n", &bus, &d, &fn, &n) == 3 && s[n] == '\0')))
        return 0;
    if (dom > 0xffff || bus > 0xff || d > 0x1f || fn > 7)
        return 0;
    out[0] = dom, out[1] = bus, out[2] = d, out[3] = fn;
    return 1;
}

/* Fills g.pci: the listed bus ids first, then 0000:FA:NN.0. Returns how many were listed. */
static int parse_bus_ids(const char *list)
{
    char buf[1024], *save = NULL, *tok;
    int n = 0;
    for (int i = 0; i < MAX_DEV; i++) {
        g.pci[i][0] = 0, g.pci[i][1] = 0xfa, g.pci[i][2] = (unsigned)i, g.pci[i][3] = 0;
    }
    if (!list || !*list)
        return 0;
    snprintf(buf, sizeof buf, "%s", list);
    for (tok = strtok_r(buf, ",", &save); tok && n < MAX_DEV; tok = strtok_r(NULL, ",", &save)) {
        if (!parse_bdf(tok, g.pci[n])) {
            fprintf(stderr, "fake libcuda: ignoring FAKE_CUDA_PCI_BUS_IDS entry %s (want dddd:bb:dd.f)\n", tok);
            continue;
        }
        n++;
    }
    return n;
}

/* The ordinal of the device at pci[4], or -1. */
static int dev_at(const unsigned pci[4])
{
    for (int i = 0; i < g.ndev; i++)
        if (!memcmp(g.pci[i], pci, sizeof g.pci[i]))
            return i;
    return -1;
}

static void bus_text(int dev, char *out, size_t len)
{
    snprintf(out, len, "%04X:%02X:%02X.%X", g.pci[dev][0], g.pci[dev][1], g.pci[dev][2], g.pci[dev][3]);
}

/* One line of the allocation log (FAKE_CUDA_ALLOC_LOG), written with one append. */
static void log_alloc(const char *call, int dev, size_t size)
{
    char line[160], bus[32];
    int n;
    if (g.alloc_log < 0)
        return;
    bus_text(dev, bus, sizeof bus);
    n = snprintf(line, sizeof line, "%s pid=%d dev=%d pci=%s size=%zu\n", call, (int)getpid(), dev, bus, size);
    if (n > 0 && write(g.alloc_log, line, (size_t)n) < 0)
        fprintf(stderr, "fake libcuda: FAKE_CUDA_ALLOC_LOG write: %s\n", strerror(errno));
}

/* FAKE_CUDA_COMPUTE_CAPABILITY=<major>.<minor> (e.g. 7.5) -> g.cc_major, g.cc_minor; 8.0
 * (the PTX's sm_80) when unset or malformed. */
static void parse_compute_capability(const char *s)
{
    int major, minor, n = -1;
    g.cc_major = 8, g.cc_minor = 0;
    if (!s || !*s)
        return;
    if (sscanf(s, "%d.%d%n", &major, &minor, &n) == 2 && s[n] == '\0' && major >= 1 && major <= 99 &&
        minor >= 0 && minor <= 9) {
        g.cc_major = major, g.cc_minor = minor;
        return;
    }
    fprintf(stderr, "fake libcuda: ignoring FAKE_CUDA_COMPUTE_CAPABILITY=%s (want MAJOR.MINOR, e.g. 7.5)\n", s);
}

/* FAKE_CUDA_FAIL_CALL=<entry point>:<n> (n >= 1) -> g.fail_call, g.fail_nth. */
static void parse_fail_call(const char *spec)
{
    char name[64];
    unsigned long long n;
    int end = -1;
    if (!spec || !*spec)
        return;
    if (sscanf(spec, "%63[A-Za-z_0-9]:%llu%n", name, &n, &end) != 2 || end < 0 || spec[end] != '\0' || n == 0 ||
        (strcmp(name, "cuLaunchKernel") && strcmp(name, "cuEventCreate"))) {
        fprintf(stderr, "fake libcuda: ignoring FAKE_CUDA_FAIL_CALL=%s (want cuLaunchKernel:N or cuEventCreate:N, N >= 1)\n",
                spec);
        return;
    }
    snprintf(g.fail_call, sizeof g.fail_call, "%s", name);
    g.fail_nth = n;
}

/* True when this call of `name` is the one FAKE_CUDA_FAIL_CALL names (counts every call of it). */
static int injected_failure(const char *name)
{
    if (!g.fail_nth || strcmp(name, g.fail_call))
        return 0;
    return ++g.fail_seen == g.fail_nth;
}

__attribute__((constructor)) static void fake_init(void)
{
    const char *mem = getenv("FAKE_CUDA_MEMORY");
    g.log = env_int("FAKE_CUDA_LOG", 0, 2, 0);
    int listed = parse_bus_ids(getenv("FAKE_CUDA_PCI_BUS_IDS"));
    const char *log_path = getenv("FAKE_CUDA_ALLOC_LOG");
    g.ndev = env_int("FAKE_CUDA_DEVICES", 0, MAX_DEV, listed > 0 ? listed : 1);
    g.alloc_log = log_path && *log_path ? open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644) : -1;
    g.no_pcie = env_int("FAKE_CUDA_NO_PCIE_FLAG", 0, 2, 0);
    g.no_dmabuf = env_int("FAKE_CUDA_NO_DMABUF", 0, 1, 0);
    g.host_coherent = env_int("FAKE_CUDA_HOST_COHERENT", 0, 1, 0);
    parse_compute_capability(getenv("FAKE_CUDA_COMPUTE_CAPABILITY"));
    g.version = env_int("FAKE_CUDA_DRIVER_VERSION", 1000, 99990, 12080);
    parse_fail_call(getenv("FAKE_CUDA_FAIL_CALL"));
    g.total_mem = mem && *mem ? strtoull(mem, NULL, 10) : 16ull << 30;
    if (g.total_mem == 0)
        g.total_mem = 16ull << 30;
    for (int i = 0; i < MAX_DEV; i++)
        g.ctx[i].dev = i;
    g.next_handle = 0xfa0000000000ull;
}

/* ---- devices and contexts ------------------------------------------------------------------ */

static CUresult need_init(void)
{
    return g.inited ? CUDA_SUCCESS : fail(CUDA_ERROR_NOT_INITIALIZED, "cuInit(0) has not been called");
}

static CUresult need_dev(CUdevice dev)
{
    CUresult r = need_init();
    if (r)
        return r;
    if (dev < 0 || dev >= g.ndev)
        return fail(CUDA_ERROR_INVALID_DEVICE, "device %d does not exist (%d device(s))", dev, g.ndev);
    return CUDA_SUCCESS;
}

static struct fc_ctx *cur_ctx(void)
{
    return t_depth ? t_stack[t_depth - 1] : NULL;
}

static int valid_ctx(const struct fc_ctx *c)
{
    for (int i = 0; i < g.ndev; i++)
        if (c == &g.ctx[i])
            return 1;
    return 0;
}

/* The current context, usable: else INVALID_CONTEXT, CONTEXT_IS_DESTROYED or its sticky error. */
static CUresult need_ctx(struct fc_ctx **out)
{
    struct fc_ctx *c;
    CUresult r = need_init();
    if (r)
        return r;
    c = cur_ctx();
    if (!c)
        return fail(CUDA_ERROR_INVALID_CONTEXT, "no CUDA context is current on this thread");
    if (c->refs == 0)
        return fail(CUDA_ERROR_CONTEXT_IS_DESTROYED,
                    "the context current on this thread was destroyed (its primary context was released)");
    if (c->sticky)
        return fail(c->sticky, "the context is unusable after an earlier %s", err_name(c->sticky));
    *out = c;
    return CUDA_SUCCESS;
}

/* ---- memory ranges --------------------------------------------------------------------------- */

static struct range *find_range(uintptr_t addr)
{
    for (size_t i = 0; i < g.ranges.n; i++) {
        struct range *r = g.ranges.v[i];
        if (addr >= r->base && addr - r->base < r->size)
            return r;
    }
    return NULL;
}

static const char *range_kind(const struct range *r)
{
    switch (r->kind) {
    case R_ALLOC:
        return "cuMemAlloc block";
    case R_HOSTALLOC:
        return "pinned host allocation";
    case R_HOSTREG:
        return "host registration";
    default:
        return "VMM mapping";
    }
}

/* Pinned host memory (cuMemHostAlloc, cuMemHostRegister) is pinned and mapped for the context
 * that made it only, unless made PORTABLE (CU_MEMHOSTALLOC_PORTABLE ==
 * CU_MEMHOSTREGISTER_PORTABLE): to every other context it is pageable memory. With one primary
 * context per device, the context of device `dev` is g.ctx[dev]. */
static int host_for_dev(const struct range *r, int dev)
{
    return (r->flags & CU_MEMHOSTREGISTER_PORTABLE) || r->ctx->dev == dev;
}

/* What device `dev` may do with a range: 1 read, 2 write. */
static int range_perm(const struct range *r, int dev)
{
    switch (r->kind) {
    case R_ALLOC:
        return r->ctx->dev == dev ? 3 : 0;
    case R_HOSTALLOC:
        /* unified addressing: pinned host memory is device-accessible (for its contexts) */
        return host_for_dev(r, dev) ? 3 : 0;
    case R_HOSTREG:
        if (!(r->flags & CU_MEMHOSTREGISTER_DEVICEMAP) || !host_for_dev(r, dev))
            return 0;
        return (r->flags & CU_MEMHOSTREGISTER_READ_ONLY) ? 1 : 3;
    default:
        return r->access[dev] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? 3
               : r->access[dev] == CU_MEM_ACCESS_FLAGS_PROT_READ    ? 1
                                                                    : 0;
    }
}

/* Checks that device `dev` may access [addr, addr + len) with `need` (1 read, 2 write), all
 * inside one live range. Writes the reason to why/whylen and returns nonzero if not. */
static int span_bad(int dev, uintptr_t addr, size_t len, int need, const char *what, char *why,
                    size_t whylen)
{
    struct range *r;
    if (len == 0)
        return 0;
    r = find_range(addr);
    if (!r) {
        snprintf(why, whylen, "%s 0x%lx is not in any live allocation, mapping or registration", what,
                 (unsigned long)addr);
        return 1;
    }
    if (len > r->size - (addr - r->base)) {
        snprintf(why, whylen, "%s [0x%lx, +%zu) runs %zu bytes past the end of the %s [0x%lx, +%zu)", what,
                 (unsigned long)addr, len, len - (r->size - (addr - r->base)), range_kind(r),
                 (unsigned long)r->base, r->size);
        return 1;
    }
    if ((range_perm(r, dev) & need) != need) {
        snprintf(why, whylen, "%s [0x%lx, +%zu): device %d may not %s this %s%s", what, (unsigned long)addr,
                 len, dev, need & 2 ? "write" : "read", range_kind(r),
                 r->kind == R_MAP ? " (cuMemSetAccess did not grant it)"
                 : r->kind != R_ALLOC && !host_for_dev(r, dev) ? " (made without PORTABLE by another device's context)"
                 : "");
        return 1;
    }
    return 0;
}

static CUresult dev_span(int dev, uintptr_t addr, size_t len, int need, const char *what)
{
    char why[512];
    if (span_bad(dev, addr, len, need, what, why, sizeof why))
        return fail(CUDA_ERROR_INVALID_VALUE, "%s", why);
    return CUDA_SUCCESS;
}

/* True if [p, p + n) is pinned (page-locked) host memory for the context of device `dev`. */
static int host_pinned(int dev, const void *p, size_t n)
{
    struct range *r = find_range((uintptr_t)p);
    return r && (r->kind == R_HOSTALLOC || r->kind == R_HOSTREG) && host_for_dev(r, dev) &&
           n <= r->size - ((uintptr_t)p - r->base);
}

static void free_range(struct range *r)
{
    if (r->kind == R_ALLOC || r->kind == R_HOSTALLOC)
        munmap((void *)r->base, r->maplen);
    if (r->kind == R_ALLOC)
        g.used[r->ctx->dev] -= r->size;
    vdel(&g.ranges, r);
    free(r);
}

/* ---- streams, deferred work, events ------------------------------------------------------------ */

static void free_op(struct op *o)
{
    free(o->staging);
    free(o);
}

static void discard_ops(struct fc_stream *s)
{
    while (s->head) {
        struct op *o = s->head;
        s->head = o->next;
        free_op(o);
    }
    s->tail = NULL;
}

static void discard_legacy(struct fc_ctx *c)
{
    while (c->lhead) {
        struct op *o = c->lhead;
        c->lhead = o->next;
        free_op(o);
    }
    c->ltail = NULL;
}

static void fault(struct fc_ctx *c, CUresult r, const char *what)
{
    fprintf(stderr,
            "fake libcuda[%d]: FAULT on device %d: %s: %s (the context is now unusable, as after a GPU fault)\n",
            (int)getpid(), c->dev, what, err_name(r));
    c->sticky = r;
    discard_legacy(c);
    for (size_t i = 0; i < g.streams.n; i++) {
        struct fc_stream *s = g.streams.v[i];
        if (s->ctx == c)
            discard_ops(s);
    }
}

static void run_launch(struct fc_ctx *c, const struct op *o);

static void exec_op(struct fc_ctx *c, struct op *o)
{
    char why[512];
    switch (o->kind) {
    case OP_COPY:
        if ((o->dst_dev && span_bad(c->dev, o->dst, o->n, 2, "copy destination", why, sizeof why)) ||
            (o->src_dev && span_bad(c->dev, o->src, o->n, 1, "copy source", why, sizeof why))) {
            fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, why);
            return;
        }
        if (o->pinned_host && !host_pinned(c->dev, (const void *)(o->dst_dev ? o->src : o->dst), o->n)) {
            /* Freed by another device's context, which did not wait for this stream. */
            snprintf(why, sizeof why, "copy %s: pinned host memory [0x%lx, +%zu) was freed before the copy ran",
                     o->dst_dev ? "source" : "destination", (unsigned long)(o->dst_dev ? o->src : o->dst), o->n);
            fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, why);
            return;
        }
        memmove((void *)o->dst, o->staging ? o->staging : (const void *)o->src, o->n);
        break;
    case OP_MEMSET:
        if (span_bad(c->dev, o->dst, o->n, 2, "memset destination", why, sizeof why)) {
            fault(c, CUDA_ERROR_ILLEGAL_ADDRESS, why);
            return;
        }
        memset((void *)o->dst, o->value, o->n);
        break;
    case OP_LAUNCH:
        run_launch(c, o);
        break;
    case OP_EVENT:
        if (o->ev && o->gen == o->ev->rec_gen) {
            o->ev->done_gen = o->gen;
            clock_gettime(CLOCK_MONOTONIC, &o->ev->t);
        }
        break;
    }
}

/* Completes the legacy default stream's pending work (staged pageable H2D copies) in order. A
 * copy whose destination went meanwhile (unmapped, freed by another device's context) faults
 * like any queued work. */
static void run_legacy(struct fc_ctx *c)
{
    while (c->lhead) {
        struct op *o = c->lhead;
        c->lhead = o->next;
        if (!c->lhead)
            c->ltail = NULL;
        if (!c->sticky)
            exec_op(c, o); /* a fault discards the rest */
        free_op(o);
    }
}

/* Runs the stream's queued work in order, through `stop` (NULL: all of it). A blocking stream
 * (flags 0) synchronises with the legacy default stream: the legacy work queued before its own
 * (every pending staged copy: a legacy call first runs the blocking streams' work) completes
 * first. A CU_STREAM_NON_BLOCKING stream waits for none of it. */
static void run_stream(struct fc_stream *s, const struct op *stop)
{
    if (s->head && !(s->flags & CU_STREAM_NON_BLOCKING))
        run_legacy(s->ctx);
    while (s->head) {
        struct op *o = s->head;
        int last = o == stop;
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        if (!s->ctx->sticky)
            exec_op(s->ctx, o);
        free_op(o);
        if (s->ctx->sticky) {
            discard_ops(s);
            return;
        }
        if (last)
            return;
    }
}

/* Waiting for the legacy default stream (before legacy work runs, or the host waits for it):
 * its pending staged copies complete, then, by its implicit synchronisation, every blocking
 * stream of `c` runs (their work was queued after those copies). Never a non-blocking one. */
static void sync_legacy(struct fc_ctx *c)
{
    run_legacy(c);
    for (size_t i = 0; i < g.streams.n && !c->sticky; i++) {
        struct fc_stream *s = g.streams.v[i];
        if (s->ctx == c && !(s->flags & CU_STREAM_NON_BLOCKING))
            run_stream(s, NULL);
    }
}

/* All of `c`'s work: the non-blocking streams first (they wait for nothing on the legacy
 * stream, so they never see a staged copy they did not wait for), then the legacy stream and
 * the blocking streams. */
static void run_ctx(struct fc_ctx *c)
{
    for (size_t i = 0; i < g.streams.n; i++) {
        struct fc_stream *s = g.streams.v[i];
        if (s->ctx == c && (s->flags & CU_STREAM_NON_BLOCKING))
            run_stream(s, NULL);
    }
    sync_legacy(c);
}

/* The implicit synchronisation of freeing memory: the work of device `dev` (its primary
 * context, while alive), never another device's. */
static void run_dev(int dev)
{
    if (g.ctx[dev].refs > 0)
        run_ctx(&g.ctx[dev]);
}

/* Queues `o` on `s`, or for the default stream (NULL) runs it now, after the legacy stream's
 * pending copies and the blocking streams. */
static CUresult enqueue(struct fc_ctx *c, struct fc_stream *s, struct op *o)
{
    if (s) {
        if (s->tail)
            s->tail->next = o;
        else
            s->head = o;
        s->tail = o;
        return CUDA_SUCCESS;
    }
    sync_legacy(c);
    if (!c->sticky)
        exec_op(c, o);
    free_op(o);
    return c->sticky;
}

static struct op *new_op(int kind)
{
    struct op *o = calloc(1, sizeof *o);
    if (!o)
        abort();
    o->kind = kind;
    return o;
}

/* The stream handle `h` of context `c`: NULL for the default stream. */
static CUresult get_stream(struct fc_ctx *c, CUstream h, struct fc_stream **out)
{
    if ((uintptr_t)h <= 2) { /* 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD */
        *out = NULL;
        return CUDA_SUCCESS;
    }
    if (vfind(&g.streams, h) < 0)
        return fail(CUDA_ERROR_INVALID_HANDLE, "stream %p is not a live stream", (void *)h);
    if (h->ctx != c)
        return fail(CUDA_ERROR_INVALID_HANDLE, "stream %p belongs to device %d's context, not the current one",
                    (void *)h, h->ctx->dev);
    *out = h;
    return CUDA_SUCCESS;
}

static CUresult get_event(struct fc_ctx *c, CUevent e)
{
    if (!e || vfind(&g.events, e) < 0)
        return fail(CUDA_ERROR_INVALID_HANDLE, "event %p is not a live event", (void *)e);
    if (e->ctx != c)
        return fail(CUDA_ERROR_INVALID_HANDLE, "event %p belongs to another context", (void *)e);
    return CUDA_SUCCESS;
}

static int event_done(const struct fc_event *e)
{
    return e->done_gen == e->rec_gen;
}

/* Runs the event's stream up to its latest record. */
static void run_until_event(struct fc_event *e)
{
    struct fc_stream *s = e->stream;
    if (!s || event_done(e))
        return;
    for (struct op *o = s->head; o; o = o->next)
        if (o->kind == OP_EVENT && o->ev == e && o->gen == e->rec_gen) {
            run_stream(s, o);
            return;
        }
}

/* ---- kernels: argument layouts, the bytes each launch touches, serial execution ---------- */

struct launch_view {
    const struct kernel *k;
    const unsigned char *args;
    const unsigned *grid, *block;
    int dev;
};

struct kernel {
    const char *name;
    int nparams;
    unsigned char size[MAX_PARAMS];
    const char *ptx_type[MAX_PARAMS];
    /* Checks the bytes the launch will touch: 0, or a CUresult with `why` set. */
    CUresult (*check)(const struct launch_view *l, char *why, size_t whylen);
    void (*thread)(const unsigned char *args);
};

static size_t arg_off(const struct kernel *k, int i)
{
    size_t off = 0;
    for (int j = 0; j <= i; j++) {
        off = round_up(off, k->size[j]);
        if (j < i)
            off += k->size[j];
    }
    return off;
}

static uint64_t a64(const struct kernel *k, const unsigned char *args, int i)
{
    uint64_t v;
    memcpy(&v, args + arg_off(k, i), 8);
    return v;
}

static unsigned a32(const struct kernel *k, const unsigned char *args, int i)
{
    unsigned v;
    memcpy(&v, args + arg_off(k, i), 4);
    return v;
}

/* The span [addr, addr + len) a kernel derives from pointer argument `base` must lie inside
 * the allocation `base` points into, with the access `need`. */
static int kspan_bad(const struct launch_view *l, const char *arg, uint64_t base, uint64_t addr, uint64_t len,
                     int need, char *why, size_t whylen)
{
    struct range *r;
    if (len == 0)
        return 0;
    r = find_range((uintptr_t)base);
    if (!r) {
        snprintf(why, whylen, "%s: pointer argument %s = 0x%llx is not in any live device allocation",
                 l->k->name, arg, (unsigned long long)base);
        return 1;
    }
    if (addr < r->base || addr - r->base > r->size || len > r->size - (addr - r->base)) {
        snprintf(why, whylen,
                 "%s: %s bytes [0x%llx, +%llu) lie outside the %s [0x%lx, +%zu) that %s = 0x%llx points into",
                 l->k->name, need & 2 ? "writes" : "reads", (unsigned long long)addr, (unsigned long long)len,
                 range_kind(r), (unsigned long)r->base, r->size, arg, (unsigned long long)base);
        return 1;
    }
    if ((range_perm(r, l->dev) & need) != need) {
        snprintf(why, whylen, "%s: %s %s [0x%llx, +%llu) of a %s device %d may not %s", l->k->name,
                 need & 2 ? "writes" : "reads", arg, (unsigned long long)addr, (unsigned long long)len,
                 range_kind(r), l->dev, need & 2 ? "write" : "read");
        return 1;
    }
    return 0;
}

static int cmp_u64pair(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : 0;
}

/* In one buffer: no frag's source bytes [src + src_off, +len) meet a destination of the
 * sorted, disjoint writes w[0..m) (offsets from dst). Binary search per frag: O(n log n). */
static CUresult check_reads_unwritten(const sw_frag *frags, unsigned n, uint64_t src, uint64_t dst,
                                      const uint64_t *w, unsigned m, char *why, size_t whylen)
{
    for (unsigned f = 0; f < n; f++) {
        uint64_t rs = src + frags[f].src_off, re = rs + frags[f].len;
        unsigned lo = 0, hi = m; /* first write starting at or after re */
        if (!frags[f].len)
            continue;
        while (lo < hi) {
            unsigned mid = lo + (hi - lo) / 2;
            if (dst + w[2 * mid] < re)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo > 0 && dst + w[2 * (lo - 1) + 1] > rs) {
            snprintf(why, whylen,
                     "sw_gather: frag %u reads [0x%llx, 0x%llx), which the launch writes (contract: in one buffer, reads and writes are disjoint)",
                     f, (unsigned long long)rs, (unsigned long long)re);
            return CUDA_ERROR_LAUNCH_FAILED;
        }
    }
    return CUDA_SUCCESS;
}

/* sw_gather(src, dst, frags, nfrags): every frag f < nfrags is read (blocks stride over them)
 * and copies [src + src_off, +len) to [dst + dst_off, +len). */
static CUresult check_gather(const struct launch_view *l, char *why, size_t whylen)
{
    const struct kernel *k = l->k;
    uint64_t src = a64(k, l->args, 0), dst = a64(k, l->args, 1), fr = a64(k, l->args, 2);
    unsigned n = a32(k, l->args, 3);
    const sw_frag *frags = (const sw_frag *)(uintptr_t)fr;
    uint64_t *iv, any = 0;
    CUresult result = CUDA_SUCCESS;
    if (n == 0)
        return CUDA_SUCCESS;
    if (kspan_bad(l, "frags", fr, fr, (uint64_t)n * sizeof(sw_frag), 1, why, whylen))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    for (unsigned f = 0; f < n; f++) {
        const sw_frag *x = &frags[f];
        char arg[64];
        if (x->len == 0)
            continue;
        any = 1;
        snprintf(arg, sizeof arg, "src (frag %u)", f);
        if (x->src_off > UINT64_MAX - src ||
            kspan_bad(l, arg, src, src + x->src_off, x->len, 1, why, whylen)) {
            if (x->src_off > UINT64_MAX - src)
                snprintf(why, whylen, "sw_gather: frag %u: src + %llu overflows", f,
                         (unsigned long long)x->src_off);
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
        snprintf(arg, sizeof arg, "dst (frag %u)", f);
        if (x->dst_off > UINT64_MAX - dst ||
            kspan_bad(l, arg, dst, dst + x->dst_off, x->len, 2, why, whylen)) {
            if (x->dst_off > UINT64_MAX - dst)
                snprintf(why, whylen, "sw_gather: frag %u: dst + %llu overflows", f,
                         (unsigned long long)x->dst_off);
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
    }
    if (!any)
        return CUDA_SUCCESS;
    /* The contract (kernels.rs, shardwire.cu): no two frags write the same destination byte,
     * and in one buffer no frag reads a byte any frag writes. A GPU would race silently (and
     * its read-only loads of src would not be coherent with the writes). */
    iv = malloc((size_t)n * 2 * sizeof *iv);
    if (!iv)
        abort();
    {
        unsigned m = 0;
        for (unsigned f = 0; f < n; f++)
            if (frags[f].len) {
                iv[2 * m] = frags[f].dst_off;
                iv[2 * m + 1] = frags[f].dst_off + frags[f].len;
                m++;
            }
        qsort(iv, m, 2 * sizeof *iv, cmp_u64pair);
        for (unsigned i = 1; i < m; i++)
            if (iv[2 * i] < iv[2 * (i - 1) + 1]) {
                snprintf(why, whylen,
                         "sw_gather: destinations [%llu, %llu) and [%llu, %llu) overlap (contract: disjoint; blocks would race)",
                         (unsigned long long)iv[2 * (i - 1)], (unsigned long long)iv[2 * (i - 1) + 1],
                         (unsigned long long)iv[2 * i], (unsigned long long)iv[2 * i + 1]);
                result = CUDA_ERROR_LAUNCH_FAILED;
                break;
            }
        if (result == CUDA_SUCCESS && find_range((uintptr_t)src) == find_range((uintptr_t)dst))
            result = check_reads_unwritten(frags, n, src, dst, iv, m, why, whylen);
    }
    free(iv);
    return result;
}

static uint64_t min64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

/* sw_crc32c_chunks(base, spans, nspans, chunk, partials, max_chunks): thread k (x dimension) of
 * span s = blockIdx.y < nspans, for k < max_chunks, reads spans[s] and, for the chunks that
 * exist, [base + off + k * chunk, +min(chunk, len - k * chunk)); writes partials[s * max + k]. */
static CUresult check_crc_chunks(const struct launch_view *l, char *why, size_t whylen)
{
    const struct kernel *k = l->k;
    uint64_t base = a64(k, l->args, 0), sp = a64(k, l->args, 1), partials = a64(k, l->args, 4);
    unsigned nspans = a32(k, l->args, 2), chunk = a32(k, l->args, 3), max_chunks = a32(k, l->args, 5);
    uint64_t kmax = min64(max_chunks, (uint64_t)l->grid[0] * l->block[0]);
    uint64_t smax = min64(nspans, l->grid[1]);
    const sw_span *spans = (const sw_span *)(uintptr_t)sp;
    if (chunk == 0 || kmax == 0 || smax == 0)
        return CUDA_SUCCESS;
    if (kspan_bad(l, "spans", sp, sp, smax * sizeof(sw_span), 1, why, whylen))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    for (uint64_t s = 0; s < smax; s++) {
        uint64_t nchunks = spans[s].len / chunk + (spans[s].len % chunk != 0);
        uint64_t kk = min64(kmax, nchunks), bytes = min64(spans[s].len, kk * chunk);
        char arg[64];
        if (kk == 0)
            continue;
        snprintf(arg, sizeof arg, "base (span %llu)", (unsigned long long)s);
        if (spans[s].off > UINT64_MAX - base || bytes > UINT64_MAX - base - spans[s].off) {
            snprintf(why, whylen, "sw_crc32c_chunks: span %llu: base + %llu overflows", (unsigned long long)s,
                     (unsigned long long)spans[s].off);
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
        if (kspan_bad(l, arg, base, base + spans[s].off, bytes, 1, why, whylen))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        snprintf(arg, sizeof arg, "partials (span %llu)", (unsigned long long)s);
        if (kspan_bad(l, arg, partials, partials + 4 * s * max_chunks, 4 * kk, 2, why, whylen))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    return CUDA_SUCCESS;
}

/* sw_crc32c_combine(spans, nspans, chunk, partials, max_chunks, out): thread s < nspans reads
 * spans[s] and partials[s * max + k] for k < min(chunks of the span, max), writes out[s]. */
static CUresult check_crc_combine(const struct launch_view *l, char *why, size_t whylen)
{
    const struct kernel *k = l->k;
    uint64_t sp = a64(k, l->args, 0), partials = a64(k, l->args, 3), out = a64(k, l->args, 5);
    unsigned nspans = a32(k, l->args, 1), chunk = a32(k, l->args, 2), max_chunks = a32(k, l->args, 4);
    uint64_t smax = min64(nspans, (uint64_t)l->grid[0] * l->block[0]);
    const sw_span *spans = (const sw_span *)(uintptr_t)sp;
    if (smax == 0)
        return CUDA_SUCCESS;
    if (kspan_bad(l, "spans", sp, sp, smax * sizeof(sw_span), 1, why, whylen) ||
        kspan_bad(l, "out", out, out, smax * 4, 2, why, whylen))
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    if (chunk == 0)
        return CUDA_SUCCESS;
    for (uint64_t s = 0; s < smax; s++) {
        uint64_t nchunks = spans[s].len / chunk + (spans[s].len % chunk != 0);
        uint64_t kk = min64(nchunks, max_chunks);
        char arg[64];
        snprintf(arg, sizeof arg, "partials (span %llu)", (unsigned long long)s);
        if (kspan_bad(l, arg, partials, partials + 4 * s * max_chunks, 4 * kk, 1, why, whylen))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    return CUDA_SUCCESS;
}

static void th_gather(const unsigned char *a);
static void th_crc_chunks(const unsigned char *a);
static void th_crc_combine(const unsigned char *a);

static const struct kernel kernels[NKERNELS] = {
    {"sw_gather", 4, {8, 8, 8, 4}, {".u64", ".u64", ".u64", ".u32"}, check_gather, th_gather},
    {"sw_crc32c_chunks", 6, {8, 8, 4, 4, 8, 4}, {".u64", ".u64", ".u32", ".u32", ".u64", ".u32"},
     check_crc_chunks, th_crc_chunks},
    {"sw_crc32c_combine", 6, {8, 4, 4, 8, 4, 8}, {".u64", ".u32", ".u32", ".u64", ".u32", ".u64"},
     check_crc_combine, th_crc_combine},
};

#define P8(i) ((void *)(uintptr_t)a64(k, a, i))
static void th_gather(const unsigned char *a)
{
    const struct kernel *k = &kernels[0];
    sw_gather(P8(0), P8(1), P8(2), a32(k, a, 3));
}

static void th_crc_chunks(const unsigned char *a)
{
    const struct kernel *k = &kernels[1];
    sw_crc32c_chunks(P8(0), P8(1), a32(k, a, 2), a32(k, a, 3), P8(4), a32(k, a, 5));
}

static void th_crc_combine(const unsigned char *a)
{
    const struct kernel *k = &kernels[2];
    sw_crc32c_combine(P8(0), a32(k, a, 1), a32(k, a, 2), P8(3), a32(k, a, 4), P8(5));
}
#undef P8

static void run_launch(struct fc_ctx *c, const struct op *o)
{
    struct launch_view l = {o->k, o->args, o->grid, o->block, c->dev};
    char why[640];
    CUresult r = o->k->check(&l, why, sizeof why);
    if (r) {
        fault(c, r, why);
        return;
    }
    gridDim.x = o->grid[0], gridDim.y = o->grid[1], gridDim.z = o->grid[2];
    blockDim.x = o->block[0], blockDim.y = o->block[1], blockDim.z = o->block[2];
    for (blockIdx.z = 0; blockIdx.z < gridDim.z; blockIdx.z++)
        for (blockIdx.y = 0; blockIdx.y < gridDim.y; blockIdx.y++)
            for (blockIdx.x = 0; blockIdx.x < gridDim.x; blockIdx.x++)
                for (threadIdx.z = 0; threadIdx.z < blockDim.z; threadIdx.z++)
                    for (threadIdx.y = 0; threadIdx.y < blockDim.y; threadIdx.y++)
                        for (threadIdx.x = 0; threadIdx.x < blockDim.x; threadIdx.x++)
                            o->k->thread(o->args);
}

/* ---- PTX: what a module declares ------------------------------------------------------------- */

struct ptx_scan {
    const char *p, *end;
    char tok[128];
};

/* The next token ('(' ')' ',' ';' '{' '}' '[' ']' '=' alone, else a run of other non-space
 * characters); comments are skipped. Returns 0 at the end. */
static int next_tok(struct ptx_scan *s)
{
    size_t n = 0;
    for (;;) {
        while (s->p < s->end && isspace((unsigned char)*s->p))
            s->p++;
        if (s->end - s->p >= 2 && s->p[0] == '/' && s->p[1] == '/') {
            while (s->p < s->end && *s->p != '\n')
                s->p++;
            continue;
        }
        if (s->end - s->p >= 2 && s->p[0] == '/' && s->p[1] == '*') {
            const char *e = strstr(s->p + 2, "*/");
            s->p = e && e < s->end ? e + 2 : s->end;
            continue;
        }
        break;
    }
    if (s->p >= s->end)
        return 0;
    if (strchr("(),;{}[]=", *s->p)) {
        s->tok[0] = *s->p++;
        s->tok[1] = '\0';
        return 1;
    }
    while (s->p < s->end && !isspace((unsigned char)*s->p) && !strchr("(),;{}[]=", *s->p)) {
        if (n + 1 < sizeof s->tok)
            s->tok[n++] = *s->p;
        s->p++;
    }
    s->tok[n] = '\0';
    return 1;
}

/* Parses the PTX text and fills the module's functions. */
static CUresult parse_ptx(const char *text, struct fc_module *m)
{
    struct ptx_scan s = {text, text + strlen(text), {0}};
    int version = 0, target = 0, addr64 = 0, sm = 0;
    while (next_tok(&s)) {
        if (!strcmp(s.tok, ".version"))
            version = 1;
        else if (!strcmp(s.tok, ".target")) {
            target = 1;
            if (next_tok(&s) && sscanf(s.tok, "sm_%d", &sm) != 1)
                sm = 0;
        } else if (!strcmp(s.tok, ".address_size")) {
            if (next_tok(&s) && !strcmp(s.tok, "64"))
                addr64 = 1;
        } else if (!strcmp(s.tok, ".entry")) {
            char name[128], types[MAX_PARAMS + 1][128];
            int np = 0;
            const struct kernel *k = NULL;
            if (!next_tok(&s))
                break;
            snprintf(name, sizeof name, "%s", s.tok);
            if (!next_tok(&s) || strcmp(s.tok, "("))
                return fail(CUDA_ERROR_INVALID_IMAGE, "PTX: .entry %s has no parameter list", name);
            while (next_tok(&s) && strcmp(s.tok, ")")) {
                if (strcmp(s.tok, ".param"))
                    continue;
                if (!next_tok(&s))
                    break;
                if (!strcmp(s.tok, ".align")) {
                    next_tok(&s);
                    next_tok(&s);
                }
                if (np <= MAX_PARAMS)
                    snprintf(types[np], sizeof types[np], "%s", s.tok);
                np++;
            }
            for (int i = 0; i < NKERNELS; i++)
                if (!strcmp(kernels[i].name, name))
                    k = &kernels[i];
            if (!k)
                return fail(CUDA_ERROR_INVALID_IMAGE,
                            "PTX declares .entry %s, which this fake cannot run (it cannot JIT PTX; it runs only the kernels compiled into it from gpu/kernels/shardwire.cu)",
                            name);
            if (np != k->nparams)
                return fail(CUDA_ERROR_INVALID_IMAGE, "PTX .entry %s has %d parameters; the compiled-in kernel has %d (stale PTX?)",
                            name, np, k->nparams);
            for (int i = 0; i < np; i++)
                if (strcmp(types[i], k->ptx_type[i]))
                    return fail(CUDA_ERROR_INVALID_IMAGE,
                                "PTX .entry %s parameter %d is %s; the compiled-in kernel's is %s (stale PTX?)", name, i,
                                types[i], k->ptx_type[i]);
            for (int i = 0; i < m->nfuncs; i++)
                if (m->funcs[i].k == k)
                    return fail(CUDA_ERROR_INVALID_IMAGE, "PTX declares .entry %s twice", name);
            m->funcs[m->nfuncs].mod = m;
            m->funcs[m->nfuncs].k = k;
            m->nfuncs++;
        }
    }
    if (!version || !target || !addr64)
        return fail(CUDA_ERROR_INVALID_IMAGE, "not PTX text for 64-bit addresses (needs .version, .target and .address_size 64)");
    if (sm > g.cc_major * 10 + g.cc_minor)
        return fail(CUDA_ERROR_INVALID_PTX,
                    "PTX .target sm_%d needs compute capability %d.%d; the device has %d.%d (FAKE_CUDA_COMPUTE_CAPABILITY)",
                    sm, sm / 10, sm % 10, g.cc_major, g.cc_minor);
    return CUDA_SUCCESS;
}

static struct fc_func *valid_func(CUfunction f)
{
    for (size_t i = 0; i < g.modules.n; i++) {
        struct fc_module *m = g.modules.v[i];
        for (int j = 0; j < m->nfuncs; j++)
            if (f == &m->funcs[j])
                return f;
    }
    return NULL;
}

/* ---- VMM helpers ----------------------------------------------------------------------------------- */

static struct alloc *find_alloc(CUmemGenericAllocationHandle h)
{
    for (size_t i = 0; i < g.allocs.n; i++) {
        struct alloc *a = g.allocs.v[i];
        if (a->handle == h && !a->released)
            return a;
    }
    return NULL;
}

static void maybe_free_alloc(struct alloc *a)
{
    if (!a->released || a->maps > 0)
        return;
    close(a->fd);
    if (a->accounted)
        g.used[a->dev] -= a->size;
    vdel(&g.allocs, a);
    free(a);
}

/* The whole mappings that tile [ptr, ptr + size) exactly, in `out` (at most `max`); -1 if the
 * range is not exactly a set of whole, contiguous mappings. */
static int tile_mappings(uintptr_t ptr, size_t size, struct range **out, int max)
{
    int n = 0;
    size_t covered = 0;
    if (size == 0 || ptr + size < ptr)
        return -1;
    for (size_t i = 0; i < g.ranges.n; i++) {
        struct range *r = g.ranges.v[i];
        if (r->kind != R_MAP || r->base >= ptr + size || r->base + r->size <= ptr)
            continue;
        if (r->base < ptr || r->base + r->size > ptr + size || n == max)
            return -1;
        out[n++] = r;
        covered += r->size;
    }
    return covered == size ? n : -1;
}

static void apply_prot(struct range *r)
{
    int prot = PROT_NONE;
    for (int d = 0; d < MAX_DEV; d++) {
        if (r->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            prot = PROT_READ | PROT_WRITE;
        else if (r->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE)
            prot = PROT_READ;
    }
    mprotect((void *)r->base, r->size, prot);
}

static CUresult check_prop(const CUmemAllocationProp *prop)
{
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return fail(CUDA_ERROR_INVALID_VALUE, "prop.type %d is not CU_MEM_ALLOCATION_TYPE_PINNED", prop->type);
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return fail(CUDA_ERROR_NOT_SUPPORTED, "prop.location.type %d: the fake has device memory only",
                    prop->location.type);
    if (prop->location.id < 0 || prop->location.id >= g.ndev)
        return fail(CUDA_ERROR_INVALID_DEVICE, "prop.location.id %d is not a device", prop->location.id);
    if (prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return fail(CUDA_ERROR_NOT_SUPPORTED, "requestedHandleTypes 0x%x: only POSIX file descriptors on Linux",
                    (unsigned)prop->requestedHandleTypes);
    if (prop->allocFlags.compressionType)
        return fail(CUDA_ERROR_NOT_SUPPORTED, "compressible memory is not supported");
    return CUDA_SUCCESS;
}

/* A memfd of ours (exported by cuMemExportToShareableHandle, in any process): the bus id of the
 * GPU it lies on, and this process's ordinal for it (-1 when this process has no such device). */
static int our_memfd(int fd, int *dev, char *bus, size_t buslen)
{
    char path[64], link[256];
    unsigned pci[4];
    ssize_t n;
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    n = readlink(path, link, sizeof link - 1);
    if (n <= 0)
        return 0;
    link[n] = '\0';
    if (strncmp(link, "/memfd:fakecuda-vmm:pci=", 24) != 0)
        return 0;
    snprintf(bus, buslen, "%.*s", (int)strcspn(link + 24, " "), link + 24);
    if (!parse_bdf(bus, pci))
        return 0;
    *dev = dev_at(pci);
    return 1;
}

/* True if [p, p + n) is mapped in this process, and writable when `write`. */
static int host_mapped(uintptr_t p, size_t n, int write)
{
    FILE *f = fopen("/proc/self/maps", "re");
    char line[512];
    uintptr_t at = p & ~(PAGE - 1), end = p + n;
    if (!f)
        return 0;
    while (at < end && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3)
            continue;
        if (lo > at)
            break; /* a hole */
        if (hi <= at)
            continue;
        if (perms[0] != 'r' || (write && perms[1] != 'w'))
            break;
        at = hi;
    }
    fclose(f);
    return at >= end;
}

/* ---- the API: init, devices ------------------------------------------------------------------------ */

CUAPI CUresult cuInit(unsigned int flags)
{
    ENTER();
    if (flags != 0)
        LEAVE("cuInit", fail(CUDA_ERROR_INVALID_VALUE, "flags must be 0, not %u", flags));
    /* A failed cuInit leaves the driver uninitialised: later calls answer NOT_INITIALIZED. */
    if (g.ndev == 0)
        LEAVE("cuInit", fail(CUDA_ERROR_NO_DEVICE, "FAKE_CUDA_DEVICES=0"));
    g.inited = 1;
    LEAVE("cuInit", CUDA_SUCCESS);
}

CUAPI CUresult cuDriverGetVersion(int *version)
{
    ENTER();
    if (!version)
        LEAVE("cuDriverGetVersion", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    *version = g.version;
    LEAVE("cuDriverGetVersion", CUDA_SUCCESS);
}

CUAPI CUresult cuGetErrorName(CUresult error, const char **str)
{
    if (!str)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *str = errors[i].name;
            return CUDA_SUCCESS;
        }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuGetErrorString(CUresult error, const char **str)
{
    if (!str)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *str = errors[i].text;
            return CUDA_SUCCESS;
        }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuDeviceGetCount(int *count)
{
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuDeviceGetCount", r);
    if (!count)
        LEAVE("cuDeviceGetCount", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    *count = g.ndev;
    LEAVE("cuDeviceGetCount", CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuDeviceGet", r);
    if (!dev)
        LEAVE("cuDeviceGet", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    if ((r = need_dev(ordinal)))
        LEAVE("cuDeviceGet", r);
    *dev = ordinal;
    LEAVE("cuDeviceGet", CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    CUresult r;
    ENTER();
    if ((r = need_dev(dev)))
        LEAVE("cuDeviceGetName", r);
    if (!name || len <= 0)
        LEAVE("cuDeviceGetName", fail(CUDA_ERROR_INVALID_VALUE, "NULL buffer or length %d", len));
    snprintf(name, (size_t)len, "%s", DEVICE_NAME);
    LEAVE("cuDeviceGetName", CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev)
{
    CUresult r;
    ENTER();
    if ((r = need_dev(dev)))
        LEAVE("cuDeviceGetPCIBusId", r);
    if (!bus_id || len <= 0)
        LEAVE("cuDeviceGetPCIBusId", fail(CUDA_ERROR_INVALID_VALUE, "NULL buffer or length %d", len));
    bus_text(dev, bus_id, (size_t)len);
    LEAVE("cuDeviceGetPCIBusId", CUDA_SUCCESS);
}

/* [domain]:[bus]:[device].[function], [domain]:[bus]:[device] or [bus]:[device].[function] (hex). */
CUAPI CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus_id)
{
    unsigned pci[4];
    char full[64];
    int d;
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuDeviceGetByPCIBusId", r);
    if (!dev || !bus_id)
        LEAVE("cuDeviceGetByPCIBusId", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    snprintf(full, sizeof full, "%s", bus_id);
    if (!parse_bdf(full, pci)) {
        /* [domain]:[bus]:[device]: function 0 */
        snprintf(full, sizeof full, "%s.0", bus_id);
        if (!parse_bdf(full, pci) || strchr(bus_id, '.'))
            LEAVE("cuDeviceGetByPCIBusId", fail(CUDA_ERROR_INVALID_VALUE, "\"%s\" is not a PCI bus id", bus_id));
    }
    if ((d = dev_at(pci)) < 0)
        LEAVE("cuDeviceGetByPCIBusId", fail(CUDA_ERROR_INVALID_DEVICE, "no device at %s (%d device(s))", bus_id, g.ndev));
    *dev = (CUdevice)d;
    LEAVE("cuDeviceGetByPCIBusId", CUDA_SUCCESS);
}

typedef struct {
    char bytes[16];
} CUuuid;

/* The UUID of device `dev`: a function of its bus id alone (the physical GPU). */
static void uuid_of(int dev, CUuuid *u)
{
    const unsigned *p = g.pci[dev];
    const unsigned char b[16] = {0x5a, 0x77, 0xfa, 0x4e, (unsigned char)(p[0] >> 8), (unsigned char)p[0], 0x40,
                                 (unsigned char)p[1], 0x80, (unsigned char)p[2], (unsigned char)(p[3] << 4), 0, 0, 0,
                                 0, 0};
    memcpy(u->bytes, b, sizeof b);
}

CUAPI CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    CUresult r;
    ENTER();
    if ((r = need_dev(dev)))
        LEAVE("cuDeviceGetUuid_v2", r);
    if (!uuid)
        LEAVE("cuDeviceGetUuid_v2", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    uuid_of(dev, uuid);
    LEAVE("cuDeviceGetUuid_v2", CUDA_SUCCESS);
}

/* Before CUDA 11.4 (MIG) the same: the fake has no MIG instances. */
CUAPI CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid_v2(uuid, dev);
}

CUAPI CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult r;
    ENTER();
    if ((r = need_dev(dev)))
        LEAVE("cuDeviceTotalMem_v2", r);
    if (!bytes)
        LEAVE("cuDeviceTotalMem_v2", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    *bytes = (size_t)g.total_mem;
    LEAVE("cuDeviceTotalMem_v2", CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev)
{
    int v;
    CUresult r;
    ENTER();
    if ((r = need_dev(dev)))
        LEAVE("cuDeviceGetAttribute", r);
    if (!value)
        LEAVE("cuDeviceGetAttribute", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    switch (attrib) {
    case ATTR_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case 2: case 3: v = 1024; break;              /* MAX_BLOCK_DIM_X, _Y */
    case 4: v = 64; break;                        /* MAX_BLOCK_DIM_Z */
    case 5: v = INT_MAX; break;                   /* MAX_GRID_DIM_X */
    case 6: case 7: v = 65535; break;             /* MAX_GRID_DIM_Y, _Z */
    case 8: case 97: v = 48 << 10; break;         /* MAX_SHARED_MEMORY_PER_BLOCK (_OPTIN) */
    case 9: v = 64 << 10; break;                  /* TOTAL_CONSTANT_MEMORY */
    case 10: v = 32; break;                       /* WARP_SIZE */
    case 12: case 82: v = 64 << 10; break;        /* MAX_REGISTERS_PER_BLOCK / _MULTIPROCESSOR */
    case 13: case 36: v = 1000000; break;         /* CLOCK_RATE, MEMORY_CLOCK_RATE (kHz) */
    case 16: v = 1; break;                        /* MULTIPROCESSOR_COUNT */
    case 19: case 41: case 99: v = 1; break;      /* CAN_MAP_HOST_MEMORY, UNIFIED_ADDRESSING, HOST_REGISTER */
    case 31: v = 1; break;                        /* CONCURRENT_KERNELS */
    case ATTR_PCI_BUS_ID: v = (int)g.pci[dev][1]; break;
    case ATTR_PCI_DEVICE_ID: v = (int)g.pci[dev][2]; break;
    case 50: v = (int)g.pci[dev][0]; break;       /* PCI_DOMAIN_ID */
    case 37: v = 64; break;                       /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: v = 1 << 20; break;                  /* L2_CACHE_SIZE */
    case 39: v = 2048; break;                     /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: v = 1; break;                        /* ASYNC_ENGINE_COUNT */
    case 75: v = g.cc_major; break;               /* COMPUTE_CAPABILITY_MAJOR (8: the PTX's sm_80) */
    case 76: v = g.cc_minor; break;               /* COMPUTE_CAPABILITY_MINOR */
    case 86: case 101: v = g.host_coherent; break; /* HOST_NATIVE_ATOMIC, DIRECT_MANAGED_MEM_ACCESS_FROM_HOST */
    case 81: v = 164 << 10; break;                /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case 103: v = 1; break;                       /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    case 106: v = 32; break;                      /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: v = 1; break;
    case 113: v = 1; break;                       /* READ_ONLY_HOST_REGISTER_SUPPORTED */
    case 116: v = 1; break;                       /* GPU_DIRECT_RDMA_SUPPORTED */
    case ATTR_DMA_BUF_SUPPORTED: v = 1; break;
    default:
        if (attrib <= 0 || attrib >= ATTR_MAX)
            LEAVE("cuDeviceGetAttribute", fail(CUDA_ERROR_INVALID_VALUE, "unknown attribute %d", attrib));
        v = 0;
    }
    *value = v;
    LEAVE("cuDeviceGetAttribute", CUDA_SUCCESS);
}

/* ---- the API: contexts ------------------------------------------------------------------------------- */

static void destroy_ctx(struct fc_ctx *c)
{
    unsigned streams = 0, events = 0, modules = 0, allocs = 0, hostallocs = 0, regs = 0;
    unsigned long long alloc_bytes = 0;
    discard_legacy(c); /* staged copies never landed: abandoned with the context */
    for (size_t i = g.streams.n; i-- > 0;) {
        struct fc_stream *s = g.streams.v[i];
        if (s->ctx == c) {
            discard_ops(s); /* abandoned: the work of a destroyed context never runs */
            vdel(&g.streams, s);
            free(s);
            streams++;
        }
    }
    for (size_t i = g.events.n; i-- > 0;) {
        struct fc_event *e = g.events.v[i];
        if (e->ctx == c) {
            vdel(&g.events, e);
            free(e);
            events++;
        }
    }
    for (size_t i = g.modules.n; i-- > 0;) {
        struct fc_module *m = g.modules.v[i];
        if (m->ctx == c) {
            vdel(&g.modules, m);
            free(m);
            modules++;
        }
    }
    for (size_t i = g.ranges.n; i-- > 0;) {
        struct range *r = g.ranges.v[i];
        if (r->kind == R_MAP || r->ctx != c)
            continue;
        if (r->kind == R_ALLOC)
            allocs++, alloc_bytes += r->size;
        else if (r->kind == R_HOSTALLOC)
            hostallocs++;
        else
            regs++;
        free_range(r);
    }
    c->sticky = CUDA_SUCCESS;
    if (g.log >= 1 && streams + events + modules + allocs + hostallocs + regs > 0)
        fprintf(stderr,
                "fake libcuda[%d]: LEAK: the primary context of device %d was destroyed (last release) with %u "
                "stream(s), %u event(s), %u module(s), %u cuMemAlloc block(s) (%llu bytes), %u pinned host "
                "allocation(s), %u host registration(s) still alive\n",
                (int)getpid(), c->dev, streams, events, modules, allocs, alloc_bytes, hostallocs, regs);
}

CUAPI CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CUresult r;
    ENTER();
    if ((r = need_dev(dev)))
        LEAVE("cuDevicePrimaryCtxRetain", r);
    if (!pctx)
        LEAVE("cuDevicePrimaryCtxRetain", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    if (g.ctx[dev].refs++ == 0)
        g.ctx[dev].sticky = CUDA_SUCCESS;
    *pctx = &g.ctx[dev];
    LEAVE("cuDevicePrimaryCtxRetain", CUDA_SUCCESS);
}

CUAPI CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CUresult r;
    ENTER();
    if ((r = need_dev(dev)))
        LEAVE("cuDevicePrimaryCtxRelease_v2", r);
    if (g.ctx[dev].refs == 0)
        LEAVE("cuDevicePrimaryCtxRelease_v2",
              fail(CUDA_ERROR_INVALID_CONTEXT, "device %d's primary context is not retained", dev));
    if (--g.ctx[dev].refs == 0)
        destroy_ctx(&g.ctx[dev]);
    LEAVE("cuDevicePrimaryCtxRelease_v2", CUDA_SUCCESS);
}

static CUresult usable_ctx(CUcontext ctx)
{
    if (!valid_ctx(ctx))
        return fail(CUDA_ERROR_INVALID_CONTEXT, "%p is not a context", (void *)ctx);
    if (ctx->refs == 0)
        return fail(CUDA_ERROR_INVALID_CONTEXT, "device %d's primary context is not retained", ctx->dev);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuCtxSetCurrent", r);
    if (!ctx) {
        if (t_depth > 0)
            t_depth--;
        LEAVE("cuCtxSetCurrent", CUDA_SUCCESS);
    }
    if ((r = usable_ctx(ctx)))
        LEAVE("cuCtxSetCurrent", r);
    if (t_depth == 0)
        t_depth = 1;
    t_stack[t_depth - 1] = ctx;
    LEAVE("cuCtxSetCurrent", CUDA_SUCCESS);
}

CUAPI CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuCtxGetCurrent", r);
    if (!pctx)
        LEAVE("cuCtxGetCurrent", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    *pctx = cur_ctx();
    LEAVE("cuCtxGetCurrent", CUDA_SUCCESS);
}

CUAPI CUresult cuCtxGetDevice(CUdevice *device)
{
    struct fc_ctx *c;
    CUresult r;
    ENTER();
    if (!device)
        LEAVE("cuCtxGetDevice", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    if ((r = need_ctx(&c)))
        LEAVE("cuCtxGetDevice", r);
    *device = c->dev;
    LEAVE("cuCtxGetDevice", CUDA_SUCCESS);
}

CUAPI CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult r;
    ENTER();
    if ((r = need_init()) || (r = usable_ctx(ctx)))
        LEAVE("cuCtxPushCurrent_v2", r);
    if (t_depth == CTX_STACK)
        LEAVE("cuCtxPushCurrent_v2", fail(CUDA_ERROR_INVALID_VALUE, "context stack full (%d, a fake limit)", CTX_STACK));
    t_stack[t_depth++] = ctx;
    LEAVE("cuCtxPushCurrent_v2", CUDA_SUCCESS);
}

CUAPI CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuCtxPopCurrent_v2", r);
    if (t_depth == 0)
        LEAVE("cuCtxPopCurrent_v2", fail(CUDA_ERROR_INVALID_CONTEXT, "no context is current on this thread"));
    t_depth--;
    if (pctx)
        *pctx = t_stack[t_depth];
    LEAVE("cuCtxPopCurrent_v2", CUDA_SUCCESS);
}

CUAPI CUresult cuCtxSynchronize(void)
{
    struct fc_ctx *c;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuCtxSynchronize", r);
    run_ctx(c);
    LEAVE("cuCtxSynchronize", c->sticky);
}

/* ---- the API: device and pinned host memory ----------------------------------------------------------- */

static void *map_anon(size_t len)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

CUAPI CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    struct fc_ctx *c;
    struct range *r;
    void *p;
    CUresult res;
    ENTER();
    if ((res = need_ctx(&c)))
        LEAVE("cuMemAlloc_v2", res);
    if (!dptr || size == 0)
        LEAVE("cuMemAlloc_v2", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or size 0"));
    if (size > g.total_mem - g.used[c->dev])
        LEAVE("cuMemAlloc_v2", fail(CUDA_ERROR_OUT_OF_MEMORY, "%zu bytes asked, %llu of %llu free", size,
                                    g.total_mem - g.used[c->dev], g.total_mem));
    if (!(p = map_anon(round_up(size, PAGE))))
        LEAVE("cuMemAlloc_v2", fail(CUDA_ERROR_OUT_OF_MEMORY, "mmap of %zu bytes: %s", size, strerror(errno)));
    memset(p, POISON, size);
    r = calloc(1, sizeof *r);
    *r = (struct range){.kind = R_ALLOC, .base = (uintptr_t)p, .size = size, .maplen = round_up(size, PAGE), .ctx = c};
    vpush(&g.ranges, r);
    g.used[c->dev] += size;
    log_alloc("cuMemAlloc", c->dev, size);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    LEAVE("cuMemAlloc_v2", CUDA_SUCCESS);
}

CUAPI CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    struct range *r;
    CUresult res;
    ENTER();
    if ((res = need_init()))
        LEAVE("cuMemFree_v2", res);
    r = find_range((uintptr_t)dptr);
    if (!r || r->kind != R_ALLOC || r->base != dptr)
        LEAVE("cuMemFree_v2", fail(CUDA_ERROR_INVALID_VALUE, "0x%llx is not the start of a cuMemAlloc block", dptr));
    run_dev(r->ctx->dev);
    free_range(r);
    LEAVE("cuMemFree_v2", CUDA_SUCCESS);
}

CUAPI CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags)
{
    struct fc_ctx *c;
    struct range *r;
    void *p;
    CUresult res;
    ENTER();
    if ((res = need_ctx(&c)))
        LEAVE("cuMemHostAlloc", res);
    if (!pp || size == 0)
        LEAVE("cuMemHostAlloc", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or size 0"));
    if (flags & ~(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED))
        LEAVE("cuMemHostAlloc", fail(CUDA_ERROR_INVALID_VALUE, "unknown flags 0x%x", flags));
    if (!(p = map_anon(round_up(size, PAGE))))
        LEAVE("cuMemHostAlloc", fail(CUDA_ERROR_OUT_OF_MEMORY, "mmap of %zu bytes: %s", size, strerror(errno)));
    memset(p, POISON, size);
    r = calloc(1, sizeof *r);
    *r = (struct range){.kind = R_HOSTALLOC, .base = (uintptr_t)p, .size = size, .maplen = round_up(size, PAGE),
                        .ctx = c, .flags = flags};
    vpush(&g.ranges, r);
    *pp = p;
    LEAVE("cuMemHostAlloc", CUDA_SUCCESS);
}

CUAPI CUresult cuMemFreeHost(void *p)
{
    struct range *r;
    CUresult res;
    ENTER();
    if ((res = need_init()))
        LEAVE("cuMemFreeHost", res);
    r = find_range((uintptr_t)p);
    if (!r || r->kind != R_HOSTALLOC || r->base != (uintptr_t)p)
        LEAVE("cuMemFreeHost", fail(CUDA_ERROR_INVALID_VALUE, "%p is not the start of a cuMemHostAlloc allocation", p));
    run_dev(r->ctx->dev);
    free_range(r);
    LEAVE("cuMemFreeHost", CUDA_SUCCESS);
}

CUAPI CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags)
{
    struct fc_ctx *c;
    struct range *r;
    CUresult res;
    ENTER();
    if ((res = need_ctx(&c)))
        LEAVE("cuMemHostRegister_v2", res);
    if (!p || size == 0)
        LEAVE("cuMemHostRegister_v2", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or size 0"));
    if (flags & ~(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
                  CU_MEMHOSTREGISTER_READ_ONLY))
        LEAVE("cuMemHostRegister_v2", fail(CUDA_ERROR_INVALID_VALUE, "unknown flags 0x%x", flags));
    if (flags & CU_MEMHOSTREGISTER_IOMEMORY)
        LEAVE("cuMemHostRegister_v2", fail(CUDA_ERROR_NOT_SUPPORTED, "the fake has no I/O memory to register"));
    for (size_t i = 0; i < g.ranges.n; i++) {
        struct range *o = g.ranges.v[i];
        if (o->base < (uintptr_t)p + size && (uintptr_t)p < o->base + o->size)
            LEAVE("cuMemHostRegister_v2",
                  fail(o->kind == R_HOSTREG || o->kind == R_HOSTALLOC ? CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
                                                                      : CUDA_ERROR_INVALID_VALUE,
                       "[%p, +%zu) overlaps a %s [0x%lx, +%zu)", p, size, range_kind(o), (unsigned long)o->base,
                       o->size));
    }
    if (!host_mapped((uintptr_t)p, size, !(flags & CU_MEMHOSTREGISTER_READ_ONLY)))
        LEAVE("cuMemHostRegister_v2",
              fail(CUDA_ERROR_INVALID_VALUE, "[%p, +%zu) is not all mapped%s", p, size,
                   flags & CU_MEMHOSTREGISTER_READ_ONLY ? " readable" : " read-write (a read-only mapping needs CU_MEMHOSTREGISTER_READ_ONLY)"));
    r = calloc(1, sizeof *r);
    *r = (struct range){.kind = R_HOSTREG, .base = (uintptr_t)p, .size = size, .ctx = c, .flags = flags};
    vpush(&g.ranges, r);
    LEAVE("cuMemHostRegister_v2", CUDA_SUCCESS);
}

CUAPI CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *dptr, void *p, unsigned int flags)
{
    struct fc_ctx *c;
    struct range *r;
    CUresult res;
    ENTER();
    if ((res = need_ctx(&c)))
        LEAVE("cuMemHostGetDevicePointer_v2", res);
    if (!dptr || flags != 0)
        LEAVE("cuMemHostGetDevicePointer_v2", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or flags %u != 0", flags));
    r = find_range((uintptr_t)p);
    if (!r || (r->kind != R_HOSTREG && r->kind != R_HOSTALLOC) ||
        !(r->flags & (r->kind == R_HOSTREG ? CU_MEMHOSTREGISTER_DEVICEMAP : CU_MEMHOSTALLOC_DEVICEMAP)))
        LEAVE("cuMemHostGetDevicePointer_v2",
              fail(CUDA_ERROR_INVALID_VALUE, "%p is not in host memory registered or allocated with DEVICEMAP", p));
    if (!host_for_dev(r, c->dev))
        LEAVE("cuMemHostGetDevicePointer_v2",
              fail(CUDA_ERROR_INVALID_VALUE,
                   "%p: the %s was made without PORTABLE by device %d's context, not the current one (device %d)", p,
                   range_kind(r), r->ctx->dev, c->dev));
    *dptr = (CUdeviceptr)(uintptr_t)p;
    LEAVE("cuMemHostGetDevicePointer_v2", CUDA_SUCCESS);
}

CUAPI CUresult cuMemHostUnregister(void *p)
{
    struct range *r;
    CUresult res;
    ENTER();
    if ((res = need_init()))
        LEAVE("cuMemHostUnregister", res);
    r = find_range((uintptr_t)p);
    if (!r || r->kind != R_HOSTREG || r->base != (uintptr_t)p)
        LEAVE("cuMemHostUnregister",
              fail(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "%p is not the start of a host registration", p));
    run_dev(r->ctx->dev);
    free_range(r);
    LEAVE("cuMemHostUnregister", CUDA_SUCCESS);
}

/* ---- the API: copies ------------------------------------------------------------------------------------------ */

/* A synchronous copy on the legacy default stream. Earlier legacy work (staged copies) and the
 * blocking streams run first ("a stream sync is performed before the copy is initiated").
 * From pageable host memory to the device, the call returns once the bytes are staged and the
 * copy lands later, in legacy-stream order (see sync_legacy, run_stream): "the DMA to final
 * destination may not have completed". From pinned memory, and to the host, it is done when
 * the call returns. */
static CUresult copy_now(const char *what, uintptr_t dst, int dst_dev, uintptr_t src, int src_dev, size_t n)
{
    struct fc_ctx *c;
    struct op *o;
    CUresult r;
    if ((r = need_ctx(&c)))
        return r;
    if (n == 0)
        return CUDA_SUCCESS;
    if ((!dst_dev && !dst) || (!src_dev && !src))
        return fail(CUDA_ERROR_INVALID_VALUE, "%s: NULL host pointer", what);
    if ((dst_dev && (r = dev_span(c->dev, dst, n, 2, "destination"))) ||
        (src_dev && (r = dev_span(c->dev, src, n, 1, "source"))))
        return r;
    sync_legacy(c);
    if (c->sticky)
        return c->sticky;
    if (!dst_dev || src_dev || host_pinned(c->dev, (const void *)src, n)) {
        memmove((void *)dst, (const void *)src, n);
        return CUDA_SUCCESS;
    }
    o = new_op(OP_COPY);
    o->dst = dst, o->src = src, o->n = n, o->dst_dev = 1;
    if (!(o->staging = malloc(n)))
        abort();
    memcpy(o->staging, (const void *)src, n); /* the host buffer may be reused at once */
    if (c->ltail)
        c->ltail->next = o;
    else
        c->lhead = o;
    c->ltail = o;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    ENTER();
    LEAVE("cuMemcpyHtoD_v2", copy_now("cuMemcpyHtoD", (uintptr_t)dst, 1, (uintptr_t)src, 0, n));
}

CUAPI CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    ENTER();
    LEAVE("cuMemcpyDtoH_v2", copy_now("cuMemcpyDtoH", (uintptr_t)dst, 0, (uintptr_t)src, 1, n));
}

CUAPI CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n)
{
    struct fc_ctx *c;
    CUresult r;
    struct op *o;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuMemsetD8_v2", r);
    if ((r = dev_span(c->dev, (uintptr_t)dst, n, 2, "destination")))
        LEAVE("cuMemsetD8_v2", r);
    if (n == 0)
        LEAVE("cuMemsetD8_v2", CUDA_SUCCESS);
    o = new_op(OP_MEMSET);
    o->dst = (uintptr_t)dst, o->n = n, o->value = value;
    LEAVE("cuMemsetD8_v2", enqueue(c, NULL, o));
}

/* An async copy: queued on `h` (pageable sources staged now; pageable destinations waited for). */
static CUresult copy_async(const char *what, uintptr_t dst, int dst_dev, uintptr_t src, int src_dev, size_t n,
                           CUstream h)
{
    struct fc_ctx *c;
    struct fc_stream *s;
    struct op *o;
    CUresult r;
    int sync_after = 0;
    if ((r = need_ctx(&c)) || (r = get_stream(c, h, &s)))
        return r;
    if ((!dst_dev && !dst) || (!src_dev && !src))
        return fail(CUDA_ERROR_INVALID_VALUE, "%s: NULL host pointer", what);
    if ((dst_dev && (r = dev_span(c->dev, dst, n, 2, "destination"))) ||
        (src_dev && (r = dev_span(c->dev, src, n, 1, "source"))))
        return r;
    if (n == 0)
        return CUDA_SUCCESS;
    o = new_op(OP_COPY);
    o->dst = dst, o->src = src, o->n = n, o->dst_dev = dst_dev, o->src_dev = src_dev;
    if (!src_dev && !host_pinned(c->dev, (const void *)src, n)) {
        o->staging = malloc(n); /* pageable source: staged before the call returns */
        if (!o->staging)
            abort();
        memcpy(o->staging, (const void *)src, n);
    }
    if (!dst_dev && !host_pinned(c->dev, (const void *)dst, n))
        sync_after = 1; /* pageable destination: the call returns when the copy is done */
    o->pinned_host = (!src_dev && !o->staging) || (!dst_dev && !sync_after);
    if ((r = enqueue(c, s, o)))
        return r;
    if (sync_after && s) {
        run_stream(s, o);
        return c->sticky;
    }
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h)
{
    ENTER();
    LEAVE("cuMemcpyHtoDAsync_v2", copy_async("cuMemcpyHtoDAsync", (uintptr_t)dst, 1, (uintptr_t)src, 0, n, h));
}

CUAPI CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h)
{
    ENTER();
    LEAVE("cuMemcpyDtoHAsync_v2", copy_async("cuMemcpyDtoHAsync", (uintptr_t)dst, 0, (uintptr_t)src, 1, n, h));
}

CUAPI CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    ENTER();
    LEAVE("cuMemcpyDtoDAsync_v2", copy_async("cuMemcpyDtoDAsync", (uintptr_t)dst, 1, (uintptr_t)src, 1, n, h));
}

/* ---- the API: streams and events ---------------------------------------------------------------------- */

CUAPI CUresult cuStreamCreate(CUstream *ph, unsigned int flags)
{
    struct fc_ctx *c;
    struct fc_stream *s;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuStreamCreate", r);
    if (!ph || (flags & ~CU_STREAM_NON_BLOCKING))
        LEAVE("cuStreamCreate", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or unknown flags 0x%x", flags));
    s = calloc(1, sizeof *s);
    s->ctx = c, s->flags = flags;
    vpush(&g.streams, s);
    *ph = s;
    LEAVE("cuStreamCreate", CUDA_SUCCESS);
}

CUAPI CUresult cuStreamDestroy_v2(CUstream h)
{
    struct fc_ctx *c;
    struct fc_stream *s;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)) || (r = get_stream(c, h, &s)))
        LEAVE("cuStreamDestroy_v2", r);
    if (!s)
        LEAVE("cuStreamDestroy_v2", fail(CUDA_ERROR_INVALID_HANDLE, "the default stream cannot be destroyed"));
    run_stream(s, NULL); /* queued work completes, as documented */
    for (size_t i = 0; i < g.events.n; i++) {
        struct fc_event *e = g.events.v[i];
        if (e->stream == s)
            e->stream = NULL;
    }
    vdel(&g.streams, s);
    free(s);
    LEAVE("cuStreamDestroy_v2", c->sticky);
}

CUAPI CUresult cuStreamSynchronize(CUstream h)
{
    struct fc_ctx *c;
    struct fc_stream *s;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)) || (r = get_stream(c, h, &s)))
        LEAVE("cuStreamSynchronize", r);
    if (s)
        run_stream(s, NULL);
    else
        sync_legacy(c);
    LEAVE("cuStreamSynchronize", c->sticky);
}

CUAPI CUresult cuEventCreate(CUevent *ph, unsigned int flags)
{
    struct fc_ctx *c;
    struct fc_event *e;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuEventCreate", r);
    if (!ph || (flags & ~(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)) ||
        ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING)))
        LEAVE("cuEventCreate", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or bad flags 0x%x", flags));
    if (injected_failure("cuEventCreate"))
        LEAVE("cuEventCreate", fail(CUDA_ERROR_OUT_OF_MEMORY, "injected (FAKE_CUDA_FAIL_CALL=cuEventCreate:%llu)", g.fail_nth));
    e = calloc(1, sizeof *e);
    e->ctx = c, e->flags = flags;
    vpush(&g.events, e);
    *ph = e;
    LEAVE("cuEventCreate", CUDA_SUCCESS);
}

CUAPI CUresult cuEventRecord(CUevent e, CUstream h)
{
    struct fc_ctx *c;
    struct fc_stream *s;
    struct op *o;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)) || (r = get_event(c, e)) || (r = get_stream(c, h, &s)))
        LEAVE("cuEventRecord", r);
    /* Markers of earlier records stay queued but no longer complete the event. */
    e->rec_gen++;
    e->stream = s;
    o = new_op(OP_EVENT);
    o->ev = e, o->gen = e->rec_gen;
    LEAVE("cuEventRecord", enqueue(c, s, o));
}

CUAPI CUresult cuEventQuery(CUevent e)
{
    struct fc_ctx *c;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)) || (r = get_event(c, e)))
        LEAVE("cuEventQuery", r);
    if (event_done(e))
        LEAVE("cuEventQuery", CUDA_SUCCESS);
    run_until_event(e); /* "not yet", and the device makes progress meanwhile */
    LEAVE("cuEventQuery", c->sticky ? c->sticky : CUDA_ERROR_NOT_READY);
}

CUAPI CUresult cuEventSynchronize(CUevent e)
{
    struct fc_ctx *c;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)) || (r = get_event(c, e)))
        LEAVE("cuEventSynchronize", r);
    run_until_event(e);
    LEAVE("cuEventSynchronize", c->sticky);
}

CUAPI CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    struct fc_ctx *c;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuEventElapsedTime", r);
    if (!ms)
        LEAVE("cuEventElapsedTime", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    if ((r = get_event(c, start)) || (r = get_event(c, end)))
        LEAVE("cuEventElapsedTime", r);
    if ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING)
        LEAVE("cuEventElapsedTime", fail(CUDA_ERROR_INVALID_HANDLE, "an event was created with CU_EVENT_DISABLE_TIMING"));
    if (start->rec_gen == 0 || end->rec_gen == 0)
        LEAVE("cuEventElapsedTime", fail(CUDA_ERROR_INVALID_HANDLE, "an event was never recorded"));
    if (!event_done(start) || !event_done(end))
        LEAVE("cuEventElapsedTime", fail(CUDA_ERROR_NOT_READY, "an event has not completed"));
    *ms = (float)((double)(end->t.tv_sec - start->t.tv_sec) * 1e3 + (double)(end->t.tv_nsec - start->t.tv_nsec) / 1e6);
    LEAVE("cuEventElapsedTime", CUDA_SUCCESS);
}

CUAPI CUresult cuEventDestroy_v2(CUevent e)
{
    struct fc_ctx *c;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)) || (r = get_event(c, e)))
        LEAVE("cuEventDestroy_v2", r);
    for (size_t i = 0; i < g.streams.n; i++) {
        struct fc_stream *s = g.streams.v[i];
        for (struct op *o = s->head; o; o = o->next)
            if (o->kind == OP_EVENT && o->ev == e)
                o->ev = NULL;
    }
    vdel(&g.events, e);
    free(e);
    LEAVE("cuEventDestroy_v2", CUDA_SUCCESS);
}

/* ---- the API: modules and launches --------------------------------------------------------------------- */

CUAPI CUresult cuModuleLoadData(CUmodule *pm, const void *image)
{
    struct fc_ctx *c;
    struct fc_module *m;
    const unsigned char *b = image;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuModuleLoadData", r);
    if (!pm || !image)
        LEAVE("cuModuleLoadData", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    if ((b[0] == 0x7f && b[1] == 'E' && b[2] == 'L' && b[3] == 'F') ||
        (b[0] == 0x50 && b[1] == 0xed && b[2] == 0x55 && b[3] == 0xba))
        LEAVE("cuModuleLoadData",
              fail(CUDA_ERROR_NOT_SUPPORTED, "a cubin or fatbin: the fake loads PTX text of its compiled-in kernels only"));
    m = calloc(1, sizeof *m);
    m->ctx = c;
    if ((r = parse_ptx(image, m))) {
        free(m);
        LEAVE("cuModuleLoadData", r);
    }
    vpush(&g.modules, m);
    *pm = m;
    LEAVE("cuModuleLoadData", CUDA_SUCCESS);
}

CUAPI CUresult cuModuleGetFunction(CUfunction *pf, CUmodule m, const char *name)
{
    struct fc_ctx *c;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuModuleGetFunction", r);
    if (!pf || !name)
        LEAVE("cuModuleGetFunction", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    if (vfind(&g.modules, m) < 0 || m->ctx != c)
        LEAVE("cuModuleGetFunction", fail(CUDA_ERROR_INVALID_HANDLE, "%p is not a module of the current context", (void *)m));
    for (int i = 0; i < m->nfuncs; i++)
        if (!strcmp(m->funcs[i].k->name, name)) {
            *pf = &m->funcs[i];
            LEAVE("cuModuleGetFunction", CUDA_SUCCESS);
        }
    LEAVE("cuModuleGetFunction", fail(CUDA_ERROR_NOT_FOUND, "the module has no entry \"%s\"", name));
}

CUAPI CUresult cuModuleUnload(CUmodule m)
{
    struct fc_ctx *c;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuModuleUnload", r);
    if (vfind(&g.modules, m) < 0 || m->ctx != c)
        LEAVE("cuModuleUnload", fail(CUDA_ERROR_INVALID_HANDLE, "%p is not a module of the current context", (void *)m));
    run_ctx(c);
    vdel(&g.modules, m);
    free(m);
    LEAVE("cuModuleUnload", CUDA_SUCCESS);
}

CUAPI CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned shmem, CUstream h, void **params, void **extra)
{
    struct fc_ctx *c;
    struct fc_stream *s;
    struct fc_func *fn;
    struct op *o;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuLaunchKernel", r);
    if (!(fn = valid_func(f)) || fn->mod->ctx != c)
        LEAVE("cuLaunchKernel", fail(CUDA_ERROR_INVALID_HANDLE, "%p is not a function of a module of the current context", (void *)f));
    if ((r = get_stream(c, h, &s)))
        LEAVE("cuLaunchKernel", r);
    if (!gx || !gy || !gz || !bx || !by || !bz || gx > (unsigned)INT_MAX || gy > 65535 || gz > 65535 || bx > 1024 ||
        by > 1024 || bz > 64 || (unsigned long long)bx * by * bz > 1024)
        LEAVE("cuLaunchKernel", fail(CUDA_ERROR_INVALID_VALUE, "%s: grid (%u, %u, %u) block (%u, %u, %u) out of limits",
                                     fn->k->name, gx, gy, gz, bx, by, bz));
    if (shmem > (48u << 10))
        LEAVE("cuLaunchKernel", fail(CUDA_ERROR_INVALID_VALUE, "%u bytes of dynamic shared memory", shmem));
    if (extra && params)
        LEAVE("cuLaunchKernel", fail(CUDA_ERROR_INVALID_VALUE, "both kernelParams and extra"));
    if (extra)
        LEAVE("cuLaunchKernel", fail(CUDA_ERROR_NOT_SUPPORTED, "the fake does not implement `extra`; pass kernelParams"));
    if (!params)
        LEAVE("cuLaunchKernel", fail(CUDA_ERROR_INVALID_VALUE, "%s takes %d parameters; kernelParams is NULL",
                                     fn->k->name, fn->k->nparams));
    for (int i = 0; i < fn->k->nparams; i++)
        if (!params[i])
            LEAVE("cuLaunchKernel", fail(CUDA_ERROR_INVALID_VALUE, "kernelParams[%d] is NULL", i));
    if (injected_failure("cuLaunchKernel"))
        LEAVE("cuLaunchKernel", fail(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "injected (FAKE_CUDA_FAIL_CALL=cuLaunchKernel:%llu)",
                                     g.fail_nth));
    o = new_op(OP_LAUNCH);
    o->k = fn->k;
    o->grid[0] = gx, o->grid[1] = gy, o->grid[2] = gz;
    o->block[0] = bx, o->block[1] = by, o->block[2] = bz;
    for (int i = 0; i < fn->k->nparams; i++)
        memcpy(o->args + arg_off(fn->k, i), params[i], fn->k->size[i]);
    LEAVE("cuLaunchKernel", enqueue(c, s, o));
}

/* ---- the API: virtual memory management ----------------------------------------------------------------- */

CUAPI CUresult cuMemGetAllocationGranularity(size_t *gran, const CUmemAllocationProp *prop, int option)
{
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuMemGetAllocationGranularity", r);
    if (!gran || !prop || (option != 0 && option != 1))
        LEAVE("cuMemGetAllocationGranularity", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or option %d", option));
    if ((r = check_prop(prop)))
        LEAVE("cuMemGetAllocationGranularity", r);
    *gran = GRANULARITY;
    LEAVE("cuMemGetAllocationGranularity", CUDA_SUCCESS);
}

CUAPI CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags)
{
    struct alloc *a;
    char name[64], bus[32];
    int fd;
    void *p;
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuMemCreate", r);
    if (!handle || !prop || flags != 0)
        LEAVE("cuMemCreate", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or flags %llu != 0", flags));
    if ((r = check_prop(prop)))
        LEAVE("cuMemCreate", r);
    if (size == 0 || size % GRANULARITY)
        LEAVE("cuMemCreate", fail(CUDA_ERROR_INVALID_VALUE, "size %zu is not a positive multiple of the granularity %zu",
                                  size, GRANULARITY));
    if (size > g.total_mem - g.used[prop->location.id])
        LEAVE("cuMemCreate", fail(CUDA_ERROR_OUT_OF_MEMORY, "%zu bytes asked, %llu free", size,
                                  g.total_mem - g.used[prop->location.id]));
    bus_text(prop->location.id, bus, sizeof bus);
    snprintf(name, sizeof name, "fakecuda-vmm:pci=%s", bus);
    fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)size) < 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        LEAVE("cuMemCreate", fail(CUDA_ERROR_OUT_OF_MEMORY, "memfd of %zu bytes: %s", size, strerror(e)));
    }
    p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        close(fd);
        LEAVE("cuMemCreate", fail(CUDA_ERROR_OUT_OF_MEMORY, "mmap of the memfd: %s", strerror(e)));
    }
    memset(p, POISON, size);
    munmap(p, size);
    a = calloc(1, sizeof *a);
    *a = (struct alloc){.handle = ++g.next_handle, .fd = fd, .size = size, .dev = prop->location.id,
                        .handle_types = prop->requestedHandleTypes, .rdma = prop->allocFlags.gpuDirectRDMACapable,
                        .accounted = 1};
    vpush(&g.allocs, a);
    g.used[a->dev] += size;
    log_alloc("cuMemCreate", a->dev, size);
    *handle = a->handle;
    LEAVE("cuMemCreate", CUDA_SUCCESS);
}

CUAPI CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    struct alloc *a;
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuMemRelease", r);
    if (!(a = find_alloc(handle)))
        LEAVE("cuMemRelease", fail(CUDA_ERROR_INVALID_VALUE, "0x%llx is not a live allocation handle", handle));
    a->released = 1;
    maybe_free_alloc(a);
    LEAVE("cuMemRelease", CUDA_SUCCESS);
}

CUAPI CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                   unsigned long long flags)
{
    struct fc_ctx *c;
    struct resv *v;
    size_t align = alignment < GRANULARITY ? GRANULARITY : alignment;
    uint8_t *p = MAP_FAILED, *base;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuMemAddressReserve", r);
    if (!ptr || flags != 0 || size == 0 || size % GRANULARITY || (alignment & (alignment - 1)))
        LEAVE("cuMemAddressReserve",
              fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer, flags %llu, size %zu (a multiple of %zu) or alignment %zu",
                   flags, size, GRANULARITY, alignment));
    if (addr && addr % align == 0)
        p = mmap((void *)(uintptr_t)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE,
                 -1, 0);
    if (p != MAP_FAILED && p != (uint8_t *)(uintptr_t)addr) {
        munmap(p, size); /* an old kernel ignored MAP_FIXED_NOREPLACE: the hint is only a hint */
        p = MAP_FAILED;
    }
    if (p == MAP_FAILED) {
        p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            LEAVE("cuMemAddressReserve", fail(CUDA_ERROR_OUT_OF_MEMORY, "mmap: %s", strerror(errno)));
        base = (uint8_t *)round_up((uintptr_t)p, align);
        if (base > p)
            munmap(p, (size_t)(base - p));
        if (base + size < p + size + align)
            munmap(base + size, (size_t)(p + size + align - (base + size)));
        p = base;
    }
    v = calloc(1, sizeof *v);
    v->base = (uintptr_t)p, v->size = size;
    vpush(&g.resvs, v);
    *ptr = (CUdeviceptr)(uintptr_t)p;
    LEAVE("cuMemAddressReserve", CUDA_SUCCESS);
}

CUAPI CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    struct fc_ctx *c;
    struct resv *v = NULL;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuMemAddressFree", r);
    for (size_t i = 0; i < g.resvs.n; i++) {
        struct resv *x = g.resvs.v[i];
        if (x->base == ptr && x->size == size)
            v = x;
    }
    if (!v)
        LEAVE("cuMemAddressFree", fail(CUDA_ERROR_INVALID_VALUE, "[0x%llx, +%zu) is not a whole reservation", ptr, size));
    for (size_t i = 0; i < g.ranges.n; i++) {
        struct range *m = g.ranges.v[i];
        if (m->kind == R_MAP && m->base >= v->base && m->base < v->base + v->size)
            LEAVE("cuMemAddressFree", fail(CUDA_ERROR_INVALID_VALUE, "the range is still mapped at 0x%lx (cuMemUnmap first)",
                                           (unsigned long)m->base));
    }
    munmap((void *)v->base, v->size);
    vdel(&g.resvs, v);
    free(v);
    LEAVE("cuMemAddressFree", CUDA_SUCCESS);
}

CUAPI CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags)
{
    struct fc_ctx *c;
    struct alloc *a;
    struct range *m;
    int in_resv = 0;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuMemMap", r);
    if (flags != 0 || offset != 0)
        LEAVE("cuMemMap", fail(CUDA_ERROR_INVALID_VALUE, "flags %llu and offset %zu must be 0", flags, offset));
    if (!(a = find_alloc(handle)))
        LEAVE("cuMemMap", fail(CUDA_ERROR_INVALID_VALUE, "0x%llx is not a live allocation handle", handle));
    if (size == 0 || size % GRANULARITY || ptr % GRANULARITY || size > a->size)
        LEAVE("cuMemMap", fail(CUDA_ERROR_INVALID_VALUE, "[0x%llx, +%zu) is not granularity-aligned or exceeds the %zu-byte allocation",
                               ptr, size, a->size));
    for (size_t i = 0; i < g.resvs.n; i++) {
        struct resv *v = g.resvs.v[i];
        if (ptr >= v->base && ptr - v->base <= v->size && size <= v->size - (ptr - v->base))
            in_resv = 1;
    }
    if (!in_resv)
        LEAVE("cuMemMap", fail(CUDA_ERROR_INVALID_VALUE, "[0x%llx, +%zu) is not inside a reservation", ptr, size));
    for (size_t i = 0; i < g.ranges.n; i++) {
        struct range *o = g.ranges.v[i];
        if (o->kind == R_MAP && o->base < ptr + size && ptr < o->base + o->size)
            LEAVE("cuMemMap", fail(CUDA_ERROR_INVALID_VALUE, "[0x%llx, +%zu) is already mapped", ptr, size));
    }
    if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED)
        LEAVE("cuMemMap", fail(CUDA_ERROR_OUT_OF_MEMORY, "mmap: %s", strerror(errno)));
    m = calloc(1, sizeof *m);
    *m = (struct range){.kind = R_MAP, .base = (uintptr_t)ptr, .size = size, .alloc = a};
    vpush(&g.ranges, m);
    a->maps++;
    LEAVE("cuMemMap", CUDA_SUCCESS);
}

#define MAX_TILES 64

CUAPI CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    struct fc_ctx *c;
    struct range *tiles[MAX_TILES];
    int n;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuMemUnmap", r);
    if ((n = tile_mappings((uintptr_t)ptr, size, tiles, MAX_TILES)) < 0)
        LEAVE("cuMemUnmap", fail(CUDA_ERROR_INVALID_VALUE, "[0x%llx, +%zu) is not exactly whole mappings", ptr, size));
    /* No implicit synchronisation (none is documented): queued work that touches the range
     * faults when it runs (its spans are checked then). */
    for (int i = 0; i < n; i++) {
        struct range *m = tiles[i];
        struct alloc *a = m->alloc;
        mmap((void *)m->base, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        vdel(&g.ranges, m);
        free(m);
        a->maps--;
        maybe_free_alloc(a);
    }
    LEAVE("cuMemUnmap", CUDA_SUCCESS);
}

CUAPI CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    struct fc_ctx *c;
    struct range *tiles[MAX_TILES];
    int n;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuMemSetAccess", r);
    if (!desc || count == 0)
        LEAVE("cuMemSetAccess", fail(CUDA_ERROR_INVALID_VALUE, "no access descriptors"));
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
            desc[i].location.id >= g.ndev)
            LEAVE("cuMemSetAccess", fail(CUDA_ERROR_INVALID_VALUE, "descriptor %zu: location (%d, %d) is not a device", i,
                                         desc[i].location.type, desc[i].location.id));
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            LEAVE("cuMemSetAccess", fail(CUDA_ERROR_INVALID_VALUE, "descriptor %zu: flags %d", i, desc[i].flags));
    }
    if ((n = tile_mappings((uintptr_t)ptr, size, tiles, MAX_TILES)) < 0)
        LEAVE("cuMemSetAccess", fail(CUDA_ERROR_INVALID_VALUE,
                                     "[0x%llx, +%zu) is not exactly whole mappings (the fake grants access per mapping)", ptr, size));
    for (int i = 0; i < n; i++) {
        for (size_t j = 0; j < count; j++)
            tiles[i]->access[desc[j].location.id] = (unsigned char)desc[j].flags;
        apply_prot(tiles[i]);
    }
    LEAVE("cuMemSetAccess", CUDA_SUCCESS);
}

CUAPI CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle, int type,
                                            unsigned long long flags)
{
    struct alloc *a;
    int fd;
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuMemExportToShareableHandle", r);
    if (!out || flags != 0)
        LEAVE("cuMemExportToShareableHandle", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or flags %llu != 0", flags));
    if (!(a = find_alloc(handle)))
        LEAVE("cuMemExportToShareableHandle", fail(CUDA_ERROR_INVALID_VALUE, "0x%llx is not a live allocation handle", handle));
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        LEAVE("cuMemExportToShareableHandle", fail(CUDA_ERROR_NOT_SUPPORTED, "handle type %d (POSIX fds only on Linux)", type));
    if (!(a->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        LEAVE("cuMemExportToShareableHandle",
              fail(CUDA_ERROR_INVALID_VALUE, "the allocation was not created with requestedHandleTypes POSIX_FILE_DESCRIPTOR"));
    if ((fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0)) < 0)
        LEAVE("cuMemExportToShareableHandle", fail(CUDA_ERROR_OUT_OF_MEMORY, "dup: %s", strerror(errno)));
    memcpy(out, &fd, sizeof fd);
    LEAVE("cuMemExportToShareableHandle", CUDA_SUCCESS);
}

CUAPI CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type)
{
    struct alloc *a;
    struct stat st;
    char bus[32];
    int fd = (int)(intptr_t)os_handle, dev, own;
    CUresult r;
    ENTER();
    if ((r = need_init()))
        LEAVE("cuMemImportFromShareableHandle", r);
    if (!handle)
        LEAVE("cuMemImportFromShareableHandle", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer"));
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        LEAVE("cuMemImportFromShareableHandle", fail(CUDA_ERROR_NOT_SUPPORTED, "handle type %d (POSIX fds only on Linux)", type));
    if (fd < 0 || fstat(fd, &st) < 0 || !our_memfd(fd, &dev, bus, sizeof bus))
        LEAVE("cuMemImportFromShareableHandle",
              fail(CUDA_ERROR_INVALID_VALUE, "fd %d is not a CUDA shareable handle (an fd from cuMemExportToShareableHandle)", fd));
    if (dev < 0)
        LEAVE("cuMemImportFromShareableHandle",
              fail(CUDA_ERROR_INVALID_DEVICE, "the allocation lies on the GPU at %s, which this process does not see", bus));
    if ((own = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0)
        LEAVE("cuMemImportFromShareableHandle", fail(CUDA_ERROR_OUT_OF_MEMORY, "dup: %s", strerror(errno)));
    a = calloc(1, sizeof *a);
    *a = (struct alloc){.handle = ++g.next_handle, .fd = own, .size = (size_t)st.st_size, .dev = dev,
                        .handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, .rdma = 1};
    vpush(&g.allocs, a);
    log_alloc("cuMemImport", dev, a->size);
    *handle = a->handle;
    LEAVE("cuMemImportFromShareableHandle", CUDA_SUCCESS);
}

/* A dma-buf over [offset, offset + size) of the memfd from /dev/udmabuf, or -1. */
static int udmabuf(int memfd, size_t offset, size_t size)
{
    struct {
        uint32_t memfd, flags;
        uint64_t offset, size;
    } arg = {(uint32_t)memfd, 1 /* UDMABUF_FLAGS_CLOEXEC */, offset, size};
    int dev = open("/dev/udmabuf", O_RDWR | O_CLOEXEC), fd;
    if (dev < 0)
        return -1;
    fd = ioctl(dev, 0x40187542 /* UDMABUF_CREATE */, &arg);
    close(dev);
    return fd;
}

CUAPI CUresult cuMemGetHandleForAddressRange(void *out, CUdeviceptr ptr, size_t size, int type,
                                             unsigned long long flags)
{
    struct fc_ctx *c;
    struct range *m;
    int fd;
    CUresult r;
    ENTER();
    if ((r = need_ctx(&c)))
        LEAVE("cuMemGetHandleForAddressRange", r);
    if (!out || type != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)
        LEAVE("cuMemGetHandleForAddressRange", fail(CUDA_ERROR_INVALID_VALUE, "NULL pointer or handle type %d", type));
    if (flags & ~CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE)
        LEAVE("cuMemGetHandleForAddressRange", fail(CUDA_ERROR_INVALID_VALUE, "unknown flags 0x%llx", flags));
    if (g.no_dmabuf)
        LEAVE("cuMemGetHandleForAddressRange", fail(CUDA_ERROR_NOT_SUPPORTED, "dma-buf export refused (FAKE_CUDA_NO_DMABUF=1)"));
    if ((flags & CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE) && g.no_pcie == 1)
        LEAVE("cuMemGetHandleForAddressRange",
              fail(CUDA_ERROR_INVALID_VALUE, "CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE refused (FAKE_CUDA_NO_PCIE_FLAG=1)"));
    if ((flags & CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE) && g.no_pcie == 2)
        LEAVE("cuMemGetHandleForAddressRange",
              fail(CUDA_ERROR_NOT_SUPPORTED, "CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE refused (FAKE_CUDA_NO_PCIE_FLAG=2)"));
    if (size == 0 || ptr % PAGE || size % PAGE)
        LEAVE("cuMemGetHandleForAddressRange",
              fail(CUDA_ERROR_INVALID_VALUE, "[0x%llx, +%zu) is not page aligned", ptr, size));
    m = find_range((uintptr_t)ptr);
    if (m && m->kind != R_MAP)
        LEAVE("cuMemGetHandleForAddressRange",
              fail(CUDA_ERROR_NOT_SUPPORTED, "0x%llx is a %s: the fake exports dma-bufs of VMM mappings only", ptr, range_kind(m)));
    if (!m || size > m->size - (ptr - m->base))
        LEAVE("cuMemGetHandleForAddressRange",
              fail(CUDA_ERROR_INVALID_VALUE, "[0x%llx, +%zu) does not lie inside one mapping", ptr, size));
    if (!m->alloc->rdma)
        LEAVE("cuMemGetHandleForAddressRange",
              fail(CUDA_ERROR_NOT_SUPPORTED, "the allocation was created without allocFlags.gpuDirectRDMACapable"));
    fd = udmabuf(m->alloc->fd, ptr - m->base, size);
    if (fd < 0 && (fd = fcntl(m->alloc->fd, F_DUPFD_CLOEXEC, 0)) < 0)
        LEAVE("cuMemGetHandleForAddressRange", fail(CUDA_ERROR_OUT_OF_MEMORY, "dup: %s", strerror(errno)));
    memcpy(out, &fd, sizeof fd);
    LEAVE("cuMemGetHandleForAddressRange", CUDA_SUCCESS);
}

/* ---- cuGetProcAddress --------------------------------------------------------------------------------------- */

CUAPI CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags, int *status);
CUAPI CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags);

static const struct proc {
    const char *name; /* the base name callers ask for */
    int since;        /* the CUDA version whose ABI this function is (cuda.h's _v2 #defines) */
    void *fn;
} procs[] = {
#define P(name, since, fn) {name, since, (void *)(fn)}
    P("cuInit", 2000, cuInit),
    P("cuDriverGetVersion", 2020, cuDriverGetVersion),
    P("cuGetErrorName", 6000, cuGetErrorName),
    P("cuGetErrorString", 6000, cuGetErrorString),
    P("cuGetProcAddress", 11030, cuGetProcAddress),
    P("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    P("cuDeviceGet", 2000, cuDeviceGet),
    P("cuDeviceGetCount", 2000, cuDeviceGetCount),
    P("cuDeviceGetName", 2000, cuDeviceGetName),
    P("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),
    P("cuDeviceGetByPCIBusId", 4010, cuDeviceGetByPCIBusId),
    P("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
    P("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    P("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    P("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    P("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    P("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    P("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    P("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    P("cuCtxGetDevice", 2000, cuCtxGetDevice),
    P("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
    P("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
    P("cuCtxSynchronize", 2000, cuCtxSynchronize),
    P("cuMemAlloc", 3020, cuMemAlloc_v2),
    P("cuMemFree", 3020, cuMemFree_v2),
    P("cuMemHostAlloc", 2020, cuMemHostAlloc),
    P("cuMemFreeHost", 2000, cuMemFreeHost),
    P("cuMemHostRegister", 6050, cuMemHostRegister_v2),
    P("cuMemHostGetDevicePointer", 3020, cuMemHostGetDevicePointer_v2),
    P("cuMemHostUnregister", 4000, cuMemHostUnregister),
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    P("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
    P("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
    P("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
    P("cuMemsetD8", 3020, cuMemsetD8_v2),
    P("cuStreamCreate", 2000, cuStreamCreate),
    P("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    P("cuStreamSynchronize", 2000, cuStreamSynchronize),
    P("cuEventCreate", 2000, cuEventCreate),
    P("cuEventRecord", 2000, cuEventRecord),
    P("cuEventQuery", 2000, cuEventQuery),
    P("cuEventSynchronize", 2000, cuEventSynchronize),
    P("cuEventDestroy", 4000, cuEventDestroy_v2),
    P("cuEventElapsedTime", 2000, cuEventElapsedTime),
    P("cuModuleLoadData", 2000, cuModuleLoadData),
    P("cuModuleGetFunction", 2000, cuModuleGetFunction),
    P("cuModuleUnload", 2000, cuModuleUnload),
    P("cuLaunchKernel", 4000, cuLaunchKernel),
    P("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    P("cuMemCreate", 10020, cuMemCreate),
    P("cuMemRelease", 10020, cuMemRelease),
    P("cuMemAddressReserve", 10020, cuMemAddressReserve),
    P("cuMemAddressFree", 10020, cuMemAddressFree),
    P("cuMemMap", 10020, cuMemMap),
    P("cuMemUnmap", 10020, cuMemUnmap),
    P("cuMemSetAccess", 10020, cuMemSetAccess),
    P("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle),
    P("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle),
    P("cuMemGetHandleForAddressRange", 11070, cuMemGetHandleForAddressRange),
#undef P
};

CUAPI CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags, int *status)
{
    CUresult r = CUDA_ERROR_NOT_FOUND;
    int st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    const struct proc *best = NULL;
    if (!symbol || !pfn || flags > CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    /* Of the variants of `symbol`, the newest whose ABI the caller's CUDA version knows. */
    for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
        if (strcmp(procs[i].name, symbol))
            continue;
        if (cuda_version < procs[i].since) {
            if (st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
                st = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            continue;
        }
        if (!best || procs[i].since > best->since)
            best = &procs[i];
    }
    if (best) {
        *pfn = best->fn;
        st = CU_GET_PROC_ADDRESS_SUCCESS;
        r = CUDA_SUCCESS;
    }
    if (status)
        *status = st;
    if (g.log >= 2 || (g.log >= 1 && r && getenv("FAKE_CUDA_LOG_PROCS")))
        fprintf(stderr, "fake libcuda[%d]: cuGetProcAddress(%s, %d, %llu) -> %s\n", (int)getpid(), symbol,
                cuda_version, flags, err_name(r));
    return r;
}

CUAPI CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}

/* ---- at exit: what was never given back ------------------------------------------------------------------- */

__attribute__((destructor)) static void fake_fini(void)
{
    unsigned allocs = 0, maps = 0;
    if (g.log < 1 || pthread_mutex_trylock(&g_lock) != 0)
        return; /* another thread is inside a call as the process exits: say nothing */
    for (size_t i = 0; i < g.ranges.n; i++)
        maps += ((struct range *)g.ranges.v[i])->kind == R_MAP;
    for (size_t i = 0; i < g.allocs.n; i++)
        allocs += !((struct alloc *)g.allocs.v[i])->released;
    if (allocs || maps || g.resvs.n)
        fprintf(stderr,
                "fake libcuda[%d]: LEAK at exit: %u unreleased VMM allocation handle(s), %u mapping(s), %zu address "
                "reservation(s)\n",
                (int)getpid(), allocs, maps, g.resvs.n);
    for (int d = 0; d < g.ndev; d++)
        if (g.ctx[d].refs > 0)
            fprintf(stderr, "fake libcuda[%d]: at exit: device %d's primary context is still retained (%d)\n",
                    (int)getpid(), d, g.ctx[d].refs);
    pthread_mutex_unlock(&g_lock);
}
