/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The connection (struct bb_client) and the request path over it, as the
 * library's other files use them: round trips, fire-and-forget releases and
 * the thread's last error. rpc.c holds them; connect.c makes and frees the
 * connection. Not installed.
 */
#ifndef BB_CLIENT_RPC_H
#define BB_CLIENT_RPC_H

#include "client_internal.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Marks the public bb_* definitions. The library builds with
 * -fvisibility=hidden, so everything not marked (bbc_* included) stays
 * inside libbufbroker.so: only bb_* is the shared library's ABI. */
#define BB_EXPORT __attribute__((visibility("default")))

struct call;
struct unproven;
struct bb_buf;
struct vmm_fd;
struct daemon_rec;

struct bb_client {
	int sock;                /* SOCK_SEQPACKET, blocking */
	pthread_mutex_t mu;      /* guards the fields below */
	pthread_cond_t cv;       /* a response was delivered, the reader left, or death */
	pthread_mutex_t send_mu; /* one sendmsg at a time; never taken under mu */
	uint64_t next_id;        /* next request id (non-zero) */
	struct call *calls;      /* requests waiting for a response */
	int reading;             /* a thread is receiving (the leader) */
	int dead;                /* the connection is gone; set once */
	char dead_msg[384];      /* why, for bb_last_error; fixed once dead */
	unsigned char *rbuf;     /* receive buffer, used by the reader only */
	size_t rcap;             /* its size */
	size_t max_send;         /* the daemon's datagram limit */
	struct bb_buf *bufs;     /* listed handles by id (uthash) */
	struct bb_buf *all;      /* every live handle, listed or not */
	uint32_t proto_minor;    /* the daemon's protocol minor version (HelloReply) */
	uint64_t daemon;         /* the daemon instance, process-wide (connect.c); never 0 */
	struct daemon_rec *drec; /* its record, or NULL (connect.c) */
	struct bb_client *dprev, *dnext; /* drec's connections (connect.c) */
	struct vmm_fd *vmm_fds;          /* VMM allocations' fds by allocation (vmm_fd.c, uthash) */

	/* Session resume across a daemon restart (docs/RESTART.md): */
	char path[108];   /* the socket it connected to */
	uint64_t session; /* HelloReply.session_id; 0: the daemon keeps no state */
	unsigned char secret[BB_TOKEN_SIZE]; /* HelloReply.session_secret */
	bb_reconnect_opts ropts;             /* in force (defaults filled in) */
	int env_enabled;                     /* BUFBROKER_RECONNECT at bb_connect: not "0" */
	int broken;                          /* the connection broke; a resume is due */
	int fixing;                          /* a thread is resuming (no one else reads) */
	char broken_msg[192];                /* why it broke */
	uint64_t gen;                        /* the connection's generation: +1 per resume */
	uint64_t resumes;                    /* sessions resumed */
	uint64_t send_seq;                   /* requests put on the wire (send_mu) */
	struct unproven *rels;               /* fire-and-forget Releases not proven read */
	size_t nrels, caprels;
};

/* A thread-safe strerror: the message for errno value err, in buf (len
 * bytes) or a static string. */
static inline const char *bbc_errstr(int err, char *buf, size_t len)
{
	return strerror_r(err, buf, len);
}

/* BB_ERR_DISCONNECTED with the reason c died as the last error. Call only
 * after seeing c->dead set (under c->mu). */
int bbc_fail_dead(const bb_client *c);

/* Round trip req (bbc_call) and judge the answer. 0: *resp is a successful
 * response carrying `want` (any result when NOT_SET), to free with
 * bbc_response_free, and *fd_in its fd or -1 (closed here when fd_in is
 * NULL). Otherwise the daemon's code with its message as the last error,
 * and nothing to free or close. */
int bbc_rpc(bb_client *c, Bufbroker__Request *req, int fd, Bufbroker__Response__ResultCase want,
	    Bufbroker__Response **resp, int *fd_in);

/* Fill in the defaults of o's zero fields (enabled is left as it is). */
void bbc_reconnect_defaults(bb_reconnect_opts *o);

/* Retain (release 0) or Release (release 1) count references to id and
 * wait for the daemon's answer: 0, or BB_ERR_* with the last error set.
 * The request goes packed by flatwire and a plain success comes back read
 * by it: this is the path busy callers take most. */
int bbc_refs_rpc(bb_client *c, uint64_t id, uint32_t count, int release);

/* Send Release{id, 1} without waiting for an answer (the last count of a
 * handle, or the extra count a coalesced grant brought). Does nothing on
 * a dead connection, reports nothing, and leaves the thread's last error
 * as it was. */
void bbc_release_one(bb_client *c, uint64_t id);

#endif /* BB_CLIENT_RPC_H */
