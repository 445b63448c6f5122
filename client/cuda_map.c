/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The CUDA side of a handle: bb_map of a CUDA buffer through one
 * process-wide cache of opened (legacy) or imported (VMM) allocations,
 * shared by every bb_client, and bb_cuda_ipc_of.
 */
#include "cuda_map.h"
#include "cuda_api.h"
#include "handle.h"
#include "vmm_fd.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
 * A VMM allocation (cuMemCreate in the daemon, exported as a file
 * descriptor) is imported from its fd, given an address range of its own
 * and mapped whole, with read-write access for its device, once per
 * process: later buffers of it are base + offset without a driver call.
 * The cache counts the mapped handles using it and unmaps it when the last
 * one goes; the import's handle is released as soon as the mapping holds
 * the memory. The key is the daemon instance (bb_client.daemon) and the
 * allocation id, which one daemon run never reuses; never a pointer. A
 * session resumed across a restart keeps its daemon number, and a daemon
 * that keeps its state never gives an id again across restarts either
 * (docs/RESTART.md, "VMM CUDA buffers at a restart"): a mapping made
 * before the restart stays valid and serves later buffers of the same
 * allocation.
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

/* What identifies an imported VMM allocation. */
struct vmm_key {
	uint64_t daemon;     /* the daemon instance (bb_client.daemon) */
	uint64_t allocation; /* the daemon's allocation id (Grant.allocation) */
};

/* One imported and mapped VMM allocation. */
struct vmm_slab {
	struct vmm_key key;   /* the hash key */
	CUdeviceptr base;     /* its address range, mapped whole */
	size_t size;          /* the allocation's bytes */
	struct cuda_dev *dev; /* the device it lives on and is accessible from */
	unsigned long users;  /* mapped handles using it */
	int listed;           /* in cuda.slabs (uthash's out-of-memory flag) */
	UT_hash_handle hh;    /* cuda.slabs, keyed by key */
};

static struct {
	pthread_once_t once;       /* cuda_load runs once */
	int loaded;                /* the driver is usable; fixed after once */
	char why[384];             /* why it is not, for every bb_map */
	int vmm;                   /* the driver has the VMM entry points; fixed after once */
	char vmm_why[384];         /* why it has not */
	bb_cuda api;               /* the driver's entry points */
	struct cuda_dev *devs;     /* every device this process sees */
	int ndevs;                 /* how many */
	pthread_mutex_t mu;        /* guards devs[].ctx, allocs and slabs */
	struct cuda_alloc *allocs; /* opened allocations (uthash) */
	struct vmm_slab *slabs;    /* imported VMM allocations (uthash) */
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
	cuda.vmm = bb_cuda_has_vmm(&cuda.api, cuda.vmm_why, sizeof(cuda.vmm_why));
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

/* BB_ERR_NO_MEMORY for the driver's out of memory, else BB_ERR_SYSTEM. */
static int cuda_code(CUresult cr)
{
	return cr == CUDA_ERROR_OUT_OF_MEMORY ? BB_ERR_NO_MEMORY : BB_ERR_SYSTEM;
}

/* The device with b's UUID, its primary context retained: 0, or BB_ERR_*
 * with the last error set. cuda.mu held. */
static int cuda_dev_of(const bb_buf *b, struct cuda_dev **out)
{
	struct cuda_dev *d = NULL;
	char ub[48], eb[160];
	CUresult cr;

	for (int i = 0; i < cuda.ndevs; i++) {
		if (memcmp(cuda.devs[i].uuid, b->device_uuid, sizeof(b->device_uuid)) == 0) {
			d = &cuda.devs[i];
			break;
		}
	}
	if (!d) {
		bb_cuda_uuid_format(b->device_uuid, ub);
		return bbc_fail(BB_ERR_NOT_FOUND,
				"no CUDA device in this process has UUID %s (buffer %" PRIu64
				" lives there); is it hidden by CUDA_VISIBLE_DEVICES?",
				ub, b->id);
	}
	if (!d->ctx) {
		CUcontext ctx = NULL;

		cr = cuda.api.DevicePrimaryCtxRetain(&ctx, d->dev);
		if (cr != CUDA_SUCCESS)
			return bbc_fail(
				cr == CUDA_ERROR_OUT_OF_MEMORY ? BB_ERR_NO_MEMORY : BB_ERR_SYSTEM,
				"retaining the primary context of CUDA device %d failed: %s",
				(int)d->dev, bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
		d->ctx = ctx;
	}
	*out = d;
	return 0;
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
	char eb[160];
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
	rc = cuda_dev_of(b, &d);
	if (rc)
		goto out;
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
		rc = bbc_fail(cuda_code(cr),
			      "opening the CUDA IPC handle of buffer %" PRIu64
			      " (allocation %" PRIu64 ") on device %d failed: %s%s",
			      b->id, b->allocation, (int)d->dev,
			      bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)),
			      cr == CUDA_ERROR_OUT_OF_MEMORY
				      ? ""
				      : " (a legacy CUDA IPC handle opens only in a process that "
					"shares the PID and IPC namespaces of bufbrokerd; across "
					"containers, use VMM buffers: bb_alloc_cuda with "
					"BB_CUDA_HANDLE_VMM)");
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

/* Import the allocation behind fd (s->size bytes) on device d, reserve
 * an address range for it, map it there whole and give d read-write
 * access: 0 with s->base set, or BB_ERR_* (nothing left behind). d's
 * context is current. */
static int vmm_import(const bb_buf *b, int fd, struct cuda_dev *d, struct vmm_slab *s)
{
	CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = (int)d->dev},
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	CUmemGenericAllocationHandle h;
	const char *step;
	char eb[160];
	CUresult cr;
	int stage = 0;

	step = "importing its file descriptor (cuMemImportFromShareableHandle)";
	cr = cuda.api.MemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
						   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (cr != CUDA_SUCCESS)
		goto err;
	stage = 1;
	step = "reserving an address range for it (cuMemAddressReserve)";
	cr = cuda.api.MemAddressReserve(&s->base, s->size, 0, 0, 0);
	if (cr != CUDA_SUCCESS)
		goto err;
	stage = 2;
	step = "mapping it (cuMemMap)";
	cr = cuda.api.MemMap(s->base, s->size, 0, h, 0);
	if (cr != CUDA_SUCCESS)
		goto err;
	stage = 3;
	step = "giving its device access (cuMemSetAccess)";
	cr = cuda.api.MemSetAccess(s->base, s->size, &acc, 1);
	if (cr != CUDA_SUCCESS)
		goto err;
	/* The mapping holds the memory now; the handle is not needed. */
	(void)cuda.api.MemRelease(h);
	return 0;

err:
	if (stage >= 3)
		(void)cuda.api.MemUnmap(s->base, s->size);
	if (stage >= 2)
		(void)cuda.api.MemAddressFree(s->base, s->size);
	if (stage >= 1)
		(void)cuda.api.MemRelease(h);
	return bbc_fail(cuda_code(cr),
			"mapping VMM CUDA buffer %" PRIu64 " (allocation %" PRIu64
			" of %zu bytes) on device %d failed %s: %s",
			b->id, b->allocation, s->size, (int)d->dev, step,
			bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
}

/* Unmap s and free its address range, in its device's context. */
static void vmm_unmap(struct vmm_slab *s)
{
	CUcontext prev;

	if (cuda_ctx_push(s->dev->ctx, &prev) != CUDA_SUCCESS)
		return;
	/* Nothing to tell anyone if these fail: the mapping is gone either
	 * way. */
	(void)cuda.api.MemUnmap(s->base, s->size);
	(void)cuda.api.MemAddressFree(s->base, s->size);
	cuda_ctx_pop(s->dev->ctx, prev);
}

/* The mapped VMM allocation holding b, with one more user: from the
 * cache, or imported and mapped now in the primary context of the device
 * with b's UUID, from the connection's fd for it (or one asked for). The
 * driver must be loaded with VMM. 0, or BB_ERR_* with the last error set. */
static int vmm_open(bb_buf *b, struct vmm_slab **out)
{
	struct vmm_key key = {.daemon = b->client->daemon, .allocation = b->allocation};
	struct vmm_slab *s = NULL;
	struct cuda_dev *d;
	CUcontext prev;
	CUresult cr;
	char eb[160];
	int fd = -1, owned = 0, rc;

	pthread_mutex_lock(&cuda.mu);
	HASH_FIND(hh, cuda.slabs, &key, sizeof(key), s);
	if (s)
		s->users++;
	pthread_mutex_unlock(&cuda.mu);
	if (s) {
		*out = s;
		return 0;
	}

	/* Not mapped here yet: the fd first, which may take a round trip,
	 * so not under the lock. */
	rc = bbc_vmm_fd_get(b, &fd, &owned);
	if (rc)
		return rc;
	pthread_mutex_lock(&cuda.mu);
	HASH_FIND(hh, cuda.slabs, &key, sizeof(key), s);
	if (s) {
		s->users++; /* another thread mapped it meanwhile */
		goto out;
	}
	rc = cuda_dev_of(b, &d);
	if (rc)
		goto out;
	s = calloc(1, sizeof(*s));
	if (!s) {
		rc = bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a CUDA mapping");
		goto out;
	}
	s->key = key;
	s->size = (size_t)b->allocation_size;
	s->dev = d;
	cr = cuda_ctx_push(d->ctx, &prev);
	if (cr != CUDA_SUCCESS) {
		rc = bbc_fail(BB_ERR_SYSTEM, "making CUDA device %d current failed: %s",
			      (int)d->dev, bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
		goto err_free;
	}
	rc = vmm_import(b, fd, d, s);
	cuda_ctx_pop(d->ctx, prev);
	if (rc)
		goto err_free;
	s->users = 1;
	s->listed = 1;
	HASH_ADD(hh, cuda.slabs, key, sizeof(s->key), s);
	if (!s->listed) {
		/* Unlisted, the next buffer of it would map it again. */
		vmm_unmap(s);
		rc = bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a CUDA mapping");
		goto err_free;
	}
	goto out;

err_free:
	free(s);
	s = NULL;
out:
	pthread_mutex_unlock(&cuda.mu);
	if (owned)
		close(fd);
	*out = s;
	return rc;
}

/* Drop one user of s; the last one unmaps it and forgets it. Unmapping
 * under the lock keeps a concurrent vmm_open of the same allocation from
 * finding it half gone. */
void bbc_cuda_vmm_unuse(struct vmm_slab *s)
{
	pthread_mutex_lock(&cuda.mu);
	if (--s->users == 0) {
		HASH_DEL(cuda.slabs, s);
		vmm_unmap(s);
		free(s);
	}
	pthread_mutex_unlock(&cuda.mu);
}

/* bb_map of a CUDA buffer: the device pointer, opening (legacy) or
 * importing and mapping (VMM) its allocation on the first map of this
 * handle. */
int bbc_cuda_map(bb_buf *b, void **ptr_out)
{
	int vmm = b->handle == BB_CUDA_HANDLE_VMM;
	struct cuda_alloc *a;
	struct vmm_slab *s;
	CUdeviceptr base = 0;
	void *p;
	int rc = 0;

	p = atomic_load_explicit(&b->map, memory_order_acquire);
	if (p) {
		*ptr_out = p;
		return 0;
	}
	if (vmm ? !b->has_vmm : !b->has_ipc)
		return bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent no %s for CUDA buffer %" PRIu64,
				vmm ? "allocation" : "IPC handle", b->id);
	rc = cuda_require();
	if (rc)
		return rc;
	if (vmm && !cuda.vmm)
		return bbc_fail(BB_ERR_UNSUPPORTED,
				"buffer %" PRIu64 " is a VMM CUDA buffer, which cannot be mapped "
				"here: %s",
				b->id, cuda.vmm_why);
	pthread_mutex_lock(&b->map_mu);
	p = atomic_load_explicit(&b->map, memory_order_relaxed);
	if (!p) {
		if (vmm) {
			rc = vmm_open(b, &s);
			if (rc == 0) {
				b->vmap = s;
				base = s->base;
			}
		} else {
			rc = cuda_open(b, &a);
			if (rc == 0) {
				b->cmap = a;
				base = a->base;
			}
		}
		if (rc == 0) {
			p = (void *)(uintptr_t)(base + b->ipc_offset);
			atomic_store_explicit(&b->map, p, memory_order_release);
		}
	}
	pthread_mutex_unlock(&b->map_mu);
	*ptr_out = p;
	return rc;
}

int bbc_cuda_handle_check(const bb_buf *b, bb_cuda_handle want)
{
	if (b->kind != BB_CUDA)
		return bbc_fail(BB_ERR_INVALID, "buffer %" PRIu64 " is not a CUDA buffer", b->id);
	if (b->handle != want)
		return bbc_fail(
			BB_ERR_UNSUPPORTED,
			"buffer %" PRIu64 " is a %s CUDA buffer: it has %s (%s), not %s", b->id,
			b->handle == BB_CUDA_HANDLE_VMM ? "VMM" : "legacy",
			b->handle == BB_CUDA_HANDLE_VMM ? "a file descriptor" : "an IPC handle",
			b->handle == BB_CUDA_HANDLE_VMM ? "bb_cuda_vmm_of" : "bb_cuda_ipc_of",
			want == BB_CUDA_HANDLE_VMM ? "a file descriptor" : "an IPC handle");
	if (want == BB_CUDA_HANDLE_VMM ? !b->has_vmm : !b->has_ipc)
		return bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent no %s for CUDA buffer %" PRIu64,
				want == BB_CUDA_HANDLE_VMM ? "allocation" : "IPC handle", b->id);
	return 0;
}

BB_EXPORT int bb_cuda_ipc_of(bb_buf *b, bb_cuda_ipc *out)
{
	int rc;

	if (!b || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_cuda_ipc_of: buffer and out are required");
	rc = bbc_cuda_handle_check(b, BB_CUDA_HANDLE_LEGACY);
	if (rc)
		return rc;
	memset(out, 0, sizeof(*out));
	memcpy(out->handle, b->ipc_handle, BB_IPC_HANDLE_SIZE);
	out->offset = b->ipc_offset;
	out->size = b->size;
	memcpy(out->device_uuid, b->device_uuid, sizeof(out->device_uuid));
	return 0;
}
