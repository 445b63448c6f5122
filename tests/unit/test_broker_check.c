/*
 * broker_check: it passes on every state the broker's own operations reach,
 * and it names each kind of inconsistency. The corrupting tests need the
 * broker's internals, so this file includes broker.c itself (its
 * definitions take the place of the library's copy at link time).
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "../../daemon/broker.c"

static int mem_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		     backend_mem *out, char *err, size_t errlen)
{
	(void)be, (void)device, (void)uid, (void)share, (void)handle, (void)err, (void)errlen;
	out->fd = -1;
	out->size = size;
	out->priv = malloc(1);
	return 0;
}

static void mem_free(backend *be, backend_mem *mem)
{
	(void)be;
	free(mem->priv);
}

static int mem_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
		      size_t errlen)
{
	(void)be, (void)mem, (void)err, (void)errlen;
	out->fd = -1;
	return 0;
}

static backend mem_backend = {
	.name = "mem",
	.alloc = mem_alloc,
	.free = mem_free,
	.export_mem = mem_export,
};

static broker *b;
static broker_error err;
static char report[4096];

static void setup(void)
{
	b = broker_new(NULL);
	broker_set_backend(b, BB_HOST, &mem_backend, NULL);
}

static void teardown(void)
{
	broker_free(b);
}

TestSuite(broker_check, .init = setup, .fini = teardown);

static broker_buf *alloc_in(broker_conn *c, uint64_t size, const char *name)
{
	broker_alloc_req r = {.size = size, .kind = BB_HOST, .name = name, .import_fd = -1};
	broker_buf *buf = NULL;
	cr_assert_eq(broker_alloc(b, c, &r, &buf, &err), 0, "%s", err.msg);
	return buf;
}

static void no_wake(broker_waiter *w, int code, bb_state state, const char *error)
{
	(void)w, (void)code, (void)state, (void)error;
}

Test(broker_check, passes_on_a_busy_broker)
{
	broker_conn *a = broker_conn_open(b, 1000, 1000, 1, &err);
	broker_conn *c = broker_conn_open(b, 1001, 1000, 2, &err);
	broker_buf *x = alloc_in(a, 4096, "x");
	broker_buf *y = alloc_in(c, 1 << 20, NULL);
	unsigned char tok[BB_TOKEN_SIZE];
	broker_waiter w = {.wake = no_wake};
	bb_state st;
	char e[256];

	cr_assert_eq(broker_retain(b, a, x->id, 3, NULL, NULL, &err), 0);
	cr_assert_eq(broker_take(b, a, x->id, true, tok, &err), 0);
	cr_assert_eq(broker_take(b, c, y->id, false, tok, &err), 0);
	cr_assert_eq(broker_wait(b, a, x->id, &w, &st, e, &err), 0);
	cr_assert_eq(broker_check(b, report, sizeof(report)), 0, "%s", report);
	cr_assert_str_eq(report, "");

	broker_conn_close(b, a); /* x lives on through its token */
	cr_assert_eq(broker_check(b, report, sizeof(report)), 0, "%s", report);
	broker_conn_close(b, c);
}

Test(broker_check, reports_refs_that_do_not_add_up)
{
	broker_conn *a = broker_conn_open(b, 1000, 1000, 1, &err);
	broker_buf *x = alloc_in(a, 4096, NULL);
	x->refs = 5;
	cr_assert_eq(broker_check(b, report, sizeof(report)), 1, "%s", report);
	cr_assert_not_null(strstr(report, "refs 5 but connections hold 1 and 0 tokens"), "%s",
			   report);
	x->refs = 1;
}

Test(broker_check, reports_totals_that_do_not_match_the_buffers)
{
	broker_conn *a = broker_conn_open(b, 1000, 1000, 1, &err);
	alloc_in(a, 4096, NULL);
	b->bytes[BB_HOST] += 1;
	usage_of(b, 1000, false)->buffers = 7;
	cr_assert_eq(broker_check(b, report, sizeof(report)), 2, "%s", report);
	cr_assert_not_null(strstr(report, "host totals say 1 buffers, 4097 bytes"), "%s", report);
	cr_assert_not_null(strstr(report, "uid 1000's usage says 7 buffers"), "%s", report);
	b->bytes[BB_HOST] -= 1;
	usage_of(b, 1000, false)->buffers = 1;
	cr_assert_eq(broker_check(b, report, sizeof(report)), 0, "%s", report);
}

Test(broker_check, reports_a_token_count_out_of_step)
{
	broker_conn *a = broker_conn_open(b, 1000, 1000, 1, &err);
	broker_buf *x = alloc_in(a, 4096, NULL);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, x->id, true, tok, &err), 0);
	x->tokens = 0;
	cr_assert_geq(broker_check(b, report, sizeof(report)), 1, "%s", report);
	cr_assert_not_null(strstr(report, "counts 0 tokens but 1 are live"), "%s", report);
	x->tokens = 1;
}

Test(broker_check, report_is_cut_to_its_buffer_but_counts_every_problem)
{
	broker_conn *a = broker_conn_open(b, 1000, 1000, 1, &err);
	broker_buf *bufs[20];
	char small[64];
	for (int i = 0; i < 20; i++) {
		bufs[i] = alloc_in(a, 4096, NULL);
		bufs[i]->refs = 9;
	}
	cr_assert_eq(broker_check(b, small, sizeof(small)), 20);
	cr_assert_lt(strlen(small), sizeof(small));
	for (int i = 0; i < 20; i++)
		bufs[i]->refs = 1;
}
