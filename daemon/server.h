/*
 * The daemon's I/O side: the listening socket, the connections it
 * accepted, and the timers that drive the broker (token expiry, parked
 * waits). Everything here runs on one libuv loop thread.
 */
#ifndef BB_SERVER_H
#define BB_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "arena.h"
#include "backend_cuda.h"
#include "broker.h"
#include "bufbroker.pb-c.h"
#include "metrics.h"

typedef struct server server;
typedef struct conn conn;
typedef struct parked_wait parked_wait;
typedef struct parked_alloc parked_alloc;

/* Most entries of one allow-list (--allow-uids, --allow-gids). */
#define SERVER_ALLOW_MAX 256
/* Connections of peers that no allow-list admits, waiting for the Hello
 * that gets their refusal; beyond this many, the next is refused at once. */
#define SERVER_DENIED_PENDING_MAX 64

/* An allow-list of uids or gids. No pointers: configurations copy it. */
typedef struct server_allow {
	uint32_t n;                     /* entries; 0: the list is not set */
	uint32_t ids[SERVER_ALLOW_MAX]; /* uids or gids, in the order given */
} server_allow;

typedef struct server_config {
	const char *socket_path; /* where to listen (ignored with LISTEN_FDS) */
	mode_t socket_mode;      /* chmod of the socket file */
	const char *socket_group; /* chgrp of the socket file, or NULL */
	server_allow allow_uids; /* peers admitted by uid (with allow_gids: either) */
	server_allow allow_gids; /* peers admitted by primary or supplementary gid */
	uint32_t max_datagram;   /* bytes; larger requests are protocol errors */
	uint64_t queue_bytes;    /* queued output per connection before it is dropped */
	uint64_t send_timeout_ms; /* queued output that cannot move this long drops the connection */
	uint32_t conn_inflight;  /* parked requests per connection before reading it pauses */
	broker_limits limits;    /* handed to the broker */
	bool no_cuda;            /* --no-cuda: serve host buffers only */
	backend_cuda_config cuda; /* slab, cache and device limits */
} server_config;

/* One queued response that did not fit in the socket buffer. */
typedef struct outmsg {
	struct outmsg *next; /* FIFO */
	int fd;              /* our duplicate of the fd to attach, or -1 */
	size_t len;          /* bytes in data */
	unsigned char data[]; /* the packed Response */
} outmsg;

/* One client connection. */
struct conn {
	uv_poll_t poll;         /* readable (and writable while output is queued) */
	int fd;                 /* the accepted socket */
	uint64_t serial;        /* connection number, for logs */
	server *srv;            /* owner */
	broker_conn *bc;        /* the broker's view of this connection */
	uint32_t uid, gid, pid; /* SO_PEERCRED */
	char name[64];          /* Hello.client_name, for logs */
	bool hello;             /* Hello accepted */
	bool denied;            /* no allow-list admits the peer: its first request is refused */
	bool doomed;            /* will be closed at the end of this loop turn */
	bool closed;            /* uv_close called */
	char why[128];          /* why it is being closed, for the log */
	outmsg *out_head, *out_tail; /* queued responses */
	uint64_t out_bytes;     /* bytes in the queue */
	uint64_t out_moved_ms;  /* loop time the queue last started or moved (send timeout) */
	int events;             /* what poll watches now (UV_READABLE, ...) */
	parked_wait *waits;     /* parked Wait requests */
	uint32_t parked_allocs; /* its allocs waiting for device memory */
	uint32_t inflight;      /* requests read, not yet answered: parked waits and allocs */
	uint32_t single_reads;  /* reads left to make one datagram at a time (CONN_SINGLE_READS) */
	conn *prev, *next;      /* server's list */
	conn *doomed_next;      /* server's list of connections to close */
};

/* A parked Wait: answered by the broker's wake or by its timer. */
struct parked_wait {
	broker_waiter w;            /* linked into the broker while parked */
	uv_timer_t timer;           /* the timeout, when there is one */
	bool has_timer;             /* timer was initialised */
	conn *c;                    /* the waiting connection */
	uint64_t req_id;            /* the Wait request's id */
	parked_wait *prev, *next;   /* conn's list */
};

/* An Alloc the backend could not answer yet (BACKEND_GROW): retried, in
 * arrival order, after each backend job's done; dropped unanswered when its
 * connection closes. */
struct parked_alloc {
	conn *c;                    /* who asked */
	uint64_t req_id;            /* the Alloc request's id */
	bool quiet;                 /* Request.no_reply */
	uint64_t size;              /* Alloc fields, copied */
	int kind;
	int32_t device;
	uint32_t share;
	char *name;                 /* copy, or NULL */
	parked_alloc *prev, *next;  /* server's list, oldest first */
};

/* Unpacked requests live here (more spills to malloc): a few hundred bytes
 * each but for a long List cursor or a long name. */
#define SERVER_ARENA_BYTES (64 * 1024)

/* Most datagrams one connection's readiness reads at once. */
#define CONN_READ_BATCH 8
/* After a batched read that found one datagram, the reads of that
 * connection before it batches again: one recvmsg each, cheaper than a
 * recvmmsg that finds one (a lone client's every request). */
#define CONN_SINGLE_READS 16

struct server {
	uv_loop_t *loop;          /* the loop everything runs on */
	server_config cfg;        /* as given */
	broker *b;                /* the state machine */
	backend *host;            /* host backend */
	backend *cuda;            /* CUDA backend, or NULL (cuda_why says why) */
	char cuda_why[256];       /* why CUDA is not served; "" when it is */
	parked_alloc *allocs;     /* allocs waiting for a backend job */
	uint32_t jobs;            /* backend jobs in flight */
	bool retry_allocs;        /* a job ran inline: retry parked allocs after this turn */
	int listen_fd;            /* listening socket */
	bool own_socket_file;     /* we bound it (so we unlink it on exit) */
	uv_poll_t listen_poll;    /* accept readiness */
	uv_timer_t token_timer;   /* next token expiry */
	uv_timer_t send_timer;    /* while output is queued: the send-timeout sweep */
	uint32_t denied_pending;  /* denied connections not yet closed */
	uv_check_t reaper;        /* after each turn: close doomed conns, retry_allocs */
	uv_idle_t reap_soon;      /* active while conns are doomed: the turn does not block */
	uv_signal_t sigterm, sigint; /* clean shutdown */
	conn *conns;              /* open connections */
	conn *doomed;             /* connections to close */
	uint64_t next_serial;     /* connection numbers */
	uint64_t started_ms;      /* uv_now at start, for uptime */
	unsigned char *rbuf;      /* receive buffers: CONN_READ_BATCH of max_datagram + 1 bytes */
	unsigned char *sbuf;      /* send buffer, max_datagram bytes */
	unsigned char *abuf;      /* arena block, SERVER_ARENA_BYTES */
	bb_arena arena;           /* what protobuf-c unpacks requests into */
	bool stopping;            /* shutdown begun */
	metrics_counters counters; /* requests, latency, refusals (metrics.h) */
	metrics_endpoint *metrics; /* the HTTP endpoint, or NULL */
};

/* Listen (or take the socket systemd passed), set up timers and signals.
 * 0, or -1 with the reason logged. */
int server_start(server *s, uv_loop_t *loop, const server_config *cfg);
/* Like server_start, but listen on nothing and leave the signals alone:
 * connections come only through server_add_conn (the fuzz target,
 * tests/fuzz/). 0, or -1 with the reason logged. */
int server_start_detached(server *s, uv_loop_t *loop, const server_config *cfg);
/* Serve fd, a connected SOCK_SEQPACKET socket (non-blocking,
 * close-on-exec), as a peer with these credentials: what accepting a
 * connection does. Over the connection limit the peer is answered
 * BB_ERR_NO_MEMORY and closed. 0 (fd is the server's), or -1 out of memory
 * (fd is still the caller's). */
int server_add_conn(server *s, int fd, uint32_t uid, uint32_t gid, uint32_t pid);
/* Close every connection and handle; run the loop until all are gone and
 * free everything. */
void server_shutdown(server *s);
/* Apply the settings of cfg that can change while running (SIGHUP): the
 * broker limits (they apply to later requests; a lower limit takes nothing
 * back), queue_bytes, send_timeout_ms, conn_inflight and the allow-lists
 * (checked when a connection is accepted: open connections stay). Every
 * other field of cfg is ignored: the socket, max_datagram and CUDA
 * settings take effect only at the next start. */
void server_reload(server *s, const server_config *cfg);
/* Whether the allow-lists of cfg admit a peer with these credentials: yes
 * when neither list is set, for uid 0 and the daemon's own uid, for a uid
 * on allow_uids, and for a gid (primary, or one of the ngroups
 * supplementary groups) on allow_gids. */
bool server_allows(const server_config *cfg, uint32_t uid, uint32_t gid, const uint32_t *groups,
		   size_t ngroups);
/* A connection was doomed: the reaper closes it this loop turn, even when
 * no I/O would wake the loop (a doom from a timer callback). */
void server_reap_soon(server *s);
/* c's output queue just started: make sure the send-timeout sweep runs. */
void server_output_queued(server *s);

/* Send r (with fd attached unless fd < 0; the fd is borrowed) to c. A full
 * socket queues it; a queue over the limit dooms the connection. */
void conn_send(conn *c, const Bufbroker__Response *r, int fd);
/* Send a response already packed (len > 0 bytes, at most max_datagram),
 * as conn_send does. */
void conn_send_packed(conn *c, const unsigned char *data, size_t len, int fd);
/* Reply with just a status. */
void conn_send_status(conn *c, uint64_t req_id, int code, const char *msg);
/* Close c at the end of this loop turn (safe inside broker callbacks). */
void conn_doom(conn *c, const char *why);
/* Watch c for what it can do now: its queued output drains first (reading
 * pauses meanwhile: backpressure); else it is read unless it has
 * conn_inflight requests parked (reading pauses until one is answered).
 * Call after c->inflight changes. */
void conn_update(conn *c);

/* The request layer (handler.c): act on one decoded request. fd is an fd
 * that came with it or -1; the handler closes it. */
void handler_request(conn *c, const Bufbroker__Request *req, int fd);
/* The fast path for the commonest requests, before any protobuf-c: the
 * op (Request.op_case) when the len bytes at data were a Retain or Release
 * that c may send now (greeted, admitted, no fd) and have been handled; 0
 * when the caller must decode them with protobuf-c and call
 * handler_request. */
int handler_request_flat(conn *c, const unsigned char *data, size_t len, int fd);
/* Cancel and free c's parked waits and parked allocs, unanswered (the
 * connection is closing). */
void handler_drop_waits(conn *c);
/* The sentence that refuses a peer no allow-list admits, into buf. */
void handler_denied_message(const conn *c, char *buf, size_t len);
/* Retry every parked alloc once, oldest first (a backend job is done);
 * those that must wait again stay parked, in order. */
void handler_retry_allocs(server *s);
/* "OK", "NOT_FOUND", ...: a status code's name, as logs and metrics write
 * it ("UNKNOWN" for a code this daemon does not know). */
const char *handler_status_name(int code);
/* After a Take: make sure the token timer will fire. */
void server_tokens_changed(server *s);

#endif /* BB_SERVER_H */
