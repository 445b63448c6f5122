/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bufbroker-bench: the command line. bench/run.sh starts the servers and
 * calls `bufbroker-bench run` with their sockets; `echo-server` is the raw
 * SOCK_SEQPACKET baseline it starts.
 */
#include <getopt.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "bufbroker/bufbroker.h"

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: bufbroker-bench run --bb-socket PATH --echo-socket PATH [OPTION]...\n"
		"       bufbroker-bench echo-server --socket PATH\n"
		"\n"
		"Measure bufbrokerd against a raw SOCK_SEQPACKET echo server and Redis in\n"
		"one run; bench/run.sh starts the servers and is the usual way in.\n"
		"\n"
		"run options:\n"
		"  --bb-socket PATH      bufbrokerd's socket\n"
		"  --echo-socket PATH    the echo server's socket\n"
		"  --redis-socket PATH   redis-server's Unix socket (Redis rows skipped without)\n"
		"  --daemon-pid PID      bufbrokerd's pid, for its RSS and open-file limit\n"
		"  --journal-socket PATH a bufbrokerd with its state journal on (--restart):\n"
		"                        the round trip at 1 and 16 clients on it, and the\n"
		"                        restart scenario (it re-executes that daemon)\n"
		"  --journal-pid PID     that daemon's pid\n"
		"  --journal-off-socket PATH\n"
		"                        its twin: a bufbrokerd started with the same\n"
		"                        options but --restart; the journal rows are paired\n"
		"                        with it (default: with the --bb-socket daemon)\n"
		"  --journal-off-pid PID its pid: with --journal-pid, the journal rows also\n"
		"                        compare the two daemons' CPU time per op\n"
		"  --daemon-fds-kept N   the open files the daemon keeps besides one per host\n"
		"                        buffer (its budget: 9 per --max-connections, its pool,\n"
		"                        spares; default 512): caps the host scale levels\n"
		"  --scale-cuda-socket PATH, --scale-cuda-pid PID\n"
		"                        a second bufbrokerd for the CUDA scale series, idle\n"
		"                        until then (default: the first)\n"
		"  --scale-vmm-socket PATH, --scale-vmm-pid PID\n"
		"                        a third one, run with --cuda-handle vmm, for the VMM\n"
		"                        CUDA scale series (default: that series is skipped)\n"
		"  --server-cpu N        pin the servers to CPU N and the client to another for\n"
		"                        single-client figures (default: nothing pinned)\n"
		"  --server-pids LIST    the servers' pids, so the bench can pin them (for one\n"
		"                        client) and free them (for several)\n"
		"  --quick               short and few repetitions (proves it works)\n"
		"  --reps N              repetitions per figure (default 11, quick 1)\n"
		"  --duration SECONDS    per repetition of a closed loop (default 0.4, quick 0.2)\n"
		"  --clients LIST        client counts (default 1,4,16,64)\n"
		"  --scale LIST          live-buffer levels of both scale series, host and\n"
		"                        CUDA (default 1000,100000,1000000; quick\n"
		"                        1000,10000,100000)\n"
		"  --zc-mib N            zero-copy size in MiB (default 256, quick 64)\n"
		"  --cuda                run the CUDA scenarios ($BUFBROKER_CUDA_LIBRARY)\n"
		"  --only LIST           scenario groups: roundtrip,local,host,zerocopy,cuda,\n"
		"                        restart,scale\n"
		"  --json FILE           write every figure as JSON\n"
		"  --plot-data DIR       write the data files bench/run.sh --plot draws\n"
		"  --commit TEXT, --command TEXT, --conditions TEXT\n"
		"                        recorded in the JSON's meta\n");
}

static int parse_list(const char *s, uint64_t *out, int max)
{
	int n = 0;
	char *end;

	while (*s && n < max) {
		unsigned long long v = strtoull(s, &end, 10);
		if (end == s || v == 0)
			return -1;
		out[n++] = v;
		s = *end == ',' ? end + 1 : end;
		if (*end && *end != ',')
			return -1;
	}
	return *s ? -1 : n;
}

static void json_escape(char *out, size_t cap, const char *s)
{
	size_t k = 0;

	for (; *s && k + 7 < cap; s++) {
		unsigned char ch = (unsigned char)*s;
		if (ch == '"' || ch == '\\') {
			out[k++] = '\\';
			out[k++] = (char)ch;
		} else if (ch < 0x20) {
			k += (size_t)snprintf(out + k, cap - k, "\\u%04x", ch);
		} else {
			out[k++] = (char)ch;
		}
	}
	out[k] = 0;
}

static void cpu_model(char *out, size_t cap)
{
	char line[512];
	FILE *f = fopen("/proc/cpuinfo", "r");

	snprintf(out, cap, "unknown");
	if (!f)
		return;
	while (fgets(line, sizeof(line), f)) {
		if (!strncmp(line, "model name", 10)) {
			char *p = strchr(line, ':');
			if (p) {
				p++;
				while (*p == ' ')
					p++;
				p[strcspn(p, "\n")] = 0;
				snprintf(out, cap, "%s", p);
			}
			break;
		}
	}
	fclose(f);
}

/* Client CPUs: every CPU this process may use but the server's. */
static void placement_init(int server_cpu)
{
	cpu_set_t set;

	bench_place.server_cpu = -1;
	bench_place.ncpus = 0;
	if (server_cpu < 0 || sched_getaffinity(0, sizeof(set), &set) < 0)
		return;
	for (int c = 0; c < CPU_SETSIZE && bench_place.ncpus < 256; c++)
		if (CPU_ISSET(c, &set) && c != server_cpu)
			bench_place.cpus[bench_place.ncpus++] = c;
	if (bench_place.ncpus == 0)
		return; /* one CPU: nothing to separate */
	bench_place.server_cpu = server_cpu;
	bench_set_pinned(1);
}

static int parse_pids(const char *s)
{
	uint64_t v[8];
	int n = parse_list(s, v, 8);

	for (int i = 0; i < n; i++)
		bench_place.server_pids[i] = (int)v[i];
	bench_place.nservers = n > 0 ? n : 0;
	return n;
}

enum {
	OPT_BB = 256,
	OPT_ECHO,
	OPT_REDIS,
	OPT_PID,
	OPT_DAEMON_FDS_KEPT,
	OPT_SCALE_CUDA_SOCKET,
	OPT_SCALE_CUDA_PID,
	OPT_SCALE_VMM_SOCKET,
	OPT_SCALE_VMM_PID,
	OPT_SERVER_CPU,
	OPT_SERVER_PIDS,
	OPT_QUICK,
	OPT_REPS,
	OPT_DURATION,
	OPT_CLIENTS,
	OPT_SCALE,
	OPT_ZC,
	OPT_CUDA,
	OPT_ONLY,
	OPT_JSON,
	OPT_PLOT,
	OPT_COMMIT,
	OPT_COMMAND,
	OPT_CONDITIONS,
	OPT_SOCKET,
	OPT_JOURNAL_SOCKET,
	OPT_JOURNAL_PID,
	OPT_JOURNAL_OFF_SOCKET,
	OPT_JOURNAL_OFF_PID,
	OPT_HELP,
};

static const struct option options[] = {
	{"bb-socket", required_argument, NULL, OPT_BB},
	{"echo-socket", required_argument, NULL, OPT_ECHO},
	{"redis-socket", required_argument, NULL, OPT_REDIS},
	{"daemon-pid", required_argument, NULL, OPT_PID},
	{"daemon-fds-kept", required_argument, NULL, OPT_DAEMON_FDS_KEPT},
	{"scale-cuda-socket", required_argument, NULL, OPT_SCALE_CUDA_SOCKET},
	{"scale-cuda-pid", required_argument, NULL, OPT_SCALE_CUDA_PID},
	{"scale-vmm-socket", required_argument, NULL, OPT_SCALE_VMM_SOCKET},
	{"scale-vmm-pid", required_argument, NULL, OPT_SCALE_VMM_PID},
	{"server-cpu", required_argument, NULL, OPT_SERVER_CPU},
	{"server-pids", required_argument, NULL, OPT_SERVER_PIDS},
	{"quick", no_argument, NULL, OPT_QUICK},
	{"reps", required_argument, NULL, OPT_REPS},
	{"duration", required_argument, NULL, OPT_DURATION},
	{"clients", required_argument, NULL, OPT_CLIENTS},
	{"scale", required_argument, NULL, OPT_SCALE},
	{"zc-mib", required_argument, NULL, OPT_ZC},
	{"cuda", no_argument, NULL, OPT_CUDA},
	{"only", required_argument, NULL, OPT_ONLY},
	{"json", required_argument, NULL, OPT_JSON},
	{"plot-data", required_argument, NULL, OPT_PLOT},
	{"commit", required_argument, NULL, OPT_COMMIT},
	{"command", required_argument, NULL, OPT_COMMAND},
	{"conditions", required_argument, NULL, OPT_CONDITIONS},
	{"socket", required_argument, NULL, OPT_SOCKET},
	{"journal-socket", required_argument, NULL, OPT_JOURNAL_SOCKET},
	{"journal-pid", required_argument, NULL, OPT_JOURNAL_PID},
	{"journal-off-socket", required_argument, NULL, OPT_JOURNAL_OFF_SOCKET},
	{"journal-off-pid", required_argument, NULL, OPT_JOURNAL_OFF_PID},
	{"help", no_argument, NULL, OPT_HELP},
	{NULL, 0, NULL, 0},
};

/* Seconds one scenario may take before the run gives up on it. */
#define WATCHDOG_S 600

static const char *volatile watchdog_scenario = "";

static void on_watchdog(int sig)
{
	static const char msg[] = "bufbroker-bench: a scenario did not finish within 600 s "
				  "(a server stopped answering?): ";
	(void)sig;
	(void)!write(2, msg, sizeof(msg) - 1);
	(void)!write(2, watchdog_scenario, strlen(watchdog_scenario));
	(void)!write(2, "\n", 1);
	_exit(1);
}

static int bad(const char *what)
{
	fprintf(stderr, "bufbroker-bench: %s\nTry 'bufbroker-bench --help'.\n", what);
	return 2;
}

static int wants(const char *only, const char *group)
{
	if (!only)
		return 1;
	size_t n = strlen(group);
	for (const char *p = only; (p = strstr(p, group)); p += n)
		if ((p == only || p[-1] == ',') && (p[n] == 0 || p[n] == ','))
			return 1;
	return 0;
}

int main(int argc, char **argv)
{
	bench_opts o = {0};
	const char *cmd = argc > 1 ? argv[1] : "help";
	const char *json = NULL, *plot = NULL, *only = NULL, *socket_path = NULL;
	const char *commit = "", *command = "", *conditions = "";
	uint64_t list[8];
	int reps = 0, server_cpu = -1, opt, n;
	double duration = 0;
	int have_counts = 0, have_scale = 0, have_zc = 0;
	size_t zc_mib = 256;

	if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
		usage(stdout);
		return 0;
	}
	if (strcmp(cmd, "run") && strcmp(cmd, "echo-server"))
		return bad("the command is run or echo-server");
	optind = 2;
	while ((opt = getopt_long(argc, argv, "", options, NULL)) != -1) {
		switch (opt) {
		case OPT_BB: o.rt.bb_socket = optarg; break;
		case OPT_ECHO: o.rt.echo_socket = optarg; break;
		case OPT_REDIS: o.rt.redis_socket = optarg; break;
		case OPT_PID: o.daemon_pid = atoi(optarg); break;
		case OPT_DAEMON_FDS_KEPT: o.daemon_fds_kept = strtoull(optarg, NULL, 10); break;
		case OPT_SCALE_CUDA_SOCKET: o.scale_cuda_socket = optarg; break;
		case OPT_SCALE_CUDA_PID: o.scale_cuda_pid = atoi(optarg); break;
		case OPT_SCALE_VMM_SOCKET: o.scale_vmm_socket = optarg; break;
		case OPT_SCALE_VMM_PID: o.scale_vmm_pid = atoi(optarg); break;
		case OPT_SERVER_CPU: server_cpu = atoi(optarg); break;
		case OPT_SERVER_PIDS:
			if (parse_pids(optarg) <= 0)
				return bad(
					"--server-pids: a comma-separated list of at most 8 pids");
			break;
		case OPT_QUICK: o.quick = 1; break;
		case OPT_REPS:
			reps = atoi(optarg);
			if (reps < 1 || reps > 50)
				return bad("--reps must be 1..50");
			break;
		case OPT_DURATION:
			duration = atof(optarg);
			if (!(duration > 0 && duration <= 60))
				return bad("--duration must be in (0, 60] seconds");
			break;
		case OPT_CLIENTS:
			n = parse_list(optarg, list, 8);
			if (n <= 0)
				return bad("--clients: a comma-separated list of at most 8 counts");
			for (int i = 0; i < n; i++) {
				if (list[i] > 1000)
					return bad("--clients: at most 1000 processes");
				o.counts[i] = (int)list[i];
			}
			o.ncounts = n;
			have_counts = 1;
			break;
		case OPT_SCALE:
			n = parse_list(optarg, list, 4);
			if (n <= 0)
				return bad("--scale: a comma-separated list of at most 4 levels");
			for (int i = 0; i < n; i++)
				o.scale[i] = list[i];
			o.nscale = n;
			have_scale = 1;
			break;
		case OPT_ZC:
			zc_mib = (size_t)atol(optarg);
			have_zc = 1;
			if (zc_mib < 1 || zc_mib > 65536)
				return bad("--zc-mib must be 1..65536");
			break;
		case OPT_CUDA: o.cuda = 1; break;
		case OPT_ONLY: only = optarg; break;
		case OPT_JSON: json = optarg; break;
		case OPT_PLOT: plot = optarg; break;
		case OPT_COMMIT: commit = optarg; break;
		case OPT_COMMAND: command = optarg; break;
		case OPT_CONDITIONS: conditions = optarg; break;
		case OPT_SOCKET: socket_path = optarg; break;
		case OPT_JOURNAL_SOCKET: o.rt.journal_socket = optarg; break;
		case OPT_JOURNAL_PID: o.journal_pid = atoi(optarg); break;
		case OPT_JOURNAL_OFF_SOCKET: o.rt.twin_socket = optarg; break;
		case OPT_JOURNAL_OFF_PID: o.rt.cpu_pid[RT_NOJOURNAL] = atoi(optarg); break;
		case OPT_HELP: usage(stdout); return 0;
		default: return bad("unknown option");
		}
	}
	if (optind < argc)
		return bad("unexpected argument");
	if (!strcmp(cmd, "echo-server")) {
		if (!socket_path)
			return bad("echo-server needs --socket PATH");
		return echo_server_main(socket_path);
	}
	if (!o.rt.bb_socket || !o.rt.echo_socket)
		return bad("run needs --bb-socket and --echo-socket");
	if (!o.scale_cuda_socket != !o.scale_cuda_pid)
		return bad("--scale-cuda-socket and --scale-cuda-pid go together");
	if (!o.scale_vmm_socket != !o.scale_vmm_pid)
		return bad("--scale-vmm-socket and --scale-vmm-pid go together");

	/* Many short interleaved repetitions: on a shared machine a burst of
	 * someone else's load then spoils a few of them, not a whole figure. */
	o.reps = reps ? reps : o.quick ? 1 : 11;
	/* CPU time per op: the journal-on daemon's and its twin's, or neither. */
	if (o.journal_pid > 0 && o.rt.cpu_pid[RT_NOJOURNAL] > 0)
		o.rt.cpu_pid[RT_JOURNAL] = o.journal_pid;
	else
		o.rt.cpu_pid[RT_NOJOURNAL] = 0;
	o.dur_ns = (uint64_t)((duration > 0 ? duration : o.quick ? 0.2 : 0.4) * 1e9);
	if (!have_counts) {
		static const int def[] = {1, 4, 16, 64};
		for (int i = 0; i < 4; i++)
			o.counts[i] = def[i];
		o.ncounts = 4;
	}
	if (!have_scale) {
		o.scale[0] = 1000;
		o.scale[1] = o.quick ? 10000 : 100000;
		o.scale[2] = o.quick ? 100000 : 1000000;
		o.nscale = 3;
	}
	/* Quick: a smaller zero-copy size keeps the run within a minute. */
	o.zc_bytes = (have_zc ? zc_mib : o.quick ? 64 : zc_mib) << 20;
	rt_wire_sizes(o.rt.req_bytes, o.rt.resp_bytes);
	signal(SIGPIPE, SIG_IGN);
	placement_init(server_cpu);
	setvbuf(stdout, NULL, _IOLBF, 0);

	uint64_t t0 = bench_now_ns();
	fprintf(stderr, "bufbroker-bench: running (%s)\n", o.quick ? "quick" : "full");
	static const struct {
		const char *group;
		void (*run)(const bench_opts *);
	} scenarios[] = {
		{"roundtrip", scenario_roundtrip},
		{"local", scenario_local},
		{"host", scenario_host},
		{"zerocopy", scenario_zerocopy},
		{"cuda", scenario_cuda},
		{"restart", scenario_restart},
		/* Last: its million buffers take the daemon a while to free. */
		{"scale", scenario_scale},
	};
	struct sigaction sa = {.sa_handler = on_watchdog};
	sigaction(SIGALRM, &sa, NULL);
	for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]); i++) {
		if (!wants(only, scenarios[i].group))
			continue;
		/* A server that stops answering must not hang the run. */
		watchdog_scenario = scenarios[i].group;
		alarm(WATCHDOG_S);
		scenarios[i].run(&o);
		alarm(0);
	}
	double secs = (double)(bench_now_ns() - t0) / 1e9;

	report_print(&o);
	printf("\n(%.0f s)\n", secs);

	int rc = 0;
	if (json) {
		char meta[8192], model[256], e_commit[512], e_command[2048], e_cond[1024],
			e_model[512], counts[128] = "", levels[128] = "", cpus[512] = "";
		struct utsname u;
		time_t now = time(NULL);
		char date[64];

		uname(&u);
		cpu_model(model, sizeof(model));
		json_escape(e_model, sizeof(e_model), model);
		json_escape(e_commit, sizeof(e_commit), commit);
		json_escape(e_command, sizeof(e_command), command);
		json_escape(e_cond, sizeof(e_cond), conditions);
		strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
		for (int i = 0; i < o.ncounts; i++)
			snprintf(counts + strlen(counts), sizeof(counts) - strlen(counts), "%s%d",
				 i ? ", " : "", o.counts[i]);
		for (int i = 0; i < o.nscale; i++)
			snprintf(levels + strlen(levels), sizeof(levels) - strlen(levels),
				 "%s%" PRIu64, i ? ", " : "", o.scale[i]);
		for (int i = 0; i < bench_place.ncpus && strlen(cpus) < sizeof(cpus) - 8; i++)
			snprintf(cpus + strlen(cpus), sizeof(cpus) - strlen(cpus), "%s%d",
				 i ? ", " : "", bench_place.cpus[i]);
		snprintf(meta, sizeof(meta),
			 "\"version\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\", "
			 "\"conditions\": \"%s\", \"date\": \"%s\", \"kernel\": \"%s %s\", "
			 "\"machine\": \"%s\", \"cpu\": \"%s\", \"cpus_online\": %ld, "
			 "\"mode\": \"%s\", \"reps\": %d, \"duration_s\": %.3f, "
			 "\"clients\": [%s], \"scale_levels\": [%s], \"zc_bytes\": %zu, "
			 "\"shmem_thp\": \"%s\", \"anon_thp\": \"%s\", "
			 "\"server_cpu\": %d, \"client_cpus\": [%s], "
			 "\"echo_bytes\": {\"retain\": [%zu, %zu], \"release\": [%zu, %zu]}, "
			 "\"elapsed_s\": %.1f",
			 BB_VERSION_STRING, e_commit, e_command, e_cond, date, u.sysname, u.release,
			 u.machine, e_model, sysconf(_SC_NPROCESSORS_ONLN),
			 o.quick ? "quick" : "full", o.reps, (double)o.dur_ns / 1e9, counts, levels,
			 o.zc_bytes, shmem_thp_mode(), anon_thp_mode(), bench_place.server_cpu,
			 cpus, o.rt.req_bytes[0], o.rt.resp_bytes[0], o.rt.req_bytes[1],
			 o.rt.resp_bytes[1], secs);
		if (report_json(&o, json, meta)) {
			fprintf(stderr, "bufbroker-bench: cannot write %s\n", json);
			rc = 1;
		}
	}
	if (plot && report_plot_data(&o, plot)) {
		fprintf(stderr, "bufbroker-bench: cannot write the plot data to %s\n", plot);
		rc = 1;
	}
	results_free();
	return rc;
}
