/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Scale: the round trip with many live buffers in the daemon, and the
 * daemon's resident memory per live buffer, in two series over the same
 * levels:
 *
 *   host: 4 KiB memfd buffers, the series the RSS target is about. The
 *         daemon keeps one memfd per buffer, so its open-file limit caps
 *         the levels (the table says so);
 *   CUDA: 256 B buffers carved from the daemon's slab pool (the smallest,
 *         BACKEND_CUDA_ALIGN), no fd each, so the levels are reached
 *         wherever a CUDA driver (or tests/fakecuda) is. Nothing writes
 *         to them: with the fake driver no device page is touched.
 *
 * Filler processes hold the buffers: each allocates through the raw
 * request path (bbc_call with an Alloc; a host buffer's memfd is closed at
 * once), so the daemon counts one reference per buffer while the filler
 * keeps no handle and no fd, only the id. They hold them until their series
 * ends, and the buffers go with the fillers' disconnects: the daemon frees
 * them in hash order (a CUDA buffer's free is O(1), see backend_cuda.c).
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
/* Descriptors the daemon needs besides one per buffer (listeners, clients)
 * when the caller does not say (--daemon-fds-kept). */
#define FD_HEADROOM 512
/* How long the daemon may take to free a series' buffers. */
#define RELEASE_TIMEOUT_NS (120 * 1000000000ull)

/* What one series fills the daemon with, and how its rows are named. */
typedef struct series {
	const char *group; /* result group and the rows' name prefix */
	const char *noun;  /* "live buffers" in labels */
	int kind;          /* BB_HOST or BB_CUDA */
	uint64_t bytes;    /* of every buffer */
	const char *raise; /* the daemon's limits to raise when a fill fails */
} series;

static const series host_series = {
	.group = "scale",
	.noun = "live buffers",
	.kind = BB_HOST,
	.bytes = 4096,
	.raise = "--uid-buffers / open-file limit",
};
/* 256 B: the slab pool's granule, so a million take 256 MiB of slabs. */
static const series cuda_series = {
	.group = "scale_cuda",
	.noun = "live CUDA buffers",
	.kind = BB_CUDA,
	.bytes = 256,
	.raise = "--uid-buffers / --uid-cuda-bytes / --cuda-device-bytes",
};

/* The same as VMM CUDA buffers, on a daemon whose default handle is VMM:
 * the daemon's memory per buffer, against the legacy series. */
static const series vmm_series = {
	.group = "scale_vmm",
	.noun = "live VMM CUDA buffers",
	.kind = BB_CUDA,
	.bytes = 256,
	.raise = "--uid-buffers / --uid-cuda-bytes / --cuda-device-bytes",
};

struct filler {
	pid_t pid;
	int cmd; /* parent -> filler: how many more to allocate (uint64) */
	int ack; /* filler -> parent: a struct ack per command */
};

/* A filler's answer to one command: one write, below PIPE_BUF. */
struct ack {
	int code;      /* 0, or the first failed Alloc's BB_ERR_* */
	char msg[200]; /* its message */
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

long bench_daemon_nofile(int pid)
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

/* One raw Alloc of s's kind and size. A CUDA Alloc may wait in the daemon
 * for a slab to grow (off its loop thread): bbc_call waits for the answer
 * with the request's id, however late it comes. */
int bench_raw_alloc(bb_client *c, int kind, uint64_t bytes, uint64_t *id, char *err, size_t errlen)
{
	Bufbroker__Alloc al = BUFBROKER__ALLOC__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	int rc;

	al.size = bytes;
	al.kind = kind == BB_CUDA ? BUFBROKER__KIND__KIND_CUDA : BUFBROKER__KIND__KIND_HOST;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &al;
	rc = bbc_call(c, &req, -1, &r, NULL); /* a memfd is closed for us */
	if (rc) {
		snprintf(err, errlen, "%s", bb_last_error());
		return rc;
	}
	if (!r->status || r->status->code) {
		rc = r->status ? r->status->code : BB_ERR_PROTOCOL;
		snprintf(err, errlen, "%s", r->status ? r->status->message : "no status");
	} else if (r->result_case != BUFBROKER__RESPONSE__RESULT_GRANT || !r->grant->info) {
		rc = BB_ERR_PROTOCOL;
		snprintf(err, errlen, "an Alloc answered without a Grant");
	} else {
		*id = r->grant->info->id;
	}
	bbc_response_free(r);
	return rc;
}

/* The daemon's live buffers of one kind and, for CUDA, why it serves
 * none ("" when it does). 0, or -1 with why set. */
static int daemon_status(const char *path, int kind, uint64_t *buffers, char *why, size_t whylen)
{
	Bufbroker__ServerStatus st = BUFBROKER__SERVER_STATUS__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r = NULL;
	bb_client *c;
	int rc = -1;

	if (bb_connect(path, &c)) {
		snprintf(why, whylen, "bb_connect: %s", bb_last_error());
		return -1;
	}
	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &st;
	if (bbc_call(c, &req, -1, &r, NULL)) {
		snprintf(why, whylen, "ServerStatus: %s", bb_last_error());
	} else if (!r->status || r->status->code ||
		   r->result_case != BUFBROKER__RESPONSE__RESULT_SERVER_STATUS) {
		snprintf(why, whylen, "ServerStatus: %s",
			 r->status && r->status->message[0] ? r->status->message
							    : "unexpected answer");
	} else {
		const Bufbroker__ServerStatusReply *ss = r->server_status;
		*buffers = 0;
		for (size_t i = 0; i < ss->n_kinds; i++)
			if ((int)ss->kinds[i]->kind == kind)
				*buffers = ss->kinds[i]->buffers;
		snprintf(why, whylen, "%s",
			 kind != BB_CUDA ? ""
			 : ss->cuda[0]   ? ss->cuda
			 : ss->n_devices ? ""
					 : "no CUDA device");
		rc = 0;
	}
	bbc_response_free(r);
	bb_disconnect(c);
	return rc;
}

__attribute__((noreturn)) static void filler_main(const char *path, const series *s, int cmd,
						  int ack)
{
	bb_client *c;
	uint64_t n, id;

	bench_pin_client(-1);
	if (bb_connect(path, &c))
		child_die("filler: bb_connect: %s", bb_last_error());
	for (;;) {
		ssize_t r = read(cmd, &n, sizeof(n));
		if (r < 0 && errno == EINTR)
			continue;
		if (r != (ssize_t)sizeof(n))
			break; /* the parent is done: disconnect releases the rest */
		struct ack a = {0};
		for (uint64_t i = 0; i < n; i++) {
			char err[sizeof(a.msg)];
			a.code = bench_raw_alloc(c, s->kind, s->bytes, &id, err, sizeof(err));
			if (a.code) {
				snprintf(a.msg, sizeof(a.msg),
					 "alloc %" PRIu64 " of %" PRIu64 ": %.140s", i + 1, n, err);
				break;
			}
		}
		if (write(ack, &a, sizeof(a)) != (ssize_t)sizeof(a))
			break;
	}
	bb_disconnect(c);
	_exit(0);
}

/* Start the fillers; how many started (all FILLERS, or why is set). */
static int fillers_start(struct filler *f, const char *path, const series *s, char *why,
			 size_t whylen)
{
	int started = 0;

	fflush(stdout);
	fflush(stderr);
	for (int i = 0; i < FILLERS; i++) {
		int cmd[2], ack[2];
		if (pipe2(cmd, O_CLOEXEC) < 0) {
			snprintf(why, whylen, "pipe: %s", strerror(errno));
			break;
		}
		if (pipe2(ack, O_CLOEXEC) < 0) {
			snprintf(why, whylen, "pipe: %s", strerror(errno));
			close(cmd[0]);
			close(cmd[1]);
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
			filler_main(path, s, cmd[0], ack[1]);
		}
		close(cmd[0]);
		close(ack[1]);
		f[i].cmd = cmd[1];
		f[i].ack = ack[0];
		started++;
		if (f[i].pid < 0) {
			snprintf(why, whylen, "fork: %s", strerror(errno));
			break;
		}
	}
	return started;
}

/* Closing the command pipes ends the fillers; their disconnects release
 * every buffer they hold. */
static void fillers_stop(struct filler *f, int started)
{
	for (int i = 0; i < started; i++) {
		int st;
		close(f[i].cmd);
		close(f[i].ack);
		if (f[i].pid > 0)
			while (waitpid(f[i].pid, &st, 0) < 0 && errno == EINTR)
				;
	}
}

/* Bring the fillers' total from *have to want, all at once: each filler
 * its share, then every answer. 0 when all went well, else the first
 * failure's code with its message in err. */
static int fill_to(struct filler *f, uint64_t *have, uint64_t want, char *err, size_t errlen)
{
	uint64_t more = want - *have;
	int rc = 0;

	for (int i = 0; i < FILLERS; i++) {
		uint64_t n = more / FILLERS + ((uint64_t)i < more % FILLERS ? 1 : 0);
		if (write(f[i].cmd, &n, sizeof(n)) != (ssize_t)sizeof(n) && !rc) {
			rc = BB_ERR_DISCONNECTED;
			snprintf(err, errlen, "a filler process is gone: %s", strerror(errno));
		}
	}
	for (int i = 0; i < FILLERS; i++) {
		struct ack a;
		if (read(f[i].ack, &a, sizeof(a)) != (ssize_t)sizeof(a)) {
			if (!rc)
				snprintf(err, errlen, "a filler process died");
			rc = rc ? rc : BB_ERR_DISCONNECTED;
		} else if (a.code && !rc) {
			rc = a.code;
			a.msg[sizeof(a.msg) - 1] = 0;
			snprintf(err, errlen, "%s", a.msg);
		}
	}
	if (!rc)
		*have = want;
	return rc;
}

/* Wait until the daemon holds at most `base` buffers of s's kind: the
 * fillers and round-trip clients that went have been released. */
static void wait_released(const bench_opts *o, const series *s, uint64_t base)
{
	uint64_t t0 = bench_now_ns(), n = 0;
	char why[256];

	while (daemon_status(o->rt.bb_socket, s->kind, &n, why, sizeof(why)) == 0 && n > base &&
	       bench_now_ns() - t0 < RELEASE_TIMEOUT_NS)
		usleep(20000);
	fprintf(stderr, "  %s: the daemon released them in %.1f s (%" PRIu64 " left)\n", s->group,
		(double)(bench_now_ns() - t0) / 1e9, n);
}

/* One row per level, all skipped for `why`. */
static void series_skip(const bench_opts *o, const series *s, const char *why)
{
	for (int l = 0; l < o->nscale; l++) {
		char name[64], label[64];
		snprintf(name, sizeof(name), "%s.%" PRIu64, s->group, o->scale[l]);
		snprintf(label, sizeof(label), "%" PRIu64 " %s", o->scale[l], s->noun);
		result *res = result_new(name, s->group, "bufbroker", label);
		res->param = o->scale[l];
		res->skipped = 1;
		result_note(res, "%.190s", why);
	}
}

/* The single-client round trip and the 16-client throughput into res, at
 * most 3 repetitions: the levels are compared with each other, and a full
 * run has to stay within five minutes. */
static void level_measure(const bench_opts *o, const series *s, result *res)
{
	double p50[64], p99[64], tput[64];
	int reps = o->reps < 3 ? o->reps : 3;
	char err[200] = "";

	for (int r = 0; r < reps; r++) {
		rt_figures fig;

		fprintf(stderr, "  %s: rep %d/%d at %" PRIu64 " %s\n", s->group, r + 1, reps,
			res->param, s->noun);
		p50[r] = p99[r] = tput[r] = NAN;
		if (rt_run(&o->rt, RT_BUFBROKER, 1, o->dur_ns, &fig, err, sizeof(err)) == 0) {
			p50[r] = fig.p50_us;
			p99[r] = fig.p99_us;
		}
		if (rt_run(&o->rt, RT_BUFBROKER, 16, o->dur_ns, &fig, err, sizeof(err)) == 0)
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

/* Run series s; *kept_kb: how much the daemon's RSS stayed above where
 * it started once it freed the series (-1: unknown). The previous series
 * left prev_kb such kB in the daemon: freed heap that this series' buffers
 * may reuse, so its RSS growth may read low. */
static void series_run(const bench_opts *o, const series *s, long prev_kb, long *kept_kb)
{
	struct filler f[FILLERS];
	uint64_t have = 0, base = 0, t0;
	long rss0, slab0, nofile = -1;
	int started, broken = 0;
	char why[256] = "";

	*kept_kb = -1;
	if (s->kind == BB_CUDA && !o->cuda) {
		series_skip(o, s,
			    "skipped: no CUDA driver (set $BUFBROKER_CUDA_LIBRARY or build "
			    "tests/fakecuda)");
		return;
	}
	if (o->daemon_pid <= 0 || daemon_rss_kb(o->daemon_pid) < 0) {
		series_skip(o, s, "the daemon's pid is needed (--daemon-pid) to read its RSS");
		return;
	}
	if (daemon_status(o->rt.bb_socket, s->kind, &base, why, sizeof(why)) || why[0]) {
		char note[300];
		snprintf(note, sizeof(note), "skipped: %s%s",
			 s->kind == BB_CUDA ? "the daemon serves no CUDA: " : "", why);
		series_skip(o, s, note);
		return;
	}
	if (s->kind == BB_HOST)
		nofile = bench_daemon_nofile(o->daemon_pid);
	rss0 = daemon_rss_kb(o->daemon_pid);
	slab0 = proc_kb("/proc/meminfo", "Slab");

	/* Fill with every CPU; rt_run places the measurements. */
	bench_set_pinned(0);
	started = fillers_start(f, o->rt.bb_socket, s, why, sizeof(why));
	broken = started < FILLERS;

	uint64_t headroom = o->daemon_fds_kept ? o->daemon_fds_kept : FD_HEADROOM;
	for (int l = 0; l < o->nscale; l++) {
		uint64_t want = o->scale[l];
		char name[64], label[64];
		char note[200] = "";

		if (nofile > 0 && want + headroom > (uint64_t)nofile) {
			/* One memfd per live host buffer: the daemon's open-file
			 * limit caps the level (run.sh raises it when root). */
			uint64_t cap =
				(uint64_t)nofile > headroom ? (uint64_t)nofile - headroom : 0;
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
			if (prev && !strcmp(prev->group, s->group) && prev->param == want)
				result_note(prev,
					    "asked for up to %" PRIu64
					    "; the daemon's open-file limit "
					    "(%ld) allows %" PRIu64,
					    o->scale[l], nofile, want);
			continue;
		}
		snprintf(name, sizeof(name), "%s.%" PRIu64, s->group, want);
		snprintf(label, sizeof(label), "%" PRIu64 " %s", want, s->noun);
		result *res = result_new(name, s->group, "bufbroker", label);
		res->param = want;
		res->clients = 16;
		result_note(res, "%s", note);
		if (broken) {
			res->skipped = 1;
			result_note(res, "%s", why);
			continue;
		}
		fprintf(stderr, "  %s: filling to %" PRIu64 " %s\n", s->group, want, s->noun);
		t0 = bench_now_ns();
		char err[200];
		int rc = fill_to(f, &have, want, err, sizeof(err));
		if (rc) {
			broken = 1;
			res->skipped = 1;
			if (rc == BB_ERR_UNSUPPORTED)
				snprintf(why, sizeof(why),
					 "skipped: the daemon serves no %s: %.150s",
					 s->kind == BB_CUDA ? "CUDA" : "host buffers", err);
			else
				snprintf(why, sizeof(why),
					 "could not fill to %" PRIu64
					 ": %.100s (raise the daemon's "
					 "%s?)",
					 want, err, s->raise);
			result_note(res, "%s", why);
			continue;
		}
		fprintf(stderr, "  %s: %" PRIu64 " %s (filled in %.1f s)\n", s->group, want,
			s->noun, (double)(bench_now_ns() - t0) / 1e9);
		usleep(200000);
		long rss = daemon_rss_kb(o->daemon_pid);
		long slab = proc_kb("/proc/meminfo", "Slab");
		if (rss >= 0 && rss0 >= 0 && want)
			res->rss_per_buf = (double)(rss - rss0) * 1024.0 / (double)want;
		/* A tenth of the 256 B target per buffer: enough to matter. */
		if (prev_kb > 0 && (double)prev_kb * 1024.0 > 25.6 * (double)want)
			result_note(
				res,
				"%.60s%sthe daemon's heap kept %ld KiB the series before freed, "
				"which these buffers may reuse: RSS per buffer may read low",
				res->note, res->note[0] ? "; " : "", prev_kb);
		/* One memfd (file, inode) each is a host buffer's kernel memory;
		 * a CUDA buffer has none, and there the host series' memfds,
		 * still being freed, would show as a fall. */
		if (s->kind == BB_HOST && slab >= 0 && slab0 >= 0 && want) {
			res->extra = (double)(slab - slab0) * 1024.0 / (double)want;
			snprintf(res->extra_name, sizeof(res->extra_name), "kernel_slab_per_buf");
		}
		level_measure(o, s, res);
	}

	fillers_stop(f, started);
	if (have) {
		wait_released(o, s, base);
		long rss = daemon_rss_kb(o->daemon_pid);
		if (rss >= 0 && rss0 >= 0) {
			*kept_kb = rss > rss0 ? rss - rss0 : 0;
			fprintf(stderr,
				"  %s: daemon RSS %ld KiB before the series, %ld KiB once it "
				"freed them\n",
				s->group, rss0, rss);
		}
	}
}

void scenario_scale(const bench_opts *o)
{
	bench_opts oc = *o; /* the CUDA series' daemon */
	long kept;

	if (o->scale_cuda_socket) {
		oc.rt.bb_socket = o->scale_cuda_socket;
		oc.daemon_pid = o->scale_cuda_pid;
	}
	series_run(o, &host_series, -1, &kept);
	series_run(&oc, &cuda_series, o->scale_cuda_socket ? -1 : kept, &kept);
	if (o->scale_vmm_socket) {
		bench_opts ov = *o;
		ov.rt.bb_socket = o->scale_vmm_socket;
		ov.daemon_pid = o->scale_vmm_pid;
		series_run(&ov, &vmm_series, -1, &kept);
	} else {
		series_skip(
			o, &vmm_series,
			"skipped: no daemon for VMM buffers (--scale-vmm-socket, --scale-vmm-pid)");
	}
}
