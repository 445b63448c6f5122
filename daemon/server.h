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

#include "backend_cuda.h"
#include "broker.h"
#include "bufbroker.pb-c.h"
#include "metrics.h"

typedef struct server server;
typedef struct conn conn;
typedef struct parked_wait parked_wait;
typedef struct parked_alloc parked_alloc;

typedef struct server_config {
	const char *socket_path; /* where to listen (ignored with LISTEN_FDS) */
	mode_t socket_mode;      /* chmod of the socket file */
	const char *socket_group; /* chgrp of the socket file, or NULL */
	uint32_t max_datagram;   /* bytes; larger requests are protocol errors */
	uint64_t queue_bytes;    /* queued output per connection before it is dropped */
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
	bool doomed;            /* will be closed at the end of this loop turn */
	bool closed;            /* uv_close called */
	char why[128];          /* why it is being closed, for the log */
	outmsg *out_head, *out_tail; /* queued responses */
	uint64_t out_bytes;     /* bytes in the queue */
	parked_wait *waits;     /* parked Wait requests */
	uint32_t parked_allocs; /* its allocs waiting for device memory */
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
	uv_check_t reaper;        /* after each turn: close doomed conns, retry_allocs */
	uv_signal_t sigterm, sigint; /* clean shutdown */
	conn *conns;              /* open connections */
	conn *doomed;             /* connections to close */
	uint64_t next_serial;     /* connection numbers */
	uint64_t started_ms;      /* uv_now at start, for uptime */
	unsigned char *rbuf;      /* receive buffer, max_datagram + 1 bytes */
	unsigned char *sbuf;      /* send buffer, max_datagram bytes */
	bool stopping;            /* shutdown begun */
	metrics_counters counters; /* requests, latency, refusals (metrics.h) */
	metrics_endpoint *metrics; /* the HTTP endpoint, or NULL */
};

/* Listen (or take the socket systemd passed), set up timers and signals.
 * 0, or -1 with the reason logged. */
int server_start(server *s, uv_loop_t *loop, const server_config *cfg);
/* Close every connection and handle; run the loop until all are gone and
 * free everything. */
void server_shutdown(server *s);
/* Apply the settings of cfg that can change while running (SIGHUP): the
 * broker limits (they apply to later requests; a lower limit takes nothing
 * back) and queue_bytes. Every other field of cfg is ignored: the socket,
 * max_datagram and CUDA settings take effect only at the next start. */
void server_reload(server *s, const server_config *cfg);

/* Send r (with fd attached unless fd < 0; the fd is borrowed) to c. A full
 * socket queues it; a queue over the limit dooms the connection. */
void conn_send(conn *c, const Bufbroker__Response *r, int fd);
/* Reply with just a status. */
void conn_send_status(conn *c, uint64_t req_id, int code, const char *msg);
/* Close c at the end of this loop turn (safe inside broker callbacks). */
void conn_doom(conn *c, const char *why);

/* The request layer (handler.c): act on one decoded request. fd is an fd
 * that came with it or -1; the handler closes it. */
void handler_request(conn *c, const Bufbroker__Request *req, int fd);
/* Cancel and free c's parked waits and parked allocs, unanswered (the
 * connection is closing). */
void handler_drop_waits(conn *c);
/* Retry every parked alloc once, oldest first (a backend job is done);
 * those that must wait again stay parked, in order. */
void handler_retry_allocs(server *s);
/* "OK", "NOT_FOUND", ...: a status code's name, as logs and metrics write
 * it ("UNKNOWN" for a code this daemon does not know). */
const char *handler_status_name(int code);
/* After a Take: make sure the token timer will fire. */
void server_tokens_changed(server *s);

#endif /* BB_SERVER_H */
