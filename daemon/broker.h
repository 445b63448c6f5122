/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The broker: buffers, per-connection reference tables, tokens, async
 * states and limits, driven by plain function calls. No sockets, no libuv,
 * no CUDA here: the I/O layers call in, and every rule is unit-tested
 * without them.
 *
 * Rules (DESIGN.md, "The broker's rules"):
 * - refs(buffer) = sum of connection counts + live tokens; at 0 the buffer
 *   is freed at once (its backend memory returned, its name free again).
 * - Alloc/import gives the caller's connection one reference, state PENDING.
 * - SetReady/SetError move PENDING to READY/FAILED exactly once; allowed to
 *   the producing connection (even after it took its last reference into a
 *   token) and to any holder. Waiters wake on the change.
 * - A producing connection that closes while its buffer is PENDING makes it
 *   FAILED ("producer disconnected").
 * - Closing a connection releases all its counts and drops its waiters;
 *   tokens it made stay until adopted or expired (TTL), then release.
 * - Take moves one reference into a single-use 128-bit token; Adopt moves it
 *   to the adopter. Neither changes refs (Take with retain adds one).
 * - Open, retain, stat and wait need the share policy to admit the caller
 *   (or the caller to hold the buffer); a token admits anyone; uid 0 is
 *   admitted by every policy. Take and release need the caller to hold it.
 * - Limits: bytes and buffers per uid, host buffers in all (each holds a
 *   memfd, a file descriptor of the daemon's), connections, tokens per
 *   connection and per uid (tokens outlive their connection), parked waits
 *   per connection.
 *
 * Every function that can fail returns 0 or a BB_ERR_* code and, on failure,
 * writes a sentence into *err.
 */
#ifndef BB_BROKER_H
#define BB_BROKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "bufbroker/bufbroker.h"
#include "kinds.h"

#define BROKER_ERR_LEN 256
#define BROKER_KINDS (BB_KIND_COUNT + 1)             /* index by bb_kind; 0 unused */
#define BROKER_CUDA_HANDLES (BB_CUDA_HANDLE_VMM + 1) /* index by bb_cuda_handle */

struct journal;
struct journal_buffer;
struct broker_kept;
typedef struct broker broker;
typedef struct broker_conn broker_conn;
typedef struct broker_buf broker_buf;

typedef struct broker_error {
	char msg[BROKER_ERR_LEN];
} broker_error;

typedef struct broker_limits {
	uint64_t uid_bytes[BROKER_KINDS]; /* bytes one uid may hold, per kind */
	uint64_t uid_buffers;             /* live buffers one uid may own */
	uint64_t host_buffers;            /* live host buffers in all (a memfd each) */
	uint32_t connections;             /* open connections in all */
	uint32_t conn_tokens;             /* live tokens one connection made */
	uint64_t uid_tokens;              /* live tokens one uid made, closed connections' too */
	uint32_t conn_waits;              /* parked waits per connection */
	uint64_t token_ttl_ms;            /* an unadopted token releases after this */
} broker_limits;

typedef struct broker_config {
	broker_limits limits;
	/* Clock in milliseconds (monotonic). NULL: CLOCK_MONOTONIC. */
	uint64_t (*now_ms)(void *ctx);
	/* Fill n random bytes. NULL: getrandom(2). */
	void (*random)(void *ctx, unsigned char *buf, size_t n);
	void *ctx; /* passed to now_ms and random */
	/* The state journal (docs/RESTART.md), written by every call that
	 * changes state, one transaction per call; NULL: off (each mutation
	 * pays one predictable branch). Borrowed: it must outlive the broker. */
	struct journal *journal;
	/* The fd store (docs/RESTART.md): keep(keep_ctx, k, true) when a
	 * buffer's memory becomes live (alloc, import, restore; inside the
	 * call, before its commit, so before any Grant of it is sent), and
	 * keep(keep_ctx, k, false) when the buffer is freed (inside the call
	 * that frees it, before its commit: what must follow the commit is the
	 * callee's to defer). Not called for a buffer whose memory was lost at
	 * a restart. NULL: none. */
	void (*keep)(void *keep_ctx, const struct broker_kept *k, bool live);
	void *keep_ctx;
} broker_config;

/* What the fd store needs of one buffer (broker_config.keep). */
typedef struct broker_kept {
	uint64_t id;
	int kind;            /* bb_kind */
	int cuda_handle;     /* bb_cuda_handle; 0 host */
	int fd;              /* host: its memfd (borrowed); -1 otherwise */
	uint64_t allocation; /* VMM CUDA: the allocation whose fd it lives in; 0 otherwise */
} broker_kept;

/* A snapshot of one buffer, as Stat and List report it. */
typedef struct broker_info {
	uint64_t id;
	uint64_t size;
	bb_kind kind;
	int device;
	bb_state state;
	uint64_t refs;
	uint32_t tokens; /* live tokens */
	uint32_t held;   /* the asking connection's count (0 if none) */
	char name[BB_NAME_MAX + 1];
	char error[256];
	uint32_t owner_uid;
	uint32_t owner_gid;
	int share;
	uint64_t age_ms;
	int cuda_handle; /* BB_CUDA_HANDLE_LEGACY or _VMM for CUDA buffers; 0 for host */
} broker_info;

/* The broker's limits that refuse requests, for counting refusals. Named
 * (broker_limit_name) as the broker_limits fields are; the per-uid byte
 * limit has one name per kind: uid_bytes for host buffers (its name before
 * CUDA buffers had a limit of their own), uid_cuda_bytes for CUDA ones. */
typedef enum broker_limit {
	BROKER_LIMIT_CONNECTIONS,    /* broker_conn_open */
	BROKER_LIMIT_UID_BUFFERS,    /* broker_alloc */
	BROKER_LIMIT_UID_BYTES,      /* broker_alloc: host bytes, uid_bytes[BB_HOST] */
	BROKER_LIMIT_CONN_TOKENS,    /* broker_take */
	BROKER_LIMIT_CONN_WAITS,     /* broker_wait */
	BROKER_LIMIT_UID_TOKENS,     /* broker_take */
	BROKER_LIMIT_HOST_BUFFERS,   /* broker_alloc */
	BROKER_LIMIT_UID_CUDA_BYTES, /* broker_alloc: CUDA bytes, uid_bytes[BB_CUDA] */
	BROKER_LIMIT_COUNT
} broker_limit;

typedef struct broker_totals {
	uint64_t buffers[BROKER_KINDS];
	uint64_t bytes[BROKER_KINDS];
	uint32_t connections;
	uint64_t tokens;
	uint64_t waits;
	uint64_t refused[BROKER_LIMIT_COUNT]; /* requests each limit refused since broker_new */
	uint64_t cuda_buffers[BROKER_CUDA_HANDLES]; /* live CUDA buffers per handle kind */
	uint64_t cuda_bytes[BROKER_CUDA_HANDLES];   /* ... and their bytes */
} broker_totals;

/* What Alloc and ImportFd ask for. */
typedef struct broker_alloc_req {
	uint64_t size; /* > 0 */
	bb_kind kind;
	int device;
	const char *name;     /* NULL or "" = unnamed; at most BB_NAME_MAX bytes */
	int share;            /* BB_SHARE_* */
	int import_fd;        /* -1: allocate from the backend; else import this fd */
	int cuda_handle;      /* BB_CUDA_HANDLE_*: what CUDA handle kind is asked for;
			       * host buffers take DEFAULT only */
	bool *handle_refused; /* NULL, or set by broker_alloc: whether it failed
			       * BB_ERR_UNSUPPORTED because that kind cannot be
			       * had on this daemon (the backend said so) */
} broker_alloc_req;

/* A parked Wait. The caller owns the memory and embeds it in its own
 * struct; wake is called once, from inside a broker call, when the buffer
 * leaves PENDING (code 0, state and error set) or is freed (code
 * BB_ERR_NOT_FOUND). After wake the broker no longer references it. wake
 * must not call back into the broker. */
typedef struct broker_waiter broker_waiter;
struct broker_waiter {
	void (*wake)(broker_waiter *w, int code, bb_state state, const char *error);
	broker_conn *conn;            /* set by broker_wait */
	broker_buf *buf;              /* set by broker_wait; NULL once woken/cancelled */
	broker_waiter *prev, *next;   /* the buffer's waiter list */
	broker_waiter *cprev, *cnext; /* the connection's waiter list */
};

/* Defaults that suit a GPU node: per-uid host bytes are half of physical
 * memory, 65536 buffers per uid, 65536 host buffers in all, 1024
 * connections, 4096 tokens and 1024 waits per connection, 65536 tokens per
 * uid, 60 s token TTL. (The daemon sizes host_buffers to its open-file
 * limit instead: server.h.) */
void broker_limits_default(broker_limits *l);

broker *broker_new(const broker_config *cfg);
/* Frees every buffer (through the backends), token and connection. The
 * backends themselves stay the caller's. Closing producer connections can
 * wake other connections' waiters, so every parked waiter must still be
 * valid here (or cancelled before). */
void broker_free(broker *b);
/* The backend that serves kind (BB_HOST, BB_CUDA). NULL: that kind answers
 * BB_ERR_UNSUPPORTED with unsupported_why as the message. */
void broker_set_backend(broker *b, bb_kind kind, backend *be, const char *unsupported_why);
/* Limits may change while running; they apply to later requests. */
void broker_set_limits(broker *b, const broker_limits *l);
const broker_limits *broker_get_limits(const broker *b);

/* A new connection of a peer. NULL with err when the connection limit is
 * reached. */
broker_conn *broker_conn_open(broker *b, uint32_t uid, uint32_t gid, uint32_t pid,
			      broker_error *err);
/* Drops its waiters (without waking them), releases all its counts, fails
 * the PENDING buffers it produced (waking their waiters), detaches its
 * tokens (they live on) and frees conn. */
void broker_conn_close(broker *b, broker_conn *conn);
uint32_t broker_conn_uid(const broker_conn *conn);
/* The protocol minor version conn's Hello said (a new connection speaks
 * BB_PROTO_MINOR). Below 2, Open and Adopt of a VMM CUDA buffer are
 * BB_ERR_UNSUPPORTED (the client cannot map it), and nothing changes: no
 * count is taken, a token stays live. */
void broker_conn_set_minor(broker_conn *conn, uint32_t minor);
uint32_t broker_conn_pid(const broker_conn *conn);
/* Buffers and bytes the connection holds at least one count on. */
void broker_conn_holdings(const broker_conn *conn, uint64_t *buffers, uint64_t *bytes);

/* What the admin Clients request reports of one connection. */
typedef struct broker_conn_stats {
	uint64_t buffers; /* buffers it holds at least one count on */
	uint64_t bytes;   /* their total size */
	uint32_t tokens;  /* live tokens it made (not yet adopted or expired) */
	uint32_t waits;   /* its parked waits */
	uint64_t age_ms;  /* since broker_conn_open, on the broker's clock */
} broker_conn_stats;
void broker_conn_stats_get(broker *b, const broker_conn *conn, broker_conn_stats *out);

/* A new buffer; conn gets one count. *out is valid until the next broker
 * call. BACKEND_GROW (positive) when the backend must first do slow work it
 * has submitted: nothing changed, retry once a backend job is done. */
int broker_alloc(broker *b, broker_conn *conn, const broker_alloc_req *req, broker_buf **out,
		 broker_error *err);
/* One more count for conn on an existing buffer, by id or by name. */
int broker_open_id(broker *b, broker_conn *conn, uint64_t id, broker_buf **out, broker_error *err);
int broker_open_name(broker *b, broker_conn *conn, const char *name, broker_buf **out,
		     broker_error *err);
/* count more (or fewer) counts for conn. Release of more than conn holds is
 * BB_ERR_INVALID and changes nothing. *refs_out/held_out may be NULL. */
int broker_retain(broker *b, broker_conn *conn, uint64_t id, uint32_t count, uint64_t *refs_out,
		  uint32_t *held_out, broker_error *err);
int broker_release(broker *b, broker_conn *conn, uint64_t id, uint32_t count, uint64_t *refs_out,
		   uint32_t *held_out, broker_error *err);
/* A token for one reference: retain false moves one of conn's counts into
 * it, retain true adds a new reference. conn must hold the buffer. */
int broker_take(broker *b, broker_conn *conn, uint64_t id, bool retain,
		unsigned char token[BB_TOKEN_SIZE], broker_error *err);
/* Move the token's reference to conn; the token is gone afterwards. */
int broker_adopt(broker *b, broker_conn *conn, const unsigned char token[BB_TOKEN_SIZE],
		 broker_buf **out, broker_error *err);
int broker_set_ready(broker *b, broker_conn *conn, uint64_t id, broker_error *err);
int broker_set_error(broker *b, broker_conn *conn, uint64_t id, const char *message,
		     broker_error *err);
/* Park w on buffer id. Returns 1 when the buffer is not PENDING (nothing
 * parked; *state_out and error_out, 256 bytes, filled), 0 when parked, or an
 * error. */
int broker_wait(broker *b, broker_conn *conn, uint64_t id, broker_waiter *w, bb_state *state_out,
		char *error_out, broker_error *err);
/* Unpark a waiter that has not woken (timeout, connection closing). */
void broker_wait_cancel(broker *b, broker_waiter *w);

int broker_stat_id(broker *b, broker_conn *conn, uint64_t id, broker_info *out, broker_error *err);
int broker_stat_name(broker *b, broker_conn *conn, const char *name, broker_info *out,
		     broker_error *err);
/* Calls fn for each live buffer conn may see (root: all), in id order,
 * until fn returns non-zero. */
void broker_list(broker *b, broker_conn *conn, int (*fn)(const broker_info *info, void *arg),
		 void *arg);
void broker_totals_get(broker *b, broker_totals *out);
/* "connections", "uid_buffers", ...; NULL for a value out of range. */
const char *broker_limit_name(broker_limit limit);
/* Calls fn for each uid that owns live buffers (in no particular order)
 * with how many it owns and their bytes per kind (index by bb_kind). fn
 * must not call back into the broker. */
void broker_uid_usage(broker *b,
		      void (*fn)(uint32_t uid, uint64_t buffers, const uint64_t bytes[BROKER_KINDS],
				 void *arg),
		      void *arg);

/* Verify the broker's invariants: for every buffer, refs = sum of
 * connection counts + live tokens, and its token count matches the live
 * tokens; per-kind and per-uid totals match the buffers; parked-wait counts
 * match the waiters. Writes one line per problem into report (len bytes,
 * always NUL-terminated, "" when all hold) and returns how many there were. */
int broker_check(broker *b, char *report, size_t len);

/* Release tokens whose TTL passed. Returns ms until the next one expires,
 * or UINT64_MAX when no token is live. */
uint64_t broker_expire_tokens(broker *b);

/* What a client is granted with a buffer: the buffer as it sees it and
 * what maps the memory. */
typedef struct broker_granted {
	broker_info info;   /* the buffer, held as the grantee's connection holds it */
	backend_export ex;  /* what maps it (ex.fd borrowed: attach, don't close;
			    * -1 for a VMM buffer without allocation_fd) */
	bool allocation_fd; /* VMM: ex.fd is the allocation's fd, sent because the
			     * connection held no count on any buffer of that
			     * allocation before this grant */
	bool exposed;       /* it goes to another uid than the owner's and the
			    * backend was told: a host memfd is never reused for
			    * a later buffer */
} broker_granted;

/* The grant of buf, which alloc, open or adopt just gave conn a count on.
 * A VMM buffer's allocation fd is in it (allocation_fd) exactly when conn
 * held no count on any buffer of that allocation before this grant's.
 * A grant to a connection whose uid is not the owner's exposes the memory
 * (backend expose: a host memfd is then never pooled for reuse, since the
 * grantee may keep its fd). When the backend cannot export it, conn's new
 * count is released again (the caller never learns of it) and the error
 * returned. */
int broker_grant(broker *b, broker_conn *conn, broker_buf *buf, broker_granted *out,
		 broker_error *err);

/* A VMM CUDA buffer's allocation fd, for a connection that needs it again
 * (AllocationFd): out->fd (borrowed), allocation_size, device_uuid. 0, or
 * BB_ERR_NOT_FOUND when conn holds no count on a buffer of allocation. */
int broker_allocation_fd(broker *b, broker_conn *conn, uint64_t allocation, backend_export *out,
			 broker_error *err);
/* How many buffers of allocation (a VMM allocation) conn holds a count on:
 * the per-connection books that decide whether a grant carries the fd. */
uint32_t broker_conn_allocation_buffers(const broker_conn *conn, uint64_t allocation);

/* Accessors for a buffer returned by alloc/open/adopt. */
void broker_buf_info(broker *b, const broker_buf *buf, const broker_conn *conn, broker_info *out);
/* The export of buf's memory from its backend. */
int broker_buf_export(broker *b, const broker_buf *buf, backend_export *out, broker_error *err);

/* ---- the state journal (docs/RESTART.md) ---------------------------------- */

/* The id of the request conn is about to apply (the handler, before a
 * state-changing op): the call's transaction records it as applied together
 * with its effect. Memory only. */
void broker_conn_note_request(broker_conn *conn, uint64_t id);
/* Journal puts refused since broker_new (the journal could not grow): the
 * journal no longer matches the broker. 0 while it does. */
uint64_t broker_journal_errors(const broker *b);

/* The memory of a buffer being restored, from its record: 0 and *out, or
 * BROKER_RESTORE_LOST with err saying why (the memory was not kept: the
 * buffer is restored FAILED with that message, memoryless, its bytes not
 * counted against any limit; its references and tokens stay), or an error
 * (the restore fails with it). be is the broker's backend for the record's
 * kind. Records of buffers already lost at an earlier start are not asked
 * for (they stay lost). be is NULL when the daemon serves no such kind
 * now. */
#define BROKER_RESTORE_LOST 1
typedef int (*broker_restore_mem)(void *ctx, backend *be, const struct journal_buffer *rec,
				  backend_mem *out, char *err, size_t len);

/* Rebuild b (new: no connection, no buffer; its backends set) from the
 * state in journal file fd: journal_read, journal_check, then every
 * session as a connection, every buffer with the memory mem gives, holds
 * and tokens, the id counters; then broker_check. With b's own journal on,
 * the whole state is written to it in one transaction. 0, or
 * BB_ERR_INVALID / BB_ERR_PROTOCOL (not a journal, or a state that does not
 * hold together: b is left empty) or the error of journal_read or mem. */
int broker_restore(broker *b, int fd, broker_restore_mem mem, void *ctx, broker_error *err);

/* ---- sessions across a restart (docs/RESTART.md) -------------------------- */
/* Every connection is a session (id from broker_conn_open, never reused). A
 * session restored by broker_restore has no socket: it is *absent* until a
 * client resumes it (broker_session_resume) or its grace deadline passes
 * (broker_release_absent closes it as a disconnect: counts released,
 * PENDING buffers it produces FAILED, tokens it made live on). */

/* [helper A] conn's session id. */
uint64_t broker_conn_session(const broker_conn *conn);
/* [helper A] True for a restored session no connection has resumed. */
bool broker_conn_absent(const broker_conn *conn);
/* [helper A] Restored sessions not resumed yet. */
uint32_t broker_absent_sessions(const broker *b);
/* [helper A] Close every absent session whose grace deadline (broker clock,
 * ms; set by broker_restore to now + grace_ms, kept in the journal so that
 * a second crash does not extend it) is at or before now; returns how many.
 * broker_next_grace gives the earliest deadline still pending (0: none). */
uint32_t broker_release_absent(broker *b);
uint64_t broker_next_grace(const broker *b);
/* [helper A] The grace period given to sessions broker_restore brings back
 * (ms); set before broker_restore. Default 10 000. */
void broker_set_grace(broker *b, uint64_t grace_ms);
/* Buffers broker_restore rebuilt, and how many of them had lost their
 * memory (BROKER_RESTORE_LOST: FAILED). */
void broker_restored(const broker *b, uint64_t *buffers, uint64_t *lost);
/* Where the last broker_restore's time went (microseconds, monotonic
 * clock; for the restart log line): the journal read, its check, the
 * rebuild (the memory callback included), broker_check, the fresh
 * journal's write. */
typedef struct broker_restore_times {
	uint64_t read_us, check_us, rebuild_us, broker_check_us, journal_us;
} broker_restore_times;
void broker_restore_times_get(const broker *b, broker_restore_times *out);

/* [helper B] The 16-byte secret that resumes conn's session (random, made
 * by broker_conn_open, journaled with the session). */
void broker_conn_secret(const broker_conn *conn, unsigned char out[BB_TOKEN_SIZE]);
/* [helper B] Attach a client to absent session `session`: the secret must
 * match (constant-time compare) and uid be the session's. 0 and *out (the
 * restored connection, present from now on; the caller closes the empty
 * connection it opened at accept and uses *out), or BB_ERR_NOT_FOUND
 * (unknown or already released), BB_ERR_DENIED (secret or uid), BB_ERR_EXISTS
 * (not absent: a live connection has it). *floor and *mask: the applied
 * request ids (broker_conn_note_request's record). [helper B, refined:] a
 * live session asked for with a secret that is not its own is
 * BB_ERR_NOT_FOUND (a daemon started without its state numbers sessions
 * from 1 again: the id is another client's, the session asked for is not
 * here); EXISTS needs the secret. */
int broker_session_resume(broker *b, uint64_t session, const unsigned char *secret,
			  size_t secret_len, uint32_t uid, broker_conn **out, uint64_t *floor,
			  uint64_t *mask, broker_error *err);

/* [helper B] Whether b keeps its state for a restart (its journal is on):
 * then Hello names the session and its secret. */
bool broker_keeps_state(const broker *b);
/* [helper B] A request that changes nothing (Stat, Wait, ...) with this id
 * reached conn: it moves the applied ids' floor like an applied one (memory
 * only; journaled with the next change). */
void broker_conn_seen(broker_conn *conn, uint64_t id);

/* [helper B] Exactly once (docs/RESTART.md): the answer an already applied
 * request gets when a resumed client sends it again. */
typedef struct broker_applied {
	bool found;      /* its result is in the ring (result-bearing ops) */
	int status;      /* found: 0 or the error it was answered with */
	broker_buf *buf; /* found, status 0, a buffer result still held by conn */
	unsigned char token[BB_TOKEN_SIZE]; /* found, Take: the token */
} broker_applied;
/* True when conn's session was resumed and request id is applied already
 * (at or below the floor, or in the mask): the caller answers it from *out
 * and does not apply it again. False otherwise (always for a session never
 * resumed: a client that reuses ids is served as before). */
bool broker_conn_applied(broker *b, broker_conn *conn, uint64_t id, broker_applied *out);

#endif /* BB_BROKER_H */
