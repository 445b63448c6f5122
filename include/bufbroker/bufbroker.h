/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bufbroker client API (libbufbroker). This header is the whole API and its
 * contract: what each call promises is written here, above the call.
 *
 * bufbrokerd, one daemon per node, owns buffers of host shared memory and
 * of CUDA device memory and counts the references to them across
 * processes. A bb_client is one connection to it; a bb_buf is a
 * process-local, reference-counted handle to one buffer the daemon owns.
 * Copying a handle (bb_ref) is local; only the last bb_unref tells the
 * daemon.
 *
 * Building: link libbufbroker (shared or static) through pkg-config
 * (`pkg-config --cflags --libs bufbroker`) or CMake
 * (find_package(bufbroker), target bufbroker::bufbroker). The shared
 * library exports the bb_* names and nothing else.
 *
 * Errors: every call that can fail returns an int, 0 (BB_OK) on success or
 * a negative BB_ERR_* code, and bb_last_error() gives the calling thread's
 * last failure as a sentence (the daemon's own message when it sent one).
 * When the daemon is gone, every call that returns a code answers
 * BB_ERR_DISCONNECTED; none hangs.
 *
 * Threads and processes: a bb_client may be used from many threads at
 * once, and so may its handles. A bb_client and its handles belong to the
 * process that made them: a child made by fork must not use its parent's;
 * it calls bb_connect for its own. Library calls never raise SIGPIPE.
 *
 * References: a buffer's refs (bb_info) are the sum of every connection's
 * count for it plus one for each live, unadopted token. A connection's
 * handle for a buffer stands for one count, however many local counts the
 * handle has (bb_retain adds raw counts of its own), so two processes that
 * each hold a buffer see refs == 2. When the last holder lets go
 * (bb_unref, bb_release, bb_disconnect, a process that dies, a token that
 * expires), the buffer is freed at once: bb_stat on its id answers
 * BB_ERR_NOT_FOUND, the memory is returned (host: the memfd's pages; CUDA:
 * the space free again) and its name may be given to a new buffer. Ids are
 * never reused. The daemon then closes a host buffer's memfd, or keeps it,
 * emptied, for a later buffer of the same owner uid and page-rounded size
 * (bufbrokerd --host-pool-memfds; 0 turns that off): see bb_map.
 *
 * Sharing: bytes written through one process's bb_map pointer are read
 * back through another's (host: at once; CUDA: after the writer's stream
 * work completes). Opening a buffer by id or by name, bb_retain and bb_stat
 * need the buffer's share policy (BB_SHARE_*) to admit the caller, else
 * BB_ERR_DENIED. Adopting a token needs no policy: the token is the
 * permission.
 */
#ifndef BUFBROKER_H
#define BUFBROKER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this header. */
#define BB_VERSION_MAJOR 0
#define BB_VERSION_MINOR 1
#define BB_VERSION_PATCH 0
#define BB_VERSION_STRING "0.1.0"

#define BB_IPC_HANDLE_SIZE 64 /* bytes of a cudaIpcMemHandle_t */
#define BB_TOKEN_SIZE 16
#define BB_NAME_MAX 127 /* bytes, without the terminating NUL */

enum {
	BB_OK = 0,
	BB_ERR_INVALID = -1,   /* bad argument */
	BB_ERR_NOT_FOUND = -2, /* no such buffer, name or token */
	BB_ERR_DENIED = -3,    /* share policy or socket permissions */
	BB_ERR_NO_MEMORY = -4, /* a quota, a limit or the device is full */
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

/* Share policies: who besides the buffer's owner (the uid and gid of the
 * connection that allocated it) may open it by id or name, retain or stat
 * it. root always may; so may a connection that holds the buffer already. */
enum {
	BB_SHARE_UID = 0, /* the owner's uid only (the default) */
	BB_SHARE_GID = 1, /* also any uid whose primary gid is the owner's gid */
	BB_SHARE_ANY = 2, /* any uid */
};

typedef struct bb_client bb_client; /* one connection; thread-safe */
typedef struct bb_buf bb_buf;       /* process-local handle, atomic local count */

/* A reference in transit from bb_take to bb_adopt: 128 random bits. */
typedef struct bb_token {
	unsigned char bytes[BB_TOKEN_SIZE];
} bb_token;

/* What bb_alloc and bb_import_fd make. */
typedef struct bb_alloc_opts {
	size_t size;      /* > 0 */
	bb_kind kind;     /* BB_HOST or BB_CUDA */
	int device;       /* CUDA ordinal as the daemon numbers devices; 0 for host */
	const char *name; /* NULL, or unique among live buffers */
	int share;        /* BB_SHARE_*: who may open it by id or name */
} bb_alloc_opts;

/* One buffer as the daemon sees it (bb_stat). */
typedef struct bb_info {
	uint64_t id;                /* the buffer's id, never reused */
	size_t size;                /* bytes */
	bb_kind kind;               /* BB_HOST or BB_CUDA */
	int device;                 /* CUDA ordinal as the daemon numbers devices; 0 for host */
	bb_state state;             /* BB_PENDING, BB_READY or BB_FAILED */
	uint64_t refs;              /* daemon side: sum of connection counts + live tokens */
	char name[BB_NAME_MAX + 1]; /* "" when unnamed */
	char error[256];            /* the message given to bb_set_error, "" otherwise */
} bb_info;

/* Where a CUDA buffer lives (bb_cuda_ipc_of). */
typedef struct bb_cuda_ipc {
	unsigned char handle[BB_IPC_HANDLE_SIZE]; /* the allocation holding the buffer */
	uint64_t offset;               /* buffer start inside that allocation, a multiple of 256 */
	size_t size;                   /* the buffer's bytes */
	unsigned char device_uuid[16]; /* the device's UUID (cuDeviceGetUuid) */
} bb_cuda_ipc;

/* How a CUDA buffer's memory is shared (bb_alloc_cuda, bb_cuda_handle_of).
 * LEGACY: a cuMemAlloc allocation shared through a CUDA IPC handle
 * (bb_cuda_ipc_of); the processes must share IPC and PID namespaces.
 * VMM: a cuMemCreate allocation exported as a POSIX file descriptor that
 * the daemon sends over its socket (bb_cuda_vmm_of); it crosses container
 * boundaries, needing nothing but the socket. bb_map maps both alike. */
typedef enum bb_cuda_handle {
	BB_CUDA_HANDLE_DEFAULT = 0, /* the daemon's default (bufbrokerd --cuda-handle) */
	BB_CUDA_HANDLE_AUTO = 1,    /* VMM where device, driver and daemon allow it, else LEGACY */
	BB_CUDA_HANDLE_LEGACY = 2,
	BB_CUDA_HANDLE_VMM = 3,
} bb_cuda_handle;

/* Where a VMM CUDA buffer lives (bb_cuda_vmm_of). */
typedef struct bb_cuda_vmm {
	int fd;                        /* the allocation's fd; the caller's to close */
	uint64_t allocation;           /* the allocation's identity, never reused by the daemon */
	size_t allocation_size;        /* bytes of the allocation: map it whole */
	uint64_t offset;               /* buffer start inside that allocation */
	size_t size;                   /* the buffer's bytes */
	unsigned char device_uuid[16]; /* the device's UUID (cuDeviceGetUuid) */
} bb_cuda_vmm;

/* Connect to the daemon. path NULL: $BUFBROKER_SOCKET, else the default
 * socket ($XDG_RUNTIME_DIR/bufbroker.sock when it exists and the caller is
 * not root, else /run/bufbroker/bufbroker.sock). Sends Hello and checks the
 * protocol version. No daemon listening there: BB_ERR_DISCONNECTED; the
 * socket's permissions refuse the caller: BB_ERR_DENIED; a daemon of
 * another protocol major version: BB_ERR_PROTOCOL; a daemon that takes no
 * new connection now (at its connection limit, out of file descriptors):
 * BB_ERR_DISCONNECTED, and bb_last_error() gives the daemon's reason. */
int bb_connect(const char *path, bb_client **out);
/* Releases everything held through c and frees its handles: none of them,
 * nor a pointer bb_map gave for one, may be used afterwards. NULL is
 * allowed. */
void bb_disconnect(bb_client *c);

/* Reconnecting across a daemon restart (0.2; the operations guide,
 * "Restarts and upgrades"). When the daemon keeps its state (its HelloReply named a
 * session), a client whose connection breaks reconnects on its own and
 * resumes its session: its counts, tokens, PENDING buffers it produces and
 * parked waits come back, every mapping stays valid, and a request that was
 * in flight is applied exactly once. Calls made meanwhile wait for it; when
 * no daemon resumes the session within timeout_ms they return
 * BB_ERR_DISCONNECTED, as they do without reconnecting. A daemon that keeps
 * no state is never reconnected to. Defaults: on (BUFBROKER_RECONNECT=0 in
 * the environment at bb_connect turns it off), timeout 10 000 ms, backoff
 * from 10 ms doubling to 500 ms. When the daemon refuses the session (it
 * started without its state, or its grace period for the session ended),
 * the connection is lost at once: BB_ERR_DISCONNECTED, and bb_last_error()
 * names the refusal. Requests reach the daemon in the order of their ids
 * (the wire protocol's "Session resume" rules), so a call may wait for
 * another thread's send. */
typedef struct bb_reconnect_opts {
	int enabled;             /* 0: a broken connection stays broken */
	uint32_t timeout_ms;     /* give up after this long (0: the default) */
	uint32_t backoff_ms;     /* first wait between attempts (0: the default) */
	uint32_t max_backoff_ms; /* the wait doubles up to this (0: the default) */
	uint32_t reserved[4];    /* 0 */
} bb_reconnect_opts;
/* Set c's reconnect behaviour; opts NULL restores the defaults. Values out
 * of range (backoff_ms above max_backoff_ms, reserved not 0):
 * BB_ERR_INVALID. */
int bb_client_set_reconnect(bb_client *c, const bb_reconnect_opts *opts);
/* How many times c has resumed its session (0 if never), for logs and
 * tests. */
uint64_t bb_client_resumes(const bb_client *c);

/* A new buffer, PENDING, one local count held by the caller. Options out of
 * range (a name longer than BB_NAME_MAX bytes, or not UTF-8, or with
 * control characters, included): BB_ERR_INVALID; a
 * name that is taken: BB_ERR_EXISTS; a quota, a limit or a full device:
 * BB_ERR_NO_MEMORY; BB_CUDA where the daemon has no GPU:
 * BB_ERR_UNSUPPORTED. A CUDA buffer may share its allocation (a slab) with
 * other buffers of the same device, owner uid and share policy (one larger
 * than a slab gets its own), and a process that maps one can reach every
 * byte of that allocation: a token for it adopted by another uid exposes
 * the slab. Device memory meant for other uids is allocated with the share
 * policy that admits them. */
int bb_alloc(bb_client *c, const bb_alloc_opts *opts, bb_buf **out);
/* bb_alloc with the CUDA handle kind asked for (bb_alloc is this with
 * BB_CUDA_HANDLE_DEFAULT: the daemon's default, LEGACY unless its operator
 * set another). opts->kind BB_HOST takes BB_CUDA_HANDLE_DEFAULT only
 * (else BB_ERR_INVALID). A kind that cannot be had is never replaced by
 * the other: BB_ERR_UNSUPPORTED, and bb_last_error() says why (the driver
 * is too old, the device cannot export file descriptors, the operator
 * forbade that kind). AUTO is VMM where the daemon's device, driver and
 * configuration allow it, else LEGACY. VMM buffers share allocations as
 * LEGACY ones do (same device, owner uid and share policy), never with
 * LEGACY ones. VMM from a daemon older than protocol 1.2 (which would
 * ignore the kind): BB_ERR_UNSUPPORTED, not sent; a handle out of range:
 * BB_ERR_INVALID. */
int bb_alloc_cuda(bb_client *c, const bb_alloc_opts *opts, bb_cuda_handle handle, bb_buf **out);
/* One more reference to an existing buffer (coalesced per connection: an id
 * this connection already holds returns the same handle, one more count).
 * No such buffer (or name): BB_ERR_NOT_FOUND; its share policy does not
 * admit the caller: BB_ERR_DENIED. A name is non-empty, UTF-8 and at most
 * BB_NAME_MAX bytes. */
int bb_open(bb_client *c, uint64_t id, bb_buf **out);
int bb_open_name(bb_client *c, const char *name, bb_buf **out);

/* Hand memory you own to the broker: fd is a memfd made with
 * MFD_ALLOW_SEALING, at least opts->size bytes, kind BB_HOST, opened
 * read-write, with no write seal. The daemon keeps its own duplicate and
 * seals the file with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL (an fd it
 * cannot seal is refused with BB_ERR_INVALID); you may close yours. The new
 * buffer is PENDING with one local count. The owner's uid is charged
 * opts->size bytes, so a file more than one page larger than that is
 * refused (BB_ERR_INVALID): make the memfd the buffer's size. The seals
 * and the size are checked again once the daemon's seals are on: do not
 * resize or seal the file while the call runs. */
int bb_import_fd(bb_client *c, int fd, const bb_alloc_opts *opts, bb_buf **out);

/* Local copies: no round trip except the last unref. NULL is allowed.
 * bb_ref adds a local count and returns b. bb_unref gives one up; the last
 * one unmaps the buffer (its bb_map pointer is no longer valid), frees the
 * handle and sends the daemon a Release without waiting for the answer. */
bb_buf *bb_ref(bb_buf *b);
void bb_unref(bb_buf *b);

/* Surrender one local count into a token that any process may adopt once.
 * With other local counts left the token holds a new daemon reference; on
 * the last count the connection's reference moves into it (net zero). A
 * mapped CUDA buffer's last count is the exception: the token gets its own
 * reference, this process closes its mapping, and only then releases its
 * reference, so the adopter can never free memory this process still has
 * open (refs is one higher for that moment only). Either way the caller
 * has given up one count (on the last, b is gone); on failure it keeps it.
 * A token nobody adopts expires after the daemon's token TTL (60 s by
 * default) and releases its reference. Whoever holds a token's bytes may
 * adopt it, whatever the share policy: keep tokens out of logs. */
int bb_take(bb_buf *b, bb_token *out);
/* Receive the reference a token holds (coalesced like bb_open). A token
 * already adopted, or expired: BB_ERR_NOT_FOUND. */
int bb_adopt(bb_client *c, const bb_token *t, bb_buf **out);
/* 32 lowercase hex digits and back, to carry a token through text channels.
 * bb_token_format writes the digits and a NUL ("" when t is NULL);
 * bb_token_parse takes exactly 32 hex digits of either case, and anything
 * else is BB_ERR_INVALID. */
void bb_token_format(const bb_token *t, char out[2 * BB_TOKEN_SIZE + 1]);
int bb_token_parse(const char *text, bb_token *out);

/* Async state. A buffer is made PENDING and moves once, to READY
 * (bb_set_ready) or FAILED (bb_set_error, whose message is kept, up to 255
 * bytes cut at a UTF-8 character boundary, as bb_info.error; NULL is "").
 * Either call on a buffer that is not PENDING: BB_ERR_STATE. Readiness is
 * host-side: a producer of a CUDA buffer synchronizes its stream work
 * before bb_set_ready. A buffer still PENDING when the connection that made
 * it closes becomes FAILED ("producer disconnected").
 * wait: answers with the state once it is not PENDING. timeout_ms < 0
 * waits forever, 0 polls; a buffer still PENDING when the timeout passes
 * gives BB_ERR_TIMEOUT. A FAILED buffer answers 0 with *state_out ==
 * BB_FAILED. state_out may be NULL. Other threads' calls on the same
 * client go on while one waits. */
int bb_set_ready(bb_buf *b);
int bb_set_error(bb_buf *b, const char *message);
int bb_wait(bb_buf *b, int timeout_ms, bb_state *state_out);

/* Host: a pointer into the shared mapping, readable and writable (from
 * 2 MiB, advised MADV_HUGEPAGE over its whole 2 MiB extents: huge pages
 * where the kernel's shmem THP mode allows them). A host buffer from
 * bb_alloc starts as zeros. A mapping (or fd) that outlives the buffer's
 * last count, kept by other means than this library, stays on the memfd,
 * and the daemon may make the next buffer of the same uid and size from it
 * (unless run with --host-pool-memfds 0): it would then read and write
 * that buffer. CUDA buffers start with whatever the memory held (an
 * earlier buffer's bytes of the same uid and policy). CUDA: a device pointer
 * valid in this process's primary context of the matching device. Valid
 * until the handle's last local count goes. The device is matched by UUID,
 * not ordinal, so CUDA_VISIBLE_DEVICES may differ between the daemon and
 * this process; no visible device with that UUID: BB_ERR_NOT_FOUND. The
 * CUDA driver is loaded from $BUFBROKER_CUDA_LIBRARY (default
 * libcuda.so.1); without it: BB_ERR_UNSUPPORTED. Both handle kinds give a
 * device pointer alike. The first bb_map in this process of a buffer of a
 * given allocation opens (legacy) or imports and maps (VMM: the whole
 * allocation, read-write for the buffer's device) that allocation; a later
 * buffer of it, through any bb_client of this process connected to the same
 * daemon, costs no driver call; the last mapped handle of it to go closes
 * or unmaps it, before its Release is sent. A VMM buffer where the driver
 * lacks the VMM API: BB_ERR_UNSUPPORTED, saying which entry point is
 * missing. A legacy buffer's handle opens only in a process that shares
 * the daemon's PID and IPC namespaces: elsewhere (another container) its
 * bb_map fails (BB_ERR_SYSTEM, the message says so); VMM buffers need
 * nothing but the socket. */
int bb_map(bb_buf *b, void **ptr_out);
/* BB_CUDA only (a host buffer: BB_ERR_INVALID): the allocation's IPC handle,
 * the same 64 bytes as a runtime cudaIpcMemHandle_t, so that a framework
 * can open it itself and add offset. A process may open an allocation only
 * once (a second open of the same handle fails on real drivers) and bb_map
 * opens it for the library, so a process that uses bb_map on CUDA buffers
 * does not also open their handles itself. Close your own open before the
 * buffer's last count goes: the daemon may then free the memory. */
int bb_cuda_ipc_of(bb_buf *b, bb_cuda_ipc *out);
/* BB_CUDA_HANDLE_LEGACY or BB_CUDA_HANDLE_VMM for a CUDA buffer's handle,
 * BB_CUDA_HANDLE_DEFAULT (0) for a host buffer or NULL. A VMM buffer's
 * bb_cuda_ipc_of answers BB_ERR_UNSUPPORTED, a LEGACY one's bb_cuda_vmm_of
 * too. */
bb_cuda_handle bb_cuda_handle_of(const bb_buf *b);
/* VMM CUDA buffers only: a new fd (O_CLOEXEC, the caller closes it) for
 * the allocation holding the buffer, for a framework that imports it
 * itself: cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), then cuMemAddressReserve and
 * cuMemMap of allocation_size bytes, cuMemSetAccess, and the buffer is at
 * offset. Unlike a legacy handle the allocation may be imported any number
 * of times, also beside bb_map. The fd, an import or a mapping keeps the
 * allocation's device memory alive in this process even after the buffer's
 * last count goes, outside the daemon's accounting: close and release
 * them with the buffer. The connection keeps one fd per allocation while
 * it holds a buffer there; when it has none (it let the allocation's
 * last handle go while the grant of this one was on its way) this call
 * and bb_map ask the daemon for it again (one round trip). */
int bb_cuda_vmm_of(bb_buf *b, bb_cuda_vmm *out);

/* The handle's buffer: id, size in bytes, kind; 0 for NULL. */
uint64_t bb_id(const bb_buf *b);
size_t bb_size(const bb_buf *b);
bb_kind bb_buf_kind(const bb_buf *b);
/* Fresh from the daemon, for any buffer this connection holds or whose
 * share policy admits the caller (else BB_ERR_DENIED); a buffer that is
 * gone: BB_ERR_NOT_FOUND. */
int bb_stat(bb_client *c, uint64_t id, bb_info *out);

/* Raw daemon counts for callers that manage references themselves. Both wait
 * for the daemon's answer (only a handle's last bb_unref is sent without
 * waiting). count >= 1. They move this connection's count for id, the one
 * its handle for id stands on: release only what you retained. bb_retain
 * needs the share policy to admit the caller (else BB_ERR_DENIED). */
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
