/*
 * Scale: the round trip with many live buffers in the daemon, and the
 * daemon's resident memory per live buffer.
 *
 * Filler processes hold the buffers: each allocates through the raw
 * request path (bbc_call with an Alloc, the memfd closed at once), so the
 * daemon counts one reference per buffer while the filler keeps no handle
 * and no fd. They hold them until the scenario ends; their disconnect
 * releases everything.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "client_internal.h"

#define FILLERS 4
#define SCALE_BUF_BYTES 4096
/* Descriptors the daemon needs besides one per buffer (listeners, clients). */
#define FD_HEADROOM 512

struct filler {
	pid_t pid;
	int cmd; /* parent -> filler: how many more to allocate (uint64) */
	int ack; /* filler -> parent: 'k' done, 'e' failed */
};

/* One field of /proc/PID/status or /proc/meminfo, in kB; -1 if absent. */
static long proc_kb(const char *path, const char *field)
{
	char line[256];
	size_t len = strlen(field);
	long v = -1;
	FILE *f = fopen(path, "r");

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, field, len) && line[len] == ':') {
			v = strtol(line + len + 1, NULL, 10);
			break;
		}
	fclose(f);
	return v;
}

static long daemon_rss_kb(int pid)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/status", pid);
	return proc_kb(path, "VmRSS");
}

/* The daemon's soft limit on open files, or -1. */
static long daemon_nofile(int pid)
{
	char path[64], line[256];
	long v = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/limits", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "Max open files", 14)) {
			char *p = line + 14;
			while (*p == ' ')
				p++;
			v = strncmp(p, "unlimited", 9) ? strtol(p, NULL, 10) : -1;
			break;
		}
	fclose(f);
	return v;
}

static int raw_alloc(bb_client *c, char *err, size_t errlen)
{
	Bufbroker__Alloc al = BUFBROKER__ALLOC__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	int rc;

	al.size = SCALE_BUF_BYTES;
	al.kind = BUFBROKER__KIND__KIND_HOST;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &al;
	rc = bbc_call(c, &req, -1, &r, NULL); /* the memfd is closed for us */
	if (rc) {
		snprintf(err, errlen, "%s", bb_last_error());
		return rc;
	}
	if (!r->status || r->status->code) {
		rc = r->status ? r->status->code : BB_ERR_PROTOCOL;
		snprintf(err, errlen, "%s", r->status ? r->status->message : "no status");
	}
	bbc_response_free(r);
	return rc;
}

__attribute__((noreturn)) static void filler_main(const char *path, int cmd, int ack)
{
	bb_client *c;
	uint64_t n;
	char err[256];

	bench_pin_client(-1);
	if (bb_connect(path, &c))
		child_die("filler: bb_connect: %s", bb_last_error());
	for (;;) {
		ssize_t r = read(cmd, &n, sizeof(n));
		if (r < 0 && errno == EINTR)
			continue;
		if (r != (ssize_t)sizeof(n))
			break; /* the parent is done: disconnect releases all */
		char k = 'k';
		for (uint64_t i = 0; i < n; i++) {
			if (raw_alloc(c, err, sizeof(err))) {
				fprintf(stderr,
					"bufbroker-bench: filler: alloc %" PRIu64 " of %" PRIu64
					": %s\n",
					i + 1, n, err);
				k = 'e';
				break;
			}
		}
		if (write(ack, &k, 1) != 1)
			break;
	}
	bb_disconnect(c);
	_exit(0);
}

/* Bring the fillers' total from *have to want; 0 when every alloc worked. */
static int fill_to(struct filler *f, uint64_t *have, uint64_t want)
{
	uint64_t more = want - *have;
	int bad = 0;

	for (int i = 0; i < FILLERS; i++) {
		uint64_t n = more / FILLERS + ((uint64_t)i < more % FILLERS ? 1 : 0);
		if (write(f[i].cmd, &n, sizeof(n)) != (ssize_t)sizeof(n))
			bad = 1;
	}
	for (int i = 0; i < FILLERS; i++) {
		char k = 'e';
		if (read(f[i].ack, &k, 1) != 1 || k != 'k')
			bad = 1;
	}
	if (!bad)
		*have = want;
	return bad ? -1 : 0;
}

void scenario_scale(const bench_opts *o)
{
	struct filler f[FILLERS];
	uint64_t have = 0, t0;
	long rss0, slab0, nofile;
	int started = 0, broken = 0;
	char why[256] = "";

	if (o->daemon_pid <= 0 || daemon_rss_kb(o->daemon_pid) < 0) {
		for (int l = 0; l < o->nscale; l++) {
			char name[64];
			snprintf(name, sizeof(name), "scale.%" PRIu64, o->scale[l]);
			result *res = result_new(name, "scale", "bufbroker", name);
			res->skipped = 1;
			result_note(res,
				    "the daemon's pid is needed (--daemon-pid) to read its RSS");
		}
		return;
	}
	nofile = daemon_nofile(o->daemon_pid);
	rss0 = daemon_rss_kb(o->daemon_pid);
	slab0 = proc_kb("/proc/meminfo", "Slab");

	/* Fill with every CPU; rt_run places the measurements. */
	bench_set_pinned(0);
	fflush(stdout);
	fflush(stderr);
	for (int i = 0; i < FILLERS; i++) {
		int cmd[2], ack[2];
		if (pipe2(cmd, O_CLOEXEC) < 0 || pipe2(ack, O_CLOEXEC) < 0) {
			snprintf(why, sizeof(why), "pipe: %s", strerror(errno));
			broken = 1;
			break;
		}
		f[i].pid = fork();
		if (f[i].pid == 0) {
			close(cmd[1]);
			close(ack[0]);
			for (int j = 0; j < i; j++) {
				close(f[j].cmd);
				close(f[j].ack);
			}
			filler_main(o->rt.bb_socket, cmd[0], ack[1]);
		}
		close(cmd[0]);
		close(ack[1]);
		f[i].cmd = cmd[1];
		f[i].ack = ack[0];
		started++;
		if (f[i].pid < 0) {
			snprintf(why, sizeof(why), "fork: %s", strerror(errno));
			broken = 1;
			break;
		}
	}

	for (int l = 0; l < o->nscale; l++) {
		uint64_t want = o->scale[l];
		char name[64], label[64];
		char note[200] = "";

		if (nofile > 0 && want + FD_HEADROOM > (uint64_t)nofile) {
			/* One memfd per live host buffer: the daemon's open-file
			 * limit caps the level (run.sh raises it when root). */
			uint64_t cap =
				(uint64_t)nofile > FD_HEADROOM ? (uint64_t)nofile - FD_HEADROOM : 0;
			snprintf(note, sizeof(note),
				 "asked for %" PRIu64
				 "; the daemon's open-file limit (%ld) allows %" PRIu64,
				 want, nofile, cap);
			want = cap;
		}
		if (want < have)
			want = have;
		if (l > 0 && want == have) {
			/* Capped to the level just measured: nothing new to see. */
			result *prev = result_at(result_count() - 1);
			if (prev && !strcmp(prev->group, "scale") && prev->param == want)
				result_note(prev,
					    "asked for up to %" PRIu64
					    "; the daemon's open-file limit "
					    "(%ld) allows %" PRIu64,
					    o->scale[l], nofile, want);
			continue;
		}
		snprintf(name, sizeof(name), "scale.%" PRIu64, want);
		snprintf(label, sizeof(label), "%" PRIu64 " live buffers", want);
		result *res = result_new(name, "scale", "bufbroker", label);
		res->param = want;
		res->clients = 16;
		result_note(res, "%s", note);
		if (broken) {
			res->skipped = 1;
			result_note(res, "%s", why);
			continue;
		}
		fprintf(stderr, "  scale: filling to %" PRIu64 " live buffers\n", want);
		t0 = bench_now_ns();
		if (fill_to(f, &have, want)) {
			broken = 1;
			res->skipped = 1;
			snprintf(why, sizeof(why),
				 "could not fill to %" PRIu64 " buffers (raise the daemon's "
				 "--uid-buffers / open-file limit?)",
				 want);
			result_note(res, "%s", why);
			continue;
		}
		fprintf(stderr, "  scale: %" PRIu64 " live buffers (filled in %.1f s)\n", want,
			(double)(bench_now_ns() - t0) / 1e9);
		usleep(200000);
		long rss = daemon_rss_kb(o->daemon_pid);
		long slab = proc_kb("/proc/meminfo", "Slab");
		if (rss >= 0 && rss0 >= 0 && want)
			res->rss_per_buf = (double)(rss - rss0) * 1024.0 / (double)want;
		if (slab >= 0 && slab0 >= 0 && want) {
			res->extra = (double)(slab - slab0) * 1024.0 / (double)want;
			snprintf(res->extra_name, sizeof(res->extra_name), "kernel_slab_per_buf");
		}

		double p50[64], p99[64], tput[64];
		/* At most 3 repetitions per level: the levels are compared with
		 * each other, and a full run has to stay within five minutes. */
		int reps = o->reps < 3 ? o->reps : 3;
		char err[200];
		for (int r = 0; r < reps; r++) {
			rt_figures fig;

			fprintf(stderr, "  scale: rep %d/%d at %" PRIu64 " live buffers\n", r + 1,
				reps, want);
			p50[r] = p99[r] = tput[r] = NAN;
			if (rt_run(&o->rt, RT_BUFBROKER, 1, o->dur_ns, &fig, err, sizeof(err)) ==
			    0) {
				p50[r] = fig.p50_us;
				p99[r] = fig.p99_us;
			}
			if (rt_run(&o->rt, RT_BUFBROKER, 16, o->dur_ns, &fig, err, sizeof(err)) ==
			    0)
				tput[r] = fig.ops_per_s;
		}
		res->reps = reps;
		res->p50_us = median(p50, reps);
		res->p99_us = median(p99, reps);
		res->ops_per_s = median(tput, reps);
		if (isnan(res->p50_us) || isnan(res->ops_per_s)) {
			res->skipped = 1;
			result_note(res, "round trip failed: %.170s", err);
		}
	}

	/* Closing the command pipes ends the fillers; their disconnects
	 * release every buffer. */
	for (int i = 0; i < started; i++) {
		int st;
		close(f[i].cmd);
		close(f[i].ack);
		if (f[i].pid > 0)
			while (waitpid(f[i].pid, &st, 0) < 0 && errno == EINTR)
				;
	}
}
