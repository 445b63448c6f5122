/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The report: one table with ratios against the baselines of the same
 * run, the targets of issue 6 with met / not met, the JSON file and the
 * data files the plots are drawn from.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* ---- ratios ------------------------------------------------------------------- */

static double div_or_nan(double a, double b)
{
	return isnan(a) || isnan(b) || b == 0 ? NAN : a / b;
}

static const result *rt_find(const char *system, int clients)
{
	char name[64];

	snprintf(name, sizeof(name), "roundtrip.%s.c%d", system, clients);
	const result *r = result_find(name);
	return r && !r->skipped ? r : NULL;
}

/* A round trip's paired ratio (see scenario_roundtrip): 0 p50 vs echo,
 * 1 ops/s vs echo, 2 ops/s vs Redis. */
static double rt_ratio(const char *system, int clients, int which)
{
	const result *r = rt_find(system, clients);

	if (!r)
		return NAN;
	return which == 0 ? r->r_p50_echo : which == 1 ? r->r_ops_echo : r->r_ops_redis;
}

/* The first and the last level with numbers of a scale series: group
 * "scale" (host buffers) or "scale_cuda". */
static const result *scale_end(const char *group, int last)
{
	const result *found = NULL;

	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		if (strcmp(r->group, group) || r->skipped)
			continue;
		if (!last)
			return r;
		found = r;
	}
	return found;
}

static double metric(const char *name, int which)
{
	const result *r = result_find(name);

	if (!r || r->skipped)
		return NAN;
	switch (which) {
	case 0: return r->p50_us;
	case 1: return r->ops_per_s;
	case 2: return r->ns_per_op;
	default: return r->gbps;
	}
}

/* The ratio printed beside a result, and what it is against; NAN if none. */
static double result_ratio(const result *r, const char **against)
{
	*against = "";
	if (!strcmp(r->group, "roundtrip") && !strcmp(r->system, "journal")) {
		/* Paired repetition by repetition with the journal-off daemon
		 * (its twin, "no-journal", when it ran). */
		*against = "ops_vs_journal_off";
		return r->r_base;
	}
	if (!strcmp(r->group, "local") && !strcmp(r->system, "bufbroker")) {
		*against = "vs_atomic";
		return r->r_base; /* paired repetition by repetition */
	}
	if (!strcmp(r->group, "host")) {
		/* Paired with a round trip measured in the same repetition. */
		*against = "round_trips";
		return r->r_base;
	}
	if (!strcmp(r->group, "zerocopy") && !strcmp(r->system, "bufbroker")) {
		/* Paired round by round with its socket baseline. */
		*against = "vs_socket";
		return r->r_base;
	}
	if (!strcmp(r->group, "scale") || !strcmp(r->group, "scale_cuda") ||
	    !strcmp(r->group, "scale_vmm")) {
		const result *first = scale_end(r->group, 0);
		*against = "ops_vs_first_level";
		return first ? div_or_nan(r->ops_per_s, first->ops_per_s) : NAN;
	}
	if (!strcmp(r->group, "cuda") && !strcmp(r->name, "cuda.alloc_slab")) {
		*against = "vs_cuMemAlloc";
		return div_or_nan(r->p50_us, metric("cuda.memalloc", 0));
	}
	if (!strcmp(r->group, "cuda") && !strcmp(r->name, "cuda.map_warm")) {
		*against = "vs_ipc_open";
		return div_or_nan(r->p50_us, metric("cuda.ipc_open", 0));
	}
	if (!strcmp(r->group, "cuda") && !strcmp(r->name, "cuda.vmm_map_warm")) {
		*against = "vs_legacy_warm_map";
		return div_or_nan(r->p50_us, metric("cuda.map_warm", 0));
	}
	if (!strcmp(r->group, "cuda") && !strcmp(r->name, "cuda.vmm_map_cold")) {
		*against = "vs_legacy_cold_map";
		return div_or_nan(r->p50_us, metric("cuda.map_cold", 0));
	}
	return NAN;
}

/* ---- targets ------------------------------------------------------------------- */

static char scale_what[128], scale_cuda_what[160], rss_what[128], rss_vmm_what[128];
static char ready_what[160];

/* A restart row's figure (ms), NAN when it was not measured. */
static double restart_ms(const char *name)
{
	const result *r = result_find(name);
	return r && !r->skipped ? r->extra : NAN;
}

static double local_ratio(void)
{
	const result *r = result_find("local.bb_ref_unref");
	return r && !r->skipped ? r->r_base : NAN;
}

/* A zero-copy row's ratio: against the socket (r_base) or the private
 * buffer (r_private). */
static double zc_ratio(const char *name, bool vs_private)
{
	const result *r = result_find(name);
	if (!r || r->skipped)
		return NAN;
	return vs_private ? r->r_private : r->r_base;
}

static int targets_compute(const bench_opts *o, target *t)
{
	const result *s0 = scale_end("scale", 0), *s1 = scale_end("scale", 1);
	const result *c0 = scale_end("scale_cuda", 0), *c1 = scale_end("scale_cuda", 1);
	const result *host_1mib = result_find("host.alloc_map_unref.1MiB");
	int n = 0;

	t[n++] = (target){"single-client round trip p50 vs raw echo p50", "<= 1.2x",
			  rt_ratio("bufbroker", 1, 0), 1.2, 1};
	t[n++] = (target){"throughput at 16 clients vs raw echo", ">= 0.9x",
			  rt_ratio("bufbroker", 16, 1), 0.9, 0};
	t[n++] = (target){"throughput at 16 clients vs Redis INCR/DECR", ">= 1.35x",
			  rt_ratio("bufbroker", 16, 2), 1.35, 0};
	t[n++] = (target){"local bb_ref+bb_unref vs a bare atomic inc+dec", "<= 1.5x",
			  local_ratio(), 1.5, 1};
	/* A level the open-file limit capped says so where the verdict is. */
	int capped = s1 && strstr(s1->note, "open-file limit");
	snprintf(scale_what, sizeof(scale_what),
		 "throughput (16 clients) at %" PRIu64 " vs %" PRIu64 " live buffers%s",
		 s1 ? s1->param : 0, s0 ? s0->param : 0, capped ? " (capped)" : "");
	t[n++] = (target){scale_what, ">= 0.9x",
			  s0 && s1 && s1 != s0 ? div_or_nan(s1->ops_per_s, s0->ops_per_s) : NAN,
			  0.9, 0};
	/* The same without an fd per buffer: no open-file limit in the way. */
	uint64_t first = o->nscale ? o->scale[0] : 0;
	uint64_t asked = o->nscale ? o->scale[o->nscale - 1] : 0;
	char short_of[48] = "";
	if (c1 && c1->param < asked)
		snprintf(short_of, sizeof(short_of), "; %" PRIu64 " not reached", asked);
	snprintf(scale_cuda_what, sizeof(scale_cuda_what),
		 "throughput (16 clients) at %" PRIu64 " vs %" PRIu64
		 " live buffers (CUDA buffers, no fd each%s)",
		 c1 ? c1->param : asked, c0 ? c0->param : first, short_of);
	t[n++] = (target){scale_cuda_what, ">= 0.9x",
			  c0 && c1 && c1 != c0 ? div_or_nan(c1->ops_per_s, c0->ops_per_s) : NAN,
			  0.9, 0};
	snprintf(rss_what, sizeof(rss_what),
		 "daemon RSS per live host buffer (bytes, at %" PRIu64 "%s)", s1 ? s1->param : 0,
		 capped ? ", capped" : "");
	t[n++] = (target){rss_what, "<= 256 B", s1 ? s1->rss_per_buf : NAN, 256, 1};
	t[n++] = (target){"zero copy, first read of a fresh buffer vs unix socket", ">= 3x",
			  zc_ratio("zerocopy.bufbroker.first", false), 3, 0};
	/* A consumer that reads every byte is bound by memory bandwidth: the
	 * measure is how close reading through bufbroker comes to reading the
	 * process's own memory (the socket comparison stays in the table). */
	t[n++] = (target){"zero copy, recycled buffer vs a private faulted buffer (same process)",
			  ">= 0.9x", zc_ratio("zerocopy.bufbroker.recycled", true), 0.9, 0};
	t[n++] = (target){"host alloc+map+unref 1 MiB p50, in single-client round trips", "<= 3",
			  host_1mib && !host_1mib->skipped ? host_1mib->r_base : NAN, 3, 1};
	t[n++] = (target){"VMM map in an already mapped slab p50 vs legacy warm map p50", "<= 1.2x",
			  div_or_nan(metric("cuda.vmm_map_warm", 0), metric("cuda.map_warm", 0)),
			  1.2, 1};
	const result *v1 = scale_end("scale_vmm", 1);
	snprintf(rss_vmm_what, sizeof(rss_vmm_what),
		 "daemon RSS per live VMM CUDA buffer vs legacy (at %" PRIu64 ")",
		 v1 ? v1->param : 0);
	t[n++] = (target){rss_vmm_what, "<= 1.1x",
			  v1 && c1 && v1->param == c1->param
				  ? div_or_nan(v1->rss_per_buf, c1->rss_per_buf)
				  : NAN,
			  1.1, 1};
	/* Issue 14: the state journal's cost and the restart's. */
	const result *j1 = rt_find("journal", 1), *j16 = rt_find("journal", 16);
	t[n++] = (target){"round trip ops/s, state journal on vs off, 1 client", ">= 0.95x",
			  j1 ? j1->r_base : NAN, 0.95, 0};
	t[n++] = (target){"round trip ops/s, state journal on vs off, 16 clients", ">= 0.95x",
			  j16 ? j16->r_base : NAN, 0.95, 0};
	const result *ready = result_find("restart.ready");
	snprintf(ready_what, sizeof(ready_what),
		 "restart_ready: serving again after %s, %" PRIu64 " live buffers (ms)",
		 getenv("BB_BENCH_RESTART_BY") && !strcmp(getenv("BB_BENCH_RESTART_BY"), "kill")
			 ? "a SIGKILL"
			 : "an upgrade",
		 ready ? ready->param : 0);
	t[n++] = (target){ready_what, "<= 1000", restart_ms("restart.ready"), 1000, 1};
	t[n++] = (target){"restart_stall: a client's longest call across it (ms)", "<= 2000",
			  restart_ms("restart.stall"), 2000, 1};
	return n;
}

static const char *target_verdict(const target *t)
{
	if (isnan(t->measured))
		return "not measured";
	return (t->at_most ? t->measured <= t->limit : t->measured >= t->limit) ? "met" : "NOT MET";
}

/* ---- the table ------------------------------------------------------------------ */

/* A number in w columns with p decimals, or "-" when it is NAN. */
static void num(double v, int w, int p)
{
	if (isnan(v))
		printf(" %*s", w, "-");
	else
		printf(" %*.*f", w, p, v);
}

static void ratio(double v, int w)
{
	if (isnan(v))
		printf(" %*s", w, "-");
	else
		printf(" %*.2fx", w - 1, v);
}

static void notes_of(const char *group)
{
	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		if (!strcmp(r->group, group) && r->note[0])
			printf("    note (%s): %s\n", r->name, r->note);
	}
}

/* The rows of a scale series, with the kernel Slab column when slab. */
static void scale_rows(const char *group, bool slab)
{
	printf("  %12s %9s %9s %14s %10s %12s", "live buffers", "p50 us", "p99 us", "ops/s (16 cl)",
	       "vs first", "RSS B/buf");
	if (slab)
		printf(" %12s", "slab B/buf");
	printf("\n");
	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		const char *against;
		if (strcmp(r->group, group))
			continue;
		printf("  %12" PRIu64, r->param);
		num(r->p50_us, 9, 1);
		num(r->p99_us, 9, 1);
		num(r->ops_per_s, 14, 0);
		ratio(result_ratio(r, &against), 10);
		num(r->rss_per_buf, 12, 0);
		if (slab)
			num(r->extra, 12, 0);
		printf("\n");
	}
}

void report_print(const bench_opts *o)
{
	target t[24];
	int nt;
	char cpus[128] = "";

	for (int i = 0; i < bench_place.ncpus && strlen(cpus) < sizeof(cpus) - 8; i++)
		snprintf(cpus + strlen(cpus), sizeof(cpus) - strlen(cpus), "%s%d", i ? "," : "",
			 bench_place.cpus[i]);
	printf("\n== bufbroker benchmark (%s) ==\n", o->quick ? "--quick: proves it works, "
								"numbers not meaningful"
							      : "full");
	printf("%d repetition(s) of %.2f s per latency figure, medians shown\n", o->reps,
	       (double)o->dur_ns / 1e9);
	if (bench_place.server_cpu >= 0)
		printf("placement: one client (and single-process figures): servers pinned to CPU %d, "
		       "the client to CPU %s;\n           several clients: nothing pinned (the "
		       "scheduler spreads servers and clients over every CPU)\n",
		       bench_place.server_cpu, cpus);
	else
		printf("placement: nothing pinned\n");
	printf("echo datagrams as the wire: retain %zu B -> %zu B, release %zu B -> %zu B\n",
	       o->rt.req_bytes[0], o->rt.resp_bytes[0], o->rt.req_bytes[1], o->rt.resp_bytes[1]);

	printf("\nRound trip: one op = one request and its answer (bufbroker: bb_retain or "
	       "bb_release; echo: same datagram sizes; redis: INCR or DECR)\n");
	printf("(ratios: the median over repetitions of each repetition's ratio; a repetition runs\n"
	       " the systems back to back, in the reverse order every other repetition)\n");
	printf("%7s  %-10s %9s %9s %11s %9s %9s %10s\n", "clients", "system", "p50 us", "p99 us",
	       "ops/s", "p50/echo", "ops/echo", "ops/redis");
	for (int c = 0; c < o->ncounts; c++) {
		static const char *sys[] = {"bufbroker", "echo", "redis", "no-journal", "journal"};
		int n = o->counts[c];
		for (int s = 0; s < 5; s++) {
			char name[64];
			snprintf(name, sizeof(name), "roundtrip.%s.c%d", sys[s], n);
			const result *r = result_find(name);
			if (!r)
				continue;
			printf("%7d  %-10s", n, sys[s]);
			num(r->p50_us, 9, 1);
			num(r->p99_us, 9, 1);
			num(r->ops_per_s, 11, 0);
			ratio(r->r_p50_echo, 9);
			ratio(r->r_ops_echo, 9);
			ratio(r->r_ops_redis, 10);
			if (!isnan(r->r_base))
				printf("  ops %.3fx journal off", r->r_base);
			if (!isnan(r->r_cpu))
				printf(", cpu/op %.3fx", r->r_cpu);
			if (!strcmp(r->extra_name, "daemon_cpu_us_per_op") && !isnan(r->extra))
				printf("  (daemon cpu %.2f us/op)", r->extra);
			if (r->skipped)
				printf("  (%s)", r->note);
			printf("\n");
		}
	}
	if (o->rt.journal_socket && o->rt.twin_socket)
		printf("(journal: bufbroker on a daemon with its state journal on, --restart;\n"
		       " no-journal: on its twin, started the same way without --restart;\n"
		       " \"ops ... journal off\": journal's ops/s over no-journal's, paired by "
		       "repetition;\n"
		       " \"cpu/op\": the daemon's CPU time per op over no-journal's, paired the "
		       "same way)\n");
	else if (o->rt.journal_socket)
		printf("(journal: bufbroker on a daemon with its state journal on, --restart;\n"
		       " \"ops ... journal off\": its ops/s over bufbroker's, paired by repetition)\n");

	printf("\nLocal reference counting (one process, ns per pair)\n");
	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		const char *against;
		if (strcmp(r->group, "local"))
			continue;
		printf("  %-34s", r->label);
		num(r->ns_per_op, 8, 2);
		printf(" ns");
		double x = result_ratio(r, &against);
		if (!isnan(x))
			printf("   %.2fx the atomic pair", x);
		if (r->skipped)
			printf("  (%s)", r->note);
		printf("\n");
	}

	printf("\nHost buffers (one process; open+map: a second process)\n");
	printf("  %-34s %9s %9s %11s %12s\n", "", "p50 us", "p99 us", "ops/s", "round trips");
	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		const char *against;
		if (strcmp(r->group, "host"))
			continue;
		printf("  %-34s", r->label);
		num(r->p50_us, 9, 1);
		num(r->p99_us, 9, 1);
		num(r->ops_per_s, 11, 0);
		num(result_ratio(r, &against), 12, 2);
		if (r->skipped)
			printf("  (%s)", r->note);
		printf("\n");
	}
	printf("  (round trips: p50 over the p50 of bb_retain/bb_release from the same process in the\n"
	       "   same repetition, the last row; median over repetitions)\n");

	printf("\nZero copy: a consumer process reads %zu MiB another process produced\n",
	       o->zc_bytes >> 20);
	printf("  %-34s %9s %9s %10s %11s %9s\n", "", "GB/s", "ms", "vs socket", "vs private",
	       "2M pages");
	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		const char *against;
		if (strcmp(r->group, "zerocopy"))
			continue;
		printf("  %-34s", r->label);
		num(r->gbps, 9, 2);
		num(r->extra, 9, 1);
		ratio(result_ratio(r, &against), 10);
		ratio(r->r_private, 11);
		if (isnan(r->huge_share))
			printf(" %9s", "-");
		else
			printf(" %8.0f%%", 100 * r->huge_share);
		if (r->skipped)
			printf("  (%s)", r->note);
		printf("\n");
	}
	printf("  (shmem transparent huge pages: %s. bufbroker asks for them on mappings from\n"
	       "   2 MiB; with advise, within_size or always a first read faults once per 2 MiB.\n"
	       "   2M pages: how much of the buffer the consumer had mapped with them.\n"
	       "   vs private: the recycled read against the same consumer reading a private,\n"
	       "   already-faulted buffer of the same size right after (the memory-bandwidth\n"
	       "   limit; the same huge-page advice, anonymous THP: %s); vs socket: information)\n",
	       shmem_thp_mode(), anon_thp_mode());

	printf("\nScale: bufbroker round trip with live buffers in the daemon\n");
	scale_rows("scale", true);
	printf("  (p50/p99: 1 client; RSS: daemon VmRSS growth / live buffers; slab: the whole\n"
	       "   machine's kernel Slab growth / live buffers, informational)\n");
	notes_of("scale");

	printf("\nScale, CUDA: the same with live 256 B CUDA buffers (slab pool, no fd each)\n");
	scale_rows("scale_cuda", false);
	printf("  (the round trip as above, on a host buffer; RSS: daemon VmRSS growth / live CUDA\n"
	       "   buffers: its tables and the slab allocator's bookkeeping)\n");
	notes_of("scale_cuda");

	printf("\nCUDA (1 MiB buffers)\n");
	printf("  %-40s %9s %9s %11s %9s\n", "", "p50 us", "p99 us", "ops/s", "ratio");
	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		const char *against;
		if (strcmp(r->group, "cuda"))
			continue;
		printf("  %-40s", r->label);
		num(r->p50_us, 9, 1);
		num(r->p99_us, 9, 1);
		num(r->ops_per_s, 11, 0);
		ratio(result_ratio(r, &against), 9);
		printf("\n");
	}
	printf("  (ratio: slab alloc vs cuMemAlloc; warm map vs cuIpcOpenMemHandle; p50s)\n");
	notes_of("cuda");

	printf("\nLive restart (issue 14): the journal-on daemon re-executes itself (Upgrade)\n");
	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		if (strcmp(r->group, "restart"))
			continue;
		printf("  %-58s", r->label);
		num(r->extra, 9, 1);
		printf(" ms");
		if (r->note[0])
			printf("  (%s)", r->note);
		printf("\n");
	}
	nt = targets_compute(o, t);
	int width = 64;
	for (int i = 0; i < nt; i++)
		if ((int)strlen(t[i].what) > width)
			width = (int)strlen(t[i].what);
	printf("\nTargets (issues 6 and 14, ratios from this run)\n");
	for (int i = 0; i < nt; i++) {
		printf("  %-13s %-*s %-9s", target_verdict(&t[i]), width, t[i].what, t[i].bound);
		if (isnan(t[i].measured))
			printf(" %10s\n", "-");
		else
			printf(" %10.2f\n", t[i].measured);
	}
	fflush(stdout);
}

/* ---- JSON ------------------------------------------------------------------------ */

static void json_str(FILE *f, const char *s)
{
	fputc('"', f);
	for (; *s; s++) {
		unsigned char ch = (unsigned char)*s;
		if (ch == '"' || ch == '\\')
			fprintf(f, "\\%c", ch);
		else if (ch < 0x20)
			fprintf(f, "\\u%04x", ch);
		else
			fputc(ch, f);
	}
	fputc('"', f);
}

static void json_num(FILE *f, const char *key, double v)
{
	if (!isnan(v) && !isinf(v))
		fprintf(f, ", \"%s\": %.6g", key, v);
}

int report_json(const bench_opts *o, const char *path, const char *meta_json)
{
	target t[24];
	int nt = targets_compute(o, t);
	FILE *f = fopen(path, "w");

	if (!f)
		return -1;
	fprintf(f, "{\n  \"meta\": {%s},\n  \"results\": [\n", meta_json);
	for (int i = 0; i < result_count(); i++) {
		const result *r = result_at(i);
		const char *against;
		double x = result_ratio(r, &against);

		fprintf(f, "    {\"name\": ");
		json_str(f, r->name);
		fprintf(f, ", \"group\": ");
		json_str(f, r->group);
		fprintf(f, ", \"system\": ");
		json_str(f, r->system);
		fprintf(f, ", \"label\": ");
		json_str(f, r->label);
		if (r->clients)
			fprintf(f, ", \"clients\": %d", r->clients);
		if (r->param)
			fprintf(f, ", \"param\": %" PRIu64, r->param);
		json_num(f, "p50_us", r->p50_us);
		json_num(f, "p99_us", r->p99_us);
		json_num(f, "ops_per_s", r->ops_per_s);
		json_num(f, "ns_per_op", r->ns_per_op);
		json_num(f, "gbps", r->gbps);
		json_num(f, "rss_bytes_per_buffer", r->rss_per_buf);
		json_num(f, "huge_page_share", r->huge_share);
		if (r->extra_name[0])
			json_num(f, r->extra_name, r->extra);
		json_num(f, "p50_vs_echo", r->r_p50_echo);
		json_num(f, "ops_vs_echo", r->r_ops_echo);
		json_num(f, "ops_vs_redis", r->r_ops_redis);
		if (against[0])
			json_num(f, against, x);
		json_num(f, "vs_private", r->r_private);
		json_num(f, "cpu_vs_journal_off", r->r_cpu);
		fprintf(f, ", \"reps\": %d, \"skipped\": %s, \"note\": ", r->reps,
			r->skipped ? "true" : "false");
		json_str(f, r->note);
		fprintf(f, "}%s\n", i + 1 < result_count() ? "," : "");
	}
	fprintf(f, "  ],\n  \"targets\": [\n");
	for (int i = 0; i < nt; i++) {
		fprintf(f, "    {\"what\": ");
		json_str(f, t[i].what);
		fprintf(f, ", \"bound\": ");
		json_str(f, t[i].bound);
		json_num(f, "measured", t[i].measured);
		fprintf(f, ", \"verdict\": ");
		json_str(f, target_verdict(&t[i]));
		fprintf(f, "}%s\n", i + 1 < nt ? "," : "");
	}
	fprintf(f, "  ]\n}\n");
	return fclose(f) ? -1 : 0;
}

/* ---- plot data ------------------------------------------------------------------- */

int report_plot_data(const bench_opts *o, const char *dir)
{
	static const char *sys[] = {"bufbroker", "echo", "redis"};
	char path[4096];
	FILE *f;

	snprintf(path, sizeof(path), "%s/roundtrip.dat", dir);
	f = fopen(path, "w");
	if (!f)
		return -1;
	fprintf(f, "# clients  then per system (bufbroker, echo, redis): ops/s p50_us p99_us\n");
	for (int c = 0; c < o->ncounts; c++) {
		fprintf(f, "%d", o->counts[c]);
		for (int s = 0; s < 3; s++) {
			const result *r = rt_find(sys[s], o->counts[c]);
			/* gnuplot skips "NaN" points. */
			fprintf(f, " %.6g %.6g %.6g", r ? r->ops_per_s : NAN, r ? r->p50_us : NAN,
				r ? r->p99_us : NAN);
		}
		fprintf(f, "\n");
	}
	return fclose(f) ? -1 : 0;
}
