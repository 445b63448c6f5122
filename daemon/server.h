/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's top: the listening socket and what it accepts, the layers
 * it assembles (transport, codec, request layer, parking, broker,
 * backends), backend jobs on libuv's thread pool, the reaper that closes
 * doomed connections after each loop turn, SIGTERM/SIGINT, the metrics
 * endpoint, and clean shutdown. Everything here runs on one libuv loop
 * thread.
 */
#ifndef BB_SERVER_H
#define BB_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "backend_cuda.h"
#include "broker.h"
#include "conn.h"

typedef struct server server;

/* Most connections accepted per readiness of the listening socket. */
#define SERVER_ACCEPT_BATCH 64
/* After accept fails (out of file descriptors), accepting pauses this
 * long; the failure is logged once, then at most once per
 * SERVER_ACCEPT_LOG_MS while it lasts. */
#define SERVER_ACCEPT_PAUSE_MS 100
#define SERVER_ACCEPT_LOG_MS 10000

/* The open-file budget (docs/OPERATIONS.md, "Open files"). Each
 * connection may hold its socket and the duplicated fds of the responses
 * queued for it (at most one read's worth). */
#define SERVER_FDS_PER_CONN (1 + CONN_READ_BATCH)
/* Beyond what it has open once set up, the daemon keeps this many fds for
 * itself: peers refused at their Hello waiting for it (64), connections
 * accepted in one turn over the connection limit (SERVER_ACCEPT_BATCH),
 * the metrics endpoint (its socket, 32 scrapers and its own), fds received
 * with one read, the reserve fd, and files the CUDA driver opens later. */
#define SERVER_FDS_SPARE 256
/* An open-file limit above this counts as this. */
#define SERVER_NOFILE_MAX (1ULL << 30)

/* Most entries of one allow-list (--allow-uids, --allow-gids). */
#define SERVER_ALLOW_MAX 256

/* An allow-list of uids or gids. No pointers: configurations copy it. */
typedef struct server_allow {
	uint32_t n;                     /* entries; 0: the list is not set */
	uint32_t ids[SERVER_ALLOW_MAX]; /* uids or gids, in the order given */
} server_allow;

typedef struct server_config {
	const char *socket_path;  /* where to listen (ignored with LISTEN_FDS) */
	mode_t socket_mode;       /* chmod of the socket file */
	const char *socket_group; /* chgrp of the socket file, or NULL */
	server_allow allow_uids;  /* peers admitted by uid (with allow_gids: either) */
	server_allow allow_gids;  /* peers admitted by primary or supplementary gid */
	uint32_t max_datagram;    /* bytes; larger requests are protocol errors */
	uint64_t queue_bytes;     /* queued output per connection before it is dropped */
	uint64_t
		send_timeout_ms; /* queued output that cannot move this long drops the connection */
	uint32_t conn_inflight;  /* parked requests per connection before reading it pauses */
	uint32_t host_pool;      /* freed host memfds kept for reuse; 0: none */
	broker_limits limits;    /* handed to the broker; host_buffers 0: what the
				  * open-file limit leaves (server_start) */
	bool no_cuda;            /* --no-cuda: serve host buffers only */
	bool journal;            /* [restart] journal, --restart: keep the state
				  * journal (docs/RESTART.md; experimental) */
	bool restart_strict;     /* [restart] strict: a refused kept state fails the start */
	uint64_t restart_grace_ms; /* [restart] grace: restored sessions' grace period */
	backend_cuda_config cuda;  /* slab, cache and device limits */
} server_config;

/* Listen (or take the socket systemd passed), set up the layers, timers
 * and signals. *out is set whenever a server was allocated, even when
 * starting failed: server_shutdown it either way. 0, or -1 with the reason
 * logged.
 *
 * The soft open-file limit (RLIMIT_NOFILE) is raised to the hard one, and
 * the fds that cfg's limits may make the daemon hold must fit in it: those
 * open once it is set up, SERVER_FDS_SPARE, the host memfd pool
 * (BACKEND_HOST_POOL_DEFAULT), the VMM CUDA allocations when CUDA is
 * served (cuda.vmm_allocations), SERVER_FDS_PER_CONN per connection
 * (limits.connections) and one per host buffer (limits.host_buffers; 0
 * takes what is left). Otherwise it does not start, and the log says
 * which limit to lower. A new connection when the daemon is out of fds
 * anyway is answered Response{id: 0, BB_ERR_NO_MEMORY} and closed, and
 * accepting pauses (SERVER_ACCEPT_PAUSE_MS). */
int server_start(server **out, uv_loop_t *loop, const server_config *cfg);
/* Like server_start, but listen on nothing and leave the signals alone:
 * connections come only through server_add_conn (the fuzz target,
 * tests/fuzz/). 0, or -1 with the reason logged. */
int server_start_detached(server **out, uv_loop_t *loop, const server_config *cfg);
/* Serve the metrics endpoint on listen_addr (metrics.h). 0, or -1 with
 * the reason logged. */
int server_metrics_start(server *s, const char *listen_addr);
/* Serve fd, a connected SOCK_SEQPACKET socket (non-blocking,
 * close-on-exec), as a peer with these credentials: what accepting a
 * connection does. Over the connection limit the peer is answered
 * BB_ERR_NO_MEMORY and closed. 0 (fd is the server's), or -1 out of memory
 * (fd is still the caller's). */
int server_add_conn(server *s, int fd, uint32_t uid, uint32_t gid, uint32_t pid);
/* Stop the metrics endpoint, close every connection and handle; run the
 * loop until all are gone and free everything, s too. NULL: nothing. */
void server_shutdown(server *s);
/* Whether the limits of cfg fit in the daemon's open-file budget (as
 * server_start checks them): 0, or -1 with why (len bytes) naming the
 * limit to lower. */
int server_reload_check(const server *s, const server_config *cfg, char *why, size_t len);
/* Apply the settings of cfg that can change while running (SIGHUP): the
 * broker limits (they apply to later requests; a lower limit takes nothing
 * back; check them with server_reload_check first), queue_bytes,
 * send_timeout_ms, conn_inflight, the allow-lists (checked when a
 * connection is accepted: open connections stay), host_pool (a change
 * closes what the pool holds; it counts in the open-file budget) and the
 * CUDA handle policy (cuda.handle_default, cuda.handle_forbid: later
 * allocs follow it). Every other field of cfg is ignored: the socket,
 * max_datagram and the other CUDA settings take effect only at the next
 * start. */
void server_reload(server *s, const server_config *cfg);
/* Whether the allow-lists of cfg admit a peer with these credentials: yes
 * when neither list is set, for uid 0 and the daemon's own uid, for a uid
 * on allow_uids, and for a gid (primary, or one of the ngroups
 * supplementary groups) on allow_gids. */
bool server_allows(const server_config *cfg, uint32_t uid, uint32_t gid, const uint32_t *groups,
		   size_t ngroups);

/* ---- for the fuzz target (tests/fuzz/) ------------------------------------ */

/* The broker and the host backend the server serves from. */
broker *server_broker(server *s);
backend *server_host(server *s);
/* Whether connections are open, and whether some wait to be closed. */
bool server_has_conns(const server *s);
bool server_has_doomed(const server *s);
/* The serial number of the oldest open connection (0: none). */
uint64_t server_first_conn(const server *s);
/* Up to max sockets of connections read now into fds; returns how many
 * there are in all. */
size_t server_reading_fds(server *s, int *fds, size_t max);
/* The invariants of the broker, and its totals against the backends and
 * the sessions (handler_check). Returns the problems, described in report. */
int server_check(server *s, char *report, size_t cap);

#endif /* BB_SERVER_H */
