/*
 * bufbroker client API.
 *
 * A bb_client is one connection to bufbrokerd; a bb_buf is a process-local,
 * reference-counted handle to one buffer the daemon owns. Copying a handle
 * (bb_ref) is local; only the last bb_unref tells the daemon. Errors are
 * negative BB_ERR_* codes; bb_last_error() gives the calling thread's last
 * failure as a sentence.
 *
 * The contract is ../shared/API.md; docs/PROTOCOL.md describes the wire.
 */
#ifndef BUFBROKER_H
#define BUFBROKER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BB_VERSION_MAJOR 0
#define BB_VERSION_MINOR 1
#define BB_VERSION_PATCH 0
#define BB_VERSION_STRING "0.1.0"

#define BB_IPC_HANDLE_SIZE 64 /* bytes of a cudaIpcMemHandle_t */
#define BB_TOKEN_SIZE 16
#define BB_NAME_MAX 127 /* bytes, without the terminating NUL */

enum {
	BB_OK = 0,
	BB_ERR_INVALID = -1,      /* bad argument */
	BB_ERR_NOT_FOUND = -2,    /* no such buffer, name or token */
	BB_ERR_DENIED = -3,       /* share policy or socket permissions */
	BB_ERR_NO_MEMORY = -4,    /* a quota, a limit or the device is full */
	BB_ERR_TIMEOUT = -5,
	BB_ERR_DISCONNECTED = -6, /* the daemon is gone */
	BB_ERR_PROTOCOL = -7,     /* malformed or unexpected message */
	BB_ERR_FAILED = -8,       /* the buffer is in the failed state */
	BB_ERR_UNSUPPORTED = -9,  /* e.g. BB_CUDA where the daemon has no GPU */
	BB_ERR_STATE = -10,       /* e.g. set_ready on a buffer not PENDING */
	BB_ERR_EXISTS = -11,      /* the name is taken */
	BB_ERR_SYSTEM = -12,      /* an OS or driver call failed */
};

typedef enum bb_kind { BB_HOST = 1, BB_CUDA = 2 } bb_kind;
typedef enum bb_state { BB_PENDING = 0, BB_READY = 1, BB_FAILED = 2 } bb_state;

enum { BB_SHARE_UID = 0, BB_SHARE_GID = 1, BB_SHARE_ANY = 2 };

typedef struct bb_client bb_client; /* one connection; thread-safe */
typedef struct bb_buf bb_buf;       /* process-local handle, atomic local count */

typedef struct bb_token {
	unsigned char bytes[BB_TOKEN_SIZE];
} bb_token;

typedef struct bb_alloc_opts {
	size_t size;      /* > 0 */
	bb_kind kind;     /* BB_HOST or BB_CUDA */
	int device;       /* CUDA ordinal as the daemon numbers devices; 0 for host */
	const char *name; /* NULL, or unique among live buffers */
	int share;        /* BB_SHARE_*: who may open it by id or name */
} bb_alloc_opts;

typedef struct bb_info {
	uint64_t id;
	size_t size;
	bb_kind kind;
	int device;
	bb_state state;
	uint64_t refs;              /* daemon side: sum of connection counts + live tokens */
	char name[BB_NAME_MAX + 1]; /* "" when unnamed */
	char error[256];            /* the message given to bb_set_error, "" otherwise */
} bb_info;

typedef struct bb_cuda_ipc {
	unsigned char handle[BB_IPC_HANDLE_SIZE]; /* the allocation holding the buffer */
	uint64_t offset; /* buffer start inside that allocation, a multiple of 256 */
	size_t size;
	unsigned char device_uuid[16];
} bb_cuda_ipc;

/* Connect to the daemon. path NULL: $BUFBROKER_SOCKET, else the default
 * socket ($XDG_RUNTIME_DIR/bufbroker.sock when it exists and the caller is
 * not root, else /run/bufbroker/bufbroker.sock). Sends Hello and checks the
 * protocol version. */
int bb_connect(const char *path, bb_client **out);
/* Releases everything held through c and frees its handles. NULL is allowed. */
void bb_disconnect(bb_client *c);

/* A new buffer, PENDING, one local count held by the caller. */
int bb_alloc(bb_client *c, const bb_alloc_opts *opts, bb_buf **out);
/* One more reference to an existing buffer (coalesced per connection: an id
 * this connection already holds returns the same handle, one more count). */
int bb_open(bb_client *c, uint64_t id, bb_buf **out);
int bb_open_name(bb_client *c, const char *name, bb_buf **out);

/* Hand memory you own to the broker: fd is a memfd made with
 * MFD_ALLOW_SEALING, at least opts->size bytes, kind BB_HOST, opened
 * read-write, with no write seal. The daemon keeps its own duplicate and
 * seals the file with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL (an fd it
 * cannot seal is refused with BB_ERR_INVALID); you may close yours. The new
 * buffer is PENDING with one local count. */
int bb_import_fd(bb_client *c, int fd, const bb_alloc_opts *opts, bb_buf **out);

/* Local copies: no round trip except the last unref. NULL is allowed. */
bb_buf *bb_ref(bb_buf *b);
void bb_unref(bb_buf *b);

/* Surrender one local count into a token that any process may adopt once.
 * With other local counts left the token holds a new daemon reference; on
 * the last count the connection's reference moves into it (net zero). A
 * mapped CUDA buffer's last count is the exception: the token gets its own
 * reference, this process closes its mapping, and only then releases its
 * reference, so the adopter can never free memory this process still has
 * open (refs is one higher for that moment only). */
int bb_take(bb_buf *b, bb_token *out);
/* Receive the reference a token holds (coalesced like bb_open). */
int bb_adopt(bb_client *c, const bb_token *t, bb_buf **out);
/* 32 lowercase hex digits and back, to carry a token through text channels. */
void bb_token_format(const bb_token *t, char out[2 * BB_TOKEN_SIZE + 1]);
int bb_token_parse(const char *text, bb_token *out);

/* Async state. wait: timeout_ms < 0 waits forever, 0 polls; a buffer still
 * PENDING when the timeout passes gives BB_ERR_TIMEOUT. A FAILED buffer
 * answers 0 with *state_out == BB_FAILED. state_out may be NULL. */
int bb_set_ready(bb_buf *b);
int bb_set_error(bb_buf *b, const char *message);
int bb_wait(bb_buf *b, int timeout_ms, bb_state *state_out);

/* Host: a pointer into the shared mapping (from 2 MiB, advised
 * MADV_HUGEPAGE over its whole 2 MiB extents: huge pages where the kernel's
 * shmem THP mode allows them). CUDA: a device pointer valid in this
 * process's primary context of the matching device. Valid until the
 * handle's last local count goes. */
int bb_map(bb_buf *b, void **ptr_out);
int bb_cuda_ipc_of(bb_buf *b, bb_cuda_ipc *out); /* BB_CUDA only */

uint64_t bb_id(const bb_buf *b);
size_t bb_size(const bb_buf *b);
bb_kind bb_buf_kind(const bb_buf *b);
int bb_stat(bb_client *c, uint64_t id, bb_info *out); /* fresh from the daemon */

/* Raw daemon counts for callers that manage references themselves. Both wait
 * for the daemon's answer (only a handle's last bb_unref is sent without
 * waiting). */
int bb_retain(bb_client *c, uint64_t id, uint32_t count);
int bb_release(bb_client *c, uint64_t id, uint32_t count);

/* A static sentence for an error code ("no such buffer, name or token");
 * "unknown error" for a code this library does not know. */
const char *bb_strerror(int err);
/* The static name of an error code: its constant without the prefix, as
 * the daemon's logs and metrics write it ("NOT_FOUND" for BB_ERR_NOT_FOUND,
 * "OK" for BB_OK); "UNKNOWN" for a code this library does not know. */
const char *bb_err_name(int err);
/* The calling thread's last failure, with the daemon's message when it gave
 * one; "" before any failure. */
const char *bb_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* BUFBROKER_H */
