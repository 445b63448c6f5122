/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's metrics: the counters the loop thread keeps as it serves
 * (requests by op and status, their latency, refusals by limit), and an
 * optional HTTP endpoint that serves them with the broker's gauges in the
 * Prometheus text exposition format (docs/OPERATIONS.md, "Metrics").
 *
 * Threads: the counters are written and read on the loop thread only, so
 * recording one is a few array increments and takes no lock. The endpoint
 * runs libmicrohttpd on its own thread; a scrape asks the loop thread for a
 * rendered snapshot (uv_async_send) and waits for it at most
 * METRICS_SCRAPE_TIMEOUT_MS, answering 503 when the loop does not answer.
 * The process's own metrics (process_open_fds, process_max_fds,
 * process_cpu_seconds_total, process_resident_memory_bytes,
 * process_virtual_memory_bytes, process_start_time_seconds) are read and
 * rendered on the HTTP thread.
 */
#ifndef BB_METRICS_H
#define BB_METRICS_H

#include <stdint.h>
#include <uv.h>

#include "status.h"

typedef struct metrics_endpoint metrics_endpoint;
typedef struct snapshot_sources snapshot_sources; /* snapshot.h */

#define METRICS_OPS 64 /* Request.op_case values counted; larger ones count as 0 */
/* Answers are counted by status: each code of status.h, then "other". */
#define METRICS_STATUSES (BB_STATUS_COUNT + 1)
#define METRICS_BUCKETS 17 /* latency buckets from 5 us to 1 s, then +Inf */
#define METRICS_SCRAPE_TIMEOUT_MS 2000

/* Limits the server enforces itself; the broker counts its own
 * (broker_totals.refused) and the CUDA backend its device limit. */
typedef enum metrics_limit {
	METRICS_LIMIT_QUEUE_BYTES,   /* a connection's queued output (--queue-bytes): closed */
	METRICS_LIMIT_SEND_TIMEOUT,  /* queued output that did not move (--send-timeout): closed */
	METRICS_LIMIT_CONN_INFLIGHT, /* parked requests (--conn-inflight): reading paused */
	METRICS_LIMIT_ALLOW_LIST,    /* a peer no allow-list admits (--allow-uids/gids) */
	METRICS_LIMIT_OPEN_FILES,    /* a connection the daemon has no fd for (RLIMIT_NOFILE) */
	METRICS_LIMIT_COUNT
} metrics_limit;

/* What the loop thread counts; zeroed with the server. */
typedef struct metrics_counters {
	uint64_t requests[METRICS_OPS][METRICS_STATUSES];   /* answered, by op case and -status */
	uint64_t latency[METRICS_OPS][METRICS_BUCKETS + 1]; /* per bucket, not cumulative */
	uint64_t latency_ns[METRICS_OPS];                   /* sum of the latencies */
	uint64_t refused[METRICS_LIMIT_COUNT];              /* by the server's limits */
} metrics_counters;

/* The loop spent ns handling a request of op (its Request.op_case): the
 * latency histogram. Parked requests count the time until they parked. */
void metrics_handled(metrics_counters *mc, int op, uint64_t ns);
/* A request of op was answered with status (0 or BB_ERR_*), sent or not
 * (no_reply): requests_total. A parked Wait or Alloc counts when its answer
 * comes, or with BB_ERR_DISCONNECTED when it is dropped unanswered with its
 * connection. */
void metrics_answered(metrics_counters *mc, int op, int status);
/* A server limit refused something. */
void metrics_refused(metrics_counters *mc, metrics_limit limit);

/* The file descriptors this process has open (the entries of
 * /proc/self/fd), or -1 when it cannot tell (errno says why). It reads
 * every entry: tens of milliseconds at tens of thousands of fds, so the
 * endpoint calls it on its own thread, never the loop's. */
int metrics_open_fds(void);

/* The process's own numbers, from /proc/self/stat and /proc/stat, as
 * Prometheus's client libraries read them. */
typedef struct metrics_process {
	double cpu_seconds;        /* user + system CPU time */
	double start_time_seconds; /* start, seconds since the epoch (boot time + starttime) */
	unsigned long long virtual_bytes;  /* the address space's size (vsize) */
	unsigned long long resident_bytes; /* resident pages times the page size */
} metrics_process;

/* Fill *out for this process: 0, or -1 when /proc cannot tell (errno).
 * Reads two files: the endpoint calls it on its own thread. The start
 * time is as exact as the kernel's boot time, whole seconds. */
int metrics_process_read(metrics_process *out);

/* Serve GET /metrics on listen_addr: "IPV4:PORT", "[IPV6]:PORT" or
 * "localhost:PORT" (an address literal: no name lookup); port 0 takes a free
 * one. Each scrape renders a snapshot of src (status.h) on loop's thread;
 * src must outlive the endpoint. The address and port bound are logged
 * (event=metrics_listening). Call on the loop thread. The endpoint, or
 * NULL with the reason logged (event=metrics_failed: a bad address, a port
 * in use, ...); the daemon serves on without metrics only if the caller
 * chooses to. */
metrics_endpoint *metrics_start(uv_loop_t *loop, const snapshot_sources *src,
				const char *listen_addr);
/* Stop the endpoint: scrapes waiting for the loop get 503 at once, the HTTP
 * thread is joined and the listening socket closed; the loop's next run
 * frees what is left. Call on the loop thread; NULL is a no-op. */
void metrics_stop(metrics_endpoint *ep);

#endif /* BB_METRICS_H */
