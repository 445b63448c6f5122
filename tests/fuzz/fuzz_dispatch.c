/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libFuzzer target: datagrams, sequences of them and attached fds, fed
 * through the daemon's whole request path (conn.c's read and decode,
 * handler.c's dispatch, the broker, the host backend) of a real server on a
 * real libuv loop. Two client connections are socketpairs handed to the
 * server as if accepted; the input (fuzz_input.h) says what each sends.
 *
 * What must hold, or the target aborts:
 * - every response decodes, has a status with a known code, fits in
 *   max_datagram, and carries an fd exactly when it grants a host buffer
 *   (a sealed memfd at least as large as the buffer);
 * - after every record, the broker's invariant check passes and its totals
 *   match the host backend's books and the server's connections and waits;
 * - once both clients have gone, every connection closes, no wait is left,
 *   and every buffer left is held by its unadopted tokens alone;
 * - server_shutdown closes every handle and fd the input made (and
 *   LeakSanitizer finds no leak).
 *
 * The same file builds without libFuzzer: fuzz_replay.c's main() runs
 * saved inputs through LLVMFuzzerTestOneInput (ctest fuzz.replay).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <utlist.h>

#include "bufbroker.pb-c.h"
#include "config.h"
#include "fuzz_input.h"
#include "log.h"
#include "msgio.h"
#include "server.h"
#include "status.h"
#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Loop turns one record may take to settle; more means a livelock. */
#define SETTLE_TURNS 256
/* Loop turns the daemon gets to close every connection after its peer left. */
#define CLOSE_TURNS 1000
/* Highest fd number counted by open_fds. */
#define FD_PROBE 4096

/* One client connection, our end of it. */
typedef struct client {
	int fd; /* our end of the socketpair, or -1 */
} client;

/* What one input runs on. */
typedef struct fuzz_run {
	uv_loop_t loop;                     /* fresh for each input */
	server *s;                          /* the daemon, detached (no socket file) */
	client c[2];                        /* the two client connections */
	uint8_t hdr;                        /* the input's header byte */
	unsigned char token[BB_TOKEN_SIZE]; /* the last token a TakeReply carried */
	bool have_token;
	bool slept; /* FUZZ_ACT_RUN waited for a timer */
} fuzz_run;

/* Set once, kept across inputs. */
static struct {
	bool ready;
	bool trace;                      /* $FUZZ_DISPATCH_TRACE: print each response */
	server_config cfg;               /* the daemon's settings (small limits) */
	uint32_t uid[4], gid[4], pid[4]; /* by FUZZ_PEER_* */
	unsigned char hello[64];         /* a packed valid Hello */
	size_t hello_len;
	unsigned char rbuf[FUZZ_MAX_DATAGRAM + 2]; /* responses */
	struct pollfd probe[FD_PROBE];             /* open_fds' poll set */
	int nprobe;                                /* its size: FD_PROBE or RLIMIT_NOFILE */
} g;

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("fuzz_dispatch: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	abort();
}

/* poll(2) without waiting, again when a signal interrupted it (libFuzzer's
 * -timeout runs a SIGALRM every second). */
static int poll_now(struct pollfd *p, nfds_t n)
{
	int rc;
	do
		rc = poll(p, n, 0);
	while (rc < 0 && errno == EINTR);
	return rc;
}

/* Sleep ms milliseconds of real time, signals or not. */
static void sleep_ms(int ms)
{
	struct timespec left = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
	while (nanosleep(&left, &left) < 0 && errno == EINTR)
		;
}

/* Open fds below FD_PROBE, in one system call (poll marks closed ones). */
static int open_fds(void)
{
	for (int i = 0; i < g.nprobe; i++) {
		g.probe[i].fd = i;
		g.probe[i].events = 0;
		g.probe[i].revents = 0;
	}
	if (poll_now(g.probe, (nfds_t)g.nprobe) < 0)
		fail("poll: %s", strerror(errno));
	int n = 0;
	for (int i = 0; i < g.nprobe; i++)
		n += !(g.probe[i].revents & POLLNVAL);
	return n;
}

static void init_once(void)
{
	if (g.ready)
		return;
	g.ready = true;
	/* The daemon's log would cost more than the requests; keep errors
	 * (all of it when tracing). */
	g.trace = getenv("FUZZ_DISPATCH_TRACE") != NULL;
	log_set_level(g.trace ? LOG_DEBUG : LOG_ERROR);
	signal(SIGPIPE, SIG_IGN);

	config c;
	config_init(&c);
	g.cfg = c.server;
	config_free(&c);
	g.cfg.socket_path = NULL;
	g.cfg.socket_group = NULL;
	g.cfg.no_cuda = true;
	g.cfg.max_datagram = FUZZ_MAX_DATAGRAM;
	g.cfg.queue_bytes = FUZZ_QUEUE_BYTES;
	g.cfg.limits.uid_bytes[BB_HOST] = FUZZ_UID_HOST_BYTES;
	g.cfg.limits.uid_buffers = FUZZ_UID_BUFFERS;
	g.cfg.limits.connections = FUZZ_CONNECTIONS;
	g.cfg.limits.conn_tokens = FUZZ_CONN_TOKENS;
	g.cfg.limits.conn_waits = FUZZ_CONN_WAITS;

	uint32_t uid = (uint32_t)geteuid(), gid = (uint32_t)getegid();
	g.uid[FUZZ_PEER_SELF] = uid;
	g.gid[FUZZ_PEER_SELF] = gid;
	g.pid[FUZZ_PEER_SELF] = (uint32_t)getpid();
	g.uid[FUZZ_PEER_SAME_GID] = uid == 60001 ? 60003 : 60001;
	g.gid[FUZZ_PEER_SAME_GID] = gid;
	g.uid[FUZZ_PEER_STRANGER] = uid == 60002 ? 60004 : 60002;
	g.gid[FUZZ_PEER_STRANGER] = gid == 60002 ? 60004 : 60002;
	g.uid[FUZZ_PEER_ROOT] = 0;
	g.gid[FUZZ_PEER_ROOT] = 0;

	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	h.version_major = BB_PROTO_MAJOR;
	h.version_minor = BB_PROTO_MINOR;
	h.client_name = "fuzz";
	r.id = 1;
	r.op_case = BUFBROKER__REQUEST__OP_HELLO;
	r.hello = &h;
	g.hello_len = bufbroker__request__pack(&r, g.hello);

	struct rlimit rl;
	g.nprobe = FD_PROBE;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < FD_PROBE)
		g.nprobe = (int)rl.rlim_cur;

	/* libuv opens its process-wide fds with the first loop: not a leak. */
	uv_loop_t l;
	if (uv_loop_init(&l) == 0)
		uv_loop_close(&l);
}

/* ---- responses ----------------------------------------------------------- */

static void check_grant_fd(const Bufbroker__Grant *gr, int fd)
{
	struct stat st;
	if (fstat(fd, &st) < 0)
		fail("fstat of a granted fd: %s", strerror(errno));
	if (gr->info && (uint64_t)st.st_size < gr->info->size)
		fail("buffer %llu of %llu bytes granted with a memfd of %lld bytes",
		     (unsigned long long)gr->info->id, (unsigned long long)gr->info->size,
		     (long long)st.st_size);
	int seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
		fail("a granted memfd is not sealed against shrinking and growing (seals %#x)",
		     seals);
}

/* Check one response on client i; remember the token of a TakeReply. */
static void check_response(fuzz_run *fr, int i, const unsigned char *buf, size_t n, int fd)
{
	if (n > FUZZ_MAX_DATAGRAM)
		fail("a response of %zu bytes; max_datagram is %d", n, FUZZ_MAX_DATAGRAM);
	Bufbroker__Response *r = bufbroker__response__unpack(NULL, n, buf);
	if (!r)
		fail("a response of %zu bytes does not decode", n);
	if (!r->status)
		fail("response %llu has no status", (unsigned long long)r->id);
	if (g.trace)
		fprintf(stderr, "  client %d <- id=%llu status=%s result=%d%s \"%s\"\n", i,
			(unsigned long long)r->id, bb_err_name(r->status->code),
			(int)r->result_case, fd >= 0 ? " +fd" : "",
			r->status->message ? r->status->message : "");
	if (strcmp(bb_err_name(r->status->code), "UNKNOWN") == 0)
		fail("response %llu has status code %d", (unsigned long long)r->id,
		     r->status->code);
	bool host_grant = r->result_case == BUFBROKER__RESPONSE__RESULT_GRANT && r->grant->info &&
			  r->grant->info->kind == BUFBROKER__KIND__KIND_HOST;
	if (host_grant && fd < 0)
		fail("response %llu grants host buffer %llu without its memfd",
		     (unsigned long long)r->id, (unsigned long long)r->grant->info->id);
	if (!host_grant && fd >= 0)
		fail("response %llu (result %d, status %d) carries an fd",
		     (unsigned long long)r->id, (int)r->result_case, r->status->code);
	if (host_grant && r->status->code != 0)
		fail("response %llu grants a buffer with status %d", (unsigned long long)r->id,
		     r->status->code);
	if (host_grant)
		check_grant_fd(r->grant, fd);
	if (r->result_case == BUFBROKER__RESPONSE__RESULT_TAKE) {
		if (r->take->token.len != BB_TOKEN_SIZE)
			fail("a TakeReply with a token of %zu bytes", r->take->token.len);
		memcpy(fr->token, r->take->token.data, BB_TOKEN_SIZE);
		fr->have_token = true;
	}
	if (fd >= 0)
		close(fd);
	bufbroker__response__free_unpacked(r, NULL);
}

/* Read and check every response waiting on client i; returns how many. */
static int drain(fuzz_run *fr, int i)
{
	client *c = &fr->c[i];
	int got = 0;
	while (c->fd >= 0) {
		int fd = -1, truncated = 0;
		ssize_t n = msgio_recv(c->fd, g.rbuf, sizeof(g.rbuf), &fd, &truncated);
		if (n == -EAGAIN || n == -EWOULDBLOCK)
			break;
		if (n < 0 || (n == 0 && fd < 0))
			break; /* the daemon closed it (never an empty datagram) */
		if (truncated)
			fail("a response over %zu bytes, or with more than one fd",
			     sizeof(g.rbuf) - 1);
		if (n == 0)
			fail("an empty response carrying an fd");
		check_response(fr, i, g.rbuf, (size_t)n, fd);
		got++;
	}
	return got;
}

/* ---- the loop -------------------------------------------------------------- */

/* Most daemon-side sockets settle() watches; with more, it assumes work. */
#define SETTLE_WATCH 32

/* Let the daemon act on everything sent so far (but what backpressure
 * holds back), reading the responses unless nodrain. Done when, after a
 * loop turn, no response waits to be read and the daemon has nothing to
 * do: no connection to close, and no socket it reads (not paused by
 * backpressure or parked requests) with a datagram or an end of stream.
 * One poll(2) a turn tells both. */
static void settle(fuzz_run *fr, bool nodrain)
{
	server *s = fr->s;
	struct pollfd p[2 + SETTLE_WATCH];
	int fds[SETTLE_WATCH];
	for (int turn = 0; turn < SETTLE_TURNS; turn++) {
		uv_run(&fr->loop, UV_RUN_NOWAIT);
		int n = 0;
		bool busy = server_has_doomed(s);
		for (int i = 0; i < 2; i++)
			p[n++] =
				(struct pollfd){.fd = nodrain ? -1 : fr->c[i].fd, .events = POLLIN};
		size_t reading = server_reading_fds(s, fds, SETTLE_WATCH);
		if (reading > SETTLE_WATCH)
			busy = true;
		for (size_t k = 0; k < reading && k < SETTLE_WATCH; k++)
			p[n++] = (struct pollfd){.fd = fds[k], .events = POLLIN | POLLRDHUP};
		if (poll_now(p, (nfds_t)n) < 0)
			fail("poll: %s", strerror(errno));
		for (int i = 0; i < 2; i++)
			if (p[i].revents && drain(fr, i))
				busy = true;
		for (int k = 2; k < n && !busy; k++)
			busy = p[k].revents != 0;
		if (!busy)
			return;
	}
	if (!nodrain)
		fail("the daemon did not settle in %d loop turns", SETTLE_TURNS);
}

/* The broker's invariants, and its totals against the host backend and
 * the server's own lists. */
static void check_invariants(fuzz_run *fr)
{
	server *s = fr->s;
	char report[2048];
	/* The broker's own check, its host totals against the backend's
	 * books, its connections and waits against the request layer's. */
	if (server_check(s, report, sizeof(report)))
		fail("check:\n%s", report);
	broker_totals t;
	broker_totals_get(server_broker(s), &t);
	if (t.buffers[BB_CUDA] || t.bytes[BB_CUDA])
		fail("CUDA buffers on a daemon without CUDA");
}

/* ---- the clients ----------------------------------------------------------- */

/* Send one datagram on client i with fd and fd2 attached (each unless
 * < 0). A full socket gives the daemon turns to read; a closed one drops
 * the datagram. */
static void send_dgram(fuzz_run *fr, int i, const void *buf, size_t len, int fd, int fd2)
{
	client *c = &fr->c[i];
	struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
	union {
		char buf[CMSG_SPACE(2 * sizeof(int))];
		struct cmsghdr align;
	} ctl;
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	int fds[2], nfds = 0;
	if (fd >= 0)
		fds[nfds++] = fd;
	if (fd2 >= 0)
		fds[nfds++] = fd2;
	if (nfds) {
		memset(&ctl, 0, sizeof(ctl));
		msg.msg_control = ctl.buf;
		msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
		struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(cm), fds, nfds * sizeof(int));
	}
	for (int tries = 0; c->fd >= 0 && tries < 16; tries++) {
		if (sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) >= 0)
			return;
		if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
			return; /* EPIPE and the like: the daemon closed it */
		settle(fr, false);
	}
}

static void open_client(fuzz_run *fr, int i)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) < 0)
		fail("socketpair: %s", strerror(errno));
	/* A small send buffer on the daemon's side, so that its output backs
	 * up after a few responses a client does not read. */
	int small = 4096;
	setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
	int peer = FUZZ_HDR_PEER(fr->hdr, i);
	if (server_add_conn(fr->s, sv[1], g.uid[peer], g.gid[peer], g.pid[peer]) < 0)
		fail("server_add_conn: out of memory");
	fr->c[i].fd = sv[0];
	if (fr->hdr & FUZZ_HDR_HELLO) {
		send_dgram(fr, i, g.hello, g.hello_len, -1, -1);
		settle(fr, false);
	}
}

static void close_client(fuzz_run *fr, int i)
{
	if (fr->c[i].fd >= 0)
		close(fr->c[i].fd);
	fr->c[i].fd = -1;
}

/* A sealable memfd of size bytes (sparse). */
static int make_memfd(unsigned flags, uint64_t size)
{
	int fd = memfd_create("fuzz", MFD_CLOEXEC | flags);
	if (fd < 0)
		fail("memfd_create: %s", strerror(errno));
	if (ftruncate(fd, (off_t)size) < 0)
		fail("ftruncate: %s", strerror(errno));
	return fd;
}

/* An fd the daemon must refuse to import (FUZZ_ACT_SEND_BADFD). */
static int make_bad_fd(int arg)
{
	int fd, p[2];
	char path[64];
	switch (arg) {
	case 0:
		if (pipe2(p, O_CLOEXEC) < 0)
			fail("pipe2: %s", strerror(errno));
		close(p[1]);
		return p[0];
	case 1: return make_memfd(0, 4096);
	case 2:
		fd = make_memfd(MFD_ALLOW_SEALING, 4096);
		snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
		p[0] = open(path, O_RDONLY | O_CLOEXEC);
		close(fd);
		if (p[0] < 0)
			fail("open %s: %s", path, strerror(errno));
		return p[0];
	default:
		fd = make_memfd(MFD_ALLOW_SEALING, 4096);
		if (fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) < 0)
			fail("F_SEAL_WRITE: %s", strerror(errno));
		return fd;
	}
}

/* FUZZ_ACT_ADOPT: send an Adopt of the last token seen. */
static void send_adopt(fuzz_run *fr, int i, int arg, const uint8_t *p, size_t len)
{
	unsigned char tok[BB_TOKEN_SIZE], buf[128];
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Adopt a = BUFBROKER__ADOPT__INIT;
	memcpy(tok, fr->token, sizeof(tok));
	if (!fr->have_token)
		memset(tok, 0, sizeof(tok));
	if (arg == 1)
		tok[(len ? p[0] : 0) % BB_TOKEN_SIZE] ^= 1;
	a.token.data = tok;
	a.token.len = arg == 3 ? BB_TOKEN_SIZE - 1 : BB_TOKEN_SIZE;
	r.id = len ? p[0] : 0;
	r.no_reply = arg == 2;
	r.op_case = BUFBROKER__REQUEST__OP_ADOPT;
	r.adopt = &a;
	send_dgram(fr, i, buf, bufbroker__request__pack(&r, buf), -1, -1);
}

/* Carry out one record. */
static void run_record(fuzz_run *fr, uint8_t ctl, const uint8_t *p, size_t len)
{
	int i = FUZZ_CTL_CONN(ctl), arg = FUZZ_CTL_ARG(ctl), fd, fd2;
	bool nodrain = ctl & FUZZ_CTL_NODRAIN;
	unsigned char big[FUZZ_MAX_DATAGRAM + 4];

	if (g.trace)
		fprintf(stderr, "client %d: action %d arg %d%s%s, %zu bytes\n", i,
			FUZZ_CTL_ACT(ctl), arg, ctl & FUZZ_CTL_HOLD ? " hold" : "",
			nodrain ? " nodrain" : "", len);

	switch (FUZZ_CTL_ACT(ctl)) {
	case FUZZ_ACT_SEND: send_dgram(fr, i, p, len, -1, -1); break;
	case FUZZ_ACT_SEND_MEMFD:
		fd = make_memfd(MFD_ALLOW_SEALING, FUZZ_MEMFD_SIZE(arg));
		fd2 = arg == 0 ? make_memfd(MFD_ALLOW_SEALING, FUZZ_MEMFD_SIZE(arg)) : -1;
		send_dgram(fr, i, p, len, fd, fd2);
		close(fd);
		if (fd2 >= 0)
			close(fd2);
		break;
	case FUZZ_ACT_SEND_BADFD:
		fd = make_bad_fd(arg);
		send_dgram(fr, i, p, len, fd, -1);
		close(fd);
		break;
	case FUZZ_ACT_ADOPT: send_adopt(fr, i, arg, p, len); break;
	case FUZZ_ACT_RECONNECT:
		close_client(fr, i);
		if (arg & 1)
			settle(fr, nodrain);
		open_client(fr, i);
		break;
	case FUZZ_ACT_HALF_CLOSE:
		if (fr->c[i].fd >= 0)
			shutdown(fr->c[i].fd, SHUT_WR);
		break;
	case FUZZ_ACT_RUN: {
		/* A timer due soon is waited for: that is how a Wait times out
		 * and a token expires. Slept out here, not in uv_run(ONCE),
		 * which would go on to wait for the next timer after that one,
		 * however far; one more ms for the loop clock's rounding. Once
		 * per input: the time is real, and fuzzing speed pays for it. */
		int due = uv_backend_timeout(&fr->loop);
		if (arg == 1 && !fr->slept && due >= 0 && due <= FUZZ_TIMER_WAIT_MS) {
			sleep_ms(due + 1);
			fr->slept = true;
		}
		for (int k = 0; k <= (len ? p[0] % 16 : 0); k++) {
			uv_run(&fr->loop, UV_RUN_NOWAIT);
			if (!nodrain)
				drain(fr, 0), drain(fr, 1);
		}
		break;
	}
	case FUZZ_ACT_OVERSIZE: {
		size_t n = FUZZ_MAX_DATAGRAM + 1 + (size_t)arg;
		memset(big, 0, n);
		memcpy(big, p, len < n ? len : n);
		send_dgram(fr, i, big, n, -1, -1);
		break;
	}
	}
	if (!(ctl & FUZZ_CTL_HOLD))
		settle(fr, nodrain);
	check_invariants(fr);
}

/* Both clients are gone: every connection must close and nothing but
 * unadopted tokens may keep a buffer. */
static int list_row(const broker_info *info, void *arg)
{
	uint64_t *rows = arg;
	if (info->tokens == 0 || info->refs != info->tokens)
		fail("buffer %llu has %llu refs and %u tokens after every connection closed",
		     (unsigned long long)info->id, (unsigned long long)info->refs, info->tokens);
	(*rows)++;
	return 0;
}

static void check_closed(fuzz_run *fr)
{
	server *s = fr->s;
	broker *b = server_broker(s);
	for (int turn = 0; turn < CLOSE_TURNS && (server_has_conns(s) || server_has_doomed(s));
	     turn++)
		uv_run(&fr->loop, UV_RUN_NOWAIT);
	if (server_has_conns(s))
		fail("connection %llu is still open %d loop turns after its peer closed",
		     (unsigned long long)server_first_conn(s), CLOSE_TURNS);
	check_invariants(fr);

	broker_totals t;
	broker_totals_get(b, &t);
	if (t.connections || t.waits)
		fail("%u connections and %llu waits left after every peer closed", t.connections,
		     (unsigned long long)t.waits);
	broker_error err;
	broker_conn *root = broker_conn_open(b, 0, 0, 0, &err);
	if (!root)
		fail("broker_conn_open with no connection open: %s", err.msg);
	uint64_t rows = 0;
	broker_list(b, root, list_row, &rows);
	broker_conn_close(b, root);
	if (rows != t.buffers[BB_HOST])
		fail("root lists %llu buffers; the broker counts %llu", (unsigned long long)rows,
		     (unsigned long long)t.buffers[BB_HOST]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static fuzz_run fr;

	init_once();
	if (size < 1)
		return 0;
	int fds_before = open_fds();
	memset(&fr, 0, sizeof(fr));
	fr.hdr = data[0];
	fr.c[0].fd = fr.c[1].fd = -1;
	if (uv_loop_init(&fr.loop) != 0)
		fail("uv_loop_init failed");
	server_config cfg = g.cfg;
	if (fr.hdr & FUZZ_HDR_INFLIGHT)
		cfg.conn_inflight = FUZZ_CONN_INFLIGHT;
	if (fr.hdr & FUZZ_HDR_TIGHT) {
		cfg.queue_bytes = FUZZ_TIGHT_QUEUE_BYTES;
		cfg.limits.token_ttl_ms = FUZZ_TIGHT_TOKEN_TTL_MS;
	}
	if (fr.hdr & FUZZ_HDR_ALLOW) {
		cfg.allow_uids.n = 1;
		cfg.allow_uids.ids[0] = g.uid[FUZZ_PEER_SAME_GID];
	}
	if (server_start_detached(&fr.s, &fr.loop, &cfg) < 0)
		fail("server_start_detached failed");
	open_client(&fr, 0);
	open_client(&fr, 1);

	size_t off = 1;
	while (off + 3 <= size) {
		uint8_t ctl = data[off];
		size_t len = (size_t)data[off + 1] | (size_t)data[off + 2] << 8;
		off += 3;
		if (len > size - off)
			len = size - off;
		run_record(&fr, ctl, data + off, len);
		off += len;
	}

	close_client(&fr, 0);
	close_client(&fr, 1);
	check_closed(&fr);
	server_shutdown(fr.s);
	fr.s = NULL;
	if (uv_loop_close(&fr.loop) != 0)
		fail("a libuv handle outlived server_shutdown");
	int fds_after = open_fds();
	if (fds_after != fds_before)
		fail("%d fds open before the input, %d after", fds_before, fds_after);
	return 0;
}
