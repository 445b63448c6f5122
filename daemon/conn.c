/*
 * Handle a single client connection: read one datagram per readiness
 * event, decode it, hand it to the request layer, and send responses,
 * queueing them when the socket is full. Bad input is answered with a
 * Status and, where the stream can no longer be trusted, the connection is
 * closed; nothing a client sends can stop the loop or reach another client.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <fcntl.h>

#include <utlist.h>

#include "log.h"
#include "msgio.h"
#include "server.h"
#include "wire.h"

void conn_doom(conn *c, const char *why)
{
	if (c->doomed || c->closed)
		return;
	c->doomed = true;
	/* Copied: callers pass messages built on their stack. */
	snprintf(c->why, sizeof(c->why), "%s", why);
	/* No more reading: nothing from a doomed connection is acted on. */
	uv_poll_stop(&c->poll);
	c->doomed_next = c->srv->doomed;
	c->srv->doomed = c;
	server_reap_soon(c->srv);
}

/* Queue a packed response that the socket did not take. */
static void enqueue(conn *c, const unsigned char *data, size_t len, int fd)
{
	if (c->out_bytes + len > c->srv->cfg.queue_bytes) {
		char why[128];
		log_warn("event=output_overflow conn=%llu uid=%u pid=%u queued=%llu limit=%llu",
			 (unsigned long long)c->serial, c->uid, c->pid,
			 (unsigned long long)c->out_bytes, (unsigned long long)c->srv->cfg.queue_bytes);
		metrics_refused(&c->srv->counters, METRICS_LIMIT_QUEUE_BYTES);
		snprintf(why, sizeof(why),
			 "client stopped reading its responses: %llu bytes would be queued; the "
			 "limit is %llu (--queue-bytes)",
			 (unsigned long long)(c->out_bytes + len),
			 (unsigned long long)c->srv->cfg.queue_bytes);
		conn_doom(c, why);
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
		c->out_moved_ms = uv_now(c->srv->loop);
		server_output_queued(c->srv);
	}
	c->out_tail = m;
	c->out_bytes += len;
	conn_update(c);
}

void conn_send_packed(conn *c, const unsigned char *data, size_t len, int fd)
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

void conn_send(conn *c, const Bufbroker__Response *r, int fd)
{
	size_t len = bufbroker__response__get_packed_size(r);
	if (len > c->srv->cfg.max_datagram) {
		/* The handler keeps every response within the limit; if one
		 * ever is not, say so rather than send what the peer rejects. */
		log_error("event=response_too_large conn=%llu bytes=%zu", (unsigned long long)c->serial,
			  len);
		conn_send_status(c, r->id, BB_ERR_SYSTEM, "response too large for one datagram");
		return;
	}
	bufbroker__response__pack(r, c->srv->sbuf);
	/* An empty response never carries an fd (it would be lost), and every
	 * response has a Status, so len > 0 here. */
	conn_send_packed(c, c->srv->sbuf, len, fd);
}

void conn_send_status(conn *c, uint64_t req_id, int code, const char *msg)
{
	Bufbroker__Response r = BUFBROKER__RESPONSE__INIT;
	Bufbroker__Status st = BUFBROKER__STATUS__INIT;
	st.code = code;
	st.message = (char *)(msg ? msg : "");
	r.id = req_id;
	r.status = &st;
	conn_send(c, &r, -1);
}

static void flush(conn *c)
{
	while (c->out_head) {
		outmsg *m = c->out_head;
		ssize_t n = msgio_send(c->fd, m->data, m->len, m->fd);
		if (n == -EAGAIN)
			return;
		if (n < 0) {
			conn_doom(c, "peer gone while sending");
			return;
		}
		c->out_head = m->next;
		if (!c->out_head)
			c->out_tail = NULL;
		c->out_bytes -= m->len;
		c->out_moved_ms = uv_now(c->srv->loop);
		if (m->fd >= 0)
			close(m->fd);
		free(m);
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
 * paused releases what it held at once. */
void conn_update(conn *c)
{
	if (c->doomed || c->closed)
		return;
	int ev = UV_DISCONNECT;
	if (c->out_head)
		ev |= UV_WRITABLE;
	else if (c->inflight < c->srv->cfg.conn_inflight)
		ev |= UV_READABLE;
	if (ev == c->events)
		return;
	if (!c->out_head && !(ev & UV_READABLE)) {
		/* Counted once per pause, not per request it holds back. */
		metrics_refused(&c->srv->counters, METRICS_LIMIT_CONN_INFLIGHT);
		log_debug("event=reading_paused conn=%llu uid=%u pid=%u inflight=%u limit=%u",
			  (unsigned long long)c->serial, c->uid, c->pid, c->inflight,
			  c->srv->cfg.conn_inflight);
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
	conn_send_status(c, id, BB_ERR_PROTOCOL, msg);
	if (close_after)
		conn_doom(c, msg);
}

/* Whether the peer has closed its end: told apart from an empty datagram
 * (both read as 0 bytes) when the readiness did not say so, as when the
 * peer closed between the wakeup and the read, or a batch read the end of
 * the stream behind its last requests. */
static bool peer_closed(int fd)
{
	struct pollfd p = {.fd = fd, .events = POLLRDHUP};

	return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP));
}

/* Act on one datagram of n bytes at data (fd attached, or -1). */
static void handle_datagram(conn *c, int events, unsigned char *data, ssize_t n, int fd,
			    int truncated)
{
	server *s = c->srv;
	if (n == 0 && fd < 0 && ((events & UV_DISCONNECT) || peer_closed(c->fd))) {
		conn_doom(c, "peer closed");
		return;
	}
	if (truncated || (size_t)n > s->cfg.max_datagram) {
		if (fd >= 0)
			close(fd);
		char msg[160];
		if ((size_t)n > s->cfg.max_datagram)
			/* The receive buffer holds one byte more than the
			 * limit: a datagram that filled it is too large by at
			 * least that byte, and its true size is not known. */
			snprintf(msg, sizeof(msg),
				 "datagram larger than %u bytes; the limit is %u bytes "
				 "(--max-datagram)",
				 s->cfg.max_datagram, s->cfg.max_datagram);
		else
			snprintf(msg, sizeof(msg),
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
	/* Timed from before decoding: protobuf-c's unpack is part of what a
	 * request costs the daemon. */
	uint64_t t0 = uv_hrtime();
	int op = handler_request_flat(c, data, (size_t)n, fd);
	if (!op) {
		Bufbroker__Request *req = bufbroker__request__unpack(&s->arena.pc, (size_t)n, data);
		if (!req) {
			/* Whatever it had allocated, protobuf-c freed. */
			bb_arena_reset(&s->arena);
			if (fd >= 0)
				close(fd);
			char msg[96];
			snprintf(msg, sizeof(msg), "could not decode request (%zd bytes)", n);
			protocol_error(c, 0, msg, true);
			return;
		}
		op = (int)req->op_case;
		handler_request(c, req, fd);
		/* Only what spilled over the arena needs freeing. */
		if (s->arena.spilled)
			bufbroker__request__free_unpacked(req, &s->arena.pc);
		bb_arena_reset(&s->arena);
	}
	metrics_handled(&s->counters, op, uv_hrtime() - t0);
}

/* Read what the peer has queued, up to CONN_READ_BATCH datagrams in one
 * system call (a client with several threads, or a burst of fire-and-forget
 * Releases, pipelines), and act on each in order. A batch that finds a
 * single datagram (nothing pipelines) makes the next CONN_SINGLE_READS
 * reads one recvmsg each, then batching is tried again. The batch never
 * holds more than the parked-request bound has room for, so conn_inflight
 * stays exact; once the connection is doomed the rest are dropped. */
static void read_batch(conn *c, int events)
{
	server *s = c->srv;
	msgio_slot slot[CONN_READ_BATCH];
	unsigned want = c->single_reads ? 1 : CONN_READ_BATCH;
	uint32_t room = s->cfg.conn_inflight > c->inflight ? s->cfg.conn_inflight - c->inflight : 1;
	size_t cap = (size_t)s->cfg.max_datagram + 1;

	if (want > room)
		want = room;
	for (unsigned i = 0; i < want; i++) {
		slot[i].buf = s->rbuf + i * cap;
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
		if (c->doomed || c->closed) {
			if (slot[i].fd >= 0)
				close(slot[i].fd);
			continue;
		}
		handle_datagram(c, events, slot[i].buf, (ssize_t)slot[i].len, slot[i].fd,
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
	if (events & UV_WRITABLE) {
		flush(c);
		return;
	}
	if (events & UV_READABLE) {
		read_batch(c, events);
		return;
	}
	/* UV_DISCONNECT alone: nothing left to read. */
	conn_doom(c, "peer closed");
}

/* ---- lifecycle (called by server.c) ------------------------------------------ */

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

/* Start serving an accepted socket. */
conn *conn_start(server *s, int fd, uint32_t uid, uint32_t gid, uint32_t pid);
conn *conn_start(server *s, int fd, uint32_t uid, uint32_t gid, uint32_t pid)
{
	conn *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->fd = fd;
	c->srv = s;
	c->serial = ++s->next_serial;
	c->uid = uid;
	c->gid = gid;
	c->pid = pid;
	if (uv_poll_init(s->loop, &c->poll, fd) < 0) {
		free(c);
		return NULL;
	}
	c->poll.data = c;
	DL_APPEND(s->conns, c);
	c->events = UV_READABLE | UV_DISCONNECT;
	uv_poll_start(&c->poll, c->events, on_io);
	return c;
}

/* Most queued datagrams a closing connection's drain reads. */
#define CONN_DRAIN_MAX 4096

/* Before the socket is closed: a Unix socket closed with datagrams still
 * queued to it makes its peer's next read fail with ECONNRESET, ahead of
 * the answers (and the error that ended the connection) already queued
 * for the peer. Stop the peer sending, then read what it had sent and drop
 * it, closing any fds it carried. */
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

/* Release everything the connection held and close it. */
void conn_close(conn *c);
void conn_close(conn *c)
{
	server *s = c->srv;
	if (c->closed)
		return;
	c->closed = true;
	if (c->denied)
		s->denied_pending--;
	handler_drop_waits(c);
	if (c->bc) {
		uint64_t buffers, bytes;
		broker_conn_holdings(c->bc, &buffers, &bytes);
		broker_conn_close(s->b, c->bc);
		c->bc = NULL;
		log_info("event=connection_closed conn=%llu uid=%u pid=%u client=\"%s\" released_buffers=%llu "
			 "released_bytes=%llu reason=\"%s\"",
			 (unsigned long long)c->serial, c->uid, c->pid, c->name,
			 (unsigned long long)buffers, (unsigned long long)bytes,
			 c->why[0] ? c->why : "daemon stopping");
		server_tokens_changed(s);
	}
	DL_DELETE(s->conns, c);
	uv_poll_stop(&c->poll);
	drain(c->fd);
	uv_close((uv_handle_t *)&c->poll, on_closed);
}
