/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Session resume (protocol 1.3, docs/RESTART.md "Clients: session resume"
 * and "Exactly once") with real daemons and real processes:
 *
 * - a daemon that keeps its state names each session and its secret at
 *   Hello; one that does not names none, and its clients never reconnect;
 * - a resume is refused for a wrong secret, another uid, an unknown
 *   session or one a live connection has, and the connection stays
 *   unhelloed;
 * - a client whose daemon comes back without its state (or does not come
 *   back) reports BB_ERR_DISCONNECTED, after the reconnect timeout or at
 *   once when reconnecting is off (BUFBROKER_RECONNECT=0, opts.enabled 0);
 * - the test-only crash point kills the daemon between the commit and the
 *   answer;
 * - with the systemd stand-in (bbt_start_sd) and the daemon's start from
 *   the fd store: a client's buffers, mappings, a PENDING buffer and a
 *   parked waiter in another process survive a SIGKILL; a request cut by
 *   the crash point is applied exactly once (Alloc, Retain, Release, Take,
 *   Adopt); a session not resumed within the grace period is released, and
 *   so is a 1.2 client's.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_internal.h"
#include "harness.h"

TestSuite(resume, .fini = bbt_cleanup, .timeout = 120);

#define NOBODY 65534

static const char *const journal_on[] = {"--restart", NULL};

/* ---- the raw protocol ------------------------------------------------------ */

/* Hello as request id, resuming session with secret (len bytes) when
 * session or len is not 0: the Status code, *out the response (free it). */
static int raw_hello(int sock, uint64_t id, uint64_t session, const void *secret, size_t len,
		     Bufbroker__Response **out)
{
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	h.version_major = 1;
	h.version_minor = 3;
	h.client_name = "test_resume";
	h.resume_session = session;
	h.resume_secret.data = (uint8_t *)secret;
	h.resume_secret.len = len;
	req.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_HELLO;
	req.hello = &h;
	cr_assert_eq(bbt_raw_send(sock, &req, -1), 0);
	int rc = bbt_raw_recv(sock, bbt_ms(5000), out, NULL);
	cr_assert_eq(rc, 1, "no answer to Hello: %d", rc);
	cr_assert_eq((*out)->id, id);
	return (*out)->status ? (*out)->status->code : BB_ERR_PROTOCOL;
}

typedef struct session_key {
	uint64_t id;
	unsigned char secret[BB_TOKEN_SIZE];
} session_key;

/* A raw connection greeted with a plain Hello: the session it opened. */
static int raw_session(const bbt_daemon *d, session_key *key)
{
	int sock = bbt_raw_connect(d->sock);
	cr_assert_geq(sock, 0);
	Bufbroker__Response *r;
	cr_assert_eq(raw_hello(sock, 1, 0, NULL, 0, &r), 0);
	key->id = r->hello->session_id;
	cr_assert_eq(r->hello->session_secret.len, BB_TOKEN_SIZE);
	memcpy(key->secret, r->hello->session_secret.data, BB_TOKEN_SIZE);
	cr_assert_not(r->hello->resumed);
	bufbroker__response__free_unpacked(r, NULL);
	return sock;
}

/* A request that needs a greeted connection answers "Hello first": the
 * connection is unhelloed. Closes sock. */
static void assert_unhelloed_then_hello(int sock)
{
	Bufbroker__Response *r;
	/* A plain Hello is still welcome after the refusal. */
	cr_assert_eq(raw_hello(sock, 9, 0, NULL, 0, &r), 0, "a plain Hello after a refused resume");
	cr_assert_neq(r->hello->session_id, 0);
	bufbroker__response__free_unpacked(r, NULL);
	close(sock);
}

Test(resume, hello_names_the_session_only_when_the_daemon_keeps_its_state)
{
	bbt_daemon *d = bbt_start(journal_on);
	session_key a, b;
	int s1 = raw_session(d, &a), s2 = raw_session(d, &b);
	cr_assert_neq(a.id, 0);
	cr_assert_neq(a.id, b.id);
	cr_assert_neq(memcmp(a.secret, b.secret, BB_TOKEN_SIZE), 0, "two sessions, one secret");
	close(s1);
	close(s2);
	bbt_stop_clean(d);

	d = bbt_start(NULL);
	int sock = bbt_raw_connect(d->sock);
	Bufbroker__Response *r;
	cr_assert_eq(raw_hello(sock, 1, 0, NULL, 0, &r), 0);
	cr_assert_eq(r->hello->session_id, 0, "a daemon that keeps no state names no session");
	cr_assert_eq(r->hello->session_secret.len, 0);
	bufbroker__response__free_unpacked(r, NULL);
	close(sock);
	bbt_stop_clean(d);
}

Test(resume, a_resume_is_refused_and_the_connection_stays_unhelloed)
{
	bbt_daemon *d = bbt_start(journal_on);
	session_key k;
	int live = raw_session(d, &k);
	Bufbroker__Response *r;
	unsigned char wrong[BB_TOKEN_SIZE];
	memcpy(wrong, k.secret, sizeof(wrong));
	wrong[0] ^= 0x80;

	/* A live session with a secret not its own: the session asked for is
	 * not here (the daemon numbers sessions anew when it starts without
	 * its state). A wrong secret for a restored session is DENIED:
	 * tests/unit/test_broker_resume.c. */
	int sock = bbt_raw_connect(d->sock);
	cr_assert_eq(raw_hello(sock, 1, k.id, wrong, sizeof(wrong), &r), BB_ERR_NOT_FOUND);
	bufbroker__response__free_unpacked(r, NULL);
	assert_unhelloed_then_hello(sock);

	sock = bbt_raw_connect(d->sock);
	cr_assert_eq(raw_hello(sock, 1, k.id + 1000, k.secret, BB_TOKEN_SIZE, &r),
		     BB_ERR_NOT_FOUND);
	cr_assert(strstr(r->status->message, "not known"), "%s", r->status->message);
	bufbroker__response__free_unpacked(r, NULL);
	assert_unhelloed_then_hello(sock);

	/* The right secret, but a live connection has the session. */
	sock = bbt_raw_connect(d->sock);
	cr_assert_eq(raw_hello(sock, 1, k.id, k.secret, BB_TOKEN_SIZE, &r), BB_ERR_EXISTS);
	bufbroker__response__free_unpacked(r, NULL);
	assert_unhelloed_then_hello(sock);
	close(live);
	bbt_stop_clean(d);
}

/* Child: as nobody, resume the session in the pipe with its own secret:
 * exits 0 when refused with BB_ERR_DENIED. */
static int resume_as_nobody(void *arg)
{
	const bbt_daemon *d = arg;
	session_key k;
	if (read(STDIN_FILENO, &k, sizeof(k)) != (ssize_t)sizeof(k))
		return 10;
	if (setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0)
		return 11;
	int sock = bbt_raw_connect(d->sock);
	if (sock < 0)
		return 12;
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	h.version_major = 1;
	h.version_minor = 3;
	h.resume_session = k.id;
	h.resume_secret.data = k.secret;
	h.resume_secret.len = sizeof(k.secret);
	req.id = 1;
	req.op_case = BUFBROKER__REQUEST__OP_HELLO;
	req.hello = &h;
	Bufbroker__Response *r = NULL;
	if (bbt_raw_send(sock, &req, -1) || bbt_raw_recv(sock, 5000 * bbt_slow(), &r, NULL) != 1)
		return 13;
	int ok = r->status && r->status->code == BB_ERR_DENIED &&
		 strstr(r->status->message, "another uid");
	bufbroker__response__free_unpacked(r, NULL);
	return ok ? 0 : 14;
}

Test(resume, another_uid_cannot_resume_a_session_even_with_its_secret)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to switch to another uid");
	const char *const args[] = {"--restart", "--socket-mode", "0666", NULL};
	bbt_daemon *d = bbt_start(args);
	cr_assert_eq(chmod(d->dir, 0755), 0);
	session_key k;
	int live = raw_session(d, &k);
	int p[2];
	cr_assert_eq(pipe(p), 0);
	int saved = dup(STDIN_FILENO);
	dup2(p[0], STDIN_FILENO);
	pid_t pid = bbt_spawn(resume_as_nobody, d);
	dup2(saved, STDIN_FILENO);
	close(saved);
	close(p[0]);
	cr_assert_eq(write(p[1], &k, sizeof(k)), (ssize_t)sizeof(k));
	close(p[1]);
	cr_assert_eq(bbt_join(pid, bbt_ms(10000)), 0, "nobody's resume was not refused as DENIED");
	close(live);
	bbt_stop_clean(d);
}

/* ---- the client library without a kept state ---------------------------------- */

static bb_buf *alloc_host(bb_client *c, size_t size)
{
	bb_alloc_opts o = {.size = size, .kind = BB_HOST};
	bb_buf *b = NULL;
	int rc = bb_alloc(c, &o, &b);
	cr_assert_eq(rc, 0, "bb_alloc: %s", bb_last_error());
	return b;
}

static void set_reconnect(bb_client *c, int enabled, uint32_t timeout_ms)
{
	bb_reconnect_opts o = {.enabled = enabled, .timeout_ms = timeout_ms};
	cr_assert_eq(bb_client_set_reconnect(c, &o), 0, "%s", bb_last_error());
}

Test(resume, set_reconnect_checks_its_options)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_reconnect_opts o = {.enabled = 1, .backoff_ms = 600, .max_backoff_ms = 500};
	cr_assert_eq(bb_client_set_reconnect(c, &o), BB_ERR_INVALID);
	o = (bb_reconnect_opts){.enabled = 1, .backoff_ms = 600}; /* max: the default 500 */
	cr_assert_eq(bb_client_set_reconnect(c, &o), BB_ERR_INVALID);
	o = (bb_reconnect_opts){.enabled = 1, .reserved = {0, 1}};
	cr_assert_eq(bb_client_set_reconnect(c, &o), BB_ERR_INVALID);
	o = (bb_reconnect_opts){.enabled = 1, .backoff_ms = 5, .max_backoff_ms = 40};
	cr_assert_eq(bb_client_set_reconnect(c, &o), 0);
	cr_assert_eq(bb_client_set_reconnect(c, NULL), 0);
	cr_assert_eq(bb_client_set_reconnect(NULL, NULL), BB_ERR_INVALID);
	cr_assert_eq(bb_client_resumes(c), 0);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* A client holding a buffer, its daemon (started with args) killed and
 * started again without any kept state: the next call is DISCONNECTED.
 * resumes: the daemon named a session, so the client tried to resume it
 * and was told it is not known; else it never tried, and failed at once. */
static void lost_across_a_plain_restart(const char *const *args, bool resumes)
{
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_host(c, 4096);
	uint64_t id = bb_id(b);
	bbt_kill(d);
	bbt_restart(d); /* no fd store: it starts empty */
	bb_info info;
	int64_t t0 = bbt_now_ms();
	cr_assert_eq(bb_stat(c, id, &info), BB_ERR_DISCONNECTED);
	const char *why = bb_last_error();
	if (resumes) {
		cr_assert(strstr(why, "resuming session"), "%s", why);
		cr_assert(strstr(why, "not known"), "%s", why);
	} else {
		cr_assert_lt(bbt_now_ms() - t0, bbt_ms(1000), "it waited for a reconnect");
		cr_assert_null(strstr(why, "resum"), "%s", why);
	}
	cr_assert_eq(bb_client_resumes(c), 0);
	/* Dead for good: the next call says the same, at once. */
	cr_assert_eq(bb_retain(c, id, 1), BB_ERR_DISCONNECTED);
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(resume, a_daemon_that_keeps_no_state_is_never_reconnected_to)
{
	lost_across_a_plain_restart(NULL, false);
}

Test(resume, a_daemon_back_without_the_session_is_reported_as_disconnected)
{
	lost_across_a_plain_restart(journal_on, true);
}

/* With the daemon gone for good: how long bb_stat takes to answer
 * DISCONNECTED (ms), with reconnecting as configured. */
static int64_t stall_without_daemon(int env_off, int opts, int enabled, uint32_t timeout_ms)
{
	if (env_off)
		setenv("BUFBROKER_RECONNECT", "0", 1);
	bbt_daemon *d = bbt_start(journal_on);
	bb_client *c = bbt_connect(d);
	unsetenv("BUFBROKER_RECONNECT");
	if (opts)
		set_reconnect(c, enabled, timeout_ms);
	bb_buf *b = alloc_host(c, 4096);
	bbt_kill(d);
	bb_info info;
	int64_t t0 = bbt_now_ms();
	cr_assert_eq(bb_stat(c, bb_id(b), &info), BB_ERR_DISCONNECTED);
	int64_t took = bbt_now_ms() - t0;
	bb_unref(b);
	bb_disconnect(c);
	return took;
}

Test(resume, reconnecting_off_fails_at_once_and_on_gives_up_after_its_timeout)
{
	cr_assert_lt(stall_without_daemon(1, 0, 0, 0), bbt_ms(1000), "BUFBROKER_RECONNECT=0");
	cr_assert_lt(stall_without_daemon(0, 1, 0, 0), bbt_ms(1000), "opts.enabled = 0");
	int64_t took = stall_without_daemon(0, 1, 1, 400);
	cr_assert_geq(took, 400, "gave up after %" PRId64 " ms, before its timeout", took);
	cr_assert_lt(took, 400 + bbt_ms(2000), "gave up after %" PRId64 " ms", took);
	cr_assert(strstr(bb_last_error(), "within 400 ms"), "%s", bb_last_error());
}

Test(resume, the_test_crash_point_kills_the_daemon_after_the_commit)
{
	char marker[200];
	setenv("BUFBROKERD_TEST_CRASH_AFTER", "2", 1);
	bbt_daemon *d = bbt_start(journal_on);
	unsetenv("BUFBROKERD_TEST_CRASH_AFTER");
	snprintf(marker, sizeof(marker), "%s/crashed", d->dir);
	bb_client *c = bbt_connect(d);
	set_reconnect(c, 0, 0);
	bb_buf *b = alloc_host(c, 4096); /* 1 */
	size_t from = bbt_log_size(d);
	cr_assert_eq(bb_retain(c, bb_id(b), 1), BB_ERR_DISCONNECTED); /* 2: applied, unanswered */
	const char *const crashed[] = {"event=test_crash_point", NULL};
	cr_assert(bbt_log_wait_line(d, from, bbt_ms(5000), crashed));
	bbt_kill(d); /* reap it */
	bb_unref(b);
	bb_disconnect(c);

	/* One shot with BUFBROKERD_TEST_CRASH_ONCE: the daemon started again
	 * after it fired serves on. */
	setenv("BUFBROKERD_TEST_CRASH_AFTER", "1", 1);
	setenv("BUFBROKERD_TEST_CRASH_ONCE", marker, 1);
	bbt_restart(d);
	c = bbt_connect(d);
	set_reconnect(c, 0, 0);
	cr_assert_eq(bb_alloc(c, &(bb_alloc_opts){.size = 64, .kind = BB_HOST}, &b),
		     BB_ERR_DISCONNECTED);
	bb_disconnect(c);
	cr_assert_eq(access(marker, F_OK), 0, "the crash point made no marker");
	bbt_kill(d);
	bbt_restart(d);
	unsetenv("BUFBROKERD_TEST_CRASH_AFTER");
	unsetenv("BUFBROKERD_TEST_CRASH_ONCE");
	c = bbt_connect(d);
	b = alloc_host(c, 64);
	cr_assert_eq(bb_retain(c, bb_id(b), 1), 0, "%s", bb_last_error());
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- across a restart from the kept state (the systemd stand-in) -------------- */

#define NBUFS 4
#define BUFSZ (256 * 1024)

typedef struct waiter_arg {
	const char *sock;
	uint64_t id;   /* the PENDING buffer */
	uint32_t seed; /* what its producer writes */
} waiter_arg;

/* Child: open the PENDING buffer, wait for it without a timeout across the
 * restart, and check what the producer wrote. */
static int waiter(void *arg)
{
	const waiter_arg *w = arg;
	bb_client *c;
	bb_buf *b;
	bb_state st;
	void *p;
	if (bb_connect(w->sock, &c) || bb_open(c, w->id, &b))
		return 10;
	if (bb_wait(b, -1, &st) != 0)
		return 11;
	if (st != BB_READY)
		return 12;
	if (bb_map(b, &p) || !bbt_check(p, BUFSZ, w->seed))
		return 13;
	if (bb_client_resumes(c) != 1)
		return 14;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

/* A thread that calls bb_stat in a loop until stop, timing each call. */
typedef struct stall {
	bb_client *c;
	uint64_t id;
	atomic_int stop;
	atomic_uint_fast64_t calls;
	int64_t worst_ms;
	int errors;
	char error[256];
} stall;

static void *staller(void *arg)
{
	stall *s = arg;
	while (!atomic_load(&s->stop)) {
		bb_info info;
		int64_t t0 = bbt_now_ms();
		int rc = bb_stat(s->c, s->id, &info);
		int64_t took = bbt_now_ms() - t0;
		if (took > s->worst_ms)
			s->worst_ms = took;
		if (rc && !s->errors++)
			snprintf(s->error, sizeof(s->error), "%s", bb_last_error());
		atomic_fetch_add(&s->calls, 1);
	}
	return NULL;
}

/* Wait (deadline scaled) until the staller made at least n calls. */
static bool wait_calls(stall *s, uint64_t n)
{
	int64_t end = bbt_now_ms() + bbt_ms(10000);
	while (atomic_load(&s->calls) < n && bbt_now_ms() < end)
		bbt_sleep_ms(1);
	return atomic_load(&s->calls) >= n;
}

Test(resume, buffers_mappings_pending_buffers_and_waits_survive_a_crash)
{
	bbt_daemon *d = bbt_start_sd(NULL);
	bb_client *c = bbt_connect(d);
	bb_client *prod = bbt_connect(d);
	bb_buf *b[NBUFS];
	void *p[NBUFS];
	for (int i = 0; i < NBUFS; i++) {
		b[i] = alloc_host(c, BUFSZ);
		cr_assert_eq(bb_map(b[i], &p[i]), 0);
		bbt_fill(p[i], BUFSZ, 100 + i);
		cr_assert_eq(bb_set_ready(b[i]), 0);
	}
	cr_assert_eq(bb_retain(c, bb_id(b[0]), 2), 0);
	bb_buf *pending = alloc_host(prod, BUFSZ);
	void *pp;
	cr_assert_eq(bb_map(pending, &pp), 0);
	waiter_arg w = {.sock = d->sock, .id = bb_id(pending), .seed = 7};
	pid_t child = bbt_spawn(waiter, &w);
	cr_assert(bbt_waits_until(c, 1, bbt_ms(5000), NULL), "the waiter did not park");

	/* A thread keeps calling through the crash: its longest call is the
	 * stall a worker sees. */
	stall st = {.c = c, .id = bb_id(b[1])};
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, staller, &st), 0);
	cr_assert(wait_calls(&st, 10), "the calling thread made no calls");
	bbt_sd_crash(d);
	uint64_t before = atomic_load(&st.calls);
	cr_assert(wait_calls(&st, before + 10), "no calls after the restart");
	atomic_store(&st.stop, 1);
	pthread_join(th, NULL);
	cr_assert_eq(st.errors, 0, "a call failed across the restart: %s", st.error);
	fprintf(stderr,
		"resume: the client's longest call across the restart took %" PRId64 " ms\n",
		st.worst_ms);
	cr_assert_lt(st.worst_ms, bbt_ms(2000), "a stall of %" PRId64 " ms", st.worst_ms);

	/* Mappings never went away; counts and states came back. */
	for (int i = 0; i < NBUFS; i++) {
		bb_info info;
		cr_assert_eq(bb_stat(c, bb_id(b[i]), &info), 0, "%s", bb_last_error());
		cr_assert(bbt_check(p[i], BUFSZ, 100 + i), "buffer %d's bytes changed", i);
		cr_assert_eq(info.state, BB_READY);
		cr_assert_eq(info.refs, i == 0 ? 3 : 1);
	}
	cr_assert_eq(bb_client_resumes(c), 1);

	/* The producer completes its PENDING buffer; the waiter wakes. */
	bbt_fill(pp, BUFSZ, w.seed);
	cr_assert_eq(bb_set_ready(pending), 0, "%s", bb_last_error());
	cr_assert_eq(bbt_join(child, bbt_ms(10000)), 0, "the waiter");
	cr_assert_eq(bb_client_resumes(prod), 1);
	cr_assert_eq(bbt_check_problems(c), 0);

	cr_assert_eq(bb_release(c, bb_id(b[0]), 2), 0);
	for (int i = 0; i < NBUFS; i++)
		bb_unref(b[i]);
	bb_unref(pending);
	bb_disconnect(prod);
	bbt_totals t;
	cr_assert(bbt_totals_until_idle(c, 1, bbt_ms(5000), &t),
		  "the daemon still holds %" PRIu64 " buffers", t.buffers);
	bb_disconnect(c);
}

/* Exactly once: the daemon applies a request, commits, and is killed before
 * it answers (the crash point); the client resumes and sends it again; its
 * effect is there once. op: what the crash cuts. */
enum { OP_ALLOC, OP_RETAIN, OP_RELEASE, OP_TAKE, OP_ADOPT };

static void exactly_once(int op)
{
	char marker[256];
	/* State-changing requests before the one cut: Alloc (1), then Retain
	 * (2) for the ops on an existing buffer, Take (3) for Adopt. */
	static const char *const nth[] = {"2", "3", "3", "3", "4"};
	snprintf(marker, sizeof(marker), "/tmp/bbt-resume-crash-%d-%d", (int)getpid(), op);
	unlink(marker);
	setenv("BUFBROKERD_TEST_CRASH_AFTER", nth[op], 1);
	setenv("BUFBROKERD_TEST_CRASH_ONCE", marker, 1);
	bbt_daemon *d = bbt_start_sd(journal_on);
	unsetenv("BUFBROKERD_TEST_CRASH_AFTER");
	unsetenv("BUFBROKERD_TEST_CRASH_ONCE");
	bb_client *c = bbt_connect(d);
	bb_buf *a = alloc_host(c, 4096); /* 1 */
	uint64_t id = bb_id(a);
	bb_info info;
	bb_buf *b = NULL;
	bb_token tok;
	bbt_totals t;
	switch (op) {
	case OP_ALLOC:
		b = alloc_host(c, 8192); /* 2: cut */
		cr_assert_eq(bbt_server_totals(c, &t), 0);
		cr_assert_eq(t.buffers, 2, "%" PRIu64 " buffers: the Alloc was applied twice",
			     t.buffers);
		cr_assert_eq(bb_stat(c, bb_id(b), &info), 0);
		cr_assert_eq(info.refs, 1);
		break;
	case OP_RETAIN:
	case OP_RELEASE:
		cr_assert_eq(bb_retain(c, id, 2), 0); /* 2 */
		if (op == OP_RETAIN)
			cr_assert_eq(bb_retain(c, id, 1), 0, "%s", bb_last_error()); /* 3: cut */
		else
			cr_assert_eq(bb_release(c, id, 1), 0, "%s", bb_last_error()); /* 3: cut */
		cr_assert_eq(bb_stat(c, id, &info), 0);
		cr_assert_eq(info.refs, op == OP_RETAIN ? 4 : 2, "refs %" PRIu64, info.refs);
		break;
	case OP_TAKE:
	case OP_ADOPT:
		cr_assert_eq(bb_retain(c, id, 1), 0);                     /* 2 */
		cr_assert_eq(bb_take(a, &tok), 0, "%s", bb_last_error()); /* 3: cut for Take */
		if (op == OP_ADOPT) {
			cr_assert_eq(bb_adopt(c, &tok, &b), 0, "%s", bb_last_error()); /* 4: cut */
			bb_buf *again;
			cr_assert_eq(bb_adopt(c, &tok, &again), BB_ERR_NOT_FOUND,
				     "the token was adopted twice");
		}
		cr_assert_eq(bb_stat(c, id, &info), 0);
		cr_assert_eq(info.refs, 2, "refs %" PRIu64, info.refs);
		cr_assert_eq(bbt_server_totals(c, &t), 0);
		cr_assert_eq(t.tokens, op == OP_TAKE ? 1 : 0);
		break;
	}
	cr_assert_eq(bb_client_resumes(c), 1, "the daemon did not crash where it should");
	cr_assert_eq(access(marker, F_OK), 0);
	cr_assert_eq(bbt_check_problems(c), 0);
	unlink(marker);
	if (b)
		bb_unref(b);
	if (op != OP_TAKE && op != OP_ADOPT)
		bb_unref(a); /* else the Take surrendered it */
	bb_disconnect(c);
}

Test(resume, an_alloc_cut_by_a_crash_is_applied_once)
{
	exactly_once(OP_ALLOC);
}

Test(resume, a_retain_cut_by_a_crash_is_applied_once)
{
	exactly_once(OP_RETAIN);
}

Test(resume, a_release_cut_by_a_crash_is_applied_once)
{
	exactly_once(OP_RELEASE);
}

Test(resume, a_take_cut_by_a_crash_is_applied_once)
{
	exactly_once(OP_TAKE);
}

Test(resume, an_adopt_cut_by_a_crash_is_applied_once)
{
	exactly_once(OP_ADOPT);
}

/* A daemon under the stand-in whose restored sessions wait ms (times
 * bbt_slow: the restart takes less) to be resumed. */
static bbt_daemon *start_sd_with_grace(int ms)
{
	char grace[32];
	snprintf(grace, sizeof(grace), "%d", bbt_ms(ms));
	const char *const args[] = {"--restart-grace", grace, NULL};
	return bbt_start_sd(args);
}

Test(resume, a_session_not_resumed_within_the_grace_period_is_released)
{
	bbt_daemon *d = start_sd_with_grace(1000);
	bb_client *c = bbt_connect(d);
	set_reconnect(c, 0, 0); /* it will not come back */
	bb_client *other = bbt_connect(d);
	bb_buf *pending = alloc_host(c, 4096);
	bb_buf *seen;
	cr_assert_eq(bb_open(other, bb_id(pending), &seen), 0);
	bbt_sd_crash(d);
	bb_info info;
	cr_assert_eq(bb_stat(c, bb_id(pending), &info), BB_ERR_DISCONNECTED);
	/* The other client resumed; after the grace period the producer's
	 * session is released: its PENDING buffer FAILED. */
	bb_state st;
	cr_assert_eq(bb_wait(seen, bbt_ms(10000), &st), 0, "%s", bb_last_error());
	cr_assert_eq(st, BB_FAILED);
	cr_assert_eq(bb_stat(other, bb_id(pending), &info), 0);
	cr_assert(strstr(info.error, "producer disconnected"), "%s", info.error);
	cr_assert_eq(info.refs, 1);
	bb_unref(seen);
	bb_unref(pending);
	bb_disconnect(c);
	bb_disconnect(other);
}

/* A client of protocol 1.2 never resumes: across a restart its session is
 * kept absent for the grace period (its buffer lives on), then released as
 * a disconnect. */
Test(resume, a_1_2_client_loses_its_buffers_only_after_the_grace_period)
{
	bbt_daemon *d = start_sd_with_grace(1500);
	int sock = bbt_raw_connect(d->sock);
	cr_assert_geq(sock, 0);
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	Bufbroker__Alloc a = BUFBROKER__ALLOC__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	h.version_major = 1;
	h.version_minor = 2;
	req.id = 1;
	req.op_case = BUFBROKER__REQUEST__OP_HELLO;
	req.hello = &h;
	cr_assert_eq(bbt_raw_send(sock, &req, -1), 0);
	cr_assert_eq(bbt_raw_recv(sock, bbt_ms(5000), &r, NULL), 1);
	bufbroker__response__free_unpacked(r, NULL);
	a.size = 4096;
	a.kind = BUFBROKER__KIND__KIND_HOST;
	req = (Bufbroker__Request)BUFBROKER__REQUEST__INIT;
	req.id = 2;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &a;
	cr_assert_eq(bbt_raw_send(sock, &req, -1), 0);
	int fd = -1;
	cr_assert_eq(bbt_raw_recv(sock, bbt_ms(5000), &r, &fd), 1);
	cr_assert_eq(r->status->code, 0, "%s", r->status->message);
	uint64_t id = r->grant->info->id;
	bufbroker__response__free_unpacked(r, NULL);
	if (fd >= 0)
		close(fd);

	bbt_sd_crash(d);
	cr_assert(bbt_raw_closed(sock, bbt_ms(5000)), "the old connection stayed open");
	close(sock);
	/* Just after the restart the 1.2 client's count is still there. */
	bb_client *c = bbt_connect(d);
	cr_assert_eq(bbt_refs(c, id), 1, "the buffer went before the grace period");
	/* Nobody resumes its session: released when the grace period ends. */
	cr_assert_eq(bbt_stat_until_gone(c, id, bbt_ms(10000)), BB_ERR_NOT_FOUND);
	cr_assert_eq(bbt_check_problems(c), 0);
	bb_disconnect(c);
}
