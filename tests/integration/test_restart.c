/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Live restart, daemon side (docs/RESTART.md, increment 3): a real daemon
 * run by a stand-in for systemd that this file plays itself, as systemd
 * does: the listening socket is the stand-in's, a NOTIFY_SOCKET datagram
 * socket receives READY=1 and the FDSTORE=1 / FDSTOREREMOVE=1 messages with
 * their fds (SCM_RIGHTS), and after a SIGKILL the daemon is started again
 * with the stored fds at 3.. behind the listening socket (LISTEN_FDS,
 * LISTEN_FDNAMES, LISTEN_PID set in the child between fork and exec).
 *
 * Proves: host buffers (contents, names, states, error texts, references,
 * tokens and their deadlines, ids never reused) survive a SIGKILL, and the
 * mappings of their old clients stay valid; the store holds exactly the
 * journal and the bundles whose queues hold one fd per live host buffer
 * (freed and pooled memfds leave them); within FileDescriptorStoreMax and
 * the names bound, a buffer no bundle could take is served and FAILED at
 * a restart; a session nobody resumes is released after the grace period; legacy
 * CUDA buffers become FAILED with the message that says why (fakecuda); a
 * corrupted journal is refused and the daemon starts empty, or with
 * --restart-strict does not start.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client_internal.h"
#include "cuda_api.h"
#include "harness.h"

#define STORE_MAX 4096
#define READY_MS 5000 /* a start, times bbt_slow */

/* The systemd stand-in: the service's listening socket, its notify socket,
 * its fd store and its main process. */
typedef struct fsd {
	bbt_daemon d; /* dir, sock (the listening socket's path), log, pid */
	char notify[160];
	int notify_fd; /* bound SOCK_DGRAM: what the daemon sends */
	int listen_fd; /* bound, listening SOCK_SEQPACKET: the socket unit's */
	char names[STORE_MAX][64];
	int fds[STORE_MAX];
	int n;         /* entries of the store */
	int store_max; /* FileDescriptorStoreMax ($FDSTORE when the test sets it) */
	int dropped;   /* fds past store_max, closed (systemd logs them) */
	bool ready;
	const char *args[BBT_MAX_ARGS];
	bool fake_cuda; /* the daemon loads $BB_FAKECUDA */
} fsd;

static fsd g_fsd;

static void fsd_cleanup(void)
{
	fsd *f = &g_fsd;
	if (f->d.pid > 0) {
		kill(f->d.pid, SIGKILL);
		waitpid(f->d.pid, NULL, 0);
		f->d.pid = -1;
	}
	for (int i = 0; i < f->n; i++)
		close(f->fds[i]);
	f->n = 0;
	if (f->notify_fd > 0)
		close(f->notify_fd);
	if (f->listen_fd > 0)
		close(f->listen_fd);
	f->notify_fd = f->listen_fd = -1;
	if (f->d.dir[0]) {
		char cmd[200];
		snprintf(cmd, sizeof(cmd), "rm -rf %.150s", f->d.dir);
		if (system(cmd) != 0)
			fprintf(stderr, "could not remove %s\n", f->d.dir);
	}
	memset(f->d.dir, 0, sizeof(f->d.dir));
	bbt_cleanup_fakecuda(f->fake_cuda);
	f->fake_cuda = false;
}

TestSuite(restart, .fini = fsd_cleanup, .timeout = 120);

/* The stored fd of that name (a journal), or -1. */
static int store_find(const fsd *f, const char *name)
{
	for (int i = 0; i < f->n; i++)
		if (strcmp(f->names[i], name) == 0)
			return i;
	return -1;
}

static bool is_bundle(const char *name)
{
	return name[0] == 'k' && name[1] >= '1' && name[1] <= '9';
}

/* The store as kept: the names that are s (that start with s: prefix),
 * each stored bundle k<n> seen as the names its queue holds
 * (bbt_bundle_names). A kept fd is stored when a stored bundle holds it
 * or it is stored by its own name. */
static int kept_count(const fsd *f, const char *s, bool prefix)
{
	size_t len = strlen(s) + !prefix;
	int n = 0;
	for (int i = 0; i < f->n; i++) {
		char **held = NULL;
		int k = is_bundle(f->names[i]) ? bbt_bundle_names(f->fds[i], &held) : 0;
		cr_assert_geq(k, 0, "%s cannot be peeked: %s", f->names[i], strerror(-k));
		n += !held && !strncmp(f->names[i], s, len);
		for (int j = 0; j < k; j++)
			n += !strncmp(held[j], s, len);
		bbt_sd_names_free(held);
	}
	return n;
}

/* Kept fds whose name starts with prefix. */
static int store_count(const fsd *f, const char *prefix)
{
	return kept_count(f, prefix, true);
}

static bool stored(const fsd *f, const char *name)
{
	return kept_count(f, name, false) > 0;
}

/* Bundles in the store. */
static int store_bundles(const fsd *f)
{
	int n = 0;
	for (int i = 0; i < f->n; i++)
		n += is_bundle(f->names[i]);
	return n;
}

static void store_remove(fsd *f, const char *name)
{
	for (int i = 0; i < f->n;) {
		if (strcmp(f->names[i], name) == 0) {
			close(f->fds[i]);
			f->n--;
			memmove(&f->names[i], &f->names[i + 1],
				(size_t)(f->n - i) * sizeof(f->names[0]));
			memmove(&f->fds[i], &f->fds[i + 1], (size_t)(f->n - i) * sizeof(f->fds[0]));
		} else {
			i++;
		}
	}
}

/* Take one notification, as systemd does. false: none within timeout_ms. */
static bool fsd_pump(fsd *f, int timeout_ms)
{
	struct pollfd p = {.fd = f->notify_fd, .events = POLLIN};
	if (poll(&p, 1, timeout_ms) <= 0)
		return false;
	char text[4096];
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * 253)];
	} c;
	struct iovec iov = {.iov_base = text, .iov_len = sizeof(text) - 1};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = c.buf,
			    .msg_controllen = sizeof(c.buf)};
	ssize_t len = recvmsg(f->notify_fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	if (len < 0)
		return false;
	text[len] = '\0';
	int got[253], ngot = 0;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
		if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
			int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			memcpy(got + ngot, CMSG_DATA(cm), (size_t)k * sizeof(int));
			ngot += k;
		}
	bool store = false, remove = false;
	char name[64] = "";
	for (char *save, *line = strtok_r(text, "\n", &save); line;
	     line = strtok_r(NULL, "\n", &save)) {
		if (!strcmp(line, "READY=1"))
			f->ready = true;
		else if (!strcmp(line, "FDSTORE=1"))
			store = true;
		else if (!strcmp(line, "FDSTOREREMOVE=1"))
			remove = true;
		else if (!strncmp(line, "FDNAME=", 7))
			snprintf(name, sizeof(name), "%s", line + 7);
	}
	if (remove)
		store_remove(f, name);
	for (int i = 0; i < ngot; i++) {
		if (store && f->n >= f->store_max) {
			f->dropped++;
		} else if (store) {
			/* systemd keeps one entry per file: a file it has is not
			 * added again (same_fd). */
			struct stat a, b;
			bool dup = false;
			fstat(got[i], &a);
			for (int j = 0; j < f->n && !dup; j++)
				dup = fstat(f->fds[j], &b) == 0 && a.st_dev == b.st_dev &&
				      a.st_ino == b.st_ino;
			if (!dup) {
				snprintf(f->names[f->n], sizeof(f->names[0]), "%s", name);
				f->fds[f->n++] = got[i];
				continue;
			}
		}
		close(got[i]);
	}
	return true;
}

/* Take every notification already queued. */
static void fsd_drain(fsd *f)
{
	while (fsd_pump(f, 0))
		;
}

/* Start the daemon with the store's fds, as systemd does (the listening
 * socket first), without waiting. */
static void fsd_launch(fsd *f, const char *const *more)
{
	const char *exe = getenv("BUFBROKERD");
	cr_assert(exe && *exe, "BUFBROKERD is not set");
	const char *argv[2 * BBT_MAX_ARGS + 8];
	int argc = 0;
	argv[argc++] = exe;
	argv[argc++] = "--socket";
	argv[argc++] = f->d.sock;
	argv[argc++] = "--restart";
	if (!f->fake_cuda)
		argv[argc++] = "--no-cuda";
	for (int i = 0; f->args[i]; i++)
		argv[argc++] = f->args[i];
	for (int i = 0; more && more[i]; i++)
		argv[argc++] = more[i];
	argv[argc] = NULL;

	static char names[STORE_MAX * 66 + 64];
	size_t used = (size_t)snprintf(names, sizeof(names), "bufbrokerd.socket");
	for (int i = 0; i < f->n; i++)
		used += (size_t)snprintf(names + used, sizeof(names) - used, ":%s", f->names[i]);
	f->ready = false;
	pid_t parent = getpid();
	pid_t pid = fork();
	cr_assert(pid >= 0);
	if (pid == 0) {
		int log = open(f->d.log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
		int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (log < 0 || null < 0)
			_exit(126);
		int total = 1 + f->n, above = 3 + total + 8;
		int moved[STORE_MAX + 1];
		moved[0] = fcntl(f->listen_fd, F_DUPFD, above);
		for (int i = 0; i < f->n; i++)
			moved[i + 1] = fcntl(f->fds[i], F_DUPFD, above);
		int lg = fcntl(log, F_DUPFD_CLOEXEC, above);
		int nl = fcntl(null, F_DUPFD_CLOEXEC, above);
		dup2(nl, 0);
		dup2(lg, 1);
		dup2(lg, 2);
		for (int i = 0; i < total; i++)
			if (moved[i] < 0 || dup2(moved[i], 3 + i) < 0)
				_exit(126);
		close_range((unsigned)(3 + total), ~0U, 0);
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(125);
		sigset_t all;
		sigemptyset(&all);
		sigprocmask(SIG_SETMASK, &all, NULL);
		signal(SIGPIPE, SIG_DFL);
		char num[32];
		snprintf(num, sizeof(num), "%d", total);
		setenv("LISTEN_FDS", num, 1);
		snprintf(num, sizeof(num), "%d", (int)getpid());
		setenv("LISTEN_PID", num, 1);
		setenv("LISTEN_FDNAMES", names, 1);
		setenv("NOTIFY_SOCKET", f->notify, 1);
		snprintf(num, sizeof(num), "%d", f->store_max);
		setenv("FDSTORE", num, 1);
		execv(exe, (char *const *)argv);
		_exit(127);
	}
	f->d.pid = pid;
}

/* Take notifications until READY=1 (asserting, deadline scaled). */
static void fsd_wait_ready(fsd *f)
{
	int64_t end = bbt_now_ms() + bbt_ms(READY_MS);
	while (!f->ready) {
		int status;
		if (waitpid(f->d.pid, &status, WNOHANG) == f->d.pid) {
			f->d.pid = -1;
			bbt_dump_log(&f->d);
			cr_assert_fail("the daemon exited (status %d) before READY=1", status);
		}
		if (bbt_now_ms() > end) {
			bbt_dump_log(&f->d);
			cr_assert_fail("no READY=1 within %d ms", bbt_ms(READY_MS));
		}
		fsd_pump(f, 20);
	}
}

static fsd *fsd_start(const char *const *args)
{
	fsd *f = &g_fsd;
	bool fake_cuda = f->fake_cuda;
	memset(f, 0, sizeof(*f));
	f->fake_cuda = fake_cuda;
	f->d.pid = -1;
	char dir[] = "/tmp/bbt-XXXXXX";
	cr_assert(mkdtemp(dir));
	snprintf(f->d.dir, sizeof(f->d.dir), "%s", dir);
	snprintf(f->d.sock, sizeof(f->d.sock), "%s/bb.sock", dir);
	snprintf(f->d.log, sizeof(f->d.log), "%s/daemon.log", dir);
	snprintf(f->notify, sizeof(f->notify), "%s/notify", dir);
	for (int i = 0; args && args[i]; i++)
		f->args[i] = args[i];
	/* FileDescriptorStoreMax: $FDSTORE when the test set it. */
	const char *max = getenv("FDSTORE");
	f->store_max = max && atoi(max) > 0 && atoi(max) < STORE_MAX ? atoi(max) : STORE_MAX;

	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	f->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", f->notify);
	cr_assert(bind(f->notify_fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	int big = 4 << 20;
	setsockopt(f->notify_fd, SOL_SOCKET, SO_RCVBUF, &big, sizeof(big));
	f->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", f->d.sock);
	cr_assert(bind(f->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	cr_assert(listen(f->listen_fd, 128) == 0);
	fsd_launch(f, NULL);
	fsd_wait_ready(f);
	return f;
}

/* SIGKILL the daemon; take what it sent before it died (systemd reads its
 * notify socket before it handles the death); start it again. */
static void fsd_kill(fsd *f)
{
	kill(f->d.pid, SIGKILL);
	waitpid(f->d.pid, NULL, 0);
	f->d.pid = -1;
	fsd_drain(f);
}

static void fsd_crash(fsd *f, const char *const *more)
{
	fsd_kill(f);
	fsd_launch(f, more);
	fsd_wait_ready(f);
}

/* Pump until the store holds want entries of prefix. */
static bool store_until(fsd *f, const char *prefix, int want)
{
	int64_t end = bbt_now_ms() + bbt_ms(3000);
	while (store_count(f, prefix) != want && bbt_now_ms() < end)
		fsd_pump(f, 10);
	return store_count(f, prefix) == want;
}

static bb_buf *alloc_host(bb_client *c, size_t size, const char *name)
{
	bb_alloc_opts o = {.size = size, .kind = BB_HOST, .name = name};
	bb_buf *b = NULL;
	int rc = bb_alloc(c, &o, &b);
	cr_assert_eq(rc, 0, "bb_alloc: %d (%s)", rc, bb_last_error());
	return b;
}

static void *map_fill(bb_buf *b, size_t size, uint32_t seed)
{
	void *p = NULL;
	cr_assert_eq(bb_map(b, &p), 0, "bb_map: %s", bb_last_error());
	bbt_fill(p, size, seed);
	return p;
}

static void stat_ok(bb_client *c, uint64_t id, bb_info *out)
{
	int rc = bb_stat(c, id, out);
	cr_assert_eq(rc, 0, "bb_stat(%llu): %d (%s)", (unsigned long long)id, rc, bb_last_error());
}

/* ServerStatus's restart fields (protocol 1.3). */
typedef bbt_restart_info restart_status;

static restart_status status_of(bb_client *c)
{
	restart_status out;
	cr_assert_eq(bbt_server_restart(c, &out), 0);
	return out;
}

static char name_of(char kind, uint64_t id, char out[32])
{
	snprintf(out, 32, "%c%llu", kind, (unsigned long long)id);
	return kind;
}

Test(restart, host_buffers_survive_a_sigkill_and_the_store_holds_what_a_restart_needs)
{
	fsd *f = fsd_start((const char *const[]){"--restart-grace", "600000", NULL});
	bb_client *c1 = bbt_connect(&f->d);
	char nm[32];

	/* READY, named, filled; FAILED with a message; PENDING; only a token. */
	bb_buf *a = alloc_host(c1, 65536, "kept-a");
	void *pa = map_fill(a, 65536, 1);
	cr_assert_eq(bb_set_ready(a), 0);
	bb_buf *b = alloc_host(c1, 8192, NULL);
	cr_assert_eq(bb_set_error(b, "broken on purpose"), 0);
	bb_buf *p = alloc_host(c1, 4096, "pending-p");
	bb_buf *t = alloc_host(c1, 12288, NULL);
	map_fill(t, 12288, 4);
	cr_assert_eq(bb_set_ready(t), 0);
	bb_token tok;
	uint64_t ta = bb_id(a), tb = bb_id(b), tp = bb_id(p), tt = bb_id(t);
	cr_assert_eq(bb_take(t, &tok), 0, "bb_take: %s", bb_last_error()); /* t's last count */
	bb_info before[4];
	uint64_t ids[4] = {ta, tb, tp, tt};
	for (int i = 0; i < 4; i++)
		stat_ok(c1, ids[i], &before[i]);

	/* A freed buffer's memfd leaves the store (pooled or closed). */
	bb_buf *gone = alloc_host(c1, 4096, NULL);
	uint64_t tgone = bb_id(gone);
	cr_assert(store_until(f, "b", 5), "store: %d b<id> entries, want 5", store_count(f, "b"));
	bb_unref(gone);
	cr_assert(bbt_stat_until_gone(c1, tgone, 3000) == BB_ERR_NOT_FOUND);
	cr_assert(store_until(f, "b", 4), "a freed buffer stayed in the store");
	name_of('b', tgone, nm);
	cr_assert_not(stored(f, nm));
	for (int i = 0; i < 4; i++)
		cr_assert(stored(f, (name_of('b', ids[i], nm), nm)), "%s not stored", nm);
	cr_assert_eq(store_count(f, "journal-"), 1);
	cr_assert_geq(store_find(f, "journal-1"), 0);
	/* The journal and the bundles (up to 64 fds each, two more open),
	 * each live buffer's fd in one of them once, nothing else. */
	cr_assert_eq(store_count(f, ""), 5, "kept: %d; want the journal and 4 buffers",
		     store_count(f, ""));
	cr_assert(store_bundles(f) >= 1 && store_bundles(f) <= 3, "%d bundles", store_bundles(f));
	cr_assert_eq(f->n, 1 + store_bundles(f), "the store holds %d fds", f->n);

	restart_status st = status_of(c1);
	cr_assert_eq(st.restarts, 0);
	cr_assert(st.restart_protected, "the journal is stored");
	cr_assert_gt(st.journal_bytes, 0);
	cr_assert_eq(st.unprotected_buffers, 0);

	fsd_crash(f, NULL);

	/* The old client's mapping is the memfd itself: still valid. */
	cr_assert(bbt_check(pa, 65536, 1), "a mapping lost its bytes across the restart");
	bb_client *c2 = bbt_connect(&f->d);
	st = status_of(c2);
	cr_assert_eq(st.restarts, 1);
	cr_assert_eq(st.restored_buffers, 4);
	cr_assert_eq(st.absent_sessions, 1, "c1's session is absent: %u", st.absent_sessions);
	cr_assert(st.restart_protected);
	for (int i = 0; i < 4; i++) {
		bb_info now;
		stat_ok(c2, ids[i], &now);
		cr_assert_eq(now.state, before[i].state, "buffer %llu: state %d, was %d",
			     (unsigned long long)ids[i], now.state, before[i].state);
		cr_assert_eq(now.refs, before[i].refs, "buffer %llu: refs %llu, were %llu",
			     (unsigned long long)ids[i], (unsigned long long)now.refs,
			     (unsigned long long)before[i].refs);
		cr_assert_eq(now.size, before[i].size);
		cr_assert_str_eq(now.name, before[i].name);
		cr_assert_str_eq(now.error, before[i].error);
	}
	cr_assert_str_eq(before[1].error, "broken on purpose");
	cr_assert_eq(before[2].state, BB_PENDING, "a restored PENDING buffer stays PENDING");

	/* Its bytes, by name, through the same file. */
	bb_buf *a2 = NULL;
	cr_assert_eq(bb_open_name(c2, "kept-a", &a2), 0, "%s", bb_last_error());
	void *pa2 = NULL;
	cr_assert_eq(bb_map(a2, &pa2), 0);
	cr_assert(bbt_check(pa2, 65536, 1));
	bbt_fill(pa2, 65536, 9);
	cr_assert(bbt_check(pa, 65536, 9), "the old and the new mapping are not one file");
	/* The token, adopted after the restart. */
	bb_buf *t2 = NULL;
	cr_assert_eq(bb_adopt(c2, &tok, &t2), 0, "bb_adopt: %s", bb_last_error());
	void *pt2 = NULL;
	cr_assert_eq(bb_map(t2, &pt2), 0);
	cr_assert(bbt_check(pt2, 12288, 4));
	/* Ids are never reused. */
	bb_buf *n = alloc_host(c2, 4096, NULL);
	cr_assert_gt(bb_id(n), tgone, "id %llu handed out again", (unsigned long long)bb_id(n));
	cr_assert_eq(bbt_check_problems(c2), 0, "bufbroker check reports problems");

	/* The store: the new journal generation only, and one fd per live
	 * host buffer, in bundles. */
	cr_assert(store_until(f, "b", 5), "store: %d b<id>, want 5", store_count(f, "b"));
	cr_assert_eq(store_count(f, "journal-"), 1);
	cr_assert_geq(store_find(f, "journal-2"), 0, "the new journal generation is not stored");
	name_of('b', bb_id(n), nm);
	cr_assert(stored(f, nm));
	cr_assert_eq(store_count(f, ""), 6, "kept: %d; want the journal and 5 buffers",
		     store_count(f, ""));
	cr_assert_eq(f->n, 1 + store_bundles(f), "the store holds %d fds", f->n);
	bb_unref(n);
	bb_unref(a2);
	bb_unref(t2);
	bb_disconnect(c2);
	bb_unref(a);
	bb_unref(b);
	bb_unref(p);
	bb_disconnect(c1);
}

Test(restart, a_session_not_resumed_is_released_after_the_grace_period)
{
	char grace[32];
	snprintf(grace, sizeof(grace), "%d", bbt_ms(1500));
	fsd *f = fsd_start((const char *const[]){"--restart-grace", grace, NULL});
	bb_client *c1 = bbt_connect(&f->d);
	bb_buf *q = alloc_host(c1, 4096, NULL);    /* held by c1's session only */
	bb_buf *pend = alloc_host(c1, 4096, NULL); /* PENDING, kept by a token */
	cr_assert_eq(bb_set_ready(q), 0);
	uint64_t tq = bb_id(q), tpend = bb_id(pend);
	bb_buf *keep = bb_ref(pend);
	bb_token tok;
	cr_assert_eq(bb_take(keep, &tok), 0);
	cr_assert(store_until(f, "b", 2));

	int64_t crashed = bbt_now_ms();
	fsd_crash(f, NULL);
	bb_client *c2 = bbt_connect(&f->d);
	bb_info info;
	/* Within the grace period the absent session still holds it. */
	int rc = bb_stat(c2, tq, &info);
	if (bbt_now_ms() - crashed < bbt_ms(1500) / 2)
		cr_assert_eq(rc, 0, "released before its grace period: %s", bb_last_error());
	/* Then it is released as a disconnect: its count goes (the buffer with
	 * it), its PENDING buffer fails, its token lives on. */
	cr_assert_eq(bbt_stat_until_gone(c2, tq, 6000), BB_ERR_NOT_FOUND,
		     "the absent session's buffer outlived the grace period");
	stat_ok(c2, tpend, &info);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_str_eq(info.error, "producer disconnected");
	cr_assert_eq(info.refs, 1, "the token's reference: refs %llu",
		     (unsigned long long)info.refs);
	cr_assert(store_until(f, "b", 1), "a released buffer stayed in the store");
	cr_assert_eq(bbt_check_problems(c2), 0);
	bb_disconnect(c2);
	bb_unref(q);
	bb_unref(pend);
	bb_disconnect(c1);
}

Test(restart, a_token_keeps_its_deadline_across_a_restart)
{
	const int ttl = bbt_ms(2500);
	char ttls[32];
	snprintf(ttls, sizeof(ttls), "%d", ttl);
	fsd *f = fsd_start((const char *const[]){"--token-ttl", ttls, NULL});
	bb_client *c1 = bbt_connect(&f->d);
	bb_buf *x = alloc_host(c1, 4096, NULL);
	uint64_t tx = bb_id(x);
	bb_token tok;
	int64_t taken = bbt_now_ms();
	cr_assert_eq(bb_take(x, &tok), 0); /* the token holds its only reference */
	bb_disconnect(c1);
	fsd_crash(f, NULL);
	bb_client *c2 = bbt_connect(&f->d);
	/* Gone by the token's own deadline (plus the expiry sweep), not one
	 * restarted from the new start. */
	int left = (int)(taken + ttl + bbt_ms(1500) - bbt_now_ms());
	cr_assert_gt(left, 0, "the restart took longer than the token's TTL");
	/* bbt_stat_until_gone scales what it is given: give it unscaled. */
	cr_assert_eq(bbt_stat_until_gone(c2, tx, (left + bbt_slow() - 1) / bbt_slow()),
		     BB_ERR_NOT_FOUND, "the token outlived its deadline");
	bb_buf *late = NULL;
	cr_assert_neq(bb_adopt(c2, &tok, &late), 0);
	bb_disconnect(c2);
}

/* SIGKILL the daemon, take what it sent, then overwrite both commit
 * copies of the stored journal (page 0, 2048 and 2176): no valid commit,
 * so journal_read refuses it. Not started again. */
static void kill_and_corrupt(fsd *f)
{
	fsd_kill(f);
	int i = store_find(f, "journal-1");
	cr_assert_geq(i, 0);
	unsigned char junk[256];
	memset(junk, 0x5a, sizeof(junk));
	cr_assert_eq(pwrite(f->fds[i], junk, sizeof(junk), 2048), (ssize_t)sizeof(junk));
}

Test(restart, a_corrupted_journal_is_refused_and_the_daemon_starts_empty)
{
	fsd *f = fsd_start(NULL);
	bb_client *c1 = bbt_connect(&f->d);
	bb_buf *a = alloc_host(c1, 4096, "doomed");
	uint64_t ta = bb_id(a);
	cr_assert(store_until(f, "b", 1));
	kill_and_corrupt(f);
	size_t from = bbt_log_size(&f->d);
	fsd_launch(f, NULL);
	fsd_wait_ready(f);
	cr_assert(bbt_log_wait_line(&f->d, from, bbt_ms(2000),
				    (const char *const[]){"event=restart_refused", NULL}));
	bb_client *c2 = bbt_connect(&f->d);
	bb_info info;
	cr_assert_eq(bb_stat(c2, ta, &info), BB_ERR_NOT_FOUND, "a refused state was served");
	bb_buf *n = NULL;
	cr_assert_eq(bb_open_name(c2, "doomed", &n), BB_ERR_NOT_FOUND);
	/* Every kept fd went (their bundles with them); the new journal is
	 * stored. */
	cr_assert(store_until(f, "b", 0));
	cr_assert_eq(f->n, 1, "store: %d fds, want the new journal only", f->n);
	cr_assert_geq(store_find(f, "journal-2"), 0);
	cr_assert_eq(bbt_check_problems(c2), 0);
	bb_disconnect(c2);
	bb_unref(a);
	bb_disconnect(c1);
}

Test(restart, with_restart_strict_a_corrupted_journal_stops_the_start)
{
	fsd *f = fsd_start(NULL);
	bb_client *c1 = bbt_connect(&f->d);
	bb_buf *a = alloc_host(c1, 4096, NULL);
	cr_assert(store_until(f, "b", 1));
	kill_and_corrupt(f);
	fsd_launch(f, (const char *const[]){"--restart-strict", NULL});
	int code = bbt_join(f->d.pid, bbt_ms(READY_MS));
	f->d.pid = -1;
	cr_assert_geq(code, 0, "the strict daemon did not exit");
	cr_assert_neq(code, 0, "the strict daemon exited 0");
	cr_assert_not(f->ready, "a strict daemon served a refused state");
	/* The store is left as it was, for the operator to look at. */
	cr_assert_geq(store_find(f, "journal-1"), 0);
	cr_assert_eq(store_count(f, "b"), 1);
	bb_unref(a);
	bb_disconnect(c1);
}

Test(restart, legacy_cuda_buffers_become_failed_with_the_reason)
{
	const char *lib = getenv("BB_FAKECUDA");
	cr_assert(lib && lib[0], "BB_FAKECUDA must name the built libfakecuda.so");
	char ns[64];
	snprintf(ns, sizeof(ns), "bbt-restart-%d", (int)getpid());
	setenv("BUFBROKER_CUDA_LIBRARY", lib, 1);
	setenv("FAKECUDA_NAMESPACE", ns, 1);
	unsetenv("CUDA_VISIBLE_DEVICES");
	g_fsd.fake_cuda = true;
	fsd *f = fsd_start((const char *const[]){"--cuda-handle", "legacy", NULL});
	bb_client *c1 = bbt_connect(&f->d);
	bb_alloc_opts o = {.size = 1 << 20, .kind = BB_CUDA};
	bb_buf *g = NULL;
	cr_assert_eq(bb_alloc_cuda(c1, &o, BB_CUDA_HANDLE_LEGACY, &g), 0, "%s", bb_last_error());
	cr_assert_eq(bb_set_ready(g), 0);
	bb_buf *h = alloc_host(c1, 4096, NULL);
	uint64_t tg = bb_id(g), th = bb_id(h);
	cr_assert(store_until(f, "b", 1), "a legacy CUDA buffer has no fd to store");
	fsd_crash(f, NULL);
	bb_client *c2 = bbt_connect(&f->d);
	bb_info info;
	stat_ok(c2, tg, &info);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert(strstr(info.error, "legacy CUDA IPC memory does not survive"), "error: \"%s\"",
		  info.error);
	cr_assert(strstr(info.error, "BB_CUDA_HANDLE_VMM"));
	cr_assert_eq(info.refs, 1, "its reference is kept: refs %llu",
		     (unsigned long long)info.refs);
	stat_ok(c2, th, &info);
	cr_assert_eq(info.state, BB_PENDING, "the host buffer beside it survives");
	bb_buf *o2 = NULL;
	cr_assert_eq(bb_open(c2, tg, &o2), BB_ERR_FAILED);
	cr_assert_eq(bbt_check_problems(c2), 0);
	bb_disconnect(c2);
	bb_unref(g);
	bb_unref(h);
	bb_disconnect(c1);
}

/* n host buffers filled, each with its index's pattern. */
static bb_buf **alloc_filled(fsd *f, bb_client *c, int n)
{
	bb_buf **bufs = calloc((size_t)n, sizeof(*bufs));
	cr_assert_not_null(bufs);
	for (int i = 0; i < n; i++) {
		bufs[i] = alloc_host(c, 4096, NULL);
		map_fill(bufs[i], 4096, (uint32_t)i);
	}
	fsd_drain(f);
	return bufs;
}

/* After a restart: exactly the buffers whose fd was not kept are FAILED,
 * the others hold their bytes; how many failed. */
static int failed_are_the_unkept(bb_client *c, bb_buf **bufs, const bool *kept, int n)
{
	int failed = 0;
	for (int i = 0; i < n; i++) {
		bb_info info;
		stat_ok(c, bb_id(bufs[i]), &info);
		if (!kept[i]) {
			cr_assert_eq(info.state, BB_FAILED, "buffer %d was not kept but served", i);
			cr_assert_str_eq(info.error, "its memory was not kept across the restart");
			failed++;
			continue;
		}
		cr_assert_eq(info.state, BB_PENDING, "buffer %d: %s", i, info.error);
		bb_buf *b = NULL;
		void *p = NULL;
		cr_assert_eq(bb_open(c, bb_id(bufs[i]), &b), 0, "%s", bb_last_error());
		cr_assert_eq(bb_map(b, &p), 0);
		cr_assert(bbt_check(p, 4096, (uint32_t)i), "buffer %d lost its bytes", i);
		bb_unref(b);
	}
	cr_assert_eq(bbt_check_problems(c), 0);
	return failed;
}

/* Which of bufs the store keeps (in a stored bundle); how many. */
static int kept_of(fsd *f, bb_buf **bufs, bool *kept, int n)
{
	char nm[32];
	int k = 0;
	for (int i = 0; i < n; i++)
		k += kept[i] = stored(f, (name_of('b', bb_id(bufs[i]), nm), nm));
	return k;
}

#define ONE_BUNDLE 66 /* host buffers: one bundle's 64, and two */

/* The store takes one bundle (the caller's environment says why): of
 * ONE_BUNDLE buffers, 64 are kept and two served unprotected (counted,
 * and logged as event); after a crash exactly those two are FAILED, the
 * rest hold their bytes. The buffers (c1's) in bufs; the client after
 * the crash. */
static bb_client *one_bundle_kept(fsd *f, bb_client *c1, const char *event, bb_buf ***bufs)
{
	*bufs = alloc_filled(f, c1, ONE_BUNDLE);
	bool kept[ONE_BUNDLE];
	restart_status st = status_of(c1);
	int stored_n = kept_of(f, *bufs, kept, ONE_BUNDLE);
	cr_assert_eq(stored_n, 64, "one bundle's worth: %d", stored_n);
	cr_assert_eq(store_bundles(f), 1);
	cr_assert_eq(st.unprotected_buffers, (uint64_t)(ONE_BUNDLE - stored_n),
		     "%llu buffers unprotected, %d of %d stored",
		     (unsigned long long)st.unprotected_buffers, stored_n, ONE_BUNDLE);
	cr_assert(bbt_log_wait_line(&f->d, 0, bbt_ms(2000), (const char *const[]){event, NULL}));
	fsd_crash(f, NULL);
	bb_client *c2 = bbt_connect(&f->d);
	cr_assert_eq(failed_are_the_unkept(c2, *bufs, kept, ONE_BUNDLE), ONE_BUNDLE - stored_n);
	return c2;
}

static void unref_all(bb_buf **bufs, int n)
{
	for (int i = 0; i < n; i++)
		if (bufs[i])
			bb_unref(bufs[i]);
	free(bufs);
}

/* FileDescriptorStoreMax ($FDSTORE) 3: one bundle and the two journals of
 * a start's handover. A bundle the store could not take is never sent:
 * the buffers past the first bundle are served unprotected, counted and
 * logged, and FAILED at a restart; the store never had to drop an fd. */
Test(restart, a_buffer_the_store_did_not_take_is_served_then_failed_at_a_restart)
{
	setenv("FDSTORE", "3", 1);
	fsd *f = fsd_start((const char *const[]){"--restart-grace", "600000", "--max-host-buffers",
						 "6400", NULL});
	unsetenv("FDSTORE");
	/* Said at start: 6 400 host buffers need 100 bundles, 105 entries. */
	cr_assert(bbt_log_wait_line(&f->d, 0, bbt_ms(2000),
				    (const char *const[]){"event=fdstore_too_small fdstore_max=3 "
							  "needed=105 host_buffers=6400",
							  NULL}));
	bb_client *c1 = bbt_connect(&f->d);
	bb_buf **bufs;
	bb_client *c2 = one_bundle_kept(f, c1, "event=fdstore_bundle_failed", &bufs);
	fsd_drain(f);
	cr_assert_eq(f->dropped, 0, "the store dropped %d fds past its maximum", f->dropped);
	cr_assert_leq(f->n, 3);
	bb_disconnect(c2);
	unref_all(bufs, ONE_BUNDLE);
	bb_disconnect(c1);
}

/* The names of the stored fds come back in one environment string
 * (LISTEN_FDNAMES), which the kernel bounds: the daemon stores no more
 * bundles than their names fit (a small bound for the test,
 * $BUFBROKERD_TEST_FDNAMES_MAX 3: "k1:", one bundle of 64 fds). */
Test(restart, the_store_holds_no_more_names_than_listen_fdnames_can_pass)
{
	setenv("BUFBROKERD_TEST_FDNAMES_MAX", "3", 1); /* the relaunch has it too */
	fsd *f = fsd_start((const char *const[]){"--restart-grace", "600000", NULL});
	bb_client *c1 = bbt_connect(&f->d);
	bb_buf **bufs;
	bb_client *c2 = one_bundle_kept(f, c1, "event=fdstore_names_full", &bufs);
	unsetenv("BUFBROKERD_TEST_FDNAMES_MAX");
	/* The restored bundle's name is counted again: no room for another. */
	bb_buf *more = alloc_host(c2, 4096, NULL);
	cr_assert_eq(status_of(c2).unprotected_buffers, 1);
	/* A kept buffer freed: its bundle cannot be rebuilt (no name left
	 * for another), so it stays as it is, and the daemon serves on. */
	uint64_t first = bb_id(bufs[0]);
	bb_info info;
	stat_ok(c1, first, &info); /* c1 resumes its session */
	bb_unref(bufs[0]);
	bufs[0] = NULL;
	cr_assert_eq(bbt_stat_until_gone(c2, first, 3000), BB_ERR_NOT_FOUND);
	cr_assert_eq(bbt_check_problems(c2), 0);
	fsd_drain(f);
	cr_assert_eq(store_bundles(f), 1);
	cr_assert_eq(store_count(f, "b"), 64, "the bundle holds what it held");
	bb_unref(more);
	bb_disconnect(c2);
	unref_all(bufs, ONE_BUNDLE);
	bb_disconnect(c1);
}

/* ---- VMM CUDA buffers ------------------------------------------------------------- */

#define VMM_BYTES (1u << 20)

/* Device 0's books as the daemon reports them. */
static void device0_of(bb_client *c, uint64_t *reserved, uint64_t *allocations)
{
	Bufbroker__Response *resp = NULL;
	cr_assert_eq(bbt_server_status(c, &resp), 0);
	cr_assert_geq(resp->server_status->n_devices, 1);
	*reserved = resp->server_status->devices[0]->reserved_bytes;
	*allocations = resp->server_status->devices[0]->vmm_allocations;
	bbc_response_free(resp);
}

/* Device 0's VMM allocations once they are want (a release may be sent
 * without waiting for its answer, and a free finishes off the loop). */
static uint64_t allocations_until(bb_client *c, uint64_t want)
{
	uint64_t reserved, allocations;
	int64_t end = bbt_now_ms() + bbt_ms(5000);
	for (;;) {
		device0_of(c, &reserved, &allocations);
		if (allocations == want || bbt_now_ms() > end)
			return allocations;
		poll(NULL, 0, 10);
	}
}

/* The fake driver in this process, device 0's primary context current. */
static void vmm_driver(bb_cuda *api)
{
	char err[256];
	CUdevice dev;
	CUcontext ctx;
	cr_assert_eq(bb_cuda_load(api, err, sizeof(err)), 0, "%s", err);
	cr_assert(api->MemcpyHtoD && api->MemcpyDtoH && api->MemGetInfo);
	cr_assert_eq(api->DeviceGet(&dev, 0), CUDA_SUCCESS);
	cr_assert_eq(api->DevicePrimaryCtxRetain(&ctx, dev), CUDA_SUCCESS);
	cr_assert_eq(api->CtxSetCurrent(ctx), CUDA_SUCCESS);
}

static void vmm_write(bb_cuda *api, void *p, uint32_t seed)
{
	static unsigned char h[VMM_BYTES];
	bbt_fill(h, VMM_BYTES, seed);
	cr_assert_eq(api->MemcpyHtoD((CUdeviceptr)(uintptr_t)p, h, VMM_BYTES), CUDA_SUCCESS);
}

static bool vmm_holds(bb_cuda *api, void *p, uint32_t seed)
{
	static unsigned char h[VMM_BYTES];
	memset(h, 0, sizeof(h));
	return api->MemcpyDtoH(h, (CUdeviceptr)(uintptr_t)p, VMM_BYTES) == CUDA_SUCCESS &&
	       bbt_check(h, VMM_BYTES, seed);
}

static bb_buf *vmm_alloc_size(bb_client *c, size_t size, bb_cuda_vmm *where)
{
	bb_alloc_opts o = {.size = size, .kind = BB_CUDA, .share = BB_SHARE_ANY};
	bb_buf *b = NULL;
	cr_assert_eq(bb_alloc_cuda(c, &o, BB_CUDA_HANDLE_VMM, &b), 0, "%s", bb_last_error());
	cr_assert_eq(bb_cuda_vmm_of(b, where), 0, "%s", bb_last_error());
	close(where->fd);
	return b;
}

static bb_buf *vmm_alloc(bb_client *c, bb_cuda_vmm *where)
{
	return vmm_alloc_size(c, VMM_BYTES, where);
}

/* A's contents, written through its mapping, and the mapping itself live
 * through a SIGKILL and an upgrade; the allocation comes back under its
 * identity (a<id> in the store again), new buffers are carved around A in
 * it, an allocation identity given before a restart is never given again
 * (clients key their mappings by it), and releasing everything frees it. */
Test(restart, vmm_cuda_buffers_survive_a_sigkill_and_an_upgrade_mapped)
{
	const char *lib = getenv("BB_FAKECUDA");
	cr_assert(lib && lib[0], "BB_FAKECUDA must name the built libfakecuda.so");
	char ns[64], nm[32];
	snprintf(ns, sizeof(ns), "bbt-restart-vmm-%d", (int)getpid());
	setenv("BUFBROKER_CUDA_LIBRARY", lib, 1);
	setenv("FAKECUDA_NAMESPACE", ns, 1);
	setenv("FAKECUDA_DEVICES", "1", 1);
	setenv("FAKECUDA_MEMORY", "256M", 1);
	setenv("FAKECUDA_VMM_FD", "1", 1);
	unsetenv("CUDA_VISIBLE_DEVICES");
	g_fsd.fake_cuda = true;
	fsd *f = fsd_start((const char *const[]){"--cuda-handle", "vmm", "--cuda-slab-bytes", "8M",
						 "--cuda-cache-bytes", "0", "--restart-grace",
						 "600000", NULL});
	bb_cuda api;
	vmm_driver(&api);
	size_t free0 = 0, total = 0;
	cr_assert_eq(api.MemGetInfo(&free0, &total), CUDA_SUCCESS);

	bb_client *c1 = bbt_connect(&f->d);
	bb_cuda_vmm wa, wb, wc;
	bb_buf *a = vmm_alloc(c1, &wa);
	void *pa = NULL;
	cr_assert_eq(bb_map(a, &pa), 0, "%s", bb_last_error());
	vmm_write(&api, pa, 41);
	cr_assert_eq(bb_set_ready(a), 0);
	name_of('a', wa.allocation, nm);
	cr_assert(store_until(f, "a", 1) && stored(f, nm), "%s is not in the store", nm);
	cr_assert_eq(store_count(f, "b"), 0, "a CUDA buffer has no b<id>");
	/* A dedicated allocation, freed before the crash: its identity was
	 * the last one given. */
	bb_cuda_vmm wd, we;
	bb_unref(vmm_alloc_size(c1, 9u << 20, &wd));
	cr_assert_gt(wd.allocation, wa.allocation);
	cr_assert_eq(allocations_until(c1, 1), 1, "the dedicated allocation is not freed");

	for (int round = 0; round < 2; round++) {
		if (round == 0) {
			fsd_crash(f, NULL);
		} else {
			size_t from = bbt_log_size(&f->d);
			cr_assert_eq(kill(f->d.pid, SIGUSR2), 0);
			static const char *const upgraded[] = {"event=upgraded", NULL};
			static const char *const listening[] = {"event=listening", NULL};
			cr_assert(bbt_log_wait_line(&f->d, from, 20000, upgraded) &&
					  bbt_log_wait_line(&f->d, from, 20000, listening),
				  "the new image did not start");
			fsd_drain(f);
		}
		cr_assert(vmm_holds(&api, pa, 41), "round %d: A's mapping lost its bytes", round);
		bb_info info;
		stat_ok(c1, bb_id(a), &info); /* c1 resumes its session */
		cr_assert_eq(info.state, BB_READY, "round %d: %s", round, info.error);
		cr_assert_eq(bb_client_resumes(c1), (uint64_t)round + 1);
		/* The dedicated allocation's removal may come after the Release's
		 * answer (end of the loop turn): an orphan the start removes. */
		cr_assert(store_until(f, "a", 1), "round %d: %d a<id> stored", round,
			  store_count(f, "a"));
		cr_assert(stored(f, nm), "round %d: %s left the store", round, nm);
		uint64_t reserved, allocations;
		device0_of(c1, &reserved, &allocations);
		cr_assert_eq(allocations, 1, "round %d: the slab is counted", round);
		cr_assert_eq(reserved, 8u << 20, "round %d: reserved %llu", round,
			     (unsigned long long)reserved);
		cr_assert_eq(bbt_check_problems(c1), 0, "round %d", round);
	}

	bb_buf *e = vmm_alloc_size(c1, 9u << 20, &we);
	cr_assert_gt(we.allocation, wd.allocation, "allocation %llu is given again",
		     (unsigned long long)we.allocation);
	bb_unref(e);
	/* A new buffer of the same slab gets a range beside A's, and maps
	 * through the mapping A's allocation already has here. */
	bb_buf *b = vmm_alloc(c1, &wb);
	cr_assert_eq(wb.allocation, wa.allocation, "carved from A's slab");
	cr_assert(wb.offset >= wa.offset + VMM_BYTES || wb.offset + VMM_BYTES <= wa.offset,
		  "B at %llu overlaps A at %llu", (unsigned long long)wb.offset,
		  (unsigned long long)wa.offset);
	void *pb = NULL;
	cr_assert_eq(bb_map(b, &pb), 0, "%s", bb_last_error());
	vmm_write(&api, pb, 42);
	cr_assert(vmm_holds(&api, pa, 41), "B's bytes went over A's");
	/* Another connection is sent the allocation's (kept) fd and reads A. */
	bb_client *c2 = bbt_connect(&f->d);
	bb_buf *a2 = NULL;
	void *pa2 = NULL;
	cr_assert_eq(bb_open(c2, bb_id(a), &a2), 0, "%s", bb_last_error());
	cr_assert_eq(bb_map(a2, &pa2), 0, "%s", bb_last_error());
	cr_assert(vmm_holds(&api, pa2, 41));
	/* A crash after the new buffer: both are restored where they were. */
	fsd_crash(f, NULL);
	bb_buf *c = vmm_alloc(c2, &wc);
	cr_assert_eq(wc.allocation, wa.allocation);
	cr_assert(wc.offset >= wb.offset + VMM_BYTES || wc.offset + VMM_BYTES <= wb.offset);
	cr_assert(wc.offset >= wa.offset + VMM_BYTES || wc.offset + VMM_BYTES <= wa.offset);
	cr_assert(vmm_holds(&api, pb, 42));
	cr_assert_eq(bbt_check_problems(c1), 0);

	/* Everything released: the allocation is freed and leaves the store. */
	bb_unref(c);
	bb_unref(a2);
	bb_unref(b);
	bb_unref(a);
	bb_disconnect(c2);
	bb_client *c3 = bbt_connect(&f->d);
	cr_assert(store_until(f, "a", 0), "%s stays in the store", nm);
	uint64_t reserved = 1, allocations = 1;
	int64_t end = bbt_now_ms() + bbt_ms(5000);
	for (;;) {
		device0_of(c3, &reserved, &allocations);
		if (!(reserved || allocations) || bbt_now_ms() > end)
			break;
		poll(NULL, 0, 10);
	}
	cr_assert_eq(allocations, 0);
	cr_assert_eq(reserved, 0);
	cr_assert_eq(bbt_check_problems(c3), 0);
	bb_disconnect(c3);
	bb_disconnect(c1);
	/* No process holds the allocation any more: the fake's device is
	 * whole again. */
	size_t fr = 0;
	end = bbt_now_ms() + bbt_ms(5000);
	while (api.MemGetInfo(&fr, &total) == CUDA_SUCCESS && fr != free0 && bbt_now_ms() < end)
		poll(NULL, 0, 10);
	cr_assert_eq(fr, free0, "the fake still counts %zu bytes", free0 - fr);
}
