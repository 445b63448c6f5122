/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bufbroker-bench: measure bufbroker and its baselines in one run.
 *
 * One executable with three commands: `run` (every scenario, one table,
 * one JSON file), `echo-server` (the raw SOCK_SEQPACKET floor that run.sh
 * starts next to the daemon) and `help`. This header is what the scenario
 * files share: timing, a latency histogram, CPU placement, the closed-loop
 * multi-process runner, and the result list the report is made from.
 */
#ifndef BB_BENCH_H
#define BB_BENCH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* ---- time ------------------------------------------------------------------ */

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t bench_now_ns(void);

/* ---- latency histogram ---------------------------------------------------- */

/* Log-linear buckets: exact below 128 ns, then 64 per power of two (at most
 * 1.6 % wide), up to about 18 minutes. Fixed size, so one lives in shared
 * memory per child process and merging is adding. */
#define HIST_SUB_BITS 6
#define HIST_LINEAR 128
#define HIST_OCTAVES 34
#define HIST_BUCKETS (HIST_LINEAR + HIST_OCTAVES * (1 << HIST_SUB_BITS))

typedef struct hist {
	uint64_t count;                /* samples recorded */
	uint64_t bucket[HIST_BUCKETS]; /* samples per bucket */
} hist;

void hist_add(hist *h, uint64_t ns);
void hist_merge(hist *into, const hist *from);
/* The q-quantile (0 < q < 1) in nanoseconds, NAN when empty. */
double hist_quantile(const hist *h, double q);

/* The median of n values (sorted in place); NAN when n == 0. */
double median(double *v, int n);

/* ---- CPU placement ---------------------------------------------------------- */

/* Where the servers run and where clients go. Two modes: pinned (servers
 * on server_cpu, clients on the others: single-client latency, where
 * scheduler placement alone moves a round trip 2x) and free (everyone on
 * every CPU: several clients, where pinning would make the clients' one
 * CPU the bottleneck for every system alike). With one CPU nothing is
 * pinned. */
typedef struct placement {
	int server_cpu;     /* the servers' CPU when pinned, or -1: never pin */
	int ncpus;          /* client CPUs when pinned */
	int cpus[256];      /* their numbers */
	int nservers;       /* server processes the bench may move */
	int server_pids[8]; /* bufbrokerd, the echo server, redis-server */
	int pinned;         /* the current mode */
} placement;

extern placement bench_place;

/* Switch mode: move every thread of the server processes, and this
 * process, accordingly. No-op when nothing is ever pinned. */
void bench_set_pinned(int on);
/* Pin the calling process to client CPU number idx (modulo their count);
 * idx < 0 pins to the whole client set. In free mode: every CPU. */
void bench_pin_client(int idx);
/* Pin the calling process to the server CPU (for a producer that should
 * not share the consumer's CPU); no-op when there is none. */
void bench_pin_server_cpu(void);

/* ---- results ----------------------------------------------------------------- */

/* One line of the table and one object in the JSON. Fields that do not
 * apply are NAN. */
typedef struct result {
	char name[64];   /* unique key, e.g. "roundtrip.bufbroker.c16" */
	char group[24];  /* "roundtrip", "local", "host", "zerocopy", "scale", "cuda" */
	char system[24]; /* "bufbroker", "echo", "redis", "atomic", "socket", "private",
			  * "cuda" */
	char label[64];  /* what a reader sees in the table */
	int clients;     /* client processes, 0 when not applicable */
	uint64_t param;  /* bytes or live buffers, 0 when not applicable */
	double p50_us;   /* latency, median over repetitions */
	double p99_us;
	double ops_per_s;   /* throughput, median over repetitions */
	double ns_per_op;   /* for the local counting loops */
	double gbps;        /* 1e9 bytes per second */
	double rss_per_buf; /* daemon bytes per live buffer (scale) */
	double extra;       /* scenario-specific, described by extra_name */
	double huge_share;  /* zero copy, bufbroker: share of the buffer the consumer
			     * had mapped with 2 MiB pages after its read, median */
	double r_p50_echo;  /* round trip: median over repetitions of p50 / echo's */
	double r_ops_echo;  /* ... of ops/s / echo's */
	double r_ops_redis; /* ... of ops/s / Redis's (bufbroker only) */
	double r_base;      /* host: p50 in round trips; zero copy: GB/s over the
			     * socket's; local: ns over the atomic pair's; each the
			     * median of per-repetition ratios */
	double r_private;   /* zero copy, bufbroker recycled: GB/s over a read of a
			     * private, already-faulted buffer of the same size in
			     * the same process (the limit), median of per-round
			     * ratios */
	double r_cpu;       /* round trip, journal: the daemon's CPU time per op over
			     * the journal-off daemon's, median of per-repetition
			     * ratios */
	char extra_name[32];
	int reps;       /* repetitions the medians are over */
	char note[200]; /* "" or why it was skipped / what to know */
	int skipped;    /* no numbers: note says why */
} result;

/* A new result, zeroed with every metric NAN. Never NULL (aborts on OOM). */
result *result_new(const char *name, const char *group, const char *system, const char *label);
/* Every result so far, in the order made. */
result *result_at(int i);
int result_count(void);
result *result_find(const char *name);
/* Set r->note (truncated to fit). */
__attribute__((format(printf, 2, 3))) void result_note(result *r, const char *fmt, ...);
/* Free them all (at exit, for leak checkers). */
void results_free(void);

/* ---- the closed-loop runner ------------------------------------------------- */

/* Which server a round-trip client talks to. */
/* RT_JOURNAL: bufbroker again, on the daemon with the state journal on
 * (rt_config.journal_socket), to compare with RT_NOJOURNAL: bufbroker on its
 * twin, a daemon started the same way but without --restart
 * (rt_config.twin_socket); without a twin, with RT_BUFBROKER. */
typedef enum rt_system { RT_BUFBROKER, RT_ECHO, RT_REDIS, RT_JOURNAL, RT_NOJOURNAL } rt_system;

/* Where the servers are and how the echo datagrams are sized. */
typedef struct rt_config {
	const char *bb_socket;      /* bufbrokerd */
	const char *echo_socket;    /* bufbroker-bench echo-server */
	const char *redis_socket;   /* redis-server, or NULL to skip Redis */
	const char *journal_socket; /* bufbrokerd --restart, or NULL to skip RT_JOURNAL
				     * and the restart scenario */
	const char *twin_socket;    /* its twin, without --restart, or NULL */
	int cpu_pid[5];             /* per rt_system: the server whose CPU time per op
				     * rt_run measures (rt_figures.cpu_us), 0: none */
	size_t req_bytes[2];        /* echo request sizes: retain, release */
	size_t resp_bytes[2];       /* echo response sizes */
} rt_config;

/* One repetition's figures. */
typedef struct rt_figures {
	double p50_us, p99_us, ops_per_s;
	uint64_t ops;
	double cpu_us; /* the server's CPU time (its main thread's, from
			* /proc/PID/schedstat) from the start of the timed
			* window to the clients' exit, per op; NAN: not measured */
} rt_figures;

/* Run `clients` processes, each in a closed loop (one request, wait for its
 * answer, the next) of retain/release (bufbroker), echo of the same sizes,
 * or INCR/DECR (Redis) for dur_ns after a warm-up. 0 and *out, or -1 with
 * err set. */
int rt_run(const rt_config *cfg, rt_system sys, int clients, uint64_t dur_ns, rt_figures *out,
	   char *err, size_t errlen);
/* Whether this build can talk to Redis (built with hiredis). */
int rt_have_redis(void);
/* The sizes of a packed Retain/Release request and its RefsReply response,
 * so the echo baseline moves the same bytes. */
void rt_wire_sizes(size_t req[2], size_t resp[2]);

/* ---- scenarios --------------------------------------------------------------- */

/* What every scenario needs to know about the run. */
typedef struct bench_opts {
	int quick;       /* --quick: fewer and shorter repetitions */
	int reps;        /* repetitions per latency figure */
	uint64_t dur_ns; /* per repetition of a closed loop */
	int counts[8];   /* client counts for the round trip */
	int ncounts;
	rt_config rt;             /* servers */
	int daemon_pid;           /* for RSS and the fd limit; 0: unknown */
	uint64_t daemon_fds_kept; /* fds the daemon keeps besides one per host buffer */
	int journal_pid;          /* the journal-on daemon (rt.journal_socket), 0: none */
	/* The CUDA scale series runs on a second bufbrokerd, idle until then,
	 * so that the heap the host series freed does not hide what its
	 * buffers cost; NULL: on bb_socket and daemon_pid. */
	const char *scale_cuda_socket; /* its socket */
	int scale_cuda_pid;            /* its pid */
	/* The VMM CUDA scale series: a third idle bufbrokerd whose default
	 * CUDA handle is VMM (--cuda-handle vmm); NULL: not run. */
	const char *scale_vmm_socket;
	int scale_vmm_pid;
	uint64_t scale[4]; /* live-buffer levels */
	int nscale;
	size_t zc_bytes; /* zero-copy size */
	int cuda;        /* try the CUDA scenarios */
} bench_opts;

void scenario_roundtrip(const bench_opts *o);
void scenario_local(const bench_opts *o);
void scenario_host(const bench_opts *o);
void scenario_zerocopy(const bench_opts *o);
/* The kernel's shmem transparent huge page mode, as
 * /sys/kernel/mm/transparent_hugepage/shmem_enabled marks it ("never",
 * "advise", ...; "unknown" where it cannot be read): whether bufbroker's
 * MADV_HUGEPAGE on mappings from 2 MiB takes effect in the zero-copy rows. */
const char *shmem_thp_mode(void);
/* The same for private anonymous memory (/sys/kernel/mm/transparent_hugepage/
 * enabled: "always", "madvise", "never"): what the private buffer the
 * recycled zero-copy read is measured against gets. */
const char *anon_thp_mode(void);
void scenario_scale(const bench_opts *o);
void scenario_cuda(const bench_opts *o);
/* Live restart (docs/RESTART.md): the journal-on daemon filled with host
 * buffers re-executes itself (Upgrade); how long until it serves again,
 * and a client's longest call across it. */
void scenario_restart(const bench_opts *o);
/* The daemon's open-file soft limit (/proc/PID/limits), or -1. */
long bench_daemon_nofile(int pid);
struct bb_client;
/* One Alloc of kind (BB_HOST or BB_CUDA) and bytes through the raw request
 * path (a host buffer's memfd is closed at once: the caller keeps only the
 * id and the connection's count). 0, or a BB_ERR_* code with err set. */
int bench_raw_alloc(struct bb_client *c, int kind, uint64_t bytes, uint64_t *id, char *err,
		    size_t errlen);

/* The echo server: one thread, epoll, one recv and one send per request.
 * A request's first two bytes (little endian) give the size of the answer;
 * shorter requests are answered with their own bytes. Runs until SIGTERM
 * or SIGINT; returns the exit status. */
int echo_server_main(const char *path);

/* ---- report ------------------------------------------------------------------ */

/* A target of issue 6 and how this run did. */
typedef struct target {
	const char *what;  /* the sentence */
	const char *bound; /* "<= 1.2x" */
	double measured;   /* the ratio, NAN when not measured */
	double limit;
	int at_most; /* measured must be <= limit (else >=) */
} target;

/* Print the table (with ratios and targets) to stdout; write the JSON and
 * the gnuplot data files when the paths are given. meta_json is a JSON
 * object body (without braces) describing the run. */
void report_print(const bench_opts *o);
int report_json(const bench_opts *o, const char *path, const char *meta_json);
int report_plot_data(const bench_opts *o, const char *dir);

/* A child measuring for about dur_ns ends itself (SIGALRM) two minutes
 * after that, so a hung server cannot hang the benchmark. */
void child_watchdog(uint64_t dur_ns);

/* Child processes report errors through this: print and _exit(1). */
__attribute__((noreturn, format(printf, 1, 2))) void child_die(const char *fmt, ...);

#endif /* BB_BENCH_H */
