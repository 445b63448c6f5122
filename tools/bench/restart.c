/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Live restart (issue 14, docs/RESTART.md "Benchmark targets"): the daemon
 * with its state journal on (--journal-socket) is filled with 4 KiB host
 * buffers (100 000, or what its open-file limit leaves; quick: 10 000)
 * and told to re-execute itself (the admin op Upgrade: the planned
 * upgrade by execve, which needs no systemd). Two rows:
 *
 *   restart.ready  from the Upgrade's answer (the old image executes the
 *                  new one right after it) to the first request answered
 *                  by the new image (on the asker's resumed session, or a
 *                  new connection without resume): exec, the
 *                  start from the kept state (journal read and checked,
 *                  every buffer's memfd checked and adopted, a fresh
 *                  journal written) and the first answer;
 *   restart.stall  meanwhile, a client calling bb_stat in a closed loop:
 *                  its longest call, counting a reconnect when its
 *                  connection broke (with session resume the library does
 *                  that itself; without, the client does it here).
 *
 * The filler's buffers stay in the new image as its absent session's until
 * the grace period releases them; nothing runs on that daemon afterwards.
 *
 * BB_BENCH_RESTART_BY=kill: SIGKILL the daemon instead, for one run under
 * a supervisor that keeps its fds and starts it again (bench/restart-crash.sh:
 * tests/integration/fakesd, systemd's stand-in): the rows then measure a
 * crash, the start from systemd's fd store (the bundles peeked) included.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "client_internal.h"

#define RESTART_BUFFERS 100000
#define RESTART_BUFFERS_QUICK 10000
/* What the daemon keeps open besides one fd per buffer, with room. */
#define RESTART_FD_HEADROOM 2048
/* The most a restart may take before the row says it failed. */
#define RESTART_TIMEOUT_NS (60 * 1000000000ull)

/* The stall client's figures, sent to the parent. */
struct stall {
	uint64_t calls;  /* bb_stat calls answered */
	uint64_t max_ns; /* the longest, reconnecting included */
	uint64_t reconnects;
	char err[160]; /* "" or why it stopped */
};

/* ServerStatus on c: 0 and *out, or a BB_ERR_* code. */
static int server_status(bb_client *c, Bufbroker__Response **out)
{
	Bufbroker__ServerStatus op = BUFBROKER__SERVER_STATUS__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &op;
	int rc = bbc_call(c, &req, -1, out, NULL);
	if (!rc && (!(*out)->status || (*out)->status->code ||
		    (*out)->result_case != BUFBROKER__RESPONSE__RESULT_SERVER_STATUS)) {
		rc = (*out)->status && (*out)->status->code ? (*out)->status->code
							    : BB_ERR_PROTOCOL;
		bbc_response_free(*out);
	}
	return rc;
}

/* The stall client: bb_stat(id) in a closed loop until the parent writes
 * to fd; a broken connection is connected again (the time counts). */
static void stall_client(const char *path, uint64_t id, int fd)
{
	struct stall st = {0};
	bb_client *c = NULL;
	bb_info info;

	child_watchdog(RESTART_TIMEOUT_NS);
	if (bb_connect(path, &c)) {
		snprintf(st.err, sizeof(st.err), "bb_connect: %s", bb_last_error());
		goto out;
	}
	(void)!write(fd, "r", 1); /* ready */
	for (;;) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (poll(&p, 1, 0) > 0)
			break;
		uint64_t t0 = bench_now_ns();
		int rc = bb_stat(c, id, &info);
		while (rc == BB_ERR_DISCONNECTED) {
			bb_disconnect(c);
			c = NULL;
			st.reconnects++;
			if (bench_now_ns() - t0 > RESTART_TIMEOUT_NS) {
				snprintf(st.err, sizeof(st.err), "no daemon for %llu s",
					 (unsigned long long)(RESTART_TIMEOUT_NS / 1000000000ull));
				goto out;
			}
			if (bb_connect(path, &c) == 0)
				rc = bb_stat(c, id, &info);
			else
				usleep(1000);
		}
		if (rc) {
			snprintf(st.err, sizeof(st.err), "bb_stat: %s", bb_last_error());
			goto out;
		}
		uint64_t dt = bench_now_ns() - t0;
		st.calls++;
		st.max_ns = dt > st.max_ns ? dt : st.max_ns;
	}
out:
	if (write(fd, &st, sizeof(st)) != sizeof(st))
		_exit(1);
	bb_disconnect(c);
	_exit(0);
}

static void restart_skip(const char *why)
{
	static const char *const names[] = {"restart.ready", "restart.stall"};
	for (int i = 0; i < 2; i++) {
		result *r = result_new(names[i], "restart", "bufbroker", names[i]);
		r->skipped = 1;
		result_note(r, "%s", why);
	}
}

/* Ask c's daemon to re-execute itself: 0 once it answered yes. */
/* The new process's first answer r, t0 ns after the upgrade or the kill:
 * the time to it (at least 1), the buffers it restored; err says so when
 * the wrong process answered (the same pid after a kill, another after an
 * upgrade, which keeps its pid). */
static uint64_t first_answer(const Bufbroker__Response *r, uint64_t t0, uint32_t pid, bool crash,
			     uint64_t *restored, char *err, size_t len)
{
	uint64_t ns = bench_now_ns() - t0;
	*restored = r->server_status->restored_buffers;
	if ((r->server_status->pid != pid) != crash)
		snprintf(err, len, "%s pid answered", crash ? "the killed" : "another");
	return ns ? ns : 1;
}

static int upgrade(bb_client *c, char *err, size_t len)
{
	Bufbroker__Upgrade op = BUFBROKER__UPGRADE__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	req.op_case = BUFBROKER__REQUEST__OP_UPGRADE;
	req.upgrade = &op;
	int rc = bbc_call(c, &req, -1, &r, NULL);
	if (rc) {
		snprintf(err, len, "Upgrade: %s", bb_last_error());
		return rc;
	}
	rc = r->status ? r->status->code : BB_ERR_PROTOCOL;
	if (rc)
		snprintf(err, len, "Upgrade: %s", r->status ? r->status->message : "no status");
	bbc_response_free(r);
	return rc;
}

void scenario_restart(const bench_opts *o)
{
	const char *path = o->rt.journal_socket;
	uint64_t want = o->quick ? RESTART_BUFFERS_QUICK : RESTART_BUFFERS, have = 0, id = 0;
	char err[160] = "", why[256];
	bb_client *c = NULL;
	Bufbroker__Response *r;
	int ch[2] = {-1, -1};
	pid_t kid = -1;

	if (!path) {
		restart_skip("no --journal-socket: no daemon with its state journal on");
		return;
	}
	long nofile = o->journal_pid ? bench_daemon_nofile(o->journal_pid) : -1;
	/* Without CUDA, host buffers only: as many as its open files allow. */
	if (!o->cuda && nofile > 0 && (uint64_t)nofile < want + RESTART_FD_HEADROOM)
		want = (uint64_t)nofile > 2 * RESTART_FD_HEADROOM
			       ? (uint64_t)nofile - RESTART_FD_HEADROOM
			       : 1000;
	if (bb_connect(path, &c)) {
		snprintf(why, sizeof(why), "bb_connect %s: %s", path, bb_last_error());
		restart_skip(why);
		return;
	}
	fprintf(stderr, "  restart: filling the journal-on daemon with %" PRIu64 " buffers\n",
		want);
	/* The stall client's buffer, first: a host buffer. */
	uint64_t stall_id = 0;
	int rc = bench_raw_alloc(c, BB_HOST, 4096, &stall_id, err, sizeof(err));
	if (rc) {
		snprintf(why, sizeof(why), "Alloc: %s", err);
		goto fail;
	}
	for (have = 1; have < want; have++)
		if ((rc = bench_raw_alloc(c, BB_HOST, 4096, &id, err, sizeof(err))))
			break;
	if (have < want && (rc != BB_ERR_NO_MEMORY || have < 1000)) {
		snprintf(why, sizeof(why), "the fill stopped at %" PRIu64 ": %s", have, err);
		goto fail;
	}
	/* Past the host buffers' fd limit: 256 B CUDA buffers (VMM by the
	 * daemon's default, run.sh's --cuda-handle vmm; no fd each), as the
	 * scale series does, when the daemon serves CUDA. */
	uint64_t host = have;
	char capped[256] = "";
	for (; o->cuda && have < want; have++)
		if ((rc = bench_raw_alloc(c, BB_CUDA, 256, &id, err, sizeof(err))))
			break;
	if (have < want) /* a limit of the daemon's: measure what it holds */
		snprintf(capped, sizeof(capped), "capped at %" PRIu64 ": %s", have, err);
	else if (host < have)
		snprintf(capped, sizeof(capped),
			 "%" PRIu64 " host buffers (the open-file limit), %" PRIu64 " CUDA", host,
			 have - host);
	err[0] = '\0';
	if (server_status(c, &r)) {
		snprintf(why, sizeof(why), "ServerStatus: %s", bb_last_error());
		goto fail;
	}
	uint32_t pid = r->server_status->pid;
	bbc_response_free(r);

	/* The stall client, on its buffer (the filler's count keeps it). */
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ch) < 0 || (kid = fork()) < 0) {
		snprintf(why, sizeof(why), "socketpair/fork: %s", strerror(errno));
		goto fail;
	}
	if (kid == 0) {
		close(ch[0]);
		bench_pin_client(0);
		stall_client(path, stall_id, ch[1]);
	}
	close(ch[1]);
	ch[1] = -1;
	char ready;
	if (read(ch[0], &ready, 1) != 1) {
		snprintf(why, sizeof(why), "the stall client did not start");
		goto fail;
	}
	usleep(100 * 1000); /* its calls before the upgrade are its baseline */

	const char *by = getenv("BB_BENCH_RESTART_BY");
	bool crash = by && !strcmp(by, "kill");
	fprintf(stderr, "  restart: %s with %" PRIu64 " live buffers\n",
		crash ? "SIGKILL" : "upgrade", have);
	if (crash ? kill((pid_t)pid, SIGKILL) : upgrade(c, err, sizeof(err))) {
		snprintf(why, sizeof(why), "%s", crash ? strerror(errno) : err);
		goto fail;
	}
	uint64_t t0 = bench_now_ns(), ready_ns = 0, restored = 0;
	/* The old image executes the new one at the end of this turn: its
	 * connection (close-on-exec) ends. The library resumes the session
	 * with the new image, whose answer is the first; without a resume a
	 * new connection is asked. */
	uint64_t resumes = bb_client_resumes(c);
	while (server_status(c, &r) == 0) {
		if (bb_client_resumes(c) > resumes)
			ready_ns = first_answer(r, t0, pid, crash, &restored, err, sizeof(err));
		bbc_response_free(r);
		if (ready_ns)
			break;
		if (bench_now_ns() - t0 > RESTART_TIMEOUT_NS) {
			snprintf(why, sizeof(why), "%s",
				 crash ? "the daemon was not started again"
				       : "the daemon answered the Upgrade but did not re-execute");
			goto fail;
		}
	}
	while (!ready_ns) {
		bb_client *n = NULL;
		if (bb_connect(path, &n) == 0 && server_status(n, &r) == 0) {
			ready_ns = first_answer(r, t0, pid, crash, &restored, err, sizeof(err));
			bbc_response_free(r);
		}
		bb_disconnect(n);
		if (!ready_ns && bench_now_ns() - t0 > RESTART_TIMEOUT_NS) {
			snprintf(why, sizeof(why), "no answer within %llu s of the Upgrade",
				 (unsigned long long)(RESTART_TIMEOUT_NS / 1000000000ull));
			goto fail;
		}
	}
	usleep(200 * 1000); /* the stall client's calls after it */
	struct stall st = {0};
	if (write(ch[0], "x", 1) != 1 || read(ch[0], &st, sizeof(st)) != sizeof(st)) {
		snprintf(why, sizeof(why), "the stall client did not report");
		goto fail;
	}

	result *res = result_new("restart.ready", "restart", "bufbroker", "");
	snprintf(res->label, sizeof(res->label),
		 "restart_ready: serving again%s, %" PRIu64 " buffers",
		 crash ? " after a SIGKILL" : "", have);
	res->param = have;
	res->extra = (double)ready_ns / 1e6;
	snprintf(res->extra_name, sizeof(res->extra_name), "ms");
	res->reps = 1;
	if (restored)
		result_note(res, "%s%s%s%" PRIu64 " of %" PRIu64 " buffers restored", capped,
			    capped[0] ? "; " : "", err, restored, have);
	else
		result_note(res, "%s%s%s", capped, capped[0] && err[0] ? "; " : "", err);
	res = result_new("restart.stall", "restart", "bufbroker",
			 crash ? "restart_stall: a client's longest bb_stat across a SIGKILL"
			       : "restart_stall: a client's longest bb_stat across it");
	res->param = have;
	res->extra = (double)st.max_ns / 1e6;
	snprintf(res->extra_name, sizeof(res->extra_name), "ms");
	res->reps = 1;
	if (st.err[0])
		result_note(res, "%s", st.err);
	else
		result_note(res, "%" PRIu64 " calls, %" PRIu64 " reconnects", st.calls,
			    st.reconnects);
	close(ch[0]);
	waitpid(kid, NULL, 0);
	bb_disconnect(c); /* the filler's buffers go now (or after the grace period) */
	return;
fail:
	fprintf(stderr, "  restart: %s\n", why);
	restart_skip(why);
	bb_disconnect(c);
	if (ch[0] >= 0)
		close(ch[0]);
	if (kid > 0) {
		kill(kid, SIGKILL);
		waitpid(kid, NULL, 0);
	}
}
