/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The CUDA side of a handle: bb_map of a CUDA buffer through one
 * process-wide cache of opened allocations, shared by every bb_client, and
 * bb_cuda_ipc_of.
 */
#include "cuda_map.h"
#include "cuda_api.h"
#include "handle.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * One view of the CUDA driver per process, shared by every bb_client: the
 * driver is loaded once, each device's primary context is retained once
 * (and kept for the life of the process), and each allocation the daemon
 * hands out (a slab, or a large buffer's own allocation) is opened with
 * cuIpcOpenMemHandle once; a buffer inside it is base + offset. Real
 * drivers refuse a second open of the same handle in one process, and an
 * open costs about a millisecond, so the cache counts the mapped handles
 * using each allocation and closes it when the last one goes, before that
 * handle's Release can let the daemon free the memory (freeing legacy-IPC
 * memory that another process still has open is undefined).
 *
 * Devices are matched by UUID, never by ordinal: CUDA_VISIBLE_DEVICES may
 * number them differently here than in the daemon.
 */

/* One device as this process sees it. */
struct cuda_dev {
	CUdevice dev;           /* the ordinal this process uses */
	unsigned char uuid[16]; /* cuDeviceGetUuid */
	CUcontext ctx;          /* its primary context once retained, else NULL (cuda.mu) */
};

/* What identifies an allocation: its handle and the daemon's allocation id
 * (which changes when an allocation is replaced, so a mapping of an old
 * one is never trusted for a new one). */
struct cuda_alloc_key {
	unsigned char handle[BB_IPC_HANDLE_SIZE];
	uint64_t allocation;
};

/* One opened allocation. */
struct cuda_alloc {
	struct cuda_alloc_key key; /* the hash key */
	CUdeviceptr base;          /* where cuIpcOpenMemHandle mapped it */
	struct cuda_dev *dev;      /* the device it lives on */
	unsigned long users;       /* mapped handles using it */
	int listed;                /* in cuda.allocs (uthash's out-of-memory flag) */
	UT_hash_handle hh;         /* cuda.allocs, keyed by key */
};

static struct {
	pthread_once_t once;       /* cuda_load runs once */
	int loaded;                /* the driver is usable; fixed after once */
	char why[384];             /* why it is not, for every bb_map */
	bb_cuda api;               /* the driver's entry points */
	struct cuda_dev *devs;     /* every device this process sees */
	int ndevs;                 /* how many */
	pthread_mutex_t mu;        /* guards devs[].ctx and allocs */
	struct cuda_alloc *allocs; /* opened allocations (uthash) */
} cuda = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER};

/* Load the driver and list its devices; on failure cuda.why says why. */
static void cuda_load(void)
{
	char eb[160];
	CUresult cr;
	int n = 0;

	if (bb_cuda_load(&cuda.api, cuda.why, sizeof(cuda.why)) != 0)
		return;
	cr = cuda.api.DeviceGetCount(&n);
	if (cr == CUDA_ERROR_NO_DEVICE) {
		n = 0;
	} else if (cr != CUDA_SUCCESS) {
		snprintf(cuda.why, sizeof(cuda.why), "cuDeviceGetCount failed: %s",
			 bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
		goto err_unload;
	}
	cuda.devs = calloc(n > 0 ? (size_t)n : 1, sizeof(*cuda.devs));
	if (!cuda.devs) {
		snprintf(cuda.why, sizeof(cuda.why), "out of memory listing CUDA devices");
		goto err_unload;
	}
	for (int i = 0; i < n; i++) {
		struct cuda_dev *d = &cuda.devs[i];
		CUuuid u;

		cr = cuda.api.DeviceGet(&d->dev, i);
		if (cr == CUDA_SUCCESS)
			cr = cuda.api.DeviceGetUuid(&u, d->dev);
		if (cr != CUDA_SUCCESS) {
			snprintf(cuda.why, sizeof(cuda.why),
				 "cannot identify CUDA device %d of this process: %s", i,
				 bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
			goto err_free;
		}
		memcpy(d->uuid, u.bytes, sizeof(d->uuid));
	}
	cuda.ndevs = n;
	cuda.loaded = 1;
	return;

err_free:
	free(cuda.devs);
	cuda.devs = NULL;
err_unload:
	bb_cuda_unload(&cuda.api);
}

/* 0 when the driver is loaded; BB_ERR_UNSUPPORTED with the reason else. */
static int cuda_require(void)
{
	pthread_once(&cuda.once, cuda_load);
	if (cuda.loaded)
		return 0;
	return bbc_fail(BB_ERR_UNSUPPORTED, "CUDA is not available in this process: %s", cuda.why);
}

/* Make ctx current on the calling thread; *prev gets the context that was,
 * for cuda_ctx_pop. */
static CUresult cuda_ctx_push(CUcontext ctx, CUcontext *prev)
{
	CUresult cr = cuda.api.CtxGetCurrent(prev);

	if (cr != CUDA_SUCCESS)
		return cr;
	return *prev == ctx ? CUDA_SUCCESS : cuda.api.CtxSetCurrent(ctx);
}

/* Give the calling thread back the context cuda_ctx_push found. */
static void cuda_ctx_pop(CUcontext ctx, CUcontext prev)
{
	if (prev != ctx)
		(void)cuda.api.CtxSetCurrent(prev);
}

/* The opened allocation holding b, with one more user: from the cache, or
 * opened now in the primary context of the device with b's UUID. The
 * driver must be loaded. 0, or BB_ERR_* with the last error set. */
static int cuda_open(const bb_buf *b, struct cuda_alloc **out)
{
	struct cuda_alloc_key key;
	struct cuda_alloc *a = NULL;
	struct cuda_dev *d = NULL;
	CUipcMemHandle h;
	CUcontext prev;
	CUresult cr;
	char ub[48], eb[160];
	int rc = 0;

	memset(&key, 0, sizeof(key));
	memcpy(key.handle, b->ipc_handle, sizeof(key.handle));
	key.allocation = b->allocation;

	/* Opening under the lock is what makes a second open of one handle
	 * impossible; it only delays threads mapping a new allocation. */
	pthread_mutex_lock(&cuda.mu);
	HASH_FIND(hh, cuda.allocs, &key, sizeof(key), a);
	if (a) {
		a->users++;
		goto out;
	}
	for (int i = 0; i < cuda.ndevs; i++) {
		if (memcmp(cuda.devs[i].uuid, b->device_uuid, sizeof(b->device_uuid)) == 0) {
			d = &cuda.devs[i];
			break;
		}
	}
	if (!d) {
		bb_cuda_uuid_format(b->device_uuid, ub);
		rc = bbc_fail(BB_ERR_NOT_FOUND,
			      "no CUDA device in this process has UUID %s (buffer %" PRIu64
			      " lives there); is it hidden by CUDA_VISIBLE_DEVICES?",
			      ub, b->id);
		goto out;
	}
	if (!d->ctx) {
		CUcontext ctx = NULL;

		cr = cuda.api.DevicePrimaryCtxRetain(&ctx, d->dev);
		if (cr != CUDA_SUCCESS) {
			rc = bbc_fail(cr == CUDA_ERROR_OUT_OF_MEMORY ? BB_ERR_NO_MEMORY
								     : BB_ERR_SYSTEM,
				      "retaining the primary context of CUDA device %d failed: %s",
				      (int)d->dev, bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
			goto out;
		}
		d->ctx = ctx;
	}
	a = calloc(1, sizeof(*a));
	if (!a) {
		rc = bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a CUDA mapping");
		goto out;
	}
	cr = cuda_ctx_push(d->ctx, &prev);
	if (cr != CUDA_SUCCESS) {
		rc = bbc_fail(BB_ERR_SYSTEM, "making CUDA device %d current failed: %s",
			      (int)d->dev, bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
		goto err_free;
	}
	memcpy(h.reserved, key.handle, sizeof(h.reserved));
	cr = cuda.api.IpcOpenMemHandle(&a->base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	if (cr != CUDA_SUCCESS) {
		cuda_ctx_pop(d->ctx, prev);
		rc = bbc_fail(cr == CUDA_ERROR_OUT_OF_MEMORY ? BB_ERR_NO_MEMORY : BB_ERR_SYSTEM,
			      "opening the CUDA IPC handle of buffer %" PRIu64
			      " (allocation %" PRIu64 ") on device %d failed: %s",
			      b->id, b->allocation, (int)d->dev,
			      bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
		goto err_free;
	}
	a->key = key;
	a->dev = d;
	a->users = 1;
	a->listed = 1;
	HASH_ADD(hh, cuda.allocs, key, sizeof(a->key), a);
	if (!a->listed) {
		/* Unlisted, the next buffer of this allocation would open it
		 * a second time: give it up instead. */
		(void)cuda.api.IpcCloseMemHandle(a->base);
		cuda_ctx_pop(d->ctx, prev);
		rc = bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a CUDA mapping");
		goto err_free;
	}
	cuda_ctx_pop(d->ctx, prev);
	goto out;

err_free:
	free(a);
	a = NULL;
out:
	pthread_mutex_unlock(&cuda.mu);
	*out = a;
	return rc;
}

/* Drop one user of a; the last one closes the allocation (in its device's
 * context) and forgets it. Closing under the lock keeps a concurrent
 * cuda_open of the same handle from opening it before it is closed. */
void bbc_cuda_unuse(struct cuda_alloc *a)
{
	CUcontext prev;

	pthread_mutex_lock(&cuda.mu);
	if (--a->users == 0) {
		HASH_DEL(cuda.allocs, a);
		if (cuda_ctx_push(a->dev->ctx, &prev) == CUDA_SUCCESS) {
			/* Nothing to tell anyone if it fails: the handle is
			 * gone either way. */
			(void)cuda.api.IpcCloseMemHandle(a->base);
			cuda_ctx_pop(a->dev->ctx, prev);
		}
		free(a);
	}
	pthread_mutex_unlock(&cuda.mu);
}

/* bb_map of a CUDA buffer: the device pointer, opening its allocation on
 * the first map of this handle. */
int bbc_cuda_map(bb_buf *b, void **ptr_out)
{
	struct cuda_alloc *a;
	void *p;
	int rc = 0;

	p = atomic_load_explicit(&b->map, memory_order_acquire);
	if (p) {
		*ptr_out = p;
		return 0;
	}
	if (!b->has_ipc)
		return bbc_fail(BB_ERR_PROTOCOL,
				"bufbrokerd sent no IPC handle for CUDA buffer %" PRIu64, b->id);
	rc = cuda_require();
	if (rc)
		return rc;
	pthread_mutex_lock(&b->map_mu);
	p = atomic_load_explicit(&b->map, memory_order_relaxed);
	if (!p) {
		rc = cuda_open(b, &a);
		if (rc == 0) {
			b->cmap = a;
			p = (void *)(uintptr_t)(a->base + b->ipc_offset);
			atomic_store_explicit(&b->map, p, memory_order_release);
		}
	}
	pthread_mutex_unlock(&b->map_mu);
	*ptr_out = p;
	return rc;
}

BB_EXPORT int bb_cuda_ipc_of(bb_buf *b, bb_cuda_ipc *out)
{
	if (!b || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_cuda_ipc_of: buffer and out are required");
	if (b->kind != BB_CUDA)
		return bbc_fail(BB_ERR_INVALID, "buffer %" PRIu64 " is not a CUDA buffer", b->id);
	if (!b->has_ipc)
		return bbc_fail(BB_ERR_PROTOCOL,
				"bufbrokerd sent no IPC handle for CUDA buffer %" PRIu64, b->id);
	memset(out, 0, sizeof(*out));
	memcpy(out->handle, b->ipc_handle, BB_IPC_HANDLE_SIZE);
	out->offset = b->ipc_offset;
	out->size = b->size;
	memcpy(out->device_uuid, b->device_uuid, sizeof(out->device_uuid));
	return 0;
}
