/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The CUDA backend: a slab pool per (device, uid, share) over the driver's
 * primary contexts, with growing and freeing done as backend jobs. See
 * backend_cuda.h for the rules; this file keeps the books.
 *
 * Accounting per device, all on the loop thread:
 *   reserved  bytes the broker has from the driver, counting allocations
 *             in progress (grow jobs) and ones being freed (free jobs);
 *   freeing   the part of reserved whose free job is in flight;
 *   cached    bytes of empty slabs kept for reuse;
 *   used      bytes of live buffers, as asked for.
 * The limit applies to reserved - freeing plus what a new grow asks for.
 *
 * A slab made by a grow job is "fresh" until the settle job that the grow's
 * done submits has run: by then the server has retried every parked alloc,
 * so a fresh slab is not evicted before the request it was made for had
 * its turn, and a dedicated allocation whose requester went away (its
 * connection closed) is freed there.
 *
 * Inside a slab every range is an extent, live (a buffer) or free, and all
 * of them are on the slab's address list, by offset, tiling the slab with
 * no gap, no overlap and no two free extents side by side. The free ones
 * are also on the slab's free list, which carve searches first fit; it is
 * not by offset (a new free range goes last). The address list is what
 * keeps freeing O(1): a freed extent merges with whichever of its two
 * neighbours is free without a search (a client with a million small
 * buffers that disconnects frees them all in hash order). An empty slab
 * has exactly one free extent.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <uthash.h>
#include <utlist.h>

#include "size.h"
#include "backend_cuda.h"
#include "bufbroker/bufbroker.h"
#include "cuda_api.h"
#include "log.h"

#define SLAB_GRANULE (2ULL << 20) /* the driver hands out memory in 2 MiB pages */

typedef struct cuda_backend cuda_backend;
typedef struct cuda_dev cuda_dev;
typedef struct pool pool;
typedef struct slab slab;
typedef struct grow_job grow_job;

/* A range of a slab: a live buffer (backend_mem.priv) or a free range.
 * Every extent is on the slab's address list; a free one is on its free
 * list too, and prev is non-NULL exactly then (utlist never leaves prev
 * NULL for a member, a live extent starts with it NULL, and an extent
 * leaves the free list only to be freed). A freed buffer's extent merges
 * into a free neighbour or joins the free list, so freeing never
 * allocates. A daemon holds one per CUDA buffer: up to 56 bytes, calloc
 * takes a 64-byte chunk. */
typedef struct extent {
	slab *slab;                   /* where it lies */
	uint64_t off;                 /* multiple of BACKEND_CUDA_ALIGN */
	uint64_t len;                 /* multiple of BACKEND_CUDA_ALIGN */
	struct extent *aprev, *anext; /* the slab's extents, live and free, by offset */
	struct extent *prev, *next;   /* the slab's free list; prev NULL: live */
} extent;
_Static_assert(sizeof(extent) <= 56, "an extent must fit a 64-byte malloc chunk");

/* Whether e is a free range (on its slab's free list). */
static bool extent_is_free(const extent *e)
{
	return e->prev != NULL;
}

/* One allocation: cuMemAlloc (LEGACY) or cuMemCreate (VMM). */
struct slab {
	pool *pool;                      /* owner (never changes) */
	CUdeviceptr base;                /* LEGACY: the allocation */
	uint64_t size;                   /* its bytes */
	CUipcMemHandle handle;           /* LEGACY: cuIpcGetMemHandle, once */
	CUmemGenericAllocationHandle mh; /* VMM: cuMemCreate's handle */
	int fd;                          /* VMM: its POSIX fd, exported once; -1 for LEGACY */
	uint64_t allocation;             /* identity, never reused in this daemon run */
	bool dedicated;                  /* made for one buffer larger than a slab */
	bool fresh;                      /* made since the last settle (see the top) */
	bool cached;                     /* empty, on the device's cache list */
	uint32_t live;                   /* buffers in it */
	extent *extents;                 /* every extent, by offset: tiles [0, size) */
	extent *free;                    /* the free extents; a new one goes last (first fit) */
	slab *prev, *next;               /* the pool's slabs, oldest first */
	slab *cprev, *cnext;             /* the device's cache list, oldest first */
	UT_hash_handle hh;               /* VMM: cuda_backend.by_allocation */
};

typedef struct pool_key {
	int device;   /* ordinal */
	uint32_t uid; /* owner */
	int share;    /* BB_SHARE_* */
	int handle;   /* BB_CUDA_HANDLE_LEGACY or _VMM */
} pool_key;

/* The slabs of one key. Pools live until destroy (there are few keys). */
struct pool {
	pool_key key;        /* hash key */
	cuda_dev *dev;       /* key.device */
	slab *slabs;         /* oldest first */
	grow_job *growing;   /* grow jobs in flight */
	int fail_code;       /* a grow failed: answer the next alloc with this */
	bool fail_dedicated; /* ... if it asks for the same kind of allocation */
	uint64_t fail_size;  /* ... of this size (dedicated) */
	char fail_msg[256];  /* the driver's error */
	UT_hash_handle hh;   /* cuda_backend.pools */
};

/* One device the daemon serves. */
struct cuda_dev {
	int ordinal;              /* as this daemon numbers it */
	CUdevice dev;             /* cuDeviceGet */
	CUcontext ctx;            /* retained primary context */
	char name[96];            /* cuDeviceGetName */
	unsigned char uuid[16];   /* cuDeviceGetUuid */
	uint64_t total;           /* cuDeviceTotalMem */
	uint64_t limit;           /* the most the broker holds */
	uint64_t reserved;        /* see the top of the file */
	uint64_t freeing;         /* ... */
	uint64_t cached;          /* ... */
	uint64_t used;            /* ... */
	uint64_t refused;         /* allocs refused at the limit, for metrics */
	slab *cache;              /* empty slabs, oldest first */
	bool vmm;                 /* VMM slabs can be made here */
	char vmm_why[256];        /* when not: why (the driver or the device) */
	uint64_t vmm_unit;        /* VMM slab sizes are multiples of this (>= 2 MiB) */
	uint64_t vmm_allocations; /* VMM slabs held (live, cached, being made or freed) */
};

struct cuda_backend {
	backend be;               /* be.ctx points here */
	bb_cuda api;              /* the loaded driver */
	backend_cuda_config cfg;  /* slab_bytes rounded */
	int driver_version;       /* cuDriverGetVersion */
	int ndev;                 /* devices */
	cuda_dev *devs;           /* by ordinal */
	pool *pools;              /* by key */
	uint64_t next_allocation; /* allocation identities */
	uint32_t jobs;            /* jobs in flight */
	slab *by_allocation;      /* VMM slabs by identity (AllocationFd) */
	uint64_t vmm_allocations; /* VMM slabs held, all devices: each is an fd */
	uint64_t vmm_freeing;     /* ... of them being freed (free jobs in flight) */
};

/* Allocate a new slab (work) and add it to its pool (done). */
struct grow_job {
	backend_job job;   /* first: the server sees this */
	cuda_backend *cu;  /* owner */
	pool *pool;        /* stays: pools live until destroy */
	CUcontext ctx;     /* the device's primary context */
	uint64_t size;     /* asked of the driver (counted in reserved) */
	uint64_t min_size; /* smallest that serves the request: tried on OOM */
	bool dedicated;    /* for one buffer */
	bool vmm;          /* cuMemCreate + export rather than cuMemAlloc */
	CUdevice dev;      /* VMM: where cuMemCreate puts it */
	/* Written by work: */
	CUresult rc;                     /* CUDA_SUCCESS or the failing call's result */
	const char *call;                /* the failing call */
	uint64_t got;                    /* bytes allocated */
	CUdeviceptr base;                /* the allocation */
	CUipcMemHandle handle;           /* LEGACY: its IPC handle */
	CUmemGenericAllocationHandle mh; /* VMM: the allocation */
	int fd;                          /* VMM: its exported fd */
	grow_job *prev, *next;           /* pool.growing */
};

/* cuMemFree an allocation (work) and drop it from the books (done). */
typedef struct free_job {
	backend_job job;                 /* first: the server sees this */
	cuda_backend *cu;                /* owner */
	cuda_dev *dev;                   /* where the allocation lies */
	CUcontext ctx;                   /* its primary context */
	CUdeviceptr base;                /* the allocation */
	uint64_t size;                   /* its bytes (in reserved and freeing until done) */
	uint64_t allocation;             /* its identity, for the log */
	bool vmm;                        /* close fd and cuMemRelease mh rather than cuMemFree */
	CUmemGenericAllocationHandle mh; /* VMM */
	int fd;                          /* VMM */
	CUresult rc;                     /* written by work */
} free_job;

/* Runs after the retries that followed a grow (see the top). */
typedef struct settle_job {
	backend_job job;  /* first: the server sees this */
	cuda_backend *cu; /* owner */
} settle_job;

/* "9.0 GiB": sizes in messages. */
static const char *human(uint64_t n, char out[BB_SIZE_TEXT])
{
	return bb_size_format(n, out, BB_SIZE_TEXT);
}

static uint64_t align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) / a * a;
}

static void submit(cuda_backend *cu, backend_job *job)
{
	cu->jobs++;
	backend_submit(&cu->be, job);
}

/* ---- the device cache ------------------------------------------------------ */

static void cache_add(cuda_dev *d, slab *s)
{
	if (s->cached)
		return;
	s->cached = true;
	d->cached += s->size;
	DL_APPEND2(d->cache, s, cprev, cnext);
}

static void cache_remove(cuda_dev *d, slab *s)
{
	if (!s->cached)
		return;
	s->cached = false;
	d->cached -= s->size;
	DL_DELETE2(d->cache, s, cprev, cnext);
}

/* Cached bytes that may be freed now (fresh slabs wait for their settle). */
static uint64_t evictable(const cuda_dev *d)
{
	uint64_t n = 0;
	for (const slab *s = d->cache; s; s = s->cnext)
		if (!s->fresh)
			n += s->size;
	return n;
}

/* ---- freeing allocations --------------------------------------------------- */

/* One VMM allocation more (delta 1) or fewer (-1) held on d: an fd of the
 * daemon's from the grow that makes it until the free that closes it. */
static void vmm_count(cuda_backend *cu, cuda_dev *d, int delta)
{
	cu->vmm_allocations += (uint64_t)(int64_t)delta;
	d->vmm_allocations += (uint64_t)(int64_t)delta;
}

/* Give a slab's memory back to the driver now (on the loop thread). */
static void slab_free_now(cuda_backend *cu, cuda_dev *d, slab *s)
{
	cu->api.CtxSetCurrent(d->ctx);
	if (s->fd >= 0) {
		close(s->fd);
		cu->api.MemRelease(s->mh);
	} else {
		cu->api.MemFree(s->base);
	}
}

static void free_work(backend_job *job)
{
	free_job *f = (free_job *)job;
	const bb_cuda *api = &f->cu->api;
	f->rc = api->CtxSetCurrent(f->ctx);
	if (f->vmm) {
		/* The fd first: no new importer can come after the release. */
		close(f->fd);
		f->rc = api->MemRelease(f->mh);
	} else if (f->rc == CUDA_SUCCESS) {
		f->rc = api->MemFree(f->base);
	}
}

static void free_done(backend_job *job)
{
	free_job *f = (free_job *)job;
	cuda_backend *cu = f->cu;
	char eb[160], h[32];
	if (f->rc != CUDA_SUCCESS)
		log_warn("event=cuda_free_failed device=%d allocation=%" PRIu64 " size=%" PRIu64
			 " error=\"%s\"",
			 f->dev->ordinal, f->allocation, f->size,
			 bb_cuda_error(&cu->api, f->rc, eb, sizeof(eb)));
	else
		log_debug("event=cuda_freed device=%d allocation=%" PRIu64 " size=%s",
			  f->dev->ordinal, f->allocation, human(f->size, h));
	/* A failed cuMemFree leaves nothing the daemon can do; the books
	 * drop it either way so the limit does not shrink for ever. */
	f->dev->reserved -= f->size;
	f->dev->freeing -= f->size;
	if (f->vmm) {
		vmm_count(cu, f->dev, -1);
		cu->vmm_freeing--;
	}
	cu->jobs--;
	free(f);
}

/* Free the free extents of s, which is going away. A live extent belongs
 * to its buffer (backend_mem.priv) and stays. */
static void slab_free_extents(slab *s)
{
	extent *e, *tmp;
	DL_FOREACH_SAFE (s->free, e, tmp) {
		DL_DELETE(s->free, e);
		free(e);
	}
	s->extents = NULL;
}

/* Take s out of its pool and free its allocation off the loop thread.
 * reserved drops when that is done. s must hold no buffer. */
static void slab_release(cuda_backend *cu, slab *s)
{
	cuda_dev *d = s->pool->dev;
	cache_remove(d, s);
	DL_DELETE(s->pool->slabs, s);
	if (s->fd >= 0)
		HASH_DELETE(hh, cu->by_allocation, s);
	slab_free_extents(s);
	d->freeing += s->size;
	free_job *f = calloc(1, sizeof(*f));
	if (f) {
		f->job.work = free_work;
		f->job.done = free_done;
		f->cu = cu;
		f->dev = d;
		f->ctx = d->ctx;
		f->base = s->base;
		f->size = s->size;
		f->allocation = s->allocation;
		f->vmm = s->fd >= 0;
		f->mh = s->mh;
		f->fd = s->fd;
		if (f->vmm)
			cu->vmm_freeing++;
		submit(cu, &f->job);
	} else {
		/* No memory for a job: free it here, on the loop thread. */
		slab_free_now(cu, d, s);
		d->reserved -= s->size;
		d->freeing -= s->size;
		if (s->fd >= 0)
			vmm_count(cu, d, -1);
	}
	free(s);
}

/* Free cached slabs of d, oldest first, while more than keep bytes are
 * cached. Fresh slabs stay. */
static void cache_trim(cuda_backend *cu, cuda_dev *d, uint64_t keep)
{
	slab *s = d->cache, *next;
	while (s && d->cached > keep) {
		next = s->cnext;
		if (!s->fresh)
			slab_release(cu, s);
		s = next;
	}
}

/* ---- growing --------------------------------------------------------------- */

static void settle_work(backend_job *job)
{
	(void)job;
}

static void settle_done(backend_job *job)
{
	settle_job *st = (settle_job *)job;
	cuda_backend *cu = st->cu;
	pool *p, *ptmp;
	HASH_ITER (hh, cu->pools, p, ptmp) {
		/* A failure nobody came back for is stale by now. */
		p->fail_code = 0;
		slab *s, *stmp;
		DL_FOREACH_SAFE (p->slabs, s, stmp) {
			if (!s->fresh)
				continue;
			s->fresh = false;
			/* Made for a request that went away. */
			if (s->dedicated && s->live == 0)
				slab_release(cu, s);
		}
	}
	for (int i = 0; i < cu->ndev; i++)
		cache_trim(cu, &cu->devs[i], cu->cfg.cache_bytes);
	cu->jobs--;
	free(st);
}

/* The properties of a VMM allocation on dev: pinned device memory that
 * can be exported as a POSIX fd. */
static void vmm_prop(CUmemAllocationProp *prop, CUdevice dev)
{
	memset(prop, 0, sizeof(*prop));
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop->location.id = dev;
}

/* grow_work for a VMM slab: cuMemCreate, then its fd. */
static void grow_work_vmm(grow_job *g)
{
	const bb_cuda *api = &g->cu->api;
	CUmemAllocationProp prop;
	vmm_prop(&prop, g->dev);
	g->call = "cuMemCreate";
	g->got = g->size;
	g->rc = api->MemCreate(&g->mh, (size_t)g->got, &prop, 0);
	if (g->rc == CUDA_ERROR_OUT_OF_MEMORY && g->min_size < g->size) {
		g->got = g->min_size;
		g->rc = api->MemCreate(&g->mh, (size_t)g->got, &prop, 0);
	}
	if (g->rc != CUDA_SUCCESS)
		return;
	g->call = "cuMemExportToShareableHandle";
	g->fd = -1;
	g->rc = api->MemExportToShareableHandle(&g->fd, g->mh,
						CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (g->rc == CUDA_SUCCESS && g->fd < 0)
		g->rc = CUDA_ERROR_INVALID_HANDLE;
	if (g->rc != CUDA_SUCCESS)
		api->MemRelease(g->mh);
}

static void grow_work(backend_job *job)
{
	grow_job *g = (grow_job *)job;
	const bb_cuda *api = &g->cu->api;
	g->call = "cuCtxSetCurrent";
	g->rc = api->CtxSetCurrent(g->ctx);
	if (g->rc != CUDA_SUCCESS)
		return;
	if (g->vmm) {
		grow_work_vmm(g);
		return;
	}
	g->call = "cuMemAlloc";
	g->got = g->size;
	g->rc = api->MemAlloc(&g->base, (size_t)g->got);
	if (g->rc == CUDA_ERROR_OUT_OF_MEMORY && g->min_size < g->size) {
		/* Others hold the device: a smaller slab still serves the
		 * request that asked. */
		g->got = g->min_size;
		g->rc = api->MemAlloc(&g->base, (size_t)g->got);
	}
	if (g->rc != CUDA_SUCCESS)
		return;
	g->call = "cuIpcGetMemHandle";
	g->rc = api->IpcGetMemHandle(&g->handle, g->base);
	if (g->rc != CUDA_SUCCESS)
		api->MemFree(g->base);
}

static void grow_done(backend_job *job)
{
	grow_job *g = (grow_job *)job;
	cuda_backend *cu = g->cu;
	pool *p = g->pool;
	cuda_dev *d = p->dev;
	char eb[96], h[32];

	DL_DELETE(p->growing, g);
	d->reserved -= g->size;
	if (g->vmm)
		vmm_count(cu, d, -1); /* counted again below if it lives */
	slab *s = NULL;
	extent *e = NULL;
	if (g->rc == CUDA_SUCCESS) {
		s = calloc(1, sizeof(*s));
		e = calloc(1, sizeof(*e));
		if (!s || !e) {
			free(s);
			free(e);
			s = NULL;
			cu->api.CtxSetCurrent(d->ctx);
			if (g->vmm) {
				close(g->fd);
				cu->api.MemRelease(g->mh);
			} else {
				cu->api.MemFree(g->base);
			}
			p->fail_code = BB_ERR_NO_MEMORY;
			p->fail_dedicated = g->dedicated;
			p->fail_size = g->size;
			snprintf(p->fail_msg, sizeof(p->fail_msg), "daemon out of memory");
		}
	}
	if (s) {
		s->pool = p;
		s->base = g->base;
		s->size = g->got;
		s->handle = g->handle;
		s->fd = g->vmm ? g->fd : -1;
		s->mh = g->mh;
		s->allocation = ++cu->next_allocation;
		if (g->vmm) {
			vmm_count(cu, d, 1);
			HASH_ADD(hh, cu->by_allocation, allocation, sizeof(s->allocation), s);
		}
		s->dedicated = g->dedicated;
		s->fresh = true;
		e->slab = s;
		e->off = 0;
		e->len = s->size;
		DL_APPEND2(s->extents, e, aprev, anext);
		DL_APPEND(s->free, e);
		d->reserved += s->size;
		DL_APPEND(p->slabs, s);
		if (!s->dedicated)
			cache_add(d, s);
		log_debug("event=cuda_grow device=%d uid=%u share=%d handle=%s allocation=%" PRIu64
			  " size=%s dedicated=%d",
			  d->ordinal, p->key.uid, p->key.share, g->vmm ? "vmm" : "legacy",
			  s->allocation, human(s->size, h), (int)s->dedicated);
	} else if (g->rc != CUDA_SUCCESS) {
		bb_cuda_error(&cu->api, g->rc, eb, sizeof(eb));
		if (g->rc == CUDA_ERROR_OUT_OF_MEMORY && evictable(d) > 0) {
			/* The device is full, partly with our own empty slabs:
			 * free them; the requests retry once that is done. */
			log_info("event=cuda_grow_evicts device=%d cached=%" PRIu64 " error=\"%s\"",
				 d->ordinal, evictable(d), eb);
			cache_trim(cu, d, 0);
		} else {
			p->fail_code = g->rc == CUDA_ERROR_OUT_OF_MEMORY ? BB_ERR_NO_MEMORY
									 : BB_ERR_SYSTEM;
			p->fail_dedicated = g->dedicated;
			p->fail_size = g->size;
			char h2[32];
			if (g->got && g->got != g->size)
				snprintf(p->fail_msg, sizeof(p->fail_msg),
					 "%s of %s, then of %s, on device %d failed: %s", g->call,
					 human(g->size, h), human(g->got, h2), d->ordinal, eb);
			else
				snprintf(p->fail_msg, sizeof(p->fail_msg),
					 "%s of %s on device %d failed: %s", g->call,
					 human(g->size, h), d->ordinal, eb);
			log_warn("event=cuda_grow_failed device=%d uid=%u size=%" PRIu64
				 " call=%s error=\"%s\"",
				 d->ordinal, p->key.uid, g->got ? g->got : g->size, g->call, eb);
		}
	}
	cu->jobs--;
	free(g);

	settle_job *st = calloc(1, sizeof(*st));
	if (st) {
		st->job.work = settle_work;
		st->job.done = settle_done;
		st->cu = cu;
		submit(cu, &st->job);
	}
}

/* What slab sizes of pool p are multiples of. */
static uint64_t slab_unit(const pool *p)
{
	return p->key.handle == BB_CUDA_HANDLE_VMM ? p->dev->vmm_unit : SLAB_GRANULE;
}

/* The size of a (not dedicated) slab of pool p. */
static uint64_t slab_bytes(const cuda_backend *cu, const pool *p)
{
	return align_up(cu->cfg.slab_bytes, slab_unit(p));
}

/* Room for one more VMM allocation (an fd) under vmm_allocations: 0,
 * BACKEND_GROW once cached VMM slabs are being freed to make it, or
 * BB_ERR_NO_MEMORY. */
static int vmm_room(cuda_backend *cu, char *err, size_t errlen)
{
	if (cu->vmm_allocations < cu->cfg.vmm_allocations)
		return 0;
	bool freed = false;
	for (int i = 0; i < cu->ndev; i++) {
		cuda_dev *d = &cu->devs[i];
		for (slab *s = d->cache, *next; s; s = next) {
			next = s->cnext;
			if (s->fd >= 0 && !s->fresh) {
				slab_release(cu, s);
				freed = true;
				break;
			}
		}
		if (freed)
			return BACKEND_GROW;
	}
	/* Allocations being freed give their fds back soon. */
	for (int i = 0; i < cu->ndev; i++)
		if (cu->devs[i].freeing > 0)
			return BACKEND_GROW;
	snprintf(err, errlen,
		 "the daemon would hold %" PRIu64 " VMM CUDA allocations (a file descriptor each); "
		 "the limit is %" PRIu64 " (--max-cuda-vmm-allocations)",
		 cu->vmm_allocations + 1, cu->cfg.vmm_allocations);
	return BB_ERR_NO_MEMORY;
}

/* Start making memory for a request of len bytes in p: BACKEND_GROW, or
 * BB_ERR_NO_MEMORY when the device limit leaves no room. */
static int grow(cuda_backend *cu, pool *p, uint64_t len, bool dedicated, char *err, size_t errlen)
{
	cuda_dev *d = p->dev;
	char h1[32], h2[32], h3[32], h4[32];
	bool vmm = p->key.handle == BB_CUDA_HANDLE_VMM;
	uint64_t unit = slab_unit(p);
	uint64_t held = d->reserved - d->freeing;
	uint64_t room = d->limit > held ? d->limit - held : 0;
	uint64_t spare = evictable(d);
	uint64_t want = dedicated ? len : slab_bytes(cu, p);
	int rc;

	if (!dedicated && want > room + spare) {
		/* Near the limit a smaller slab still serves this request. */
		uint64_t fit = (room + spare) / unit * unit;
		uint64_t least = align_up(len, vmm ? unit : BACKEND_CUDA_ALIGN);
		want = fit > least ? fit : least;
	}
	if (want > room + spare) {
		d->refused++;
		snprintf(
			err, errlen,
			"device %d would hold %s (%s for this buffer on top of %s); the limit is %s "
			"(--cuda-device-bytes)",
			d->ordinal, human(held - spare + want, h1), human(want, h2),
			human(held - spare, h3), human(d->limit, h4));
		return BB_ERR_NO_MEMORY;
	}
	if (want > room) {
		/* Free cached slabs, oldest first, until it fits; grow after. */
		for (slab *s = d->cache, *next; s && want > room; s = next) {
			next = s->cnext;
			if (s->fresh)
				continue;
			room += s->size;
			slab_release(cu, s);
		}
		return BACKEND_GROW;
	}
	if (d->freeing > 0) {
		/* Memory we are giving back may not be back yet: grow once it
		 * is, so the driver sees it free. */
		return BACKEND_GROW;
	}
	if (vmm && (rc = vmm_room(cu, err, errlen)))
		return rc;

	grow_job *g = calloc(1, sizeof(*g));
	if (!g) {
		snprintf(err, errlen, "daemon out of memory");
		return BB_ERR_NO_MEMORY;
	}
	g->job.work = grow_work;
	g->job.done = grow_done;
	g->cu = cu;
	g->pool = p;
	g->ctx = d->ctx;
	g->size = want;
	g->dedicated = dedicated;
	g->vmm = vmm;
	g->dev = d->dev;
	g->fd = -1;
	g->min_size = dedicated ? want : align_up(len, unit);
	if (g->min_size > want)
		g->min_size = want;
	d->reserved += want;
	if (vmm)
		vmm_count(cu, d, 1);
	DL_APPEND(p->growing, g);
	submit(cu, &g->job);
	return BACKEND_GROW;
}

/* ---- the vtable -------------------------------------------------------------- */

static pool *pool_get(cuda_backend *cu, int device, uint32_t uid, int share, int handle)
{
	pool_key k;
	pool *p;
	memset(&k, 0, sizeof(k));
	k.device = device;
	k.uid = uid;
	k.share = share;
	k.handle = handle;
	HASH_FIND(hh, cu->pools, &k, sizeof(k), p);
	if (p)
		return p;
	p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->key = k;
	p->dev = &cu->devs[device];
	HASH_ADD(hh, cu->pools, key, sizeof(k), p);
	return p;
}

/* x (its off and len set) takes the front of free extent e of s: it goes
 * before e by address, and e keeps the rest (or goes, when nothing is
 * left). */
static void take_front(slab *s, extent *e, extent *x)
{
	DL_PREPEND_ELEM2(s->extents, e, x, aprev, anext);
	e->off += x->len;
	e->len -= x->len;
	if (e->len == 0) {
		DL_DELETE2(s->extents, e, aprev, anext);
		DL_DELETE(s->free, e);
		free(e);
	}
}

/* Carve len bytes out of p into x (first fit over each slab's free
 * extents, oldest slab first); a dedicated request takes an unclaimed
 * allocation of exactly len. x becomes a live extent on the slab's address
 * list. NULL when nothing fits. */
static slab *carve(pool *p, uint64_t len, bool dedicated, extent *x)
{
	slab *s;
	DL_FOREACH (p->slabs, s) {
		if (s->dedicated != dedicated || (dedicated && (s->live || s->size != len)))
			continue;
		extent *e;
		DL_FOREACH (s->free, e) {
			if (e->len >= len)
				break;
		}
		if (!e)
			continue;
		x->slab = s;
		x->off = e->off;
		x->len = len;
		x->prev = x->next = NULL;
		take_front(s, e, x);
		cache_remove(p->dev, s);
		s->live++;
		return s;
	}
	return NULL;
}

/* Give live extent x's range back to its slab, merging with whichever of
 * its neighbours by address is free: O(1), no search, no allocation. x is
 * freed or becomes a free-list node. */
static void extent_put(extent *x)
{
	slab *s = x->slab;
	extent *prev = x == s->extents ? NULL : x->aprev; /* the head's aprev is the tail */
	extent *next = x->anext;
	bool with_prev = prev && extent_is_free(prev);
	bool with_next = next && extent_is_free(next);

	if (with_prev) {
		/* prev grows over x (and next): it is on the free list already. */
		prev->len += x->len;
		DL_DELETE2(s->extents, x, aprev, anext);
		free(x);
		if (with_next) {
			prev->len += next->len;
			DL_DELETE2(s->extents, next, aprev, anext);
			DL_DELETE(s->free, next);
			free(next);
		}
	} else if (with_next) {
		next->off = x->off;
		next->len += x->len;
		DL_DELETE2(s->extents, x, aprev, anext);
		free(x);
	} else {
		/* Last in the free list: first fit over a FIFO list fragments
		 * about as little as by address, and LIFO markedly more
		 * (Johnstone and Wilson, 1998). */
		DL_APPEND(s->free, x);
	}
}

/* The handle kind an alloc asking for asked gets on d, into *out: 0, or
 * BB_ERR_UNSUPPORTED / BB_ERR_INVALID with why. Never another kind than
 * an explicit one. */
static int choose_handle(const cuda_backend *cu, const cuda_dev *d, int asked, int *out, char *err,
			 size_t errlen)
{
	int forbid = cu->cfg.handle_forbid;
	if (asked == BB_CUDA_HANDLE_DEFAULT)
		asked = cu->cfg.handle_default;
	switch (asked) {
	case BB_CUDA_HANDLE_AUTO:
		if (d->vmm && forbid != BB_CUDA_HANDLE_VMM) {
			*out = BB_CUDA_HANDLE_VMM;
			return 0;
		}
		if (forbid != BB_CUDA_HANDLE_LEGACY) {
			*out = BB_CUDA_HANDLE_LEGACY;
			return 0;
		}
		snprintf(err, errlen,
			 "no CUDA handle kind can be had on device %d: legacy IPC handles are "
			 "forbidden by the operator (cuda-forbid = legacy) and VMM: %s",
			 d->ordinal, d->vmm ? "forbidden" : d->vmm_why);
		return BB_ERR_UNSUPPORTED;
	case BB_CUDA_HANDLE_VMM:
		if (forbid == BB_CUDA_HANDLE_VMM) {
			snprintf(err, errlen,
				 "VMM CUDA buffers are forbidden by the operator of this daemon "
				 "(cuda-forbid = vmm)");
			return BB_ERR_UNSUPPORTED;
		}
		if (!d->vmm) {
			snprintf(err, errlen, "VMM CUDA buffers cannot be had on device %d: %s",
				 d->ordinal, d->vmm_why);
			return BB_ERR_UNSUPPORTED;
		}
		*out = BB_CUDA_HANDLE_VMM;
		return 0;
	case BB_CUDA_HANDLE_LEGACY:
		if (forbid == BB_CUDA_HANDLE_LEGACY) {
			snprintf(err, errlen,
				 "legacy CUDA IPC buffers are forbidden by the operator of this "
				 "daemon (cuda-forbid = legacy)");
			return BB_ERR_UNSUPPORTED;
		}
		*out = BB_CUDA_HANDLE_LEGACY;
		return 0;
	default: snprintf(err, errlen, "unknown CUDA handle kind %d", asked); return BB_ERR_INVALID;
	}
}

static int cuda_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		      backend_mem *out, char *err, size_t errlen)
{
	cuda_backend *cu = be->ctx;
	char h[32];
	int kind, rc;

	if (device < 0 || device >= cu->ndev) {
		snprintf(err, errlen,
			 "device %d is not a CUDA device of this daemon (it serves %d: 0-%d)",
			 device, cu->ndev, cu->ndev - 1);
		return BB_ERR_INVALID;
	}
	if (size > UINT64_MAX - 2 * SLAB_GRANULE - cu->devs[device].vmm_unit) {
		snprintf(err, errlen, "%s is too large for a CUDA buffer", human(size, h));
		return BB_ERR_INVALID;
	}
	if ((rc = choose_handle(cu, &cu->devs[device], *handle, &kind, err, errlen))) {
		if (rc == BB_ERR_UNSUPPORTED)
			*handle = BACKEND_HANDLE_REFUSED;
		return rc;
	}
	pool *p = pool_get(cu, device, uid, share, kind);
	extent *x = calloc(1, sizeof(*x));
	if (!p || !x) {
		free(x);
		snprintf(err, errlen, "daemon out of memory");
		return BB_ERR_NO_MEMORY;
	}
	uint64_t len = align_up(size, BACKEND_CUDA_ALIGN);
	bool dedicated = len > slab_bytes(cu, p);
	/* A dedicated VMM allocation is a whole number of the device's
	 * granules, and its one extent covers it. */
	if (dedicated && kind == BB_CUDA_HANDLE_VMM)
		len = align_up(len, slab_unit(p));
	*handle = kind;
	if (carve(p, len, dedicated, x)) {
		p->dev->used += size;
		out->fd = -1;
		out->size = size;
		out->priv = x;
		return 0;
	}
	free(x);
	if (p->fail_code && p->fail_dedicated == dedicated && (!dedicated || p->fail_size == len)) {
		/* The grow made for this request failed: say why, once. */
		int rc = p->fail_code;
		p->fail_code = 0;
		snprintf(err, errlen, "%s", p->fail_msg);
		return rc;
	}
	for (grow_job *g = p->growing; g; g = g->next)
		if (g->dedicated == dedicated && (!dedicated || g->size == len))
			return BACKEND_GROW;
	return grow(cu, p, len, dedicated, err, errlen);
}

static void cuda_free(backend *be, backend_mem *mem)
{
	cuda_backend *cu = be->ctx;
	extent *x = mem->priv;
	if (!x)
		return;
	mem->priv = NULL;
	slab *s = x->slab;
	cuda_dev *d = s->pool->dev;
	d->used -= mem->size;
	s->live--;
	extent_put(x);
	if (s->live)
		return;
	if (s->dedicated) {
		slab_release(cu, s);
	} else {
		cache_add(d, s);
		cache_trim(cu, d, cu->cfg.cache_bytes);
	}
}

static int cuda_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
		       size_t errlen)
{
	(void)be;
	const extent *x = mem->priv;
	if (!x) {
		snprintf(err, errlen, "the buffer has no device memory");
		return BB_ERR_SYSTEM;
	}
	const slab *s = x->slab;
	_Static_assert(sizeof(out->ipc_handle) == sizeof(s->handle), "IPC handle size");
	if (s->fd >= 0) {
		out->fd = s->fd;
		out->has_ipc = 0;
		out->cuda_handle = BB_CUDA_HANDLE_VMM;
	} else {
		out->fd = -1;
		memcpy(out->ipc_handle, &s->handle, sizeof(out->ipc_handle));
		out->has_ipc = 1;
		out->cuda_handle = BB_CUDA_HANDLE_LEGACY;
	}
	out->offset = x->off;
	memcpy(out->device_uuid, s->pool->dev->uuid, sizeof(out->device_uuid));
	out->allocation = s->allocation;
	out->allocation_size = s->size;
	return 0;
}

static uint64_t cuda_fd_allocation(backend *be, const backend_mem *mem)
{
	(void)be;
	const extent *x = mem->priv;
	return x && x->slab->fd >= 0 ? x->slab->allocation : 0;
}

static int cuda_export_allocation(backend *be, uint64_t allocation, backend_export *out, char *err,
				  size_t errlen)
{
	cuda_backend *cu = be->ctx;
	slab *s;
	HASH_FIND(hh, cu->by_allocation, &allocation, sizeof(allocation), s);
	if (!s) {
		snprintf(err, errlen, "no VMM allocation %" PRIu64 " lives", allocation);
		return BB_ERR_NOT_FOUND;
	}
	out->fd = s->fd;
	out->has_ipc = 0;
	out->cuda_handle = BB_CUDA_HANDLE_VMM;
	out->offset = 0;
	memcpy(out->device_uuid, s->pool->dev->uuid, sizeof(out->device_uuid));
	out->allocation = s->allocation;
	out->allocation_size = s->size;
	return 0;
}

/* ---- a restart: VMM allocations kept by the fd store --------------------------- */

/* Mark [off, off + len) of s live as x: it must lie inside one free extent,
 * which keeps what is left of it on either side (the tail as a new free
 * extent when both are left). false when it does not fit (nothing changed),
 * or with *nomem when the tail's extent could not be had. */
static bool carve_at(slab *s, uint64_t off, uint64_t len, extent *x, bool *nomem)
{
	extent *e;
	DL_FOREACH (s->free, e) {
		if (e->off <= off && len <= e->len && off - e->off <= e->len - len)
			break;
	}
	if (!e)
		return false;
	uint64_t end = e->off + e->len;
	x->slab = s;
	x->off = off;
	x->len = len;
	x->prev = x->next = NULL;
	if (off > e->off && off + len < end) {
		extent *t = calloc(1, sizeof(*t));
		if (!t) {
			*nomem = true;
			return false;
		}
		t->slab = s;
		t->off = off + len;
		t->len = end - t->off;
		e->len = off - e->off;
		DL_APPEND_ELEM2(s->extents, e, x, aprev, anext);
		DL_APPEND_ELEM2(s->extents, x, t, aprev, anext);
		DL_APPEND(s->free, t);
	} else if (off > e->off) {
		e->len = off - e->off; /* the head stays free */
		DL_APPEND_ELEM2(s->extents, e, x, aprev, anext);
	} else {
		take_front(s, e, x);
	}
	cache_remove(s->pool->dev, s);
	s->live++;
	return true;
}

/* Import the kept allocation c->allocation from fd into pool p as a slab
 * with one free extent over it, counted as one the backend made. NULL
 * with why. */
static slab *slab_import(cuda_backend *cu, pool *p, int fd, const backend_carved *c, char *err,
			 size_t errlen)
{
	cuda_dev *d = p->dev;
	char eb[160], h1[32], h2[32];
	uint64_t held = d->reserved - d->freeing;
	if (c->allocation_size > d->limit || held > d->limit - c->allocation_size) {
		snprintf(err, errlen,
			 "device %d would hold %s with it; the limit is %s (--cuda-device-bytes)",
			 d->ordinal, human(held + c->allocation_size, h1), human(d->limit, h2));
		return NULL;
	}
	if (cu->vmm_allocations >= cu->cfg.vmm_allocations) {
		snprintf(err, errlen,
			 "the daemon holds %" PRIu64 " VMM CUDA allocations, the limit "
			 "(--max-cuda-vmm-allocations)",
			 cu->vmm_allocations);
		return NULL;
	}
	if (!cu->api.MemImportFromShareableHandle) {
		snprintf(err, errlen, "the CUDA driver has no cuMemImportFromShareableHandle");
		return NULL;
	}
	slab *s = calloc(1, sizeof(*s));
	extent *e = calloc(1, sizeof(*e));
	if (!s || !e) {
		free(s);
		free(e);
		snprintf(err, errlen, "daemon out of memory");
		return NULL;
	}
	cu->api.CtxSetCurrent(d->ctx);
	CUresult rc = cu->api.MemImportFromShareableHandle(
		&s->mh, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (rc != CUDA_SUCCESS) {
		snprintf(err, errlen, "cuMemImportFromShareableHandle of its fd failed: %s",
			 bb_cuda_error(&cu->api, rc, eb, sizeof(eb)));
		free(s);
		free(e);
		return NULL;
	}
	s->pool = p;
	s->size = c->allocation_size;
	s->fd = fd;
	s->allocation = c->allocation;
	s->dedicated = c->allocation_size > slab_bytes(cu, p);
	e->slab = s;
	e->len = s->size;
	DL_APPEND2(s->extents, e, aprev, anext);
	DL_APPEND(s->free, e);
	DL_APPEND(p->slabs, s);
	HASH_ADD(hh, cu->by_allocation, allocation, sizeof(s->allocation), s);
	d->reserved += s->size;
	vmm_count(cu, d, 1);
	if (cu->next_allocation < s->allocation)
		cu->next_allocation = s->allocation;
	return s;
}

/* Forget a slab slab_import made that got no buffer: the fd stays the
 * caller's. */
static void slab_unimport(cuda_backend *cu, slab *s)
{
	cuda_dev *d = s->pool->dev;
	DL_DELETE(s->pool->slabs, s);
	HASH_DELETE(hh, cu->by_allocation, s);
	slab_free_extents(s);
	cu->api.CtxSetCurrent(d->ctx);
	cu->api.MemRelease(s->mh);
	d->reserved -= s->size;
	vmm_count(cu, d, -1);
	free(s);
}

static int cuda_adopt_carved(backend *be, int fd, const backend_carved *c, backend_mem *out,
			     char *err, size_t errlen)
{
	cuda_backend *cu = be->ctx;
	if (c->device < 0 || c->device >= cu->ndev) {
		snprintf(err, errlen, "device %d is not a CUDA device of this daemon", c->device);
		return BB_ERR_INVALID;
	}
	if (!cu->devs[c->device].vmm) {
		snprintf(err, errlen, "VMM CUDA memory cannot be had on device %d now: %s",
			 c->device, cu->devs[c->device].vmm_why);
		return BB_ERR_INVALID;
	}
	pool *p = pool_get(cu, c->device, c->uid, c->share, BB_CUDA_HANDLE_VMM);
	extent *x = calloc(1, sizeof(*x));
	if (!p || !x) {
		free(x);
		snprintf(err, errlen, "daemon out of memory");
		return BB_ERR_NO_MEMORY;
	}
	slab *s;
	HASH_FIND(hh, cu->by_allocation, &c->allocation, sizeof(c->allocation), s);
	bool made = false;
	if (s && (s->pool != p || s->size != c->allocation_size)) {
		snprintf(err, errlen,
			 "VMM allocation %" PRIu64
			 " is restored with another owner, device or size",
			 c->allocation);
		free(x);
		return BB_ERR_INVALID;
	}
	uint64_t len = align_up(c->size, BACKEND_CUDA_ALIGN);
	if (!s) {
		if (fd < 0) {
			snprintf(err, errlen, "VMM allocation %" PRIu64 " was not kept",
				 c->allocation);
			free(x);
			return BB_ERR_INVALID;
		}
		if (!(s = slab_import(cu, p, fd, c, err, errlen))) {
			free(x);
			return BB_ERR_INVALID;
		}
		made = true;
	}
	if (s->dedicated)
		len = s->size; /* its one extent covers it (cuda_alloc) */
	bool nomem = false;
	if (c->offset % BACKEND_CUDA_ALIGN || len < c->size ||
	    !carve_at(s, c->offset, len, x, &nomem)) {
		if (nomem)
			snprintf(err, errlen, "daemon out of memory");
		else
			snprintf(err, errlen,
				 "bytes %" PRIu64 "-%" PRIu64 " of VMM allocation %" PRIu64
				 " are not free to restore",
				 c->offset, c->offset + len, c->allocation);
		free(x);
		if (made)
			slab_unimport(cu, s);
		return nomem ? BB_ERR_NO_MEMORY : BB_ERR_INVALID;
	}
	p->dev->used += c->size;
	out->fd = -1;
	out->size = c->size;
	out->priv = x;
	return 0;
}

static void cuda_allocation_floor(backend *be, uint64_t floor)
{
	cuda_backend *cu = be->ctx;
	if (cu->next_allocation < floor)
		cu->next_allocation = floor;
}

static int cuda_devices(backend *be, backend_device *out, int max)
{
	cuda_backend *cu = be->ctx;
	CUcontext prev = NULL;
	int n = 0;
	cu->api.CtxGetCurrent(&prev);
	for (; n < cu->ndev && n < max; n++) {
		const cuda_dev *d = &cu->devs[n];
		backend_device *o = &out[n];
		size_t fr = 0, tot = 0;
		memset(o, 0, sizeof(*o));
		o->ordinal = d->ordinal;
		snprintf(o->name, sizeof(o->name), "%s", d->name);
		memcpy(o->uuid, d->uuid, sizeof(o->uuid));
		o->total = d->total;
		if (cu->api.CtxSetCurrent(d->ctx) == CUDA_SUCCESS &&
		    cu->api.MemGetInfo(&fr, &tot) == CUDA_SUCCESS)
			o->free = fr;
		o->used = d->used;
		o->reserved = d->reserved;
		o->limit = d->limit;
		o->refused = d->refused;
		o->vmm = d->vmm && cu->cfg.handle_forbid != BB_CUDA_HANDLE_VMM;
		if (!d->vmm)
			snprintf(o->vmm_why, sizeof(o->vmm_why), "%s", d->vmm_why);
		else if (!o->vmm)
			snprintf(o->vmm_why, sizeof(o->vmm_why),
				 "forbidden by the operator (cuda-forbid = vmm)");
		o->vmm_allocations = d->vmm_allocations;
	}
	cu->api.CtxSetCurrent(prev);
	return n;
}

static void cuda_usage(backend *be, uint64_t *buffers, uint64_t *bytes)
{
	cuda_backend *cu = be->ctx;
	uint64_t n = 0, sz = 0;
	pool *p, *ptmp;
	HASH_ITER (hh, cu->pools, p, ptmp) {
		const slab *s;
		DL_FOREACH (p->slabs, s)
			n += s->live;
	}
	for (int i = 0; i < cu->ndev; i++)
		sz += cu->devs[i].used;
	*buffers = n;
	*bytes = sz;
}

/* Append one problem line to report. */
static void check_line(char *report, size_t cap, int *problems, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static void check_line(char *report, size_t cap, int *problems, const char *fmt, ...)
{
	size_t used = strnlen(report, cap);
	(*problems)++;
	if (used + 1 >= cap)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(report + used, cap - used, fmt, ap);
	va_end(ap);
	used = strnlen(report, cap);
	if (used + 1 < cap) {
		report[used] = '\n';
		report[used + 1] = '\0';
	}
}

/* Each slab is of its pool's kind: a VMM one keeps an open fd and is found
 * by its identity, a legacy one has no fd; the VMM allocations counted are
 * the VMM slabs plus those being made and freed, within the bound. */
static int cuda_check(backend *be, char *report, size_t cap)
{
	cuda_backend *cu = be->ctx;
	int problems = 0;
	uint64_t vmm = 0, growing = 0;
	if (cap)
		report[0] = '\0';
	pool *p, *ptmp;
	HASH_ITER (hh, cu->pools, p, ptmp) {
		bool is_vmm = p->key.handle == BB_CUDA_HANDLE_VMM;
		for (const grow_job *g = p->growing; g; g = g->next)
			if (g->vmm)
				growing++;
		const slab *s;
		DL_FOREACH (p->slabs, s) {
			if (!is_vmm) {
				if (s->fd != -1)
					check_line(report, cap, &problems,
						   "legacy CUDA allocation %" PRIu64 " has fd %d",
						   s->allocation, s->fd);
				continue;
			}
			vmm++;
			slab *found;
			HASH_FIND(hh, cu->by_allocation, &s->allocation, sizeof(s->allocation),
				  found);
			if (found != s)
				check_line(report, cap, &problems,
					   "VMM CUDA allocation %" PRIu64
					   " is not found by its identity",
					   s->allocation);
			if (s->fd < 0 || fcntl(s->fd, F_GETFD) < 0)
				check_line(report, cap, &problems,
					   "VMM CUDA allocation %" PRIu64 " has no open fd (%d)",
					   s->allocation, s->fd);
		}
	}
	if (HASH_COUNT(cu->by_allocation) != vmm)
		check_line(report, cap, &problems,
			   "%u VMM CUDA allocations are indexed by identity, %" PRIu64 " live",
			   HASH_COUNT(cu->by_allocation), vmm);
	if (vmm + growing + cu->vmm_freeing != cu->vmm_allocations)
		check_line(report, cap, &problems,
			   "%" PRIu64 " VMM CUDA allocations are counted; %" PRIu64
			   " live, %" PRIu64 " being made, %" PRIu64 " being freed",
			   cu->vmm_allocations, vmm, growing, cu->vmm_freeing);
	if (cu->vmm_allocations > cu->cfg.vmm_allocations)
		check_line(report, cap, &problems,
			   "%" PRIu64 " VMM CUDA allocations are held; the bound is %" PRIu64,
			   cu->vmm_allocations, cu->cfg.vmm_allocations);
	uint64_t sum = 0;
	for (int i = 0; i < cu->ndev; i++)
		sum += cu->devs[i].vmm_allocations;
	if (sum != cu->vmm_allocations)
		check_line(report, cap, &problems,
			   "the devices count %" PRIu64
			   " VMM CUDA allocations, the backend %" PRIu64,
			   sum, cu->vmm_allocations);
	return problems;
}

static void cuda_destroy(backend *be)
{
	cuda_backend *cu = be->ctx;
	pool *p, *ptmp;
	if (cu->jobs)
		log_error("event=cuda_destroy_early jobs=%u", cu->jobs);
	HASH_ITER (hh, cu->pools, p, ptmp) {
		slab *s, *stmp;
		if (p->slabs)
			cu->api.CtxSetCurrent(p->dev->ctx);
		DL_FOREACH_SAFE (p->slabs, s, stmp) {
			if (s->live)
				log_warn("event=cuda_destroy_live device=%d allocation=%" PRIu64
					 " buffers=%u",
					 p->dev->ordinal, s->allocation, s->live);
			slab_free_now(cu, p->dev, s);
			if (s->fd >= 0)
				HASH_DELETE(hh, cu->by_allocation, s);
			slab_free_extents(s);
			DL_DELETE(p->slabs, s);
			free(s);
		}
		HASH_DEL(cu->pools, p);
		free(p);
	}
	cu->api.CtxSetCurrent(NULL);
	for (int i = 0; i < cu->ndev; i++)
		cu->api.DevicePrimaryCtxRelease(cu->devs[i].dev);
	bb_cuda_unload(&cu->api);
	free(cu->devs);
	free(cu);
}

/* ---- construction ------------------------------------------------------------ */

void backend_cuda_config_default(backend_cuda_config *cfg)
{
	cfg->slab_bytes = BACKEND_CUDA_SLAB_DEFAULT;
	cfg->cache_bytes = BACKEND_CUDA_CACHE_DEFAULT;
	cfg->device_bytes = 0;
	cfg->handle_default = BB_CUDA_HANDLE_LEGACY;
	cfg->handle_forbid = 0;
	cfg->vmm_allocations = BACKEND_CUDA_VMM_ALLOCATIONS_DEFAULT;
}

int backend_cuda_handles_check(const backend_cuda_config *cfg, char *why, size_t whylen)
{
	int def = cfg->handle_default, forbid = cfg->handle_forbid;
	if (def != BB_CUDA_HANDLE_LEGACY && def != BB_CUDA_HANDLE_AUTO &&
	    def != BB_CUDA_HANDLE_VMM) {
		snprintf(why, whylen, "cuda-handle must be legacy, auto or vmm");
		return -1;
	}
	if (forbid != 0 && forbid != BB_CUDA_HANDLE_LEGACY && forbid != BB_CUDA_HANDLE_VMM) {
		snprintf(why, whylen, "cuda-forbid must be none, legacy or vmm");
		return -1;
	}
	if (forbid && forbid == def) {
		snprintf(why, whylen, "cuda-handle = %s is forbidden by cuda-forbid = %s",
			 def == BB_CUDA_HANDLE_VMM ? "vmm" : "legacy",
			 def == BB_CUDA_HANDLE_VMM ? "vmm" : "legacy");
		return -1;
	}
	return 0;
}

void backend_cuda_set_handles(backend *be, const backend_cuda_config *cfg)
{
	cuda_backend *cu = be->ctx;
	cu->cfg.handle_default = cfg->handle_default;
	cu->cfg.handle_forbid = cfg->handle_forbid;
}

int backend_cuda_driver_version(const backend *be)
{
	return ((const cuda_backend *)be->ctx)->driver_version;
}

const backend_cuda_config *backend_cuda_config_of(const backend *be)
{
	return &((const cuda_backend *)be->ctx)->cfg;
}

const char *backend_cuda_library(const backend *be)
{
	(void)be;
	return bb_cuda_library_path();
}

/* Whether device attribute attr (named name) of d is non-zero; if not,
 * d->vmm_why says "device N LACKS (NAME: value or error)". */
static bool device_has(cuda_backend *cu, cuda_dev *d, CUdevice_attribute attr, const char *name,
		       const char *lacks)
{
	int v = 0;
	char eb[96];
	CUresult rc = cu->api.DeviceGetAttribute(&v, attr, d->dev);
	if (rc == CUDA_SUCCESS && v)
		return true;
	snprintf(d->vmm_why, sizeof(d->vmm_why), "device %d %s (%s: %s)", d->ordinal, lacks, name,
		 rc ? bb_cuda_error(&cu->api, rc, eb, sizeof(eb)) : "0");
	return false;
}

/* Whether VMM slabs can be made on d (d->vmm, else d->vmm_why) and their
 * unit: the recommended granularity, rounded up to a multiple of it that
 * is at least 2 MiB. */
static void device_probe_vmm(cuda_backend *cu, cuda_dev *d)
{
	const bb_cuda *api = &cu->api;
	size_t gran = 0;
	CUresult rc;
	char eb[96];
	CUmemAllocationProp prop;

	d->vmm = false;
	if (!bb_cuda_has_vmm(api, d->vmm_why, sizeof(d->vmm_why)) ||
	    !device_has(cu, d, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
			"CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
			"does not support virtual memory management") ||
	    !device_has(cu, d, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
			"CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
			"cannot export allocations as file descriptors"))
		return;
	vmm_prop(&prop, d->dev);
	if ((rc = api->CtxSetCurrent(d->ctx)) != CUDA_SUCCESS ||
	    (rc = api->MemGetAllocationGranularity(
		     &gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)) != CUDA_SUCCESS ||
	    gran == 0) {
		snprintf(d->vmm_why, sizeof(d->vmm_why),
			 "device %d: cuMemGetAllocationGranularity failed: %s", d->ordinal,
			 rc ? bb_cuda_error(api, rc, eb, sizeof(eb)) : "granularity 0");
		return;
	}
	d->vmm_unit = align_up(SLAB_GRANULE, gran);
	d->vmm = true;
	d->vmm_why[0] = '\0';
}

/* Learn device i and retain its primary context. 0, or -1 with why. */
static int device_open(cuda_backend *cu, int i, char *why, size_t whylen)
{
	const bb_cuda *api = &cu->api;
	cuda_dev *d = &cu->devs[i];
	CUuuid uuid;
	size_t total = 0;
	const char *call;
	CUresult rc;
	char eb[160];

	d->ordinal = i;
	if ((rc = api->DeviceGet(&d->dev, i)) != CUDA_SUCCESS) {
		call = "cuDeviceGet";
		goto err;
	}
	if ((rc = api->DeviceGetName(d->name, (int)sizeof(d->name), d->dev)) != CUDA_SUCCESS) {
		call = "cuDeviceGetName";
		goto err;
	}
	d->name[sizeof(d->name) - 1] = '\0';
	if ((rc = api->DeviceGetUuid(&uuid, d->dev)) != CUDA_SUCCESS) {
		call = "cuDeviceGetUuid";
		goto err;
	}
	memcpy(d->uuid, uuid.bytes, sizeof(d->uuid));
	if ((rc = api->DeviceTotalMem(&total, d->dev)) != CUDA_SUCCESS) {
		call = "cuDeviceTotalMem";
		goto err;
	}
	d->total = total;
	if ((rc = api->DevicePrimaryCtxRetain(&d->ctx, d->dev)) != CUDA_SUCCESS) {
		call = "cuDevicePrimaryCtxRetain";
		goto err;
	}
	d->limit = cu->cfg.device_bytes ? cu->cfg.device_bytes : d->total / 10 * 9;
	device_probe_vmm(cu, d);
	return 0;
err:
	snprintf(why, whylen, "device %d: %s failed: %s", i, call,
		 bb_cuda_error(api, rc, eb, sizeof(eb)));
	return -1;
}

backend *backend_cuda_new(const backend_cuda_config *cfg, char *why, size_t whylen)
{
	cuda_backend *cu = calloc(1, sizeof(*cu));
	char eb[160];
	int n = 0, opened = 0;
	CUresult rc;

	if (!cu) {
		snprintf(why, whylen, "out of memory");
		return NULL;
	}
	if (cfg)
		cu->cfg = *cfg;
	else
		backend_cuda_config_default(&cu->cfg);
	if (cu->cfg.slab_bytes < BACKEND_CUDA_SLAB_MIN)
		cu->cfg.slab_bytes = BACKEND_CUDA_SLAB_MIN;
	cu->cfg.slab_bytes = align_up(cu->cfg.slab_bytes, SLAB_GRANULE);

	if (bb_cuda_load(&cu->api, why, whylen) < 0)
		goto err_free;
	cu->api.DriverGetVersion(&cu->driver_version);
	if ((rc = cu->api.DeviceGetCount(&n)) != CUDA_SUCCESS) {
		snprintf(why, whylen, "cuDeviceGetCount failed: %s",
			 bb_cuda_error(&cu->api, rc, eb, sizeof(eb)));
		goto err_unload;
	}
	if (n <= 0) {
		snprintf(why, whylen, "the CUDA driver %s reports no devices",
			 bb_cuda_library_path());
		goto err_unload;
	}
	if (!(cu->devs = calloc((size_t)n, sizeof(*cu->devs)))) {
		snprintf(why, whylen, "out of memory");
		goto err_unload;
	}
	for (; opened < n; opened++)
		if (device_open(cu, opened, why, whylen) < 0)
			goto err_devices;
	cu->ndev = n;

	cu->be.name = "cuda";
	cu->be.ctx = cu;
	cu->be.alloc = cuda_alloc;
	cu->be.import_fd = NULL;
	cu->be.free = cuda_free;
	cu->be.export_mem = cuda_export;
	cu->be.fd_allocation = cuda_fd_allocation;
	cu->be.export_allocation = cuda_export_allocation;
	cu->be.adopt_carved = cuda_adopt_carved;
	cu->be.allocation_floor = cuda_allocation_floor;
	cu->be.destroy = cuda_destroy;
	cu->be.devices = cuda_devices;
	cu->be.usage = cuda_usage;
	cu->be.check = cuda_check;
	return &cu->be;

err_devices:
	for (int i = 0; i < opened; i++)
		cu->api.DevicePrimaryCtxRelease(cu->devs[i].dev);
	free(cu->devs);
err_unload:
	bb_cuda_unload(&cu->api);
err_free:
	free(cu);
	return NULL;
}
