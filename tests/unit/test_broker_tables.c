/*
 * The broker's tables at size: buffers by id and each connection's counts
 * live in idmap tables, which keep no order and move entries as they grow,
 * shrink and delete. List still answers in id order, thousands of counts
 * survive churn and go with their connection, names and failure messages
 * (kept apart from the buffer) behave as before. A heap backend counts
 * what it hands out.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "broker.h"

#define UID_A 1000
#define UID_B 2000

static int live_mem; /* heap backend allocations not yet freed */

static int heap_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		      backend_mem *out, char *err, size_t errlen)
{
	(void)be, (void)device, (void)uid, (void)share, (void)handle, (void)err, (void)errlen;
	out->fd = -1;
	out->size = size;
	out->priv = malloc(1);
	if (!out->priv)
		return BB_ERR_NO_MEMORY;
	live_mem++;
	return 0;
}

static void heap_free(backend *be, backend_mem *mem)
{
	(void)be;
	free(mem->priv);
	mem->priv = NULL;
	live_mem--;
}

static backend heap = {.name = "heap", .alloc = heap_alloc, .free = heap_free};

static broker *b;
static broker_error err;
static char report[4096];

static void setup(void)
{
	live_mem = 0;
	b = broker_new(NULL);
	cr_assert_not_null(b);
	broker_set_backend(b, BB_HOST, &heap, NULL);
}

static void teardown(void)
{
	broker_free(b);
	cr_assert_eq(live_mem, 0, "%d buffers' memory outlived the broker", live_mem);
}

TestSuite(broker_tables, .init = setup, .fini = teardown);

static uint64_t alloc_in(broker_conn *c, const char *name)
{
	broker_alloc_req req = {.size = 4096,
				.kind = BB_HOST,
				.name = name,
				.share = BB_SHARE_ANY,
				.import_fd = -1};
	broker_buf *buf = NULL;
	broker_info info;
	cr_assert_eq(broker_alloc(b, c, &req, &buf, &err), 0, "%s", err.msg);
	broker_buf_info(b, buf, c, &info);
	return info.id;
}

static void assert_consistent(void)
{
	cr_assert_eq(broker_check(b, report, sizeof(report)), 0, "%s", report);
}

typedef struct ids_seen {
	uint64_t n;    /* rows */
	uint64_t last; /* the previous row's id */
	int unordered; /* rows not above the one before */
} ids_seen;

static int note_id(const broker_info *info, void *arg)
{
	ids_seen *s = arg;
	if (s->n && info->id <= s->last)
		s->unordered++;
	s->last = info->id;
	s->n++;
	return 0;
}

Test(broker_tables, list_is_in_id_order_over_many_buffers)
{
	enum { N = 600 };
	broker_conn *a = broker_conn_open(b, UID_A, UID_A, 1, &err);
	uint64_t ids[N];
	for (int i = 0; i < N; i++)
		ids[i] = alloc_in(a, NULL);
	/* Gaps, and a table that has moved entries about. */
	for (int i = 0; i < N; i += 3)
		cr_assert_eq(broker_release(b, a, ids[i], 1, NULL, NULL, &err), 0, "%s", err.msg);

	ids_seen seen = {0};
	broker_list(b, a, note_id, &seen);
	cr_assert_eq(seen.n, N - N / 3);
	cr_assert_eq(seen.unordered, 0, "%d rows came before a smaller id", seen.unordered);
	cr_assert_eq(seen.last, ids[N - 1]);
}

/* xorshift64: the same churn on every run. */
static uint64_t next_random(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

Test(broker_tables, churn_over_connections_keeps_every_count)
{
	enum { CONNS = 4, BUFS = 2000, OPS = 30000 };
	broker_conn *c[CONNS];
	static uint64_t ids[BUFS];
	static uint32_t held[CONNS][BUFS]; /* what each connection should hold */
	uint64_t rnd = 0x2545f4914f6cdd1du;

	for (int k = 0; k < CONNS; k++)
		c[k] = broker_conn_open(b, UID_A, UID_A, (uint32_t)k + 1, &err);
	for (int i = 0; i < BUFS; i++) {
		ids[i] = alloc_in(c[0], NULL);
		held[0][i] = 1;
	}
	/* Every buffer keeps connection 0's first count, so none is freed
	 * and every id stays valid while the other counts come and go. */
	for (int op = 0; op < OPS; op++) {
		int k = (int)(next_random(&rnd) % CONNS);
		int i = (int)(next_random(&rnd) % BUFS);
		uint32_t n = (uint32_t)(next_random(&rnd) % 3) + 1;
		uint32_t now_held = 0;
		if (next_random(&rnd) % 2) {
			cr_assert_eq(broker_retain(b, c[k], ids[i], n, NULL, &now_held, &err), 0,
				     "%s", err.msg);
			held[k][i] += n;
		} else {
			uint32_t keep = k == 0 ? 1 : 0;
			if (held[k][i] - keep < n)
				continue;
			cr_assert_eq(broker_release(b, c[k], ids[i], n, NULL, &now_held, &err), 0,
				     "%s", err.msg);
			held[k][i] -= n;
		}
		cr_assert_eq(now_held, held[k][i]);
		if (op % 5000 == 0)
			assert_consistent();
	}
	assert_consistent();
	for (int k = 0; k < CONNS; k++) {
		uint64_t nbufs = 0, bytes = 0, want = 0;
		for (int i = 0; i < BUFS; i++) {
			broker_info info;
			cr_assert_eq(broker_stat_id(b, c[k], ids[i], &info, &err), 0, "%s",
				     err.msg);
			cr_assert_eq(info.held, held[k][i], "connection %d, buffer %d", k, i);
			want += held[k][i] ? 1 : 0;
		}
		broker_conn_holdings(c[k], &nbufs, &bytes);
		cr_assert_eq(nbufs, want);
		cr_assert_eq(bytes, want * 4096);
	}
	/* Closing connection 0 frees exactly the buffers no one else holds. */
	uint64_t shared = 0;
	for (int i = 0; i < BUFS; i++)
		shared += held[1][i] || held[2][i] || held[3][i];
	broker_conn_close(b, c[0]);
	assert_consistent();
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], shared);
	cr_assert_eq((uint64_t)live_mem, shared);
	for (int k = 1; k < CONNS; k++)
		broker_conn_close(b, c[k]);
	broker_totals_get(b, &t);
	cr_assert_eq(t.buffers[BB_HOST], 0);
	cr_assert_eq(live_mem, 0);
}

Test(broker_tables, many_names_are_found_and_free_again)
{
	enum { N = 500 };
	broker_conn *a = broker_conn_open(b, UID_A, UID_A, 1, &err);
	broker_conn *o = broker_conn_open(b, UID_B, UID_B, 2, &err);
	uint64_t ids[N];
	char name[32];
	for (int i = 0; i < N; i++) {
		snprintf(name, sizeof(name), "frame-%d", i);
		ids[i] = alloc_in(a, name);
	}
	for (int i = 0; i < N; i++) {
		broker_info info;
		snprintf(name, sizeof(name), "frame-%d", i);
		cr_assert_eq(broker_stat_name(b, o, name, &info, &err), 0, "%s", err.msg);
		cr_assert_eq(info.id, ids[i]);
		cr_assert_str_eq(info.name, name);
	}
	broker_conn_close(b, a);
	for (int i = 0; i < N; i++) {
		snprintf(name, sizeof(name), "frame-%d", i);
		alloc_in(o, name);
	}
	assert_consistent();
}

Test(broker_tables, a_failure_message_is_kept_to_255_bytes)
{
	broker_conn *a = broker_conn_open(b, UID_A, UID_A, 1, &err);
	uint64_t id = alloc_in(a, NULL);
	uint64_t quiet = alloc_in(a, NULL);
	char msg[400];
	memset(msg, 'x', sizeof(msg) - 1);
	msg[sizeof(msg) - 1] = '\0';
	cr_assert_eq(broker_set_error(b, a, id, msg, &err), 0, "%s", err.msg);

	broker_info info;
	cr_assert_eq(broker_stat_id(b, a, id, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_eq(strlen(info.error), 255);
	cr_assert_eq(strncmp(info.error, msg, 255), 0);

	broker_waiter w = {0};
	bb_state st;
	char e[256];
	cr_assert_eq(broker_wait(b, a, id, &w, &st, e, &err), 1);
	cr_assert_eq(st, BB_FAILED);
	cr_assert_str_eq(e, info.error);

	/* A buffer that never failed reports no message. */
	cr_assert_eq(broker_set_ready(b, a, quiet, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_stat_id(b, a, quiet, &info, &err), 0, "%s", err.msg);
	cr_assert_str_eq(info.error, "");
}
