/*
 * Write the fuzz target's seed corpus: one file per session of valid (and
 * a few deliberately invalid) requests, in the input format of
 * fuzz_input.h, so that fuzzing starts from every op and the paths between
 * them rather than from random bytes.
 *
 * Usage: fuzz_gen_corpus DIR    (the repository's is tests/fuzz/corpus)
 * The files are small and deterministic: regenerate them after changing
 * the schema or this file, and commit the result.
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bufbroker.pb-c.h"
#include "bufbroker/bufbroker.h"
#include "fuzz_input.h"
#include "wire.h"

/* One seed being written. */
typedef struct seed {
	unsigned char buf[64 * 1024];
	size_t len;
	uint64_t next_id; /* request ids, from 2 (the automatic Hello is 1) */
} seed;

static const char *outdir;
static int written;

static void begin(seed *s, uint8_t hdr)
{
	s->len = 0;
	s->next_id = 2;
	s->buf[s->len++] = hdr;
}

static void record(seed *s, uint8_t ctl, const void *p, size_t n)
{
	if (s->len + 3 + n > sizeof(s->buf)) {
		fprintf(stderr, "fuzz_gen_corpus: a seed outgrew its buffer\n");
		exit(1);
	}
	s->buf[s->len++] = ctl;
	s->buf[s->len++] = (uint8_t)(n & 0xff);
	s->buf[s->len++] = (uint8_t)(n >> 8);
	memcpy(s->buf + s->len, p, n);
	s->len += n;
}

static void finish(seed *s, const char *name)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", outdir, name);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(s->buf, 1, s->len, f) != s->len || fclose(f) != 0) {
		perror(path);
		exit(1);
	}
	written++;
}

/* Pack r (its id set here unless preset) as one record. */
static void request(seed *s, uint8_t ctl, Bufbroker__Request *r)
{
	unsigned char buf[FUZZ_MAX_DATAGRAM];
	if (!r->id)
		r->id = s->next_id++;
	if (bufbroker__request__get_packed_size(r) > sizeof(buf)) {
		fprintf(stderr, "fuzz_gen_corpus: a request over max_datagram\n");
		exit(1);
	}
	record(s, ctl, buf, bufbroker__request__pack(r, buf));
}

/* ---- one helper per op: conn is 0 or 1; ctl_extra adds FUZZ_CTL_* bits --- */

#define SEND(conn) FUZZ_CTL(FUZZ_ACT_SEND, conn, 0)

static void hello(seed *s, int conn, uint32_t major)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	h.version_major = major;
	h.version_minor = BB_PROTO_MINOR;
	h.client_name = "seed";
	r.op_case = BUFBROKER__REQUEST__OP_HELLO;
	r.hello = &h;
	request(s, SEND(conn), &r);
}

/* An Alloc asking for CUDA handle kind handle (protocol 1.2; 0: none). */
static void alloc_handle(seed *s, int conn, uint64_t size, int kind, int32_t device,
			 const char *name, uint32_t share, int handle)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Alloc a = BUFBROKER__ALLOC__INIT;
	a.size = size;
	a.device = device;
	a.kind = (Bufbroker__Kind)kind;
	a.name = (char *)(name ? name : "");
	a.share = share;
	a.cuda_handle = (Bufbroker__CudaHandle)handle;
	r.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	r.alloc = &a;
	request(s, SEND(conn), &r);
}

static void alloc_on(seed *s, int conn, uint64_t size, int kind, int32_t device, const char *name,
		     uint32_t share)
{
	alloc_handle(s, conn, size, kind, device, name, share, 0);
}

static void alloc(seed *s, int conn, uint64_t size, int kind, const char *name, uint32_t share)
{
	alloc_on(s, conn, size, kind, 0, name, share);
}

/* ImportFd; how is the record's ctl (which fd goes with it). */
static void import_fd(seed *s, uint8_t how, uint64_t size, const char *name, uint32_t share)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__ImportFd a = BUFBROKER__IMPORT_FD__INIT;
	a.size = size;
	a.kind = BUFBROKER__KIND__KIND_HOST;
	a.name = (char *)(name ? name : "");
	a.share = share;
	r.op_case = BUFBROKER__REQUEST__OP_IMPORT_FD;
	r.import_fd = &a;
	request(s, how, &r);
}

static void open_id(seed *s, int conn, uint64_t id)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Open o = BUFBROKER__OPEN__INIT;
	o.target_case = BUFBROKER__OPEN__TARGET_ID;
	o.id = id;
	r.op_case = BUFBROKER__REQUEST__OP_OPEN;
	r.open = &o;
	request(s, SEND(conn), &r);
}

static void open_name(seed *s, int conn, const char *name)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Open o = BUFBROKER__OPEN__INIT;
	o.target_case = BUFBROKER__OPEN__TARGET_NAME;
	o.name = (char *)name;
	r.op_case = BUFBROKER__REQUEST__OP_OPEN;
	r.open = &o;
	request(s, SEND(conn), &r);
}

static void refs(seed *s, int conn, bool retain, uint64_t id, uint32_t count, bool quiet)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Retain rt = BUFBROKER__RETAIN__INIT;
	Bufbroker__Release rl = BUFBROKER__RELEASE__INIT;
	if (retain) {
		rt.id = id;
		rt.count = count;
		r.op_case = BUFBROKER__REQUEST__OP_RETAIN;
		r.retain = &rt;
	} else {
		rl.id = id;
		rl.count = count;
		r.op_case = BUFBROKER__REQUEST__OP_RELEASE;
		r.release = &rl;
	}
	r.no_reply = quiet;
	request(s, SEND(conn), &r);
}

static void take(seed *s, int conn, uint64_t id, bool retain)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Take t = BUFBROKER__TAKE__INIT;
	t.id = id;
	t.retain = retain;
	r.op_case = BUFBROKER__REQUEST__OP_TAKE;
	r.take = &t;
	request(s, SEND(conn), &r);
}

/* Adopt the last token the daemon handed out (FUZZ_ACT_ADOPT). */
static void adopt_last(seed *s, int conn, int arg)
{
	uint8_t id = (uint8_t)s->next_id++;
	record(s, FUZZ_CTL(FUZZ_ACT_ADOPT, conn, arg), &id, 1);
}

static void settle_op(seed *s, int conn, uint64_t id, const char *error)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__SetReady sr = BUFBROKER__SET_READY__INIT;
	Bufbroker__SetError se = BUFBROKER__SET_ERROR__INIT;
	if (error) {
		se.id = id;
		se.message = (char *)error;
		r.op_case = BUFBROKER__REQUEST__OP_SET_ERROR;
		r.set_error = &se;
	} else {
		sr.id = id;
		r.op_case = BUFBROKER__REQUEST__OP_SET_READY;
		r.set_ready = &sr;
	}
	request(s, SEND(conn), &r);
}

static void wait_op(seed *s, int conn, uint64_t id, int32_t timeout_ms, bool quiet)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Wait w = BUFBROKER__WAIT__INIT;
	w.id = id;
	w.timeout_ms = timeout_ms;
	r.no_reply = quiet;
	r.op_case = BUFBROKER__REQUEST__OP_WAIT;
	r.wait = &w;
	request(s, SEND(conn), &r);
}

static void stat_op(seed *s, int conn, uint64_t id, const char *name)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Stat st = BUFBROKER__STAT__INIT;
	if (name) {
		st.target_case = BUFBROKER__STAT__TARGET_NAME;
		st.name = (char *)name;
	} else {
		st.target_case = BUFBROKER__STAT__TARGET_ID;
		st.id = id;
	}
	r.op_case = BUFBROKER__REQUEST__OP_STAT;
	r.stat = &st;
	request(s, SEND(conn), &r);
}

static void list_op(seed *s, uint8_t ctl, uint64_t after_id)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__List l = BUFBROKER__LIST__INIT;
	l.after_id = after_id;
	r.op_case = BUFBROKER__REQUEST__OP_LIST;
	r.list = &l;
	request(s, ctl, &r);
}

static void server_status(seed *s, uint8_t ctl)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__ServerStatus ss = BUFBROKER__SERVER_STATUS__INIT;
	r.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	r.server_status = &ss;
	request(s, ctl, &r);
}

static void clients(seed *s, int conn, uint64_t after)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Clients c = BUFBROKER__CLIENTS__INIT;
	c.after_serial = after;
	r.op_case = BUFBROKER__REQUEST__OP_CLIENTS;
	r.clients = &c;
	request(s, SEND(conn), &r);
}

static void check(seed *s, int conn)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__Check c = BUFBROKER__CHECK__INIT;
	r.op_case = BUFBROKER__REQUEST__OP_CHECK;
	r.check = &c;
	request(s, SEND(conn), &r);
}

/* AllocationFd (1.2) for allocation. */
static void allocation_fd(seed *s, int conn, uint64_t allocation)
{
	Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
	Bufbroker__AllocationFd a = BUFBROKER__ALLOCATION_FD__INIT;
	a.allocation = allocation;
	r.op_case = BUFBROKER__REQUEST__OP_ALLOCATION_FD;
	r.allocation_fd = &a;
	request(s, SEND(conn), &r);
}

static void action(seed *s, int act, int conn, int arg, uint8_t extra)
{
	uint8_t p = 0;
	record(s, (uint8_t)(FUZZ_CTL(act, conn, arg) | extra), &p, 1);
}

/* ---- the seeds ------------------------------------------------------------ */

#define AUTO FUZZ_HDR_HELLO
#define PEERS(a, b) (FUZZ_HDR_MAKE_PEER(0, a) | FUZZ_HDR_MAKE_PEER(1, b))

int main(int argc, char **argv)
{
	static seed s;
	char name[BB_NAME_MAX + 2];
	if (argc != 2) {
		fprintf(stderr, "usage: fuzz_gen_corpus DIR\n");
		return 2;
	}
	outdir = argv[1];

	begin(&s, 0);
	hello(&s, 0, BB_PROTO_MAJOR);
	server_status(&s, SEND(0));
	finish(&s, "hello-status");

	begin(&s, 0);
	hello(&s, 0, BB_PROTO_MAJOR);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	settle_op(&s, 0, 1, NULL);
	stat_op(&s, 0, 1, NULL);
	list_op(&s, SEND(0), 0);
	refs(&s, 0, false, 1, 1, false);
	stat_op(&s, 0, 1, NULL);
	finish(&s, "alloc-ready-stat-release");

	begin(&s, AUTO | PEERS(FUZZ_PEER_SELF, FUZZ_PEER_STRANGER));
	alloc(&s, 0, 65536, BB_HOST, "frames", BB_SHARE_ANY);
	open_name(&s, 1, "frames");
	refs(&s, 1, true, 1, 2, false);
	stat_op(&s, 1, 0, "frames");
	refs(&s, 1, false, 1, 3, false);
	refs(&s, 0, false, 1, 1, true);
	stat_op(&s, 1, 0, "frames");
	finish(&s, "share-any-open-by-name");

	begin(&s, AUTO | PEERS(FUZZ_PEER_SELF, FUZZ_PEER_STRANGER));
	alloc(&s, 0, 4096, BB_HOST, "mine", BB_SHARE_UID);
	open_id(&s, 1, 1);
	open_name(&s, 1, "mine");
	stat_op(&s, 1, 1, NULL);
	refs(&s, 1, true, 1, 1, false);
	wait_op(&s, 1, 1, 0, false);
	take(&s, 1, 1, false);
	list_op(&s, SEND(1), 0);
	finish(&s, "share-uid-denied");

	begin(&s, AUTO | PEERS(FUZZ_PEER_SELF, FUZZ_PEER_SAME_GID));
	alloc(&s, 0, 4096, BB_HOST, "group", BB_SHARE_GID);
	open_name(&s, 1, "group");
	wait_op(&s, 1, 1, -1, false);
	settle_op(&s, 0, 1, NULL);
	clients(&s, 1, 0);
	finish(&s, "share-gid-wait-wakes");

	begin(&s, AUTO);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	take(&s, 0, 1, false);
	adopt_last(&s, 1, 0);
	adopt_last(&s, 1, 0);
	refs(&s, 1, false, 1, 1, false);
	stat_op(&s, 0, 1, NULL);
	finish(&s, "take-adopt-release");

	begin(&s, AUTO);
	alloc(&s, 0, 8192, BB_HOST, "kept", BB_SHARE_UID);
	take(&s, 0, 1, true);
	action(&s, FUZZ_ACT_RECONNECT, 0, 1, 0);
	adopt_last(&s, 0, 0);
	take(&s, 0, 1, false);
	adopt_last(&s, 1, 1);
	adopt_last(&s, 1, 3);
	adopt_last(&s, 1, 2);
	finish(&s, "take-retain-reconnect-adopt");

	begin(&s, AUTO);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_ANY);
	take(&s, 0, 1, false);
	stat_op(&s, 1, 1, NULL);
	finish(&s, "token-outlives-connection");

	begin(&s, AUTO);
	import_fd(&s, FUZZ_CTL(FUZZ_ACT_SEND_MEMFD, 0, 2), 4096, "imported", BB_SHARE_UID);
	import_fd(&s, FUZZ_CTL(FUZZ_ACT_SEND_MEMFD, 0, 3), 1 << 20, NULL, BB_SHARE_GID);
	import_fd(&s, FUZZ_CTL(FUZZ_ACT_SEND_MEMFD, 0, 1), 4096, NULL, BB_SHARE_UID);
	import_fd(&s, SEND(0), 4096, NULL, BB_SHARE_UID);
	open_name(&s, 1, "imported");
	list_op(&s, SEND(1), 0);
	/* Two fds on one datagram: a protocol error that closes. */
	import_fd(&s, FUZZ_CTL(FUZZ_ACT_SEND_MEMFD, 0, 0), 4096, NULL, BB_SHARE_UID);
	stat_op(&s, 0, 1, NULL);
	finish(&s, "import-fd");

	begin(&s, AUTO);
	for (int arg = 0; arg < 4; arg++)
		import_fd(&s, FUZZ_CTL(FUZZ_ACT_SEND_BADFD, 0, arg), 4096, NULL, BB_SHARE_UID);
	stat_op(&s, 0, 1, NULL);
	finish(&s, "import-bad-fds");

	begin(&s, AUTO);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	{
		/* An fd on a request that takes none. */
		Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
		Bufbroker__Stat st = BUFBROKER__STAT__INIT;
		st.target_case = BUFBROKER__STAT__TARGET_ID;
		st.id = 1;
		r.op_case = BUFBROKER__REQUEST__OP_STAT;
		r.stat = &st;
		request(&s, FUZZ_CTL(FUZZ_ACT_SEND_MEMFD, 0, 2), &r);
	}
	stat_op(&s, 0, 1, NULL);
	finish(&s, "fd-on-wrong-op");

	begin(&s, AUTO | PEERS(FUZZ_PEER_SELF, FUZZ_PEER_SELF));
	alloc(&s, 0, 4096, BB_HOST, "result", BB_SHARE_UID);
	wait_op(&s, 1, 1, -1, false);
	wait_op(&s, 1, 1, 100000, false);
	settle_op(&s, 0, 1, "out of coffee");
	wait_op(&s, 1, 1, 0, false);
	settle_op(&s, 0, 1, NULL);
	stat_op(&s, 1, 0, "result");
	finish(&s, "wait-set-error");

	begin(&s, AUTO | PEERS(FUZZ_PEER_SELF, FUZZ_PEER_SELF));
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	wait_op(&s, 1, 1, -1, false);
	wait_op(&s, 1, 1, 0, false);
	wait_op(&s, 1, 1, -1, true);
	action(&s, FUZZ_ACT_RECONNECT, 0, 0, 0);
	wait_op(&s, 1, 1, -1, false);
	finish(&s, "wait-producer-disconnects");

	begin(&s, AUTO | PEERS(FUZZ_PEER_SELF, FUZZ_PEER_SELF));
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	open_id(&s, 1, 1);
	wait_op(&s, 0, 1, -1, false);
	wait_op(&s, 1, 1, 60000, false);
	refs(&s, 1, false, 1, 1, false);
	refs(&s, 0, false, 1, 1, false);
	finish(&s, "wait-buffer-freed");

	begin(&s, 0);
	stat_op(&s, 0, 1, NULL);
	hello(&s, 1, BB_PROTO_MAJOR + 1);
	finish(&s, "before-hello-and-bad-version");

	begin(&s, 0);
	hello(&s, 0, BB_PROTO_MAJOR);
	hello(&s, 0, BB_PROTO_MAJOR);
	record(&s, SEND(0), "", 0);
	server_status(&s, SEND(0));
	record(&s, SEND(0), "\x08\x01\x52\x00", 4); /* id 1 and an empty Hello: version 0.0 */
	record(&s, SEND(1), "\xff\xff\xff", 3);
	finish(&s, "garbage");

	begin(&s, AUTO);
	record(&s, FUZZ_CTL(FUZZ_ACT_OVERSIZE, 0, 0), "\x08\x01", 2);
	server_status(&s, SEND(1));
	finish(&s, "oversize");

	begin(&s, AUTO | PEERS(FUZZ_PEER_ROOT, FUZZ_PEER_SELF));
	for (int i = 0; i < 40; i++) {
		snprintf(name, sizeof(name),
			 "buffer-%02d-with-a-name-long-enough-that-forty-of-them-"
			 "do-not-fit-in-one-list-response",
			 i);
		alloc(&s, i % 2, 1 + (uint64_t)i * 512, BB_HOST, name, (uint32_t)(i % 3));
	}
	list_op(&s, SEND(0), 0);
	list_op(&s, SEND(0), 30);
	list_op(&s, SEND(1), 0);
	finish(&s, "list-paging");

	begin(&s, AUTO);
	for (int i = 0; i < FUZZ_UID_BUFFERS + 2; i++)
		alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	alloc(&s, 1, FUZZ_UID_HOST_BYTES, BB_HOST, NULL, BB_SHARE_UID);
	finish(&s, "limit-uid-buffers-and-bytes");

	begin(&s, AUTO);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	refs(&s, 0, true, 1, 20, false);
	for (int i = 0; i < FUZZ_CONN_TOKENS + 2; i++)
		take(&s, 0, 1, i % 2);
	for (int i = 0; i < FUZZ_CONN_WAITS + 2; i++)
		wait_op(&s, 0, 1, -1, false);
	settle_op(&s, 0, 1, NULL);
	finish(&s, "limit-tokens-and-waits");

	/* Reading pauses at the in-flight limit and resumes as waits end. */
	begin(&s, AUTO | FUZZ_HDR_INFLIGHT);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	for (int i = 0; i < FUZZ_CONN_INFLIGHT + 2; i++)
		wait_op(&s, 0, 1, i == 1 ? 0 : -1, false);
	server_status(&s, SEND(0));
	settle_op(&s, 1, 1, NULL);
	refs(&s, 0, false, 1, 1, false);
	wait_op(&s, 0, 1, -1, false);
	finish(&s, "limit-inflight-pauses-reading");

	/* Peers no allow-list admits are refused at their Hello. */
	begin(&s, FUZZ_HDR_ALLOW | PEERS(FUZZ_PEER_STRANGER, FUZZ_PEER_SAME_GID));
	hello(&s, 0, BB_PROTO_MAJOR);
	hello(&s, 1, BB_PROTO_MAJOR);
	alloc(&s, 1, 4096, BB_HOST, NULL, BB_SHARE_ANY);
	action(&s, FUZZ_ACT_RECONNECT, 0, 1, 0);
	stat_op(&s, 0, 1, NULL);
	finish(&s, "allow-list-denies");

	begin(&s, AUTO);
	alloc(&s, 0, 4096, BB_HOST, "a", BB_SHARE_UID);
	alloc(&s, 0, 4096, BB_HOST, "a", BB_SHARE_UID);
	alloc(&s, 0, 0, BB_HOST, NULL, BB_SHARE_UID);
	alloc(&s, 0, 4096, 0, NULL, BB_SHARE_UID);
	alloc(&s, 0, 4096, BB_CUDA, NULL, BB_SHARE_UID);
	alloc(&s, 0, 4096, 7, NULL, BB_SHARE_UID);
	alloc(&s, 0, 4096, BB_HOST, NULL, 9);
	alloc_on(&s, 0, 4096, BB_HOST, 1, NULL, BB_SHARE_UID);
	alloc_on(&s, 0, 4096, BB_HOST, -1, NULL, BB_SHARE_UID);
	import_fd(&s, FUZZ_CTL(FUZZ_ACT_SEND_MEMFD, 0, 2), 4096, NULL, 3);
	memset(name, 'n', BB_NAME_MAX + 1);
	name[BB_NAME_MAX + 1] = '\0';
	alloc(&s, 0, 4096, BB_HOST, name, BB_SHARE_UID);
	alloc(&s, 0, UINT64_MAX, BB_HOST, NULL, BB_SHARE_UID);
	refs(&s, 0, false, 1, 5, false);
	refs(&s, 0, true, 1, 0, false);
	refs(&s, 0, true, 1, UINT32_MAX, false);
	settle_op(&s, 0, 1, NULL);
	settle_op(&s, 0, 1, NULL);
	finish(&s, "alloc-bad-arguments");

	begin(&s, AUTO);
	for (int i = 0; i < 24; i++) {
		snprintf(name, sizeof(name),
			 "a-name-long-enough-to-make-every-list-response-large-%02d", i);
		alloc(&s, 0, 4096, BB_HOST, name, BB_SHARE_UID);
	}
	for (int i = 0; i < 30; i++)
		list_op(&s, FUZZ_CTL(FUZZ_ACT_SEND, 0, 0) | FUZZ_CTL_NODRAIN, 0);
	action(&s, FUZZ_ACT_RUN, 0, 0, 0);
	server_status(&s, SEND(0));
	finish(&s, "backpressure-unread-responses");

	begin(&s, AUTO);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	/* A burst, held: all of it queued before the daemon runs. */
	for (int i = 0; i < 12; i++) {
		Bufbroker__Request r = BUFBROKER__REQUEST__INIT;
		Bufbroker__Stat st = BUFBROKER__STAT__INIT;
		st.target_case = BUFBROKER__STAT__TARGET_ID;
		st.id = 1;
		r.op_case = BUFBROKER__REQUEST__OP_STAT;
		r.stat = &st;
		request(&s, SEND(0) | FUZZ_CTL_HOLD, &r);
	}
	action(&s, FUZZ_ACT_RUN, 0, 0, 0);
	finish(&s, "held-burst");

	begin(&s, AUTO | PEERS(FUZZ_PEER_SELF, FUZZ_PEER_STRANGER));
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	clients(&s, 0, 0);
	clients(&s, 0, 1);
	clients(&s, 1, 0);
	check(&s, 0);
	check(&s, 1);
	server_status(&s, SEND(1));
	finish(&s, "admin-clients-check");

	/* Protocol 1.2: handle kinds (a host buffer with one is invalid, a
	 * kind out of range too) and AllocationFd of nothing held. */
	begin(&s, AUTO);
	alloc_handle(&s, 0, 4096, BB_HOST, 0, NULL, BB_SHARE_UID, BB_CUDA_HANDLE_VMM);
	alloc_handle(&s, 0, 4096, BB_CUDA, 0, NULL, BB_SHARE_UID, BB_CUDA_HANDLE_VMM);
	alloc_handle(&s, 0, 4096, BB_CUDA, 0, NULL, BB_SHARE_UID, 7);
	alloc_handle(&s, 0, 4096, BB_CUDA, 0, NULL, BB_SHARE_UID, BB_CUDA_HANDLE_AUTO);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	allocation_fd(&s, 0, 0);
	allocation_fd(&s, 0, 1);
	allocation_fd(&s, 0, UINT64_MAX);
	finish(&s, "vmm-handles-allocation-fd");

	/* Timers: a Wait times out; with tight settings, a token expires
	 * before it is adopted, and a large response overflows the queue. */
	begin(&s, AUTO);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	wait_op(&s, 0, 1, 1, false);
	action(&s, FUZZ_ACT_RUN, 0, 1, 0);
	wait_op(&s, 0, 1, 2, false);
	settle_op(&s, 0, 1, NULL);
	finish(&s, "wait-timeout-fires");

	begin(&s, AUTO | FUZZ_HDR_TIGHT);
	alloc(&s, 0, 4096, BB_HOST, "short-lived", BB_SHARE_UID);
	take(&s, 0, 1, true);
	take(&s, 0, 1, false);
	action(&s, FUZZ_ACT_RUN, 0, 1, 0);
	adopt_last(&s, 1, 0);
	stat_op(&s, 1, 0, "short-lived");
	finish(&s, "tight-token-expires");

	begin(&s, AUTO | FUZZ_HDR_TIGHT);
	for (int i = 0; i < 12; i++) {
		snprintf(name, sizeof(name),
			 "a-name-long-enough-to-make-every-list-response-large-%02d", i);
		alloc(&s, 0, 4096, BB_HOST, name, BB_SHARE_UID);
	}
	for (int i = 0; i < 12; i++)
		list_op(&s, FUZZ_CTL(FUZZ_ACT_SEND, 0, 0) | FUZZ_CTL_NODRAIN, 0);
	action(&s, FUZZ_ACT_RUN, 0, 0, 0);
	server_status(&s, SEND(1));
	finish(&s, "tight-queue-overflows");

	begin(&s, AUTO);
	alloc(&s, 0, 4096, BB_HOST, NULL, BB_SHARE_UID);
	wait_op(&s, 0, 1, -1, false);
	action(&s, FUZZ_ACT_HALF_CLOSE, 0, 0, 0);
	stat_op(&s, 0, 1, NULL);
	action(&s, FUZZ_ACT_RECONNECT, 1, 0, 0);
	action(&s, FUZZ_ACT_RECONNECT, 1, 1, 0);
	finish(&s, "half-close-reconnect");

	printf("fuzz_gen_corpus: %d seeds written to %s\n", written, outdir);
	return 0;
}
