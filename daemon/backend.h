/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Memory backends: the one small interface through which the broker gets,
 * exports and frees the memory behind a buffer. Host (memfd), CUDA and the
 * unit tests' counting backend all look the same to the broker.
 */
#ifndef BB_BACKEND_H
#define BB_BACKEND_H

#include <stddef.h>
#include <stdint.h>

/* The memory behind one buffer, as a backend describes it. */
typedef struct backend_mem {
	int fd;        /* host: the sealed memfd the daemon keeps; -1 otherwise */
	uint32_t uid;  /* host: the uid alloc was asked for (the reuse pool's key);
			 * in the padding after fd, so the struct stays 24 bytes */
	uint64_t size; /* bytes usable by clients */
	void *priv;    /* backend's own bookkeeping */
} backend_mem;

/* What a client needs to map a buffer: attached to Alloc/Open/Adopt answers. */
typedef struct backend_export {
	int fd;                        /* borrowed fd to attach, or -1 */
	unsigned char ipc_handle[64];  /* CUDA: cudaIpcMemHandle_t bytes */
	int has_ipc;                   /* 1 when ipc_handle is meaningful */
	uint64_t offset;               /* CUDA: start inside the allocation */
	unsigned char device_uuid[16]; /* CUDA: device the memory lives on */
	uint64_t allocation;           /* CUDA: identity of the allocation */
	int cuda_handle;               /* CUDA: BB_CUDA_HANDLE_LEGACY or _VMM; host: 0 */
	uint64_t allocation_size;      /* CUDA: bytes of the allocation */
} backend_export;

/* Where a restored VMM CUDA buffer lies (adopt_carved). */
typedef struct backend_carved {
	uint64_t allocation;      /* the allocation's identity, kept */
	uint64_t allocation_size; /* its bytes */
	uint64_t offset;          /* the buffer's start in it */
	uint64_t size;            /* the buffer's bytes */
	int device;               /* ordinal */
	uint32_t uid;             /* owner (the pool's key, with share) */
	int share;                /* BB_SHARE_* */
} backend_carved;

typedef struct backend backend;

/* Slow work a backend hands to the server (cuMemAlloc of a new slab,
 * cuMemFree of an old one): work runs on a worker thread and must touch
 * only what the job owns; done runs on the loop thread afterwards and frees
 * the job. */
typedef struct backend_job backend_job;
struct backend_job {
	void (*work)(backend_job *job);
	void (*done)(backend_job *job);
};

/* What alloc returns when the memory needs slow work first: it has
 * submitted a job (or one is already in flight) and the caller retries
 * the allocation after a job's done has run. Positive, so never a
 * BB_ERR_* code. */
#define BACKEND_GROW 1

/* What alloc sets *handle to when it refuses because the CUDA handle kind
 * asked for (DEFAULT: the configured one) cannot be had: the caller knows
 * why without reading the sentence. Never a BB_CUDA_HANDLE_* value. */
#define BACKEND_HANDLE_REFUSED (-1)

/* One device a backend serves, for status reports. */
typedef struct backend_device {
	int ordinal;                        /* as the daemon numbers devices */
	char name[96];                      /* e.g. "NVIDIA H200" */
	unsigned char uuid[16];             /* cuDeviceGetUuid */
	unsigned long long total;           /* bytes of device memory */
	unsigned long long free;            /* bytes free, as the driver reports */
	unsigned long long used;            /* bytes in live buffers of the broker */
	unsigned long long reserved;        /* bytes the broker holds from the driver (slabs) */
	unsigned long long limit;           /* the most the broker may hold on it */
	unsigned long long refused;         /* allocs refused because limit left no room */
	int vmm;                            /* VMM (cuMemCreate + POSIX fd) buffers can be had */
	char vmm_why[256];                  /* when not: why (driver, device or operator) */
	unsigned long long vmm_allocations; /* VMM allocations (an fd each) held now */
} backend_device;

struct backend {
	const char *name; /* "host", "cuda", ... for logs */
	void *ctx;        /* backend's own state */
	/* Get size bytes on device for uid, shared by policy share (memory of
	 * different uids or policies never shares an allocation). *handle is
	 * the CUDA handle kind asked for (BB_CUDA_HANDLE_*; host: DEFAULT) and
	 * becomes the one given (LEGACY or VMM for CUDA; a kind that cannot be
	 * had is BB_ERR_UNSUPPORTED with why and *handle
	 * BACKEND_HANDLE_REFUSED, never another kind). 0, BACKEND_GROW, or
	 * BB_ERR_* with a sentence in err (errlen bytes). */
	int (*alloc)(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		     backend_mem *out, char *err, size_t errlen);
	/* Adopt memory a client handed over as fd (the caller keeps its own fd;
	 * the backend duplicates what it keeps). NULL when the kind cannot be
	 * imported. */
	int (*import_fd)(backend *be, int fd, uint64_t size, backend_mem *out, char *err,
			 size_t errlen);
	/* Return the memory. Never fails. */
	void (*free)(backend *be, backend_mem *mem);
	/* Describe mem for a client. 0 or BB_ERR_*. For a VMM CUDA buffer
	 * out->fd is its allocation's fd (borrowed), which a connection needs
	 * once, not with every grant (the broker decides). */
	int (*export_mem)(backend *be, const backend_mem *mem, backend_export *out, char *err,
			  size_t errlen);
	/* The identity of the allocation whose fd grants of mem carry once per
	 * connection (a VMM CUDA slab); 0 for memory whose grants carry their
	 * own fd or none. May be NULL (always 0). Cheap: the broker calls it
	 * whenever a connection starts or stops holding such a buffer. */
	uint64_t (*fd_allocation)(backend *be, const backend_mem *mem);
	/* Describe allocation (an fd_allocation identity) for AllocationFd:
	 * out->fd (borrowed), allocation, allocation_size, device_uuid,
	 * cuda_handle. 0, or BB_ERR_NOT_FOUND when no such allocation lives.
	 * May be NULL. */
	int (*export_allocation)(backend *be, uint64_t allocation, backend_export *out, char *err,
				 size_t errlen);
	/* mem's export is going to a process whose uid is not the owner's,
	 * which may keep it forever: never reuse mem's memory for another
	 * buffer. May be NULL (the backend reuses nothing it exported). */
	void (*expose)(backend *be, const backend_mem *mem);
	/* Free the backend itself (after every mem was freed and every job
	 * is done). May be NULL. */
	void (*destroy)(backend *be);
	/* Devices served, up to max into out; returns how many. May be NULL. */
	int (*devices)(backend *be, backend_device *out, int max);
	/* The live memories (alloc and import_fd not yet freed) and their
	 * sizes as asked for, from the backend's own books: the invariant
	 * check compares them with the broker's totals. May be NULL. */
	void (*usage)(backend *be, uint64_t *buffers, uint64_t *bytes);
	/* The backend's own invariants (for Check): appends one line per
	 * problem to report (cap bytes, NUL-terminated) and returns how many.
	 * May be NULL. */
	int (*check)(backend *be, char *report, size_t cap);
	/* Take over the memory of a buffer kept across a restart
	 * (docs/RESTART.md): fd, what the fd store kept for a buffer of size
	 * bytes owned by uid; flags its journal flags (JOURNAL_BUF_IMPORTED or
	 * _EXPOSED: never reuse it). 0 and *out (fd is the backend's now), or
	 * BB_ERR_INVALID with why when fd is not such memory (fd stays the
	 * caller's). NULL: memory of this kind cannot be kept. */
	int (*adopt)(backend *be, int fd, uint64_t size, uint32_t uid, unsigned flags,
		     backend_mem *out, char *err, size_t errlen);
	/* Take over a VMM CUDA buffer kept across a restart (docs/RESTART.md):
	 * c says where it lies in which allocation; fd is that allocation's
	 * kept fd, or -1 once an earlier call for the same allocation took it.
	 * The first call imports the allocation (never mapped) and counts it
	 * like one the backend made; each call marks the buffer's range in
	 * it. 0 and *out (fd, when given, is the backend's now), or
	 * BB_ERR_INVALID with why (the fd does not import, the range is not
	 * free, a limit leaves no room; fd stays the caller's). NULL: such
	 * memory cannot be kept. */
	int (*adopt_carved)(backend *be, int fd, const backend_carved *c, backend_mem *out,
			    char *err, size_t errlen);
	/* Allocation identities handed out from now on are above floor (a
	 * restart: identities of earlier runs are never given again). May be
	 * NULL. */
	void (*allocation_floor)(backend *be, uint64_t floor);
	/* Set by the server: run job off the loop thread. NULL: the backend
	 * runs work and done inline (unit tests). */
	void (*submit)(backend *be, backend_job *job);
	void *server; /* the server's context for submit */
};

/* Run job through be->submit, or inline when there is none. */
static inline void backend_submit(backend *be, backend_job *job)
{
	if (be->submit) {
		be->submit(be, job);
	} else {
		job->work(job);
		job->done(job);
	}
}

/* The host backend: sealed memfds (MFD_CLOEXEC | MFD_ALLOW_SEALING, sized
 * to the request rounded up to whole pages, then F_SEAL_SHRINK |
 * F_SEAL_GROW | F_SEAL_SEAL); a buffer's size stays what was asked for.
 * import_fd takes a memfd that allows sealing, open for reading and
 * writing, with no write seal, of size bytes up to one page more; it seals
 * its own duplicate and checks the seals and the size again on it, so what
 * it hands out is what it checked (BB_ERR_INVALID otherwise; a file
 * refused before the seal is left as it was).
 * It pools nothing until backend_host_pool turns pooling on. Caller frees
 * with destroy, which closes every pooled memfd. */
backend *backend_host_new(void);

/* Bounds of the host reuse pool: the most memfds it may keep whatever
 * backend_host_pool asks (each alloc and free scans the pool), and the
 * bounds the daemon is meant to run with. */
#define BACKEND_HOST_POOL_MAX 1024
#define BACKEND_HOST_POOL_DEFAULT 64
#define BACKEND_HOST_POOL_PER_CLASS_DEFAULT 8

/* Keep up to max memfds in all, at most per_class of one (uid, size
 * class), for reuse instead of closing them when their buffer is freed;
 * 0 for either turns pooling off. Either way what was pooled is closed
 * first. 0, or BB_ERR_NO_MEMORY with pooling off. The size class is the
 * page-rounded size. A pooled memfd has had its pages returned
 * (FALLOC_FL_PUNCH_HOLE) and is punched again when reused, so a new buffer
 * reads zeros; it is only ever reused for the uid it was made for, and
 * never once it was sent to a process of another uid or came from
 * import_fd. Beyond a bound the oldest pooled memfd is closed; an alloc
 * that finds the process out of fds closes the pool and tries again.
 *
 * Only turn it on where every host fd sent to a process whose uid is not
 * the buffer's owner's is reported first (the backend's expose, which the
 * broker's grant calls; or backend_host_exposed): the backend cannot see
 * sends, and without that a client of another uid could keep an fd and
 * read a later buffer made from it. */
int backend_host_pool(backend *be, unsigned max, unsigned per_class);

/* fd, the memfd of a live host buffer, is being sent to a
 * process whose uid differs from the buffer's owner's (that process may
 * keep it forever): its memfd is closed when the buffer is freed, never
 * pooled. An fd the backend does not know is ignored. */
void backend_host_exposed(backend *be, int fd);

/* The reuse pool, for status and metrics. */
typedef struct backend_host_pool_stats {
	uint64_t pooled;  /* memfds in the pool now (not live; no pages) */
	uint64_t reused;  /* allocs served from the pool */
	uint64_t created; /* allocs that made a new memfd */
	uint64_t evicted; /* pooled memfds closed: bounds, out of fds, a failed
			   * punch at reuse, the pool turned off */
	uint64_t closed;  /* frees that closed the memfd: exposed, imported,
			   * pooling off, or the punch failed */
} backend_host_pool_stats;

/* Fill out with the pool's figures since backend_host_new. */
void backend_host_pool_info(backend *be, backend_host_pool_stats *out);

#endif /* BB_BACKEND_H */
