/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Handle client connections: read datagrams per readiness event, have the
 * codec decode each and the request layer act on it, and send responses,
 * queueing them when the socket is full. Bad input is answered with a
 * Status and, where the stream can no longer be trusted, the connection is
 * closed; nothing a client sends can stop the loop or reach another client.
 */
#include "conn.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>
#include <fcntl.h>
#include <linux/sockios.h>

#include <utlist.h>

#include "log.h"
#include "msgio.h"
#include "wire.h"

/* One queued response that did not fit in the socket buffer. */
typedef struct outmsg {
	struct outmsg *next;  /* FIFO */
	int fd;               /* our duplicate of the fd to attach, or -1 */
	size_t len;           /* bytes in data */
	unsigned char data[]; /* the packed Response */
} outmsg;

/* One client connection. */
struct conn {
	uv_poll_t poll;              /* readable (and writable while output is queued) */
	int fd;                      /* the accepted socket */
	uint64_t serial;             /* connection number, for logs */
	conn_env *env;               /* what it shares */
	session *session;            /* the request layer's side; NULL once closed */
	uint32_t uid, pid;           /* SO_PEERCRED, for logs */
	bool doomed;                 /* will be closed at the end of this loop turn */
	bool lingering;              /* doomed: sending its queued output before it closes */
	bool discard;                /* doomed: close without sending the queued output */
	bool closed;                 /* uv_close called */
	bool rdhup;                  /* the peer shut down its sending side (seen; not watched) */
	bool eof;                    /* read the end of its stream: close once all is answered */
	char why[192];               /* why it is being closed, for the log */
	outmsg *out_head, *out_tail; /* queued responses */
	uint64_t out_bytes;          /* bytes in the queue */
	uint64_t out_moved_ms;       /* loop time the queue last started or moved (send timeout) */
	int events;                  /* what poll watches now (UV_READABLE, ...) */
	uint32_t inflight;     /* requests read, not yet answered: the session's parked ones */
	uint32_t single_reads; /* reads left to make one datagram at a time (CONN_SINGLE_READS) */
	conn *prev, *next;     /* env's list */
	conn *doomed_next;     /* env's list of connections to close */
};

static void conn_update(conn *c);

int conn_env_init(conn_env *env)
{
	env->rbuf = malloc(CONN_READ_BATCH * ((size_t)env->limits.max_datagram + 1));
	return env->rbuf ? 0 : -1;
}

void conn_env_free(conn_env *env)
{
	free(env->rbuf);
	env->rbuf = NULL;
}

/* Put c on env's list of connections for the reaper's conn_close. */
static void reap_push(conn *c)
{
	c->doomed_next = c->env->doomed;
	c->env->doomed = c;
	c->env->reap_soon(c->env->ctx);
}

void conn_doom(conn *c, const char *why)
{
	if (c->doomed || c->closed)
		return;
	c->doomed = true;
	/* Copied: callers pass messages built on their stack. */
	snprintf(c->why, sizeof(c->why), "%s", why);
	/* No more reading: nothing from a doomed connection is acted on. */
	uv_poll_stop(&c->poll);
	reap_push(c);
}

conn *conn_next_doomed(conn_env *env)
{
	conn *c = env->doomed;
	if (c)
		env->doomed = c->doomed_next;
	return c;
}

/* Queue a packed response that the socket did not take. */
static void enqueue(conn *c, const unsigned char *data, size_t len, int fd)
{
	if (c->out_bytes + len > c->env->limits.queue_bytes) {
		char why[128];
		log_warn("event=output_overflow conn=%llu uid=%u pid=%u queued=%llu limit=%llu",
			 (unsigned long long)c->serial, c->uid, c->pid,
			 (unsigned long long)c->out_bytes,
			 (unsigned long long)c->env->limits.queue_bytes);
		metrics_refused(c->env->counters, METRICS_LIMIT_QUEUE_BYTES);
		snprintf(why, sizeof(why),
			 "client stopped reading its responses: %llu bytes would be queued; the "
			 "limit is %llu (--queue-bytes)",
			 (unsigned long long)(c->out_bytes + len),
			 (unsigned long long)c->env->limits.queue_bytes);
		conn_doom(c, why);
		c->discard = true; /* it does not read: no use sending the rest */
		return;
	}
	outmsg *m = malloc(sizeof(*m) + len);
	if (!m) {
		conn_doom(c, "daemon out of memory");
		return;
	}
	m->next = NULL;
	m->len = len;
	m->fd = -1;
	if (fd >= 0 && (m->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0) {
		free(m);
		conn_doom(c, "could not duplicate a response fd");
		return;
	}
	memcpy(m->data, data, len);
	if (c->out_tail) {
		c->out_tail->next = m;
	} else {
		c->out_head = m;
		c->out_moved_ms = uv_now(c->env->loop);
		c->env->output_queued(c->env->ctx);
	}
	c->out_tail = m;
	c->out_bytes += len;
	conn_update(c);
}

/* Send len > 0 bytes, fd attached unless < 0 (borrowed); a full socket
 * queues them. */
static void send_packed(conn *c, const unsigned char *data, size_t len, int fd)
{
	if (c->doomed || c->closed)
		return;
	if (!c->out_head) {
		ssize_t n = msgio_send(c->fd, data, len, fd);
		if (n >= 0)
			return;
		if (n != -EAGAIN) {
			/* EPIPE / ECONNRESET: the peer is gone; reading will
			 * see the end of stream, close from here regardless. */
			conn_doom(c, "peer gone while sending");
			return;
		}
	}
	enqueue(c, data, len, fd);
}

static void send_status(conn *c, uint64_t req_id, int code, const char *msg)
{
	const unsigned char *data;
	size_t len = codec_encode_status(c->env->codec, req_id, code, msg, &data);
	if (len)
		send_packed(c, data, len, -1);
}

/* ---- the reply interface (handler.h) ---------------------------------------- */

static void reply_send(void *ctx, const Bufbroker__Response *r, int fd)
{
	conn *c = ctx;
	const unsigned char *data;
	if (c->doomed || c->closed)
		return;
	size_t len = codec_encode(c->env->codec, r, &data);
	if (!len) {
		/* The handler keeps every response within the limit; if one
		 * ever is not, say so rather than send what the peer rejects. */
		log_error("event=response_too_large conn=%llu bytes=%zu",
			  (unsigned long long)c->serial, bufbroker__response__get_packed_size(r));
		send_status(c, r->id, BB_ERR_SYSTEM, "response too large for one datagram");
		return;
	}
	/* An empty response never carries an fd (it would be lost), and every
	 * response has a Status, so len > 0 here. */
	send_packed(c, data, len, fd);
}

static void reply_close_after(void *ctx, const char *why)
{
	conn_doom(ctx, why);
}

static void reply_parked(void *ctx, uint32_t parked)
{
	conn *c = ctx;
	c->inflight = parked;
	conn_update(c);
}

static bool reply_closing(void *ctx)
{
	const conn *c = ctx;
	return c->doomed || c->closed;
}

/* Send what is queued, oldest first, while the socket takes it: 0 when
 * all went, -EAGAIN when the socket is full, or another -errno (the peer
 * is gone). */
static int send_queued(conn *c)
{
	while (c->out_head) {
		outmsg *m = c->out_head;
		ssize_t n = msgio_send(c->fd, m->data, m->len, m->fd);
		if (n < 0)
			return (int)n;
		c->out_head = m->next;
		if (!c->out_head)
			c->out_tail = NULL;
		c->out_bytes -= m->len;
		c->out_moved_ms = uv_now(c->env->loop);
		if (m->fd >= 0)
			close(m->fd);
		free(m);
	}
	return 0;
}

static void flush(conn *c)
{
	int rc = send_queued(c);
	if (rc < 0 && rc != -EAGAIN) {
		conn_doom(c, "peer gone while sending");
		return;
	}
	conn_update(c);
}

static void on_io(uv_poll_t *p, int status, int events);

/* Read while nothing is queued; while output is queued, wait for the
 * socket to drain and stop reading: backpressure, so a client that floods
 * requests without reading answers is slowed, never buffered unboundedly.
 * Parked requests (Waits, Allocs waiting for device memory) produce no
 * output until they are answered, so they have their own bound: at
 * conn_inflight of them reading pauses too, until one is answered. The end
 * of the peer is watched throughout, so that a client that goes away while
 * paused releases what it held at once.
 *
 * A peer that shut down only its sending side (shutdown(SHUT_WR)) can
 * still read: its requests are read up to the end of its stream and all
 * are answered, parked ones as they complete, and the connection closes
 * once nothing is left to answer or send. UV_DISCONNECT (EPOLLRDHUP) is
 * level-triggered and would wake the loop every turn from then on, so it
 * is watched only until it is first seen; after that only a hangup
 * (EPOLLHUP: the peer closed completely) ends the connection early, and
 * epoll reports a hangup whatever is watched. UV_PRIORITIZED, which a Unix
 * socket never raises, keeps the handle watching when nothing else is. */
static void conn_update(conn *c)
{
	if (c->doomed || c->closed)
		return;
	if (c->eof && !c->out_head && c->inflight == 0) {
		conn_doom(c, "peer half-closed; every request answered");
		return;
	}
	int ev = c->rdhup ? UV_PRIORITIZED : UV_DISCONNECT;
	if (c->out_head)
		ev |= UV_WRITABLE;
	else if (!c->eof && c->inflight < c->env->limits.conn_inflight)
		ev |= UV_READABLE;
	if (ev == c->events)
		return;
	if (!c->out_head && !c->eof && !(ev & UV_READABLE) &&
	    (c->events & (UV_READABLE | UV_WRITABLE))) {
		/* Counted once per pause, not per request it holds back. */
		metrics_refused(c->env->counters, METRICS_LIMIT_CONN_INFLIGHT);
		log_debug("event=reading_paused conn=%llu uid=%u pid=%u inflight=%u limit=%u",
			  (unsigned long long)c->serial, c->uid, c->pid, c->inflight,
			  c->env->limits.conn_inflight);
	}
	c->events = ev;
	uv_poll_start(&c->poll, ev, on_io);
}

static void protocol_error(conn *c, uint64_t id, const char *msg, bool close_after)
{
	char esc[256];
	log_warn("event=protocol_error conn=%llu uid=%u pid=%u error=\"%s\"%s",
		 (unsigned long long)c->serial, c->uid, c->pid, log_escape(msg, esc, sizeof(esc)),
		 close_after ? " action=close" : "");
	send_status(c, id, BB_ERR_PROTOCOL, msg);
	if (close_after)
		conn_doom(c, msg);
}

/* Whether the peer has closed completely (or shut down its reading side
 * too): nothing sent to it can be read any more. */
static bool peer_hung_up(int fd)
{
	struct pollfd p = {.fd = fd};

	return poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR));
}

/* Whether a 0-byte read at slot i of the got that a batch read is the end
 * of the peer's stream, not an empty datagram (both read as 0 bytes): the
 * peer shut down its sending side, and no datagram with bytes, an fd or
 * too much of either follows, in the batch (a batch reads the end of the
 * stream again into every slot after it) or still queued. The readiness
 * does not tell: the peer may have closed between the wakeup and the
 * read. Empty datagrams sent just before the end cannot be told from it;
 * they are dropped with it. */
static bool end_of_stream(const conn *c, const msgio_slot *slot, int i, int got)
{
	struct pollfd p = {.fd = c->fd, .events = POLLRDHUP};
	int queued = 0;

	for (int k = i; k < got; k++)
		if (slot[k].len || slot[k].fd >= 0 || slot[k].truncated)
			return false;
	if (poll(&p, 1, 0) != 1 || !(p.revents & (POLLRDHUP | POLLHUP)))
		return false;
	return ioctl(c->fd, SIOCINQ, &queued) < 0 || queued == 0;
}

/* The peer shut down its sending side and can still read (first seen).
 * Nothing changes but what is watched (conn_update): its requests are read
 * up to the end of its stream and answered. */
static void half_closed(conn *c)
{
	c->rdhup = true;
	log_info("event=peer_half_closed conn=%llu uid=%u pid=%u parked=%u queued_bytes=%llu",
		 (unsigned long long)c->serial, c->uid, c->pid, c->inflight,
		 (unsigned long long)c->out_bytes);
}

/* The peer's stream ended: close now if it cannot read either, else
 * answer what it sent (conn_update closes the connection once that is
 * done). */
static void read_end(conn *c)
{
	if (peer_hung_up(c->fd)) {
		conn_doom(c, "peer closed");
		return;
	}
	if (!c->rdhup)
		half_closed(c);
	c->eof = true;
	conn_update(c);
}

/* Act on one datagram of n bytes at data (fd attached, or -1). */
static void handle_datagram(conn *c, unsigned char *data, ssize_t n, int fd, int truncated)
{
	conn_env *env = c->env;
	uint32_t max = env->limits.max_datagram;
	if (truncated || (size_t)n > max) {
		if (fd >= 0)
			close(fd);
		char msg[160];
		if ((size_t)n > max)
			/* The receive buffer holds one byte more than the
			 * limit: a datagram that filled it is too large by at
			 * least that byte, and its true size is not known. */
			snprintf(msg, sizeof(msg),
				 "datagram larger than %u bytes; the limit is %u bytes "
				 "(--max-datagram)",
				 max, max);
		else
			snprintf(
				msg, sizeof(msg),
				"datagram of %zd bytes with more than one file descriptor; at most "
				"one may be attached",
				n);
		protocol_error(c, 0, msg, true);
		return;
	}
	if (n == 0) {
		if (fd >= 0)
			close(fd);
		protocol_error(c, 0, "empty datagram", false);
		return;
	}
	/* Timed from before decoding: decoding is part of what a request
	 * costs the daemon. */
	uint64_t t0 = uv_hrtime();
	codec_request cr;
	char msg[128];
	int rc = codec_decode(env->codec, data, (size_t)n, &cr, msg, sizeof(msg));
	if (rc < 0) {
		if (fd >= 0)
			close(fd);
		protocol_error(c, 0, msg, true);
		return;
	}
	int op = (int)cr.req->op_case;
	handler_request(c->session, cr.req, fd, rc == CODEC_INVALID ? msg : NULL);
	codec_request_done(env->codec, &cr);
	metrics_handled(env->counters, op, uv_hrtime() - t0);
}

/* Read what the peer has queued, up to CONN_READ_BATCH datagrams in one
 * system call (a client with several threads, or a burst of fire-and-forget
 * Releases, pipelines), and act on each in order. A batch that finds a
 * single datagram (nothing pipelines) makes the next CONN_SINGLE_READS
 * reads one recvmsg each, then batching is tried again. The batch never
 * holds more than the parked-request bound has room for, so conn_inflight
 * stays exact; once the connection is doomed the rest are dropped. */
static void read_batch(conn *c)
{
	conn_env *env = c->env;
	msgio_slot slot[CONN_READ_BATCH];
	unsigned want = c->single_reads ? 1 : CONN_READ_BATCH;
	uint32_t lim = env->limits.conn_inflight;
	uint32_t room = lim > c->inflight ? lim - c->inflight : 1;
	size_t cap = (size_t)env->limits.max_datagram + 1;

	if (want > room)
		want = room;
	for (unsigned i = 0; i < want; i++) {
		slot[i].buf = env->rbuf + i * cap;
		slot[i].cap = cap;
	}
	int got = msgio_recv_batch(c->fd, slot, want);
	if (got == -EAGAIN)
		return;
	if (got < 0) {
		conn_doom(c, "receive failed");
		return;
	}
	if (want > 1)
		c->single_reads = got == 1 ? CONN_SINGLE_READS : 0;
	else if (c->single_reads)
		c->single_reads--;
	for (int i = 0; i < got; i++) {
		if (c->doomed || c->closed || c->eof) {
			if (slot[i].fd >= 0)
				close(slot[i].fd);
			continue;
		}
		if (slot[i].len == 0 && end_of_stream(c, slot, i, got)) {
			read_end(c);
			continue;
		}
		handle_datagram(c, slot[i].buf, (ssize_t)slot[i].len, slot[i].fd,
				slot[i].truncated);
	}
}

static void on_io(uv_poll_t *p, int status, int events)
{
	conn *c = p->data;
	if (c->doomed || c->closed)
		return;
	if (status < 0) {
		conn_doom(c, uv_strerror(status));
		return;
	}
	/* Seen once; from now on only a hangup is watched (conn_update). */
	if ((events & UV_DISCONNECT) && !c->rdhup) {
		if (peer_hung_up(c->fd))
			c->rdhup = true;
		else
			half_closed(c);
	}
	if (events & UV_WRITABLE)
		flush(c);
	else if (events & UV_READABLE)
		read_batch(c);
	else if (peer_hung_up(c->fd))
		conn_doom(c, "peer closed");
	/* Else the peer shut down its sending side while reading is paused:
	 * what it sent before is read when reading resumes. */
	conn_update(c);
}

/* ---- lifecycle ---------------------------------------------------------------- */

static void on_closed(uv_handle_t *h)
{
	conn *c = h->data;
	close(c->fd);
	while (c->out_head) {
		outmsg *m = c->out_head;
		c->out_head = m->next;
		if (m->fd >= 0)
			close(m->fd);
		free(m);
	}
	free(c);
}

conn *conn_start(conn_env *env, int fd, uint32_t uid, uint32_t gid, uint32_t pid, bool denied)
{
	conn *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->fd = fd;
	c->env = env;
	c->serial = ++env->next_serial;
	c->uid = uid;
	c->pid = pid;
	if (uv_poll_init(env->loop, &c->poll, fd) < 0) {
		free(c);
		return NULL;
	}
	c->poll.data = c;
	DL_APPEND(env->conns, c);
	c->events = UV_READABLE | UV_DISCONNECT;
	uv_poll_start(&c->poll, c->events, on_io);
	handler_reply reply = {
		.send = reply_send,
		.close_after = reply_close_after,
		.parked = reply_parked,
		.closing = reply_closing,
		.ctx = c,
	};
	c->session = handler_session_open(env->h, c->serial, uid, gid, pid, denied, &reply);
	if (!c->session)
		conn_doom(c, "daemon out of memory");
	return c;
}

/* Most queued datagrams a closing connection's drain reads. */
#define CONN_DRAIN_MAX 4096

/* When a connection starts closing, before its queued output goes: a Unix
 * socket closed with datagrams still queued to it makes its peer's next
 * read fail with ECONNRESET, ahead of the answers (and the error that
 * ended the connection) already queued for the peer. Stop the peer
 * sending, then read what it had sent and drop it, closing any fds it
 * carried. */
static void drain(int fd)
{
	unsigned char byte;
	msgio_slot slot = {.buf = &byte, .cap = 1};

	(void)shutdown(fd, SHUT_RD);
	for (int i = 0; i < CONN_DRAIN_MAX; i++) {
		if (msgio_recv_batch(fd, &slot, 1) != 1)
			return;
		if (slot.fd >= 0)
			close(slot.fd);
		if (slot.len == 0 && !slot.truncated)
			return; /* the end of the stream (or an empty datagram: harmless) */
	}
}

void conn_refuse(conn_env *env, int fd, int code, const char *msg)
{
	const unsigned char *data;
	size_t len = codec_encode_status(env->codec, 0, code, msg, &data);
	/* A new socket's buffer is empty: the answer fits, or the peer is
	 * gone already. */
	if (len)
		(void)msgio_send(fd, data, len, -1);
	drain(fd);
	close(fd);
}

/* Release what c held and close it: no more lingering. */
static void close_now(conn *c)
{
	c->closed = true;
	if (c->session)
		handler_session_close(c->session, c->why);
	c->session = NULL;
	DL_DELETE(c->env->conns, c);
	uv_poll_stop(&c->poll);
	uv_close((uv_handle_t *)&c->poll, on_closed);
}

/* A lingering connection's socket has room, or the peer is gone. */
static void on_linger(uv_poll_t *p, int status, int events)
{
	conn *c = p->data;

	(void)events;
	if (c->closed || c->discard)
		return; /* the reaper closes it this turn */
	if (status == 0 && send_queued(c) == -EAGAIN)
		return;
	close_now(c);
}

void conn_close(conn *c)
{
	if (c->closed)
		return;
	if (!c->lingering) {
		uv_poll_stop(&c->poll);
		/* What the peer sent after what doomed it is never acted on. */
		if (c->session)
			handler_session_drop_parked(c->session);
		drain(c->fd);
	}
	if (c->out_head && !c->discard && send_queued(c) == -EAGAIN) {
		/* The answers queued for the peer (and the error that doomed
		 * it) go first; the send timeout bounds the wait, and a peer
		 * that is gone ends it at once. */
		if (!c->lingering) {
			c->lingering = true;
			uv_poll_start(&c->poll, UV_WRITABLE, on_linger);
			c->env->output_queued(c->env->ctx);
		}
		return;
	}
	close_now(c);
}

void conn_update_all(conn_env *env)
{
	for (conn *c = env->conns; c; c = c->next)
		conn_update(c);
}

uint64_t conn_sweep_stalled(conn_env *env, uint64_t now)
{
	uint64_t limit = env->limits.send_timeout_ms, next = UINT64_MAX;
	conn *c;
	DL_FOREACH (env->conns, c) {
		/* Doomed ones too: they send what is queued before they close. */
		if (!c->out_head || c->discard || c->closed)
			continue;
		uint64_t still = now - c->out_moved_ms;
		if (still < limit) {
			if (limit - still < next)
				next = limit - still;
			continue;
		}
		char why[192];
		log_warn("event=send_timeout conn=%llu uid=%u pid=%u queued=%llu stalled_ms=%llu "
			 "limit_ms=%llu",
			 (unsigned long long)c->serial, c->uid, c->pid,
			 (unsigned long long)c->out_bytes, (unsigned long long)still,
			 (unsigned long long)limit);
		metrics_refused(env->counters, METRICS_LIMIT_SEND_TIMEOUT);
		snprintf(why, sizeof(why),
			 "client read none of its %llu bytes of queued responses for %llu ms; the "
			 "limit is %llu ms (--send-timeout)",
			 (unsigned long long)c->out_bytes, (unsigned long long)still,
			 (unsigned long long)limit);
		if (c->lingering)
			reap_push(c);
		else
			conn_doom(c, why);
		c->discard = true;
	}
	return next;
}

void conn_close_all(conn_env *env)
{
	/* Nothing is sent while stopping: parked requests are dropped and
	 * every connection is silenced before any closes, so that a waiter
	 * learns that the daemon went (end of stream), not that its producer
	 * did, which depends only on the close order. */
	for (conn *c = env->conns; c; c = c->next) {
		if (c->session)
			handler_session_drop_parked(c->session);
		c->doomed = true;
		c->discard = true;
	}
	while (env->conns)
		conn_close(env->conns);
	env->doomed = NULL;
}

uint64_t conn_first_serial(const conn_env *env)
{
	return env->conns ? env->conns->serial : 0;
}

size_t conn_reading_fds(conn_env *env, int *fds, size_t max)
{
	size_t n = 0;
	for (conn *c = env->conns; c; c = c->next) {
		if (c->doomed || c->closed || !(c->events & UV_READABLE))
			continue;
		if (n < max)
			fds[n] = c->fd;
		n++;
	}
	return n;
}
