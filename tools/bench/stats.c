/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Timing, the latency histogram, medians, CPU pinning and the result list.
 */
#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

placement bench_place = {.server_cpu = -1};

uint64_t bench_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- histogram ------------------------------------------------------------- */

static int hist_index(uint64_t v)
{
	if (v < HIST_LINEAR)
		return (int)v;
	int e = 63 - __builtin_clzll(v); /* >= 7 */
	int oct = e - 7;
	if (oct >= HIST_OCTAVES)
		return HIST_BUCKETS - 1;
	int sub = (int)((v >> (e - HIST_SUB_BITS)) & ((1u << HIST_SUB_BITS) - 1));
	return HIST_LINEAR + oct * (1 << HIST_SUB_BITS) + sub;
}

/* The middle of bucket i, in nanoseconds. */
static double hist_value(int i)
{
	if (i < HIST_LINEAR)
		return i;
	int oct = (i - HIST_LINEAR) >> HIST_SUB_BITS;
	int sub = (i - HIST_LINEAR) & ((1 << HIST_SUB_BITS) - 1);
	int e = oct + 7;
	double lo = ldexp(1.0, e) + (double)sub * ldexp(1.0, e - HIST_SUB_BITS);
	return lo + ldexp(1.0, e - HIST_SUB_BITS) / 2;
}

void hist_add(hist *h, uint64_t ns)
{
	h->bucket[hist_index(ns)]++;
	h->count++;
}

void hist_merge(hist *into, const hist *from)
{
	for (int i = 0; i < HIST_BUCKETS; i++)
		into->bucket[i] += from->bucket[i];
	into->count += from->count;
}

double hist_quantile(const hist *h, double q)
{
	if (!h->count)
		return NAN;
	/* The smallest value with at least q of the samples at or below it. */
	uint64_t rank = (uint64_t)ceil(q * (double)h->count);
	uint64_t seen = 0;

	if (rank < 1)
		rank = 1;
	for (int i = 0; i < HIST_BUCKETS; i++) {
		seen += h->bucket[i];
		if (seen >= rank)
			return hist_value(i);
	}
	return hist_value(HIST_BUCKETS - 1);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

double median(double *v, int n)
{
	int k = 0;

	/* NANs (failed repetitions) do not count. */
	for (int i = 0; i < n; i++)
		if (!isnan(v[i]))
			v[k++] = v[i];
	if (!k)
		return NAN;
	qsort(v, (size_t)k, sizeof(*v), cmp_double);
	return k % 2 ? v[k / 2] : (v[k / 2 - 1] + v[k / 2]) / 2;
}

/* ---- CPU placement ----------------------------------------------------------- */

static cpu_set_t all_cpus; /* what this process was allowed at start */
static int have_all_cpus;

static void set_affinity(pid_t tid, const cpu_set_t *set)
{
	(void)sched_setaffinity(tid, sizeof(*set), set);
}

static void pin_to(int cpu)
{
	cpu_set_t set;

	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	set_affinity(0, &set);
}

static const cpu_set_t *every_cpu(void)
{
	if (!have_all_cpus) {
		CPU_ZERO(&all_cpus);
		for (int i = 0; i < bench_place.ncpus; i++)
			CPU_SET(bench_place.cpus[i], &all_cpus);
		if (bench_place.server_cpu >= 0)
			CPU_SET(bench_place.server_cpu, &all_cpus);
		have_all_cpus = 1;
	}
	return &all_cpus;
}

/* Every thread of process pid onto set. */
static void move_process(int pid, const cpu_set_t *set)
{
	char path[64];
	struct dirent *e;
	DIR *d;

	snprintf(path, sizeof(path), "/proc/%d/task", pid);
	d = opendir(path);
	if (!d) {
		set_affinity(pid, set);
		return;
	}
	while ((e = readdir(d)))
		if (e->d_name[0] != '.')
			set_affinity((pid_t)atoi(e->d_name), set);
	closedir(d);
}

void bench_set_pinned(int on)
{
	cpu_set_t server;

	if (bench_place.server_cpu < 0 || bench_place.ncpus <= 0)
		return;
	bench_place.pinned = on;
	CPU_ZERO(&server);
	CPU_SET(bench_place.server_cpu, &server);
	for (int i = 0; i < bench_place.nservers; i++)
		move_process(bench_place.server_pids[i], on ? &server : every_cpu());
	bench_pin_client(-1);
}

void bench_pin_client(int idx)
{
	if (bench_place.ncpus <= 0 || bench_place.server_cpu < 0)
		return;
	if (!bench_place.pinned) {
		set_affinity(0, every_cpu());
		return;
	}
	if (idx >= 0) {
		pin_to(bench_place.cpus[idx % bench_place.ncpus]);
		return;
	}
	cpu_set_t set;

	CPU_ZERO(&set);
	for (int i = 0; i < bench_place.ncpus; i++)
		CPU_SET(bench_place.cpus[i], &set);
	set_affinity(0, &set);
}

void bench_pin_server_cpu(void)
{
	if (bench_place.server_cpu >= 0 && bench_place.pinned)
		pin_to(bench_place.server_cpu);
}

/* ---- results ----------------------------------------------------------------- */

/* Each result is its own allocation, so a pointer stays valid while more
 * are made. */
static result **results;
static int nresults, capresults;

static void *xalloc(void *p)
{
	if (!p) {
		fprintf(stderr, "bufbroker-bench: out of memory\n");
		exit(1);
	}
	return p;
}

result *result_new(const char *name, const char *group, const char *system, const char *label)
{
	if (nresults == capresults) {
		capresults = capresults ? 2 * capresults : 64;
		results = xalloc(realloc(results, (size_t)capresults * sizeof(*results)));
	}
	result *r = xalloc(calloc(1, sizeof(*r)));
	results[nresults++] = r;
	snprintf(r->name, sizeof(r->name), "%s", name);
	snprintf(r->group, sizeof(r->group), "%s", group);
	snprintf(r->system, sizeof(r->system), "%s", system);
	snprintf(r->label, sizeof(r->label), "%s", label);
	r->p50_us = r->p99_us = r->ops_per_s = r->ns_per_op = r->gbps = NAN;
	r->rss_per_buf = r->extra = r->huge_share = NAN;
	r->r_p50_echo = r->r_ops_echo = r->r_ops_redis = r->r_base = r->r_private = r->r_cpu = NAN;
	return r;
}

result *result_at(int i)
{
	return i >= 0 && i < nresults ? results[i] : NULL;
}

int result_count(void)
{
	return nresults;
}

result *result_find(const char *name)
{
	for (int i = 0; i < nresults; i++)
		if (!strcmp(results[i]->name, name))
			return results[i];
	return NULL;
}

void result_note(result *r, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(r->note, sizeof(r->note), fmt, ap);
	va_end(ap);
}

void results_free(void)
{
	for (int i = 0; i < nresults; i++)
		free(results[i]);
	free(results);
	results = NULL;
	nresults = capresults = 0;
}

void child_watchdog(uint64_t dur_ns)
{
	signal(SIGALRM, SIG_DFL); /* not the parent's per-scenario handler */
	alarm((unsigned)(dur_ns / 1000000000u) + 120);
}

void child_die(const char *fmt, ...)
{
	va_list ap;

	fputs("bufbroker-bench (child): ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	_exit(1);
}
