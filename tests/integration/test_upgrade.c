/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The planned upgrade by execve against a real bufbrokerd (docs/RESTART.md,
 * "Planned upgrade by execve"): `bufbroker upgrade` ($BUFBROKER_CLI, a
 * separate process), the admin op Upgrade on a raw connection, and
 * SIGUSR2. The daemon keeps its pid and its listening socket (a client
 * connecting in a tight loop is never refused), refuses a binary that does
 * not read its journal (with that binary's output) and serves on, and
 * serves on with every fd in place when execve itself fails.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "wire.h"

#define NOBODY 65534
#define OUT_CAP 8192

extern char **environ;

TestSuite(upgrade, .fini = bbt_cleanup, .timeout = 240);

/* A daemon with the state journal on (or off), its socket and directory
 * open to other uids. A client that sits out an upgrade keeps its session
 * for the grace period: a long one here, so that a slow run (valgrind)
 * does not release what the test holds through an idle client. */
static bbt_daemon *start_daemon(bool journal)
{
	static const char *const on[] = {"--restart", "--restart-grace", "600000",
					 "--no-cuda", "--socket-mode",   "0666",
					 NULL};
	static const char *const off[] = {"--no-cuda", "--socket-mode", "0666", NULL};
	bbt_daemon *d = bbt_start(journal ? on : off);
	cr_assert_eq(chmod(d->dir, 0755), 0);
	return d;
}

/* ---- the CLI ------------------------------------------------------------- */

typedef struct cli_run {
	int rc;            /* exit status, 128 + signal, -1 timed out */
	char out[OUT_CAP]; /* stdout */
	char err[OUT_CAP]; /* stderr */
} cli_run;

/* Drain fd into buf (cap bytes, NUL-terminated) until end of stream. */
static void drain(int fd, char *buf, size_t cap)
{
	size_t got = 0;
	ssize_t n;
	while ((n = read(fd, buf + got, cap - 1 - got)) > 0 && got + (size_t)n < cap - 1)
		got += (size_t)n;
	if (n > 0)
		got += (size_t)n;
	buf[got] = '\0';
}

/* $BUFBROKER_CLI --socket d->sock ARGS... (NULL-terminated), its stdout
 * and stderr into the run. */
static cli_run *cli(const bbt_daemon *d, const char *arg0, ...)
{
	const char *prog = getenv("BUFBROKER_CLI");
	const char *argv[16] = {prog, "--socket", d->sock};
	int n = 3, po[2], pe[2];
	va_list ap;
	posix_spawn_file_actions_t fa;
	pid_t pid;

	cr_assert(prog && prog[0], "BUFBROKER_CLI must name the built bufbroker (ctest sets it)");
	va_start(ap, arg0);
	for (const char *a = arg0; a; a = va_arg(ap, const char *))
		argv[n++] = a;
	va_end(ap);
	cli_run *r = calloc(1, sizeof(*r));
	cr_assert_not_null(r);
	cr_assert_eq(pipe2(po, O_CLOEXEC), 0);
	cr_assert_eq(pipe2(pe, O_CLOEXEC), 0);
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, po[1], 1);
	posix_spawn_file_actions_adddup2(&fa, pe[1], 2);
	cr_assert_eq(posix_spawn(&pid, prog, &fa, NULL, (char *const *)argv, environ), 0);
	posix_spawn_file_actions_destroy(&fa);
	close(po[1]);
	close(pe[1]);
	drain(po[0], r->out, sizeof(r->out));
	drain(pe[0], r->err, sizeof(r->err));
	close(po[0]);
	close(pe[0]);
	r->rc = bbt_join(pid, 60000);
	return r;
}

/* ---- raw Upgrade ---------------------------------------------------------- */

/* Hello (protocol 1.3) then Upgrade {binary} on a new raw connection, as
 * uid unless it is (uid_t)-1 (in a child). The answer's code; its message
 * into msg. */
static int raw_upgrade(const bbt_daemon *d, const char *binary, uid_t uid, char *msg, size_t len)
{
	bbt_chan ch;
	bbt_chan_open(&ch);
	fflush(NULL);
	pid_t pid = fork();
	cr_assert(pid >= 0);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		char out[1024] = "";
		int code = BB_ERR_DISCONNECTED;
		if (uid != (uid_t)-1 &&
		    (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0))
			_exit(3);
		int s = bbt_raw_connect(d->sock);
		Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
		Bufbroker__Upgrade up = BUFBROKER__UPGRADE__INIT;
		Bufbroker__Response *resp = NULL;
		if (s >= 0 && bbt_raw_hello(s, 1, BB_PROTO_MAJOR) == 0) {
			req.id = 2;
			req.op_case = BUFBROKER__REQUEST__OP_UPGRADE;
			req.upgrade = &up;
			up.binary = (char *)(binary ? binary : "");
			if (bbt_raw_send(s, &req, -1) == 0 &&
			    bbt_raw_recv(s, 20000, &resp, NULL) == 1) {
				code = resp->status ? resp->status->code : BB_ERR_PROTOCOL;
				snprintf(out, sizeof(out), "%s",
					 resp->status && resp->status->message
						 ? resp->status->message
						 : "");
				bufbroker__response__free_unpacked(resp, NULL);
			}
		}
		bbt_send(ch.fd[1], &code, sizeof(code));
		bbt_send(ch.fd[1], out, sizeof(out));
		_exit(0);
	}
	int code = 1;
	char out[1024] = "";
	cr_assert_eq(bbt_recv(ch.fd[0], &code, sizeof(code), 30000), 0);
	cr_assert_eq(bbt_recv(ch.fd[0], out, sizeof(out), 30000), 0);
	cr_assert_eq(bbt_join(pid, 30000), 0);
	bbt_chan_close(&ch);
	snprintf(msg, len, "%s", out);
	return code;
}

/* ---- what identifies the daemon ---------------------------------------------- */

/* The kernel's inode of the listening socket at path (/proc/net/unix:
 * the daemon binds a temporary name and renames it, so the name there
 * starts with path), or 0. */
static unsigned long listen_inode(const char *path)
{
	FILE *f = fopen("/proc/net/unix", "r");
	char line[512];
	unsigned long ino = 0;
	size_t pl = strlen(path);
	cr_assert_not_null(f);
	while (!ino && fgets(line, sizeof(line), f)) {
		unsigned long inode, flags;
		char p[256] = "";
		/* Num RefCount Protocol Flags Type St Inode Path */
		if (sscanf(line, "%*s %*s %*s %lx %*s %*s %lu %255s", &flags, &inode, p) == 3 &&
		    strncmp(p, path, pl) == 0 && (p[pl] == '\0' || p[pl] == '.') &&
		    (flags & 0x10000) /* __SO_ACCEPTCON: listening */)
			ino = inode;
	}
	fclose(f);
	return ino;
}

/* The socket file's own inode at path. */
static ino_t file_inode(const char *path)
{
	struct stat st;
	cr_assert_eq(stat(path, &st), 0);
	return st.st_ino;
}

/* Poll until the daemon has want fds open (closed connections are reaped
 * after their peer went): true when it does. */
static bool fds_until(const bbt_daemon *d, int want, int timeout_ms)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	while (bbt_daemon_fds(d) != want && bbt_now_ms() < deadline)
		bbt_sleep_ms(5);
	return bbt_daemon_fds(d) == want;
}

/* Wait for the new image after an upgrade that began with the log at
 * from: its "event=upgraded" line and then its listening one. */
static void wait_new_image(const bbt_daemon *d, size_t from)
{
	static const char *const upgraded[] = {"event=upgraded", NULL};
	static const char *const listening[] = {"event=listening", NULL};
	if (!bbt_log_wait_line(d, from, 20000, upgraded) ||
	    !bbt_log_wait_line(d, from, 20000, listening)) {
		bbt_dump_log(d);
		cr_assert_fail("the new image did not start");
	}
}

/* How many lines of the log from `from` contain needle. */
static int log_count(const bbt_daemon *d, size_t from, const char *needle)
{
	FILE *f = fopen(d->log, "r");
	char line[2048];
	int n = 0;
	cr_assert_not_null(f);
	fseek(f, (long)from, SEEK_SET);
	while (fgets(line, sizeof(line), f))
		n += strstr(line, needle) != NULL;
	fclose(f);
	return n;
}

/* An executable shell script at dir/name with body; its path into out. */
static void write_script(const bbt_daemon *d, const char *name, const char *body, char *out,
			 size_t len)
{
	snprintf(out, len, "%s/%s", d->dir, name);
	FILE *f = fopen(out, "w");
	cr_assert_not_null(f);
	fprintf(f, "#!/bin/sh\n%s", body);
	fclose(f);
	cr_assert_eq(chmod(out, 0755), 0);
}

/* ---- a client connecting in a tight loop ----------------------------------- */

typedef struct connect_counts {
	long connected; /* connect() succeeded */
	long served;    /* and its Hello was answered */
	long refused;   /* ECONNREFUSED, ENOENT: what an upgrade must never cause */
	long other;     /* any other connect error */
	int last_errno;
} connect_counts;

/* Connect, Hello, close, as fast as possible, until the parent writes to
 * the channel; then send it the counts. */
static int connector(void *arg)
{
	bbt_chan *ch = arg;
	const char *path = getenv("BBT_UPGRADE_SOCK");
	connect_counts k = {0};
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
	for (;;) {
		struct pollfd p = {.fd = ch->fd[1], .events = POLLIN};
		if (poll(&p, 1, 0) > 0)
			break;
		int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
		if (connect(s, (struct sockaddr *)&a, sizeof(a)) == 0) {
			k.connected++;
			if (bbt_raw_hello(s, 1, BB_PROTO_MAJOR) == 0)
				k.served++;
		} else if (errno == ECONNREFUSED || errno == ENOENT) {
			k.refused++;
			k.last_errno = errno;
		} else {
			k.other++;
			k.last_errno = errno;
		}
		close(s);
	}
	bbt_send(ch->fd[1], &k, sizeof(k));
	return 0;
}

/* ---- tests ------------------------------------------------------------------ */

Test(upgrade, keeps_the_pid_and_the_listening_socket_and_never_refuses_a_connect)
{
	bbt_daemon *d = start_daemon(true);
	pid_t pid = d->pid;
	unsigned long ino = listen_inode(d->sock);
	ino_t file = file_inode(d->sock);
	cr_assert_neq(ino, 0, "the daemon's listening socket is not in /proc/net/unix");

	bbt_chan ch;
	bbt_chan_open(&ch);
	setenv("BBT_UPGRADE_SOCK", d->sock, 1);
	pid_t child = bbt_spawn(connector, &ch);

	/* Three upgrades by the CLI, three by SIGUSR2, while it connects. */
	for (int i = 0; i < 6; i++) {
		size_t from = bbt_log_size(d);
		if (i % 2 == 0) {
			cli_run *r = cli(d, "upgrade", NULL);
			cr_assert_eq(r->rc, 0, "bufbroker upgrade: rc %d: %s%s", r->rc, r->out,
				     r->err);
			cr_assert(strstr(r->out, "upgraded: pid "), "%s", r->out);
			free(r);
		} else {
			cr_assert_eq(kill(d->pid, SIGUSR2), 0);
		}
		wait_new_image(d, from);
		cr_assert_eq(log_count(d, from, "event=upgrade_exec"), 1);
		/* The same process, the same listening socket. */
		cr_assert_eq(kill(pid, 0), 0);
		cr_assert_eq(d->pid, pid);
		cr_assert_eq(listen_inode(d->sock), ino, "upgrade %d changed the socket", i);
		cr_assert_eq(file_inode(d->sock), file, "upgrade %d changed the socket file", i);
		bb_client *c = bbt_connect(d);
		bbt_totals t;
		cr_assert_eq(bbt_server_totals(c, &t), 0);
		cr_assert_eq(t.pid, (uint32_t)pid);
		bb_disconnect(c);
	}

	cr_assert_eq(bbt_send(ch.fd[0], "x", 1), 0);
	connect_counts k;
	cr_assert_eq(bbt_recv(ch.fd[0], &k, sizeof(k), 30000), 0);
	cr_assert_eq(bbt_join(child, 30000), 0);
	bbt_chan_close(&ch);
	cr_assert_eq(k.refused, 0, "%ld connects refused (errno %d) across the upgrades", k.refused,
		     k.last_errno);
	cr_assert_eq(k.other, 0, "%ld connects failed (errno %d)", k.other, k.last_errno);
	cr_assert_gt(k.served, 0);
	bbt_stop_clean(d);
}

/* One upgrade: by the CLI when cli, else by SIGUSR2; returns once the new
 * image serves (the same pid). */
static void upgrade_once(bbt_daemon *d, bool by_cli)
{
	pid_t pid = d->pid;
	size_t from = bbt_log_size(d);
	if (by_cli) {
		cli_run *r = cli(d, "upgrade", NULL);
		cr_assert_eq(r->rc, 0, "bufbroker upgrade: rc %d: %s%s", r->rc, r->out, r->err);
		free(r);
	} else {
		cr_assert_eq(kill(d->pid, SIGUSR2), 0);
	}
	wait_new_image(d, from);
	cr_assert_eq(kill(pid, 0), 0);
}

#define SURVIVORS 24
#define SURVIVOR_BYTES 65536

Test(upgrade, buffers_names_states_contents_and_tokens_survive_upgrades)
{
	bbt_daemon *d = start_daemon(true);
	bb_client *c = bbt_connect(d);
	bb_buf *b[SURVIVORS];
	void *p[SURVIVORS];
	uint64_t id[SURVIVORS];
	bb_token tok[2];
	char name[64];

	/* READY buffers with contents, one FAILED with its error, one PENDING
	 * (its producer, c, is away during the upgrade: the grace period
	 * keeps it PENDING), a token on buffer 0 per upgrade. */
	for (int i = 0; i < SURVIVORS; i++) {
		snprintf(name, sizeof(name), "survivor-%d", i);
		bb_alloc_opts o = {.size = SURVIVOR_BYTES, .kind = BB_HOST, .name = name};
		cr_assert_eq(bb_alloc(c, &o, &b[i]), 0);
		id[i] = bb_id(b[i]);
		cr_assert_eq(bb_map(b[i], &p[i]), 0);
		bbt_fill(p[i], SURVIVOR_BYTES, (uint32_t)i);
		if (i == 1)
			cr_assert_eq(bb_set_error(b[i], "the producer gave up"), 0);
		else if (i != 2)
			cr_assert_eq(bb_set_ready(b[i]), 0);
	}
	cr_assert_eq(bb_take(bb_ref(b[0]), &tok[0]), 0);
	cr_assert_eq(bb_take(bb_ref(b[0]), &tok[1]), 0);

	for (int round = 0; round < 2; round++) {
		upgrade_once(d, round == 0);
		bb_client *c2 = bbt_connect(d);
		cr_assert_eq(bbt_check_problems(c2), 0);
		for (int i = 0; i < SURVIVORS; i++) {
			bb_buf *o;
			bb_info info;
			void *q;
			snprintf(name, sizeof(name), "survivor-%d", i);
			cr_assert_eq(bb_open_name(c2, name, &o), 0, "%s after upgrade %d: %s", name,
				     round, bb_last_error());
			cr_assert_eq(bb_id(o), id[i]);
			cr_assert_eq(bb_stat(c2, id[i], &info), 0);
			cr_assert_str_eq(info.name, name);
			cr_assert_eq(info.size, SURVIVOR_BYTES);
			cr_assert_eq(info.state, i == 1   ? BB_FAILED
						 : i == 2 ? BB_PENDING
							  : BB_READY);
			if (i == 1)
				cr_assert_str_eq(info.error, "the producer gave up");
			/* c's count, the tokens not adopted yet, c2's open. */
			cr_assert_eq(info.refs, 2 + (i == 0 ? 2 - (uint64_t)round : 0),
				     "buffer %d refs %" PRIu64, i, info.refs);
			if (i == 1) {
				bb_unref(o);
				continue; /* a FAILED buffer is not mapped */
			}
			cr_assert_eq(bb_map(o, &q), 0);
			cr_assert(bbt_check(q, SURVIVOR_BYTES, (uint32_t)i), "buffer %d", i);
			/* The mapping from before is the same memory. */
			((unsigned char *)q)[0] ^= 0xff;
			cr_assert_eq(((unsigned char *)p[i])[0], ((unsigned char *)q)[0]);
			((unsigned char *)q)[0] ^= 0xff;
			bb_unref(o);
		}
		/* A token taken before the upgrade is adopted after it. */
		bb_buf *a;
		cr_assert_eq(bb_adopt(c2, &tok[round], &a), 0, "%s", bb_last_error());
		cr_assert_eq(bb_id(a), id[0]);
		bb_unref(a);
		cr_assert_eq(bbt_check_problems(c2), 0);
		bb_disconnect(c2);
		/* Its close is seen before the next upgrade (a connection the
		 * daemon has not seen close when it re-executes comes back as an
		 * absent session, released after the grace period). */
		bb_client *c3 = bbt_connect(d);
		cr_assert_eq(bbt_refs_until(c3, id[3], 1, 5000), 1);
		bb_disconnect(c3);
	}
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* A worker's connection across an upgrade: the library reconnects and
 * resumes its session; its counts, the PENDING buffer it produces and a
 * wait parked on it by another process come back; its mappings never
 * went. */
static int waiter(void *arg)
{
	const bbt_daemon *d = arg;
	bb_client *c;
	bb_buf *b;
	bb_state st = BB_PENDING;
	if (bb_connect(d->sock, &c) || bb_open_name(c, "resumed-pending", &b))
		return 2;
	int rc = bb_wait(b, bbt_ms(30000), &st);
	bb_unref(b);
	bb_disconnect(c);
	return rc == 0 && st == BB_READY ? 0 : 3;
}

Test(upgrade, clients_resume_their_sessions_across_it)
{
	bbt_daemon *d = start_daemon(true);
	bb_client *c = bbt_connect(d), *watch = bbt_connect(d);
	bb_buf *ready, *pending;
	void *p, *q;
	bb_alloc_opts o = {.size = 8192, .kind = BB_HOST, .name = "resumed-ready"};
	cr_assert_eq(bb_alloc(c, &o, &ready), 0);
	cr_assert_eq(bb_map(ready, &p), 0);
	bbt_fill(p, 8192, 7);
	cr_assert_eq(bb_set_ready(ready), 0);
	cr_assert_eq(bb_retain(c, bb_id(ready), 2), 0);
	o.name = "resumed-pending";
	cr_assert_eq(bb_alloc(c, &o, &pending), 0);
	cr_assert_eq(bb_map(pending, &q), 0);
	pid_t w = bbt_spawn(waiter, d);
	uint64_t last;
	cr_assert(bbt_waits_until(watch, 1, 10000, &last), "the wait is not parked (%llu)",
		  (unsigned long long)last);

	for (int round = 0; round < 2; round++) {
		upgrade_once(d, round == 0);
		/* The same client, without a word from the test: its counts. */
		cr_assert_eq(bb_retain(c, bb_id(ready), 1), 0, "%s", bb_last_error());
		cr_assert_eq(bb_release(c, bb_id(ready), 1), 0, "%s", bb_last_error());
		cr_assert_eq(bbt_refs(c, bb_id(ready)), 3);
		cr_assert_eq(bb_client_resumes(c), (uint64_t)round + 1);
		cr_assert(bbt_check(p, 8192, 7));
	}
	/* Still PENDING and still its: the producer finishes it, and the
	 * waiter (its wait sent again after each resume) sees READY. */
	bb_info info;
	cr_assert_eq(bb_stat(c, bb_id(pending), &info), 0);
	cr_assert_eq(info.state, BB_PENDING);
	bbt_fill(q, 8192, 8);
	cr_assert_eq(bb_set_ready(pending), 0, "%s", bb_last_error());
	cr_assert_eq(bbt_join(w, 30000), 0, "the waiter");
	cr_assert_eq(bbt_check_problems(c), 0);
	cr_assert_eq(bb_release(c, bb_id(ready), 2), 0);
	bb_unref(ready);
	bb_unref(pending);
	bb_disconnect(watch);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(upgrade, a_binary_that_fails_the_preflight_is_refused_with_its_output)
{
	bbt_daemon *d = start_daemon(true);
	char path[256], msg[1024];
	write_script(d, "not-bufbrokerd", "echo 'I am not bufbrokerd'\n", path, sizeof(path));
	bb_client *c = bbt_connect(d);
	bb_buf *b;
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	cr_assert_eq(bb_alloc(c, &o, &b), 0);
	size_t from = bbt_log_size(d);

	cr_assert_eq(raw_upgrade(d, path, (uid_t)-1, msg, sizeof(msg)), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(msg, "I am not bufbrokerd"), "the answer quotes its output: %s", msg);
	cr_assert(strstr(msg, path), "%s", msg);

	/* An older bufbrokerd without the option exits 2 with its usage. */
	write_script(d, "old-bufbrokerd", "echo \"unrecognized option '$1'\" >&2\nexit 2\n", path,
		     sizeof(path));
	cr_assert_eq(raw_upgrade(d, path, (uid_t)-1, msg, sizeof(msg)), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(msg, "exit status 2"), "%s", msg);
	cr_assert(strstr(msg, "unrecognized option '--check-journal-version'"), "%s", msg);

	/* The CLI says it and exits 1. */
	cli_run *r = cli(d, "upgrade", "--binary", path, NULL);
	cr_assert_eq(r->rc, 1, "rc %d: %s", r->rc, r->err);
	cr_assert(strstr(r->err, "cannot read this daemon's state journal"), "%s", r->err);
	free(r);

	/* Nothing happened: the same connection serves on. */
	cr_assert_eq(log_count(d, from, "event=upgrade_exec"), 0);
	cr_assert_eq(bbt_refs(c, bb_id(b)), 1);
	cr_assert_eq(bb_set_ready(b), 0);
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* The daemon lists every journal layout it reads, the one it writes first:
 * a daemon of the build before, whose journal has the older layout, takes
 * it in its preflight. A binary that lists only the older layout cannot
 * read this daemon's journal: refused. */
Test(upgrade, the_preflight_lists_every_layout_read_and_wants_the_journal_s_own)
{
	const char *exe = getenv("BUFBROKERD");
	cr_assert(exe && exe[0], "BUFBROKERD is not set (ctest sets it to the built daemon)");
	char cmd[512], line[256] = "";
	snprintf(cmd, sizeof(cmd), "'%s' --check-journal-version", exe);
	FILE *p = popen(cmd, "r");
	cr_assert_not_null(p);
	cr_assert_not_null(fgets(line, sizeof(line), p));
	cr_assert_eq(pclose(p), 0);
	cr_assert_str_eq(line, "journal versions: 2 1\n");

	bbt_daemon *d = start_daemon(true);
	char path[256], msg[1024];
	write_script(d, "v1-only", "echo 'journal versions: 1'\n", path, sizeof(path));
	size_t from = bbt_log_size(d);
	cr_assert_eq(raw_upgrade(d, path, (uid_t)-1, msg, sizeof(msg)), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(msg, "cannot read this daemon's state journal (layout version 2)"), "%s",
		  msg);
	cr_assert_eq(log_count(d, from, "event=upgrade_exec"), 0);
	bb_client *c = bbt_connect(d);
	cr_assert_eq(bbt_check_problems(c), 0);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(upgrade, a_binary_that_cannot_be_executed_is_refused_and_the_daemon_serves_on)
{
	bbt_daemon *d = start_daemon(true);
	char msg[1024], path[256];
	size_t from = bbt_log_size(d);

	cr_assert_eq(raw_upgrade(d, "/nonexistent/bufbrokerd", (uid_t)-1, msg, sizeof(msg)),
		     BB_ERR_NOT_FOUND);
	cr_assert(strstr(msg, "cannot execute /nonexistent/bufbrokerd: No such file"), "%s", msg);
	write_script(d, "not-executable", "exit 0\n", path, sizeof(path));
	cr_assert_eq(chmod(path, 0644), 0);
	cr_assert_eq(raw_upgrade(d, path, (uid_t)-1, msg, sizeof(msg)), BB_ERR_NOT_FOUND);
	cr_assert(strstr(msg, "Permission denied"), "%s", msg);
	cr_assert_eq(raw_upgrade(d, "relative/bufbrokerd", (uid_t)-1, msg, sizeof(msg)),
		     BB_ERR_INVALID);
	cr_assert(strstr(msg, "absolute path"), "%s", msg);
	cr_assert_eq(log_count(d, from, "event=upgrade_exec"), 0);
	bb_client *c = bbt_connect(d);
	cr_assert_eq(bbt_check_problems(c), 0);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* A binary that passes the preflight and then is gone: the daemon's own
 * execve fails after the fds were moved into place; each must be back
 * where it was (the loop, the connections, the buffers' memfds). */
Test(upgrade, an_execve_that_fails_puts_every_fd_back_and_the_daemon_serves_on)
{
	bbt_daemon *d = start_daemon(true);
	char path[256], sb[64];
	void *p;
	write_script(d, "vanishing", "echo 'journal versions: 2 1'\nrm -f \"$0\"\n", path,
		     sizeof(path));

	/* Buffers (their memfds take fd numbers 3, 4, ... are handed over
	 * from), a connection that stays open throughout. */
	bb_client *c = bbt_connect(d);
	bb_buf *bufs[32];
	for (int i = 0; i < 32; i++) {
		snprintf(sb, sizeof(sb), "vanishing-%d", i);
		bb_alloc_opts o = {.size = 8192, .kind = BB_HOST, .name = sb};
		cr_assert_eq(bb_alloc(c, &o, &bufs[i]), 0);
		cr_assert_eq(bb_map(bufs[i], &p), 0);
		bbt_fill(p, 8192, (uint32_t)i);
		cr_assert_eq(bb_set_ready(bufs[i]), 0);
	}
	int fds = bbt_daemon_fds(d);
	size_t from = bbt_log_size(d);

	cli_run *r = cli(d, "upgrade", "--binary", path, NULL);
	cr_assert_eq(r->rc, 1, "rc %d: %s%s", r->rc, r->out, r->err);
	cr_assert(strstr(r->err, "still runs its old image"), "%s", r->err);
	free(r);
	static const char *const failed[] = {"event=upgrade_failed", "No such file", NULL};
	cr_assert(bbt_log_wait_line(d, from, 10000, failed));
	cr_assert_eq(log_count(d, from, "event=upgrade_exec"), 1);
	cr_assert_eq(log_count(d, from, "event=upgraded"), 0);

	/* The old connection serves on, every buffer is whole, nothing leaked. */
	for (int i = 0; i < 32; i++) {
		cr_assert_eq(bbt_refs(c, bb_id(bufs[i])), 1);
		cr_assert_eq(bb_retain(c, bb_id(bufs[i]), 1), 0);
		cr_assert_eq(bb_release(c, bb_id(bufs[i]), 1), 0);
	}
	bb_client *c2 = bbt_connect(d);
	for (int i = 0; i < 32; i++) {
		bb_buf *o;
		snprintf(sb, sizeof(sb), "vanishing-%d", i);
		cr_assert_eq(bb_open_name(c2, sb, &o), 0);
		cr_assert_eq(bb_map(o, &p), 0);
		cr_assert(bbt_check(p, 8192, (uint32_t)i), "buffer %d's contents", i);
		bb_unref(o);
	}
	cr_assert_eq(bbt_check_problems(c2), 0);
	bb_disconnect(c2);
	cr_assert(fds_until(d, fds, 5000), "the daemon's fds: %d before, %d after", fds,
		  bbt_daemon_fds(d));
	for (int i = 0; i < 32; i++)
		bb_unref(bufs[i]);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(upgrade, is_for_root_and_the_daemons_uid_only)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to switch to another uid");
	bbt_daemon *d = start_daemon(true);
	char msg[1024];
	size_t from = bbt_log_size(d);
	cr_assert_eq(raw_upgrade(d, NULL, NOBODY, msg, sizeof(msg)), BB_ERR_DENIED, "%s", msg);
	cr_assert(strstr(msg, "Upgrade is allowed to root and to uid 0"), "%s", msg);
	cr_assert_eq(log_count(d, from, "event=upgrade_exec"), 0);
	bbt_stop_clean(d);
}

Test(upgrade, needs_the_state_journal)
{
	bbt_daemon *d = start_daemon(false);
	char msg[1024];
	size_t from = bbt_log_size(d);
	cr_assert_eq(raw_upgrade(d, NULL, (uid_t)-1, msg, sizeof(msg)), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(msg, "keeps no state journal"), "%s", msg);
	cli_run *r = cli(d, "upgrade", NULL);
	cr_assert_eq(r->rc, 1);
	cr_assert(strstr(r->err, "keeps no state journal"), "%s", r->err);
	free(r);

	/* SIGUSR2 does nothing to it: it neither ends nor execs. */
	bb_client *c = bbt_connect(d);
	bb_buf *b;
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	cr_assert_eq(bb_alloc(c, &o, &b), 0);
	cr_assert_eq(kill(d->pid, SIGUSR2), 0);
	/* A request answered after the signal was delivered and handled (or
	 * ignored): the connection is the same, the buffer too. */
	for (int i = 0; i < 20; i++)
		cr_assert_eq(bbt_refs(c, bb_id(b)), 1);
	cr_assert_eq(kill(d->pid, 0), 0);
	cr_assert_eq(log_count(d, from, "event=upgrade"), 0);
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}
