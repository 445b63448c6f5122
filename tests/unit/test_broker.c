/*
 * Unit tests for the broker's rules (DESIGN.md, "The broker's rules"),
 * against the contract in daemon/broker.h. No sockets, no real memory: a
 * counting backend records what is live, a fake clock drives token TTLs and
 * a deterministic random source drives tokens.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "broker.h"

#define container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

#define UID_A 1000
#define UID_B 2000
#define GID_A 100
#define GID_B 200
#define TTL_MS 1000

/* ---- counting backend ---------------------------------------------------- */

/* What the counting backend keeps behind one buffer: a real heap block, so
 * LeakSanitizer also sees memory the broker forgot to return. */
typedef struct test_mem {
	uint64_t magic; /* MEM_MAGIC while live */
	uint64_t size;  /* bytes asked for */
	int imported;   /* 1: came through import_fd */
} test_mem;

#define MEM_MAGIC 0x6262627566666572ull

typedef struct counting_backend {
	backend be;          /* handed to the broker */
	int live;            /* allocations not yet freed */
	uint64_t live_bytes; /* their sizes */
	int allocs;          /* alloc calls */
	int imports;         /* import_fd calls */
	int frees;           /* free calls */
	int exports;         /* export_mem calls */
	int exposes;         /* expose calls */
	int fail_export;     /* non-zero: export_mem fails with it */
	int last_import_fd;  /* fd the last import_fd got */
	int fail_code;       /* non-zero: the next alloc/import fails with it */
} counting_backend;

static int cb_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		    backend_mem *out, char *err, size_t errlen)
{
	counting_backend *cb = be->ctx;
	(void)device;
	(void)uid;
	(void)share;
	(void)handle;
	cb->allocs++;
	if (cb->fail_code) {
		int code = cb->fail_code;
		cb->fail_code = 0;
		snprintf(err, errlen, "counting backend refuses %llu bytes",
			 (unsigned long long)size);
		return code;
	}
	test_mem *m = calloc(1, sizeof(*m));
	cr_assert_not_null(m);
	m->magic = MEM_MAGIC;
	m->size = size;
	out->fd = -1;
	out->size = size;
	out->priv = m;
	cb->live++;
	cb->live_bytes += size;
	return 0;
}

static int cb_import_fd(backend *be, int fd, uint64_t size, backend_mem *out, char *err,
			size_t errlen)
{
	counting_backend *cb = be->ctx;
	cb->imports++;
	cb->last_import_fd = fd;
	if (cb->fail_code) {
		int code = cb->fail_code;
		cb->fail_code = 0;
		snprintf(err, errlen, "counting backend refuses fd %d", fd);
		return code;
	}
	test_mem *m = calloc(1, sizeof(*m));
	cr_assert_not_null(m);
	m->magic = MEM_MAGIC;
	m->size = size;
	m->imported = 1;
	out->fd = -1;
	out->size = size;
	out->priv = m;
	cb->live++;
	cb->live_bytes += size;
	return 0;
}

static void cb_free(backend *be, backend_mem *mem)
{
	counting_backend *cb = be->ctx;
	test_mem *m = mem->priv;
	cr_assert_not_null(m, "backend free of a mem without priv");
	cr_assert_eq(m->magic, MEM_MAGIC, "backend free of a dead mem (double free?)");
	cb->frees++;
	cb->live--;
	cb->live_bytes -= m->size;
	m->magic = 0;
	free(m);
	mem->priv = NULL;
}

static int cb_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
		     size_t errlen)
{
	counting_backend *cb = be->ctx;
	const test_mem *m = mem->priv;
	cb->exports++;
	memset(out, 0, sizeof(*out));
	out->fd = -1;
	out->allocation = m->size;
	if (cb->fail_export) {
		snprintf(err, errlen, "counting backend cannot export");
		return cb->fail_export;
	}
	return 0;
}

static void cb_expose(backend *be, const backend_mem *mem)
{
	counting_backend *cb = be->ctx;
	cr_assert_not_null(mem->priv, "expose of a mem without priv");
	cb->exposes++;
}

static void counting_backend_init(counting_backend *cb, const char *name)
{
	memset(cb, 0, sizeof(*cb));
	cb->be.name = name;
	cb->be.ctx = cb;
	cb->be.alloc = cb_alloc;
	cb->be.import_fd = cb_import_fd;
	cb->be.free = cb_free;
	cb->be.export_mem = cb_export;
	cb->be.expose = cb_expose;
	cb->be.destroy = NULL;
}

/* ---- fake clock, deterministic random ------------------------------------ */

static uint64_t fake_now = 1000000;
static unsigned rand_counter;
static unsigned char last_random[BB_TOKEN_SIZE];

static uint64_t fake_clock(void *ctx)
{
	(void)ctx;
	return fake_now;
}

static void fake_random(void *ctx, unsigned char *buf, size_t n)
{
	(void)ctx;
	for (size_t i = 0; i < n; i++)
		buf[i] = (unsigned char)(0x5a ^ (rand_counter++ * 31u + i));
	if (n == BB_TOKEN_SIZE)
		memcpy(last_random, buf, n);
}

/* ---- fixture ------------------------------------------------------------- */

static broker *b;
static counting_backend host;
static counting_backend cuda;
static broker_error err;

static void make_broker(bool default_random)
{
	broker_config cfg;
	memset(&cfg, 0, sizeof(cfg));
	broker_limits_default(&cfg.limits);
	cfg.limits.token_ttl_ms = TTL_MS;
	cfg.now_ms = fake_clock;
	cfg.random = default_random ? NULL : fake_random;
	cfg.ctx = NULL;
	fake_now = 1000000;
	rand_counter = 0;
	counting_backend_init(&host, "test-host");
	counting_backend_init(&cuda, "test-cuda");
	b = broker_new(&cfg);
	cr_assert_not_null(b);
	broker_set_backend(b, BB_HOST, &host.be, NULL);
	broker_set_backend(b, BB_CUDA, NULL, "no GPU on this test node");
	memset(&err, 0, sizeof(err));
}

static void setup(void)
{
	make_broker(false);
}

static void teardown(void)
{
	if (b)
		broker_free(b);
	b = NULL;
}

TestSuite(broker, .init = setup, .fini = teardown);

static broker_conn *conn(uint32_t uid, uint32_t gid)
{
	broker_error e;
	broker_conn *c = broker_conn_open(b, uid, gid, 4242, &e);
	cr_assert_not_null(c, "conn_open: %s", e.msg);
	return c;
}

static broker_alloc_req req_of(uint64_t size, const char *name, int share)
{
	broker_alloc_req r = {
		.size = size,
		.kind = BB_HOST,
		.device = 0,
		.name = name,
		.share = share,
		.import_fd = -1,
	};
	return r;
}

/* Allocate a host buffer and return its id; the test fails if it cannot. */
static uint64_t alloc_named(broker_conn *c, uint64_t size, const char *name, int share)
{
	broker_alloc_req r = req_of(size, name, share);
	broker_buf *buf = NULL;
	broker_error e;
	int rc = broker_alloc(b, c, &r, &buf, &e);
	cr_assert_eq(rc, 0, "alloc: %d %s", rc, e.msg);
	cr_assert_not_null(buf);
	broker_info info;
	broker_buf_info(b, buf, c, &info);
	cr_assert_neq(info.id, 0);
	return info.id;
}

static uint64_t alloc_buf(broker_conn *c, uint64_t size)
{
	return alloc_named(c, size, NULL, BB_SHARE_UID);
}

static broker_info stat_of(broker_conn *c, uint64_t id)
{
	broker_info info;
	broker_error e;
	memset(&info, 0, sizeof(info));
	int rc = broker_stat_id(b, c, id, &info, &e);
	cr_assert_eq(rc, 0, "stat %llu: %d %s", (unsigned long long)id, rc, e.msg);
	return info;
}

static uint64_t refs_of(broker_conn *c, uint64_t id)
{
	return stat_of(c, id).refs;
}

/* ---- waiters ------------------------------------------------------------- */

typedef struct test_waiter {
	broker_waiter w; /* parked in the broker */
	int calls;       /* times wake ran */
	int code;        /* last wake's code */
	bb_state state;  /* last wake's state */
	char error[256]; /* last wake's error */
} test_waiter;

static void test_wake(broker_waiter *w, int code, bb_state state, const char *error)
{
	test_waiter *tw = container_of(w, test_waiter, w);
	tw->calls++;
	tw->code = code;
	tw->state = state;
	snprintf(tw->error, sizeof(tw->error), "%s", error ? error : "");
}

static void waiter_init(test_waiter *tw)
{
	memset(tw, 0, sizeof(*tw));
	tw->w.wake = test_wake;
	tw->state = (bb_state)-1;
}

/* Park tw on id; the test fails unless it parks. */
static void park(broker_conn *c, uint64_t id, test_waiter *tw)
{
	bb_state st = (bb_state)-1;
	char e[256] = "";
	broker_error be;
	waiter_init(tw);
	int rc = broker_wait(b, c, id, &tw->w, &st, e, &be);
	cr_assert_eq(rc, 0, "wait did not park: %d %s", rc, be.msg);
	cr_assert_eq(tw->calls, 0);
}

/* ---- references ---------------------------------------------------------- */

Test(broker, alloc_gives_one_ref_and_pending)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_alloc_req r = req_of(4096, "frame", BB_SHARE_UID);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, a, &info);
	cr_assert_eq(info.refs, 1);
	cr_assert_eq(info.held, 1);
	cr_assert_eq(info.tokens, 0);
	cr_assert_eq(info.state, BB_PENDING);
	cr_assert_eq(info.size, 4096);
	cr_assert_eq(info.kind, BB_HOST);
	cr_assert_str_eq(info.name, "frame");
	cr_assert_str_eq(info.error, "");
	cr_assert_eq(info.owner_uid, UID_A);
	cr_assert_eq(info.owner_gid, GID_A);
	cr_assert_eq(info.share, BB_SHARE_UID);
	cr_assert_eq(host.allocs, 1);
	cr_assert_eq(host.live, 1);
	cr_assert_eq(host.live_bytes, 4096);

	broker_info s = stat_of(a, info.id);
	cr_assert_eq(s.id, info.id);
	cr_assert_eq(s.refs, 1);
	cr_assert_eq(s.held, 1);
	cr_assert_eq(s.state, BB_PENDING);
}

Test(broker, refs_are_sum_of_connection_counts)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 64);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(refs_of(a, id), 2);
	cr_assert_eq(stat_of(a, id).held, 1);
	cr_assert_eq(stat_of(c, id).held, 1);

	uint64_t refs = 0;
	uint32_t held = 0;
	cr_assert_eq(broker_retain(b, c, id, 3, &refs, &held, &err), 0, "%s", err.msg);
	cr_assert_eq(refs, 5);
	cr_assert_eq(held, 4);
	cr_assert_eq(broker_release(b, c, id, 2, &refs, &held, &err), 0, "%s", err.msg);
	cr_assert_eq(refs, 3);
	cr_assert_eq(held, 2);
	cr_assert_eq(stat_of(a, id).refs, 3);
	cr_assert_eq(stat_of(a, id).held, 1);
	cr_assert_eq(stat_of(c, id).held, 2);
	/* A count of 0 is not a request. */
	cr_assert_eq(broker_retain(b, c, id, 0, NULL, NULL, &err), BB_ERR_INVALID);
	cr_assert_eq(broker_release(b, c, id, 0, NULL, NULL, &err), BB_ERR_INVALID);
	cr_assert_eq(stat_of(a, id).refs, 3);
	/* NULL outputs are allowed. */
	cr_assert_eq(broker_retain(b, a, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(refs_of(a, id), 4);
}

Test(broker, release_of_last_ref_frees_buffer)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_named(a, 777, "last", BB_SHARE_UID);
	cr_assert_eq(host.live, 1);
	uint64_t refs = 99;
	uint32_t held = 99;
	cr_assert_eq(broker_release(b, a, id, 1, &refs, &held, &err), 0, "%s", err.msg);
	cr_assert_eq(refs, 0);
	cr_assert_eq(held, 0);
	cr_assert_eq(host.live, 0);
	cr_assert_eq(host.live_bytes, 0);
	cr_assert_eq(host.frees, 1);

	broker_info info;
	cr_assert_eq(broker_stat_id(b, a, id, &info, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_stat_name(b, a, "last", &info, &err), BB_ERR_NOT_FOUND);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_open_id(b, a, id, &buf, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_retain(b, a, id, 1, NULL, NULL, &err), BB_ERR_NOT_FOUND);

	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 0);
	cr_assert_eq(t.bytes[BB_HOST], 0);
}

Test(broker, ids_are_never_reused)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id1 = alloc_buf(a, 8);
	cr_assert_eq(broker_release(b, a, id1, 1, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t id2 = alloc_buf(a, 8);
	cr_assert_neq(id2, id1);
	cr_assert_eq(broker_release(b, a, id2, 1, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t id3 = alloc_buf(a, 8);
	cr_assert_neq(id3, id1);
	cr_assert_neq(id3, id2);
	broker_info info;
	cr_assert_eq(broker_stat_id(b, a, id1, &info, &err), BB_ERR_NOT_FOUND);
}

Test(broker, release_more_than_held_is_invalid_and_changes_nothing)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 64);
	cr_assert_eq(broker_retain(b, a, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t refs = 77;
	uint32_t held = 77;
	err.msg[0] = '\0';
	cr_assert_eq(broker_release(b, a, id, 3, &refs, &held, &err), BB_ERR_INVALID);
	cr_assert_neq(err.msg[0], '\0', "no sentence in err");
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.refs, 2);
	cr_assert_eq(info.held, 2);
	/* A connection holding nothing cannot release either. */
	cr_assert_eq(broker_release(b, c, id, 1, NULL, NULL, &err), BB_ERR_INVALID);
	cr_assert_eq(refs_of(a, id), 2);
	cr_assert_eq(host.live, 1);
}

Test(broker, retain_and_release_of_unknown_id_is_not_found)
{
	broker_conn *a = conn(UID_A, GID_A);
	cr_assert_eq(broker_retain(b, a, 12345, 1, NULL, NULL, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_release(b, a, 12345, 1, NULL, NULL, &err), BB_ERR_NOT_FOUND);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, a, 12345, &buf, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_open_name(b, a, "nobody", &buf, &err), BB_ERR_NOT_FOUND);
}

Test(broker, holdings_count_buffers_and_bytes_of_a_connection)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id1 = alloc_buf(a, 100);
	uint64_t id2 = alloc_buf(a, 300);
	cr_assert_eq(broker_retain(b, a, id1, 4, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t n = 0, bytes = 0;
	broker_conn_holdings(a, &n, &bytes);
	cr_assert_eq(n, 2);
	cr_assert_eq(bytes, 400);
	cr_assert_eq(broker_release(b, a, id2, 1, NULL, NULL, &err), 0, "%s", err.msg);
	broker_conn_holdings(a, &n, &bytes);
	cr_assert_eq(n, 1);
	cr_assert_eq(bytes, 100);
}

/* ---- names ---------------------------------------------------------------- */

Test(broker, name_is_unique_among_live_buffers)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	alloc_named(a, 16, "kv-cache", BB_SHARE_UID);
	broker_alloc_req r = req_of(16, "kv-cache", BB_SHARE_UID);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_EXISTS);
	cr_assert_neq(err.msg[0], '\0');
	/* Another uid cannot take it either. */
	cr_assert_eq(broker_alloc(b, c, &r, &buf, &err), BB_ERR_EXISTS);
	/* Nothing leaked from the refused requests. */
	cr_assert_eq(host.live, 1);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 1);
}

Test(broker, name_is_free_again_after_buffer_freed)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id1 = alloc_named(a, 16, "reuse", BB_SHARE_UID);
	cr_assert_eq(broker_release(b, a, id1, 1, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t id2 = alloc_named(a, 32, "reuse", BB_SHARE_UID);
	cr_assert_neq(id1, id2);
	broker_info info;
	cr_assert_eq(broker_stat_name(b, a, "reuse", &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.id, id2);
	cr_assert_eq(info.size, 32);
}

Test(broker, open_by_name_adds_a_count)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_named(a, 16, "weights", BB_SHARE_UID);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_open_name(b, c, "weights", &buf, &err), 0, "%s", err.msg);
	cr_assert_not_null(buf);
	broker_info info;
	broker_buf_info(b, buf, c, &info);
	cr_assert_eq(info.id, id);
	cr_assert_eq(info.refs, 2);
	cr_assert_eq(info.held, 1);
	cr_assert_eq(broker_open_name(b, c, "weights", &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(stat_of(c, id).held, 2);
	cr_assert_eq(refs_of(a, id), 3);
	cr_assert_eq(broker_stat_name(b, c, "weights", &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.id, id);
	cr_assert_eq(info.held, 2);
}

Test(broker, open_by_id_adds_a_count)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_open_id(b, a, id, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, a, &info);
	cr_assert_eq(info.id, id);
	cr_assert_eq(info.refs, 2);
	cr_assert_eq(info.held, 2);
}

/* ---- argument checks ------------------------------------------------------ */

Test(broker, invalid_alloc_arguments_are_refused)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_buf *buf = NULL;
	broker_alloc_req r;

	r = req_of(0, NULL, BB_SHARE_UID);
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID, "size 0");
	cr_assert_neq(err.msg[0], '\0');

	r = req_of(16, NULL, BB_SHARE_UID);
	r.kind = (bb_kind)0;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID, "kind 0");
	r.kind = (bb_kind)3;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID, "kind 3");
	r.kind = (bb_kind)-1;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID, "kind -1");

	r = req_of(16, NULL, 3);
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID, "share 3");
	r = req_of(16, NULL, -1);
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID, "share -1");

	char long_name[BB_NAME_MAX + 2];
	memset(long_name, 'n', sizeof(long_name) - 1);
	long_name[BB_NAME_MAX + 1] = '\0'; /* BB_NAME_MAX + 1 bytes */
	r = req_of(16, long_name, BB_SHARE_UID);
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID, "name too long");

	cr_assert_eq(host.allocs, 0, "the backend was asked despite bad arguments");
	cr_assert_eq(host.live, 0);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 0);

	/* The longest allowed name works. */
	long_name[BB_NAME_MAX] = '\0';
	r = req_of(16, long_name, BB_SHARE_UID);
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, a, &info);
	cr_assert_str_eq(info.name, long_name);
}

Test(broker, empty_name_is_unnamed)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id1 = alloc_named(a, 16, "", BB_SHARE_UID);
	uint64_t id2 = alloc_named(a, 16, "", BB_SHARE_UID);
	cr_assert_neq(id1, id2);
	cr_assert_str_eq(stat_of(a, id1).name, "");
}

Test(broker, kind_without_backend_is_unsupported_with_reason)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_alloc_req r = req_of(16, NULL, BB_SHARE_UID);
	r.kind = BB_CUDA;
	broker_buf *buf = NULL;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_UNSUPPORTED);
	cr_assert_not_null(strstr(err.msg, "no GPU on this test node"), "message: %s", err.msg);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_CUDA], 0);
	cr_assert_eq(t.buffers[BB_HOST], 0);
}

Test(broker, backend_alloc_failure_propagates_and_leaks_nothing)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_alloc_req r = req_of(5000, "doomed", BB_SHARE_UID);
	broker_buf *buf = NULL;

	host.fail_code = BB_ERR_NO_MEMORY;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_NO_MEMORY);
	cr_assert_not_null(strstr(err.msg, "counting backend refuses 5000 bytes"), "message: %s",
			   err.msg);
	host.fail_code = BB_ERR_SYSTEM;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_SYSTEM);
	cr_assert_eq(host.allocs, 2);
	cr_assert_eq(host.live, 0);

	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 0);
	cr_assert_eq(t.bytes[BB_HOST], 0);
	uint64_t n = 9, bytes = 9;
	broker_conn_holdings(a, &n, &bytes);
	cr_assert_eq(n, 0);
	cr_assert_eq(bytes, 0);
	/* The name was not kept by the failed requests. */
	broker_info info;
	cr_assert_eq(broker_stat_name(b, a, "doomed", &info, &err), BB_ERR_NOT_FOUND);
	uint64_t id = alloc_named(a, 5000, "doomed", BB_SHARE_UID);
	cr_assert_eq(stat_of(a, id).refs, 1);
}

Test(broker, backend_grow_passes_through_and_changes_nothing)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_alloc_req r = req_of(5000, "later", BB_SHARE_UID);
	broker_buf *buf = NULL;
	broker_totals t;
	broker_info info;

	host.fail_code = BACKEND_GROW;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BACKEND_GROW);
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 0);
	cr_assert_eq(host.live, 0);
	cr_assert_eq(broker_stat_name(b, a, "later", &info, &err), BB_ERR_NOT_FOUND);
	/* The retry after the backend's job succeeds as a first try would. */
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), 0, "%s", err.msg);
	broker_buf_info(b, buf, a, &info);
	cr_assert_eq(stat_of(a, info.id).refs, 1);
	cr_assert_eq(host.live, 1);
}

Test(broker, import_fd_goes_through_backend_import)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_alloc_req r = req_of(8192, "imported", BB_SHARE_UID);
	r.import_fd = 42; /* the counting backend never touches it */
	broker_buf *buf = NULL;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(host.imports, 1);
	cr_assert_eq(host.allocs, 0);
	cr_assert_eq(host.last_import_fd, 42);
	cr_assert_eq(host.live, 1);
	broker_info info;
	broker_buf_info(b, buf, a, &info);
	cr_assert_eq(info.refs, 1);
	cr_assert_eq(info.state, BB_PENDING);
	cr_assert_eq(info.size, 8192);
	cr_assert_eq(broker_release(b, a, info.id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(host.live, 0);

	host.fail_code = BB_ERR_INVALID;
	r.name = NULL;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID);
	cr_assert_eq(host.live, 0);
}

Test(broker, import_on_a_backend_without_import_is_unsupported)
{
	host.be.import_fd = NULL;
	broker_conn *a = conn(UID_A, GID_A);
	broker_alloc_req r = req_of(64, NULL, BB_SHARE_UID);
	r.import_fd = 7;
	broker_buf *buf = NULL;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_UNSUPPORTED);
	cr_assert_neq(err.msg[0], '\0');
	cr_assert_eq(host.imports, 0);
	cr_assert_eq(host.allocs, 0);
	cr_assert_eq(host.live, 0);
}

Test(broker, export_goes_through_backend)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_alloc_req r = req_of(4321, NULL, BB_SHARE_UID);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), 0, "%s", err.msg);
	backend_export ex;
	memset(&ex, 0xff, sizeof(ex));
	cr_assert_eq(broker_buf_export(b, buf, &ex, &err), 0, "%s", err.msg);
	cr_assert_eq(host.exports, 1);
	cr_assert_eq(ex.fd, -1);
	cr_assert_eq(ex.allocation, 4321);
}

Test(broker, grant_to_the_owners_uid_exposes_nothing)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 64);
	broker_buf *buf;
	broker_granted g;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_grant(b, c, buf, &g, &err), 0, "%s", err.msg);
	cr_assert_eq(g.info.id, id);
	cr_assert_eq(g.info.held, 1);
	cr_assert_eq(g.ex.allocation, 64);
	cr_assert(!g.exposed);
	cr_assert_eq(host.exposes, 0);
}

Test(broker, grant_to_another_uid_exposes_the_memory_to_the_backend)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id = alloc_named(a, 16, NULL, BB_SHARE_ANY);
	broker_buf *buf;
	broker_granted g;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_grant(b, c, buf, &g, &err), 0, "%s", err.msg);
	cr_assert(g.exposed);
	cr_assert_eq(host.exposes, 1);
	/* The owner's own grant of the same buffer exposes nothing more. */
	cr_assert_eq(broker_open_id(b, a, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_grant(b, a, buf, &g, &err), 0, "%s", err.msg);
	cr_assert(!g.exposed);
	cr_assert_eq(host.exposes, 1);
}

Test(broker, failed_grant_gives_back_the_count_it_came_with)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id = alloc_named(a, 16, NULL, BB_SHARE_ANY);
	broker_buf *buf;
	broker_granted g;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(stat_of(a, id).refs, 2);
	host.fail_export = BB_ERR_SYSTEM;
	err.msg[0] = '\0';
	cr_assert_eq(broker_grant(b, c, buf, &g, &err), BB_ERR_SYSTEM);
	cr_assert_str_eq(err.msg, "counting backend cannot export");
	cr_assert_eq(host.exposes, 0, "nothing is exposed by a grant that failed");
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.refs, 1);
	cr_assert_eq(broker_release(b, c, id, 1, NULL, NULL, &err), BB_ERR_INVALID,
		     "the grantee holds nothing after the failed grant");
}

/* ---- async state ---------------------------------------------------------- */

Test(broker, set_ready_happens_exactly_once)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	cr_assert_eq(broker_set_ready(b, a, id, &err), 0, "%s", err.msg);
	cr_assert_eq(stat_of(a, id).state, BB_READY);
	cr_assert_eq(broker_set_ready(b, a, id, &err), BB_ERR_STATE);
	cr_assert_neq(err.msg[0], '\0');
	cr_assert_eq(broker_set_error(b, a, id, "late", &err), BB_ERR_STATE);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.state, BB_READY);
	cr_assert_str_eq(info.error, "");
}

Test(broker, set_error_happens_exactly_once_and_keeps_message)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	cr_assert_eq(broker_set_error(b, a, id, "decoder crashed", &err), 0, "%s", err.msg);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_str_eq(info.error, "decoder crashed");
	cr_assert_eq(broker_set_error(b, a, id, "again", &err), BB_ERR_STATE);
	cr_assert_eq(broker_set_ready(b, a, id, &err), BB_ERR_STATE);
	info = stat_of(a, id);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_str_eq(info.error, "decoder crashed");
}

/* A long message is cut to 255 bytes between two characters, never inside
 * one: it travels as UTF-8 (Stat, Wait, List). */
Test(broker, set_error_cuts_a_long_message_between_characters)
{
	broker_conn *a = conn(UID_A, GID_A);
	char msg[301];
	for (int i = 0; i < 150; i++)
		memcpy(msg + 2 * i, "\xc3\xa9", 2); /* U+00E9, two bytes */
	msg[300] = '\0';
	uint64_t id = alloc_buf(a, 16);
	cr_assert_eq(broker_set_error(b, a, id, msg, &err), 0, "%s", err.msg);
	broker_info info = stat_of(a, id);
	cr_assert_eq(strlen(info.error), 254,
		     "the message kept %zu bytes, not 254 (127 whole characters)",
		     strlen(info.error));
	cr_assert_eq(memcmp(info.error, msg, 254), 0);

	/* Three- and four-byte characters too: 85 of three bytes are 255. */
	uint64_t id3 = alloc_buf(a, 16), id4 = alloc_buf(a, 16);
	for (int i = 0; i < 100; i++)
		memcpy(msg + 3 * i, "\xe2\x82\xac", 3); /* U+20AC */
	msg[300] = '\0';
	cr_assert_eq(broker_set_error(b, a, id3, msg, &err), 0, "%s", err.msg);
	cr_assert_eq(strlen(stat_of(a, id3).error), 255);
	for (int i = 0; i < 75; i++)
		memcpy(msg + 4 * i, "\xf0\x9f\x98\x80", 4); /* U+1F600 */
	msg[300] = '\0';
	cr_assert_eq(broker_set_error(b, a, id4, msg, &err), 0, "%s", err.msg);
	cr_assert_eq(strlen(stat_of(a, id4).error), 252);
}

Test(broker, name_that_is_not_utf8_is_invalid)
{
	broker_conn *a = conn(UID_A, GID_A);
	const char *const bad[] = {"\xff", "caf\xc3", "\xc0\xaf", "\xed\xa0\x80",
				   "a\x80"
				   "b"};
	broker_buf *buf = NULL;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		broker_alloc_req r = req_of(16, bad[i], BB_SHARE_UID);
		cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_INVALID, "name %zu", i);
		cr_assert_not_null(strstr(err.msg, "UTF-8"), "message: %s", err.msg);
		cr_assert_eq(broker_open_name(b, a, bad[i], &buf, &err), BB_ERR_INVALID);
	}
	cr_assert_eq(host.allocs, 0, "the backend was asked for an invalid name");
	/* Characters beyond ASCII are fine. */
	uint64_t id = alloc_named(a, 16, "caf\xc3\xa9-\xf0\x9f\x98\x80", BB_SHARE_UID);
	cr_assert_str_eq(stat_of(a, id).name, "caf\xc3\xa9-\xf0\x9f\x98\x80");
}

Test(broker, set_state_of_unknown_id_is_not_found)
{
	broker_conn *a = conn(UID_A, GID_A);
	cr_assert_eq(broker_set_ready(b, a, 999, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_set_error(b, a, 999, "x", &err), BB_ERR_NOT_FOUND);
}

Test(broker, producer_may_set_ready_after_taking_last_ref_into_token)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	cr_assert_eq(refs_of(a, id), 1);
	cr_assert_eq(stat_of(a, id).held, 0);
	cr_assert_eq(broker_set_ready(b, a, id, &err), 0, "%s", err.msg);
	cr_assert_eq(stat_of(a, id).state, BB_READY);
}

Test(broker, producer_may_set_error_after_taking_last_ref_into_token)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_set_error(b, a, id, "oops", &err), 0, "%s", err.msg);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_str_eq(info.error, "oops");
}

Test(broker, any_holder_may_set_ready)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id = alloc_named(a, 16, NULL, BB_SHARE_ANY);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_set_ready(b, c, id, &err), 0, "%s", err.msg);
	cr_assert_eq(stat_of(a, id).state, BB_READY);
}

Test(broker, any_holder_may_set_error)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_set_error(b, c, id, "consumer gave up", &err), 0, "%s", err.msg);
	cr_assert_str_eq(stat_of(a, id).error, "consumer gave up");
}

Test(broker, non_holder_non_producer_may_not_set_state)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_named(a, 16, NULL, BB_SHARE_ANY);
	err.msg[0] = '\0';
	cr_assert_eq(broker_set_ready(b, c, id, &err), BB_ERR_DENIED);
	cr_assert_neq(err.msg[0], '\0');
	cr_assert_eq(broker_set_error(b, c, id, "nope", &err), BB_ERR_DENIED);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.state, BB_PENDING);
	cr_assert_str_eq(info.error, "");
}

Test(broker, former_holder_may_not_set_state)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_release(b, c, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_set_ready(b, c, id, &err), BB_ERR_DENIED);
	cr_assert_eq(stat_of(a, id).state, BB_PENDING);
}

/* ---- waits ---------------------------------------------------------------- */

Test(broker, waiters_wake_once_on_ready)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	test_waiter w1, w2;
	park(c, id, &w1);
	park(c, id, &w2);
	cr_assert_eq(w1.w.conn, c);
	cr_assert_not_null(w1.w.buf);
	cr_assert_eq(broker_set_ready(b, a, id, &err), 0, "%s", err.msg);
	cr_assert_eq(w1.calls, 1);
	cr_assert_eq(w1.code, 0);
	cr_assert_eq(w1.state, BB_READY);
	cr_assert_eq(w2.calls, 1);
	cr_assert_eq(w2.state, BB_READY);
	cr_assert_null(w1.w.buf);
	/* Nothing more happens to them later. */
	cr_assert_eq(broker_release(b, c, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_release(b, a, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(w1.calls, 1);
	cr_assert_eq(w2.calls, 1);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 0);
}

Test(broker, waiters_wake_once_on_error_with_message)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	test_waiter w;
	park(a, id, &w);
	cr_assert_eq(broker_set_error(b, a, id, "bad input", &err), 0, "%s", err.msg);
	cr_assert_eq(w.calls, 1);
	cr_assert_eq(w.code, 0);
	cr_assert_eq(w.state, BB_FAILED);
	cr_assert_str_eq(w.error, "bad input");
	cr_assert_eq(broker_set_ready(b, a, id, &err), BB_ERR_STATE);
	cr_assert_eq(w.calls, 1);
}

Test(broker, wait_returns_at_once_when_not_pending)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t ready = alloc_buf(a, 16);
	uint64_t failed = alloc_buf(a, 16);
	cr_assert_eq(broker_set_ready(b, a, ready, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_set_error(b, a, failed, "broken", &err), 0, "%s", err.msg);

	test_waiter w;
	bb_state st = (bb_state)-1;
	char e[256];
	waiter_init(&w);
	memset(e, 'x', sizeof(e));
	cr_assert_eq(broker_wait(b, a, ready, &w.w, &st, e, &err), 1);
	cr_assert_eq(st, BB_READY);
	cr_assert_str_eq(e, "");
	cr_assert_eq(w.calls, 0);

	waiter_init(&w);
	st = (bb_state)-1;
	cr_assert_eq(broker_wait(b, a, failed, &w.w, &st, e, &err), 1);
	cr_assert_eq(st, BB_FAILED);
	cr_assert_str_eq(e, "broken");
	cr_assert_eq(w.calls, 0);

	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 0, "nothing may be parked");
}

Test(broker, wait_on_unknown_id_is_not_found)
{
	broker_conn *a = conn(UID_A, GID_A);
	test_waiter w;
	bb_state st;
	char e[256];
	waiter_init(&w);
	cr_assert_eq(broker_wait(b, a, 31337, &w.w, &st, e, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(w.calls, 0);
}

Test(broker, cancelled_waiter_does_not_wake)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	test_waiter w, other;
	park(a, id, &w);
	park(a, id, &other);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 2);
	broker_wait_cancel(b, &w.w);
	cr_assert_null(w.w.buf);
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 1);
	cr_assert_eq(broker_set_ready(b, a, id, &err), 0, "%s", err.msg);
	cr_assert_eq(w.calls, 0);
	cr_assert_eq(other.calls, 1);
}

Test(broker, waiters_get_not_found_when_buffer_freed)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id = alloc_named(a, 16, NULL, BB_SHARE_ANY);
	test_waiter w;
	park(c, id, &w); /* c does not hold it: the policy admits it */
	cr_assert_eq(broker_release(b, a, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(host.live, 0);
	cr_assert_eq(w.calls, 1);
	cr_assert_eq(w.code, BB_ERR_NOT_FOUND);
	cr_assert_null(w.w.buf);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 0);
}

Test(broker, producer_disconnect_while_pending_fails_buffer_and_wakes_waiters)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	test_waiter w;
	park(c, id, &w);
	broker_conn_close(b, a);
	cr_assert_eq(w.calls, 1);
	cr_assert_eq(w.code, 0);
	cr_assert_eq(w.state, BB_FAILED);
	cr_assert_not_null(strstr(w.error, "producer disconnected"), "error: %s", w.error);
	broker_info info = stat_of(c, id);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_not_null(strstr(info.error, "producer disconnected"), "error: %s", info.error);
	cr_assert_eq(info.refs, 1);
	cr_assert_eq(host.live, 1);
}

Test(broker, producer_disconnect_while_pending_fails_buffer_kept_by_token)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	broker_conn_close(b, a);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, c, &info);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_not_null(strstr(info.error, "producer disconnected"), "error: %s", info.error);
}

Test(broker, producer_disconnect_after_ready_leaves_ready)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_set_ready(b, a, id, &err), 0, "%s", err.msg);
	broker_conn_close(b, a);
	broker_info info = stat_of(c, id);
	cr_assert_eq(info.state, BB_READY);
	cr_assert_str_eq(info.error, "");
	cr_assert_eq(info.refs, 1);
}

Test(broker, non_producer_disconnect_leaves_pending)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	broker_conn_close(b, c);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.state, BB_PENDING);
	cr_assert_eq(info.refs, 1);
}

Test(broker, connection_close_drops_its_waiters_without_waking)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	test_waiter w;
	park(c, id, &w);
	broker_conn_close(b, c);
	cr_assert_eq(w.calls, 0);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 0);
	cr_assert_eq(broker_set_ready(b, a, id, &err), 0, "%s", err.msg);
	cr_assert_eq(w.calls, 0);
}

/* ---- connections ---------------------------------------------------------- */

Test(broker, connection_close_releases_all_its_counts)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t shared = alloc_buf(a, 100);
	uint64_t own = alloc_buf(a, 200);
	cr_assert_eq(broker_retain(b, a, shared, 2, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_retain(b, a, own, 5, NULL, NULL, &err), 0, "%s", err.msg);
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, shared, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(refs_of(c, shared), 4);
	cr_assert_eq(host.live, 2);

	broker_conn_close(b, a);
	cr_assert_eq(host.live, 1, "the buffer only a held must be freed");
	cr_assert_eq(host.live_bytes, 100);
	cr_assert_eq(refs_of(c, shared), 1);
	broker_info info;
	cr_assert_eq(broker_stat_id(b, c, own, &info, &err), BB_ERR_NOT_FOUND);

	broker_conn_close(b, c);
	cr_assert_eq(host.live, 0);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 0);
	cr_assert_eq(t.connections, 0);
}

Test(broker, connection_reports_uid_and_pid)
{
	broker_conn *c = broker_conn_open(b, 1234, 5678, 91011, &err);
	cr_assert_not_null(c, "%s", err.msg);
	cr_assert_eq(broker_conn_uid(c), 1234);
	cr_assert_eq(broker_conn_pid(c), 91011);
}

/* ---- tokens --------------------------------------------------------------- */

Test(broker, take_moves_a_reference_into_a_token)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	cr_assert_eq(broker_retain(b, a, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.refs, 2);
	cr_assert_eq(info.held, 1);
	cr_assert_eq(info.tokens, 1);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.tokens, 1);
}

Test(broker, take_with_retain_adds_a_reference)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, true, tok, &err), 0, "%s", err.msg);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.refs, 2);
	cr_assert_eq(info.held, 1);
	cr_assert_eq(info.tokens, 1);
}

Test(broker, adopt_moves_token_reference_to_adopter)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, true, tok, &err), 0, "%s", err.msg);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, c, &info);
	cr_assert_eq(info.id, id);
	cr_assert_eq(info.refs, 2);
	cr_assert_eq(info.held, 1);
	cr_assert_eq(info.tokens, 0);
	cr_assert_eq(stat_of(a, id).held, 1);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.tokens, 0);
}

Test(broker, second_adopt_of_a_token_is_not_found)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, true, tok, &err), 0, "%s", err.msg);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_adopt(b, a, tok, &buf, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(refs_of(a, id), 2);
	cr_assert_eq(stat_of(c, id).held, 1);
}

Test(broker, adopt_of_unknown_token_is_not_found)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, true, tok, &err), 0, "%s", err.msg);
	unsigned char wrong[BB_TOKEN_SIZE];
	broker_buf *buf = NULL;
	/* Every one of the 128 bits matters. */
	for (int bit = 0; bit < 8 * BB_TOKEN_SIZE; bit++) {
		memcpy(wrong, tok, sizeof(wrong));
		wrong[bit / 8] ^= (unsigned char)(1u << (bit % 8));
		cr_assert_eq(broker_adopt(b, a, wrong, &buf, &err), BB_ERR_NOT_FOUND, "bit %d",
			     bit);
	}
	memset(wrong, 0, sizeof(wrong));
	cr_assert_eq(broker_adopt(b, a, wrong, &buf, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(stat_of(a, id).tokens, 1);
	cr_assert_eq(refs_of(a, id), 2);
}

Test(broker, take_by_non_holder_is_not_found)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_named(a, 16, NULL, BB_SHARE_ANY);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, c, id, false, tok, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_take(b, c, id, true, tok, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_take(b, c, 4242, false, tok, &err), BB_ERR_NOT_FOUND);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.refs, 1);
	cr_assert_eq(info.tokens, 0);
}

Test(broker, token_is_the_random_source_bytes)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char t1[BB_TOKEN_SIZE], t2[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, true, t1, &err), 0, "%s", err.msg);
	cr_assert_eq(memcmp(t1, last_random, BB_TOKEN_SIZE), 0);
	cr_assert_eq(broker_take(b, a, id, true, t2, &err), 0, "%s", err.msg);
	cr_assert_eq(memcmp(t2, last_random, BB_TOKEN_SIZE), 0);
	cr_assert_neq(memcmp(t1, t2, BB_TOKEN_SIZE), 0);
	cr_assert_eq(stat_of(a, id).tokens, 2);
	cr_assert_eq(refs_of(a, id), 3);
}

TestSuite(broker_default_random, .fini = teardown);

Test(broker_default_random, tokens_from_getrandom_differ)
{
	make_broker(true);
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char t1[BB_TOKEN_SIZE], t2[BB_TOKEN_SIZE], zero[BB_TOKEN_SIZE] = {0};
	cr_assert_eq(broker_take(b, a, id, true, t1, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_take(b, a, id, true, t2, &err), 0, "%s", err.msg);
	cr_assert_neq(memcmp(t1, t2, BB_TOKEN_SIZE), 0);
	cr_assert_neq(memcmp(t1, zero, BB_TOKEN_SIZE), 0);
	cr_assert_neq(memcmp(t2, zero, BB_TOKEN_SIZE), 0);
	broker_buf *buf;
	cr_assert_eq(broker_adopt(b, a, t2, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_adopt(b, a, t1, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(stat_of(a, id).held, 3);
	broker_free(b);
	b = NULL;
	cr_assert_eq(host.live, 0);
}

Test(broker, tokens_outlive_their_maker_until_adopted)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	broker_conn_close(b, a);
	cr_assert_eq(host.live, 1, "the token must keep the buffer");
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.tokens, 1);
	cr_assert_eq(t.buffers[BB_HOST], 1);

	broker_conn *c = conn(UID_A, GID_A);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, c, &info);
	cr_assert_eq(info.id, id);
	cr_assert_eq(info.refs, 1);
	cr_assert_eq(info.held, 1);
	cr_assert_eq(info.tokens, 0);
	cr_assert_eq(broker_release(b, c, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(host.live, 0);
}

Test(broker, expired_token_releases_its_reference)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	cr_assert_eq(broker_expire_tokens(b), UINT64_MAX, "no token is live");
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	broker_conn_close(b, a);

	cr_assert_eq(broker_expire_tokens(b), TTL_MS);
	fake_now += 400;
	cr_assert_eq(broker_expire_tokens(b), TTL_MS - 400);
	fake_now += TTL_MS - 400 - 1;
	cr_assert_eq(broker_expire_tokens(b), 1);
	cr_assert_eq(host.live, 1, "the token is not yet expired");
	fake_now += 2;
	cr_assert_eq(broker_expire_tokens(b), UINT64_MAX);
	cr_assert_eq(host.live, 0, "the expired token's buffer must be freed");

	broker_conn *c = conn(UID_A, GID_A);
	broker_buf *buf;
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), BB_ERR_NOT_FOUND);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.tokens, 0);
	cr_assert_eq(t.buffers[BB_HOST], 0);
}

Test(broker, token_past_its_ttl_cannot_be_adopted_before_the_sweep)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	fake_now += TTL_MS + 1; /* no broker_expire_tokens in between */
	broker_buf *buf = NULL;
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(host.live, 0, "the expired token's reference was the last");
	uint64_t n = 9, bytes = 9;
	broker_conn_holdings(c, &n, &bytes);
	cr_assert_eq(n, 0);
	cr_assert_eq(broker_expire_tokens(b), UINT64_MAX);
}

Test(broker, expiry_keeps_buffer_other_holders_hold)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char t1[BB_TOKEN_SIZE], t2[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, true, t1, &err), 0, "%s", err.msg);
	fake_now += 300;
	cr_assert_eq(broker_take(b, a, id, true, t2, &err), 0, "%s", err.msg);
	cr_assert_eq(refs_of(a, id), 3);
	cr_assert_eq(broker_expire_tokens(b), TTL_MS - 300);
	fake_now += TTL_MS - 300 + 1; /* t1 expired, t2 has 299 ms left */
	cr_assert_eq(broker_expire_tokens(b), 299);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.refs, 2);
	cr_assert_eq(info.tokens, 1);
	broker_buf *buf;
	cr_assert_eq(broker_adopt(b, a, t1, &buf, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_adopt(b, a, t2, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_expire_tokens(b), UINT64_MAX);
	cr_assert_eq(stat_of(a, id).held, 2);
	cr_assert_eq(host.live, 1);
}

Test(broker, token_admits_a_different_uid)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id = alloc_named(a, 16, "private", BB_SHARE_UID);
	broker_buf *buf = NULL;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), BB_ERR_DENIED);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, true, tok, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, c, &info);
	cr_assert_eq(info.id, id);
	cr_assert_eq(info.held, 1);
	/* Holding it, the other uid may now stat, retain and wait on it. */
	info = stat_of(c, id);
	cr_assert_eq(info.refs, 2);
	cr_assert_eq(broker_retain(b, c, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	test_waiter w;
	park(c, id, &w);
	cr_assert_eq(broker_set_ready(b, c, id, &err), 0, "%s", err.msg);
	cr_assert_eq(w.calls, 1);
}

/* ---- share policy --------------------------------------------------------- */

Test(broker, share_uid_admits_same_uid)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_B);
	uint64_t id = alloc_named(a, 16, "mine", BB_SHARE_UID);
	broker_buf *buf;
	broker_info info;
	cr_assert_eq(broker_stat_id(b, c, id, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.held, 0);
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_open_name(b, c, "mine", &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_retain(b, c, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(refs_of(a, id), 4);
}

Test(broker, share_uid_denies_other_uid)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_A); /* same gid does not matter */
	uint64_t id = alloc_named(a, 16, "mine", BB_SHARE_UID);
	broker_buf *buf = NULL;
	broker_info info;
	test_waiter w;
	bb_state st;
	char e[256];
	err.msg[0] = '\0';
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), BB_ERR_DENIED);
	cr_assert_neq(err.msg[0], '\0');
	cr_assert_eq(broker_open_name(b, c, "mine", &buf, &err), BB_ERR_DENIED);
	cr_assert_eq(broker_retain(b, c, id, 1, NULL, NULL, &err), BB_ERR_DENIED);
	cr_assert_eq(broker_stat_id(b, c, id, &info, &err), BB_ERR_DENIED);
	cr_assert_eq(broker_stat_name(b, c, "mine", &info, &err), BB_ERR_DENIED);
	waiter_init(&w);
	cr_assert_eq(broker_wait(b, c, id, &w.w, &st, e, &err), BB_ERR_DENIED);
	cr_assert_eq(refs_of(a, id), 1);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 0);
	uint64_t n = 9, bytes = 9;
	broker_conn_holdings(c, &n, &bytes);
	cr_assert_eq(n, 0);
}

Test(broker, share_gid_admits_same_gid_and_denies_other)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *same = conn(UID_B, GID_A);
	broker_conn *other = conn(UID_B, GID_B);
	uint64_t id = alloc_named(a, 16, "team", BB_SHARE_GID);
	broker_buf *buf;
	broker_info info;
	cr_assert_eq(broker_open_id(b, same, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_open_name(b, same, "team", &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_stat_id(b, same, id, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.held, 2);

	cr_assert_eq(broker_open_id(b, other, id, &buf, &err), BB_ERR_DENIED);
	cr_assert_eq(broker_open_name(b, other, "team", &buf, &err), BB_ERR_DENIED);
	cr_assert_eq(broker_retain(b, other, id, 1, NULL, NULL, &err), BB_ERR_DENIED);
	cr_assert_eq(broker_stat_id(b, other, id, &info, &err), BB_ERR_DENIED);
	test_waiter w;
	bb_state st;
	char e[256];
	waiter_init(&w);
	cr_assert_eq(broker_wait(b, other, id, &w.w, &st, e, &err), BB_ERR_DENIED);
	cr_assert_eq(refs_of(a, id), 3);
}

Test(broker, share_any_admits_every_uid)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id = alloc_named(a, 16, "public", BB_SHARE_ANY);
	broker_buf *buf;
	broker_info info;
	cr_assert_eq(broker_stat_id(b, c, id, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_open_name(b, c, "public", &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_retain(b, c, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	test_waiter w;
	park(c, id, &w);
	cr_assert_eq(refs_of(a, id), 4);
	cr_assert_eq(stat_of(c, id).held, 3);
	broker_wait_cancel(b, &w.w);
}

/* Holding a reference is permission enough under every share policy: a
 * connection of another uid and another gid, refused while it holds
 * nothing (but by BB_SHARE_ANY), adopts a token and then stats, opens,
 * retains, waits on, sets ready and releases the buffer. */
Test(broker, holder_is_admitted_whatever_the_policy)
{
	static const int policies[] = {BB_SHARE_UID, BB_SHARE_GID, BB_SHARE_ANY};
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);

	for (size_t i = 0; i < sizeof(policies) / sizeof(policies[0]); i++) {
		int share = policies[i];
		uint64_t id = alloc_named(a, 16, NULL, share);
		unsigned char tok[BB_TOKEN_SIZE];
		broker_buf *buf = NULL;
		broker_info info;
		test_waiter w;

		cr_assert_eq(broker_stat_id(b, c, id, &info, &err),
			     share == BB_SHARE_ANY ? 0 : BB_ERR_DENIED, "share %d, holding nothing",
			     share);
		/* The owner's only count moves to c: c is the one holder. */
		cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
		cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), 0, "%s", err.msg);
		cr_assert_eq(stat_of(c, id).held, 1, "share %d", share);
		cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "share %d: open: %s", share,
			     err.msg);
		cr_assert_eq(broker_retain(b, c, id, 1, NULL, NULL, &err), 0,
			     "share %d: retain: %s", share, err.msg);
		cr_assert_eq(stat_of(c, id).held, 3, "share %d", share);
		park(c, id, &w);
		cr_assert_eq(broker_set_ready(b, c, id, &err), 0, "share %d: set_ready: %s", share,
			     err.msg);
		cr_assert_eq(w.calls, 1, "share %d: the holder's wait woke", share);
		cr_assert_eq(w.state, BB_READY);
		cr_assert_eq(broker_release(b, c, id, 3, NULL, NULL, &err), 0,
			     "share %d: release: %s", share, err.msg);
		cr_assert_eq(broker_stat_id(b, a, id, &info, &err), BB_ERR_NOT_FOUND,
			     "share %d: the holder's last release frees it", share);
	}
}

static int collect_ids(const broker_info *info, void *arg)
{
	uint64_t *ids = arg; /* ids[0] = count, then ids */
	ids[1 + ids[0]++] = info->id;
	return 0;
}

Test(broker, list_shows_only_what_caller_may_see)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	broker_conn *g = conn(UID_B, GID_A);
	uint64_t priv = alloc_named(a, 16, NULL, BB_SHARE_UID);
	uint64_t team = alloc_named(a, 16, NULL, BB_SHARE_GID);
	uint64_t pub = alloc_named(a, 16, NULL, BB_SHARE_ANY);
	uint64_t held = alloc_named(a, 16, NULL, BB_SHARE_UID);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, held, true, tok, &err), 0, "%s", err.msg);
	broker_buf *buf;
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), 0, "%s", err.msg);
	uint64_t theirs = alloc_named(c, 16, NULL, BB_SHARE_UID);

	uint64_t ids[16] = {0};
	broker_list(b, a, collect_ids, ids);
	cr_assert_eq(ids[0], 4, "owner sees its four");
	cr_assert_eq(ids[1], priv);
	cr_assert_eq(ids[2], team);
	cr_assert_eq(ids[3], pub);
	cr_assert_eq(ids[4], held);

	memset(ids, 0, sizeof(ids));
	broker_list(b, c, collect_ids, ids);
	cr_assert_eq(ids[0], 3, "other uid sees public, held and its own");
	cr_assert_eq(ids[1], pub);
	cr_assert_eq(ids[2], held);
	cr_assert_eq(ids[3], theirs);

	memset(ids, 0, sizeof(ids));
	broker_list(b, g, collect_ids, ids);
	cr_assert_eq(ids[0], 3, "same gid sees team and public, plus uid B's own");
	cr_assert_eq(ids[1], team);
	cr_assert_eq(ids[2], pub);
	cr_assert_eq(ids[3], theirs);
}

Test(broker, list_as_root_shows_everything)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	broker_conn *root = conn(0, 0);
	uint64_t id1 = alloc_named(a, 16, NULL, BB_SHARE_UID);
	uint64_t id2 = alloc_named(c, 16, NULL, BB_SHARE_GID);
	uint64_t ids[16] = {0};
	broker_list(b, root, collect_ids, ids);
	cr_assert_eq(ids[0], 2);
	cr_assert_eq(ids[1], id1);
	cr_assert_eq(ids[2], id2);
}

Test(broker, root_is_admitted_by_every_policy)
{
	/* As implemented (broker.c admits): uid 0 passes every share policy,
	 * as it sees every buffer in broker_list. */
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *root = conn(0, 0);
	uint64_t id = alloc_named(a, 16, "private", BB_SHARE_UID);
	broker_buf *buf;
	broker_info info;
	cr_assert_eq(broker_stat_id(b, root, id, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.held, 0);
	cr_assert_eq(broker_open_name(b, root, "private", &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(refs_of(a, id), 2);
}

static int stop_after_one(const broker_info *info, void *arg)
{
	(void)info;
	(*(int *)arg)++;
	return 1;
}

Test(broker, list_stops_when_callback_says_so)
{
	broker_conn *a = conn(UID_A, GID_A);
	alloc_buf(a, 16);
	alloc_buf(a, 16);
	alloc_buf(a, 16);
	int calls = 0;
	broker_list(b, a, stop_after_one, &calls);
	cr_assert_eq(calls, 1);
}

static int check_list_info(const broker_info *info, void *arg)
{
	broker_info *out = arg;
	*out = *info;
	return 0;
}

Test(broker, list_reports_held_and_refs_for_the_caller)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_named(a, 64, "l", BB_SHARE_UID);
	cr_assert_eq(broker_retain(b, a, id, 2, NULL, NULL, &err), 0, "%s", err.msg);
	broker_info info;
	memset(&info, 0, sizeof(info));
	broker_list(b, a, check_list_info, &info);
	cr_assert_eq(info.id, id);
	cr_assert_eq(info.size, 64);
	cr_assert_eq(info.refs, 3);
	cr_assert_eq(info.held, 3);
	cr_assert_str_eq(info.name, "l");
}

/* ---- clock ---------------------------------------------------------------- */

Test(broker, age_follows_the_clock)
{
	broker_conn *a = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	cr_assert_eq(stat_of(a, id).age_ms, 0);
	fake_now += 250;
	cr_assert_eq(stat_of(a, id).age_ms, 250);
}

/* ---- limits --------------------------------------------------------------- */

static void set_limits(void (*edit)(broker_limits *l))
{
	broker_limits l = *broker_get_limits(b);
	edit(&l);
	broker_set_limits(b, &l);
}

Test(broker, limits_default_are_bounded)
{
	broker_limits l;
	memset(&l, 0, sizeof(l));
	broker_limits_default(&l);
	cr_assert_gt(l.uid_bytes[BB_HOST], 0);
	cr_assert_neq(l.uid_bytes[BB_HOST], UINT64_MAX);
	cr_assert_eq(l.uid_buffers, 65536);
	cr_assert_eq(l.host_buffers, 65536);
	cr_assert_eq(l.connections, 1024);
	cr_assert_eq(l.conn_tokens, 4096);
	cr_assert_eq(l.conn_waits, 1024);
	cr_assert_eq(l.token_ttl_ms, 60000);
}

Test(broker, limits_set_are_the_limits_got)
{
	broker_limits l = *broker_get_limits(b);
	cr_assert_eq(l.token_ttl_ms, TTL_MS);
	l.uid_buffers = 7;
	l.conn_waits = 3;
	broker_set_limits(b, &l);
	cr_assert_eq(broker_get_limits(b)->uid_buffers, 7);
	cr_assert_eq(broker_get_limits(b)->conn_waits, 3);
}

static void limit_buffers(broker_limits *l)
{
	l->uid_buffers = 3;
}

Test(broker, uid_buffer_limit_refuses_with_numbers)
{
	set_limits(limit_buffers);
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *a2 = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id1 = alloc_buf(a, 16);
	alloc_buf(a, 16);
	alloc_buf(a2, 16); /* the limit is per uid, not per connection */
	broker_alloc_req r = req_of(16, NULL, BB_SHARE_UID);
	broker_buf *buf;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_NO_MEMORY);
	cr_assert_not_null(strstr(err.msg, "3"), "message: %s", err.msg);
	cr_assert_eq(host.live, 3);
	/* Another uid has its own quota. */
	alloc_buf(c, 16);
	/* Freeing one makes room. */
	cr_assert_eq(broker_release(b, a, id1, 1, NULL, NULL, &err), 0, "%s", err.msg);
	alloc_buf(a, 16);
}

static void limit_host_buffers(broker_limits *l)
{
	l->host_buffers = 3;
}

Test(broker, host_buffer_limit_counts_every_uid_and_no_cuda_buffer)
{
	broker_set_backend(b, BB_CUDA, &cuda.be, NULL);
	set_limits(limit_host_buffers);
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id1 = alloc_buf(a, 16);
	alloc_buf(a, 16);
	alloc_buf(c, 16); /* every uid's host buffers count */
	broker_alloc_req r = req_of(16, NULL, BB_SHARE_UID);
	broker_buf *buf;
	cr_assert_eq(broker_alloc(b, c, &r, &buf, &err), BB_ERR_NO_MEMORY);
	cr_assert_str_eq(
		err.msg,
		"the daemon would hold 4 host buffers; the limit is 3 (--max-host-buffers)");
	cr_assert_eq(host.allocs, 3, "the backend was asked despite the limit");
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.refused[BROKER_LIMIT_HOST_BUFFERS], 1);
	cr_assert_eq(t.refused[BROKER_LIMIT_UID_BUFFERS], 0);
	/* A CUDA buffer holds no fd of the daemon's: not counted. */
	r.kind = BB_CUDA;
	cr_assert_eq(broker_alloc(b, c, &r, &buf, &err), 0, "%s", err.msg);
	/* Freeing a host buffer makes room. */
	cr_assert_eq(broker_release(b, a, id1, 1, NULL, NULL, &err), 0, "%s", err.msg);
	alloc_buf(c, 16);
}

static void limit_host_bytes(broker_limits *l)
{
	l->uid_bytes[BB_HOST] = 900;
}

Test(broker, uid_byte_limit_refuses_with_numbers)
{
	set_limits(limit_host_bytes);
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id1 = alloc_buf(a, 600);
	broker_alloc_req r = req_of(400, NULL, BB_SHARE_UID);
	broker_buf *buf;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_NO_MEMORY);
	cr_assert_not_null(strstr(err.msg, "900"), "message: %s", err.msg);
	cr_assert_eq(host.allocs, 1, "the backend was asked despite the quota");
	cr_assert_eq(host.live, 1);
	/* One over the limit by itself. */
	r.size = 901;
	cr_assert_eq(broker_alloc(b, c, &r, &buf, &err), BB_ERR_NO_MEMORY);
	/* Exactly up to the limit is fine, per uid. */
	alloc_buf(a, 300);
	alloc_buf(c, 900);
	cr_assert_eq(broker_release(b, a, id1, 1, NULL, NULL, &err), 0, "%s", err.msg);
	alloc_buf(a, 600);
}

static void limit_cuda_bytes(broker_limits *l)
{
	l->uid_bytes[BB_HOST] = 900;
	l->uid_bytes[BB_CUDA] = 300;
}

Test(broker, uid_byte_limit_is_per_kind)
{
	broker_set_backend(b, BB_CUDA, &cuda.be, NULL);
	set_limits(limit_cuda_bytes);
	broker_conn *a = conn(UID_A, GID_A);
	alloc_buf(a, 900);
	broker_alloc_req r = req_of(200, NULL, BB_SHARE_UID);
	r.kind = BB_CUDA;
	broker_buf *buf;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(cuda.live, 1);
	cr_assert_eq(host.live, 1);
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), BB_ERR_NO_MEMORY);
	cr_assert_not_null(strstr(err.msg, "300"), "message: %s", err.msg);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 1);
	cr_assert_eq(t.bytes[BB_HOST], 900);
	cr_assert_eq(t.buffers[BB_CUDA], 1);
	cr_assert_eq(t.bytes[BB_CUDA], 200);
	broker_free(b);
	b = NULL;
	cr_assert_eq(cuda.live, 0);
	cr_assert_eq(host.live, 0);
}

static void limit_connections(broker_limits *l)
{
	l->connections = 3;
}

Test(broker, connection_limit_refuses_with_numbers)
{
	set_limits(limit_connections);
	broker_conn *c1 = conn(UID_A, GID_A);
	conn(UID_B, GID_B);
	conn(UID_B, GID_B);
	err.msg[0] = '\0';
	cr_assert_null(broker_conn_open(b, UID_A, GID_A, 1, &err));
	cr_assert_not_null(strstr(err.msg, "3"), "message: %s", err.msg);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.connections, 3);
	broker_conn_close(b, c1);
	broker_conn *c3 = broker_conn_open(b, UID_A, GID_A, 1, &err);
	cr_assert_not_null(c3, "%s", err.msg);
}

static void limit_tokens(broker_limits *l)
{
	l->conn_tokens = 2;
}

Test(broker, token_limit_per_connection_refuses_with_numbers)
{
	set_limits(limit_tokens);
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	unsigned char t1[BB_TOKEN_SIZE], t2[BB_TOKEN_SIZE], t3[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, true, t1, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_take(b, a, id, true, t2, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_take(b, a, id, true, t3, &err), BB_ERR_NO_MEMORY);
	cr_assert_not_null(strstr(err.msg, "2"), "message: %s", err.msg);
	broker_info info = stat_of(a, id);
	cr_assert_eq(info.refs, 3, "the refused take changed refs");
	cr_assert_eq(info.tokens, 2);
	cr_assert_eq(info.held, 1);
	/* The limit is per connection. */
	broker_buf *buf;
	cr_assert_eq(broker_open_id(b, c, id, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_take(b, c, id, true, t3, &err), 0, "%s", err.msg);
	/* An adopted token no longer counts. */
	cr_assert_eq(broker_adopt(b, c, t1, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_take(b, a, id, true, t1, &err), 0, "%s", err.msg);
}

static void limit_waits(broker_limits *l)
{
	l->conn_waits = 2;
}

Test(broker, wait_limit_per_connection_refuses_with_numbers)
{
	set_limits(limit_waits);
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_A, GID_A);
	uint64_t id = alloc_buf(a, 16);
	test_waiter w1, w2, w3, w4;
	park(a, id, &w1);
	park(a, id, &w2);
	bb_state st;
	char e[256];
	waiter_init(&w3);
	cr_assert_eq(broker_wait(b, a, id, &w3.w, &st, e, &err), BB_ERR_NO_MEMORY);
	cr_assert_not_null(strstr(err.msg, "2"), "message: %s", err.msg);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 2);
	/* Another connection has its own. */
	park(c, id, &w4);
	/* A cancelled wait frees its slot. */
	broker_wait_cancel(b, &w1.w);
	park(a, id, &w3);
	cr_assert_eq(broker_set_ready(b, a, id, &err), 0, "%s", err.msg);
	cr_assert_eq(w1.calls, 0);
	cr_assert_eq(w2.calls, 1);
	cr_assert_eq(w3.calls, 1);
	cr_assert_eq(w4.calls, 1);
}

/* ---- totals and teardown ------------------------------------------------- */

Test(broker, totals_match_the_state)
{
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.connections, 2);
	cr_assert_eq(t.buffers[BB_HOST], 0);
	cr_assert_eq(t.tokens, 0);
	cr_assert_eq(t.waits, 0);

	uint64_t id1 = alloc_buf(a, 100);
	alloc_buf(c, 200);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id1, true, tok, &err), 0, "%s", err.msg);
	test_waiter w;
	park(a, id1, &w);
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 2);
	cr_assert_eq(t.bytes[BB_HOST], 300);
	cr_assert_eq(t.buffers[BB_CUDA], 0);
	cr_assert_eq(t.bytes[BB_CUDA], 0);
	cr_assert_eq(t.connections, 2);
	cr_assert_eq(t.tokens, 1);
	cr_assert_eq(t.waits, 1);

	broker_conn_close(b, c);
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 1);
	cr_assert_eq(t.bytes[BB_HOST], 100);
	cr_assert_eq(t.connections, 1);
	cr_assert_eq(host.live_bytes, 100);
	broker_wait_cancel(b, &w.w); /* w lives on this stack */
	broker_totals_get(b, &t);
	cr_assert_eq(t.waits, 0);
}

Test(broker, broker_free_returns_all_backend_memory)
{
	broker_set_backend(b, BB_CUDA, &cuda.be, NULL);
	broker_conn *a = conn(UID_A, GID_A);
	broker_conn *c = conn(UID_B, GID_B);
	uint64_t id1 = alloc_named(a, 100, "one", BB_SHARE_ANY);
	alloc_buf(c, 200);
	broker_alloc_req r = req_of(300, NULL, BB_SHARE_UID);
	r.kind = BB_CUDA;
	broker_buf *buf;
	cr_assert_eq(broker_alloc(b, a, &r, &buf, &err), 0, "%s", err.msg);
	uint64_t orphan = alloc_buf(a, 50);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, orphan, false, tok, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_take(b, a, id1, true, tok, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_open_id(b, c, id1, &buf, &err), 0, "%s", err.msg);
	test_waiter w;
	park(c, id1, &w);
	cr_assert_eq(host.live, 3);
	cr_assert_eq(cuda.live, 1);

	broker_free(b);
	b = NULL;
	cr_assert_eq(host.live, 0);
	cr_assert_eq(host.live_bytes, 0);
	cr_assert_eq(cuda.live, 0);
	cr_assert_eq(host.frees, 3);
	cr_assert_eq(cuda.frees, 1);
}
