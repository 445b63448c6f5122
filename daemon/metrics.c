/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Metrics: the loop thread's counters, the Prometheus text rendering of
 * them and of the broker's state, and the HTTP endpoint (libmicrohttpd) that
 * serves it. The broker is not thread-safe, so the HTTP thread never reads
 * it: a scrape asks the loop thread to render a snapshot and waits for it.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "metrics.h"

#include "cuda_api.h"
#include "kinds.h"
#include "log.h"
#include "ops.h"
#include "snapshot.h"
#include "status.h"
#include "wire.h"

#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define HTTP_CONNECTIONS_MAX 32 /* concurrent scrapers; more wait in the backlog */
#define HTTP_TIMEOUT_S 10       /* an idle HTTP connection is closed after this */

/* Latency bucket bounds, in ns and as the le label writes them. */
static const uint64_t bucket_ns[METRICS_BUCKETS] = {
	5000,    10000,    25000,    50000,    100000,    250000,    500000,    1000000,    2500000,
	5000000, 10000000, 25000000, 50000000, 100000000, 250000000, 500000000, 1000000000,
};
static const char *bucket_le[METRICS_BUCKETS + 1] = {
	"5e-06", "1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025",
	"0.005", "0.01",  "0.025",   "0.05",  "0.1",    "0.25",    "0.5",    "1",     "+Inf",
};

/* ---- counters (loop thread) ---------------------------------------------------- */

static int op_index(int op)
{
	return op > 0 && op < METRICS_OPS ? op : 0;
}

void metrics_handled(metrics_counters *mc, int op, uint64_t ns)
{
	int i = op_index(op), b = 0;
	while (b < METRICS_BUCKETS && ns > bucket_ns[b])
		b++;
	mc->latency[i][b]++;
	mc->latency_ns[i] += ns;
}

void metrics_answered(metrics_counters *mc, int op, int status)
{
	int s = status <= 0 && -status < METRICS_STATUSES - 1 ? -status : METRICS_STATUSES - 1;
	mc->requests[op_index(op)][s]++;
}

void metrics_refused(metrics_counters *mc, metrics_limit limit)
{
	if ((unsigned)limit < METRICS_LIMIT_COUNT)
		mc->refused[limit]++;
}

/* ---- rendering (loop thread) ----------------------------------------------------- */

static const char *status_label(int i)
{
	return i < METRICS_STATUSES - 1 ? bb_err_name(-i) : "OTHER";
}

/* A label value, escaped as the exposition format wants. */
static void put_value(FILE *f, const char *v)
{
	for (; *v; v++) {
		if (*v == '\\')
			fputs("\\\\", f);
		else if (*v == '"')
			fputs("\\\"", f);
		else if (*v == '\n')
			fputs("\\n", f);
		else
			fputc(*v, f);
	}
}

/* HELP and TYPE lines of a metric family. */
static void family(FILE *f, const char *name, const char *type, const char *help)
{
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* The per-uid families. */
static void render_uids(FILE *f, const snapshot *snap)
{
	family(f, "bufbroker_uid_buffers", "gauge", "Live buffers, by owner uid.");
	for (size_t i = 0; i < snap->n_uids; i++)
		fprintf(f, "bufbroker_uid_buffers{uid=\"%" PRIu32 "\"} %" PRIu64 "\n",
			snap->uids[i].uid, snap->uids[i].buffers);
	family(f, "bufbroker_uid_bytes", "gauge", "Bytes of live buffers, by owner uid and kind.");
	for (size_t i = 0; i < snap->n_uids; i++)
		for (int k = 1; k <= BB_KIND_COUNT; k++)
			fprintf(f,
				"bufbroker_uid_bytes{uid=\"%" PRIu32 "\",kind=\"%s\"} %" PRIu64
				"\n",
				snap->uids[i].uid, bb_kind_name(k), snap->uids[i].bytes[k]);
}

/* The per-device gauges. */
typedef enum dev_field {
	DEV_TOTAL,
	DEV_FREE,
	DEV_USED,
	DEV_RESERVED,
	DEV_LIMIT,
	DEV_VMM,
	DEV_VMM_ALLOCATIONS
} dev_field;

static unsigned long long dev_value(const backend_device *d, dev_field field)
{
	switch (field) {
	case DEV_TOTAL: return d->total;
	case DEV_FREE: return d->free;
	case DEV_USED: return d->used;
	case DEV_RESERVED: return d->reserved;
	case DEV_VMM: return d->vmm ? 1 : 0;
	case DEV_VMM_ALLOCATIONS: return d->vmm_allocations;
	default: return d->limit;
	}
}

/* One device gauge family. */
static void device_family(FILE *f, const backend_device *devs, int n, const char *name,
			  const char *help, dev_field field)
{
	char uuid[48];
	family(f, name, "gauge", help);
	for (int i = 0; i < n; i++) {
		bb_cuda_uuid_format(devs[i].uuid, uuid);
		fprintf(f, "%s{device=\"%d\",uuid=\"", name, devs[i].ordinal);
		put_value(f, uuid);
		fprintf(f, "\"} %llu\n", dev_value(&devs[i], field));
	}
}

static void render_requests(FILE *f, const metrics_counters *mc)
{
	family(f, "bufbroker_requests_total", "counter",
	       "Requests answered, by op and by the status of the answer.");
	for (int op = 0; op < METRICS_OPS; op++)
		for (int st = 0; st < METRICS_STATUSES; st++) {
			if (!mc->requests[op][st])
				continue;
			fprintf(f, "bufbroker_requests_total{op=\"");
			put_value(f, bb_op_name(op));
			fprintf(f, "\",status=\"%s\"} %" PRIu64 "\n", status_label(st),
				mc->requests[op][st]);
		}

	family(f, "bufbroker_request_duration_seconds", "histogram",
	       "Time the daemon spent handling a request, by op (a parked one: until it parked).");
	for (int op = 0; op < METRICS_OPS; op++) {
		uint64_t count = 0;
		for (int b = 0; b <= METRICS_BUCKETS; b++)
			count += mc->latency[op][b];
		if (!count)
			continue;
		const char *name = bb_op_name(op);
		uint64_t cum = 0;
		for (int b = 0; b <= METRICS_BUCKETS; b++) {
			cum += mc->latency[op][b];
			fprintf(f, "bufbroker_request_duration_seconds_bucket{op=\"");
			put_value(f, name);
			fprintf(f, "\",le=\"%s\"} %" PRIu64 "\n", bucket_le[b], cum);
		}
		fprintf(f, "bufbroker_request_duration_seconds_sum{op=\"");
		put_value(f, name);
		fprintf(f, "\"} %.9f\n", (double)mc->latency_ns[op] / 1e9);
		fprintf(f, "bufbroker_request_duration_seconds_count{op=\"");
		put_value(f, name);
		fprintf(f, "\"} %" PRIu64 "\n", count);
	}
}

/* The whole exposition of snap, malloc'ed into *out (*len bytes). 0 or -1. */
static int render_snapshot(const snapshot *snap, char **out, size_t *len)
{
	const broker_totals t = snap->totals;
	const backend_device *devs = snap->devices;
	const metrics_counters *mc = snap->counters;
	int ndev = snap->n_devices;
	FILE *f = open_memstream(out, len);
	if (!f)
		return -1;

	family(f, "bufbroker_build_info", "gauge", "The daemon's version and protocol; always 1.");
	fprintf(f, "bufbroker_build_info{version=\"");
	put_value(f, BB_VERSION_STRING);
	fprintf(f, "\",protocol=\"%d.%d\"} 1\n", BB_PROTO_MAJOR, BB_PROTO_MINOR);
	family(f, "bufbroker_uptime_seconds", "gauge", "Seconds since the daemon started serving.");
	fprintf(f, "bufbroker_uptime_seconds %.3f\n", (double)snap->uptime_ms / 1000.0);

	family(f, "bufbroker_connections", "gauge", "Open client connections.");
	fprintf(f, "bufbroker_connections %" PRIu32 "\n", t.connections);
	family(f, "bufbroker_buffers", "gauge", "Live buffers, by kind.");
	for (int k = 1; k <= BB_KIND_COUNT; k++)
		fprintf(f, "bufbroker_buffers{kind=\"%s\"} %" PRIu64 "\n", bb_kind_name(k),
			t.buffers[k]);
	family(f, "bufbroker_buffer_bytes", "gauge",
	       "Bytes of live buffers (their sizes), by kind.");
	for (int k = 1; k <= BB_KIND_COUNT; k++)
		fprintf(f, "bufbroker_buffer_bytes{kind=\"%s\"} %" PRIu64 "\n", bb_kind_name(k),
			t.bytes[k]);
	/* CUDA buffers by how they are shared: the wire's CudaHandle names. */
	static const char *const handles[] = {
		[BB_CUDA_HANDLE_LEGACY] = "legacy", [BB_CUDA_HANDLE_VMM] = "vmm"};
	_Static_assert(BB_CUDA_HANDLE_VMM == BB_CUDA_HANDLE_LEGACY + 1,
		       "the loops below visit only the kinds named above");
	family(f, "bufbroker_cuda_buffers", "gauge",
	       "Live CUDA buffers, by handle kind (legacy IPC handle, or VMM fd).");
	for (int h = BB_CUDA_HANDLE_LEGACY; h <= BB_CUDA_HANDLE_VMM; h += 1)
		fprintf(f, "bufbroker_cuda_buffers{handle=\"%s\"} %" PRIu64 "\n", handles[h],
			t.cuda_buffers[h]);
	family(f, "bufbroker_cuda_buffer_bytes", "gauge",
	       "Bytes of live CUDA buffers (their sizes), by handle kind.");
	for (int h = BB_CUDA_HANDLE_LEGACY; h <= BB_CUDA_HANDLE_VMM; h += 1)
		fprintf(f, "bufbroker_cuda_buffer_bytes{handle=\"%s\"} %" PRIu64 "\n", handles[h],
			t.cuda_bytes[h]);
	family(f, "bufbroker_tokens", "gauge", "Live tokens (taken, not yet adopted or expired).");
	fprintf(f, "bufbroker_tokens %" PRIu64 "\n", t.tokens);
	family(f, "bufbroker_parked_waits", "gauge", "Wait requests parked on pending buffers.");
	fprintf(f, "bufbroker_parked_waits %" PRIu64 "\n", t.waits);
	family(f, "bufbroker_parked_allocs", "gauge",
	       "Alloc requests waiting for the backend to make device memory.");
	fprintf(f, "bufbroker_parked_allocs %" PRIu64 "\n", snap->parked_allocs);
	const backend_host_pool_stats ps = snap->pool;
	family(f, "bufbroker_host_pooled_memfds", "gauge",
	       "Memfds of freed host buffers kept, empty, for reuse.");
	fprintf(f, "bufbroker_host_pooled_memfds %" PRIu64 "\n", ps.pooled);
	family(f, "bufbroker_host_memfds_total", "counter",
	       "Host buffers made, by where their memfd came from: new, or reused from the pool.");
	fprintf(f, "bufbroker_host_memfds_total{source=\"new\"} %" PRIu64 "\n", ps.created);
	fprintf(f, "bufbroker_host_memfds_total{source=\"reused\"} %" PRIu64 "\n", ps.reused);

	const snapshot_restart *rs = &snap->restart;
	family(f, "bufbroker_restarts_total", "counter",
	       "Starts from a kept state (journal and fd store) since the journal was first made.");
	fprintf(f, "bufbroker_restarts_total %" PRIu64 "\n", rs->restarts);
	family(f, "bufbroker_restart_restored_buffers", "gauge",
	       "Buffers this process rebuilt at its start from the kept state.");
	fprintf(f, "bufbroker_restart_restored_buffers %" PRIu64 "\n", rs->restored_buffers);
	family(f, "bufbroker_restart_failed_buffers", "gauge",
	       "Buffers made FAILED at this process's start, by why: legacy CUDA memory died "
	       "with the old process, or the buffer's fd was not kept.");
	fprintf(f, "bufbroker_restart_failed_buffers{reason=\"legacy_cuda\"} %" PRIu64 "\n",
		rs->failed_legacy);
	fprintf(f, "bufbroker_restart_failed_buffers{reason=\"fd_not_kept\"} %" PRIu64 "\n",
		rs->failed_missing);
	family(f, "bufbroker_restart_unprotected_buffers", "gauge",
	       "Live buffers whose fd could not be put in the fd store: lost at a restart.");
	fprintf(f, "bufbroker_restart_unprotected_buffers %" PRIu64 "\n", rs->unprotected);
	family(f, "bufbroker_restart_fdstore_bundles", "gauge",
	       "Bundles in systemd's fd store: each holds up to 64 buffers' and VMM "
	       "allocations' fds.");
	fprintf(f, "bufbroker_restart_fdstore_bundles %" PRIu64 "\n", rs->bundles);
	family(f, "bufbroker_restart_absent_sessions", "gauge",
	       "Sessions restored from the kept state that no client has resumed yet.");
	fprintf(f, "bufbroker_restart_absent_sessions %" PRIu32 "\n", rs->absent_sessions);
	family(f, "bufbroker_restart_protected", "gauge",
	       "1 when the journal is in systemd's fd store (a crash keeps the buffers).");
	fprintf(f, "bufbroker_restart_protected %d\n", rs->protected_by_store ? 1 : 0);
	family(f, "bufbroker_journal_bytes", "gauge", "Size of the state journal; 0 when off.");
	fprintf(f, "bufbroker_journal_bytes %" PRIu64 "\n", rs->journal_bytes);
	family(f, "bufbroker_journal_errors_total", "counter",
	       "Journal writes refused (it could not grow): the journal no longer matches.");
	fprintf(f, "bufbroker_journal_errors_total %" PRIu64 "\n", rs->journal_errors);

	render_uids(f, snap);

	device_family(f, devs, ndev, "bufbroker_device_total_bytes", "The device's memory.",
		      DEV_TOTAL);
	device_family(f, devs, ndev, "bufbroker_device_free_bytes",
		      "Free device memory, as the driver reports it (all processes).", DEV_FREE);
	device_family(f, devs, ndev, "bufbroker_device_buffer_bytes",
		      "Bytes of live CUDA buffers on the device.", DEV_USED);
	device_family(f, devs, ndev, "bufbroker_device_reserved_bytes",
		      "Device memory the daemon holds from the driver: slabs (used and cached), "
		      "dedicated allocations, allocations in progress.",
		      DEV_RESERVED);
	device_family(f, devs, ndev, "bufbroker_device_limit_bytes",
		      "The most device memory the daemon may hold (--cuda-device-bytes).",
		      DEV_LIMIT);
	device_family(f, devs, ndev, "bufbroker_device_vmm",
		      "1 when VMM CUDA buffers can be had on the device (driver, device and "
		      "--cuda-forbid allow them), else 0; ServerStatus says why not.",
		      DEV_VMM);
	device_family(f, devs, ndev, "bufbroker_device_vmm_allocations",
		      "VMM allocations (slabs) the daemon holds on the device: an open file each.",
		      DEV_VMM_ALLOCATIONS);

	render_requests(f, mc);

	family(f, "bufbroker_refused_total", "counter",
	       "Requests (and connections) refused by a limit, by limit.");
	for (int l = 0; l < BROKER_LIMIT_COUNT; l++)
		fprintf(f, "bufbroker_refused_total{limit=\"%s\"} %" PRIu64 "\n",
			broker_limit_name((broker_limit)l), t.refused[l]);
	unsigned long long device_refused = 0;
	for (int i = 0; i < ndev; i++)
		device_refused += devs[i].refused;
	fprintf(f, "bufbroker_refused_total{limit=\"device_bytes\"} %llu\n", device_refused);
	fprintf(f, "bufbroker_refused_total{limit=\"queue_bytes\"} %" PRIu64 "\n",
		mc->refused[METRICS_LIMIT_QUEUE_BYTES]);
	fprintf(f, "bufbroker_refused_total{limit=\"send_timeout\"} %" PRIu64 "\n",
		mc->refused[METRICS_LIMIT_SEND_TIMEOUT]);
	fprintf(f, "bufbroker_refused_total{limit=\"conn_inflight\"} %" PRIu64 "\n",
		mc->refused[METRICS_LIMIT_CONN_INFLIGHT]);
	fprintf(f, "bufbroker_refused_total{limit=\"allow_list\"} %" PRIu64 "\n",
		mc->refused[METRICS_LIMIT_ALLOW_LIST]);
	fprintf(f, "bufbroker_refused_total{limit=\"open_files\"} %" PRIu64 "\n",
		mc->refused[METRICS_LIMIT_OPEN_FILES]);

	if (ferror(f)) {
		fclose(f);
		free(*out);
		*out = NULL;
		return -1;
	}
	return fclose(f) == 0 ? 0 : -1;
}

int metrics_open_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	if (!d)
		return -1;
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d)))
		if (e->d_name[0] != '.')
			n++;
	closedir(d);
	return n - 1; /* the directory's own */
}

int metrics_process_read(metrics_process *out)
{
	char buf[1024], *p;
	unsigned long long utime, stime, start_ticks, vsize;
	long long rss;
	long hz = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
	FILE *f = fopen("/proc/self/stat", "re");
	if (!f)
		return -1;
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	/* The command name, in parentheses, may itself hold ") ": the fields
	 * start after the last one. utime is field 14 of proc(5), the state
	 * field 3. */
	if (hz <= 0 || page <= 0 || !(p = strrchr(buf, ')')) ||
	    sscanf(p + 1,
		   " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d %*d"
		   " %llu %llu %lld",
		   &utime, &stime, &start_ticks, &vsize, &rss) != 5) {
		errno = EINVAL;
		return -1;
	}
	/* The boot time, whole seconds since the epoch (btime of proc(5)). */
	unsigned long long btime = 0;
	bool have_btime = false;
	char line[256];
	if (!(f = fopen("/proc/stat", "re")))
		return -1;
	while (!have_btime && fgets(line, sizeof(line), f))
		have_btime = sscanf(line, "btime %llu", &btime) == 1;
	fclose(f);
	if (!have_btime) {
		errno = EINVAL;
		return -1;
	}
	out->cpu_seconds = (double)(utime + stime) / (double)hz;
	out->start_time_seconds = (double)btime + (double)start_ticks / (double)hz;
	out->virtual_bytes = vsize;
	out->resident_bytes = rss > 0 ? (unsigned long long)rss * (unsigned long long)page : 0;
	return 0;
}

/* HTTP thread: text (*len bytes, malloc'ed) with the process's gauges
 * after it, under the names Prometheus's client libraries give them.
 * Returns the text (text itself when there is no memory for more). */
static char *with_process(char *text, size_t *len)
{
	char *more = NULL;
	size_t n = 0;
	struct rlimit rl;
	FILE *f = open_memstream(&more, &n);
	if (!f)
		return text;
	bool limit = getrlimit(RLIMIT_NOFILE, &rl) == 0;
	int open = metrics_open_fds();
	/* Out of fds to open the directory with: every one is in use. */
	if (open < 0 && errno == EMFILE && limit)
		open = (int)rl.rlim_cur;
	if (open >= 0) {
		family(f, "process_open_fds", "gauge", "Number of open file descriptors.");
		fprintf(f, "process_open_fds %d\n", open);
	}
	if (limit) {
		family(f, "process_max_fds", "gauge", "Maximum number of open file descriptors.");
		fprintf(f, "process_max_fds %llu\n", (unsigned long long)rl.rlim_cur);
	}
	metrics_process ps;
	if (metrics_process_read(&ps) == 0) {
		family(f, "process_cpu_seconds_total", "counter",
		       "Total user and system CPU time spent in seconds.");
		fprintf(f, "process_cpu_seconds_total %.2f\n", ps.cpu_seconds);
		family(f, "process_resident_memory_bytes", "gauge",
		       "Resident memory size in bytes.");
		fprintf(f, "process_resident_memory_bytes %llu\n", ps.resident_bytes);
		family(f, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.");
		fprintf(f, "process_virtual_memory_bytes %llu\n", ps.virtual_bytes);
		family(f, "process_start_time_seconds", "gauge",
		       "Start time of the process since unix epoch in seconds.");
		fprintf(f, "process_start_time_seconds %.2f\n", ps.start_time_seconds);
	}
	if (fclose(f) != 0 || !more) {
		free(more);
		return text;
	}
	char *all = realloc(text, *len + n);
	if (all) {
		memcpy(all + *len, more, n);
		*len += n;
	} else {
		all = text;
	}
	free(more);
	return all;
}

/* A snapshot of src, rendered. 0 or -1. */
static int render(const snapshot_sources *src, char **out, size_t *len)
{
	snapshot snap;
	if (snapshot_take(src, &snap, true) < 0)
		return -1;
	int rc = render_snapshot(&snap, out, len);
	snapshot_release(&snap);
	return rc;
}

/* ---- the endpoint ------------------------------------------------------------------- */

struct metrics_endpoint {
	const snapshot_sources *src; /* read on the loop thread only */
	struct MHD_Daemon *mhd;      /* the HTTP server and its thread */
	uv_async_t async;            /* a scrape asks the loop for a snapshot */
	char addr[64];               /* what it listens on, for logs */
	pthread_mutex_t mu;          /* guards what follows */
	pthread_cond_t cv;           /* a snapshot is ready, or stopping */
	uint64_t asked;              /* snapshots asked for (HTTP thread) */
	uint64_t answered;           /* the last one rendered (loop thread) */
	char *text;                  /* that snapshot, or NULL */
	size_t len;                  /* its bytes */
	bool stopping;               /* metrics_stop began: answer 503 */
};

/* Loop thread: render what was asked for. */
static void on_async(uv_async_t *h)
{
	metrics_endpoint *ep = h->data;
	char *text = NULL;
	size_t len = 0;
	pthread_mutex_lock(&ep->mu);
	uint64_t want = ep->asked;
	bool done = ep->answered == want;
	pthread_mutex_unlock(&ep->mu);
	if (done)
		return;
	if (render(ep->src, &text, &len) < 0)
		log_warn("event=metrics_render_failed error=\"out of memory\"");
	pthread_mutex_lock(&ep->mu);
	free(ep->text);
	ep->text = text;
	ep->len = len;
	ep->answered = want;
	pthread_cond_broadcast(&ep->cv);
	pthread_mutex_unlock(&ep->mu);
}

/* HTTP thread: a copy of a snapshot rendered after this call began, or NULL
 * when the loop did not answer in time (or the endpoint is stopping). */
static char *scrape(metrics_endpoint *ep, size_t *len)
{
	struct timespec deadline;
	char *copy = NULL;
	int rc = 0;
	clock_gettime(CLOCK_MONOTONIC, &deadline);
	deadline.tv_sec += METRICS_SCRAPE_TIMEOUT_MS / 1000;
	deadline.tv_nsec += (long)(METRICS_SCRAPE_TIMEOUT_MS % 1000) * 1000000L;
	if (deadline.tv_nsec >= 1000000000L) {
		deadline.tv_sec++;
		deadline.tv_nsec -= 1000000000L;
	}
	pthread_mutex_lock(&ep->mu);
	uint64_t want = ++ep->asked;
	/* The handle stays open until metrics_stop has joined this thread. */
	uv_async_send(&ep->async);
	while (ep->answered < want && !ep->stopping && rc != ETIMEDOUT)
		rc = pthread_cond_timedwait(&ep->cv, &ep->mu, &deadline);
	if (ep->answered >= want && ep->text && (copy = malloc(ep->len))) {
		memcpy(copy, ep->text, ep->len);
		*len = ep->len;
	}
	pthread_mutex_unlock(&ep->mu);
	return copy;
}

/* Queue a response; body is static text, or malloc'ed when owned. */
static enum MHD_Result respond(struct MHD_Connection *mc, unsigned int status, const char *body,
			       size_t len, bool owned)
{
	struct MHD_Response *r = MHD_create_response_from_buffer(
		len, (void *)body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
	if (!r) {
		if (owned)
			free((void *)body);
		return MHD_NO;
	}
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
				status == MHD_HTTP_OK ? CONTENT_TYPE : "text/plain; charset=utf-8");
	if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
		MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
	enum MHD_Result ret = MHD_queue_response(mc, status, r);
	MHD_destroy_response(r);
	return ret;
}

#define STATIC_BODY(s) s, sizeof(s) - 1, false

static enum MHD_Result on_http(void *cls, struct MHD_Connection *mc, const char *url,
			       const char *method, const char *version, const char *upload_data,
			       size_t *upload_data_size, void **req_cls)
{
	static int headers_seen;
	metrics_endpoint *ep = cls;
	(void)version;
	(void)upload_data;
	/* The first call has the headers only; answer on the next. */
	if (!*req_cls) {
		*req_cls = &headers_seen;
		return MHD_YES;
	}
	if (*upload_data_size) {
		*upload_data_size = 0; /* a body is ignored */
		return MHD_YES;
	}
	if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
		return respond(mc, MHD_HTTP_METHOD_NOT_ALLOWED,
			       STATIC_BODY("only GET and HEAD are served\n"));
	if (strcmp(url, "/metrics") != 0)
		return respond(mc, MHD_HTTP_NOT_FOUND,
			       STATIC_BODY("not found: the metrics are at /metrics\n"));
	size_t len = 0;
	char *text = scrape(ep, &len);
	if (!text)
		return respond(mc, MHD_HTTP_SERVICE_UNAVAILABLE,
			       STATIC_BODY("the daemon's event loop did not answer within 2 s\n"));
	text = with_process(text, &len);
	return respond(mc, MHD_HTTP_OK, text, len, true);
}

/* libmicrohttpd's own messages, as log lines. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
	char msg[256];
	(void)cls;
	vsnprintf(msg, sizeof(msg), fmt, ap);
	msg[strcspn(msg, "\r\n")] = '\0';
	for (char *p = msg; *p; p++)
		if (*p == '"' || *p == '\\')
			*p = '\'';
	log_warn("event=metrics_http_error error=\"%s\"", msg);
}

/* Parse "IPV4:PORT", "[IPV6]:PORT" or "localhost:PORT". 0, or -1 with why. */
static int parse_listen(const char *spec, struct sockaddr_storage *ss, socklen_t *sslen, char *why,
			size_t whylen)
{
	char host[64];
	const char *port;
	memset(ss, 0, sizeof(*ss));
	if (spec[0] == '[') {
		const char *end = strchr(spec, ']');
		if (!end || end[1] != ':' || (size_t)(end - spec - 1) >= sizeof(host)) {
			snprintf(why, whylen, "expected [IPV6]:PORT");
			return -1;
		}
		snprintf(host, sizeof(host), "%.*s", (int)(end - spec - 1), spec + 1);
		port = end + 2;
	} else {
		const char *colon = strrchr(spec, ':');
		if (!colon || colon == spec || (size_t)(colon - spec) >= sizeof(host)) {
			snprintf(why, whylen, "expected HOST:PORT, e.g. 127.0.0.1:9464");
			return -1;
		}
		snprintf(host, sizeof(host), "%.*s", (int)(colon - spec), spec);
		port = colon + 1;
		if (strchr(host, ':')) {
			snprintf(why, whylen, "put an IPv6 address in brackets: [%s]:PORT", host);
			return -1;
		}
		if (strcmp(host, "localhost") == 0)
			snprintf(host, sizeof(host), "127.0.0.1");
	}
	char *end;
	errno = 0;
	unsigned long p = strtoul(port, &end, 10);
	if (!port[0] || *end || errno || p > 65535 || port[0] == '-' || port[0] == '+') {
		snprintf(why, whylen, "\"%s\" is not a port number (0 to 65535)", port);
		return -1;
	}
	struct sockaddr_in *v4 = (struct sockaddr_in *)ss;
	struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)ss;
	if (spec[0] != '[' && inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
		v4->sin_family = AF_INET;
		v4->sin_port = htons((uint16_t)p);
		*sslen = sizeof(*v4);
		return 0;
	}
	if (spec[0] == '[' && inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
		v6->sin6_family = AF_INET6;
		v6->sin6_port = htons((uint16_t)p);
		*sslen = sizeof(*v6);
		return 0;
	}
	snprintf(why, whylen, "\"%s\" is not an IPv%d address (no name lookup is done)", host,
		 spec[0] == '[' ? 6 : 4);
	return -1;
}

/* A listening TCP socket on spec, its address as bound written into addr.
 * The fd, or -1 with why. */
static int listen_tcp(const char *spec, char *addr, size_t addrlen, char *why, size_t whylen)
{
	struct sockaddr_storage ss;
	socklen_t sslen;
	if (parse_listen(spec, &ss, &sslen, why, whylen) < 0)
		return -1;
	int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		snprintf(why, whylen, "socket: %s", strerror(errno));
		return -1;
	}
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (ss.ss_family == AF_INET6)
		setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&ss, sslen) < 0) {
		snprintf(why, whylen, "bind: %s", strerror(errno));
		close(fd);
		return -1;
	}
	if (listen(fd, 64) < 0) {
		snprintf(why, whylen, "listen: %s", strerror(errno));
		close(fd);
		return -1;
	}
	/* Port 0 took a free one: say which. */
	sslen = sizeof(ss);
	getsockname(fd, (struct sockaddr *)&ss, &sslen);
	char ip[INET6_ADDRSTRLEN];
	if (ss.ss_family == AF_INET6) {
		const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)&ss;
		inet_ntop(AF_INET6, &v6->sin6_addr, ip, sizeof(ip));
		snprintf(addr, addrlen, "[%s]:%u", ip, ntohs(v6->sin6_port));
	} else {
		const struct sockaddr_in *v4 = (const struct sockaddr_in *)&ss;
		inet_ntop(AF_INET, &v4->sin_addr, ip, sizeof(ip));
		snprintf(addr, addrlen, "%s:%u", ip, ntohs(v4->sin_port));
	}
	return fd;
}

static void endpoint_free(metrics_endpoint *ep)
{
	pthread_cond_destroy(&ep->cv);
	pthread_mutex_destroy(&ep->mu);
	free(ep->text);
	free(ep);
}

static void on_async_closed(uv_handle_t *h)
{
	endpoint_free(h->data);
}

metrics_endpoint *metrics_start(uv_loop_t *loop, const snapshot_sources *src,
				const char *listen_addr)
{
	char why[160];
	pthread_condattr_t ca;
	sigset_t all, old;
	metrics_endpoint *ep = calloc(1, sizeof(*ep));
	if (!ep) {
		log_error("event=metrics_failed listen=\"%s\" error=\"out of memory\"",
			  listen_addr);
		return NULL;
	}
	ep->src = src;
	pthread_mutex_init(&ep->mu, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&ep->cv, &ca);
	pthread_condattr_destroy(&ca);

	int fd = listen_tcp(listen_addr, ep->addr, sizeof(ep->addr), why, sizeof(why));
	if (fd < 0)
		goto err_free;
	if (uv_async_init(loop, &ep->async, on_async) < 0) {
		snprintf(why, sizeof(why), "cannot create the loop's wake-up handle");
		close(fd);
		goto err_free;
	}
	ep->async.data = ep;

	/* The HTTP thread inherits this thread's signal mask: block every
	 * signal there, so SIGTERM and friends reach the loop. */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	ep->mhd = MHD_start_daemon(
		MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL, on_http, ep,
		MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, NULL, MHD_OPTION_LISTEN_SOCKET, fd,
		MHD_OPTION_CONNECTION_LIMIT, (unsigned int)HTTP_CONNECTIONS_MAX,
		MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)HTTP_TIMEOUT_S, MHD_OPTION_END);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (!ep->mhd) {
		/* fd is libmicrohttpd's from the call on: it closes it on
		 * failure too. */
		snprintf(why, sizeof(why), "libmicrohttpd could not start");
		uv_close((uv_handle_t *)&ep->async, on_async_closed);
		log_error("event=metrics_failed listen=\"%s\" error=\"%s\"", listen_addr, why);
		return NULL;
	}
	log_info("event=metrics_listening address=%s path=/metrics", ep->addr);
	return ep;

err_free:
	endpoint_free(ep);
	log_error("event=metrics_failed listen=\"%s\" error=\"%s\"", listen_addr, why);
	return NULL;
}

void metrics_stop(metrics_endpoint *ep)
{
	if (!ep)
		return;
	pthread_mutex_lock(&ep->mu);
	ep->stopping = true;
	pthread_cond_broadcast(&ep->cv);
	pthread_mutex_unlock(&ep->mu);
	/* Joins the HTTP thread and closes the listening socket. */
	MHD_stop_daemon(ep->mhd);
	uv_close((uv_handle_t *)&ep->async, on_async_closed);
}
