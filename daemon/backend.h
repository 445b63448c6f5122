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

struct backend {
	const char *name; /* "host", "cuda", ... for logs */
	void *ctx;        /* backend's own state */
	/* Get size bytes on device for uid. 0 or BB_ERR_*, with a sentence in
	 * err (errlen bytes) on failure. */
	int (*alloc)(backend *be, uint64_t size, int device, uint32_t uid,
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
	/* Free the backend itself (after every mem was freed). May be NULL. */
	void (*destroy)(backend *be);
};

/* The host backend: sealed memfds (MFD_CLOEXEC | MFD_ALLOW_SEALING, then
 * F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL). Caller frees with destroy. */
backend *backend_host_new(void);

#endif /* BB_BACKEND_H */
