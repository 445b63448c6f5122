/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The transport: client connections on SOCK_SEQPACKET sockets. A
 * connection reads datagrams (batched with recvmmsg when the peer
 * pipelines), has the codec decode each and the request layer act on it,
 * and sends what the request layer answers, queueing it while the socket
 * is full. It owns backpressure (a queue over its limit, or too many
 * parked requests, pauses reading), the fds that travel with datagrams,
 * and the closing of a connection (at the end of a loop turn, after
 * draining what the peer had queued and sending what was queued for it).
 * A peer that shuts down only its sending side gets every answer to what
 * it sent before the connection closes.
 *
 * Connections are kept in a conn_env, which the server owns and drives:
 * it closes doomed connections after each loop turn (the reap_soon
 * callback says one is waiting) and runs the send-timeout sweep (the
 * output_queued callback says it may be due). Loop thread only.
 */
#ifndef BB_CONN_H
#define BB_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "codec.h"
#include "handler.h"
#include "metrics.h"

typedef struct conn conn;

/* Most datagrams one connection's readiness reads at once. */
#define CONN_READ_BATCH 8
/* After a batched read that found one datagram, the reads of that
 * connection before it batches again: one recvmsg each, cheaper than a
 * recvmmsg that finds one (a lone client's every request). */
#define CONN_SINGLE_READS 16

/* The transport's limits; the server sets them, and may change all but
 * max_datagram while running. */
typedef struct conn_limits {
	uint32_t max_datagram; /* bytes; larger requests are protocol errors */
	uint64_t queue_bytes;  /* queued output per connection before it is dropped */
	uint64_t
		send_timeout_ms; /* queued output that cannot move this long drops the connection */
	uint32_t conn_inflight;  /* parked requests per connection before reading pauses */
} conn_limits;

/* What every connection shares. The caller fills the fields marked "in"
 * and calls conn_env_init; the rest is the transport's. */
typedef struct conn_env {
	uv_loop_t *loop;                  /* in: the loop everything runs on */
	conn_limits limits;               /* in */
	codec *codec;                     /* in: decodes requests, encodes answers */
	handler *h;                       /* in: the request layer */
	metrics_counters *counters;       /* in: latency, the transport's refusals */
	void (*reap_soon)(void *ctx);     /* in: a connection was doomed */
	void (*output_queued)(void *ctx); /* in: a connection's output started queueing */
	void *ctx;                        /* in: passed to the callbacks */
	unsigned char *rbuf;              /* receive buffers: CONN_READ_BATCH of max_datagram + 1 */
	uint64_t next_serial;             /* connection numbers */
	conn *conns;                      /* open connections, oldest first */
	conn *doomed;                     /* connections to close */
} conn_env;

/* Allocate env's buffers. 0, or -1 out of memory. */
int conn_env_init(conn_env *env);
/* Free them (every connection closed and its handle closed). */
void conn_env_free(conn_env *env);

/* Serve fd, a connected socket (non-blocking, close-on-exec), for a peer
 * with these credentials; denied: no allow-list admits it (the request
 * layer refuses its first request). The connection is the transport's
 * from here, even when the request layer refuses it at once. NULL out of
 * memory (fd is still the caller's). */
conn *conn_start(conn_env *env, int fd, uint32_t uid, uint32_t gid, uint32_t pid, bool denied);
/* Answer fd, an accepted socket that gets no connection (the daemon has no
 * file descriptor to serve it with), Response{id: 0, code, msg}, and close
 * it at once, after reading and dropping what its peer had sent (so that
 * the peer reads the answer, not a reset). */
void conn_refuse(conn_env *env, int fd, int code, const char *msg);
/* Close c at the end of this loop turn (env's reap_soon): nothing it sends
 * from now on is read, nothing more is answered; what is already queued
 * for it is still sent (conn_close). why is copied, for the log. */
void conn_doom(conn *c, const char *why);
/* The next doomed connection, taken off env's doomed list; NULL when none. */
conn *conn_next_doomed(conn_env *env);
/* Close doomed c: drop what its peer sent and was not read, send what is
 * queued for the peer (c lingers, reading nothing, until the socket took
 * it, the peer is gone, or it stalls for send_timeout_ms; a timed-out
 * linger comes back through env's doomed list), then release everything
 * c held (its session) and close the socket. Its memory goes when its
 * handle's close callback runs. */
void conn_close(conn *c);
/* Limits changed: let each connection paused by the old in-flight limit
 * read again. */
void conn_update_all(conn_env *env);
/* Doom each connection whose queued output has not moved for
 * send_timeout_ms at loop time now (its client stopped reading), and end
 * such a linger (conn_close) without sending the rest. Returns
 * the ms until the next could be due, UINT64_MAX when none has output
 * queued. */
uint64_t conn_sweep_stalled(conn_env *env, uint64_t now);
/* The daemon is stopping: silence every connection (parked requests
 * dropped unanswered, nothing more read) before any closes, then close
 * them all at once, sending nothing they had queued. */
void conn_close_all(conn_env *env);
/* The serial number of env's oldest open connection; 0 when none is. */
uint64_t conn_first_serial(const conn_env *env);
/* Up to max sockets of connections that read now (not paused, not doomed)
 * into fds; returns how many there are in all (the fuzz target's settling). */
size_t conn_reading_fds(conn_env *env, int *fds, size_t max);

#endif /* BB_CONN_H */
