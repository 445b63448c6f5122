/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The systemd stand-in (fakesd.c) does what systemd does for a Type=notify
 * service with a socket unit, Restart=on-failure and an fd store, checked
 * with a toy service (fakesd_toy.c) that speaks libsystemd's own
 * sd_pid_notify_with_fds: what it stores, removes and gets back in
 * LISTEN_FDS / LISTEN_FDNAMES / LISTEN_PID after it dies; the store's
 * limit; duplicates; pollable fds that hang up; notifications from another
 * pid refused; a clean exit ends the service; and bufbrokerd itself under
 * it (bbt_start_sd, bbt_sd_crash, bbt_stop).
 *
 * No systemd runs where this was written (no /run/systemd/system, no user
 * manager): the behaviour is checked against systemd's documentation and
 * sources (docs/RESTART.md, "Tests"), not against a live systemd.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <stddef.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

TestSuite(fakesd, .fini = bbt_cleanup, .timeout = 60);

typedef struct toy {
	char name[64];  /* $TOY_CTL: "@" and an abstract socket name */
	int lsn;        /* where the toy connects */
	int conn;       /* the running toy's connection */
	bbt_daemon *d;  /* the toy under the stand-in */
	char rep[8192]; /* its last start report */
} toy;

/* One datagram into p (NUL-terminated): 0, or -1 on timeout or end. */
static int recv_dgram(int fd, char *p, size_t cap, int timeout_ms)
{
	struct pollfd pfd = {.fd = fd, .events = POLLIN};
	if (poll(&pfd, 1, bbt_ms(timeout_ms)) != 1)
		return -1;
	ssize_t n = recv(fd, p, cap - 1, 0);
	if (n <= 0)
		return -1;
	p[n] = '\0';
	return 0;
}

/* Accept the (re)started toy's connection and read its report. */
static void toy_accept(toy *t)
{
	struct pollfd p = {.fd = t->lsn, .events = POLLIN};
	cr_assert_eq(poll(&p, 1, bbt_ms(5000)), 1, "the toy did not connect");
	if (t->conn >= 0)
		close(t->conn);
	t->conn = accept4(t->lsn, NULL, NULL, SOCK_CLOEXEC);
	cr_assert(t->conn >= 0, "accept: %s", strerror(errno));
	cr_assert_eq(recv_dgram(t->conn, t->rep, sizeof(t->rep), 5000), 0,
		     "no start report from the toy");
}

static void toy_start(toy *t)
{
	memset(t, 0, sizeof(*t));
	t->conn = -1;
	/* An abstract name: nothing on disk, whatever happens. */
	snprintf(t->name, sizeof(t->name), "@bbt-toy-%d-%lld", (int)getpid(),
		 (long long)bbt_now_ms());
	t->lsn = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	size_t len = strlen(t->name);
	memcpy(a.sun_path + 1, t->name + 1, len - 1);
	cr_assert(bind(t->lsn, (struct sockaddr *)&a,
		       (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) == 0 &&
		  listen(t->lsn, 4) == 0);
	setenv("TOY_CTL", t->name, 1);
	const char *exe = getenv("BB_FAKESD_TOY");
	cr_assert(exe && *exe, "BB_FAKESD_TOY is not set (ctest sets it)");
	const char *argv[] = {exe, NULL};
	t->d = bbt_sd_start_program(argv, false);
	toy_accept(t);
}

static void toy_end(toy *t)
{
	bbt_stop(t->d);
	if (t->conn >= 0)
		close(t->conn);
	close(t->lsn);
}

static void toy_cmd(toy *t, const char *cmd)
{
	char ans[64] = "";
	cr_assert_eq(bbt_send(t->conn, cmd, strlen(cmd)), 0);
	cr_assert_eq(recv_dgram(t->conn, ans, sizeof(ans), 5000), 0, "%s: no answer", cmd);
	cr_assert_str_eq(ans, "ok", "toy: %s: %s", cmd, ans);
}

/* The report has this " key=value" (or "key=value" at its start). */
static bool has(const toy *t, const char *item)
{
	size_t len = strlen(item);
	for (const char *p = strstr(t->rep, item); p; p = strstr(p + 1, item))
		if ((p == t->rep || p[-1] == ' ') && (p[len] == ' ' || p[len] == '\0'))
			return true;
	return false;
}

#define REPORTS(t, item) \
	cr_assert(has(t, item), "want \"%s\" in the toy's report: %s", item, (t)->rep)

/* The stored names, newest first, joined with ','. */
static void names_of(const bbt_daemon *d, char *out, size_t cap)
{
	char **v;
	int n = bbt_sd_store_names(d, &v);
	cr_assert(n >= 0, "bbt_sd_store_names: %d", n);
	out[0] = '\0';
	for (int i = 0; i < n; i++)
		snprintf(out + strlen(out), cap - strlen(out), "%s%s", i ? "," : "", v[i]);
	bbt_sd_names_free(v);
}

/* Poll until the store's names are want (the stand-in removes a hung-up
 * fd when it polls it). */
static void names_until(const bbt_daemon *d, const char *want)
{
	char got[1024];
	int64_t deadline = bbt_now_ms() + bbt_ms(5000);
	for (;;) {
		names_of(d, got, sizeof(got));
		if (!strcmp(got, want) || bbt_now_ms() >= deadline)
			break;
		bbt_sleep_ms(5);
	}
	cr_assert_str_eq(got, want, "stored names");
}

static void status_of(const bbt_daemon *d, bbt_sd_state *st)
{
	int rc = bbt_sd_status(d, st);
	cr_assert_eq(rc, 0, "bbt_sd_status: %d", rc);
}

/* Poll until the service has ended (state dead). */
static void dead_until(const bbt_daemon *d, bbt_sd_state *st)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(5000);
	do {
		status_of(d, st);
		if (!strcmp(st->state, "dead"))
			break;
		bbt_sleep_ms(5);
	} while (bbt_now_ms() < deadline);
	cr_assert_str_eq(st->state, "dead");
}

Test(fakesd, the_first_start_gets_the_socket_and_the_notify_socket)
{
	toy t;
	char item[64];
	bbt_sd_state st;
	toy_start(&t);
	snprintf(item, sizeof(item), "pid=%d", (int)t.d->pid);
	REPORTS(&t, item);
	snprintf(item, sizeof(item), "listen_pid=%d", (int)t.d->pid);
	REPORTS(&t, item);
	REPORTS(&t, "listen_fds=1");
	REPORTS(&t, "names=bufbrokerd.socket");
	REPORTS(&t, "fd=3:listen:0");
	REPORTS(&t, "fdstore=65536");
	REPORTS(&t, "notify=1");
	REPORTS(&t, "stray=0");
	status_of(t.d, &st);
	cr_assert(!st.ready && !strcmp(st.state, "starting"), "before READY=1: %s", st.state);
	toy_cmd(&t, "ready");
	status_of(t.d, &st);
	cr_assert(st.ready && !strcmp(st.state, "running") && st.readys == 1 && st.gen == 1);
	toy_cmd(&t, "stopping");
	status_of(t.d, &st);
	cr_assert_str_eq(st.state, "stopping");
	toy_end(&t);
}

Test(fakesd, what_was_stored_comes_back_after_a_crash_newest_first)
{
	toy t;
	char item[64];
	bbt_sd_state st;
	toy_start(&t);
	toy_cmd(&t, "ready");
	toy_cmd(&t, "store a A1");
	toy_cmd(&t, "store2 b B1 B2"); /* two fds of one name */
	toy_cmd(&t, "store c C1");
	toy_cmd(&t, "storedup d"); /* d-again: the same file, not stored */
	toy_cmd(&t, "pipe p");     /* hangs up: removed */
	toy_cmd(&t, "pipe0 q");    /* FDPOLL=0: kept */
	toy_cmd(&t, "remove c");
	names_until(t.d, "q,d,b,b,a");
	status_of(t.d, &st);
	cr_assert_eq(st.stored, 5);
	cr_assert_eq(st.dups, 1);
	int fd = bbt_sd_store_fd(t.d, "a");
	cr_assert(fd >= 0, "bbt_sd_store_fd: %d", fd);
	char buf[8] = "";
	cr_assert_eq(pread(fd, buf, sizeof(buf) - 1, 0), 2);
	cr_assert_str_eq(buf, "A1");
	close(fd);
	cr_assert_eq(bbt_sd_store_fd(t.d, "c"), -ENOENT);

	/* Stored, then dead at once: the store has it before the relaunch. */
	pid_t old = t.d->pid;
	const char *die = "diestore e E1";
	cr_assert_eq(bbt_send(t.conn, die, strlen(die)), 0);
	toy_accept(&t);
	status_of(t.d, &st);
	cr_assert_eq(st.gen, 2);
	cr_assert_neq(st.pid, old);
	snprintf(item, sizeof(item), "listen_pid=%d", (int)st.pid);
	REPORTS(&t, item);
	REPORTS(&t, "listen_fds=7");
	REPORTS(&t, "names=bufbrokerd.socket:e:q:d:b:b:a");
	REPORTS(&t, "fd=3:listen:0");
	REPORTS(&t, "fd=4:memfd=E1:0");
	REPORTS(&t, "fd=5:pipe:0");
	REPORTS(&t, "fd=6:memfd=d:0");
	/* Within one notification systemd's order is its fd set's (none to
	 * rely on); the stand-in's is newest first as across them. */
	REPORTS(&t, "fd=7:memfd=B2:0");
	REPORTS(&t, "fd=8:memfd=B1:0");
	REPORTS(&t, "fd=9:memfd=A1:0");
	REPORTS(&t, "stray=0");
	cr_assert(!st.ready, "the new process has not said READY=1 yet");
	/* The new process removes what it does not need. */
	toy_cmd(&t, "remove b");
	toy_cmd(&t, "remove e");
	names_until(t.d, "q,d,a");
	toy_end(&t);
}

Test(fakesd, past_the_store_limit_fds_are_closed)
{
	toy t;
	bbt_sd_state st;
	toy_start(&t);
	cr_assert_eq(bbt_sd_set_store_max(t.d, 2), 0);
	toy_cmd(&t, "store a A1");
	toy_cmd(&t, "store2 b B1 B2"); /* B2 does not fit */
	toy_cmd(&t, "store c C1");     /* nor this */
	status_of(t.d, &st);
	cr_assert_eq(st.stored, 2);
	cr_assert_eq(st.exfull, 2);
	names_until(t.d, "b,a");
	toy_cmd(&t, "remove a"); /* room again */
	toy_cmd(&t, "store c C1");
	names_until(t.d, "c,b");
	/* A non-zero exit restarts it, with $FDSTORE the limit. */
	const char *ex = "exit 3";
	cr_assert_eq(bbt_send(t.conn, ex, strlen(ex)), 0);
	toy_accept(&t);
	REPORTS(&t, "fdstore=2");
	REPORTS(&t, "listen_fds=3");
	REPORTS(&t, "names=bufbrokerd.socket:c:b");
	REPORTS(&t, "fd=5:memfd=B1:0");
	toy_end(&t);
}

Test(fakesd, only_the_main_process_is_heard)
{
	toy t;
	bbt_sd_state st;
	toy_start(&t);
	toy_cmd(&t, "other x X1");
	toy_cmd(&t, "store a A1"); /* after it, so that the other one was read */
	status_of(t.d, &st);
	cr_assert_eq(st.refused, 1);
	names_until(t.d, "a");
	toy_end(&t);
}

Test(fakesd, a_clean_exit_ends_the_service_and_empties_the_store)
{
	toy t;
	bbt_sd_state st;
	toy_start(&t);
	toy_cmd(&t, "store a A1");
	const char *ex = "exit 0";
	cr_assert_eq(bbt_send(t.conn, ex, strlen(ex)), 0);
	dead_until(t.d, &st);
	cr_assert_eq(st.stored, 0);
	cr_assert_eq(st.pid, -1);
	/* Not relaunched: well past RestartSec, still the first start. */
	bbt_sleep_ms(300);
	status_of(t.d, &st);
	cr_assert_eq(st.gen, 1);
	toy_end(&t);
}

Test(fakesd, sigterm_is_a_clean_end_too)
{
	toy t;
	bbt_sd_state st;
	toy_start(&t);
	cr_assert_eq(kill(t.d->pid, SIGTERM), 0);
	dead_until(t.d, &st);
	cr_assert_eq(st.gen, 1);
	toy_end(&t);
}

Test(fakesd, bufbrokerd_runs_crashes_and_stops_under_it)
{
	bbt_daemon *d = bbt_start_sd(NULL);
	pid_t first = d->pid;
	cr_assert(first > 0);
	cr_assert_eq(bbt_sd_pid(d), first);
	bb_client *c = bbt_connect(d);
	bbt_totals tot;
	cr_assert_eq(bbt_server_totals(c, &tot), 0);
	cr_assert_eq((pid_t)tot.pid, first, "the client reached the daemon under the stand-in");
	bb_disconnect(c);

	bbt_sd_crash(d);
	cr_assert_neq(d->pid, first);
	cr_assert_eq(bbt_sd_pid(d), d->pid);
	c = bbt_connect(d);
	cr_assert_eq(bbt_server_totals(c, &tot), 0);
	cr_assert_eq((pid_t)tot.pid, d->pid);
	bb_disconnect(c);

	pid_t sd = d->sd_pid;
	int status = bbt_stop(d);
	cr_assert(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "the daemon's stop: wait status %d", status);
	cr_assert_eq(kill(sd, 0), -1, "the stand-in is gone");
	struct stat sb;
	cr_assert_eq(stat(d->sock, &sb), -1, "the stand-in removed its socket");
}

/* LISTEN_FDNAMES as the kernel holds the running daemon's environment
 * (the daemon unsets the variable, but /proc/PID/environ keeps what exec
 * was given): its length, -1 when absent. */
static long listen_fdnames_len(pid_t pid)
{
	char path[64], *env = malloc(1 << 20);
	cr_assert(env);
	snprintf(path, sizeof(path), "/proc/%d/environ", (int)pid);
	FILE *f = fopen(path, "r");
	cr_assert(f, "%s: %s", path, strerror(errno));
	size_t n = fread(env, 1, (1 << 20) - 1, f);
	fclose(f);
	env[n] = '\0';
	long len = -1;
	for (size_t at = 0; at < n; at += strlen(env + at) + 1)
		if (!strncmp(env + at, "LISTEN_FDNAMES=", 15))
			len = (long)strlen(env + at + 15);
	free(env);
	return len;
}

/* Poll the store (as kept: bundles expanded) until it holds want names or
 * the deadline passed; the last count. Each b<id> in *names. */
static int kept_until(bbt_daemon *d, int want, char ***names)
{
	int64_t end = bbt_now_ms() + bbt_ms(10000);
	int n;
	for (;;) {
		n = bbt_sd_kept_names(d, names);
		if (n == want || bbt_now_ms() > end)
			return n;
		bbt_sd_names_free(*names);
		poll(NULL, 0, 20);
	}
}

/* The store holds the journal and between ceil(n / 64) and that + 2
 * bundles (two open), which keep every buffer of ids exactly once. */
static void store_keeps(bbt_daemon *d, const uint64_t *ids, int n)
{
	char **names, **kept;
	int stored = bbt_sd_store_names(d, &names), bundles = 0, journals = 0;
	cr_assert_gt(stored, 0);
	for (int i = 0; i < stored; i++) {
		bundles += names[i][0] == 'k';
		journals += !strncmp(names[i], "journal-", 8);
	}
	bbt_sd_names_free(names);
	int least = (n + 63) / 64;
	cr_assert(bundles >= least && bundles <= least + 2, "%d bundles for %d buffers", bundles,
		  n);
	cr_assert_eq(journals, 1);
	cr_assert_eq(stored, bundles + journals, "%d stored fds", stored);
	int got = kept_until(d, n + 1, &kept);
	cr_assert_eq(got, n + 1, "kept: %d names, want %d buffers and the journal", got, n);
	/* Each id once: mark them. */
	char *seen = calloc((size_t)n, 1);
	cr_assert(seen);
	for (int i = 0; i < got; i++) {
		if (!strncmp(kept[i], "journal-", 8))
			continue;
		cr_assert_eq(kept[i][0], 'b', "kept: %s", kept[i]);
		uint64_t id = strtoull(kept[i] + 1, NULL, 10);
		int at = -1;
		for (int lo = 0, hi = n - 1; lo <= hi && at < 0;) { /* ids ascend */
			int mid = (lo + hi) / 2;
			if (ids[mid] == id)
				at = mid;
			else if (ids[mid] < id)
				lo = mid + 1;
			else
				hi = mid - 1;
		}
		cr_assert(at >= 0 && !seen[at], "kept: %s (not a live buffer, or twice)", kept[i]);
		seen[at] = 1;
	}
	free(seen);
	bbt_sd_names_free(kept);
}

/* As many host buffers as one stored fd per buffer could ever keep, and
 * more where the open-file limit allows (one name each in LISTEN_FDNAMES,
 * which the kernel bounds at 128 KiB: buffers 1 to 20 000 took 126 KiB
 * with the daemon's margin, larger ids fewer): under the stand-in, 20 000
 * (2 000 under valgrind) survive a SIGKILL in about 313 bundles, every
 * byte of them, and LISTEN_FDNAMES stays under 4 KiB. The daemon holds
 * an fd per buffer: where RLIMIT_NOFILE cannot be raised past 20 000 (no
 * CAP_SYS_RESOURCE), as many as its limit allows, no fewer than 15 000. */
Test(fakesd, twenty_thousand_host_buffers_survive_a_sigkill_in_bundles, .timeout = 300)
{
	int n = getenv("BBT_VALGRIND") ? 2000 : 20000;
	/* fakesd, and the daemon after it, get this process's limit. */
	struct rlimit rl = {.rlim_cur = 65536, .rlim_max = 65536};
	if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
		cr_assert_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
		rl.rlim_cur = rl.rlim_max;
		cr_assert_eq(setrlimit(RLIMIT_NOFILE, &rl), 0, "%s", strerror(errno));
	}
	bbt_daemon *d =
		bbt_start_sd((const char *const[]){"--restart-grace", "600000", "--max-connections",
						   "4", "--host-pool-memfds", "0", NULL});
	bb_client *c1 = bbt_connect(d);
	bb_buf **bufs = calloc((size_t)n, sizeof(*bufs));
	uint64_t *ids = calloc((size_t)n, sizeof(*ids));
	cr_assert(bufs && ids);
	for (int i = 0; i < n; i++) {
		bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
		int rc = bb_alloc(c1, &o, &bufs[i]);
		if (rc == BB_ERR_NO_MEMORY && strstr(bb_last_error(), "--max-host-buffers")) {
			n = i; /* the daemon's open-file limit */
			break;
		}
		cr_assert_eq(rc, 0, "buffer %d: %s", i, bb_last_error());
		void *p = NULL;
		cr_assert_eq(bb_map(bufs[i], &p), 0, "%s", bb_last_error());
		bbt_fill(p, 4096, (uint32_t)i);
		ids[i] = bb_id(bufs[i]);
		cr_assert(i == 0 || ids[i] > ids[i - 1]);
		/* Buffer i opened a bundle: the stand-in has it before the next
		 * one is sent. The notify socket holds net.unix.max_dgram_qlen
		 * datagrams (10 without systemd, which raises it to 512), and a
		 * bundle the daemon cannot send within 10 ms is not stored: a
		 * stand-in starved of CPU must not make buffers unprotected. */
		int64_t end = bbt_now_ms() + bbt_ms(10000);
		while (i % 64 == 0 && bbt_sd_store_count(d) < i / 64 + 2 && bbt_now_ms() < end)
			poll(NULL, 0, 1);
	}
	if (!getenv("BBT_VALGRIND"))
		cr_assert_geq(n, 15000, "only %d host buffers within RLIMIT_NOFILE %llu", n,
			      (unsigned long long)rl.rlim_max);
	store_keeps(d, ids, n);

	bbt_sd_crash(d);
	long names = listen_fdnames_len(d->pid);
	cr_assert(names > 0 && names < 4096, "LISTEN_FDNAMES: %ld bytes", names);
	bb_client *c2 = bbt_connect(d);
	bbt_restart_info st;
	cr_assert_eq(bbt_server_restart(c2, &st), 0);
	cr_assert_eq(st.restarts, 1);
	cr_assert_eq(st.restored_buffers, (uint64_t)n);
	cr_assert_eq(st.unprotected_buffers, 0);
	for (int i = 0; i < n; i++) {
		bb_buf *b = NULL;
		void *p = NULL;
		cr_assert_eq(bb_open(c2, ids[i], &b), 0, "buffer %d: %s", i, bb_last_error());
		cr_assert_eq(bb_map(b, &p), 0, "%s", bb_last_error());
		cr_assert(bbt_check(p, 4096, (uint32_t)i), "buffer %d lost its bytes", i);
		bb_unref(b);
	}
	cr_assert_eq(bbt_check_problems(c2), 0);
	store_keeps(d, ids, n);
	bb_disconnect(c2);
	for (int i = 0; i < n; i++)
		bb_unref(bufs[i]);
	bb_disconnect(c1);
	free(bufs);
	free(ids);
}
