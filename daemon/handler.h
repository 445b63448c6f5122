/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The request layer: one session per client connection, and the turning
 * of each decoded Request into broker calls and one Response (or none, for
 * no_reply requests; or later, for a parked Wait or Alloc).
 *
 * It knows no socket and no byte of the wire: requests come in decoded
 * (codec.h), and answers go out through the small reply interface the
 * transport hands in with each session. Below it: parking (park.h), the
 * snapshot (status.h), the broker and its backends.
 *
 * Everything here runs on the loop thread.
 */
#ifndef BB_HANDLER_H
#define BB_HANDLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "bufbroker.pb-c.h"
#include "metrics.h"
#include "park.h"
#include "snapshot.h"

typedef struct handler handler;
typedef struct session session;

/* How a session answers: the transport's side of one connection. */
typedef struct handler_reply {
	/* Send r to the peer, with fd attached unless fd < 0 (borrowed: the
	 * transport duplicates what it must keep). */
	void (*send)(void *ctx, const Bufbroker__Response *r, int fd);
	/* Close the connection after what was sent so far; nothing it sends
	 * afterwards is acted on. why is copied, for the log. */
	void (*close_after)(void *ctx, const char *why);
	/* The session now has parked requests (waits and allocs waiting for
	 * their answer): the transport bounds them by pausing its reads. */
	void (*parked)(void *ctx, uint32_t parked);
	/* Whether the connection is closing: its answers go nowhere. */
	bool (*closing)(void *ctx);
	void *ctx; /* passed to each */
} handler_reply;

/* The planned upgrade as the Upgrade op uses it (upgrade.h): the server
 * hands it down when the state journal is on; without it Upgrade is
 * answered BB_ERR_UNSUPPORTED. */
typedef struct handler_upgrade {
	/* Whether binary (NULL or "": the daemon's own) can take over: 0, or a
	 * BB_ERR_* code with why (len bytes). Nothing has changed either way. */
	int (*prepare)(void *ctx, const char *binary, char *why, size_t len);
	/* The Upgrade of the prepared binary was answered: re-execute it once
	 * this loop turn ends. */
	void (*start)(void *ctx);
	void *ctx; /* passed to each */
} handler_upgrade;

/* The request layer for the buffers of src->b. src and counters must
 * outlive it; max_datagram bounds what one answer may hold. NULL out of
 * memory. */
handler *handler_new(uv_loop_t *loop, const snapshot_sources *src, park *park,
		     metrics_counters *counters, uint32_t max_datagram);
/* Serve Upgrade with u (copied); NULL: answer it BB_ERR_UNSUPPORTED. */
void handler_set_upgrade(handler *h, const handler_upgrade *u);
/* Free it, once every session is closed and the loop has closed its
 * handles (handler_stop first). */
void handler_free(handler *h);
/* The daemon is stopping: the token timer stops and is not started again. */
void handler_stop(handler *h);

/* A session for a new connection (serial numbers it in logs) of a peer
 * with these credentials. denied: no allow-list admits the peer; its first
 * request is answered BB_ERR_DENIED and the connection closed (at once when
 * too many such wait). A peer over the broker's connection limit is
 * answered at once and the connection closed. reply is copied. NULL out of
 * memory. */
session *handler_session_open(handler *h, uint64_t serial, uint32_t uid, uint32_t gid, uint32_t pid,
			      bool denied, const handler_reply *reply);
/* Act on one decoded request; fd came with it (-1: none) and is closed
 * here, or kept by the backend as a duplicate. invalid: NULL, or why the
 * request is refused with BB_ERR_INVALID (a string in it is not UTF-8),
 * once the session's rules (Hello first, ...) let it be answered. A request
 * with id 0 is refused with BB_ERR_PROTOCOL: that id answers no
 * particular request. */
void handler_request(session *s, const Bufbroker__Request *req, int fd, const char *invalid);
/* Drop s's parked waits and allocs unanswered (the daemon is stopping;
 * handler_session_close does it too). */
void handler_session_drop_parked(session *s);
/* The connection is closing (why: for the log): drop what is parked,
 * release everything the session held in the broker, and free s. */
void handler_session_close(session *s, const char *why);

/* Retry every parked alloc once, oldest first (a backend job is done). */
void handler_retry_allocs(handler *h);
/* The broker was rebuilt from a kept state (docs/RESTART.md): its restored
 * tokens expire at their own deadlines from now on. */
void handler_restored(handler *h);
/* The broker's invariants (broker_check) and the checks it cannot make
 * itself: its totals against each backend's books, its connections and
 * waits against the sessions'. One line per problem into report (cap
 * bytes, NUL-terminated); returns how many problems there were. */
int handler_check(handler *h, char *report, size_t cap);

#endif /* BB_HANDLER_H */
