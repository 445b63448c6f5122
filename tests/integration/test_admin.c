/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The admin surface against a real bufbrokerd: `bufbroker clients`, `top`,
 * `ls` filters and `check` (protocol 1.1's Clients and Check requests).
 *
 * Holder children connect, allocate, take tokens and park waits, then stay
 * until the test tells them to go, so the CLI ($BUFBROKER_CLI, run as a
 * separate process) sees known connections. When $BB_FAKECUDA is set (ctest
 * sets it) the daemon also serves CUDA buffers through the fake driver, so
 * the CUDA backend's books take part in the check; the holders never load
 * a driver themselves (allocating needs none).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <pty.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "client_internal.h"
#include "harness.h"

#define NOBODY 65534
#define CHILD_TIMEOUT_MS 15000
#define CLI_TIMEOUT_MS 10000
#define KiB 1024u
#define MiB (1024u * 1024u)
#define MAX_BUFS 8
#define OUT_CAP (64 * 1024)

/* ---- environment --------------------------------------------------------- */

static bool g_cuda; /* the daemon serves CUDA buffers through the fake driver */

static void admin_fini(void)
{
	bbt_cleanup_fakecuda(g_cuda);
}

TestSuite(admin, .fini = admin_fini, .timeout = 120);

/* A daemon with the fake CUDA driver when there is one, in a fake namespace
 * of this test's own; socket mode 0666 and a 0755 directory so that other
 * uids can connect. */
static bbt_daemon *start_daemon(void)
{
	static const char *const args[] = {"--socket-mode", "0666", NULL};
	const char *fake = getenv("BB_FAKECUDA");
	char ns[64];

	g_cuda = fake && fake[0];
	if (g_cuda) {
		snprintf(ns, sizeof(ns), "bbtadmin%d", (int)getpid());
		setenv("BUFBROKER_CUDA_LIBRARY", fake, 1);
		setenv("FAKECUDA_NAMESPACE", ns, 1);
		setenv("FAKECUDA_DEVICES", "1", 1);
		unsetenv("FAKECUDA_MEMORY");
		unsetenv("CUDA_VISIBLE_DEVICES");
	} else {
		cr_log_warn("BB_FAKECUDA is not set: CUDA buffers are left out");
	}
	bbt_daemon *d = bbt_start(args);
	cr_assert_eq(chmod(d->dir, 0755), 0);
	return d;
}

static int become(uid_t uid, gid_t gid)
{
	if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
		return -1;
	prctl(PR_SET_DUMPABLE, 1);
	return getuid() == uid && geteuid() == uid ? 0 : -1;
}

/* ---- running the CLI -------------------------------------------------------- */

/* What one CLI run printed. */
typedef struct cli_run {
	int rc;            /* exit status; 128 + signal; -1 when it timed out */
	char out[OUT_CAP]; /* stdout */
	char err[4096];    /* stderr */
} cli_run;

/* Run $BUFBROKER_CLI --socket SOCK ARGS... (NULL-terminated; no --socket
 * when sock is NULL), as uid unless it is (uid_t)-1. Asserts that it could
 * be started. */
static cli_run *cli_as(const char *sock, uid_t uid, const char *arg0, ...)
{
	const char *cli = getenv("BUFBROKER_CLI");
	const char *argv[24];
	int n = 0, po[2], pe[2];
	va_list ap;

	cr_assert(cli && cli[0], "BUFBROKER_CLI must name the built bufbroker (ctest sets it)");
	argv[n++] = cli;
	if (sock) {
		argv[n++] = "--socket";
		argv[n++] = sock;
	}
	va_start(ap, arg0);
	for (const char *a = arg0; a; a = va_arg(ap, const char *)) {
		cr_assert(n < 23);
		argv[n++] = a;
	}
	va_end(ap);
	argv[n] = NULL;

	cli_run *r = calloc(1, sizeof(*r));
	cr_assert_not_null(r);
	cr_assert_eq(pipe2(po, O_CLOEXEC), 0);
	cr_assert_eq(pipe2(pe, O_CLOEXEC), 0);
	fflush(NULL);
	pid_t pid = fork();
	cr_assert(pid >= 0);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		dup2(po[1], 1);
		dup2(pe[1], 2);
		int devnull = open("/dev/null", O_RDONLY);
		if (devnull >= 0)
			dup2(devnull, 0);
		if (uid != (uid_t)-1 && become(uid, uid) != 0)
			_exit(126);
		execv(cli, (char *const *)argv);
		_exit(127);
	}
	close(po[1]);
	close(pe[1]);
	size_t nout = 0, nerr = 0;
	struct pollfd pf[2] = {{.fd = po[0], .events = POLLIN}, {.fd = pe[0], .events = POLLIN}};
	int64_t deadline = bbt_now_ms() + CLI_TIMEOUT_MS;
	while ((pf[0].fd >= 0 || pf[1].fd >= 0) && bbt_now_ms() < deadline) {
		if (poll(pf, 2, 100) <= 0)
			continue;
		for (int i = 0; i < 2; i++) {
			if (pf[i].fd < 0 || !(pf[i].revents & (POLLIN | POLLHUP | POLLERR)))
				continue;
			char *buf = i ? r->err : r->out;
			size_t *len = i ? &nerr : &nout;
			size_t cap = i ? sizeof(r->err) : sizeof(r->out);
			char scratch[512];
			ssize_t got = *len + 1 < cap ? read(pf[i].fd, buf + *len, cap - 1 - *len)
						     : read(pf[i].fd, scratch, sizeof(scratch));
			if (got <= 0) {
				close(pf[i].fd);
				pf[i].fd = -1;
			} else if (*len + 1 < cap) {
				*len += (size_t)got;
			}
		}
	}
	for (int i = 0; i < 2; i++)
		if (pf[i].fd >= 0)
			close(pf[i].fd);
	r->out[nout] = '\0';
	r->err[nerr] = '\0';
	r->rc = bbt_join(pid, 2000);
	return r;
}

#define cli(d, ...) cli_as((d)->sock, (uid_t)-1, __VA_ARGS__, NULL)
#define cli_nobody(d, ...) cli_as((d)->sock, NOBODY, __VA_ARGS__, NULL)
#define cli_at(sock, ...) cli_as(sock, (uid_t)-1, __VA_ARGS__, NULL)

#define assert_ran(r, want, what)                                                          \
	cr_assert_eq((r)->rc, want, "%s exited %d, want %d\nstdout: %s\nstderr: %s", what, \
		     (r)->rc, want, (r)->out, (r)->err)

/* ---- reading the JSON, by plain string search --------------------------------- */

/* The innermost object around the first occurrence of needle in doc, copied
 * into obj (its rows hold no nested objects); false when needle is absent. */
static bool json_object_with(const char *doc, const char *needle, char *obj, size_t cap)
{
	const char *hit = strstr(doc, needle), *a, *b;
	if (!hit)
		return false;
	for (a = hit; a > doc && *a != '{'; a--)
		;
	b = strchr(hit, '}');
	if (*a != '{' || !b || (size_t)(b - a + 2) > cap)
		return false;
	memcpy(obj, a, (size_t)(b - a + 1));
	obj[b - a + 1] = '\0';
	return true;
}

/* The number after "key": in obj; asserts it is there. */
static uint64_t json_num(const char *obj, const char *key)
{
	char pat[64];
	snprintf(pat, sizeof(pat), "\"%s\":", key);
	const char *p = strstr(obj, pat);
	cr_assert_not_null(p, "no %s in %s", pat, obj);
	return strtoull(p + strlen(pat), NULL, 10);
}

/* The string after "key": in obj (no escapes expected); asserts. */
static void json_text(const char *obj, const char *key, char *out, size_t cap)
{
	char pat[64];
	snprintf(pat, sizeof(pat), "\"%s\":\"", key);
	const char *p = strstr(obj, pat);
	cr_assert_not_null(p, "no string %s in %s", pat, obj);
	p += strlen(pat);
	const char *e = strchr(p, '"');
	cr_assert_not_null(e);
	snprintf(out, cap, "%.*s", (int)(e - p), p);
}

/* How many times needle occurs in s. */
static int count_of(const char *s, const char *needle)
{
	int n = 0;
	for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle))
		n++;
	return n;
}

/* The client row of pid in a `clients --json` document, into obj. */
static bool client_row(const char *doc, pid_t pid, char *obj, size_t cap)
{
	char needle[48];
	snprintf(needle, sizeof(needle), "\"pid\":%d,", (int)pid);
	return json_object_with(doc, needle, obj, cap);
}

/* The line of text that contains needle, into line; false when none. */
static bool line_with(const char *text, const char *needle, char *line, size_t cap)
{
	const char *hit = strstr(text, needle);
	if (!hit)
		return false;
	const char *a = hit, *b = strchr(hit, '\n');
	while (a > text && a[-1] != '\n')
		a--;
	if (!b)
		b = hit + strlen(hit);
	snprintf(line, cap, "%.*s", (int)(b - a), a);
	return true;
}

/* ---- holders ------------------------------------------------------------------ */

/* A child that holds buffers, tokens and parked waits on one connection
 * until it is told to go. */
typedef struct holder {
	const char *sock;            /* the daemon's */
	const char *comm;            /* its process name (PR_SET_NAME) */
	bool as_nobody;              /* switch to uid and gid 65534 first */
	int nbufs;                   /* host buffers */
	size_t sizes[MAX_BUFS];      /* their sizes */
	const char *names[MAX_BUFS]; /* their names (NULL: unnamed) */
	int states[MAX_BUFS];        /* 0 stays pending, 1 set ready, 2 set failed */
	int share;                   /* BB_SHARE_* of them all */
	int tokens;                  /* bb_take (retain) of buffer 0, this many */
	int waits;                   /* threads waiting on the first pending buffer */
	size_t cuda_size;            /* > 0: one more buffer, CUDA on device 0 */
	const char *cuda_name;       /* its name */
	bbt_chan ch;                 /* the test talks to it here */
	pid_t pid;                   /* the child */
	uint64_t ids[MAX_BUFS + 1];  /* what it allocated (CUDA last) */
} holder;

/* What the child reports once it holds everything: 0, or the failed step. */
typedef struct holder_report {
	int step;
	uint64_t ids[MAX_BUFS + 1];
} holder_report;

typedef struct waiter {
	pthread_t t;
	bb_buf *b;
	int rc;
} waiter;

static void *waiter_main(void *arg)
{
	waiter *w = arg;
	bb_state st;
	w->rc = bb_wait(w->b, 60000, &st);
	return NULL;
}

static int holder_main(void *arg)
{
	holder *h = arg;
	holder_report rep = {0};
	bb_client *c = NULL;
	bb_buf *bufs[MAX_BUFS + 1] = {0}, *pending = NULL;
	waiter w[8];
	char go;
	int nb = 0;

	prctl(PR_SET_NAME, h->comm);
	if (h->as_nobody && become(NOBODY, NOBODY) != 0)
		return 1;
	if (bb_connect(h->sock, &c) != 0) {
		rep.step = 2;
		goto report;
	}
	for (int i = 0; i < h->nbufs; i++, nb++) {
		bb_alloc_opts o = {.size = h->sizes[i],
				   .kind = BB_HOST,
				   .name = h->names[i],
				   .share = h->share};
		if (bb_alloc(c, &o, &bufs[i]) != 0) {
			rep.step = 10 + i;
			goto report;
		}
		rep.ids[i] = bb_id(bufs[i]);
		if ((h->states[i] == 1 && bb_set_ready(bufs[i]) != 0) ||
		    (h->states[i] == 2 && bb_set_error(bufs[i], "made to fail") != 0)) {
			rep.step = 20 + i;
			goto report;
		}
		if (h->states[i] == 0 && !pending)
			pending = bufs[i];
	}
	if (h->cuda_size) {
		bb_alloc_opts o = {.size = h->cuda_size,
				   .kind = BB_CUDA,
				   .name = h->cuda_name,
				   .share = h->share};
		if (bb_alloc(c, &o, &bufs[nb]) != 0 || bb_set_ready(bufs[nb]) != 0) {
			rep.step = 30;
			goto report;
		}
		rep.ids[MAX_BUFS] = bb_id(bufs[nb]);
		nb++;
	}
	for (int i = 0; i < h->tokens; i++) {
		bb_token tok;
		if (bb_take(bb_ref(bufs[0]), &tok) != 0) {
			rep.step = 40;
			goto report;
		}
	}
	if (h->waits && !pending) {
		rep.step = 50;
		goto report;
	}
	for (int i = 0; i < h->waits; i++) {
		w[i].b = pending;
		if (pthread_create(&w[i].t, NULL, waiter_main, &w[i]) != 0) {
			rep.step = 51;
			goto report;
		}
	}
report:
	if (bbt_send(h->ch.fd[1], &rep, sizeof(rep)) != 0 || rep.step)
		return rep.step ? rep.step : 3;
	/* Stay until told to go (or the test ends). */
	if (bbt_recv(h->ch.fd[1], &go, 1, -1) != 0)
		return 0;
	if (pending && bb_set_ready(pending) != 0)
		return 60;
	for (int i = 0; i < h->waits; i++) {
		pthread_join(w[i].t, NULL);
		if (w[i].rc != 0)
			return 61;
	}
	for (int i = 0; i < nb; i++)
		bb_unref(bufs[i]);
	bb_disconnect(c);
	return 0;
}

/* Start h and wait until it holds everything it was asked to. Asserts. */
static void holder_start(const bbt_daemon *d, holder *h)
{
	holder_report rep;

	h->sock = d->sock;
	bbt_chan_open(&h->ch);
	h->pid = bbt_spawn(holder_main, h);
	int rc = bbt_recv(h->ch.fd[0], &rep, sizeof(rep), CHILD_TIMEOUT_MS);
	if (rc != 0 || rep.step != 0) {
		int code = bbt_join(h->pid, 1000);
		cr_assert_fail("holder %s did not get ready: step %d (exit %d)", h->comm,
			       rc ? -1 : rep.step, code);
	}
	memcpy(h->ids, rep.ids, sizeof(h->ids));
}

/* Tell h to let go and reap it; asserts a clean exit. */
static void holder_finish(holder *h)
{
	char go = 1;
	cr_assert_eq(bbt_send(h->ch.fd[0], &go, 1), 0);
	int code = bbt_join(h->pid, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "holder %s failed at step %d", h->comm, code);
	bbt_chan_close(&h->ch);
}

/* SIGKILL h, as a crash would end it. */
static void holder_kill(holder *h)
{
	kill(h->pid, SIGKILL);
	bbt_join(h->pid, CHILD_TIMEOUT_MS);
	bbt_chan_close(&h->ch);
}

/* Poll the daemon until its parked waits reach want. Asserts. */
static void waits_until(bb_client *c, uint64_t want)
{
	uint64_t waits;
	cr_assert(bbt_waits_until(c, want, 5000, &waits),
		  "the daemon has %llu parked waits, want %llu", (unsigned long long)waits,
		  (unsigned long long)want);
}

/* ---- clients ------------------------------------------------------------------- */

Test(admin, clients_reports_pid_uid_process_and_holdings_of_each_connection)
{
	bbt_daemon *d = start_daemon();
	bb_client *c = bbt_connect(d);
	holder a = {.comm = "bbt-holder-a",
		    .nbufs = 2,
		    .sizes = {1 * MiB, 4 * KiB},
		    .tokens = 1,
		    .waits = 2};
	holder b = {.comm = "bbt-holder-b",
		    .nbufs = 3,
		    .sizes = {64 * KiB, 64 * KiB, 64 * KiB},
		    .states = {1, 1, 1}};
	char obj[1024], text[64], line[512];

	holder_start(d, &a);
	holder_start(d, &b);
	waits_until(c, 2);

	cli_run *r = cli(d, "--json", "clients");
	assert_ran(r, 0, "clients --json");
	cr_assert(client_row(r->out, a.pid, obj, sizeof(obj)), "no row for pid %d in %s", a.pid,
		  r->out);
	cr_assert_eq(json_num(obj, "uid"), getuid());
	cr_assert_eq(json_num(obj, "gid"), getgid());
	json_text(obj, "process", text, sizeof(text));
	cr_assert_str_eq(text, "bbt-holder-a", "process of holder a: %s", obj);
	json_text(obj, "client", text, sizeof(text));
	cr_assert_str_eq(text, program_invocation_short_name, "client name of holder a: %s", obj);
	cr_assert_eq(json_num(obj, "buffers"), 2, "%s", obj);
	cr_assert_eq(json_num(obj, "bytes"), 1 * MiB + 4 * KiB, "%s", obj);
	cr_assert_eq(json_num(obj, "tokens"), 1, "%s", obj);
	cr_assert_eq(json_num(obj, "waits"), 2, "%s", obj);
	cr_assert(strstr(obj, "\"self\":false"), "%s", obj);

	cr_assert(client_row(r->out, b.pid, obj, sizeof(obj)), "no row for pid %d in %s", b.pid,
		  r->out);
	json_text(obj, "process", text, sizeof(text));
	cr_assert_str_eq(text, "bbt-holder-b", "%s", obj);
	cr_assert_eq(json_num(obj, "buffers"), 3, "%s", obj);
	cr_assert_eq(json_num(obj, "bytes"), 192 * KiB, "%s", obj);
	cr_assert_eq(json_num(obj, "tokens"), 0, "%s", obj);
	cr_assert_eq(json_num(obj, "waits"), 0, "%s", obj);

	/* The CLI's own connection, marked; and the test's own. */
	cr_assert_eq(count_of(r->out, "\"self\":true"), 1, "%s", r->out);
	cr_assert(json_object_with(r->out, "\"self\":true", obj, sizeof(obj)));
	json_text(obj, "process", text, sizeof(text));
	/* Under valgrind (scripts/valgrind.sh) a process is named after the tool. */
	if (!getenv("BBT_VALGRIND") || strncmp(text, "memcheck", 8) != 0)
		cr_assert_str_eq(text, "bufbroker", "%s", obj);
	cr_assert(client_row(r->out, getpid(), obj, sizeof(obj)), "%s", r->out);
	cr_assert_eq(count_of(r->out, "\"conn\":"), 4, "four connections: %s", r->out);
	free(r);

	/* The text form: one line per connection with the human sizes. */
	r = cli(d, "clients");
	assert_ran(r, 0, "clients");
	cr_assert(strstr(r->out, "PROCESS") && strstr(r->out, "BYTES"), "%s", r->out);
	cr_assert(line_with(r->out, "bbt-holder-a", line, sizeof(line)), "%s", r->out);
	snprintf(text, sizeof(text), " %d ", (int)a.pid);
	cr_assert(strstr(line, text) && strstr(line, "1.0 MiB"), "holder a's line: %s", line);
	cr_assert(line_with(r->out, "bbt-holder-b", line, sizeof(line)), "%s", r->out);
	cr_assert(strstr(line, "192.0 KiB"), "holder b's line: %s", line);
	free(r);

	/* A connection that is gone is no longer listed. */
	holder_finish(&b);
	r = cli(d, "--json", "clients");
	assert_ran(r, 0, "clients --json after b left");
	cr_assert_not(client_row(r->out, b.pid, obj, sizeof(obj)), "%s", r->out);
	cr_assert(client_row(r->out, a.pid, obj, sizeof(obj)), "%s", r->out);
	free(r);

	holder_finish(&a);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(admin, clients_shows_other_uids_connections_only_to_root)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to switch to another uid");
	bbt_daemon *d = start_daemon();
	holder mine = {.comm = "bbt-root-holder", .nbufs = 1, .sizes = {8 * KiB}};
	holder theirs = {
		.comm = "bbt-nobody-hold", .as_nobody = true, .nbufs = 1, .sizes = {16 * KiB}};
	char obj[1024];

	holder_start(d, &mine);
	holder_start(d, &theirs);

	cli_run *r = cli_nobody(d, "--json", "clients");
	assert_ran(r, 0, "clients --json as nobody");
	cr_assert_not(client_row(r->out, mine.pid, obj, sizeof(obj)),
		      "nobody sees root's connection: %s", r->out);
	cr_assert(client_row(r->out, theirs.pid, obj, sizeof(obj)), "%s", r->out);
	cr_assert_eq(json_num(obj, "uid"), NOBODY);
	cr_assert_eq(json_num(obj, "bytes"), 16 * KiB);
	cr_assert_eq(count_of(r->out, "\"conn\":"), 2, "its own holder and itself: %s", r->out);
	free(r);

	r = cli(d, "--json", "clients");
	assert_ran(r, 0, "clients --json as root");
	cr_assert(client_row(r->out, mine.pid, obj, sizeof(obj)), "%s", r->out);
	cr_assert(client_row(r->out, theirs.pid, obj, sizeof(obj)), "%s", r->out);
	cr_assert_eq(json_num(obj, "uid"), NOBODY);
	free(r);

	holder_finish(&mine);
	holder_finish(&theirs);
	bbt_stop_clean(d);
}

/* ---- ls filters ----------------------------------------------------------------- */

/* Whether buffer id is among the rows of an `ls --json` document. */
static bool has_id(const char *doc, uint64_t id)
{
	char needle[48];
	snprintf(needle, sizeof(needle), "{\"id\":%llu,", (unsigned long long)id);
	return strstr(doc, needle) != NULL;
}

Test(admin, ls_filters_by_uid_name_state_and_kind)
{
	bbt_daemon *d = start_daemon();
	holder h = {.comm = "bbt-ls-holder",
		    .nbufs = 5,
		    .sizes = {4 * KiB, 8 * KiB, 12 * KiB, 16 * KiB, 20 * KiB},
		    .names = {"bbt-frame-0", "bbt-frame-1", "bbt-frame-2", "other-x", NULL},
		    .states = {0, 1, 2, 1, 1},
		    .share = BB_SHARE_ANY,
		    .cuda_size = 256 * KiB,
		    .cuda_name = "bbt-frame-cuda"};
	holder nb = {.comm = "bbt-ls-nobody",
		     .as_nobody = true,
		     .nbufs = 1,
		     .sizes = {4 * KiB},
		     .names = {"bbt-nobody-0"},
		     .states = {1},
		     .share = BB_SHARE_ANY};
	bool root = geteuid() == 0;
	uint64_t *id = h.ids;
	char uid[16];

	if (!g_cuda)
		h.cuda_size = 0;
	holder_start(d, &h);
	uint64_t cuda_id = h.ids[MAX_BUFS];
	if (root)
		holder_start(d, &nb);

	cli_run *r = cli(d, "--json", "ls", "--name", "bbt-frame-*");
	assert_ran(r, 0, "ls --name");
	cr_assert(has_id(r->out, id[0]) && has_id(r->out, id[1]) && has_id(r->out, id[2]), "%s",
		  r->out);
	cr_assert_not(has_id(r->out, id[3]) || has_id(r->out, id[4]), "%s", r->out);
	cr_assert_eq(has_id(r->out, cuda_id), g_cuda, "%s", r->out);
	cr_assert(strstr(r->out, "\"truncated\":false"), "%s", r->out);
	free(r);

	r = cli(d, "--json", "ls", "--state", "ready");
	assert_ran(r, 0, "ls --state ready");
	cr_assert(has_id(r->out, id[1]) && has_id(r->out, id[3]) && has_id(r->out, id[4]), "%s",
		  r->out);
	cr_assert_not(has_id(r->out, id[0]) || has_id(r->out, id[2]), "%s", r->out);
	free(r);

	r = cli(d, "--json", "ls", "--state", "failed");
	assert_ran(r, 0, "ls --state failed");
	cr_assert_eq(count_of(r->out, "{\"id\":"), 1, "%s", r->out);
	cr_assert(has_id(r->out, id[2]), "%s", r->out);
	free(r);

	r = cli(d, "--json", "ls", "--kind", "cuda");
	assert_ran(r, 0, "ls --kind cuda");
	cr_assert_eq(count_of(r->out, "{\"id\":"), g_cuda ? 1 : 0, "%s", r->out);
	free(r);

	r = cli(d, "--json", "ls", "--kind", "host", "--state", "pending", "--name", "bbt-*");
	assert_ran(r, 0, "ls with three filters");
	cr_assert_eq(count_of(r->out, "{\"id\":"), 1, "%s", r->out);
	cr_assert(has_id(r->out, id[0]), "%s", r->out);
	free(r);

	/* The text form filters the same rows. */
	r = cli(d, "ls", "--name", "*frame-[01]");
	assert_ran(r, 0, "ls --name (text)");
	cr_assert(strstr(r->out, "bbt-frame-0") && strstr(r->out, "bbt-frame-1"), "%s", r->out);
	cr_assert_not(strstr(r->out, "bbt-frame-2") || strstr(r->out, "other-x"), "%s", r->out);
	cr_assert_eq(count_of(r->out, "\n"), 3, "a title and two rows: %s", r->out);
	free(r);

	snprintf(uid, sizeof(uid), "%u", (unsigned)getuid());
	r = cli(d, "--json", "ls", "--uid", uid);
	assert_ran(r, 0, "ls --uid (own)");
	cr_assert_eq(count_of(r->out, "{\"id\":"), 5 + (g_cuda ? 1 : 0), "%s", r->out);
	free(r);
	if (root) {
		r = cli(d, "--json", "ls", "--uid", "nobody");
		assert_ran(r, 0, "ls --uid nobody");
		cr_assert_eq(count_of(r->out, "{\"id\":"), 1, "%s", r->out);
		cr_assert(has_id(r->out, nb.ids[0]), "%s", r->out);
		free(r);
		r = cli(d, "--json", "ls");
		assert_ran(r, 0, "ls without filters");
		cr_assert_eq(count_of(r->out, "{\"id\":"), 6 + (g_cuda ? 1 : 0), "%s", r->out);
		free(r);
	}

	/* Bad filters are usage errors; filters belong to ls. */
	static const char *const bad[][3] = {{"ls", "--state", "done"},
					     {"ls", "--kind", "gpu"},
					     {"ls", "--uid", "no-such-user-bbt"},
					     {"status", "--uid", "0"},
					     {"clients", "--name", "x"}};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		r = cli(d, bad[i][0], bad[i][1], bad[i][2]);
		cr_assert_eq(r->rc, 2, "%s %s %s exited %d: %s", bad[i][0], bad[i][1], bad[i][2],
			     r->rc, r->err);
		cr_assert_str_eq(r->out, "");
		free(r);
	}

	holder_finish(&h);
	if (root)
		holder_finish(&nb);
	bbt_stop_clean(d);
}

/* ---- top ------------------------------------------------------------------------ */

/* The row of buffer id in an `ls --json` document, into obj. */
static void ls_row_of(const char *doc, uint64_t id, char *obj, size_t cap)
{
	char needle[48];
	snprintf(needle, sizeof(needle), "{\"id\":%llu,", (unsigned long long)id);
	cr_assert(json_object_with(doc, needle, obj, cap), "no row of buffer %llu in %s",
		  (unsigned long long)id, doc);
}

Test(admin, ls_and_stat_show_each_cuda_buffers_handle_kind)
{
	bbt_daemon *d = start_daemon();
	if (!g_cuda)
		cr_skip_test("needs the fake CUDA driver (BB_FAKECUDA)");
	bb_client *c = bbt_connect(d);
	bb_alloc_opts o = {.size = 64 * KiB, .kind = BB_CUDA};
	static const struct {
		bb_cuda_handle ask;
		const char *shown;
	} kinds[] = {{BB_CUDA_HANDLE_LEGACY, "legacy"}, {BB_CUDA_HANDLE_VMM, "vmm"}};
	bb_buf *b[3];
	char obj[1024], text[64], line[512], id[32];

	for (int i = 0; i < 2; i++)
		cr_assert_eq(bb_alloc_cuda(c, &o, kinds[i].ask, &b[i]), 0, "%s", bb_last_error());
	o.kind = BB_HOST;
	cr_assert_eq(bb_alloc(c, &o, &b[2]), 0, "%s", bb_last_error());

	cli_run *ls = cli(d, "--json", "ls");
	assert_ran(ls, 0, "ls --json");
	cli_run *lt = cli(d, "ls");
	assert_ran(lt, 0, "ls");
	cr_assert(line_with(lt->out, "HANDLE", line, sizeof(line)), "no HANDLE column: %s",
		  lt->out);
	for (int i = 0; i < 3; i++) {
		const char *want = i < 2 ? kinds[i].shown : "";

		ls_row_of(ls->out, bb_id(b[i]), obj, sizeof(obj));
		json_text(obj, "cuda_handle", text, sizeof(text));
		cr_assert_str_eq(text, want, "ls --json row %s", obj);

		snprintf(id, sizeof(id), "%llu", (unsigned long long)bb_id(b[i]));
		cli_run *st = cli(d, "--json", "stat", id);
		assert_ran(st, 0, "stat --json");
		json_text(st->out, "cuda_handle", text, sizeof(text));
		cr_assert_str_eq(text, want, "stat --json %s", st->out);
		free(st);
		st = cli(d, "stat", id);
		assert_ran(st, 0, "stat");
		cr_assert(line_with(st->out, "handle ", line, sizeof(line)), "%s", st->out);
		cr_assert(strstr(line, i < 2 ? want : "-"), "stat's handle line: %s", line);
		free(st);

		/* The ls row: id first, the handle kind after kind and device. */
		char lead[48];
		snprintf(lead, sizeof(lead), "%s  ", id);
		const char *row = strstr(lt->out, lead);
		cr_assert_not_null(row, "no ls row for %s: %s", id, lt->out);
		cr_assert(line_with(row, lead, line, sizeof(line)));
		cr_assert(strstr(line, i < 2 ? (i ? " vmm " : " legacy ") : " - "),
			  "ls row of buffer %s: %s", id, line);
	}
	free(ls);
	free(lt);
	for (int i = 0; i < 3; i++)
		bb_unref(b[i]);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(admin, status_says_per_device_whether_vmm_buffers_can_be_had_and_why_not)
{
	static const char *const no_vmm[] = {"--cuda-forbid", "vmm", "--cuda-handle", "legacy",
					     NULL};
	bbt_daemon *d = start_daemon();
	if (!g_cuda)
		cr_skip_test("needs the fake CUDA driver (BB_FAKECUDA)");
	bb_client *c = bbt_connect(d);
	bb_alloc_opts o = {.size = 4096, .kind = BB_CUDA};
	char obj[1024], line[512], why[256];
	bb_buf *b;

	cr_assert_eq(bb_alloc_cuda(c, &o, BB_CUDA_HANDLE_VMM, &b), 0, "%s", bb_last_error());
	cli_run *r = cli(d, "--json", "status");
	assert_ran(r, 0, "status --json");
	cr_assert(json_object_with(r->out, "\"ordinal\":0,", obj, sizeof(obj)), "%s", r->out);
	cr_assert(strstr(obj, "\"vmm\":true"), "%s", obj);
	cr_assert_eq(json_num(obj, "vmm_allocations"), 1, "%s", obj);
	free(r);
	r = cli(d, "status");
	assert_ran(r, 0, "status");
	cr_assert(line_with(r->out, "  vmm ", line, sizeof(line)), "%s", r->out);
	cr_assert(strstr(line, "yes, 1 allocations held"), "%s", line);
	free(r);
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);

	d = bbt_start(no_vmm);
	r = cli(d, "--json", "status");
	assert_ran(r, 0, "status --json");
	cr_assert(json_object_with(r->out, "\"ordinal\":0,", obj, sizeof(obj)), "%s", r->out);
	cr_assert(strstr(obj, "\"vmm\":false"), "%s", obj);
	json_text(obj, "vmm_unavailable", why, sizeof(why));
	cr_assert(strstr(why, "cuda-forbid"), "why not: %s", why);
	free(r);
	r = cli(d, "status");
	assert_ran(r, 0, "status");
	cr_assert(line_with(r->out, "  vmm ", line, sizeof(line)), "%s", r->out);
	cr_assert(strstr(line, "no: ") && strstr(line, "cuda-forbid"), "%s", line);
	free(r);
	bbt_stop_clean(d);
}

Test(admin, top_one_frame_shows_the_header_busiest_clients_and_largest_buffers)
{
	bbt_daemon *d = start_daemon();
	bb_client *c = bbt_connect(d);
	holder big = {.comm = "bbt-top-big",
		      .nbufs = 2,
		      .sizes = {3 * MiB, 1 * MiB},
		      .names = {"bbt-top-largest", "bbt-top-second"},
		      .states = {1, 1},
		      .tokens = 1};
	holder small = {.comm = "bbt-top-small",
			.nbufs = 1,
			.sizes = {4 * KiB},
			.names = {"bbt-top-small"},
			.waits = 1};
	char line[512];
	bbt_totals t;

	holder_start(d, &big);
	holder_start(d, &small);
	waits_until(c, 1);
	cr_assert_eq(bbt_server_totals(c, &t), 0);

	cli_run *r = cli(d, "top", "-n", "1");
	assert_ran(r, 0, "top -n 1");
	cr_assert_eq(count_of(r->out, "bufbroker top"), 1, "one frame: %s", r->out);
	cr_assert_null(strchr(r->out, '\033'), "no terminal codes into a pipe: %s", r->out);
	snprintf(line, sizeof(line), "pid %u", t.pid);
	cr_assert(strstr(r->out, line), "the daemon's pid in the header: %s", r->out);
	cr_assert(strstr(r->out, "connections 4, live tokens 1, parked waits 1"), "%s", r->out);
	cr_assert(strstr(r->out, "host 3 buffers, 4.0 MiB"), "%s", r->out);
	if (g_cuda)
		cr_assert(strstr(r->out, "device 0 "), "the fake device: %s", r->out);

	/* Busiest client first, largest buffer first. */
	const char *cl = strstr(r->out, "CLIENTS: 4"), *bu = strstr(r->out, "BUFFERS: 3");
	cr_assert(cl && bu && cl < bu, "%s", r->out);
	const char *pb = strstr(cl, "bbt-top-big"), *ps = strstr(cl, "bbt-top-small");
	cr_assert(pb && ps && pb < ps && ps < bu, "clients by bytes held: %s", r->out);
	cr_assert(line_with(cl, "bbt-top-big", line, sizeof(line)));
	cr_assert(strstr(line, "4.0 MiB"), "big's line: %s", line);
	const char *l1 = strstr(bu, "bbt-top-largest"), *l2 = strstr(bu, "bbt-top-second"),
		   *l3 = strstr(bu, "bbt-top-small");
	cr_assert(l1 && l2 && l3 && l1 < l2 && l2 < l3, "buffers by size: %s", r->out);
	cr_assert(line_with(bu, "bbt-top-largest", line, sizeof(line)));
	cr_assert(strstr(line, "3.0 MiB") && strstr(line, "ready"), "%s", line);
	free(r);

	/* -n 2: two frames about a second apart. */
	int64_t t0 = bbt_now_ms();
	r = cli(d, "top", "-n", "2");
	int64_t took = bbt_now_ms() - t0;
	assert_ran(r, 0, "top -n 2");
	cr_assert_eq(count_of(r->out, "bufbroker top"), 2, "%s", r->out);
	cr_assert(took >= 900 && took < 1000 + bbt_ms(4000), "two frames took %lld ms",
		  (long long)took);
	free(r);

	r = cli(d, "--json", "top", "-n", "1");
	cr_assert_eq(r->rc, 2, "top has no --json form: %d", r->rc);
	free(r);
	r = cli(d, "top", "-n", "0");
	cr_assert_eq(r->rc, 2, "-n 0: %d", r->rc);
	free(r);

	holder_finish(&big);
	holder_finish(&small);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Read from the pty master into out (appending) until needle shows up;
 * false when the other side closes or timeout_ms (times bbt_slow) passes
 * first. */
static bool pty_read_until(int master, char *out, size_t cap, size_t *len, const char *needle,
			   int timeout_ms)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	while (bbt_now_ms() < deadline) {
		out[*len] = '\0';
		if (needle && strstr(out, needle))
			return true;
		struct pollfd pf = {.fd = master, .events = POLLIN};
		if (poll(&pf, 1, 50) <= 0)
			continue;
		ssize_t n = read(master, out + *len, cap - 1 - *len);
		if (n <= 0)
			return false; /* EIO: the other side is gone */
		*len += (size_t)n;
		if (*len + 1 >= cap)
			*len = 0; /* keep reading; only the latest output matters */
	}
	return false;
}

/* Run top on a terminal, end it by writing key, and check that it exits 0
 * and leaves the terminal as it found it. */
static void top_on_a_terminal_ends_with(const bbt_daemon *d, char key)
{
	const char *cli = getenv("BUFBROKER_CLI");
	int master, slave;
	struct termios before, during, after;
	static char out[256 * 1024];
	size_t len = 0;

	cr_assert_eq(openpty(&master, &slave, NULL, NULL, NULL), 0, "openpty: %s", strerror(errno));
	cr_assert_eq(tcgetattr(slave, &before), 0);
	cr_assert(before.c_lflag & ICANON);
	fflush(NULL);
	pid_t pid = fork();
	cr_assert(pid >= 0);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		setsid();
		ioctl(slave, TIOCSCTTY, 0);
		dup2(slave, 0);
		dup2(slave, 1);
		dup2(slave, 2);
		close(master);
		execl(cli, cli, "--socket", d->sock, "top", (char *)NULL);
		_exit(127);
	}
	/* Two frames drawn: the first clears, the pause reads keys. */
	cr_assert(pty_read_until(master, out, sizeof(out), &len, "BUFFERS:", 5000),
		  "top drew nothing: %s", out);
	cr_assert(strstr(out, "\033[H\033[2J"), "top clears the screen on a terminal");
	cr_assert(strstr(out, "\033[?25l"), "top hides the cursor");
	cr_assert_eq(tcgetattr(slave, &during), 0);
	cr_assert_not(during.c_lflag & (ICANON | ECHO), "top reads keys without Enter or echo");
	/* Nothing more to wait for: top made the terminal raw and took SIGINT
	 * before its first frame, so it reads the key in its next pause (one
	 * written while it draws waits in the terminal until then). */
	cr_assert_eq(write(master, &key, 1), 1);
	/* Its last words show the cursor again. */
	bool shown = pty_read_until(master, out, sizeof(out), &len, "\033[?25h", 3000);
	int code = bbt_join(pid, 3000);
	cr_assert_eq(code, 0, "top ended by %#x exited %d", key, code);
	cr_assert(shown, "top shows the cursor again");
	cr_assert_eq(tcgetattr(slave, &after), 0);
	cr_assert_eq(after.c_lflag & (ICANON | ECHO), before.c_lflag & (ICANON | ECHO),
		     "the terminal is restored (lflag %#x, was %#x)", (unsigned)after.c_lflag,
		     (unsigned)before.c_lflag);
	close(master);
	close(slave);
}

Test(admin, top_on_a_terminal_quits_on_q_or_ctrl_c_and_restores_it)
{
	bbt_daemon *d = start_daemon();
	top_on_a_terminal_ends_with(d, 'q');
	top_on_a_terminal_ends_with(d, 0x03); /* Ctrl-C: SIGINT from the terminal */
	bbt_stop_clean(d);
}

/* ---- check ---------------------------------------------------------------------- */

Test(admin, check_is_ok_on_a_busy_daemon_and_after_crashes)
{
	bbt_daemon *d = start_daemon();
	bb_client *c = bbt_connect(d);
	holder h[3] = {
		{.comm = "bbt-check-0",
		 .nbufs = 3,
		 .sizes = {4 * KiB, 1 * MiB, 100},
		 .states = {0, 1, 2},
		 .tokens = 2,
		 .waits = 3,
		 .cuda_size = 4 * KiB},
		{.comm = "bbt-check-1",
		 .nbufs = 2,
		 .sizes = {64 * KiB, 12345},
		 .tokens = 1,
		 .waits = 1,
		 .share = BB_SHARE_ANY},
		{.comm = "bbt-check-2",
		 .nbufs = 1,
		 .sizes = {2 * MiB},
		 .states = {1},
		 .cuda_size = 3 * MiB},
	};
	char want[160], obj[512];
	bbt_totals t;

	for (int i = 0; i < 3; i++) {
		if (!g_cuda)
			h[i].cuda_size = 0;
		holder_start(d, &h[i]);
	}
	waits_until(c, 4);
	/* The test's own connection holds an opened buffer of holder 1 too. */
	bb_buf *mine;
	cr_assert_eq(bb_open(c, h[1].ids[0], &mine), 0, "%s", bb_last_error());
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.tokens, 3);

	cli_run *r = cli(d, "check");
	assert_ran(r, 0, "check on a busy daemon");
	snprintf(want, sizeof(want), "ok: %llu buffers, %llu bytes", (unsigned long long)t.buffers,
		 (unsigned long long)t.bytes);
	cr_assert(strncmp(r->out, want, strlen(want)) == 0, "want '%s...', got %s", want, r->out);
	cr_assert(strstr(r->out, "5 connections consistent"), "%s", r->out);
	free(r);

	r = cli(d, "--json", "check");
	assert_ran(r, 0, "check --json");
	cr_assert(strstr(r->out, "{\"ok\":true,\"problems\":0,\"report\":[]"), "%s", r->out);
	cr_assert(json_object_with(r->out, "\"ok\":", obj, sizeof(obj)));
	cr_assert_eq(json_num(obj, "buffers"), t.buffers);
	cr_assert_eq(json_num(obj, "bytes"), t.bytes);
	free(r);

	/* Crashes mid-use: the dead connections' counts go, tokens and the
	 * buffer the test still holds stay, and everything still adds up. */
	holder_kill(&h[0]);
	holder_kill(&h[1]);
	cr_assert_eq(bbt_refs_until(c, bb_id(mine), 2, 5000), 2, "the test's count and a token");
	r = cli(d, "--json", "check");
	assert_ran(r, 0, "check after two holders were killed");
	cr_assert(strstr(r->out, "{\"ok\":true,\"problems\":0,"), "%s", r->out);
	free(r);

	holder_finish(&h[2]);
	bb_unref(mine);
	r = cli(d, "check");
	assert_ran(r, 0, "check after the rest left");
	free(r);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* The raw Check request as nobody: the status code the daemon answers. */
static int check_as_nobody_child(void *arg)
{
	const bbt_daemon *d = arg;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Check op = BUFBROKER__CHECK__INIT;
	Bufbroker__Response *resp = NULL;
	bb_client *c = NULL;

	if (become(NOBODY, NOBODY) != 0)
		return 9;
	if (bb_connect(d->sock, &c) != 0)
		return 10;
	req.op_case = BUFBROKER__REQUEST__OP_CHECK;
	req.check = &op;
	if (bbc_call(c, &req, -1, &resp, NULL) != 0)
		return 11;
	int code = resp->status ? resp->status->code : 1;
	bool result = resp->result_case != BUFBROKER__RESPONSE__RESULT__NOT_SET;
	bbc_response_free(resp);
	bb_disconnect(c);
	if (result)
		return 12;
	return code == BB_ERR_DENIED ? 0 : 20;
}

Test(admin, check_by_another_uid_is_denied)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to switch to another uid");
	bbt_daemon *d = start_daemon();

	int code = bbt_join(bbt_spawn(check_as_nobody_child, d), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "Check as uid %d: step %d (20: not DENIED)", NOBODY, code);

	cli_run *r = cli_nobody(d, "check");
	assert_ran(r, 1, "check as nobody");
	cr_assert_str_eq(r->out, "", "nothing on stdout on an error");
	cr_assert(strstr(r->err, "allowed to root"), "%s", r->err);
	free(r);
	r = cli_nobody(d, "--json", "check");
	assert_ran(r, 1, "check --json as nobody");
	cr_assert_str_eq(r->out, "");
	free(r);
	/* What nobody may do still works. */
	r = cli_nobody(d, "clients");
	assert_ran(r, 0, "clients as nobody");
	free(r);
	bbt_stop_clean(d);
}

/* ---- help, exit statuses, options ------------------------------------------- */

/* The CLI's exit statuses (its --help and bufbroker(1) say the same). */
#define CLI_DAEMON_ERROR 1
#define CLI_USAGE 2
#define CLI_UNREACHABLE 3
#define CLI_NOT_FOUND 4

/* Nothing listens here: help must not need a daemon. */
#define NO_DAEMON "/nonexistent-bbt-dir/bb.sock"

Test(admin, help_of_each_command_by_help_flag_h_and_help_command)
{
	static const struct {
		const char *name; /* the command */
		const char *has;  /* something only its help says */
	} cmds[] = {
		{"status", "CUDA device"},   {"ls", "--state STATE"}, {"stat", "--name NAME"},
		{"clients", "parked waits"}, {"top", "-n N"},         {"check", "reference counts"},
	};

	cli_run *o1 = cli_at(NO_DAEMON, "--help");
	cli_run *o2 = cli_at(NO_DAEMON, "-h");
	cli_run *o3 = cli_at(NO_DAEMON, "help");
	assert_ran(o1, 0, "--help");
	assert_ran(o2, 0, "-h");
	assert_ran(o3, 0, "help");
	cr_assert_str_eq(o1->out, o2->out, "-h and --help print the same");
	cr_assert_str_eq(o1->out, o3->out, "help and --help print the same");
	cr_assert(strncmp(o1->out, "Usage: bufbroker [-s PATH]", 26) == 0, "%s", o1->out);
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
		char line[32];
		snprintf(line, sizeof(line), "\n  %s ", cmds[i].name);
		cr_assert(strstr(o1->out, line), "the overview lists %s:\n%s", cmds[i].name,
			  o1->out);
	}
	cr_assert(strstr(o1->out, "  3  the daemon could not be reached"), "%s", o1->out);
	cr_assert(strstr(o1->out, "  4  not found"), "%s", o1->out);

	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
		const char *name = cmds[i].name;
		char usage[96];
		cli_run *a = cli_at(NO_DAEMON, name, "--help");
		cli_run *b = cli_at(NO_DAEMON, name, "-h");
		cli_run *c = cli_at(NO_DAEMON, "help", name);
		assert_ran(a, 0, name);
		assert_ran(b, 0, name);
		assert_ran(c, 0, name);
		cr_assert_str_eq(a->err, "", "%s --help: nothing on stderr", name);
		cr_assert_str_eq(a->out, b->out, "%s: -h and --help print the same", name);
		cr_assert_str_eq(a->out, c->out, "help %s and %s --help print the same", name,
				 name);
		cr_assert_str_neq(a->out, o1->out, "%s --help is not the overview", name);
		/* Its synopsis first, then what only it has. */
		const char *first = strchr(a->out, '\n');
		snprintf(usage, sizeof(usage), " %s", name);
		cr_assert(strncmp(a->out, "Usage: bufbroker [-s PATH] ", 27) == 0 && first &&
				  strstr(a->out, usage) && strstr(a->out, usage) < first,
			  "%s --help begins with its synopsis:\n%s", name, a->out);
		cr_assert(strstr(a->out, cmds[i].has), "%s --help says '%s':\n%s", name,
			  cmds[i].has, a->out);
		cr_assert(strstr(a->out, "-s, --socket PATH"), "%s", a->out);
		cr_assert(strstr(a->out, "  3  the daemon could not be reached"), "%s", a->out);
		/* Only stat names a buffer that may not exist. */
		cr_assert_eq(strstr(a->out, "  4  not found") != NULL, strcmp(name, "stat") == 0,
			     "%s --help and exit status 4:\n%s", name, a->out);
		free(a);
		free(b);
		free(c);
	}

	/* The option may come before the command, as every option may. */
	cli_run *a = cli_at(NO_DAEMON, "ls", "--help");
	cli_run *b = cli_at(NO_DAEMON, "-h", "ls");
	assert_ran(b, 0, "-h ls");
	cr_assert_str_eq(a->out, b->out, "-h ls and ls --help print the same");
	free(a);
	free(b);

	/* Help for what is not a command is a usage error. */
	cli_run *r = cli_at(NO_DAEMON, "help", "bogus");
	assert_ran(r, CLI_USAGE, "help bogus");
	cr_assert(strstr(r->err, "'bogus'"), "%s", r->err);
	cr_assert_str_eq(r->out, "");
	free(r);
	r = cli_at(NO_DAEMON, "bogus", "--help");
	assert_ran(r, CLI_USAGE, "bogus --help");
	cr_assert(strstr(r->err, "unknown command 'bogus'"), "%s", r->err);
	free(r);
	r = cli_at(NO_DAEMON, "help", "ls", "stat");
	assert_ran(r, CLI_USAGE, "help ls stat");
	free(r);
	free(o1);
	free(o2);
	free(o3);
}

Test(admin, exit_status_tells_unreachable_from_not_found_from_a_daemon_error)
{
	bbt_daemon *d = start_daemon();
	char refused[256];

	/* A buffer that does not exist, by id and by name: 4. */
	cli_run *r = cli(d, "stat", "999");
	assert_ran(r, CLI_NOT_FOUND, "stat 999");
	cr_assert_str_eq(r->out, "", "nothing on stdout on an error");
	cr_assert_str_neq(r->err, "", "the daemon's message on stderr");
	free(r);
	r = cli(d, "--json", "stat", "--name", "bbt-no-such-buffer");
	assert_ran(r, CLI_NOT_FOUND, "--json stat --name bbt-no-such-buffer");
	cr_assert_str_eq(r->out, "");
	free(r);

	/* Any other error the daemon answers: 1. A name that is not UTF-8
	 * passes the CLI's checks and is the daemon's to refuse (INVALID);
	 * check as nobody (DENIED) is in check_by_another_uid_is_denied. */
	r = cli(d, "stat", "--name", "bbt-\xff");
	assert_ran(r, CLI_DAEMON_ERROR, "stat --name of a name that is not UTF-8");
	cr_assert(strstr(r->err, "UTF-8"), "%s", r->err);
	free(r);
	/* A bad command line: 2. */
	r = cli(d, "ls", "--kind", "bogus");
	assert_ran(r, CLI_USAGE, "ls --kind bogus");
	cr_assert(strstr(r->err, "Try 'bufbroker ls --help'."), "the command's help is named: %s",
		  r->err);
	free(r);

	/* No daemon there: 3, with no socket file or with nobody listening. */
	r = cli_at(NO_DAEMON, "status");
	assert_ran(r, CLI_UNREACHABLE, "status on a missing socket");
	cr_assert(strstr(r->err, "is bufbrokerd running?"), "%s", r->err);
	cr_assert_str_eq(r->out, "");
	free(r);
	snprintf(refused, sizeof(refused), "%s/refused.sock", d->dir);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	cr_assert_lt(strlen(refused), sizeof(sa.sun_path));
	memcpy(sa.sun_path, refused, strlen(refused) + 1);
	cr_assert(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	r = cli_at(refused, "--json", "status");
	assert_ran(r, CLI_UNREACHABLE, "status on a socket nobody listens on");
	cr_assert_str_eq(r->out, "");
	free(r);
	close(fd);

	/* The daemon gone: 3. */
	bbt_stop_clean(d);
	r = cli(d, "ls");
	assert_ran(r, CLI_UNREACHABLE, "ls after the daemon stopped");
	free(r);
}

Test(admin, short_s_names_the_socket_before_or_after_the_command)
{
	bbt_daemon *d = start_daemon();

	cli_run *r = cli_at(NULL, "-s", d->sock, "--json", "status");
	assert_ran(r, 0, "-s SOCK --json status");
	cr_assert(strstr(r->out, "\"connections\":"), "%s", r->out);
	free(r);
	r = cli_at(NULL, "clients", "-s", d->sock);
	assert_ran(r, 0, "clients -s SOCK");
	free(r);
	/* -s and --socket are one option: the last given counts. */
	r = cli_at(NO_DAEMON, "-s", d->sock, "status");
	assert_ran(r, 0, "--socket MISSING -s SOCK status");
	free(r);
	r = cli_at(NULL, "status", "-s");
	assert_ran(r, CLI_USAGE, "status -s");
	cr_assert(strstr(r->err, "'-s' needs an argument"), "%s", r->err);
	free(r);
	bbt_stop_clean(d);
}

/* The name of a group for the socket that nobody (65534) is not in, into
 * name; false when there is none. */
static bool group_for_socket(char *name, size_t cap)
{
	const struct group *g;
	bool found = false;

	setgrent();
	while (!found && (g = getgrent()) != NULL) {
		bool member = false;
		for (char **m = g->gr_mem; *m; m++)
			member |= strcmp(*m, "nobody") == 0;
		if (g->gr_gid != 0 && g->gr_gid != NOBODY && !member) {
			snprintf(name, cap, "%s", g->gr_name);
			found = true;
		}
	}
	endgrent();
	return found;
}

/* Start a daemon with args (its directory open to all), run `bufbroker cmd`
 * as nobody, stop the daemon; the run, which could not reach it (exit 3). */
static cli_run *nobody_unreachable(const char *const *args, const char *cmd)
{
	bbt_daemon *d = bbt_start(args);
	cr_assert_eq(chmod(d->dir, 0755), 0);
	cli_run *r = cli_nobody(d, cmd);
	bbt_stop_clean(d);
	assert_ran(r, CLI_UNREACHABLE, cmd);
	cr_assert_str_eq(r->out, "", "nothing on stdout on an error");
	return r;
}

Test(admin, permission_denied_on_the_socket_hints_at_its_group)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to switch to another uid");
	char group[64], want[128];
	cr_assert(group_for_socket(group, sizeof(group)), "no group that nobody is not in");

	/* A 0660 socket of another group. */
	const char *const args[] = {"--socket-mode", "0660", "--socket-group", group, NULL};
	cli_run *r = nobody_unreachable(args, "status");
	cr_assert(strstr(r->err, "Permission denied"), "%s", r->err);
	snprintf(want, sizeof(want), "sudo usermod -aG %s $USER", group);
	cr_assert(strstr(r->err, want), "the hint names the socket's group %s:\n%s", group, r->err);
	cr_assert(strstr(r->err, "log in again"), "%s", r->err);
	free(r);

	/* A socket of root's group: only root may use it, and the hint says how
	 * a packaged daemon shares it. */
	const char *const root_args[] = {"--socket-mode", "0660", NULL};
	r = nobody_unreachable(root_args, "ls");
	cr_assert(strstr(r->err, "only root may use this socket"), "%s", r->err);
	cr_assert(strstr(r->err, "sudo usermod -aG bufbroker $USER"), "%s", r->err);
	free(r);

	/* Refused by an allow-list, not by the socket: the daemon's word, no
	 * hint about groups. */
	const char *const allow_args[] = {"--socket-mode", "0666", "--allow-uids", "65533", NULL};
	r = nobody_unreachable(allow_args, "status");
	cr_assert(strstr(r->err, "not allowed"), "%s", r->err);
	cr_assert_null(strstr(r->err, "usermod"), "%s", r->err);
	free(r);
}
