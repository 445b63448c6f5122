/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The request path: sending requests over the connection's socket,
 * receiving and matching responses to the calls waiting for them, and the
 * thread's last error.
 *
 * Receiving is leader/follower, without a reader thread of its own: a
 * thread waiting for its response becomes the reader when no other thread
 * is reading, receives one datagram with the state lock dropped, hands it
 * to the call it answers and wakes everyone; the others sleep on the
 * condition variable. A round trip thus costs one context switch, and a
 * thread parked in bb_wait(-1) keeps delivering other threads' responses.
 */
#include "rpc.h"
#include "flatwire.h"
#include "msgio.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <utlist.h>

#include "wire.h"

/* Requests that pack into this many bytes are sent from the stack. */
#define SEND_STACK_BYTES 512

/* One request waiting for its response; lives on the caller's stack. */
struct call {
	uint64_t id;               /* the request id the response echoes */
	int done;                  /* resp (or flat) and fd are set */
	int want_flat;             /* a plain RefsReply may be answered in flat */
	int flat_ok;               /* flat holds the answer; resp is NULL */
	flat_refs_resp flat;       /* a successful RefsReply, read by flatwire */
	Bufbroker__Response *resp; /* the response, owned by the caller */
	int fd;                    /* the fd attached to it, or -1 */
	struct call *prev, *next;  /* bb_client.calls */
	/* What sends it again after a resume (the caller's, alive until the
	 * call completes): */
	Bufbroker__Request *req; /* a protobuf request, or NULL: */
	flat_refs_req fr;        /* ... a flat Retain or Release */
	int req_fd;              /* attached to it, or -1 (borrowed) */
	int64_t wait_end;        /* a Wait's end (monotonic ms); -1: none */
	uint64_t sent_gen;       /* the connection generation it went out on; 0: not yet */
	uint64_t seq;            /* its place in the send order (bb_client.send_seq) */
};

/* A fire-and-forget Release the daemon may not have read yet: sent again
 * after a resume until an answer to a request sent after it on the same
 * connection proves it was read (docs/RESTART.md, "Exactly once"). */
struct unproven {
	uint64_t id;  /* its request id */
	uint64_t buf; /* Release.id */
	uint64_t gen; /* the connection it went out on (0: not sent) */
	uint64_t seq; /* its place in that connection's send order */
};

static _Thread_local char last_error[512];

/* ---- errors ---------------------------------------------------------------- */

int bbc_fail(int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	return code;
}

BB_EXPORT const char *bb_last_error(void)
{
	return last_error;
}

/* ---- connection state ------------------------------------------------------ */

/* Mark the connection gone (the first reason sticks), stop the socket so a
 * blocked reader or sender returns, and wake every waiting call. mu held. */
__attribute__((format(printf, 2, 3))) static void client_die_locked(bb_client *c, const char *fmt,
								    ...)
{
	if (!c->dead) {
		va_list ap;

		c->dead = 1;
		va_start(ap, fmt);
		vsnprintf(c->dead_msg, sizeof(c->dead_msg), fmt, ap);
		va_end(ap);
		shutdown(c->sock, SHUT_RDWR);
	}
	pthread_cond_broadcast(&c->cv);
}

/* The error every call on a dead client answers. dead_msg is fixed once
 * dead is set, so reading it after seeing dead (under mu) is safe. */
int bbc_fail_dead(const bb_client *c)
{
	return bbc_fail(BB_ERR_DISCONNECTED, "%s", c->dead_msg);
}

/* Whether a broken connection is resumed rather than lost: the daemon
 * keeps its state (it named a session) and reconnecting is on. mu held. */
static int resumable(const bb_client *c)
{
	return c->session != 0 && c->ropts.enabled;
}

/* The connection of generation gen broke (why: for the messages): resume
 * it, or, when it cannot be, die. A later generation or a connection
 * already broken or dead is left alone. mu held. */
__attribute__((format(printf, 3, 4))) static void client_broke_locked(bb_client *c, uint64_t gen,
								      const char *fmt, ...)
{
	va_list ap;

	if (c->dead || c->broken || gen != c->gen)
		return;
	va_start(ap, fmt);
	vsnprintf(c->broken_msg, sizeof(c->broken_msg), fmt, ap);
	va_end(ap);
	if (!resumable(c)) {
		client_die_locked(c, "%s", c->broken_msg);
		return;
	}
	c->broken = 1;
	shutdown(c->sock, SHUT_RDWR); /* a reader on it returns */
	pthread_cond_broadcast(&c->cv);
}

static int64_t mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void client_read_locked(bb_client *c);
static void client_resume_locked(bb_client *c);

/* Send one packed request on sock, fd attached unless fd < 0: 0, or the
 * negative errno. */
static ssize_t send_raw(int sock, const uint8_t *buf, size_t len, int fd)
{
	ssize_t n = msgio_send(sock, buf, len, fd);
	return n >= 0 ? 0 : n;
}

static int conn_lost_errno(ssize_t n)
{
	return n == -EPIPE || n == -ECONNRESET || n == -ENOTCONN;
}

/* Pack k's request (protobuf or flat) into stackbuf (cap bytes) or a new
 * buffer (*heap, to free). 0 and *out, *len; or an error code. */
static int call_pack(bb_client *c, const struct call *k, uint8_t *stackbuf, size_t cap,
		     uint8_t **out, size_t *len, uint8_t **heap)
{
	*heap = NULL;
	if (!k->req) {
		*out = stackbuf;
		*len = flat_refs_req_encode(&k->fr, stackbuf);
		return 0;
	}
	*len = bufbroker__request__get_packed_size(k->req);
	if (*len > c->max_send)
		return bbc_fail(BB_ERR_INVALID,
				"request of %zu bytes exceeds the daemon's limit of %zu bytes",
				*len, c->max_send);
	*out = stackbuf;
	if (*len > cap) {
		*out = *heap = malloc(*len);
		if (!*out)
			return bbc_fail(BB_ERR_NO_MEMORY, "out of memory packing a request");
	}
	bufbroker__request__pack(k->req, *out);
	return 0;
}

/* Give k its request id, list it and send it, in one step under send_mu so
 * that ids reach the wire in ascending order (PROTOCOL.md, "Session
 * resume"). A connection being resumed sends it once it is back. 0 when
 * sent or left to the resume; otherwise an error, and k is not listed. */
static int call_start(bb_client *c, struct call *k)
{
	uint8_t stackbuf[SEND_STACK_BYTES], *buf, *heap;
	size_t len;
	ssize_t n;
	uint64_t gen;
	int rc;
	char eb[128];

	pthread_mutex_lock(&c->send_mu);
	pthread_mutex_lock(&c->mu);
	if (c->dead) {
		rc = bbc_fail_dead(c);
		pthread_mutex_unlock(&c->mu);
		pthread_mutex_unlock(&c->send_mu);
		return rc;
	}
	k->id = c->next_id++;
	if (k->req)
		k->req->id = k->id;
	else
		k->fr.id = k->id;
	rc = call_pack(c, k, stackbuf, sizeof(stackbuf), &buf, &len, &heap);
	if (rc) {
		pthread_mutex_unlock(&c->mu);
		pthread_mutex_unlock(&c->send_mu);
		return rc;
	}
	DL_APPEND(c->calls, k);
	if (c->broken) {
		/* The resume sends it. */
		pthread_mutex_unlock(&c->mu);
		pthread_mutex_unlock(&c->send_mu);
		free(heap);
		return 0;
	}
	gen = c->gen;
	k->sent_gen = gen;
	k->seq = ++c->send_seq;
	pthread_mutex_unlock(&c->mu);
	n = send_raw(c->sock, buf, len, k->req_fd);
	pthread_mutex_unlock(&c->send_mu);
	free(heap);
	if (n == 0)
		return 0;

	pthread_mutex_lock(&c->mu);
	if (conn_lost_errno(n)) {
		if (resumable(c)) {
			/* Sent again once the session is resumed (unless a
			 * resume since did it already). */
			if (k->sent_gen == gen)
				k->sent_gen = 0;
			client_broke_locked(c, gen, "lost the connection to bufbrokerd: %s",
					    bbc_errstr((int)-n, eb, sizeof(eb)));
			pthread_mutex_unlock(&c->mu);
			return 0;
		}
		/* The daemon closed the connection, and may have said why
		 * first (an answer with id 0, as when it refuses a connection
		 * before its Hello): what it sent is queued to us up to the
		 * end of the stream, so read it, answering the calls it
		 * answers, and die with its reason. */
		while (!c->dead && n != -ENOTCONN) {
			if (!c->reading)
				client_read_locked(c);
			else
				pthread_cond_wait(&c->cv, &c->mu);
		}
		client_die_locked(c, "lost the connection to bufbrokerd: %s",
				  bbc_errstr((int)-n, eb, sizeof(eb)));
		rc = bbc_fail_dead(c);
	} else {
		rc = bbc_fail(BB_ERR_SYSTEM, "sending a request to bufbrokerd failed: %s",
			      bbc_errstr((int)-n, eb, sizeof(eb)));
	}
	DL_DELETE(c->calls, k);
	pthread_mutex_unlock(&c->mu);
	return rc;
}

/* The answer to k came on connection gen: every fire-and-forget Release
 * sent before k on that connection was read. mu held. */
static void releases_proven_locked(bb_client *c, const struct call *k, uint64_t gen)
{
	size_t i, w = 0;

	if (!c->nrels || k->sent_gen != gen)
		return;
	for (i = 0; i < c->nrels; i++)
		if (c->rels[i].gen != gen || c->rels[i].seq > k->seq)
			c->rels[w++] = c->rels[i];
	c->nrels = w;
}

/* Become the reader for one datagram: drop mu while receiving, then hand
 * the response to the call it answers (or drop it) and wake everyone.
 * Called and returns with mu held; c->reading must be 0. */
static void client_read_locked(bb_client *c)
{
	Bufbroker__Response *r = NULL;
	int fd = -1, truncated = 0, delivered = 0, flat_ok = 0;
	int sock = c->sock;
	uint64_t gen = c->gen;
	flat_refs_resp flat;
	struct call *k;
	ssize_t n;
	char eb[128];

	c->reading = 1;
	pthread_mutex_unlock(&c->mu);
	n = msgio_recv(sock, c->rbuf, c->rcap, &fd, &truncated);
	if (n > 0 && !truncated) {
		flat_ok = fd < 0 && flat_refs_resp_decode(c->rbuf, (size_t)n, &flat);
		if (!flat_ok)
			r = bufbroker__response__unpack(NULL, (size_t)n, c->rbuf);
	}
	pthread_mutex_lock(&c->mu);
	c->reading = 0;

	if (flat_ok) {
		/* A plain RefsReply: a call that asked for flat answers takes it
		 * as it is; any other (bbc_call's callers) gets it unpacked. */
		DL_FOREACH (c->calls, k) {
			if (k->id == flat.id && !k->done && k->want_flat) {
				k->flat = flat;
				k->flat_ok = 1;
				k->done = 1;
				releases_proven_locked(c, k, gen);
				pthread_cond_broadcast(&c->cv);
				return;
			}
		}
		r = bufbroker__response__unpack(NULL, (size_t)n, c->rbuf);
	}

	if (n == 0) {
		client_broke_locked(c, gen, "bufbrokerd closed the connection");
	} else if (n < 0) {
		client_broke_locked(c, gen, "lost the connection to bufbrokerd: %s",
				    bbc_errstr((int)-n, eb, sizeof(eb)));
	} else if (truncated) {
		client_die_locked(c,
				  "bufbrokerd sent a datagram over %zu bytes or with several "
				  "file descriptors; connection closed",
				  c->rcap);
	} else if (!r) {
		client_die_locked(c, "bufbrokerd sent a response that could not be decoded; "
				     "connection closed");
	} else if (r->id == 0) {
		/* The daemon could not attribute our request and is closing us. */
		const char *m =
			r->status && r->status->message[0] ? r->status->message : "no reason given";
		client_die_locked(c, "bufbrokerd ended the connection: %s", m);
	} else {
		DL_FOREACH (c->calls, k) {
			if (k->id == r->id && !k->done) {
				k->resp = r;
				k->fd = fd;
				k->done = 1;
				delivered = 1;
				releases_proven_locked(c, k, gen);
				break;
			}
		}
	}
	if (!delivered) {
		/* Unsolicited, for a call that gave up, or fatal: nobody takes it. */
		if (r)
			bufbroker__response__free_unpacked(r, NULL);
		if (fd >= 0)
			close(fd);
	}
	pthread_cond_broadcast(&c->cv);
}

/* ---- session resume ---------------------------------------------------------- */

void bbc_reconnect_defaults(bb_reconnect_opts *o)
{
	if (!o->timeout_ms)
		o->timeout_ms = 10000;
	if (!o->backoff_ms)
		o->backoff_ms = 10;
	if (!o->max_backoff_ms)
		o->max_backoff_ms = 500;
}

/* Connect a new socket to c->path and resume c's session on it (Hello
 * with resume_session and resume_secret, request id hello_id), waiting for
 * the answer until end (monotonic ms). 0 and *sock_out, *floor, *mask; 1:
 * try again later (no daemon, or it went away); else the daemon's refusal
 * (BB_ERR_NOT_FOUND, BB_ERR_DENIED, ...), final. why says what happened.
 * No lock held (send_mu is, by the caller). */
static int resume_try(bb_client *c, uint64_t hello_id, int64_t end, int *sock_out, uint64_t *floor,
		      uint64_t *mask, char *why, size_t wlen)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r = NULL;
	uint8_t out[256], *in = NULL;
	size_t len;
	ssize_t n;
	int sock, fd = -1, truncated = 0, rc = 1;
	char eb[128];

	memcpy(sa.sun_path, c->path, sizeof(c->path));
	sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (sock < 0) {
		snprintf(why, wlen, "socket: %s", bbc_errstr(errno, eb, sizeof(eb)));
		return 1;
	}
	if (connect(sock, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		snprintf(why, wlen, "cannot connect to %s: %s", c->path,
			 bbc_errstr(errno, eb, sizeof(eb)));
		goto out;
	}
	h.version_major = BB_PROTO_MAJOR;
	h.version_minor = BB_PROTO_MINOR;
	h.client_name = program_invocation_short_name ? program_invocation_short_name : "";
	h.resume_session = c->session;
	h.resume_secret.data = c->secret;
	h.resume_secret.len = sizeof(c->secret);
	req.id = hello_id;
	req.op_case = BUFBROKER__REQUEST__OP_HELLO;
	req.hello = &h;
	len = bufbroker__request__pack(&req, out);
	if ((n = send_raw(sock, out, len, -1)) != 0) {
		snprintf(why, wlen, "sending Hello: %s", bbc_errstr((int)-n, eb, sizeof(eb)));
		goto out;
	}
	in = malloc(BB_MAX_DATAGRAM);
	if (!in) {
		snprintf(why, wlen, "out of memory");
		goto out;
	}
	/* The daemon may still be starting: its answer comes when it serves. */
	for (;;) {
		struct pollfd p = {.fd = sock, .events = POLLIN};
		int64_t left = end - mono_ms();
		if (left <= 0) {
			snprintf(why, wlen, "no answer to the resuming Hello");
			goto out;
		}
		if (poll(&p, 1, (int)left) > 0)
			break;
	}
	n = msgio_recv(sock, in, BB_MAX_DATAGRAM, &fd, &truncated);
	if (fd >= 0)
		close(fd);
	if (n <= 0) {
		snprintf(why, wlen, "the daemon closed the connection before answering Hello");
		goto out;
	}
	r = truncated ? NULL : bufbroker__response__unpack(NULL, (size_t)n, in);
	if (!r || r->id != hello_id || !r->status) {
		snprintf(why, wlen, "bufbrokerd sent an answer to Hello that could not be used");
		rc = BB_ERR_PROTOCOL;
	} else if (r->status->code) {
		snprintf(why, wlen, "%s", r->status->message);
		rc = r->status->code < 0 ? r->status->code : BB_ERR_PROTOCOL;
	} else if (r->result_case != BUFBROKER__RESPONSE__RESULT_HELLO || !r->hello->resumed ||
		   r->hello->session_id != c->session) {
		snprintf(why, wlen, "bufbrokerd did not resume session %llu",
			 (unsigned long long)c->session);
		rc = BB_ERR_PROTOCOL;
	} else {
		*floor = r->hello->last_applied;
		*mask = r->hello->applied_mask;
		*sock_out = sock;
		sock = -1;
		rc = 0;
	}
out:
	if (r)
		bufbroker__response__free_unpacked(r, NULL);
	free(in);
	if (sock >= 0)
		close(sock);
	return rc;
}

/* Whether request id is applied by the floor and mask a resume reported. */
static int applied(uint64_t id, uint64_t floor, uint64_t mask)
{
	return id <= floor || (id - floor - 1 < 64 && (mask >> (id - floor - 1) & 1));
}

/* Send again, in ascending id order, every fire-and-forget Release not
 * proven read and not applied, and every call not answered, on the new
 * connection (generation c->gen). A Wait goes with what is left of its
 * timeout. mu and send_mu held. */
static void resend_locked(bb_client *c, uint64_t floor, uint64_t mask)
{
	uint8_t stackbuf[SEND_STACK_BYTES], *buf, *heap;
	size_t len, ri = 0, w = 0;
	struct call *k = c->calls;
	char eb[128];

	for (;;) {
		struct unproven *u = ri < c->nrels ? &c->rels[ri] : NULL;
		while (k && k->done)
			k = k->next;
		if (!u && !k)
			break;
		ssize_t n;
		if (u && (!k || u->id < k->id)) {
			ri++;
			if (applied(u->id, floor, mask))
				continue; /* read and applied: proven */
			flat_refs_req rel = {.id = u->id,
					     .no_reply = true,
					     .op = FLAT_OP_RELEASE,
					     .buf_id = u->buf,
					     .count = 1};
			u->gen = c->gen;
			u->seq = ++c->send_seq;
			c->rels[w++] = *u;
			n = send_raw(c->sock, stackbuf, flat_refs_req_encode(&rel, stackbuf), -1);
		} else {
			if (k->req && k->req->op_case == BUFBROKER__REQUEST__OP_WAIT &&
			    k->wait_end >= 0) {
				int64_t left = k->wait_end - mono_ms();
				k->req->wait->timeout_ms = left > 0 ? (int32_t)left : 0;
			}
			if (call_pack(c, k, stackbuf, sizeof(stackbuf), &buf, &len, &heap)) {
				k = k->next;
				continue; /* it packed before: cannot happen */
			}
			k->sent_gen = c->gen;
			k->seq = ++c->send_seq;
			n = send_raw(c->sock, buf, len, k->req_fd);
			free(heap);
			k = k->next;
		}
		if (n != 0 && conn_lost_errno(n)) {
			/* Gone again: what is left goes with the next resume. */
			while (ri < c->nrels)
				c->rels[w++] = c->rels[ri++];
			client_broke_locked(c, c->gen, "lost the connection to bufbrokerd: %s",
					    bbc_errstr((int)-n, eb, sizeof(eb)));
			break;
		}
	}
	c->nrels = w;
}

/* The connection broke: reconnect with backoff until the reconnect
 * timeout, resume the session and send again what has no answer; or die
 * with why. Called and returns with mu held; c->broken set, c->fixing not. */
static void client_resume_locked(bb_client *c)
{
	bb_reconnect_opts o = c->ropts;
	int64_t start = mono_ms(), end = start + o.timeout_ms;
	uint32_t backoff = o.backoff_ms;
	uint64_t floor = 0, mask = 0, hello_id;
	int sock = -1, rc;
	char why[256] = "";

	c->fixing = 1;
	hello_id = c->next_id++;
	pthread_mutex_unlock(&c->mu);
	pthread_mutex_lock(&c->send_mu);
	for (;;) {
		rc = resume_try(c, hello_id, end, &sock, &floor, &mask, why, sizeof(why));
		if (rc <= 0)
			break;
		int64_t now = mono_ms();
		if (now >= end)
			break;
		struct timespec ts = {.tv_sec = 0, .tv_nsec = 0};
		int64_t nap = backoff < end - now ? backoff : end - now;
		ts.tv_sec = nap / 1000;
		ts.tv_nsec = (nap % 1000) * 1000000;
		nanosleep(&ts, NULL);
		backoff = backoff * 2 < o.max_backoff_ms ? backoff * 2 : o.max_backoff_ms;
	}
	pthread_mutex_lock(&c->mu);
	while (c->reading) /* the old socket is shut down: its reader returns */
		pthread_cond_wait(&c->cv, &c->mu);
	if (rc == 0) {
		int old = c->sock;
		c->sock = sock;
		close(old);
		c->gen++;
		c->resumes++;
		c->broken = 0;
		resend_locked(c, floor, mask);
	} else if (rc > 0) {
		client_die_locked(c, "%s; no bufbrokerd resumed the session within %u ms (%s)",
				  c->broken_msg, o.timeout_ms, why);
	} else {
		client_die_locked(c, "%s; resuming session %llu failed: %s (%s)", c->broken_msg,
				  (unsigned long long)c->session, bb_strerror(rc), why);
	}
	c->fixing = 0;
	pthread_mutex_unlock(&c->send_mu);
	pthread_cond_broadcast(&c->cv);
}

/* Wait until k is answered or the connection dies, resuming a broken one,
 * then unlist k. rc: call_start's. */
static int call_complete(bb_client *c, struct call *k, int rc)
{
	if (rc)
		return rc; /* not listed */
	pthread_mutex_lock(&c->mu);
	while (!k->done && !c->dead) {
		if (c->broken && !c->fixing)
			client_resume_locked(c);
		else if (!c->broken && !c->reading)
			client_read_locked(c);
		else
			pthread_cond_wait(&c->cv, &c->mu);
	}
	if (!k->done)
		rc = bbc_fail_dead(c);
	DL_DELETE(c->calls, k);
	pthread_mutex_unlock(&c->mu);
	if (rc && k->resp) {
		bufbroker__response__free_unpacked(k->resp, NULL);
		k->resp = NULL;
	}
	if (rc && k->fd >= 0) {
		close(k->fd);
		k->fd = -1;
	}
	return rc;
}

int bbc_call(bb_client *c, Bufbroker__Request *req, int fd, Bufbroker__Response **resp, int *fd_in)
{
	struct call k = {.fd = -1, .req = req, .req_fd = fd, .wait_end = -1};
	int rc;

	if (fd_in)
		*fd_in = -1;
	if (resp)
		*resp = NULL;
	if (!c || !req || !resp)
		return bbc_fail(BB_ERR_INVALID,
				"bbc_call: client, request and response are required");
	if (req->no_reply)
		return bbc_fail(BB_ERR_INVALID, "bbc_call: a no_reply request gets no response");
	if (req->op_case == BUFBROKER__REQUEST__OP_WAIT && req->wait && req->wait->timeout_ms >= 0)
		k.wait_end = mono_ms() + req->wait->timeout_ms;

	rc = call_complete(c, &k, call_start(c, &k));
	if (rc)
		return rc;

	*resp = k.resp;
	if (fd_in)
		*fd_in = k.fd;
	else if (k.fd >= 0)
		close(k.fd);
	return 0;
}

void bbc_response_free(Bufbroker__Response *r)
{
	if (r)
		bufbroker__response__free_unpacked(r, NULL);
}

static int response_check(Bufbroker__Response *r, int rfd, Bufbroker__Response__ResultCase want,
			  Bufbroker__Response **resp, int *fd_in);

/* Round trip req. 0: *resp is a successful response carrying `want` (any
 * result when NOT_SET) and *fd_in its fd or -1 (closed when fd_in is NULL).
 * Otherwise the daemon's code with its message as the last error. */
int bbc_rpc(bb_client *c, Bufbroker__Request *req, int fd, Bufbroker__Response__ResultCase want,
	    Bufbroker__Response **resp, int *fd_in)
{
	Bufbroker__Response *r;
	int rfd = -1, rc;

	rc = bbc_call(c, req, fd, &r, fd_in ? &rfd : NULL);
	if (rc)
		return rc;
	return response_check(r, rfd, want, resp, fd_in);
}

/* bbc_rpc's verdict on the response r (with its fd rfd): r and rfd are
 * the caller's on success, freed and closed otherwise. */
static int response_check(Bufbroker__Response *r, int rfd, Bufbroker__Response__ResultCase want,
			  Bufbroker__Response **resp, int *fd_in)
{
	int rc = 0;
	const Bufbroker__Status *st = r->status;
	if (!st)
		rc = bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent a response without a status");
	else if (st->code > 0)
		rc = bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent an invalid status code %d",
			      (int)st->code);
	else if (st->code < 0)
		rc = bbc_fail(st->code, "%s", st->message[0] ? st->message : bb_strerror(st->code));
	else if (want != BUFBROKER__RESPONSE__RESULT__NOT_SET && r->result_case != want)
		rc = bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent an unexpected kind of response");
	if (rc) {
		bbc_response_free(r);
		if (rfd >= 0)
			close(rfd);
		return rc;
	}
	*resp = r;
	if (fd_in)
		*fd_in = rfd;
	else if (rfd >= 0)
		close(rfd);
	return 0;
}

/* Fire-and-forget Release{id, 1}: the last count of a handle, or the extra
 * count a coalesced open brought. Nothing to do on a dead connection: the
 * daemon released everything when it went. */
void bbc_release_one(bb_client *c, uint64_t id)
{
	flat_refs_req rel = {.no_reply = true, .op = FLAT_OP_RELEASE, .buf_id = id, .count = 1};
	uint8_t buf[FLAT_MAX_BYTES];
	char saved[sizeof(last_error)], eb[128];
	uint64_t gen;
	ssize_t n;

	pthread_mutex_lock(&c->send_mu);
	pthread_mutex_lock(&c->mu);
	if (c->dead) {
		pthread_mutex_unlock(&c->mu);
		pthread_mutex_unlock(&c->send_mu);
		return;
	}
	rel.id = c->next_id++;
	gen = c->gen;
	if (resumable(c)) {
		/* Kept until proven read: a resume sends it again. */
		if (c->nrels == c->caprels) {
			size_t cap = c->caprels ? 2 * c->caprels : 16;
			struct unproven *p = realloc(c->rels, cap * sizeof(*p));
			if (p) {
				c->rels = p;
				c->caprels = cap;
			}
		}
		if (c->nrels < c->caprels)
			c->rels[c->nrels++] = (struct unproven){
				.id = rel.id,
				.buf = id,
				.gen = c->broken ? 0 : gen,
				.seq = c->broken ? 0 : c->send_seq + 1,
			};
	}
	if (c->broken) {
		pthread_mutex_unlock(&c->mu);
		pthread_mutex_unlock(&c->send_mu);
		return; /* the resume sends it */
	}
	c->send_seq++;
	pthread_mutex_unlock(&c->mu);
	n = send_raw(c->sock, buf, flat_refs_req_encode(&rel, buf), -1);
	pthread_mutex_unlock(&c->send_mu);
	if (n == 0 || !conn_lost_errno(n))
		return; /* the callers report nothing */
	/* Keep the thread's last error: the callers report nothing. */
	memcpy(saved, last_error, sizeof(saved));
	pthread_mutex_lock(&c->mu);
	client_broke_locked(c, gen, "lost the connection to bufbrokerd: %s",
			    bbc_errstr((int)-n, eb, sizeof(eb)));
	pthread_mutex_unlock(&c->mu);
	memcpy(last_error, saved, sizeof(saved));
}

/* Retain and Release are what busy callers send most: packed and read by
 * flatwire, not protobuf-c (an error answer still comes unpacked). */
int bbc_refs_rpc(bb_client *c, uint64_t id, uint32_t count, int release)
{
	struct call k = {.fd = -1, .want_flat = 1, .req_fd = -1, .wait_end = -1};
	const char *what = release ? "bb_release" : "bb_retain";
	int rc;

	if (!c)
		return bbc_fail(BB_ERR_INVALID, "%s: client is required", what);
	if (count == 0)
		return bbc_fail(BB_ERR_INVALID, "%s: count must be at least 1", what);
	k.fr = (flat_refs_req){
		.op = release ? FLAT_OP_RELEASE : FLAT_OP_RETAIN, .buf_id = id, .count = count};
	rc = call_complete(c, &k, call_start(c, &k));
	if (rc || k.flat_ok)
		return rc;
	rc = response_check(k.resp, k.fd, BUFBROKER__RESPONSE__RESULT_REFS, &k.resp, NULL);
	if (rc == 0)
		bbc_response_free(k.resp);
	return rc;
}
