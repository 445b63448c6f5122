/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Sessions across a restart, the broker's part (docs/RESTART.md, "Clients:
 * session resume" and "Exactly once"): each session has a random secret,
 * journaled with it; a broker rebuilt from a journal has every session
 * absent until a client resumes it with the secret and the same uid; and a
 * resumed session tells which request ids it applied, with the answers of
 * the result-bearing ones in its ring, so that a request sent again is
 * answered, not applied twice.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "broker.h"
#include "journal.h"

/* ---- a host backend that only counts ---------------------------------------- */

static int live_mems; /* memory handed out and not given back */

static int count_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		       backend_mem *out, char *err, size_t errlen)
{
	(void)be, (void)device, (void)uid, (void)share, (void)handle, (void)err, (void)errlen;
	out->fd = -1;
	out->size = size;
	out->priv = malloc(1);
	live_mems++;
	return 0;
}

static void count_free(backend *be, backend_mem *mem)
{
	(void)be;
	free(mem->priv);
	live_mems--;
}

static int count_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
			size_t errlen)
{
	(void)be, (void)mem, (void)err, (void)errlen;
	out->fd = -1;
	return 0;
}

static backend host = {
	.name = "counting",
	.alloc = count_alloc,
	.free = count_free,
	.export_mem = count_export,
};

static int restore_mem(void *ctx, backend *be, const journal_buffer *rec, backend_mem *out,
		       char *err, size_t len)
{
	(void)ctx;
	return count_alloc(be, rec->size, rec->device, rec->owner_uid, (int)rec->share, NULL, out,
			   err, len);
}

static uint64_t fake_now(void *ctx)
{
	(void)ctx;
	return 1000;
}

static unsigned char next_byte;

static void fake_random(void *ctx, unsigned char *buf, size_t n)
{
	(void)ctx;
	for (size_t i = 0; i < n; i++)
		buf[i] = ++next_byte;
}

static broker *broker_with(journal *j)
{
	broker_config cfg = {.now_ms = fake_now, .random = fake_random, .journal = j};
	broker_limits_default(&cfg.limits);
	broker *b = broker_new(&cfg);
	cr_assert_not_null(b);
	broker_set_backend(b, BB_HOST, &host, NULL);
	return b;
}

static journal *new_journal(void)
{
	journal *j = NULL;
	char why[256];
	journal_config jc = {.big_slots = 4, .small_slots = 8};
	cr_assert_eq(journal_create(&jc, &j, why, sizeof(why)), 0, "%s", why);
	return j;
}

/* A broker rebuilt from j, with a journal of its own (*jout). */
static broker *restored(journal *j, journal **jout)
{
	*jout = new_journal();
	broker *r = broker_with(*jout);
	broker_error err;
	cr_assert_eq(broker_restore(r, journal_fd(j), restore_mem, NULL, &err), 0, "%s", err.msg);
	return r;
}

static uint64_t buf_id(broker *b, const broker_buf *buf)
{
	broker_info info;
	broker_buf_info(b, buf, NULL, &info);
	return info.id;
}

static uint64_t alloc_host(broker *b, broker_conn *c, uint64_t request)
{
	broker_alloc_req req = {.size = 4096, .kind = BB_HOST, .import_fd = -1};
	broker_buf *buf;
	broker_error err;
	broker_conn_note_request(c, request);
	cr_assert_eq(broker_alloc(b, c, &req, &buf, &err), 0, "%s", err.msg);
	return buf_id(b, buf);
}

static void setup(void)
{
	live_mems = 0;
	next_byte = 0;
}

static void teardown(void)
{
	cr_assert_eq(live_mems, 0, "%d buffers' memory was not given back", live_mems);
}

TestSuite(broker_resume, .init = setup, .fini = teardown);

Test(broker_resume, each_session_has_its_own_secret_journaled_with_it)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c1 = broker_conn_open(b, 1000, 1000, 7, &err);
	broker_conn *c2 = broker_conn_open(b, 1000, 1000, 8, &err);
	cr_assert(c1 && c2);
	cr_assert(broker_keeps_state(b));
	unsigned char s1[BB_TOKEN_SIZE], s2[BB_TOKEN_SIZE], zero[BB_TOKEN_SIZE] = {0};
	broker_conn_secret(c1, s1);
	broker_conn_secret(c2, s2);
	cr_assert_neq(memcmp(s1, zero, sizeof(s1)), 0);
	cr_assert_neq(memcmp(s1, s2, sizeof(s1)), 0, "two sessions, one secret");

	journal_state st;
	char why[256];
	cr_assert_eq(journal_read(journal_fd(j), &st, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(st.n_sessions, 2);
	for (size_t i = 0; i < st.n_sessions; i++) {
		const unsigned char *want = st.sessions[i].id == broker_conn_session(c1) ? s1 : s2;
		cr_assert_eq(memcmp(st.sessions[i].secret, want, BB_TOKEN_SIZE), 0);
	}
	journal_state_free(&st);
	broker_free(b);
	journal_free(j);

	/* Off: no state is kept, and there is nothing to resume with. */
	b = broker_with(NULL);
	c1 = broker_conn_open(b, 1000, 1000, 7, &err);
	cr_assert_not(broker_keeps_state(b));
	broker_conn_secret(c1, s1);
	cr_assert_eq(memcmp(s1, zero, sizeof(s1)), 0);
	broker_free(b);
}

Test(broker_resume, a_restored_session_resumes_with_its_secret_and_uid_only)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	cr_assert_not_null(c);
	uint64_t id = alloc_host(b, c, 1);
	broker_conn_note_request(c, 2);
	cr_assert_eq(broker_retain(b, c, id, 2, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t session = broker_conn_session(c);
	unsigned char secret[BB_TOKEN_SIZE];
	broker_conn_secret(c, secret);

	/* While its connection lives, nobody else can take it. */
	broker_conn *out = NULL;
	uint64_t floor = 0, mask = 0;
	cr_assert_eq(broker_session_resume(b, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     BB_ERR_EXISTS, "%s", err.msg);

	journal *j2;
	broker *r = restored(j, &j2);
	broker_free(b);
	journal_free(j);

	unsigned char wrong[BB_TOKEN_SIZE];
	memcpy(wrong, secret, sizeof(wrong));
	wrong[BB_TOKEN_SIZE - 1] ^= 1;
	cr_assert_eq(broker_session_resume(r, session, wrong, sizeof(wrong), 1000, &out, &floor,
					   &mask, &err),
		     BB_ERR_DENIED);
	cr_assert_eq(broker_session_resume(r, session, secret, 8, 1000, &out, &floor, &mask, &err),
		     BB_ERR_DENIED, "a short secret");
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1001, &out, &floor,
					   &mask, &err),
		     BB_ERR_DENIED, "another uid");
	cr_assert_eq(broker_session_resume(r, session + 1, secret, sizeof(secret), 1000, &out,
					   &floor, &mask, &err),
		     BB_ERR_NOT_FOUND);
	cr_assert(strstr(err.msg, "not known"), "%s", err.msg);

	/* Refusals leave it absent: the right secret still resumes it, with
	 * its counts, and tells which requests it applied. */
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	cr_assert_not_null(out);
	cr_assert_eq(broker_conn_session(out), session);
	cr_assert_eq(floor, 2);
	cr_assert_eq(mask, 0);
	broker_info info;
	cr_assert_eq(broker_stat_id(r, out, id, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.held, 3);
	cr_assert_eq(info.refs, 3);
	/* Once: a second client cannot attach to it too. */
	broker_conn *again;
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &again, &floor,
					   &mask, &err),
		     BB_ERR_EXISTS);

	/* The resumed session is journaled present, secret and all: a second
	 * restart finds it again. */
	journal *j3;
	broker *r2 = restored(j2, &j3);
	cr_assert_eq(broker_session_resume(r2, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	broker_free(r2);
	journal_free(j3);
	broker_free(r);
	journal_free(j2);
}

Test(broker_resume, applied_requests_are_answered_from_the_ring_after_a_resume)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	uint64_t a = alloc_host(b, c, 1);
	unsigned char tok[BB_TOKEN_SIZE];
	broker_conn_note_request(c, 2);
	cr_assert_eq(broker_take(b, c, a, true, tok, &err), 0, "%s", err.msg);
	broker_alloc_req bad = {.size = 0, .kind = BB_HOST, .import_fd = -1};
	broker_buf *buf;
	broker_conn_note_request(c, 3);
	cr_assert_neq(broker_alloc(b, c, &bad, &buf, &err), 0);
	broker_conn_note_request(c, 5); /* 4 is in flight */
	cr_assert_eq(broker_retain(b, c, a, 1, NULL, NULL, &err), 0, "%s", err.msg);

	/* A session never resumed answers every id as new: a client that
	 * reuses ids is served as before. */
	broker_applied done;
	cr_assert_not(broker_conn_applied(b, c, 1, &done));

	uint64_t session = broker_conn_session(c);
	unsigned char secret[BB_TOKEN_SIZE];
	broker_conn_secret(c, secret);
	journal *j2;
	broker *r = restored(j, &j2);
	broker_free(b);
	journal_free(j);
	broker_conn *out;
	uint64_t floor, mask;
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	cr_assert_eq(floor, 3);
	cr_assert_eq(mask, 2, "5 applied above the floor: mask %" PRIx64, mask);

	cr_assert(broker_conn_applied(r, out, 1, &done));
	cr_assert(done.found);
	cr_assert_eq(done.status, 0);
	cr_assert_not_null(done.buf);
	cr_assert_eq(buf_id(r, done.buf), a);
	cr_assert(broker_conn_applied(r, out, 2, &done));
	cr_assert(done.found);
	cr_assert_eq(memcmp(done.token, tok, sizeof(tok)), 0);
	cr_assert(broker_conn_applied(r, out, 3, &done));
	cr_assert(done.found);
	cr_assert_eq(done.status, BB_ERR_INVALID);
	cr_assert_not(broker_conn_applied(r, out, 4, &done), "4 was never applied");
	cr_assert(broker_conn_applied(r, out, 5, &done));
	cr_assert_not(done.found, "a Retain has no result: its answer is the counts");
	cr_assert_not(broker_conn_applied(r, out, 6, &done));

	/* The count the first Alloc gave is there once. */
	broker_info info;
	cr_assert_eq(broker_stat_id(r, out, a, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.held, 2);
	cr_assert_eq(info.refs, 3, "two held, one token");
	broker_free(r);
	journal_free(j2);
}

Test(broker_resume, ids_far_ahead_move_the_floor_and_reads_count_as_seen)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	uint64_t a = alloc_host(b, c, 1);
	/* Requests 2..99 change nothing (Stat, Wait ...): seen, in order. */
	for (uint64_t id = 2; id < 100; id++)
		broker_conn_seen(c, id);
	broker_conn_note_request(c, 100);
	cr_assert_eq(broker_retain(b, c, a, 1, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t session = broker_conn_session(c);
	unsigned char secret[BB_TOKEN_SIZE];
	broker_conn_secret(c, secret);
	journal *j2;
	broker *r = restored(j, &j2);
	broker_conn *out;
	uint64_t floor, mask;
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	cr_assert_eq(floor, 100);
	cr_assert_eq(mask, 0);
	broker_free(r);
	journal_free(j2);

	/* Without the reads: 300 is more than 64 above the floor (100), which
	 * moves up to 236 rather than refusing it. */
	broker_conn_note_request(c, 300);
	cr_assert_eq(broker_retain(b, c, a, 1, NULL, NULL, &err), 0, "%s", err.msg);
	r = restored(j, &j2);
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	cr_assert_eq(floor, 236);
	cr_assert_eq(mask, 1ull << 63);
	broker_free(r);
	journal_free(j2);
	broker_free(b);
	journal_free(j);
}

Test(broker_resume, a_closed_session_takes_its_results_out_of_the_journal)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	alloc_host(b, c, 1);
	alloc_host(b, c, 2);
	journal_state st;
	char why[256];
	cr_assert_eq(journal_read(journal_fd(j), &st, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(st.n_results, 2);
	cr_assert_eq(st.results[1].request, 2);
	journal_state_free(&st);
	broker_conn_close(b, c);
	cr_assert_eq(journal_read(journal_fd(j), &st, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(st.n_results, 0);
	cr_assert_eq(st.n_sessions, 0);
	cr_assert_eq(journal_check(&st, why, sizeof(why)), 0, "%s", why);
	journal_state_free(&st);
	broker_free(b);
	journal_free(j);
}
