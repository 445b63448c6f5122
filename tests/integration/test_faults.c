/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Faults: clients killed while holding buffers or mid-operation give
 * everything back; a killed daemon makes every call answer
 * BB_ERR_DISCONNECTED promptly (no hang, no SIGPIPE) while host mappings
 * stay valid; a restarted daemon serves the same path; SIGTERM with live
 * clients is a clean exit.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define CHILD_TIMEOUT_MS 8000
#define PROMPT_MS 1000 /* "promptly": each call after the daemon died (times bbt_slow) */

TestSuite(faults, .fini = bbt_cleanup, .timeout = 40);

struct ctx {
	const char *sock;
	uint64_t id; /* a buffer of the parent's */
	uint32_t seed;
	size_t size;
	bbt_chan ch;
};

static bb_buf *alloc_host(bb_client *c, size_t size, const char *name)
{
	bb_alloc_opts o = {.size = size, .kind = BB_HOST, .name = name};
	bb_buf *b = NULL;
	int rc = bb_alloc(c, &o, &b);
	cr_assert_eq(rc, 0, "bb_alloc: %d (%s)", rc, bb_last_error());
	return b;
}

/* The default SIGPIPE disposition, unblocked: a library call that raises
 * SIGPIPE kills the process. */
static void default_sigpipe(void)
{
	sigset_t s;
	signal(SIGPIPE, SIG_DFL);
	sigemptyset(&s);
	sigaddset(&s, SIGPIPE);
	sigprocmask(SIG_UNBLOCK, &s, NULL);
}

static void join_thread_within(pthread_t th, int seconds, const char *what)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += seconds;
	cr_assert_eq(pthread_timedjoin_np(th, NULL, &ts), 0, "%s did not return within %d s", what,
		     seconds);
}

/* ---- killed clients ------------------------------------------------------ */

/* Holds buffers several ways, reports their ids, then waits to be killed. */
static int hoarder_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *a = NULL, *n = NULL, *p = NULL, *w = NULL;
	bb_alloc_opts o = {.size = 65536, .kind = BB_HOST};
	uint64_t ids[3];
	void *m;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_alloc(c, &o, &a) != 0 || bb_map(a, &m) != 0)
		return 11;
	memset(m, 7, o.size);
	bb_ref(a);
	bb_ref(a);
	o.name = "bbt-hoarded";
	if (bb_alloc(c, &o, &n) != 0 || bb_retain(c, bb_id(n), 5) != 0)
		return 12;
	o.name = NULL;
	if (bb_alloc(c, &o, &w) != 0) /* stays PENDING */
		return 13;
	if (bb_open(c, x->id, &p) != 0 || bb_map(p, &m) != 0)
		return 14;
	ids[0] = bb_id(a);
	ids[1] = bb_id(n);
	ids[2] = bb_id(w);
	if (bbt_send(x->ch.fd[1], ids, sizeof(ids)) != 0)
		return 15;
	for (;;)
		pause();
}

Test(faults, killed_client_gives_back_everything_it_held)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock};
	uint64_t ids[3];
	bbt_totals t;
	int memfds0 = bbt_daemon_memfds(d);

	bb_buf *p = alloc_host(c, 4096, NULL);
	x.id = bb_id(p);
	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(hoarder_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], ids, sizeof(ids), CHILD_TIMEOUT_MS), 0,
		     "the hoarder did not report (exit %d)", bbt_join(pid, 0));
	cr_assert_eq(bbt_refs(c, x.id), 2);
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.buffers, 4);
	cr_assert_eq(t.connections, 2);

	kill(pid, SIGKILL);
	cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 128 + SIGKILL);
	bbt_chan_close(&x.ch);
	static const char *what[] = {"a buffer with local copies", "a buffer with raw counts",
				     "a PENDING buffer"};
	for (int i = 0; i < 3; i++)
		cr_assert_eq(bbt_stat_until_gone(c, ids[i], 2000), BB_ERR_NOT_FOUND,
			     "%s of the killed client survived it", what[i]);
	cr_assert_eq(bbt_refs_until(c, x.id, 1, 2000), 1,
		     "the killed client's count on our buffer");
	bb_unref(p);
	cr_assert(bbt_totals_until_idle(c, 1, 2000, &t),
		  "not idle: %llu buffers, %llu bytes, %u connections, %llu waits",
		  (unsigned long long)t.buffers, (unsigned long long)t.bytes, t.connections,
		  (unsigned long long)t.waits);
	cr_assert_eq(bbt_daemon_memfd_bytes(d), 0, "memory left in the daemon's memfds");
	cr_assert_leq(bbt_daemon_memfds(d), memfds0 + BBT_HOST_POOL_MAX,
		      "memfds left open in the daemon beyond its reuse pool");
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Several threads doing everything at once, until SIGKILL. */
struct busy {
	struct ctx *x;
	bb_client *c;
	int index;
};

static void *busy_thread(void *arg)
{
	struct busy *bz = arg;
	unsigned seed = (unsigned)bz->index;
	for (unsigned i = 0;; i++) {
		char name[64];
		snprintf(name, sizeof(name), "bbt-busy-%d-%u", bz->index, i);
		bb_alloc_opts o = {.size = 4096u << (rand_r(&seed) % 6),
				   .kind = BB_HOST,
				   .name = i % 3 ? NULL : name};
		bb_buf *b = NULL, *q = NULL;
		bb_token t;
		bb_info info;
		bb_state st;
		void *m;
		if (bb_alloc(bz->c, &o, &b) != 0)
			continue;
		if (bb_map(b, &m) == 0)
			memset(m, (int)i, o.size);
		if (bb_take(bb_ref(b), &t) == 0 && i % 2 && bb_adopt(bz->c, &t, &q) == 0)
			bb_unref(q);
		bb_retain(bz->c, bb_id(b), 2);
		bb_stat(bz->c, bb_id(b), &info);
		bb_release(bz->c, bb_id(b), 1);
		if (i % 4 == 0)
			bb_set_ready(b);
		bb_wait(b, 0, &st);
		if (bb_open(bz->c, bz->x->id, &q) == 0) {
			bb_wait(q, 1, &st);
			bb_unref(q);
		}
		/* One raw count stays with the connection on purpose. */
		bb_unref(b);
		if (i == 1 && bz->index == 0)
			bbt_send(bz->x->ch.fd[1], "r", 1);
	}
	return NULL;
}

/* Parks in bb_wait(-1) on the parent's PENDING buffer. */
static void *parked_thread(void *arg)
{
	struct busy *bz = arg;
	bb_buf *q = NULL;
	bb_state st;
	if (bb_open(bz->c, bz->x->id, &q) == 0)
		bb_wait(q, -1, &st);
	return NULL;
}

static int busy_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	struct busy bz[4];
	pthread_t th[4];

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	for (int i = 0; i < 4; i++) {
		bz[i] = (struct busy){.x = x, .c = c, .index = i};
		if (pthread_create(&th[i], NULL, i == 3 ? parked_thread : busy_thread, &bz[i]) != 0)
			return 11;
	}
	for (;;)
		pause();
}

Test(faults, client_killed_mid_operation_leaves_no_trace)
{
	static const char *const args[] = {"--token-ttl", "200", NULL};
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock};
	bbt_totals t;
	char r;
	int memfds0 = bbt_daemon_memfds(d);

	bb_buf *p = alloc_host(c, 4096, "bbt-parent-pending");
	x.id = bb_id(p);
	static const int delays[] = {30, 110, 260};
	for (int round = 0; round < 3; round++) {
		bbt_chan_open(&x.ch);
		pid_t pid = bbt_spawn(busy_child, &x);
		cr_assert_eq(bbt_recv(x.ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0,
			     "round %d: the busy child did not get going (exit %d)", round,
			     bbt_join(pid, 0));
		bbt_sleep_ms(delays[round]);
		kill(pid, SIGKILL);
		cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 128 + SIGKILL);
		bbt_chan_close(&x.ch);
	}
	cr_assert_eq(bbt_refs_until(c, x.id, 1, 2000), 1, "killed clients' counts on our buffer");
	cr_assert_eq(bb_set_ready(p), 0, "the buffer the killed clients waited on still works");
	bb_unref(p);
	/* Tokens outlive their makers until the 200 ms TTL. */
	cr_assert(bbt_totals_until_idle(c, 1, 3000, &t),
		  "not idle: %llu buffers, %llu bytes, %u connections, %llu tokens, %llu waits",
		  (unsigned long long)t.buffers, (unsigned long long)t.bytes, t.connections,
		  (unsigned long long)t.tokens, (unsigned long long)t.waits);
	cr_assert_eq(bbt_daemon_memfd_bytes(d), 0, "memory left in the daemon's memfds");
	cr_assert_leq(bbt_daemon_memfds(d), memfds0 + BBT_HOST_POOL_MAX,
		      "memfds left open in the daemon beyond its reuse pool");
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- a killed daemon ----------------------------------------------------------- */

struct parked {
	bb_buf *b;
	int rc;
	int64_t done_ms;
};

static void *wait_forever(void *arg)
{
	struct parked *pk = arg;
	bb_state st;
	pk->rc = bb_wait(pk->b, -1, &st);
	pk->done_ms = bbt_now_ms();
	return NULL;
}

#define TIMED(what, expr)                                                                         \
	do {                                                                                      \
		int64_t t0_ = bbt_now_ms();                                                       \
		int rc_ = (expr);                                                                 \
		int64_t took_ = bbt_now_ms() - t0_;                                               \
		cr_assert_eq(rc_, BB_ERR_DISCONNECTED, "%s after the daemon died: %d (%s)", what, \
			     rc_, bb_last_error());                                               \
		cr_assert_lt(took_, bbt_ms(PROMPT_MS), "%s took %lld ms after the daemon died",   \
			     what, (long long)took_);                                             \
	} while (0)

Test(faults, every_call_answers_disconnected_promptly_after_daemon_death)
{
	default_sigpipe();
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_buf *got = NULL;
	bb_token tok;
	bb_info info;
	bb_state st;

	bb_buf *b = alloc_host(c, 65536, "bbt-survivor");
	void *m = NULL;
	cr_assert_eq(bb_map(b, &m), 0);
	bbt_fill(m, 65536, 99);
	cr_assert_eq(bb_set_ready(b), 0);
	bb_buf *pend = alloc_host(c, 4096, NULL);
	cr_assert_eq(bb_take(bb_ref(b), &tok), 0);

	struct parked pk = {.b = pend};
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, wait_forever, &pk), 0);
	uint64_t waits;
	cr_assert(bbt_waits_until(c, 1, 2000, &waits), "the wait never parked (%llu parked waits)",
		  (unsigned long long)waits);

	int64_t killed = bbt_now_ms();
	bbt_kill(d);
	join_thread_within(th, bbt_ms(5000) / 1000, "bb_wait(-1) parked when the daemon died");
	cr_assert_eq(pk.rc, BB_ERR_DISCONNECTED, "the parked bb_wait(-1) answered %d", pk.rc);
	cr_assert_lt(pk.done_ms - killed, bbt_ms(PROMPT_MS), "the parked bb_wait(-1) took %lld ms",
		     (long long)(pk.done_ms - killed));

	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	int fd = memfd_create("bbt-late-import", MFD_ALLOW_SEALING | MFD_CLOEXEC);
	cr_assert_geq(fd, 0);
	cr_assert_eq(ftruncate(fd, 4096), 0);

	int64_t all0 = bbt_now_ms();
	TIMED("bb_alloc", bb_alloc(c, &o, &got));
	TIMED("bb_import_fd", bb_import_fd(c, fd, &o, &got));
	TIMED("bb_open", bb_open(c, bb_id(b), &got));
	TIMED("bb_open_name", bb_open_name(c, "bbt-survivor", &got));
	TIMED("bb_adopt", bb_adopt(c, &tok, &got));
	TIMED("bb_stat", bb_stat(c, bb_id(b), &info));
	TIMED("bb_retain", bb_retain(c, bb_id(b), 1));
	TIMED("bb_release", bb_release(c, bb_id(b), 1));
	TIMED("bb_set_ready", bb_set_ready(pend));
	TIMED("bb_set_error", bb_set_error(pend, "too late"));
	TIMED("bb_wait(-1)", bb_wait(pend, -1, &st));
	TIMED("bb_wait(0)", bb_wait(pend, 0, &st));
	TIMED("bb_wait(5000)", bb_wait(pend, 5000, &st));
	bb_buf *extra = bb_ref(b);
	int take_rc;
	TIMED("bb_take", (take_rc = bb_take(extra, &tok)));
	if (take_rc != 0)
		bb_unref(extra); /* a failed take leaves the count with the caller */
	cr_assert_lt(bbt_now_ms() - all0, bbt_ms(3 * PROMPT_MS),
		     "all calls together took too long");
	close(fd);

	/* The mapping outlives the daemon. */
	cr_assert(bbt_check(m, 65536, 99), "the host mapping changed after the daemon died");
	memset(m, 0x11, 4096);

	int64_t t0 = bbt_now_ms();
	bb_unref(pend); /* last count: a fire-and-forget Release into a dead socket */
	bb_unref(b);
	cr_assert_lt(bbt_now_ms() - t0, bbt_ms(PROMPT_MS), "the last bb_unref hung");

	bb_client *c2 = NULL;
	TIMED("bb_connect to the dead daemon's socket", bb_connect(d->sock, &c2));
	bb_disconnect(c);
}

/* Several threads of one client busy with every kind of call when the
 * daemon is SIGKILLed: each thread's call in flight and every call after
 * answer BB_ERR_DISCONNECTED within PROMPT_MS, none hangs, and each
 * thread's mapped buffers keep their bytes. */
#define LOADERS 6
#define AFTER_DEATH_CALLS 40 /* calls each thread makes once it saw the death */

struct loader {
	bb_client *c;
	int index;
	uint64_t shared_id;    /* a PENDING buffer of the test's: open and wait on it */
	atomic_int *ops;       /* successful calls by every thread */
	int64_t first_disc_ms; /* when this thread first got BB_ERR_DISCONNECTED */
	int64_t slowest_after; /* the slowest call that started after first_disc_ms */
	int after;             /* calls made after first_disc_ms */
	int bad_rc;            /* an answer no call may give (0: none) */
	char bad_what[64];
	bool mapping_changed; /* a mapped buffer's bytes changed after the death */
};

static _Atomic int64_t g_killed_ms;

/* rc of one call by a loader: counts it, records a wrong answer, and
 * returns true when the daemon is gone. */
static bool loader_saw(struct loader *l, const char *what, int rc, int64_t t0)
{
	int64_t now = bbt_now_ms();
	if (rc == BB_ERR_DISCONNECTED) {
		if (!l->first_disc_ms)
			l->first_disc_ms = now;
		else if (now - t0 > l->slowest_after)
			l->slowest_after = now - t0;
		return true;
	}
	if (l->first_disc_ms || atomic_load(&g_killed_ms)) {
		/* Calls that completed before the kill may still succeed; none
		 * may after the thread saw DISCONNECTED once. */
		if (l->first_disc_ms && !l->bad_rc) {
			l->bad_rc = rc == 0 ? 1 : rc;
			snprintf(l->bad_what, sizeof(l->bad_what), "%s after DISCONNECTED", what);
		}
		return false;
	}
	if (rc != 0 && rc != BB_ERR_TIMEOUT && rc != BB_ERR_NOT_FOUND && !l->bad_rc) {
		l->bad_rc = rc;
		snprintf(l->bad_what, sizeof(l->bad_what), "%s", what);
	}
	if (rc == 0)
		atomic_fetch_add(l->ops, 1);
	return false;
}

#define LOAD_CALL(l, what, expr)                                  \
	do {                                                      \
		int64_t t0_ = bbt_now_ms();                       \
		if (loader_saw((l), (what), (expr), t0_))         \
			(l)->after += (l)->first_disc_ms ? 1 : 0; \
	} while (0)

static void *loader_thread(void *arg)
{
	struct loader *l = arg;
	bb_buf *keep[4] = {NULL};
	void *keep_map[4] = {NULL};
	size_t keep_size = 8192;
	uint32_t seed = 1000u + (uint32_t)l->index;

	/* Buffers this thread maps and must still read after the death. */
	for (int i = 0; i < 4; i++) {
		bb_alloc_opts o = {.size = keep_size, .kind = BB_HOST};
		if (bb_alloc(l->c, &o, &keep[i]) != 0 || bb_map(keep[i], &keep_map[i]) != 0) {
			l->bad_rc = 1;
			snprintf(l->bad_what, sizeof(l->bad_what), "setting up");
			return NULL;
		}
		bbt_fill(keep_map[i], keep_size, seed + (uint32_t)i);
	}
	for (unsigned i = 0; l->after < AFTER_DEATH_CALLS; i++) {
		bb_alloc_opts o = {.size = 4096u << (i % 4), .kind = BB_HOST};
		bb_buf *b = NULL, *q = NULL;
		bb_token t;
		bb_info info;
		bb_state st;
		void *m;
		int rc;

		if (l->first_disc_ms && bbt_now_ms() - l->first_disc_ms > 5000)
			break; /* reported as too few calls */
		LOAD_CALL(l, "bb_alloc", rc = bb_alloc(l->c, &o, &b));
		if (rc == 0) {
			if (bb_map(b, &m) == 0)
				memset(m, (int)i, o.size);
			bb_buf *extra = bb_ref(b);
			LOAD_CALL(l, "bb_take", rc = bb_take(extra, &t));
			if (rc != 0)
				bb_unref(extra);
			else
				LOAD_CALL(l, "bb_adopt", rc = bb_adopt(l->c, &t, &q));
			if (rc == 0 && q)
				bb_unref(q);
			LOAD_CALL(l, "bb_retain", bb_retain(l->c, bb_id(b), 1));
			LOAD_CALL(l, "bb_release", bb_release(l->c, bb_id(b), 1));
			LOAD_CALL(l, "bb_set_ready", bb_set_ready(b));
			LOAD_CALL(l, "bb_wait", bb_wait(b, 0, &st));
			bb_unref(b); /* the last count: a Release without an answer */
		}
		q = NULL;
		LOAD_CALL(l, "bb_open", rc = bb_open(l->c, l->shared_id, &q));
		if (rc == 0) {
			/* One thread parks for long; the others briefly. */
			LOAD_CALL(l, "bb_wait(timeout)",
				  bb_wait(q, l->index == 0 ? 60000 : (int)(i % 20), &st));
			bb_unref(q);
		}
		LOAD_CALL(l, "bb_stat", bb_stat(l->c, bb_id(keep[i % 4]), &info));
		LOAD_CALL(l, "bb_open_name", rc = bb_open_name(l->c, "bbt-no-such-name", &q));
	}
	for (int i = 0; i < 4; i++) {
		if (!bbt_check(keep_map[i], keep_size, seed + (uint32_t)i))
			l->mapping_changed = true;
		int64_t t0 = bbt_now_ms();
		bb_unref(keep[i]);
		if (bbt_now_ms() - t0 > l->slowest_after)
			l->slowest_after = bbt_now_ms() - t0;
	}
	return NULL;
}

Test(faults, daemon_killed_under_load_every_busy_thread_answers_disconnected_promptly)
{
	default_sigpipe();
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct loader l[LOADERS];
	pthread_t th[LOADERS];
	atomic_int ops = 0;
	int prompt = bbt_ms(PROMPT_MS);

	bb_buf *shared = alloc_host(c, 4096, "bbt-load-pending");
	atomic_store(&g_killed_ms, 0);
	for (int i = 0; i < LOADERS; i++) {
		l[i] = (struct loader){.c = c, .index = i, .shared_id = bb_id(shared), .ops = &ops};
		cr_assert_eq(pthread_create(&th[i], NULL, loader_thread, &l[i]), 0);
	}
	/* Under load: every thread at work, one parked in a long wait. */
	int64_t deadline = bbt_now_ms() + bbt_ms(5000);
	while (atomic_load(&ops) < 500 && bbt_now_ms() < deadline)
		bbt_sleep_ms(5);
	cr_assert_geq(atomic_load(&ops), 500, "the threads got little done: %d calls",
		      atomic_load(&ops));

	int64_t killed = bbt_now_ms();
	atomic_store(&g_killed_ms, killed);
	bbt_kill(d);
	for (int i = 0; i < LOADERS; i++)
		join_thread_within(th[i], bbt_ms(5000) / 1000,
				   "a busy thread after the daemon died");

	for (int i = 0; i < LOADERS; i++) {
		cr_assert_eq(l[i].bad_rc, 0, "thread %d: %s answered %d", i, l[i].bad_what,
			     l[i].bad_rc);
		cr_assert_neq(l[i].first_disc_ms, 0, "thread %d never saw BB_ERR_DISCONNECTED", i);
		cr_assert_lt(l[i].first_disc_ms - killed, prompt,
			     "thread %d saw BB_ERR_DISCONNECTED %lld ms after the kill", i,
			     (long long)(l[i].first_disc_ms - killed));
		cr_assert_geq(l[i].after, AFTER_DEATH_CALLS,
			      "thread %d made only %d calls in 5 s after the death", i, l[i].after);
		cr_assert_lt(l[i].slowest_after, prompt,
			     "thread %d: a call after the death took %lld ms", i,
			     (long long)l[i].slowest_after);
		cr_assert(!l[i].mapping_changed, "thread %d: a mapped buffer changed", i);
	}
	bb_unref(shared);

	/* A restarted daemon: the dead connection stays dead (no silent
	 * reconnect into a daemon that knows none of its buffers), a new one
	 * works, and the new daemon starts from nothing. */
	bbt_restart(d);
	bb_buf *b = NULL;
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	cr_assert_eq(bb_alloc(c, &o, &b), BB_ERR_DISCONNECTED,
		     "the old connection after the restart");
	bb_disconnect(c);
	c = bbt_connect(d);
	bbt_totals t;
	cr_assert(bbt_totals_until_idle(c, 1, 2000, &t), "a restarted daemon holds %llu buffers",
		  (unsigned long long)t.buffers);
	b = alloc_host(c, 4096, "bbt-load-pending"); /* the name is free again */
	cr_assert_eq(bbt_check_problems(c), 0, "the restarted daemon's invariant check");
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Maps the parent's buffer, reports, then (after the daemon died) checks
 * that the mapping still shares bytes with the parent. */
static int sharer_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	void *m;
	char go;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_open(c, x->id, &b) != 0 || bb_map(b, &m) != 0)
		return 11;
	if (!bbt_check(m, x->size, x->seed))
		return 12;
	if (bbt_send(x->ch.fd[1], "m", 1) != 0)
		return 13;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0) /* the daemon is dead now */
		return 14;
	if (!bbt_check(m, x->size, x->seed + 1)) /* the parent rewrote it */
		return 15;
	bbt_fill(m, x->size, x->seed + 2);
	if (bbt_send(x->ch.fd[1], "w", 1) != 0)
		return 16;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
		return 17;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(faults, host_mappings_stay_shared_after_daemon_death)
{
	default_sigpipe();
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock, .size = 1 << 20, .seed = 5};
	char r;

	bb_buf *b = alloc_host(c, x.size, NULL);
	x.id = bb_id(b);
	void *m = NULL;
	cr_assert_eq(bb_map(b, &m), 0);
	bbt_fill(m, x.size, x.seed);
	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(sharer_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0, "the sharer exited %d",
		     bbt_join(pid, 0));

	bbt_kill(d);
	cr_assert(bbt_check(m, x.size, x.seed), "the mapping changed when the daemon died");
	bbt_fill(m, x.size, x.seed + 1);
	cr_assert_eq(bbt_send(x.ch.fd[0], "k", 1), 0);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0, "the sharer exited %d",
		     bbt_join(pid, 0));
	cr_assert(bbt_check(m, x.size, x.seed + 2),
		  "the other process's write after the daemon died is not visible");
	cr_assert_eq(bbt_send(x.ch.fd[0], "q", 1), 0);
	int code = bbt_join(pid, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the sharer failed at step %d", code);
	bbt_chan_close(&x.ch);
	bb_unref(b);
	bb_disconnect(c);
}

/* With the default SIGPIPE disposition, calls on a dead daemon. */
static int sigpipe_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *bufs[8];
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	char go;

	default_sigpipe();
	if (bb_connect(x->sock, &c) != 0)
		return 10;
	for (int i = 0; i < 8; i++)
		if (bb_alloc(c, &o, &bufs[i]) != 0)
			return 11;
	if (bbt_send(x->ch.fd[1], "r", 1) != 0)
		return 12;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0) /* the daemon is dead now */
		return 13;
	for (int round = 0; round < 20; round++) {
		bb_buf *b = NULL;
		bb_info info;
		if (bb_alloc(c, &o, &b) != BB_ERR_DISCONNECTED)
			return 20;
		if (bb_stat(c, 1, &info) != BB_ERR_DISCONNECTED)
			return 21;
		if (bb_retain(c, 1, 1) != BB_ERR_DISCONNECTED)
			return 22;
	}
	for (int i = 0; i < 8; i++)
		bb_unref(bufs[i]); /* each a Release sent into the dead socket */
	bb_disconnect(c);
	return 0;
}

Test(faults, no_sigpipe_in_a_client_after_daemon_death)
{
	bbt_daemon *d = bbt_start(NULL);
	struct ctx x = {.sock = d->sock};
	char r;

	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(sigpipe_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0, "the client exited %d",
		     bbt_join(pid, 0));
	bbt_kill(d);
	cr_assert_eq(bbt_send(x.ch.fd[0], "k", 1), 0);
	int code = bbt_join(pid, CHILD_TIMEOUT_MS);
	cr_assert_neq(code, 128 + SIGPIPE, "a library call raised SIGPIPE");
	cr_assert_neq(code, -1, "the client hung after the daemon died");
	cr_assert_eq(code, 0, "the client failed at step %d", code);
	bbt_chan_close(&x.ch);
}

Test(faults, connect_works_against_a_restarted_daemon)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_host(c, 4096, "bbt-before-restart");

	bbt_kill(d); /* leaves the socket file behind */
	bb_buf *x = NULL;
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	cr_assert_eq(bb_alloc(c, &o, &x), BB_ERR_DISCONNECTED);
	bb_unref(b);
	bb_disconnect(c);

	bbt_restart(d);
	c = bbt_connect(d);
	b = alloc_host(c, 4096, "bbt-before-restart");
	bb_info info;
	cr_assert_eq(bb_stat(c, bb_id(b), &info), 0);
	cr_assert_eq(info.refs, 1);
	bb_unref(b);
	bb_disconnect(c);

	/* And after a clean stop. */
	bbt_stop_clean(d);
	bbt_restart(d);
	c = bbt_connect(d);
	b = alloc_host(c, 4096, NULL);
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Parks on the parent's PENDING buffer; 0 when the wait ends because the
 * daemon stopped (DISCONNECTED: a stopping daemon drops waits before it
 * closes producers, so the answer never depends on the close order) and
 * later calls answer DISCONNECTED too. */
static int stopped_waiter_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL, *own = NULL;
	bb_alloc_opts o = {.size = 8192, .kind = BB_HOST};
	bb_token t;
	bb_state st = BB_PENDING;
	bb_info info;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_open(c, x->id, &b) != 0)
		return 11;
	if (bb_alloc(c, &o, &own) != 0 || bb_take(bb_ref(own), &t) != 0)
		return 12;
	if (bbt_send(x->ch.fd[1], "p", 1) != 0)
		return 13;
	int rc = bb_wait(b, -1, &st);
	if (rc != BB_ERR_DISCONNECTED)
		return rc == 0 ? 20 + (int)st : 40 - rc;
	rc = bb_stat(c, bb_id(own), &info);
	bb_unref(b);
	bb_unref(own);
	bb_disconnect(c);
	return rc == BB_ERR_DISCONNECTED ? 0 : 60 - rc;
}

Test(faults, sigterm_with_live_clients_and_buffers_exits_zero)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_client *c2 = bbt_connect(d);
	struct ctx x = {.sock = d->sock};
	bb_token t;
	char r;

	bb_buf *pend = alloc_host(c, 4096, "bbt-pending-at-exit");
	x.id = bb_id(pend);
	bb_buf *big = alloc_host(c, 4 << 20, NULL);
	bb_buf *ready = alloc_host(c2, 4096, NULL);
	cr_assert_eq(bb_set_ready(ready), 0);
	cr_assert_eq(bb_retain(c2, bb_id(ready), 3), 0);
	cr_assert_eq(bb_take(bb_ref(big), &t), 0);
	bb_buf *failed = alloc_host(c2, 4096, NULL);
	cr_assert_eq(bb_set_error(failed, "on purpose"), 0);

	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(stopped_waiter_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0, "the waiter exited %d",
		     bbt_join(pid, 0));
	uint64_t waits;
	cr_assert(bbt_waits_until(c, 1, CHILD_TIMEOUT_MS, &waits),
		  "the waiter's wait never parked (%llu parked waits)", (unsigned long long)waits);

	bbt_stop_clean(d);
	int code = bbt_join(pid, 3000);
	cr_assert_eq(code, 0,
		     "the waiter parked at SIGTERM: step %d (20 + state: answered 0; 40 - code: "
		     "the wait's error; 60 - code: a later call's error)",
		     code);
	bbt_chan_close(&x.ch);
	bb_info info;
	cr_assert_eq(bb_stat(c, x.id, &info), BB_ERR_DISCONNECTED);
	bb_unref(pend);
	bb_unref(big);
	bb_unref(ready);
	bb_unref(failed);
	bb_disconnect(c);
	bb_disconnect(c2);
}

/* ---- the daemon out of file descriptors ---------------------------------- */

#define FDS_ROOM 16         /* fds the squeezed daemon has left */
#define SPIN_WINDOW_MS 1000 /* the daemon's CPU time is measured over this */
#define REFUSED_ATTEMPTS 20 /* connections refused one after the other */
#define OUT_OF_FDS "the daemon is out of file descriptors"

static bool g_hold_connect; /* connect returns once the daemon closed the connection */

/* Every connect of this program (the client library's, the harness's)
 * comes here. With g_hold_connect set, it returns only once the daemon has
 * closed the new connection, so the client's first request meets a socket
 * the daemon already answered and closed (EPIPE), as it does whenever the
 * daemon refuses a connection before the client sends its Hello. */
int connect(int fd, const struct sockaddr *sa, socklen_t len)
{
	static int (*real)(int, const struct sockaddr *, socklen_t);
	if (!real)
		real = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT,
									       "connect");
	int rc = real(fd, sa, len);
	if (rc == 0 && g_hold_connect) {
		struct pollfd p = {.fd = fd, .events = POLLRDHUP};
		poll(&p, 1, bbt_ms(5000));
	}
	return rc;
}

/* The answer the daemon gives a connection it has no fd for, and its close:
 * 0, or a step number when it is not that. */
static int out_of_fds_refusal(int sock)
{
	Bufbroker__Response *r = NULL;
	if (bbt_raw_recv(sock, 5000, &r, NULL) != 1)
		return 1;
	int bad = r->id != 0 || !r->status || r->status->code != BB_ERR_NO_MEMORY ||
		  !strstr(r->status->message, OUT_OF_FDS);
	if (bad)
		fprintf(stderr, "the refusal: id %llu, code %d, \"%s\"\n",
			(unsigned long long)r->id, r->status ? r->status->code : 0,
			r->status ? r->status->message : "");
	bufbroker__response__free_unpacked(r, NULL);
	if (bad)
		return 2;
	return bbt_raw_closed(sock, 5000) ? 0 : 3;
}

Test(faults, out_of_fds_refuses_new_connections_without_spinning_and_serves_the_rest)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_buf *kept = alloc_host(c, 4096, NULL);
	bb_buf *fill[FDS_ROOM + 8];
	int n = 0, rc;

	/* The daemon's fds run out: host buffers fill what is left. */
	long soft = bbt_daemon_squeeze_fds(d, FDS_ROOM);
	cr_assert_gt(soft, 0, "prlimit on the daemon: %s", strerror(errno));
	for (;;) {
		bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
		cr_assert_lt(n, FDS_ROOM + 8, "the daemon never ran out of file descriptors");
		if ((rc = bb_alloc(c, &o, &fill[n])) != 0)
			break;
		n++;
	}
	cr_assert_eq(rc, BB_ERR_NO_MEMORY, "the alloc past the fds: %d (%s)", rc, bb_last_error());
	cr_assert(strstr(bb_last_error(), "Too many open files"),
		  "the alloc past the fds says \"%s\"", bb_last_error());

	/* A new connection: before the fix the listener fired in a tight
	 * loop while it waited, never accepted. */
	size_t log0 = bbt_log_size(d);
	long cpu0 = bbt_daemon_cpu_ms(d);
	int64_t t0 = bbt_now_ms();
	int r = bbt_raw_connect(d->sock);
	cr_assert_geq(r, 0, "connect: %s", strerror(-r));
	bbt_sleep_ms(SPIN_WINDOW_MS); /* a window to measure, not a wait for something */
	long cpu = bbt_daemon_cpu_ms(d) - cpu0;
	int64_t wall = bbt_now_ms() - t0;
	cr_assert_geq(cpu0, 0);
	cr_assert_lt(cpu, wall / 4,
		     "the daemon used %ld ms of CPU in %lld ms with a connection it had no fd for",
		     cpu, (long long)wall);
	cr_assert_eq(out_of_fds_refusal(r), 0, "the connection was not refused with the reason");
	close(r);

	/* bb_connect says why too, even when the refusal comes before it
	 * sent its Hello. */
	bb_client *x = NULL;
	g_hold_connect = true;
	rc = bb_connect(d->sock, &x);
	g_hold_connect = false;
	cr_assert_eq(rc, BB_ERR_DISCONNECTED, "bb_connect with the daemon out of fds: %d", rc);
	cr_assert(strstr(bb_last_error(), OUT_OF_FDS), "bb_connect says \"%s\"", bb_last_error());

	/* Every attempt is answered, and the log does not grow per attempt. */
	for (int i = 0; i < REFUSED_ATTEMPTS; i++) {
		r = bbt_raw_connect(d->sock);
		cr_assert_geq(r, 0, "connect %d: %s", i, strerror(-r));
		cr_assert_eq(out_of_fds_refusal(r), 0, "attempt %d was not refused with the reason",
			     i);
		close(r);
	}
	size_t grown = bbt_log_size(d) - log0;
	cr_assert_lt(grown, 1024, "the log grew by %zu bytes for %d refused connections", grown,
		     REFUSED_ATTEMPTS + 2);

	/* The client that is connected is served meanwhile. */
	uint64_t id = bb_id(kept);
	cr_assert_eq(bb_retain(c, id, 2), 0, "retain: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, id), 3);
	cr_assert_eq(bb_release(c, id, 2), 0, "release: %s", bb_last_error());
	bbt_totals t;
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.connections, 1);
	cr_assert_eq(t.host_buffers, (uint64_t)n + 1);

	/* Freed fds let the next client in (the memfd pool keeps a few). */
	for (int i = 0; i < n; i++)
		bb_unref(fill[i]);
	/* Requests are answered in order: the releases were done before this. */
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.host_buffers, 1);
	rc = bb_connect(d->sock, &x);
	cr_assert_eq(rc, 0, "bb_connect once fds were freed: %s", bb_last_error());
	bb_buf *after = alloc_host(x, 4096, NULL);
	const char *const resumed[] = {"event=accept_resumed", NULL};
	cr_assert(bbt_log_wait_line(d, log0, 5000, resumed), "no accept_resumed line");

	cr_assert_eq(bbt_daemon_set_nofile(d, soft), 0);
	bb_unref(after);
	bb_disconnect(x);
	bb_unref(kept);
	cr_assert_eq(bbt_check_problems(c), 0);
	bb_disconnect(c);
	bbt_stop_clean(d);
}
