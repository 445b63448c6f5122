/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The round trip from 1..N client processes against bufbrokerd and its two
 * baselines, with one client loop for all three: take the time, one request,
 * wait for its answer, take the time, the next request.
 *
 *   bufbroker: bb_retain(id, 1) then bb_release(id, 1) of a buffer the
 *              client holds (each waits for the daemon's answer);
 *   echo:      a datagram of the packed Retain (Release) request's size,
 *              answered with one of the packed RefsReply's size;
 *   redis:     INCR key then DECR key (hiredis, a pre-formatted command).
 *
 * Every op is one sample; ops/s counts ops (a retain or a release is one).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef BB_BENCH_HIREDIS
#include <hiredis/hiredis.h>
#endif

#include "bench.h"
#include "bufbroker.pb-c.h"
#include "bufbroker/bufbroker.h"
#include "msgio.h"

/* Warm-up before a child says it is ready (connections warm, caches hot):
 * this many pairs, or this long, whichever comes first. */
#define WARMUP_PAIRS 200
#define WARMUP_NS 20000000u
/* How long the parent waits for every child to be ready. */
#define READY_TIMEOUT_MS 60000

/* One child's figures, in memory shared with the parent. */
struct slot {
	uint64_t ops;        /* ops done in the timed window */
	uint64_t elapsed_ns; /* length of that window */
	hist h;              /* per-op latency */
};

/* One client's connection to whichever server it measures. */
struct rt_conn {
	rt_system sys;
	bb_client *bb;             /* RT_BUFBROKER */
	bb_buf *buf;               /* the held buffer */
	uint64_t id;               /* its id */
	int sock;                  /* RT_ECHO */
	unsigned char req[2][256]; /* the two request datagrams */
	size_t req_len[2];
	size_t resp_len[2];
	unsigned char rbuf[512]; /* answers land here */
#ifdef BB_BENCH_HIREDIS
	redisContext *redis; /* RT_REDIS */
	char *cmd[2];        /* INCR and DECR, pre-formatted */
	int cmd_len[2];
#endif
};

int rt_have_redis(void)
{
#ifdef BB_BENCH_HIREDIS
	return 1;
#else
	return 0;
#endif
}

void rt_wire_sizes(size_t req[2], size_t resp[2])
{
	/* Representative values: a request id as a connection reaches within
	 * its first second (three varint bytes), a small buffer id, a count of
	 * 1; the refs after retain (2) and after release (1). */
	for (int w = 0; w < 2; w++) {
		Bufbroker__Request rq = BUFBROKER__REQUEST__INIT;
		Bufbroker__Retain ret = BUFBROKER__RETAIN__INIT;
		Bufbroker__Release rel = BUFBROKER__RELEASE__INIT;
		Bufbroker__Response rs = BUFBROKER__RESPONSE__INIT;
		Bufbroker__Status st = BUFBROKER__STATUS__INIT;
		Bufbroker__RefsReply refs = BUFBROKER__REFS_REPLY__INIT;

		rq.id = 100000 + (uint64_t)w;
		if (w == 0) {
			ret.id = 5;
			ret.count = 1;
			rq.op_case = BUFBROKER__REQUEST__OP_RETAIN;
			rq.retain = &ret;
		} else {
			rel.id = 5;
			rel.count = 1;
			rq.op_case = BUFBROKER__REQUEST__OP_RELEASE;
			rq.release = &rel;
		}
		rs.id = rq.id;
		rs.status = &st;
		refs.refs = w == 0 ? 2 : 1;
		refs.held = w == 0 ? 2 : 1;
		rs.result_case = BUFBROKER__RESPONSE__RESULT_REFS;
		rs.refs = &refs;
		req[w] = bufbroker__request__get_packed_size(&rq);
		resp[w] = bufbroker__response__get_packed_size(&rs);
	}
}

/* ---- one client's connection ----------------------------------------------- */

static int unix_connect(const char *path, int type)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	int s;

	if (strlen(path) >= sizeof(a.sun_path))
		return -ENAMETOOLONG;
	strcpy(a.sun_path, path);
	s = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -errno;
	if (connect(s, (struct sockaddr *)&a, sizeof(a)) < 0) {
		int e = errno;
		close(s);
		return -e;
	}
	return s;
}

static void conn_open(struct rt_conn *k, const rt_config *cfg, rt_system sys, int idx)
{
	int rc;

	memset(k, 0, sizeof(*k));
	k->sys = sys;
	k->sock = -1;
	switch (sys) {
	case RT_BUFBROKER:
	case RT_JOURNAL:
	case RT_NOJOURNAL: {
		bb_alloc_opts ao = {.size = 4096, .kind = BB_HOST};
		const char *path = sys == RT_JOURNAL     ? cfg->journal_socket
				   : sys == RT_NOJOURNAL ? cfg->twin_socket
							 : cfg->bb_socket;

		rc = bb_connect(path, &k->bb);
		if (rc)
			child_die("bb_connect %s: %s", path, bb_last_error());
		rc = bb_alloc(k->bb, &ao, &k->buf);
		if (rc)
			child_die("bb_alloc: %s", bb_last_error());
		k->id = bb_id(k->buf);
		break;
	}
	case RT_ECHO:
		k->sock = unix_connect(cfg->echo_socket, SOCK_SEQPACKET);
		if (k->sock < 0)
			child_die("connect %s: %s", cfg->echo_socket, strerror(-k->sock));
		for (int w = 0; w < 2; w++) {
			k->req_len[w] = cfg->req_bytes[w];
			k->resp_len[w] = cfg->resp_bytes[w];
			if (k->req_len[w] < 2 || k->req_len[w] > sizeof(k->req[w]) ||
			    k->resp_len[w] < 1 || k->resp_len[w] > sizeof(k->rbuf))
				child_die("echo datagram sizes out of range");
			memset(k->req[w], 0x5a, k->req_len[w]);
			k->req[w][0] = (unsigned char)(k->resp_len[w] & 0xff);
			k->req[w][1] = (unsigned char)(k->resp_len[w] >> 8);
		}
		break;
	case RT_REDIS:
#ifdef BB_BENCH_HIREDIS
	{
		char key[32];

		k->redis = redisConnectUnix(cfg->redis_socket);
		if (!k->redis || k->redis->err)
			child_die("redis connect %s: %s", cfg->redis_socket,
				  k->redis ? k->redis->errstr : "out of memory");
		snprintf(key, sizeof(key), "bbref:%d", idx);
		k->cmd_len[0] = redisFormatCommand(&k->cmd[0], "INCR %s", key);
		k->cmd_len[1] = redisFormatCommand(&k->cmd[1], "DECR %s", key);
		if (k->cmd_len[0] < 0 || k->cmd_len[1] < 0)
			child_die("redisFormatCommand failed");
		break;
	}
#else
		(void)idx;
		child_die("built without hiredis");
#endif
	}
}

/* One request and its answer. which: 0 retain / INCR, 1 release / DECR. */
static inline void conn_op(struct rt_conn *k, int which)
{
	switch (k->sys) {
	case RT_BUFBROKER:
	case RT_JOURNAL:
	case RT_NOJOURNAL: {
		int rc = which ? bb_release(k->bb, k->id, 1) : bb_retain(k->bb, k->id, 1);
		if (rc)
			child_die("%s: %s", which ? "bb_release" : "bb_retain", bb_last_error());
		break;
	}
	case RT_ECHO: {
		int fd, trunc;
		ssize_t n = msgio_send(k->sock, k->req[which], k->req_len[which], -1);

		if (n != (ssize_t)k->req_len[which])
			child_die("echo send: %s", n < 0 ? strerror((int)-n) : "short");
		n = msgio_recv(k->sock, k->rbuf, sizeof(k->rbuf), &fd, &trunc);
		if (n != (ssize_t)k->resp_len[which])
			child_die("echo recv: %s", n < 0 ? strerror((int)-n) : "wrong size");
		break;
	}
	case RT_REDIS: {
#ifdef BB_BENCH_HIREDIS
		redisReply *r = NULL;

		if (redisAppendFormattedCommand(k->redis, k->cmd[which],
						(size_t)k->cmd_len[which]) != REDIS_OK ||
		    redisGetReply(k->redis, (void **)&r) != REDIS_OK || !r)
			child_die("redis: %s", k->redis->errstr);
		if (r->type != REDIS_REPLY_INTEGER)
			child_die("redis answered type %d, not an integer", r->type);
		freeReplyObject(r);
#endif
		break;
	}
	}
}

static void conn_close(struct rt_conn *k)
{
	switch (k->sys) {
	case RT_BUFBROKER:
	case RT_JOURNAL:
	case RT_NOJOURNAL:
		bb_unref(k->buf);
		bb_disconnect(k->bb);
		break;
	case RT_ECHO: close(k->sock); break;
	case RT_REDIS:
#ifdef BB_BENCH_HIREDIS
		redisFreeCommand(k->cmd[0]);
		redisFreeCommand(k->cmd[1]);
		redisFree(k->redis);
#endif
		break;
	}
}

/* ---- the runner ---------------------------------------------------------------- */

/* The CPU time pid's main thread has run, in ns (the first field of
 * /proc/PID/schedstat: exact, not the tick-sampled utime and stime); -1 when
 * it cannot be read. The daemon serves on its main thread (the loop). */
static int64_t cpu_ns(int pid)
{
	char path[64];
	unsigned long long ns;
	FILE *f;
	int n;

	snprintf(path, sizeof(path), "/proc/%d/schedstat", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	n = fscanf(f, "%llu", &ns);
	fclose(f);
	return n == 1 ? (int64_t)ns : -1;
}

__attribute__((noreturn)) static void rt_child(const rt_config *cfg, rt_system sys, int idx,
					       struct slot *slot, int ready_fd, int go_fd,
					       uint64_t dur_ns)
{
	struct rt_conn k;
	char c = 'r';
	uint64_t start, deadline, t0, t1, t2, ops = 0;

	bench_pin_client(idx);
	child_watchdog(dur_ns);
	conn_open(&k, cfg, sys, idx);
	t0 = bench_now_ns();
	for (int i = 0; i < WARMUP_PAIRS && bench_now_ns() - t0 < WARMUP_NS; i++) {
		conn_op(&k, 0);
		conn_op(&k, 1);
	}
	if (write(ready_fd, &c, 1) != 1)
		child_die("cannot tell the parent it is ready");
	/* The parent closes the pipe to start everyone at once. */
	while (read(go_fd, &c, 1) < 0 && errno == EINTR)
		;
	start = t0 = bench_now_ns();
	deadline = start + dur_ns;
	for (;;) {
		conn_op(&k, 0);
		t1 = bench_now_ns();
		conn_op(&k, 1);
		t2 = bench_now_ns();
		hist_add(&slot->h, t1 - t0);
		hist_add(&slot->h, t2 - t1);
		ops += 2;
		t0 = t2;
		if (t2 >= deadline)
			break;
	}
	slot->ops = ops;
	slot->elapsed_ns = t0 - start;
	conn_close(&k);
	_exit(0);
}

int rt_run(const rt_config *cfg, rt_system sys, int clients, uint64_t dur_ns, rt_figures *out,
	   char *err, size_t errlen)
{
	size_t bytes = (size_t)clients * sizeof(struct slot);
	struct slot *slots;
	int ready[2], go[2], got = 0, failed = 0, rc = -1;
	int cpu_pid = cfg->cpu_pid[sys];
	int64_t cpu0 = -1, cpu1 = -1;
	pid_t *pids;
	hist *all;

	memset(out, 0, sizeof(*out));
	out->cpu_us = NAN;
	err[0] = 0;
	bench_set_pinned(clients == 1);
	slots = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (slots == MAP_FAILED) {
		snprintf(err, errlen, "mmap: %s", strerror(errno));
		return -1;
	}
	pids = calloc((size_t)clients, sizeof(*pids));
	all = calloc(1, sizeof(*all));
	if (!pids || !all || pipe2(ready, O_CLOEXEC) < 0) {
		snprintf(err, errlen, "out of memory or pipes");
		goto err_mem;
	}
	if (pipe2(go, O_CLOEXEC) < 0) {
		snprintf(err, errlen, "pipe: %s", strerror(errno));
		goto err_ready;
	}
	fflush(stdout);
	fflush(stderr);
	for (int i = 0; i < clients; i++) {
		pids[i] = fork();
		if (pids[i] == 0) {
			close(ready[0]);
			close(go[1]);
			rt_child(cfg, sys, i, &slots[i], ready[1], go[0], dur_ns);
		}
		if (pids[i] < 0) {
			snprintf(err, errlen, "fork: %s", strerror(errno));
			failed = 1;
			break;
		}
	}
	close(ready[1]);
	close(go[0]);
	/* Every child says 'r' once it is connected and warm; a child that
	 * dies first just closes its end. */
	while (!failed && got < clients) {
		struct pollfd p = {.fd = ready[0], .events = POLLIN};
		char buf[64];
		int n = poll(&p, 1, READY_TIMEOUT_MS);
		if (n <= 0) {
			snprintf(err, errlen, "clients not ready after %d s",
				 READY_TIMEOUT_MS / 1000);
			failed = 1;
			break;
		}
		ssize_t r = read(ready[0], buf, sizeof(buf));
		if (r <= 0) {
			snprintf(err, errlen, "a client failed before it was ready");
			failed = 1;
			break;
		}
		got += (int)r;
	}
	if (cpu_pid > 0 && !failed)
		cpu0 = cpu_ns(cpu_pid);
	close(go[1]); /* go (or, after a failure, give up) */
	for (int i = 0; i < clients && pids[i] > 0; i++) {
		int st;

		if (failed)
			kill(pids[i], SIGKILL);
		while (waitpid(pids[i], &st, 0) < 0 && errno == EINTR)
			;
		if (!failed && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
			snprintf(err, errlen, "client %d %s %d", i,
				 WIFEXITED(st) ? "exited with" : "died of signal",
				 WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
			failed = 1;
		}
	}
	close(ready[0]);
	if (cpu0 >= 0)
		cpu1 = cpu_ns(cpu_pid);
	if (!failed) {
		double tput = 0;

		for (int i = 0; i < clients; i++) {
			hist_merge(all, &slots[i].h);
			out->ops += slots[i].ops;
			if (slots[i].elapsed_ns)
				tput += (double)slots[i].ops * 1e9 / (double)slots[i].elapsed_ns;
		}
		out->p50_us = hist_quantile(all, 0.50) / 1e3;
		out->p99_us = hist_quantile(all, 0.99) / 1e3;
		out->ops_per_s = tput;
		if (cpu1 >= cpu0 && cpu0 >= 0 && out->ops)
			out->cpu_us = (double)(cpu1 - cpu0) / 1e3 / (double)out->ops;
		rc = 0;
	}
	goto err_mem;

err_ready:
	close(ready[0]);
	close(ready[1]);
err_mem:
	free(all);
	free(pids);
	munmap(slots, bytes);
	return rc;
}

/* ---- the scenario ---------------------------------------------------------------- */

/* The median over repetitions of a[r] / b[r]; NAN when no pair has both. */
static double paired_ratio(const double *a, const double *b, int n)
{
	double *q = calloc((size_t)n, sizeof(double));
	double m;

	if (!q)
		return NAN;
	for (int r = 0; r < n; r++)
		q[r] = isnan(a[r]) || isnan(b[r]) || b[r] == 0 ? NAN : a[r] / b[r];
	m = median(q, n);
	free(q);
	return m;
}

static const char *sys_name[] = {"bufbroker", "echo", "redis", "journal", "no-journal"};
#define RT_SYSTEMS 5

/* Whether system s runs at client count c: Redis when it is there; the
 * journal-on daemon and its twin at 1 and 16 clients, where its targets
 * are. */
static int rt_runs(const bench_opts *o, int s, int c)
{
	int jc = o->rt.journal_socket && (o->counts[c] == 1 || o->counts[c] == 16);

	if (s == RT_REDIS)
		return rt_have_redis() && o->rt.redis_socket;
	if (s == RT_JOURNAL)
		return jc;
	if (s == RT_NOJOURNAL)
		return jc && o->rt.twin_socket;
	return 1;
}

/* What the journal-on daemon is paired with: its twin, else the first. */
static rt_system journal_base(const bench_opts *o)
{
	return o->rt.twin_socket ? RT_NOJOURNAL : RT_BUFBROKER;
}

void scenario_roundtrip(const bench_opts *o)
{
	int n = o->ncounts * RT_SYSTEMS * o->reps;
	double *p50 = calloc((size_t)n, sizeof(double));
	double *p99 = calloc((size_t)n, sizeof(double));
	double *tput = calloc((size_t)n, sizeof(double));
	double *cpu = calloc((size_t)n, sizeof(double));
	char errs[RT_SYSTEMS][8][200] = {{{0}}};
	char err[200];

	if (!p50 || !p99 || !tput || !cpu) {
		fprintf(stderr, "bufbroker-bench: out of memory\n");
		exit(1);
	}
#define AT(s, c, r) (((s)*o->ncounts + (c)) * o->reps + (r))
	/* Interleaved: each repetition visits every count and every system, so
	 * drift on a shared machine touches all of them alike. Every other
	 * repetition visits the systems in the reverse order, so that no
	 * system is always the one measured first (or right after another):
	 * the journal-on daemon and its twin run back to back, each first in
	 * half the repetitions. */
	for (int r = 0; r < o->reps; r++) {
		for (int c = 0; c < o->ncounts; c++) {
			for (int i = 0; i < RT_SYSTEMS; i++) {
				int s = r % 2 ? RT_SYSTEMS - 1 - i : i;
				rt_figures f;

				if (!rt_runs(o, s, c))
					continue;
				fprintf(stderr, "  round trip: rep %d/%d, %2d clients, %s\n", r + 1,
					o->reps, o->counts[c], sys_name[s]);
				if (rt_run(&o->rt, (rt_system)s, o->counts[c], o->dur_ns, &f, err,
					   sizeof(err)) == 0) {
					p50[AT(s, c, r)] = f.p50_us;
					p99[AT(s, c, r)] = f.p99_us;
					tput[AT(s, c, r)] = f.ops_per_s;
					cpu[AT(s, c, r)] = f.cpu_us;
				} else {
					fprintf(stderr, "  round trip %s: %s\n", sys_name[s], err);
					snprintf(errs[s][c], sizeof(errs[s][c]), "%s", err);
					p50[AT(s, c, r)] = p99[AT(s, c, r)] = tput[AT(s, c, r)] =
						cpu[AT(s, c, r)] = NAN;
				}
			}
		}
	}
	for (int c = 0; c < o->ncounts; c++) {
		for (int s = 0; s < RT_SYSTEMS; s++) {
			char name[64], label[64];

			if ((s == RT_JOURNAL || s == RT_NOJOURNAL) && !rt_runs(o, s, c))
				continue; /* no row: it is not measured at this count */
			snprintf(name, sizeof(name), "roundtrip.%s.c%d", sys_name[s], o->counts[c]);
			snprintf(label, sizeof(label), "%s", sys_name[s]);
			result *res = result_new(name, "roundtrip", sys_name[s], label);
			res->clients = o->counts[c];
			res->reps = o->reps;
			if (!rt_runs(o, s, c)) {
				res->skipped = 1;
				result_note(res, "%s",
					    rt_have_redis() ? "no redis-server socket given"
							    : "built without hiredis");
				continue;
			}
			/* Ratios first (median sorts in place): each repetition
			 * ran the systems back to back, so a burst of load on a
			 * shared machine hits both sides of a pair alike; the
			 * median of the pairs' ratios resists it better than the
			 * ratio of medians. */
			if (s != RT_ECHO) {
				res->r_p50_echo = paired_ratio(&p50[AT(s, c, 0)],
							       &p50[AT(RT_ECHO, c, 0)], o->reps);
				res->r_ops_echo = paired_ratio(&tput[AT(s, c, 0)],
							       &tput[AT(RT_ECHO, c, 0)], o->reps);
			}
			if (s == RT_BUFBROKER && rt_runs(o, RT_REDIS, c))
				res->r_ops_redis = paired_ratio(&tput[AT(s, c, 0)],
								&tput[AT(RT_REDIS, c, 0)], o->reps);
			/* Journal on over off, ops/s, paired the same way. */
			if (s == RT_JOURNAL)
				res->r_base =
					paired_ratio(&tput[AT(s, c, 0)],
						     &tput[AT(journal_base(o), c, 0)], o->reps);
			/* And the daemon's CPU time per op, where it was read. */
			if (s == RT_JOURNAL && o->rt.cpu_pid[RT_JOURNAL] > 0)
				res->r_cpu = paired_ratio(&cpu[AT(s, c, 0)],
							  &cpu[AT(RT_NOJOURNAL, c, 0)], o->reps);
			if (o->rt.cpu_pid[s] > 0) {
				snprintf(res->extra_name, sizeof(res->extra_name),
					 "daemon_cpu_us_per_op");
				res->extra = median(&cpu[AT(s, c, 0)], o->reps);
			}
		}
	}
	for (int c = 0; c < o->ncounts; c++) {
		for (int s = 0; s < RT_SYSTEMS; s++) {
			char name[64];

			if (!rt_runs(o, s, c))
				continue;
			snprintf(name, sizeof(name), "roundtrip.%s.c%d", sys_name[s], o->counts[c]);
			result *res = result_find(name);
			res->p50_us = median(&p50[AT(s, c, 0)], o->reps);
			res->p99_us = median(&p99[AT(s, c, 0)], o->reps);
			res->ops_per_s = median(&tput[AT(s, c, 0)], o->reps);
			if (isnan(res->p50_us)) {
				res->skipped = 1;
				result_note(res, "failed: %s", errs[s][c]);
			} else if (errs[s][c][0]) {
				result_note(res, "some repetitions failed: %s", errs[s][c]);
			}
		}
	}
#undef AT
	free(p50);
	free(p99);
	free(tput);
	free(cpu);
}

/* ---- the echo server -------------------------------------------------------------- */

static volatile sig_atomic_t echo_stop;

static void echo_on_signal(int sig)
{
	(void)sig;
	echo_stop = 1;
}

int echo_server_main(const char *path)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	struct sigaction sa = {.sa_handler = echo_on_signal};
	static unsigned char in[65536], out[65536];
	struct epoll_event evs[128];
	int ls, ep;

	if (strlen(path) >= sizeof(a.sun_path)) {
		fprintf(stderr, "echo-server: socket path too long\n");
		return 2;
	}
	strcpy(a.sun_path, path);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	memset(out, 0xa5, sizeof(out));
	unlink(path);
	ls = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(ls, 1024) < 0) {
		fprintf(stderr, "echo-server: %s: %s\n", path, strerror(errno));
		return 1;
	}
	ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event lev = {.events = EPOLLIN, .data.fd = ls};
	if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, ls, &lev) < 0) {
		fprintf(stderr, "echo-server: epoll: %s\n", strerror(errno));
		return 1;
	}
	while (!echo_stop) {
		int n = epoll_wait(ep, evs, 128, -1);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			fprintf(stderr, "echo-server: epoll_wait: %s\n", strerror(errno));
			break;
		}
		for (int i = 0; i < n; i++) {
			int fd = evs[i].data.fd;

			if (fd == ls) {
				int c;
				while ((c = accept4(ls, NULL, NULL,
						    SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
					struct epoll_event ev = {.events = EPOLLIN, .data.fd = c};
					if (epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev) < 0)
						close(c);
				}
				continue;
			}
			/* One recv and one send per request: the floor the daemon
			 * is measured against. */
			int afd, trunc;
			ssize_t len = msgio_recv(fd, in, sizeof(in), &afd, &trunc);
			if (len == -EAGAIN)
				continue;
			if (afd >= 0)
				close(afd);
			if (len <= 0) {
				close(fd); /* also leaves the epoll set */
				continue;
			}
			size_t rlen = (size_t)len;
			if (len >= 2)
				rlen = (size_t)in[0] | (size_t)in[1] << 8;
			if (rlen == 0 || rlen > sizeof(out))
				rlen = (size_t)len;
			if (msgio_send(fd, len >= 2 ? out : in, rlen, -1) < 0)
				close(fd);
		}
	}
	close(ep);
	close(ls);
	unlink(path);
	return 0;
}
