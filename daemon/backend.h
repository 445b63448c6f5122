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
	int fd;         /* host: the sealed memfd the daemon keeps; -1 otherwise */
	uint64_t size;  /* bytes usable by clients */
	void *priv;     /* backend's own bookkeeping */
} backend_mem;

/* What a client needs to map a buffer: attached to Alloc/Open/Adopt answers. */
typedef struct backend_export {
	int fd;                          /* borrowed fd to attach, or -1 */
	unsigned char ipc_handle[64];    /* CUDA: cudaIpcMemHandle_t bytes */
	int has_ipc;                     /* 1 when ipc_handle is meaningful */
	uint64_t offset;                 /* CUDA: start inside the allocation */
	unsigned char device_uuid[16];   /* CUDA: device the memory lives on */
	uint64_t allocation;             /* CUDA: identity of the allocation */
} backend_export;

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

/* One device a backend serves, for status reports. */
typedef struct backend_device {
	int ordinal;                 /* as the daemon numbers devices */
	char name[96];               /* e.g. "NVIDIA H200" */
	unsigned char uuid[16];      /* cuDeviceGetUuid */
	unsigned long long total;    /* bytes of device memory */
	unsigned long long free;     /* bytes free, as the driver reports */
	unsigned long long used;     /* bytes in live buffers of the broker */
	unsigned long long reserved; /* bytes the broker holds from the driver (slabs) */
	unsigned long long limit;    /* the most the broker may hold on it */
	unsigned long long refused;  /* allocs refused because limit left no room */
} backend_device;

struct backend {
	const char *name; /* "host", "cuda", ... for logs */
	void *ctx;        /* backend's own state */
	/* Get size bytes on device for uid, shared by policy share (memory of
	 * different uids or policies never shares an allocation). 0,
	 * BACKEND_GROW, or BB_ERR_* with a sentence in err (errlen bytes). */
	int (*alloc)(backend *be, uint64_t size, int device, uint32_t uid, int share,
		     backend_mem *out, char *err, size_t errlen);
	/* Adopt memory a client handed over as fd (the caller keeps its own fd;
	 * the backend duplicates what it keeps). NULL when the kind cannot be
	 * imported. */
	int (*import_fd)(backend *be, int fd, uint64_t size, backend_mem *out,
			 char *err, size_t errlen);
	/* Return the memory. Never fails. */
	void (*free)(backend *be, backend_mem *mem);
	/* Describe mem for a client. 0 or BB_ERR_*. */
	int (*export_mem)(backend *be, const backend_mem *mem, backend_export *out,
			  char *err, size_t errlen);
	/* Free the backend itself (after every mem was freed and every job
	 * is done). May be NULL. */
	void (*destroy)(backend *be);
	/* Devices served, up to max into out; returns how many. May be NULL. */
	int (*devices)(backend *be, backend_device *out, int max);
	/* The live memories (alloc and import_fd not yet freed) and their
	 * sizes as asked for, from the backend's own books: the invariant
	 * check compares them with the broker's totals. May be NULL. */
	void (*usage)(backend *be, uint64_t *buffers, uint64_t *bytes);
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

/* The host backend: sealed memfds (MFD_CLOEXEC | MFD_ALLOW_SEALING, then
 * F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL). Caller frees with destroy. */
backend *backend_host_new(void);

#endif /* BB_BACKEND_H */
