/*
 * The CUDA backend: device memory from each device's primary context,
 * carved out of large allocations (slabs) and described to clients as the
 * allocation's handle plus an offset. A slab is of one of two kinds:
 * LEGACY, a cuMemAlloc allocation shared through its CUDA IPC handle; or
 * VMM, a cuMemCreate allocation (pinned device memory, the device's
 * recommended granularity, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) whose
 * fd the daemon exports once (cuMemExportToShareableHandle) and keeps with
 * the allocation handle; it never maps it. Freeing a VMM slab closes its
 * fd and cuMemRelease's it; a process that imported and mapped it keeps
 * that memory alive on its own side, outside these books.
 *
 * - Slabs belong to one pool, keyed (device, owner uid, share policy,
 *   handle kind):
 *   memory of different keys never shares an allocation, because a process
 *   that maps one buffer can reach every byte of its allocation. A slab is
 *   never re-keyed, not even when empty.
 * - Inside a slab, buffers are first-fit extents that coalesce when freed;
 *   offsets and extent sizes are multiples of BACKEND_CUDA_ALIGN.
 * - A buffer larger than a slab gets its own (dedicated) allocation, freed
 *   as soon as the buffer is.
 * - Growing (cuMemAlloc + cuIpcGetMemHandle) and freeing (cuMemFree) run
 *   as backend jobs off the loop thread; alloc answers BACKEND_GROW while
 *   the memory it needs is being made, and only then.
 * - Empty slabs stay cached, up to cache_bytes per device, oldest freed
 *   first; cached slabs are also freed to make room under the device limit
 *   or when the driver runs out of memory.
 * - The broker holds at most limit bytes of a device (slabs, cached ones
 *   and allocations in progress included); past it alloc answers
 *   BB_ERR_NO_MEMORY with the numbers. VMM slabs also count against
 *   vmm_allocations (their fds): at it, cached VMM slabs are freed first,
 *   else BB_ERR_NO_MEMORY.
 * - The handle kind: DEFAULT is the configured default; AUTO is VMM where
 *   the driver has the VMM entry points, the device reports VMM and
 *   POSIX-fd export and VMM is not forbidden, else LEGACY unless that is
 *   forbidden; an explicit kind that cannot be had is BB_ERR_UNSUPPORTED
 *   with why (driver too old, device lacks it, the operator forbade it).
 */
#ifndef BB_BACKEND_CUDA_H
#define BB_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

#define BACKEND_CUDA_ALIGN 256                    /* buffer offsets and extents */
#define BACKEND_CUDA_SLAB_DEFAULT (64ULL << 20)   /* --cuda-slab-bytes */
#define BACKEND_CUDA_CACHE_DEFAULT (256ULL << 20) /* --cuda-cache-bytes */
#define BACKEND_CUDA_SLAB_MIN (1ULL << 20)        /* smallest --cuda-slab-bytes */
#define BACKEND_CUDA_VMM_ALLOCATIONS_DEFAULT 1024 /* --max-cuda-vmm-allocations */

typedef struct backend_cuda_config {
	uint64_t slab_bytes;      /* size of a slab; rounded up to a multiple of 2 MiB
				* (VMM slabs: also of the device's granularity) */
	uint64_t cache_bytes;     /* empty slabs kept per device (0: none) */
	uint64_t device_bytes;    /* the most the broker holds per device; 0: 90% of its memory */
	int handle_default;       /* what BB_CUDA_HANDLE_DEFAULT means: LEGACY, AUTO or VMM */
	int handle_forbid;        /* BB_CUDA_HANDLE_LEGACY or _VMM: never given; 0: none */
	uint64_t vmm_allocations; /* the most VMM allocations held at once, all devices
				   * (each is an open fd of the daemon's) */
} backend_cuda_config;

/* The defaults: 64 MiB slabs, 256 MiB cache, 90% of each device, LEGACY
 * by default and nothing forbidden, 1024 VMM allocations. */
void backend_cuda_config_default(backend_cuda_config *cfg);

/* Which handle kinds are given (SIGHUP): handle_default and handle_forbid
 * of cfg; the other fields are ignored. Later allocs follow it; buffers
 * that live keep their kind. */
void backend_cuda_set_handles(backend *be, const backend_cuda_config *cfg);

/* Whether a handle kind policy is consistent: 0, or -1 with why (the
 * default is forbidden, a value out of range). */
int backend_cuda_handles_check(const backend_cuda_config *cfg, char *why, size_t whylen);

/* Load the driver ($BUFBROKER_CUDA_LIBRARY, else libcuda.so.1), retain
 * every visible device's primary context and serve them. NULL with a
 * sentence in why (whylen bytes) when the driver cannot be loaded or there
 * is no device: the daemon then serves host buffers only. destroy frees
 * every slab synchronously, releases the contexts and unloads the driver;
 * call it after every buffer was freed and every job is done. */
backend *backend_cuda_new(const backend_cuda_config *cfg, char *why, size_t whylen);

/* For the start-up log: the driver's version as cuDriverGetVersion reports
 * it (e.g. 12040), the library loaded, and the configuration in effect
 * (slab size rounded). be must be a CUDA backend. */
int backend_cuda_driver_version(const backend *be);
const char *backend_cuda_library(const backend *be);
const backend_cuda_config *backend_cuda_config_of(const backend *be);

#endif /* BB_BACKEND_CUDA_H */
