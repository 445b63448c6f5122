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
#include <sys/socket.h>
#include <unistd.h>
#include <utlist.h>

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

static void client_read_locked(bb_client *c);

/* Send one packed request, fd attached unless fd < 0. No lock held. */
static int client_send_packed(bb_client *c, const uint8_t *buf, size_t len, int fd)
{
	ssize_t n;
	char eb[128];

	pthread_mutex_lock(&c->send_mu);
	n = msgio_send(c->sock, buf, len, fd);
	pthread_mutex_unlock(&c->send_mu);
	if (n >= 0)
		return 0;
	if (n == -EPIPE || n == -ECONNRESET || n == -ENOTCONN) {
		int rc;

		pthread_mutex_lock(&c->mu);
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
		pthread_mutex_unlock(&c->mu);
		return rc;
	}
	return bbc_fail(BB_ERR_SYSTEM, "sending a request to bufbrokerd failed: %s",
			bbc_errstr((int)-n, eb, sizeof(eb)));
}

/* Pack and send one request, fd attached unless fd < 0. No lock held. */
static int client_send(bb_client *c, const Bufbroker__Request *req, int fd)
{
	uint8_t stackbuf[SEND_STACK_BYTES];
	size_t len = bufbroker__request__get_packed_size(req);
	uint8_t *buf = stackbuf;
	int rc;

	if (len > c->max_send)
		return bbc_fail(BB_ERR_INVALID,
				"request of %zu bytes exceeds the daemon's limit of %zu bytes", len,
				c->max_send);
	if (len > sizeof(stackbuf)) {
		buf = malloc(len);
		if (!buf)
			return bbc_fail(BB_ERR_NO_MEMORY, "out of memory packing a request");
	}
	bufbroker__request__pack(req, buf);
	rc = client_send_packed(c, buf, len, fd);
	if (buf != stackbuf)
		free(buf);
	return rc;
}

/* Become the reader for one datagram: drop mu while receiving, then hand
 * the response to the call it answers (or drop it) and wake everyone.
 * Called and returns with mu held; c->reading must be 0. */
static void client_read_locked(bb_client *c)
{
	Bufbroker__Response *r = NULL;
	int fd = -1, truncated = 0, delivered = 0, flat_ok = 0;
	flat_refs_resp flat;
	struct call *k;
	ssize_t n;
	char eb[128];

	c->reading = 1;
	pthread_mutex_unlock(&c->mu);
	n = msgio_recv(c->sock, c->rbuf, c->rcap, &fd, &truncated);
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
				pthread_cond_broadcast(&c->cv);
				return;
			}
		}
		r = bufbroker__response__unpack(NULL, (size_t)n, c->rbuf);
	}

	if (n == 0) {
		client_die_locked(c, "bufbrokerd closed the connection");
	} else if (n < 0) {
		client_die_locked(c, "lost the connection to bufbrokerd: %s",
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

/* Give k its request id and list it, before the request is sent: the
 * response may be read by another thread before send returns. */
static int call_register(bb_client *c, struct call *k)
{
	int rc = 0;

	pthread_mutex_lock(&c->mu);
	if (c->dead)
		rc = bbc_fail_dead(c);
	else {
		k->id = c->next_id++;
		DL_APPEND(c->calls, k);
	}
	pthread_mutex_unlock(&c->mu);
	return rc;
}

/* After sending k's request (send_rc, 0 when sent): read until k is
 * answered or the connection dies, then unlist k. */
static int call_complete(bb_client *c, struct call *k, int send_rc)
{
	int rc = send_rc;

	pthread_mutex_lock(&c->mu);
	if (rc == 0) {
		while (!k->done && !c->dead) {
			if (!c->reading)
				client_read_locked(c);
			else
				pthread_cond_wait(&c->cv, &c->mu);
		}
		if (!k->done)
			rc = bbc_fail_dead(c);
	}
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
	struct call k = {.fd = -1};
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

	rc = call_register(c, &k);
	if (rc)
		return rc;
	req->id = k.id;
	rc = call_complete(c, &k, client_send(c, req, fd));
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
	char saved[sizeof(last_error)];

	pthread_mutex_lock(&c->mu);
	if (c->dead) {
		pthread_mutex_unlock(&c->mu);
		return;
	}
	rel.id = c->next_id++;
	pthread_mutex_unlock(&c->mu);
	/* The callers report nothing, so keep the thread's last error. */
	memcpy(saved, last_error, sizeof(saved));
	(void)client_send_packed(c, buf, flat_refs_req_encode(&rel, buf), -1);
	memcpy(last_error, saved, sizeof(saved));
}

/* Retain and Release are what busy callers send most: packed and read by
 * flatwire, not protobuf-c (an error answer still comes unpacked). */
int bbc_refs_rpc(bb_client *c, uint64_t id, uint32_t count, int release)
{
	flat_refs_req fr = {
		.op = release ? FLAT_OP_RELEASE : FLAT_OP_RETAIN, .buf_id = id, .count = count};
	struct call k = {.fd = -1, .want_flat = 1};
	uint8_t buf[FLAT_MAX_BYTES];
	const char *what = release ? "bb_release" : "bb_retain";
	int rc;

	if (!c)
		return bbc_fail(BB_ERR_INVALID, "%s: client is required", what);
	if (count == 0)
		return bbc_fail(BB_ERR_INVALID, "%s: count must be at least 1", what);
	rc = call_register(c, &k);
	if (rc)
		return rc;
	fr.id = k.id;
	rc = call_complete(c, &k, client_send_packed(c, buf, flat_refs_req_encode(&fr, buf), -1));
	if (rc || k.flat_ok)
		return rc;
	rc = response_check(k.resp, k.fd, BUFBROKER__RESPONSE__RESULT_REFS, &k.resp, NULL);
	if (rc == 0)
		bbc_response_free(k.resp);
	return rc;
}
