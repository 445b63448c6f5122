/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Isolation and limits against a real bufbrokerd, as hostile local clients
 * meet them (docs/SECURITY.md): processes of two other uids probe each
 * other's buffers under every share policy, guess tokens, try to get past
 * the allow-lists, exceed each limit, stop reading and flood requests. The
 * daemon must refuse each with the right code and a message that carries
 * the numbers, keep serving everyone else, and end with its accounting at
 * zero. Hostile input (garbage datagrams) is test_badinput.c's.
 *
 * Runs as root: children switch to uids 65534 and 65533 against a daemon
 * whose socket is mode 0666 in a world-searchable directory. Children
 * report through exit codes: 0 is success, any other value names the step
 * that failed (see each child function).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "harness.h"
#include "wire.h"

#define UID_A 65534 /* nobody */
#define GID_A 65534 /* nogroup */
#define UID_B 65533
#define GID_B 65533
#define GID_C 65530 /* a group neither uid has unless a test gives it */
#define CHILD_TIMEOUT_MS 20000
#define KIB 1024u
#define MIB (1024u * 1024u)

static bool g_fake; /* a test put the daemon on libfakecuda.so */

/* After the daemon is gone: what a fake CUDA namespace left in /dev/shm. */
static void security_fini(void)
{
	bbt_cleanup_fakecuda(g_fake);
}

TestSuite(security, .fini = security_fini, .timeout = 90);

#define NEED_ROOT()                                                         \
	do {                                                                \
		if (geteuid() != 0)                                         \
			cr_skip_test("needs root to switch to other uids"); \
	} while (0)

/* ---- set-up ------------------------------------------------------------------ */

/* A daemon anyone may connect to: socket mode 0666 in a directory anyone
 * may search, plus the NULL-terminated extra arguments. */
static bbt_daemon *start_open(const char *const *extra)
{
	const char *args[BBT_MAX_ARGS];
	int n = 0;

	args[n++] = "--socket-mode";
	args[n++] = "0666";
	for (int i = 0; extra && extra[i]; i++) {
		cr_assert(n < BBT_MAX_ARGS - 1, "too many daemon arguments");
		args[n++] = extra[i];
	}
	args[n] = NULL;
	bbt_daemon *d = bbt_start(args);
	cr_assert_eq(chmod(d->dir, 0755), 0, "chmod %s: %s", d->dir, strerror(errno));
	return d;
}

/* The daemon and this process's clients on libfakecuda.so, one device of
 * 64 MiB in a namespace of this test's own; with BB_REAL_CUDA=1 and no
 * BB_FAKECUDA, on the real driver. Skips with neither. */
static void fake_cuda_env(void)
{
	static int seq;
	const char *fake = getenv("BB_FAKECUDA");
	char ns[64];

	if (!fake || !fake[0]) {
		if (!getenv("BB_REAL_CUDA"))
			cr_skip_test("BB_FAKECUDA is not set (ctest sets it to libfakecuda.so); "
				     "BB_REAL_CUDA=1 runs on the real driver");
		return;
	}
	g_fake = true;
	snprintf(ns, sizeof(ns), "bbtsec%d_%d", (int)getpid(), ++seq);
	unsetenv("CUDA_VISIBLE_DEVICES");
	setenv("BUFBROKER_CUDA_LIBRARY", fake, 1);
	setenv("FAKECUDA_NAMESPACE", ns, 1);
	setenv("FAKECUDA_DEVICES", "1", 1);
	setenv("FAKECUDA_MEMORY", "64M", 1);
}

/* Drop to uid:gid with exactly these supplementary groups. */
static int become(uid_t uid, gid_t gid, size_t ngroups, const gid_t *groups)
{
	if (setgroups(ngroups, groups) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
		return -1;
	prctl(PR_SET_DUMPABLE, 1);
	return getuid() == uid && geteuid() == uid && getgid() == gid ? 0 : -1;
}

/* ---- requests through a client ---------------------------------------------- */

/* Send req through c: the Status code of the answer (or the transport's
 * error). *out keeps the response when not NULL (bbc_response_free it). */
static int call(bb_client *c, Bufbroker__Request *req, Bufbroker__Response **out, int *fd_in)
{
	Bufbroker__Response *r = NULL;
	int rc = bbc_call(c, req, -1, &r, fd_in);

	if (out)
		*out = NULL;
	if (rc)
		return rc;
	rc = r->status ? r->status->code : BB_ERR_PROTOCOL;
	if (out)
		*out = r;
	else
		bbc_response_free(r);
	return rc;
}

static int call_wait(bb_client *c, uint64_t id, int32_t timeout_ms)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Wait w = BUFBROKER__WAIT__INIT;
	w.id = id;
	w.timeout_ms = timeout_ms;
	req.op_case = BUFBROKER__REQUEST__OP_WAIT;
	req.wait = &w;
	return call(c, &req, NULL, NULL);
}

static int call_set_error(bb_client *c, uint64_t id)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__SetError se = BUFBROKER__SET_ERROR__INIT;
	se.id = id;
	se.message = "spoiled by a stranger";
	req.op_case = BUFBROKER__REQUEST__OP_SET_ERROR;
	req.set_error = &se;
	return call(c, &req, NULL, NULL);
}

static int call_take(bb_client *c, uint64_t id)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Take t = BUFBROKER__TAKE__INIT;
	t.id = id;
	t.retain = true;
	req.op_case = BUFBROKER__REQUEST__OP_TAKE;
	req.take = &t;
	return call(c, &req, NULL, NULL);
}

/* Open by id on the wire, keeping the memfd the Grant carries in *fd (the
 * connection then holds one count the library does not know of). */
static int call_open_fd(bb_client *c, uint64_t id, int *fd)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Open o = BUFBROKER__OPEN__INIT;
	o.target_case = BUFBROKER__OPEN__TARGET_ID;
	o.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_OPEN;
	req.open = &o;
	return call(c, &req, NULL, fd);
}

/* The ids List shows c (up to max): their number, or a negative error. */
static int list_ids(bb_client *c, uint64_t *ids, int max)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__List l = BUFBROKER__LIST__INIT;
	Bufbroker__Response *r;
	req.op_case = BUFBROKER__REQUEST__OP_LIST;
	req.list = &l;
	int rc = call(c, &req, &r, NULL);
	if (rc)
		return rc < 0 ? rc : -1;
	int n = 0;
	for (size_t i = 0; r->list && i < r->list->n_buffers && n < max; i++)
		ids[n++] = r->list->buffers[i]->id;
	bbc_response_free(r);
	return n;
}

static bool listed(const uint64_t *ids, int n, uint64_t id)
{
	for (int i = 0; i < n; i++)
		if (ids[i] == id)
			return true;
	return false;
}

/* c is served: a buffer comes and goes, promptly, whatever others do. */
static void assert_served(bb_client *c, const char *when)
{
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	bb_buf *b = NULL;
	bb_info info;
	int64_t t0 = bbt_now_ms();

	int rc = bb_alloc(c, &o, &b);
	cr_assert_eq(rc, 0, "%s: another client's alloc failed: %d (%s)", when, rc,
		     bb_last_error());
	rc = bb_stat(c, bb_id(b), &info);
	cr_assert_eq(rc, 0, "%s: another client's stat failed: %d (%s)", when, rc, bb_last_error());
	bb_unref(b);
	int64_t took = bbt_now_ms() - t0;
	cr_assert_lt(took, bbt_ms(1000), "%s: another client waited %lld ms to be served", when,
		     (long long)took);
}

/* Every buffer, token, wait and connection but conns of the caller's is
 * gone, and the daemon's invariant check finds nothing wrong. */
static void assert_accounting_zero(bb_client *c, uint32_t conns)
{
	bbt_totals t;
	bool idle = bbt_totals_until_idle(c, conns, 5000, &t);
	cr_assert(idle,
		  "the daemon still counts %llu buffers (%llu bytes), %llu tokens, %llu waits, "
		  "%u connections (want 0, 0, 0, 0, %u)",
		  (unsigned long long)t.buffers, (unsigned long long)t.bytes,
		  (unsigned long long)t.tokens, (unsigned long long)t.waits, t.connections, conns);
	int problems = bbt_check_problems(c);
	cr_assert_eq(problems, 0, "the daemon's invariant check: %d (see stderr)", problems);
}

static bb_buf *alloc_kind(bb_client *c, bb_kind kind, size_t size, const char *name, int share)
{
	bb_alloc_opts o = {.size = size, .kind = kind, .name = name, .share = share};
	bb_buf *b = NULL;
	int rc = bb_alloc(c, &o, &b);
	cr_assert_eq(rc, 0, "bb_alloc(%zu): %d (%s)", size, rc, bb_last_error());
	return b;
}

/* bb_last_error() contains want. */
static bool said(const char *want)
{
	return strstr(bb_last_error(), want) != NULL;
}

/* ---- the raw wire --------------------------------------------------------------- */

/* A raw connection that said Hello. */
static int raw_hello(const bbt_daemon *d)
{
	int s = bbt_raw_connect(d->sock);
	cr_assert_geq(s, 0, "connect: %s", strerror(-s));
	cr_assert_eq(bbt_raw_hello(s, 1, BB_PROTO_MAJOR), 0, "Hello was refused");
	return s;
}

/* One response within timeout_ms: 1 with its id, code and message; 0 end
 * of stream; -ETIMEDOUT; another -errno. */
static int raw_answer(int s, int timeout_ms, uint64_t *id, int *code, char *msg, size_t len)
{
	Bufbroker__Response *r;
	int rc = bbt_raw_recv(s, timeout_ms, &r, NULL);
	if (rc != 1)
		return rc;
	*id = r->id;
	*code = r->status ? r->status->code : BB_ERR_PROTOCOL;
	if (msg)
		snprintf(msg, len, "%s", r->status && r->status->message ? r->status->message : "");
	bufbroker__response__free_unpacked(r, NULL);
	return 1;
}

/* Whether the daemon runs under valgrind (its RSS is then valgrind's). */
static bool under_valgrind(pid_t pid)
{
	char path[64], exe[512];
	snprintf(path, sizeof(path), "/proc/%d/exe", (int)pid);
	ssize_t n = readlink(path, exe, sizeof(exe) - 1);
	if (n <= 0)
		return false;
	exe[n] = '\0';
	return strstr(exe, "valgrind") || strstr(exe, "memcheck");
}

/* ---- share policies across uids -------------------------------------------- */

enum { P_UID, P_GID, P_ANY, NPOL };
static const char *const pol_name[NPOL] = {"sec-uid", "sec-gid", "sec-any"};
static const int pol_share[NPOL] = {BB_SHARE_UID, BB_SHARE_GID, BB_SHARE_ANY};

struct share_ctx {
	const char *sock;
	uint64_t ids[NPOL]; /* the owner's buffers, by policy */
	bb_token token;     /* one reference to the uid-only buffer */
	uint32_t seed;
	size_t size;
	bool allow[NPOL]; /* what the prober expects to be admitted to */
	bool adopt;       /* the prober adopts the token (else: NOT_FOUND, used) */
	gid_t gid;        /* the prober's gid */
	bbt_chan ch;
};

/* Uid A owns one buffer per policy and a token for the uid-only one; it
 * sends the ids and the token, and holds everything until told to go. */
static int owner_child(void *arg)
{
	struct share_ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b[NPOL];
	char quit;

	if (become(UID_A, GID_A, 0, NULL) != 0)
		return 9;
	if (bb_connect(x->sock, &c) != 0)
		return 10;
	for (int i = 0; i < NPOL; i++) {
		bb_alloc_opts o = {.size = x->size,
				   .kind = BB_HOST,
				   .name = pol_name[i],
				   .share = pol_share[i]};
		void *p;
		if (bb_alloc(c, &o, &b[i]) != 0)
			return 11;
		if (bb_map(b[i], &p) != 0)
			return 12;
		bbt_fill(p, x->size, x->seed + (uint32_t)i);
		if (bb_set_ready(b[i]) != 0)
			return 13;
		x->ids[i] = bb_id(b[i]);
	}
	if (bb_take(bb_ref(b[P_UID]), &x->token) != 0)
		return 14;
	if (bbt_send(x->ch.fd[1], x->ids, sizeof(x->ids)) != 0 ||
	    bbt_send(x->ch.fd[1], &x->token, sizeof(x->token)) != 0)
		return 15;
	if (bbt_recv(x->ch.fd[1], &quit, 1, CHILD_TIMEOUT_MS) != 0)
		return 16;
	for (int i = 0; i < NPOL; i++)
		bb_unref(b[i]);
	bb_disconnect(c);
	return 0;
}

/* Uid B (gid x->gid) tries each of uid A's buffers every way there is;
 * steps 20 + 10 * policy + n. */
static int prober_child(void *arg)
{
	struct share_ctx *x = arg;
	bb_client *c = NULL;
	uint64_t seen[64];

	if (become(UID_B, x->gid, 0, NULL) != 0)
		return 9;
	if (bb_connect(x->sock, &c) != 0)
		return 10;
	int nseen = list_ids(c, seen, 64);
	if (nseen < 0)
		return 11;
	for (int i = 0; i < NPOL; i++) {
		int step = 20 + 10 * i, want = x->allow[i] ? 0 : BB_ERR_DENIED;
		uint64_t id = x->ids[i];
		bb_buf *b = NULL, *b2 = NULL;
		bb_info info;
		void *p;

		if (listed(seen, nseen, id) != x->allow[i])
			return step + 0; /* ls shows exactly what it may open */
		if (bb_open(c, id, &b) != want)
			return step + 1;
		if (bb_open_name(c, pol_name[i], &b2) != want)
			return step + 2;
		if (bb_stat(c, id, &info) != want)
			return step + 3;
		if (bb_retain(c, id, 1) != want)
			return step + 4;
		if (call_wait(c, id, 0) != want)
			return step + 5;
		/* Settling needs a reference, whatever the policy says. */
		if (!x->allow[i] && call_set_error(c, id) != BB_ERR_DENIED)
			return step + 6;
		if (!x->allow[i]) {
			/* Nothing to release, nothing to take: A's counts are A's. */
			if (bb_release(c, id, 1) == 0)
				return step + 7;
			if (call_take(c, id) != BB_ERR_NOT_FOUND)
				return step + 8;
			continue;
		}
		if (b2 != b || bb_release(c, id, 1) != 0)
			return step + 7;
		if (bb_map(b, &p) != 0 || !bbt_check(p, x->size, x->seed + (uint32_t)i))
			return step + 8;
		/* The memfd is sealed: no shrinking, growing or write seal
		 * that would SIGBUS or lock out uid A's mapping. */
		int fd = -1;
		if (call_open_fd(c, id, &fd) != 0 || fd < 0)
			return step + 9;
		int seals = fcntl(fd, F_GET_SEALS);
		bool sealed = seals >= 0 && (seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) ==
						    (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
		bool held = ftruncate(fd, 0) != 0 && ftruncate(fd, (off_t)x->size * 2) != 0 &&
			    fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) != 0;
		close(fd);
		if (!sealed || !held || bb_release(c, id, 1) != 0)
			return step + 9;
		bb_unref(b2);
		bb_unref(b);
	}
	bb_buf *t = NULL;
	if (x->adopt) {
		void *p;
		if (bb_adopt(c, &x->token, &t) != 0)
			return 60;
		if (bb_id(t) != x->ids[P_UID])
			return 61;
		if (bb_map(t, &p) != 0 || !bbt_check(p, x->size, x->seed + P_UID))
			return 62;
		bb_unref(t);
	} else if (bb_adopt(c, &x->token, &t) != BB_ERR_NOT_FOUND) {
		return 63; /* single use */
	}
	bb_disconnect(c);
	return 0;
}

Test(security, other_uids_are_refused_by_uid_policy_admitted_by_gid_or_any_and_by_a_token)
{
	NEED_ROOT();
	bbt_daemon *d = start_open(NULL);
	bb_client *root = bbt_connect(d);
	struct share_ctx x = {.sock = d->sock, .seed = 777, .size = 8192};

	bbt_chan_open(&x.ch);
	pid_t owner = bbt_spawn(owner_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], x.ids, sizeof(x.ids), CHILD_TIMEOUT_MS), 0,
		     "the owner sent no ids (exit %d)", bbt_join(owner, 100));
	cr_assert_eq(bbt_recv(x.ch.fd[0], &x.token, sizeof(x.token), CHILD_TIMEOUT_MS), 0);

	/* Another uid and another group: only BB_SHARE_ANY, and the token. */
	x.gid = GID_B;
	x.allow[P_UID] = false, x.allow[P_GID] = false, x.allow[P_ANY] = true;
	x.adopt = true;
	int code = bbt_join(bbt_spawn(prober_child, &x), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "uid %d gid %d: step %d", UID_B, GID_B, code);

	/* Another uid in the owner's group: BB_SHARE_GID too; the token is used. */
	x.gid = GID_A;
	x.allow[P_GID] = true;
	x.adopt = false;
	code = bbt_join(bbt_spawn(prober_child, &x), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "uid %d gid %d: step %d", UID_B, GID_A, code);

	/* Root sees and opens all; nothing the probers did stuck: each buffer
	 * has the owner's one count (the token went with its adopter). */
	uint64_t seen[16];
	int n = list_ids(root, seen, 16);
	for (int i = 0; i < NPOL; i++) {
		cr_assert(listed(seen, n, x.ids[i]), "root does not see %s", pol_name[i]);
		bb_info info;
		cr_assert_eq(bb_stat(root, x.ids[i], &info), 0);
		cr_assert_eq(info.state, BB_READY, "%s: a stranger changed its state", pol_name[i]);
		cr_assert_eq(bbt_refs_until(root, x.ids[i], 1, 2000), 1, "%s: refs %lld, want 1",
			     pol_name[i], (long long)bbt_refs(root, x.ids[i]));
	}
	cr_assert_eq(bbt_send(x.ch.fd[0], "q", 1), 0);
	code = bbt_join(owner, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the owner failed at step %d", code);
	bbt_chan_close(&x.ch);
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
}

/* ---- a memfd sent to another uid is never reused ------------------------------ */

struct stale_ctx {
	const char *sock;
	uint64_t id; /* root's buffer, BB_SHARE_ANY */
	size_t size;
	uint32_t seed; /* what root writes into the buffer made after the free */
	bbt_chan ch;
};

/* Uid B opens root's buffer on the wire, keeps the memfd it is sent,
 * gives its count back and goes; after root freed that buffer and made
 * another of the same size, the kept memfd must not show the new one. */
static int stale_holder_child(void *arg)
{
	struct stale_ctx *x = arg;
	bb_client *c = NULL;
	int fd = -1;
	char go;

	if (become(UID_B, GID_B, 0, NULL) != 0)
		return 9;
	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (call_open_fd(c, x->id, &fd) != 0 || fd < 0)
		return 11;
	if (bb_release(c, x->id, 1) != 0)
		return 12;
	bb_disconnect(c);
	if (bbt_send(x->ch.fd[1], "k", 1) != 0)
		return 13;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
		return 14;
	void *p = mmap(NULL, x->size, PROT_READ, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return 15;
	bool leaked = bbt_check(p, x->size, x->seed);
	munmap(p, x->size);
	close(fd);
	return leaked ? 16 : 0;
}

Test(security, a_memfd_sent_to_another_uid_is_never_reused)
{
	NEED_ROOT();
	bbt_daemon *d = start_open(NULL);
	bb_client *root = bbt_connect(d);
	struct stale_ctx x = {.sock = d->sock, .size = 64 * 1024, .seed = 4242};
	bb_alloc_opts o = {.size = x.size, .kind = BB_HOST, .share = BB_SHARE_ANY};
	bb_buf *a = NULL, *b = NULL;
	bb_info info;
	void *p;

	cr_assert_eq(bb_alloc(root, &o, &a), 0, "bb_alloc: %s", bb_last_error());
	x.id = bb_id(a);
	bbt_chan_open(&x.ch);
	pid_t holder = bbt_spawn(stale_holder_child, &x);
	char k;
	cr_assert_eq(bbt_recv(x.ch.fd[0], &k, 1, CHILD_TIMEOUT_MS), 0,
		     "the holder did not get the memfd (exit %d)", bbt_join(holder, 100));
	int memfds = bbt_daemon_memfds(d);
	bb_unref(a);
	cr_assert_eq(bb_stat(root, x.id, &info), BB_ERR_NOT_FOUND, "the buffer was not freed");
	cr_assert_eq(bbt_daemon_memfds(d), memfds - 1,
		     "the daemon kept a memfd that uid %d still has", UID_B);

	cr_assert_eq(bb_alloc(root, &o, &b), 0, "bb_alloc: %s", bb_last_error());
	cr_assert_eq(bb_map(b, &p), 0);
	bbt_fill(p, x.size, x.seed);
	cr_assert_eq(bbt_send(x.ch.fd[0], "g", 1), 0);
	int code = bbt_join(holder, CHILD_TIMEOUT_MS);
	cr_assert_neq(code, 16, "uid %d read root's new buffer through a memfd it kept", UID_B);
	cr_assert_eq(code, 0, "the holder failed at step %d", code);
	bbt_chan_close(&x.ch);
	bb_unref(b);
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
}

/* ---- the host memfd guards --------------------------------------------------- */

#define RACE_SIZE (64 * KIB)
#define RACES 2000
#define HOST_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* A memfd that allows sealing, bytes long. */
static int sealable_memfd(size_t bytes)
{
	int fd = memfd_create("bbt-sec-import", MFD_ALLOW_SEALING | MFD_CLOEXEC);
	cr_assert_geq(fd, 0, "memfd_create: %s", strerror(errno));
	cr_assert_eq(ftruncate(fd, (off_t)bytes), 0, "ftruncate: %s", strerror(errno));
	return fd;
}

/* ImportFd of fd as a host buffer of size bytes, on the raw connection s. */
static int raw_import(int s, uint64_t req_id, int fd, uint64_t size)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__ImportFd im = BUFBROKER__IMPORT_FD__INIT;
	im.size = size;
	im.kind = BUFBROKER__KIND__KIND_HOST;
	req.id = req_id;
	req.op_case = BUFBROKER__REQUEST__OP_IMPORT_FD;
	req.import_fd = &im;
	return bbt_raw_send(s, &req, fd);
}

/* Release one count of buffer id on the raw connection s, unanswered. */
static int raw_release_quietly(int s, uint64_t req_id, uint64_t id)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Release rel = BUFBROKER__RELEASE__INIT;
	rel.id = id;
	rel.count = 1;
	req.id = req_id;
	req.no_reply = true;
	req.op_case = BUFBROKER__REQUEST__OP_RELEASE;
	req.release = &rel;
	return bbt_raw_send(s, &req, -1);
}

/* Busy for about us microseconds: spreads the racer's change over the
 * time the daemon takes to read, check and seal an import. */
static void spin_us(int us)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	int64_t end = (int64_t)t.tv_sec * 1000000000 + t.tv_nsec + (int64_t)us * 1000;
	do
		clock_gettime(CLOCK_MONOTONIC, &t);
	while ((int64_t)t.tv_sec * 1000000000 + t.tv_nsec < end);
}

/* What a peer does to the memfd it has just sent: 0 when the change was
 * made (the daemon had not sealed the file yet), -1 when the seals
 * refused it. */
static int race_write_seal(int fd)
{
	return fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE) == 0 ? 0 : -1;
}

static int race_shrink(int fd)
{
	return ftruncate(fd, RACE_SIZE / 2) == 0 ? 0 : -1;
}

static int race_grow(int fd)
{
	return ftruncate(fd, 4 * RACE_SIZE) == 0 ? 0 : -1;
}

/* RACES imports of a fresh RACE_SIZE-byte memfd, each changed by race
 * right after it was sent. Whatever the timing, a change that landed
 * (before the daemon's seals, which refuse it afterwards) means the import
 * is refused with BB_ERR_INVALID, and every memfd the daemon hands out
 * carries exactly its three seals and is RACE_SIZE bytes up to one page
 * more. Returns how many were accepted. */
static int import_races(bbt_daemon *d, int (*race)(int fd), const char *what)
{
	const long page = sysconf(_SC_PAGESIZE);
	int s = raw_hello(d), accepted = 0;
	uint64_t req_id = 2;

	for (int i = 0; i < RACES; i++) {
		int fd = sealable_memfd(RACE_SIZE), got = -1;
		Bufbroker__Response *r = NULL;
		struct stat st;

		cr_assert_eq(raw_import(s, req_id, fd, RACE_SIZE), 0, "%s: sending import %d", what,
			     i);
		spin_us(i % 32);
		bool changed = race(fd) == 0;
		cr_assert_eq(bbt_raw_recv(s, 3000, &r, &got), 1, "%s: no answer to import %d", what,
			     i);
		cr_assert_eq(r->id, req_id);
		int code = r->status ? r->status->code : BB_ERR_PROTOCOL;
		req_id++;
		if (code != 0) {
			cr_assert_eq(code, BB_ERR_INVALID, "%s: import %d answered %d (%s)", what,
				     i, code, r->status->message);
			cr_assert_lt(got, 0, "%s: a refused import came with an fd", what);
		} else {
			accepted++;
			cr_assert_geq(got, 0, "%s: import %d was granted without its memfd", what,
				      i);
			cr_assert_eq(fcntl(got, F_GET_SEALS), HOST_SEALS,
				     "%s: import %d was handed out with seals 0x%x", what, i,
				     fcntl(got, F_GET_SEALS));
			cr_assert_eq(fstat(got, &st), 0);
			cr_assert(st.st_size >= RACE_SIZE && st.st_size <= RACE_SIZE + page,
				  "%s: import %d of %u bytes was handed out with %lld", what, i,
				  RACE_SIZE, (long long)st.st_size);
			cr_assert(!changed,
				  "%s: import %d was accepted although the change landed before "
				  "the daemon's seals",
				  what, i);
			cr_assert_eq(raw_release_quietly(s, req_id++, r->grant->info->id), 0);
			close(got);
		}
		bufbroker__response__free_unpacked(r, NULL);
		close(fd);
	}
	close(s);
	return accepted;
}

/* A peer that adds F_SEAL_FUTURE_WRITE right after sending its memfd: the
 * seals are checked on what the daemon hands out, after its own seals. */
Test(security, an_import_raced_by_a_write_seal_is_never_handed_out_write_sealed)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	import_races(d, race_write_seal, "a write seal added after the send");
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* A peer that shrinks or grows its memfd right after sending it: the size
 * is checked again after the daemon's seals. */
Test(security, an_import_raced_by_a_resize_is_never_handed_out_at_another_size)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	import_races(d, race_shrink, "a shrink after the send");
	import_races(d, race_grow, "a growth after the send");
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* What the daemon refuses before sealing leaves the peer's memfd as it
 * was, and charges nothing: a write seal, or a file much larger than the
 * buffer (a 256 MiB file imported as 1 byte would charge 1 byte). */
Test(security, a_write_sealed_or_oversized_memfd_is_refused_unsealed_and_uncharged)
{
	const char *const args[] = {"--uid-host-bytes", "1M", NULL};
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	const int write_seals[] = {F_SEAL_WRITE, F_SEAL_FUTURE_WRITE};
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	bb_buf *b = NULL;
	bbt_totals t;
	int memfds = bbt_daemon_memfds(d);

	for (size_t i = 0; i < sizeof(write_seals) / sizeof(write_seals[0]); i++) {
		int fd = sealable_memfd(4096);
		cr_assert_eq(fcntl(fd, F_ADD_SEALS, write_seals[i]), 0);
		cr_assert_eq(bb_import_fd(c, fd, &o, &b), BB_ERR_INVALID,
			     "a memfd with write seal 0x%x was imported", write_seals[i]);
		cr_assert(said("write seal"), "the refusal says \"%s\"", bb_last_error());
		cr_assert_eq(fcntl(fd, F_GET_SEALS), write_seals[i],
			     "the refused memfd was sealed (0x%x)", fcntl(fd, F_GET_SEALS));
		close(fd);
	}

	int big = sealable_memfd((size_t)256 * MIB);
	o.size = 1;
	cr_assert_eq(bb_import_fd(c, big, &o, &b), BB_ERR_INVALID,
		     "a 256 MiB memfd was imported as 1 byte");
	cr_assert(said("at most one page"), "the refusal says \"%s\"", bb_last_error());
	cr_assert_eq(fcntl(big, F_GET_SEALS), 0, "the refused memfd was sealed");
	close(big);

	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.buffers, 0, "a refused import left a buffer");
	cr_assert_eq(bbt_daemon_memfds(d), memfds, "the daemon kept a refused memfd");
	/* Within a page more: accepted, and the uid's limit still holds. */
	int ok = sealable_memfd(MIB + 4096);
	o.size = MIB;
	cr_assert_eq(bb_import_fd(c, ok, &o, &b), 0, "%s", bb_last_error());
	close(ok);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* A same-uid process that kept a mapping of a freed buffer and writes to
 * it afterwards: the next buffer made from that pooled memfd still starts
 * as zeros (it is punched again on reuse). */
Test(security, writes_through_a_stale_mapping_never_show_in_the_next_buffer)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	const size_t size = 64 * KIB;
	const uint32_t stale_seed = 7, new_seed = 8;
	bb_buf *a = alloc_kind(c, BB_HOST, size, NULL, BB_SHARE_UID);
	int fd = -1;
	void *p;

	cr_assert_eq(call_open_fd(c, bb_id(a), &fd), 0, "%s", bb_last_error());
	cr_assert_eq(bb_release(c, bb_id(a), 1), 0);
	unsigned char *stale = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	cr_assert(stale != MAP_FAILED, "mmap: %s", strerror(errno));
	close(fd);
	uint64_t id = bb_id(a);
	bb_unref(a);
	cr_assert_eq(bb_stat(c, id, &(bb_info){0}), BB_ERR_NOT_FOUND, "the buffer was not freed");
	bbt_fill(stale, size, stale_seed); /* after the free */

	bb_buf *b = alloc_kind(c, BB_HOST, size, NULL, BB_SHARE_UID);
	cr_assert_eq(bb_map(b, &p), 0);
	const unsigned char *q = p;
	for (size_t i = 0; i < size; i++)
		cr_assert_eq(q[i], 0, "byte %zu of the new buffer is %#x: the stale writes", i,
			     q[i]);
	/* The stale mapping is the new buffer's file (what OPERATIONS.md
	 * says of one uid): the case above was a reuse. */
	bbt_fill(p, size, new_seed);
	cr_assert(bbt_check(stale, size, new_seed),
		  "the memfd was not reused: the test proves nothing (is pooling off?)");
	munmap(stale, size);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* The importer keeps its memfd: the daemon closes its own when the buffer
 * goes and never makes a later buffer of it. */
Test(security, an_imported_memfd_is_never_reused)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	const size_t size = 64 * KIB;
	const uint32_t seed = 9;
	bb_alloc_opts o = {.size = size, .kind = BB_HOST};
	bb_buf *b = NULL;
	void *p;
	int memfds = bbt_daemon_memfds(d);

	int fd = sealable_memfd(size);
	unsigned char *mine = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	cr_assert(mine != MAP_FAILED, "mmap: %s", strerror(errno));
	cr_assert_eq(bb_import_fd(c, fd, &o, &b), 0, "%s", bb_last_error());
	uint64_t id = bb_id(b);
	bb_unref(b);
	cr_assert_eq(bb_stat(c, id, &(bb_info){0}), BB_ERR_NOT_FOUND, "the buffer was not freed");
	cr_assert_eq(bbt_daemon_memfds(d), memfds, "the daemon kept the imported memfd");

	b = alloc_kind(c, BB_HOST, size, NULL, BB_SHARE_UID);
	cr_assert_eq(bb_map(b, &p), 0);
	bbt_fill(mine, size, seed);
	cr_assert(!bbt_check(p, size, seed), "a new buffer shows what the importer writes");
	munmap(mine, size);
	close(fd);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- tokens cannot be guessed ------------------------------------------------ */

#define GUESSES 10000

struct guess_ctx {
	const char *sock;
	bb_token real; /* a live token: the near misses are it with one bit flipped */
};

/* Uid B adopts random tokens and near misses of a real one: none adopts. */
static int guesser_child(void *arg)
{
	struct guess_ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	bb_token t;

	if (become(UID_B, GID_B, 0, NULL) != 0)
		return 9;
	if (bb_connect(x->sock, &c) != 0)
		return 10;
	for (int i = 0; i < GUESSES; i++) {
		if (getrandom(t.bytes, sizeof(t.bytes), 0) != (ssize_t)sizeof(t.bytes))
			return 11;
		int rc = bb_adopt(c, &t, &b);
		if (rc == 0)
			return 12; /* a guess adopted something */
		if (rc != BB_ERR_NOT_FOUND)
			return 13;
	}
	for (int bit = 0; bit < 8 * BB_TOKEN_SIZE; bit++) {
		t = x->real;
		t.bytes[bit / 8] ^= (unsigned char)(1u << (bit % 8));
		int rc = bb_adopt(c, &t, &b);
		if (rc == 0)
			return 14;
		if (rc != BB_ERR_NOT_FOUND)
			return 15;
	}
	bb_disconnect(c);
	return 0;
}

Test(security, guessed_tokens_adopt_nothing_and_spoil_no_real_one)
{
	NEED_ROOT();
	bbt_daemon *d = start_open(NULL);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, NULL, BB_SHARE_ANY);
	bb_token real[8];
	for (int i = 0; i < 8; i++)
		cr_assert_eq(bb_take(bb_ref(b), &real[i]), 0, "take %d: %s", i, bb_last_error());
	cr_assert_eq(bbt_refs(c, bb_id(b)), 9);

	struct guess_ctx x = {.sock = d->sock, .real = real[0]};
	int code = bbt_join(bbt_spawn(guesser_child, &x), 60000);
	cr_assert_eq(code, 0, "the guesser failed at step %d (12, 14: a guess adopted a buffer)",
		     code);
	cr_assert_eq(bbt_refs(c, bb_id(b)), 9, "guessing changed refs");
	/* Each real token still adopts, once. */
	for (int i = 0; i < 8; i++) {
		bb_buf *a = NULL;
		cr_assert_eq(bb_adopt(c, &real[i], &a), 0, "real token %d: %s", i, bb_last_error());
		cr_assert_eq(a, b);
		bb_unref(a);
	}
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- CUDA slabs are per uid -------------------------------------------------- */

struct slab_ctx {
	const char *sock;
	bb_cuda_handle handle; /* the kind of every buffer */
	uint64_t id;
	bbt_chan ch;
};

static bb_buf *alloc_cuda_kind(bb_client *c, bb_cuda_handle handle, int share)
{
	bb_alloc_opts o = {.size = MIB, .kind = BB_CUDA, .share = share};
	bb_buf *b = NULL;
	int rc = bb_alloc_cuda(c, &o, handle, &b);
	cr_assert_eq(rc, 0, "bb_alloc_cuda(handle %d): %d (%s)", (int)handle, rc, bb_last_error());
	return b;
}

/* The allocation holding b: its IPC handle (legacy) or its allocation id
 * (VMM, whose fd is closed again). Asserts. */
static void slab_of(bb_buf *b, unsigned char out[BB_IPC_HANDLE_SIZE])
{
	memset(out, 0, BB_IPC_HANDLE_SIZE);
	if (bb_cuda_handle_of(b) == BB_CUDA_HANDLE_VMM) {
		bb_cuda_vmm v;
		cr_assert_eq(bb_cuda_vmm_of(b, &v), 0, "%s", bb_last_error());
		close(v.fd);
		memcpy(out, &v.allocation, sizeof(v.allocation));
		return;
	}
	bb_cuda_ipc ipc;
	cr_assert_eq(bb_cuda_ipc_of(b, &ipc), 0, "%s", bb_last_error());
	memcpy(out, ipc.handle, BB_IPC_HANDLE_SIZE);
}

/* Uid A allocates a 1 MiB CUDA buffer anyone may open and holds it. */
static int cuda_owner_child(void *arg)
{
	struct slab_ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	char quit;

	if (become(UID_A, GID_A, 0, NULL) != 0)
		return 9;
	if (bb_connect(x->sock, &c) != 0)
		return 10;
	bb_alloc_opts o = {.size = MIB, .kind = BB_CUDA, .share = BB_SHARE_ANY};
	if (bb_alloc_cuda(c, &o, x->handle, &b) != 0)
		return 11;
	x->id = bb_id(b);
	if (bbt_send(x->ch.fd[1], &x->id, sizeof(x->id)) != 0)
		return 12;
	if (bbt_recv(x->ch.fd[1], &quit, 1, CHILD_TIMEOUT_MS) != 0)
		return 13;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

/* Buffers of handle kind `handle` of two uids, or of two share policies,
 * never lie in one allocation: whoever maps one (or, VMM, holds the fd)
 * reaches every byte of it. */
static void slabs_are_per_uid_and_policy(bb_cuda_handle handle)
{
	NEED_ROOT();
	fake_cuda_env();
	static const char *const args[] = {"--cuda-slab-bytes", "4M", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d);
	struct slab_ctx x = {.sock = d->sock, .handle = handle};

	bbt_chan_open(&x.ch);
	pid_t owner = bbt_spawn(cuda_owner_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &x.id, sizeof(x.id), CHILD_TIMEOUT_MS), 0,
		     "the owner sent no id (exit %d)", bbt_join(owner, 100));

	/* Root: one buffer of the same policy and one of another. All three
	 * fit in one slab; none may share one. */
	bb_buf *same = alloc_cuda_kind(c, handle, BB_SHARE_ANY);
	bb_buf *other = alloc_cuda_kind(c, handle, BB_SHARE_UID);
	bb_buf *theirs = NULL;
	cr_assert_eq(bb_open(c, x.id, &theirs), 0, "%s", bb_last_error());
	cr_assert_eq(bb_cuda_handle_of(theirs), handle);
	unsigned char a[BB_IPC_HANDLE_SIZE], b[BB_IPC_HANDLE_SIZE], t[BB_IPC_HANDLE_SIZE];
	slab_of(same, a);
	slab_of(other, b);
	slab_of(theirs, t);
	cr_assert_neq(memcmp(a, t, sizeof(a)), 0,
		      "uid 0's buffer lies in the allocation of uid %d's", UID_A);
	cr_assert_neq(memcmp(a, b, sizeof(a)), 0,
		      "buffers of two share policies lie in one allocation");
	/* A second buffer of root's ANY policy does share: the test can tell. */
	bb_buf *same2 = alloc_cuda_kind(c, handle, BB_SHARE_ANY);
	unsigned char a2[BB_IPC_HANDLE_SIZE];
	slab_of(same2, a2);
	cr_assert_eq(memcmp(a, a2, sizeof(a)), 0,
		     "two buffers of one uid and policy did not share a slab");

	bb_unref(theirs);
	bb_unref(same);
	bb_unref(same2);
	bb_unref(other);
	cr_assert_eq(bbt_send(x.ch.fd[0], "q", 1), 0);
	int code = bbt_join(owner, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the owner failed at step %d", code);
	bbt_chan_close(&x.ch);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(security, cuda_buffers_of_other_uids_or_policies_never_share_an_allocation)
{
	slabs_are_per_uid_and_policy(BB_CUDA_HANDLE_LEGACY);
}

Test(security, vmm_cuda_buffers_of_other_uids_or_policies_never_share_an_allocation)
{
	slabs_are_per_uid_and_policy(BB_CUDA_HANDLE_VMM);
}

/* ---- allow-lists ------------------------------------------------------------- */

struct allow_ctx {
	const char *sock;
	uid_t uid;
	gid_t gid;
	size_t ngroups;
	gid_t groups[2];
	bool allowed;
	char want[128]; /* what the refusal must say */
};

/* Connect as uid/gid/groups: admitted and served, or refused at Hello
 * with BB_ERR_DENIED and the sentence. */
static int allow_child(void *arg)
{
	struct allow_ctx *x = arg;
	bb_client *c = NULL;

	if (become(x->uid, x->gid, x->ngroups, x->groups) != 0)
		return 9;
	int rc = bb_connect(x->sock, &c);
	if (!x->allowed) {
		if (rc != BB_ERR_DENIED)
			return rc == 0 ? 10 : 11;
		return said(x->want) ? 0 : 12;
	}
	if (rc != 0)
		return 13;
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	bb_buf *b = NULL;
	if (bb_alloc(c, &o, &b) != 0)
		return 14;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

static int run_allow(const char *sock, uid_t uid, gid_t gid, gid_t group, bool allowed)
{
	struct allow_ctx x = {.sock = sock, .uid = uid, .gid = gid, .allowed = allowed};
	if (group) {
		x.groups[0] = group;
		x.ngroups = 1;
	}
	snprintf(x.want, sizeof(x.want), "uid %u is not allowed to use this daemon", (unsigned)uid);
	return bbt_join(bbt_spawn(allow_child, &x), CHILD_TIMEOUT_MS);
}

Test(security, allow_lists_admit_listed_uids_and_groups_and_refuse_the_rest_at_hello)
{
	NEED_ROOT();
	char gids[32];
	snprintf(gids, sizeof(gids), "%d", GID_C);
	const char *const args[] = {"--allow-uids", "65533", "--allow-gids", gids, NULL};
	bbt_daemon *d = start_open(args);
	size_t from = bbt_log_size(d);

	cr_assert_eq(run_allow(d->sock, UID_B, GID_B, 0, true), 0, "uid %d is listed", UID_B);
	int code = run_allow(d->sock, UID_A, GID_A, 0, false);
	cr_assert_eq(code, 0, "uid %d, on no list: step %d (10: admitted)", UID_A, code);
	cr_assert_eq(run_allow(d->sock, UID_A, GID_C, 0, true), 0, "primary gid %d is listed",
		     GID_C);
	cr_assert_eq(run_allow(d->sock, UID_A, GID_A, GID_C, true), 0,
		     "supplementary gid %d is listed", GID_C);
	const char *const denied[] = {"event=connection_denied", "uid=65534", NULL};
	cr_assert(bbt_log_wait_line(d, from, 2000, denied), "no connection_denied line");
	/* Root always may (and here it is the one that checks). */
	bb_client *root = bbt_connect(d);
	assert_served(root, "root under allow-lists");
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
}

Test(security, allow_lists_change_on_sighup_for_new_connections)
{
	NEED_ROOT();
	char dir[] = "/tmp/bbt-sec-conf-XXXXXX", path[64], line[160];
	cr_assert(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/bufbrokerd.conf", dir);
	FILE *f = fopen(path, "w");
	cr_assert(f);
	fprintf(f, "[access]\nallow_uids = %d\n", UID_B);
	fclose(f);
	const char *const args[] = {"--config", path, NULL};
	bbt_daemon *d = start_open(args);
	int code = run_allow(d->sock, UID_A, GID_A, 0, false);
	cr_assert_eq(code, 0, "uid %d before the reload: step %d", UID_A, code);

	f = fopen(path, "w");
	cr_assert(f);
	fprintf(f, "[access]\nallow_uids = %d, %d\n", UID_B, UID_A);
	fclose(f);
	size_t from = bbt_log_size(d);
	kill(d->pid, SIGHUP);
	snprintf(line, sizeof(line), "old=%d new=%d,%d", UID_B, UID_B, UID_A);
	const char *const changed[] = {"event=config_changed", "key=access.allow_uids", line, NULL};
	cr_assert(bbt_log_wait_line(d, from, 3000, changed), "no config_changed line for the list");
	code = run_allow(d->sock, UID_A, GID_A, 0, true);
	cr_assert_eq(code, 0, "uid %d after the reload: step %d", UID_A, code);
	bb_client *root = bbt_connect(d);
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
	unlink(path);
	rmdir(dir);
}

struct squat_ctx {
	const char *sock;
	int conns; /* connections to open */
	int early; /* of them, refused at once (id 0 DENIED) */
	bbt_chan ch;
};

/* Uid A, on no list, opens x->conns raw connections and says nothing;
 * reports how many the daemon refused at once; on "h" sends Hello on the
 * first and expects the refusal with its id, then the close. One more
 * connection after them says when to count: the daemon accepts in order and
 * answers a refusal at once, and with 64 waiting the last one is refused at
 * once, so its answer means every one before it was accepted and answered
 * if it was to be. */
static int squatter_child(void *arg)
{
	struct squat_ctx *x = arg;
	int socks[128];
	char go;

	if (become(UID_A, GID_A, 0, NULL) != 0)
		return 9;
	for (int i = 0; i < x->conns; i++)
		if ((socks[i] = bbt_raw_connect(x->sock)) < 0)
			return 10;
	x->early = 0;
	int last = bbt_raw_connect(x->sock);
	if (last < 0)
		return 19;
	uint64_t lid;
	int lcode;
	if (raw_answer(last, bbt_ms(5000), &lid, &lcode, NULL, 0) != 1 || lcode != BB_ERR_DENIED)
		return 20;
	close(last);
	for (int i = 0; i < x->conns; i++) {
		uint64_t id;
		int code;
		char msg[256];
		int rc = raw_answer(socks[i], 0, &id, &code, msg, sizeof(msg));
		if (rc == -ETIMEDOUT)
			continue;
		if (rc != 1 || id != 0 || code != BB_ERR_DENIED ||
		    !strstr(msg, "uid 65534 is not allowed to use this daemon"))
			return 11;
		if (!bbt_raw_closed(socks[i], bbt_ms(2000)))
			return 12;
		x->early++;
	}
	if (bbt_send(x->ch.fd[1], &x->early, sizeof(x->early)) != 0)
		return 13;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
		return 14;
	/* At Hello: the refusal answers the Hello's id, then the close. */
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	h.version_major = BB_PROTO_MAJOR;
	req.id = 42;
	req.op_case = BUFBROKER__REQUEST__OP_HELLO;
	req.hello = &h;
	if (bbt_raw_send(socks[0], &req, -1) != 0)
		return 15;
	uint64_t id = 0;
	int code;
	char msg[256];
	if (raw_answer(socks[0], 3000, &id, &code, msg, sizeof(msg)) != 1)
		return 16;
	if (id != 42 || code != BB_ERR_DENIED || !strstr(msg, "uid 65534 is not allowed"))
		return 17;
	if (!bbt_raw_closed(socks[0], 3000))
		return 18;
	return 0;
}

Test(security, refused_peers_take_no_connection_slot_and_only_so_many_may_wait)
{
	NEED_ROOT();
	/* Two slots: root's and one more. */
	const char *const args[] = {"--allow-uids", "65533", "--max-connections", "2", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *root = bbt_connect(d);
	struct squat_ctx x = {.sock = d->sock, .conns = 70};

	bbt_chan_open(&x.ch);
	pid_t squatter = bbt_spawn(squatter_child, &x);
	int early = -1;
	cr_assert_eq(bbt_recv(x.ch.fd[0], &early, sizeof(early), CHILD_TIMEOUT_MS), 0,
		     "the squatter failed at step %d", bbt_join(squatter, 100));
	cr_assert_eq(early, 70 - 64, "%d of 70 silent refused peers were closed at once; want 6",
		     early);
	/* The 64 silent ones hold no slot: the second one is free. */
	bb_client *second = bbt_connect(d);
	assert_served(second, "while 64 refused peers wait");
	cr_assert_eq(bbt_send(x.ch.fd[0], "h", 1), 0);
	int code = bbt_join(squatter, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the squatter failed at step %d", code);
	bbt_chan_close(&x.ch);
	bb_disconnect(second);
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
}

/* ---- per-uid limits ------------------------------------------------------------ */

struct quota_ctx {
	const char *sock;
	bb_kind kind;
	size_t first, second; /* the allocation that fits, then the one refused */
	int buffers;          /* or: this many fit, the next is refused */
	char want[256];       /* what the refusal says */
	size_t after;         /* an allocation that fits once the first is freed */
	bbt_chan ch;
};

/* Uid A reaches its limit: the refusal is NO_MEMORY with the numbers; it
 * tells the parent and, once told, frees and allocates again. */
static int quota_child(void *arg)
{
	struct quota_ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *held[16] = {NULL}, *b = NULL;
	int n = 0;
	char go;

	if (become(UID_A, GID_A, 0, NULL) != 0)
		return 9;
	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (x->buffers) {
		for (; n < x->buffers; n++) {
			bb_alloc_opts o = {.size = 4096, .kind = x->kind};
			if (bb_alloc(c, &o, &held[n]) != 0)
				return 11;
		}
		bb_alloc_opts o = {.size = 4096, .kind = x->kind};
		if (bb_alloc(c, &o, &b) != BB_ERR_NO_MEMORY)
			return 12;
	} else {
		bb_alloc_opts o = {.size = x->first, .kind = x->kind};
		if (bb_alloc(c, &o, &held[n++]) != 0)
			return 13;
		o.size = x->second;
		if (bb_alloc(c, &o, &b) != BB_ERR_NO_MEMORY)
			return 14;
	}
	if (!said(x->want)) {
		fprintf(stderr, "quota child: \"%s\" does not say \"%s\"\n", bb_last_error(),
			x->want);
		return 15;
	}
	if (bbt_send(x->ch.fd[1], "r", 1) != 0 || bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS))
		return 16;
	bb_unref(held[0]);
	/* The release is fire-and-forget: allow it a moment to land. */
	bb_alloc_opts o = {.size = x->after, .kind = x->kind};
	int rc = BB_ERR_NO_MEMORY;
	for (int i = 0; i < 100 && rc == BB_ERR_NO_MEMORY; i++) {
		rc = bb_alloc(c, &o, &b);
		if (rc == BB_ERR_NO_MEMORY)
			bbt_sleep_ms(10);
	}
	if (rc != 0)
		return 17;
	bb_unref(b);
	for (int i = 1; i < n; i++)
		bb_unref(held[i]);
	bb_disconnect(c);
	return 0;
}

/* Run quota_child against d; root is served while uid A is at its limit. */
static void run_quota(bbt_daemon *d, bb_client *root, struct quota_ctx *x, const char *what)
{
	char r;
	x->sock = d->sock;
	bbt_chan_open(&x->ch);
	pid_t pid = bbt_spawn(quota_child, x);
	cr_assert_eq(bbt_recv(x->ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0,
		     "%s: uid %d failed at step %d", what, UID_A, bbt_join(pid, 100));
	assert_served(root, what);
	cr_assert_eq(bbt_send(x->ch.fd[0], "g", 1), 0);
	int code = bbt_join(pid, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "%s: uid %d failed at step %d", what, UID_A, code);
	bbt_chan_close(&x->ch);
}

Test(security, buffer_limit_is_per_uid_and_says_the_numbers)
{
	NEED_ROOT();
	const char *const args[] = {"--uid-buffers", "3", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *root = bbt_connect(d);
	struct quota_ctx x = {.kind = BB_HOST, .buffers = 3, .after = 4096};
	snprintf(x.want, sizeof(x.want),
		 "uid %d would own 4 buffers; the limit is 3 (--uid-buffers)", UID_A);
	run_quota(d, root, &x, "uid buffers");
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
}

Test(security, host_byte_limit_is_per_uid_and_says_the_numbers)
{
	NEED_ROOT();
	const char *const args[] = {"--uid-host-bytes", "1M", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *root = bbt_connect(d);
	struct quota_ctx x = {.kind = BB_HOST, .first = 512 * KIB, .second = MIB, .after = MIB};
	snprintf(x.want, sizeof(x.want),
		 "uid %d would hold 1.5 MiB of host buffers; the limit is 1.0 MiB "
		 "(--uid-host-bytes)",
		 UID_A);
	run_quota(d, root, &x, "uid host bytes");

	/* Over by a byte: the numbers still differ in the message. */
	struct quota_ctx y = {.kind = BB_HOST, .first = MIB, .second = 1, .after = MIB};
	snprintf(y.want, sizeof(y.want),
		 "uid %d would hold 1048577 bytes of host buffers; the limit is 1048576 bytes",
		 UID_A);
	run_quota(d, root, &y, "uid host bytes, over by one");
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
}

Test(security, cuda_byte_limit_is_per_uid_and_says_the_numbers)
{
	NEED_ROOT();
	fake_cuda_env();
	const char *const args[] = {"--uid-cuda-bytes", "4M", "--cuda-slab-bytes", "2M", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *root = bbt_connect(d);
	struct quota_ctx x = {
		.kind = BB_CUDA, .first = 3 * MIB, .second = 2 * MIB, .after = 4 * MIB};
	snprintf(x.want, sizeof(x.want),
		 "uid %d would hold 5.0 MiB of cuda buffers; the limit is 4.0 MiB "
		 "(--uid-cuda-bytes)",
		 UID_A);
	run_quota(d, root, &x, "uid CUDA bytes");
	/* Root's own 4 MiB are not uid A's. */
	bb_buf *b = alloc_kind(root, BB_CUDA, 4 * MIB, NULL, BB_SHARE_UID);
	bb_unref(b);
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
}

Test(security, device_limit_says_the_numbers_and_host_buffers_go_on)
{
	NEED_ROOT();
	fake_cuda_env();
	const char *const args[] = {"--cuda-device-bytes",
				    "8M",
				    "--cuda-slab-bytes",
				    "2M",
				    "--cuda-cache-bytes",
				    "0",
				    NULL};
	bbt_daemon *d = start_open(args);
	bb_client *root = bbt_connect(d);
	bb_buf *big = alloc_kind(root, BB_CUDA, 6 * MIB, NULL, BB_SHARE_UID);
	struct quota_ctx x = {
		.kind = BB_CUDA, .first = 2 * MIB, .second = 2 * MIB, .after = 2 * MIB};
	snprintf(x.want, sizeof(x.want),
		 "device 0 would hold 10.0 MiB (2.0 MiB for this buffer on top of 8.0 MiB); the "
		 "limit is 8.0 MiB (--cuda-device-bytes)");
	run_quota(d, root, &x, "device bytes");
	bb_unref(big);
	assert_accounting_zero(root, 1);
	bb_disconnect(root);
	bbt_stop_clean(d);
}

/* ---- per-connection limits ---------------------------------------------------- */

Test(security, connection_limit_refuses_with_the_numbers_and_serves_the_rest)
{
	NEED_ROOT();
	const char *const args[] = {"--max-connections", "3", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d);
	int r1 = raw_hello(d), r2 = raw_hello(d);

	int r3 = bbt_raw_connect(d->sock);
	cr_assert_geq(r3, 0);
	uint64_t id = 0;
	int code;
	char msg[256];
	cr_assert_eq(raw_answer(r3, 3000, &id, &code, msg, sizeof(msg)), 1,
		     "the 4th connection got no answer");
	cr_assert_eq(code, BB_ERR_NO_MEMORY, "the 4th connection: code %d", code);
	cr_assert_eq(id, 0);
	cr_assert(strstr(msg, "3 connections are open; the limit is 3 (--max-connections)"),
		  "the refusal says \"%s\"", msg);
	cr_assert(bbt_raw_closed(r3, 3000), "the refused connection stays open");
	close(r3);
	assert_served(c, "at the connection limit");

	/* A slot that frees is taken again. */
	close(r1);
	bbt_totals t;
	for (int i = 0; i < 200; i++) {
		cr_assert_eq(bbt_server_totals(c, &t), 0);
		if (t.connections == 2)
			break;
		bbt_sleep_ms(10);
	}
	cr_assert_eq(t.connections, 2);
	int r4 = raw_hello(d);
	close(r4);
	close(r2);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(security, token_limit_is_per_connection_and_says_the_numbers)
{
	NEED_ROOT();
	const char *const args[] = {"--conn-tokens", "2", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d), *c2 = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, NULL, BB_SHARE_UID);
	bb_token t[3];

	cr_assert_eq(bb_take(bb_ref(b), &t[0]), 0);
	cr_assert_eq(bb_take(bb_ref(b), &t[1]), 0);
	bb_buf *extra = bb_ref(b); /* a failed take leaves the caller its count */
	cr_assert_eq(bb_take(extra, &t[2]), BB_ERR_NO_MEMORY, "a third token was made");
	cr_assert(said("the connection would have 3 live tokens; the limit is 2 (--conn-tokens)"),
		  "the refusal says \"%s\"", bb_last_error());
	bb_unref(extra);
	/* Another connection has its own two. */
	bb_buf *b2 = NULL;
	cr_assert_eq(bb_open(c2, bb_id(b), &b2), 0);
	cr_assert_eq(bb_take(bb_ref(b2), &t[2]), 0, "%s", bb_last_error());
	assert_served(c2, "at the token limit");
	/* Adopting gives the slots back. */
	for (int i = 0; i < 3; i++) {
		bb_buf *a = NULL;
		cr_assert_eq(bb_adopt(c2, &t[i], &a), 0);
		bb_unref(a);
	}
	bb_token t3;
	cr_assert_eq(bb_take(bb_ref(b), &t3), 0, "adopted tokens still count: %s", bb_last_error());
	bb_buf *a = NULL;
	cr_assert_eq(bb_adopt(c, &t3, &a), 0);
	bb_unref(a);
	bb_unref(b2);
	bb_unref(b);
	bb_disconnect(c2);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Uid A takes a token on a buffer of its own: another uid's token limit
 * is not its. */
static int token_child(void *arg)
{
	const char *sock = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL, *a = NULL;
	bb_token t;

	if (become(UID_A, GID_A, 0, NULL) != 0)
		return 9;
	if (bb_connect(sock, &c) != 0)
		return 10;
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	if (bb_alloc(c, &o, &b) != 0)
		return 11;
	if (bb_take(bb_ref(b), &t) != 0)
		return 12;
	if (bb_adopt(c, &t, &a) != 0)
		return 13;
	bb_unref(a);
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(security, token_limit_per_uid_counts_the_tokens_of_closed_connections)
{
	NEED_ROOT();
	const char *const args[] = {"--conn-tokens", "2", "--uid-tokens", "3", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d), *c1 = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, NULL, BB_SHARE_UID);
	bb_buf *b1 = NULL;
	bb_token t[4];

	/* Two tokens from a connection that then goes: they live on. */
	cr_assert_eq(bb_open(c1, bb_id(b), &b1), 0);
	cr_assert_eq(bb_take(bb_ref(b1), &t[0]), 0);
	cr_assert_eq(bb_take(bb_ref(b1), &t[1]), 0);
	bb_unref(b1);
	bb_disconnect(c1);
	cr_assert_eq(bbt_refs_until(c, bb_id(b), 3, 2000), 3);
	/* One more from another connection of the uid, then the limit. */
	cr_assert_eq(bb_take(bb_ref(b), &t[2]), 0, "%s", bb_last_error());
	bb_buf *extra = bb_ref(b);
	cr_assert_eq(bb_take(extra, &t[3]), BB_ERR_NO_MEMORY, "a 4th token of uid 0 was made");
	cr_assert(said("uid 0 would have 4 live tokens; the limit is 3 (--uid-tokens)"),
		  "the refusal says \"%s\"", bb_last_error());
	bb_unref(extra);
	int code = bbt_join(bbt_spawn(token_child, (void *)d->sock), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "uid %d could not take a token: step %d", UID_A, code);
	/* Adopting one frees a slot. */
	bb_buf *a = NULL;
	cr_assert_eq(bb_adopt(c, &t[0], &a), 0);
	bb_unref(a);
	cr_assert_eq(bb_take(bb_ref(b), &t[3]), 0, "an adopted token still counts: %s",
		     bb_last_error());
	for (int i = 1; i < 4; i++) {
		cr_assert_eq(bb_adopt(c, &t[i], &a), 0);
		bb_unref(a);
	}
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(security, wait_limit_is_per_connection_and_says_the_numbers)
{
	NEED_ROOT();
	const char *const args[] = {"--conn-waits", "2", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, NULL, BB_SHARE_ANY);
	int r = raw_hello(d);

	cr_assert_eq(bbt_raw_wait(r, 1, bb_id(b), -1), 0);
	cr_assert_eq(bbt_raw_wait(r, 2, bb_id(b), -1), 0);
	cr_assert_eq(bbt_raw_wait(r, 3, bb_id(b), -1), 0);
	uint64_t id = 0;
	int code;
	char msg[256];
	cr_assert_eq(raw_answer(r, 3000, &id, &code, msg, sizeof(msg)), 1,
		     "the 3rd Wait: no answer");
	cr_assert_eq(id, 3, "answered %llu first", (unsigned long long)id);
	cr_assert_eq(code, BB_ERR_NO_MEMORY);
	cr_assert(strstr(msg, "the connection would have 3 parked waits; the limit is 2 "
			      "(--conn-waits)"),
		  "the refusal says \"%s\"", msg);
	assert_served(c, "at the wait limit");
	cr_assert_eq(bb_set_ready(b), 0);
	for (int i = 0; i < 2; i++) {
		cr_assert_eq(raw_answer(r, 3000, &id, &code, NULL, 0), 1);
		cr_assert(id == 1 || id == 2);
		cr_assert_eq(code, 0);
	}
	close(r);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(security, datagram_limit_closes_with_the_numbers)
{
	NEED_ROOT();
	const char *const args[] = {"--max-datagram", "1024", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d);
	int r = raw_hello(d);
	unsigned char big[1500];

	memset(big, 0x5a, sizeof(big));
	cr_assert_eq(bbt_raw_send_bytes(r, big, sizeof(big), -1), 0);
	uint64_t id = 0;
	int code;
	char msg[256];
	cr_assert_eq(raw_answer(r, 3000, &id, &code, msg, sizeof(msg)), 1);
	cr_assert_eq(code, BB_ERR_PROTOCOL);
	cr_assert(strstr(msg, "datagram larger than 1024 bytes; the limit is 1024 bytes "
			      "(--max-datagram)"),
		  "the refusal says \"%s\"", msg);
	cr_assert(bbt_raw_closed(r, 3000), "the connection stays open");
	close(r);
	assert_served(c, "after an oversized datagram");
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- in flight, backpressure, stalls ------------------------------------------- */

Test(security, inflight_limit_pauses_reading_until_a_parked_request_is_answered)
{
	NEED_ROOT();
	const char *const args[] = {"--conn-inflight", "4", "--conn-waits", "100", NULL};
	bbt_daemon *d = start_open(args);
	const char *const warned[] = {"event=config_warning", "limits.conn_inflight", NULL};
	cr_assert(bbt_log_wait_line(d, 0, 2000, warned),
		  "no warning for conn_inflight <= conn_waits");
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, NULL, BB_SHARE_ANY);
	int r = raw_hello(d);

	for (uint64_t i = 1; i <= 4; i++)
		cr_assert_eq(bbt_raw_wait(r, i, bb_id(b), -1), 0);
	cr_assert_eq(bbt_raw_stat(r, 100, bb_id(b)), 0);
	uint64_t id = 0;
	int code;
	int rc = raw_answer(r, 400, &id, &code, NULL, 0);
	cr_assert_eq(rc, -ETIMEDOUT, "a request past 4 in flight was read and answered (id %llu)",
		     (unsigned long long)id);
	assert_served(c, "while a connection is paused");
	bbt_totals t;
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.waits, 4, "want 4 parked waits, the daemon has %llu",
		     (unsigned long long)t.waits);

	/* Answering them lets the Stat through, after them. */
	cr_assert_eq(bb_set_ready(b), 0);
	bool stat_seen = false;
	for (int i = 0; i < 5; i++) {
		cr_assert_eq(raw_answer(r, 3000, &id, &code, NULL, 0), 1, "answer %d missing", i);
		cr_assert_eq(code, 0);
		if (id == 100)
			stat_seen = true;
		else
			cr_assert(!stat_seen, "the Stat was answered before a Wait");
	}
	cr_assert(stat_seen);
	close(r);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(security, a_paused_client_that_goes_away_releases_everything_at_once)
{
	NEED_ROOT();
	const char *const args[] = {"--conn-inflight", "4", "--conn-waits", "100", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, NULL, BB_SHARE_ANY);
	int r = raw_hello(d);

	for (uint64_t i = 1; i <= 4; i++)
		cr_assert_eq(bbt_raw_wait(r, i, bb_id(b), -1), 0);
	cr_assert_eq(bbt_raw_stat(r, 100, bb_id(b)), 0);
	bbt_totals t;
	for (int i = 0; i < 200; i++) {
		cr_assert_eq(bbt_server_totals(c, &t), 0);
		if (t.waits == 4)
			break;
		bbt_sleep_ms(10);
	}
	cr_assert_eq(t.waits, 4);
	int64_t t0 = bbt_now_ms();
	close(r);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	cr_assert_lt(bbt_now_ms() - t0, bbt_ms(1000), "the paused connection lingered");
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(security, a_wait_storm_to_a_client_that_does_not_read_disconnects_it)
{
	NEED_ROOT();
	enum { STORM = 2000 };
	const char *const args[] = {
		"--queue-bytes", "4096", "--conn-waits", "4000", "--conn-inflight", "8000", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, NULL, BB_SHARE_ANY);
	int r = raw_hello(d);
	size_t from = bbt_log_size(d);

	for (uint64_t i = 1; i <= STORM; i++)
		cr_assert_eq(bbt_raw_wait(r, i, bb_id(b), -1), 0);
	bbt_totals t;
	for (int i = 0; i < 500; i++) {
		cr_assert_eq(bbt_server_totals(c, &t), 0);
		if (t.waits == STORM)
			break;
		bbt_sleep_ms(10);
	}
	cr_assert_eq(t.waits, STORM, "only %llu waits parked", (unsigned long long)t.waits);
	cr_assert_eq(bb_set_ready(b), 0);
	const char *const overflow[] = {"event=output_overflow", "limit=4096", NULL};
	cr_assert(bbt_log_wait_line(d, from, 3000, overflow), "no output_overflow line");
	assert_served(c, "after a wait storm");

	/* The client gets what the socket held, then the end. */
	int answered = 0;
	for (;;) {
		uint64_t id;
		int code;
		int rc = raw_answer(r, 3000, &id, &code, NULL, 0);
		if (rc != 1) {
			cr_assert_eq(rc, 0, "no end of stream (%d) after %d answers", rc, answered);
			break;
		}
		answered++;
	}
	cr_assert_lt(answered, STORM, "all %d answers were delivered: nothing was cut off", STORM);
	close(r);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(security, a_pipelining_client_that_stops_reading_is_disconnected_after_the_send_timeout)
{
	NEED_ROOT();
	const char *const args[] = {"--send-timeout", "500", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, "sec-stat-me", BB_SHARE_ANY);
	int r = raw_hello(d);
	size_t from = bbt_log_size(d);

	/* Stat until neither direction takes more: the daemon stopped
	 * reading (its answers fill our receive buffer). */
	cr_assert_eq(fcntl(r, F_SETFL, fcntl(r, F_GETFL) | O_NONBLOCK), 0);
	uint64_t sent = 0;
	int64_t last_ok = bbt_now_ms(), t0 = last_ok;
	while (bbt_now_ms() - last_ok < bbt_ms(200) && bbt_now_ms() - t0 < bbt_ms(5000)) {
		int rc = bbt_raw_stat(r, sent + 1, bb_id(b));
		if (rc == 0) {
			sent++;
			last_ok = bbt_now_ms();
		} else {
			cr_assert_eq(rc, -EAGAIN, "send: %s", strerror(-rc));
			bbt_sleep_ms(1);
		}
	}
	cr_assert_gt(sent, 100, "only %llu requests went out", (unsigned long long)sent);
	assert_served(c, "while a client does not read");
	const char *const timeout[] = {"event=send_timeout", "limit_ms=500", NULL};
	cr_assert(bbt_log_wait_line(d, from, 5000, timeout), "no send_timeout line");
	/* Backpressure kept its queue short: not a queue overflow. */
	const char *const overflow[] = {"event=output_overflow", NULL};
	cr_assert(!bbt_log_wait_line(d, from, 0, overflow), "the queue overflowed instead");
	cr_assert_eq(fcntl(r, F_SETFL, fcntl(r, F_GETFL) & ~O_NONBLOCK), 0);
	cr_assert(bbt_raw_closed(r, 5000), "the stalled connection is still open");
	close(r);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* The flooder: one thread sends, this one reads, slowly. */
struct flood {
	int sock;
	uint64_t id;       /* the buffer every request stats */
	uint64_t n;        /* requests */
	atomic_int failed; /* the sender's errno, or 0 */
};

static void *flood_sender(void *arg)
{
	struct flood *f = arg;
	for (uint64_t i = 1; i <= f->n; i++) {
		int rc = bbt_raw_stat(f->sock, i, f->id);
		if (rc != 0) {
			atomic_store(&f->failed, -rc);
			break;
		}
	}
	return NULL;
}

Test(security, a_flooding_client_that_reads_slowly_is_slowed_not_buffered)
{
	NEED_ROOT();
	enum { FLOOD = 40000 };
#if defined(__SANITIZE_ADDRESS__)
	/* ASan keeps freed memory in quarantine (256 MiB by default): what
	 * would grow then is not the daemon's data. */
	char asan[512];
	const char *was = getenv("ASAN_OPTIONS");
	snprintf(asan, sizeof(asan), "%s%squarantine_size_mb=1", was ? was : "",
		 was && was[0] ? ":" : "");
	setenv("ASAN_OPTIONS", asan, 1);
#endif
	static const char *const args[] = {"--queue-bytes", "256K", NULL};
	bbt_daemon *d = start_open(args);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_kind(c, BB_HOST, 4096, "sec-flooded", BB_SHARE_ANY);
	cr_assert_eq(bb_set_ready(b), 0);
	int r = raw_hello(d);
	long base = bbt_daemon_rss_kb(d), peak = base;
	cr_assert_gt(base, 0, "cannot read the daemon's VmRSS");

	/* 40000 answers of ~80 bytes: far past --queue-bytes (256 KiB) and
	 * the socket buffers, had the daemon read ahead of what this client
	 * takes: it would have closed the connection. */
	struct flood f = {.sock = r, .id = bb_id(b), .n = FLOOD};
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, flood_sender, &f), 0);
	uint64_t got = 0;
	int64_t t0 = bbt_now_ms();
	while (got < FLOOD) {
		uint64_t id;
		int code;
		int rc = raw_answer(r, 5000, &id, &code, NULL, 0);
		cr_assert_eq(rc, 1, "answer %llu: %d (0: the daemon closed the connection)",
			     (unsigned long long)got + 1, rc);
		cr_assert_eq(id, got + 1, "answer %llu out of order", (unsigned long long)id);
		cr_assert_eq(code, 0);
		got++;
		if (got % 500 == 0) {
			long now = bbt_daemon_rss_kb(d);
			if (now > peak)
				peak = now;
			bbt_sleep_ms(10); /* a slow reader */
		}
		if (got == FLOOD / 2)
			assert_served(c, "during a flood");
	}
	pthread_join(th, NULL);
	cr_assert_eq(atomic_load(&f.failed), 0, "the flooder's send failed: %s",
		     strerror(atomic_load(&f.failed)));
	cr_assert_geq(bbt_now_ms() - t0, 700, "the slow reader was not slow");
	if (!under_valgrind(d->pid))
		cr_assert_lt(peak - base, 16 * 1024,
			     "the daemon's RSS grew by %ld KiB (from %ld) during the flood",
			     peak - base, base);
	close(r);
	bb_unref(b);
	assert_accounting_zero(c, 1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}
