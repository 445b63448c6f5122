/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Host-side scenarios: local reference counting against a bare atomic pair,
 * host alloc + map + unref, open + map by a second process, and zero copy
 * (a consumer reading what another process produced, through bufbroker
 * versus a Unix stream socket).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "bufbroker/bufbroker.h"

static void die(const char *fmt, const char *arg)
{
	fprintf(stderr, "bufbroker-bench: ");
	fprintf(stderr, fmt, arg);
	fputc('\n', stderr);
	exit(1);
}

static void *xcalloc(size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size);
	if (!p)
		die("%s", "out of memory");
	return p;
}

/* Memory shared with forked children, for their histograms. */
static void *shared_alloc(size_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		die("%s", "mmap of shared memory failed");
	return p;
}

static int wait_child(pid_t pid)
{
	int st;

	while (waitpid(pid, &st, 0) < 0)
		if (errno != EINTR)
			return -1;
	return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* ---- local reference counting ----------------------------------------------- */

/* The bare pair bb_ref/bb_unref is measured against: the orders a
 * reference count needs (relaxed increment, release decrement). */
static _Atomic uint64_t bare_count = 1;

static double loop_bb(bb_buf *b, uint64_t iters)
{
	uint64_t t0 = bench_now_ns();
	for (uint64_t i = 0; i < iters; i++) {
		bb_ref(b);
		bb_unref(b);
	}
	return (double)(bench_now_ns() - t0) / (double)iters;
}

static double loop_atomic(uint64_t iters)
{
	uint64_t t0 = bench_now_ns();
	for (uint64_t i = 0; i < iters; i++) {
		atomic_fetch_add_explicit(&bare_count, 1, memory_order_relaxed);
		atomic_fetch_sub_explicit(&bare_count, 1, memory_order_release);
	}
	return (double)(bench_now_ns() - t0) / (double)iters;
}

void scenario_local(const bench_opts *o)
{
	uint64_t iters = o->quick ? 2000000 : 20000000;
	int reps = o->reps < 3 ? 3 : o->reps;
	double *bb = xcalloc((size_t)reps, sizeof(double));
	double *at = xcalloc((size_t)reps, sizeof(double));
	bb_alloc_opts ao = {.size = 4096, .kind = BB_HOST};
	bb_client *c = NULL;
	bb_buf *b = NULL;
	result *rb = result_new("local.bb_ref_unref", "local", "bufbroker", "bb_ref + bb_unref");
	result *ra = result_new("local.atomic_pair", "local", "atomic", "atomic inc + dec");

	fprintf(stderr, "  local reference counting\n");
	bench_set_pinned(1);
	rb->reps = ra->reps = reps;
	if (bb_connect(o->rt.bb_socket, &c) || bb_alloc(c, &ao, &b)) {
		rb->skipped = 1;
		result_note(rb, "%s", bb_last_error());
		bb_disconnect(c);
		goto out;
	}
	bench_pin_client(0);
	loop_bb(b, iters / 10); /* warm-up */
	loop_atomic(iters / 10);
	for (int r = 0; r < reps; r++) {
		bb[r] = loop_bb(b, iters);
		at[r] = loop_atomic(iters);
	}
	bench_pin_client(-1);
	/* The pairs' ratios first: median() sorts in place. */
	double *q = xcalloc((size_t)reps, sizeof(double));
	for (int r = 0; r < reps; r++)
		q[r] = bb[r] / at[r];
	rb->r_base = median(q, reps);
	free(q);
	rb->ns_per_op = median(bb, reps);
	bb_unref(b);
	bb_disconnect(c);
out:
	ra->ns_per_op = median(at, reps);
	free(bb);
	free(at);
}

/* ---- host alloc + map + unref ---------------------------------------------- */

/* A timed loop's figures: latency in microseconds, ops/s. */
struct loop_fig {
	double p50, p99, ops;
};

static int alloc_map_unref(bb_client *c, size_t size)
{
	bb_alloc_opts ao = {.size = size, .kind = BB_HOST};
	bb_buf *b;
	void *p;
	int rc = bb_alloc(c, &ao, &b);

	if (rc)
		return rc;
	rc = bb_map(b, &p);
	bb_unref(b);
	return rc;
}

static int loop_alloc(bb_client *c, size_t size, uint64_t dur_ns, struct loop_fig *f)
{
	hist *h = xcalloc(1, sizeof(*h));
	uint64_t start = bench_now_ns(), t0 = start, t1;
	int rc = 0;

	for (int i = 0; i < 20 && !rc; i++)
		rc = alloc_map_unref(c, size); /* warm-up */
	start = t0 = bench_now_ns();
	while (!rc) {
		rc = alloc_map_unref(c, size);
		t1 = bench_now_ns();
		hist_add(h, t1 - t0);
		t0 = t1;
		if (t1 - start >= dur_ns)
			break;
	}
	f->p50 = hist_quantile(h, 0.5) / 1e3;
	f->p99 = hist_quantile(h, 0.99) / 1e3;
	f->ops = (double)h->count * 1e9 / (double)(t0 - start);
	free(h);
	return rc;
}

/* A child that opens and maps (then unrefs) buffer id in a loop. */
static void open_map_child(const bench_opts *o, uint64_t id, uint64_t dur_ns, hist *h)
{
	bb_client *c;
	uint64_t start = 0, t0, t1;

	bench_pin_client(0);
	child_watchdog(dur_ns);
	if (bb_connect(o->rt.bb_socket, &c))
		child_die("bb_connect: %s", bb_last_error());
	for (int i = 0;; i++) {
		bb_buf *b;
		void *p;

		t0 = bench_now_ns();
		if (i == 20)
			start = t0;
		if (bb_open(c, id, &b) || bb_map(b, &p))
			child_die("open + map: %s", bb_last_error());
		t1 = bench_now_ns();
		bb_unref(b);
		if (i >= 20) {
			hist_add(h, t1 - t0);
			if (t1 - start >= dur_ns)
				break;
		}
	}
	bb_disconnect(c);
	_exit(0);
}

/* The reference the host figures are counted in: single-client
 * bb_retain/bb_release round trips on a held buffer, from this process,
 * right before them. */
static int loop_roundtrip(bb_client *c, bb_buf *held, uint64_t dur_ns, struct loop_fig *f)
{
	hist *h = xcalloc(1, sizeof(*h));
	uint64_t id = bb_id(held), start, t0, t1;
	int rc = 0;

	start = t0 = bench_now_ns();
	for (int i = 0; !rc; i++) {
		rc = i % 2 ? bb_release(c, id, 1) : bb_retain(c, id, 1);
		t1 = bench_now_ns();
		hist_add(h, t1 - t0);
		t0 = t1;
		if (i % 2 && t1 - start >= dur_ns)
			break;
	}
	f->p50 = hist_quantile(h, 0.5) / 1e3;
	f->p99 = hist_quantile(h, 0.99) / 1e3;
	f->ops = (double)h->count * 1e9 / (double)(t0 - start);
	free(h);
	return rc;
}

/* Rows: the three alloc sizes, open+map by a second process, and the
 * reference round trip. */
#define HOST_ROWS 5
#define ROW_OPEN 3
#define ROW_RT 4

void scenario_host(const bench_opts *o)
{
	static const size_t sizes[] = {4096, 1u << 20, 64u << 20};
	static const char *names[] = {"alloc_map_unref.4KiB", "alloc_map_unref.1MiB",
				      "alloc_map_unref.64MiB", "open_map.1MiB", "roundtrip_ref"};
	static const char *labels[] = {"alloc+map+unref 4 KiB", "alloc+map+unref 1 MiB",
				       "alloc+map+unref 64 MiB", "open+map by a 2nd process 1 MiB",
				       "round trip, for the ratios"};
	int reps = o->reps < 64 ? o->reps : 64;
	uint64_t dur = o->dur_ns / 2;
	double v[HOST_ROWS][3][64], ratio[HOST_ROWS][64];
	char err[HOST_ROWS][200] = {{0}};
	bb_alloc_opts hold = {.size = 4096, .kind = BB_HOST};
	bb_client *c = NULL;
	bb_buf *held = NULL;

	bench_set_pinned(1);
	for (int s = 0; s < HOST_ROWS; s++)
		for (int r = 0; r < reps; r++)
			v[s][0][r] = v[s][1][r] = v[s][2][r] = ratio[s][r] = NAN;
	if (bb_connect(o->rt.bb_socket, &c) || bb_alloc(c, &hold, &held)) {
		for (int s = 0; s < HOST_ROWS; s++)
			snprintf(err[s], sizeof(err[s]), "%s", bb_last_error());
		bb_disconnect(c);
		c = NULL;
	}
	for (int r = 0; r < reps && c; r++) {
		struct loop_fig f;

		fprintf(stderr, "  host: rep %d/%d\n", r + 1, reps);
		bench_pin_client(0);
		if (loop_roundtrip(c, held, dur / 2, &f) == 0) {
			v[ROW_RT][0][r] = f.p50;
			v[ROW_RT][1][r] = f.p99;
			v[ROW_RT][2][r] = f.ops;
		} else {
			snprintf(err[ROW_RT], sizeof(err[ROW_RT]), "%s", bb_last_error());
		}
		for (int s = 0; s < 3; s++) {
			if (loop_alloc(c, sizes[s], dur, &f)) {
				snprintf(err[s], sizeof(err[s]), "%s", bb_last_error());
				continue;
			}
			v[s][0][r] = f.p50;
			v[s][1][r] = f.p99;
			v[s][2][r] = f.ops;
		}
		bench_pin_client(-1);

		/* Open + map of an existing 1 MiB buffer by a second process. */
		bb_alloc_opts ao = {.size = 1u << 20, .kind = BB_HOST};
		bb_buf *b;
		hist *h = shared_alloc(sizeof(*h));

		if (bb_alloc(c, &ao, &b) == 0) {
			fflush(stdout);
			fflush(stderr);
			pid_t pid = fork();
			if (pid == 0)
				open_map_child(o, bb_id(b), dur, h);
			if (pid > 0 && wait_child(pid) == 0 && h->count) {
				v[ROW_OPEN][0][r] = hist_quantile(h, 0.5) / 1e3;
				v[ROW_OPEN][1][r] = hist_quantile(h, 0.99) / 1e3;
				/* ops/s stays NAN: the child's loop also unrefs,
				 * and counting only the timed part would flatter. */
			} else {
				snprintf(err[ROW_OPEN], sizeof(err[ROW_OPEN]),
					 "the opening process failed");
			}
			bb_unref(b);
		} else {
			snprintf(err[ROW_OPEN], sizeof(err[ROW_OPEN]), "%s", bb_last_error());
		}
		munmap(h, sizeof(*h));

		/* Each figure in round trips of the same repetition. */
		for (int s = 0; s < ROW_RT; s++)
			if (!isnan(v[s][0][r]) && v[ROW_RT][0][r] > 0)
				ratio[s][r] = v[s][0][r] / v[ROW_RT][0][r];
	}
	for (int s = 0; s < HOST_ROWS; s++) {
		char name[64];

		snprintf(name, sizeof(name), "host.%s", names[s]);
		result *res = result_new(name, "host", "bufbroker", labels[s]);
		res->param = s < 3 ? sizes[s] : s == ROW_OPEN ? 1u << 20 : 0;
		res->reps = reps;
		res->p50_us = median(v[s][0], reps);
		res->p99_us = median(v[s][1], reps);
		if (s != ROW_OPEN)
			res->ops_per_s = median(v[s][2], reps);
		if (s != ROW_RT)
			res->r_base = median(ratio[s], reps);
		if (isnan(res->p50_us)) {
			res->skipped = 1;
			result_note(res, "failed: %.180s", err[s]);
		}
	}
	bb_unref(held);
	bb_disconnect(c);
}

/* ---- zero copy ----------------------------------------------------------------- */

/* Read every byte (as 64-bit words); the sum proves they were all seen. */
static uint64_t sum_words(const void *p, size_t bytes)
{
	const uint64_t *w = p;
	uint64_t s = 0;

	for (size_t i = 0; i < bytes / 8; i++)
		s += w[i];
	return s;
}

/* What a buffer filled with byte v sums to. */
static uint64_t expected_sum(size_t bytes, unsigned char v)
{
	return (uint64_t)(bytes / 8) * (0x0101010101010101ull * v);
}

static int read_full(int fd, void *buf, size_t n)
{
	size_t got = 0;

	while (got < n) {
		ssize_t r = read(fd, (char *)buf + got, n - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		got += (size_t)r;
	}
	return 0;
}

static int write_full(int fd, const void *buf, size_t n)
{
	size_t put = 0;

	while (put < n) {
		ssize_t r = write(fd, (const char *)buf + put, n - put);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		put += (size_t)r;
	}
	return 0;
}

/* Producer through bufbroker: fills a buffer with rep+1 and passes its id;
 * fresh: a new buffer every time; recycled: the same one, rewritten. */
static void zc_bb_producer(const bench_opts *o, int recycled, int rounds, int to_c, int from_c)
{
	bb_alloc_opts ao = {.size = o->zc_bytes, .kind = BB_HOST};
	bb_client *c;
	bb_buf *b = NULL;
	void *p = NULL;
	char done;

	bench_pin_server_cpu();
	child_watchdog((uint64_t)rounds * 60000000000u);
	if (bb_connect(o->rt.bb_socket, &c))
		child_die("bb_connect: %s", bb_last_error());
	for (int i = 0; i < rounds; i++) {
		if (!b) {
			if (bb_alloc(c, &ao, &b) || bb_map(b, &p))
				child_die("producer alloc + map of %zu bytes: %s", o->zc_bytes,
					  bb_last_error());
		}
		memset(p, i + 1, o->zc_bytes);
		uint64_t id = bb_id(b);
		if (write_full(to_c, &id, sizeof(id)) || read_full(from_c, &done, 1))
			child_die("producer lost the consumer");
		if (!recycled) {
			bb_unref(b);
			b = NULL;
		}
	}
	bb_unref(b);
	bb_disconnect(c);
	_exit(0);
}

/* Bytes of this process's memory that /proc/self/smaps_rollup counts under
 * key (ShmemPmdMapped: shared memory mapped with 2 MiB pages;
 * AnonHugePages: private memory in 2 MiB pages), or -1 where it cannot be
 * read. */
static double smaps_rollup_bytes(const char *key)
{
	char line[128];
	size_t len = strlen(key);
	double kb = -1;
	FILE *f = fopen("/proc/self/smaps_rollup", "r");

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, key, len) && line[len] == ':' &&
		    sscanf(line + len + 1, "%lf kB", &kb) == 1)
			break;
	fclose(f);
	return kb < 0 ? -1 : kb * 1024;
}

/* The share of a bytes-long buffer that smaps_rollup counts under key
 * (the only mapping of the process big enough for 2 MiB pages), NAN if
 * unknown. */
static double huge_share_of(const char *key, size_t bytes)
{
	double b = smaps_rollup_bytes(key);
	return b < 0 ? NAN : b / (double)bytes;
}

/* What a zero-copy consumer reports for each of its rounds (at most 2),
 * in memory shared with the parent; NAN where it does not apply. */
typedef struct zc_report {
	double secs[2];      /* the timed read */
	double huge[2];      /* bufbroker: share of the buffer the consumer had
			      * mapped with 2 MiB pages after its read */
	double priv_secs[2]; /* bufbroker, recycled: the same read of a private,
			      * already-faulted buffer in the same process */
	double priv_huge[2]; /* its share in 2 MiB pages */
} zc_report;

#define ZC_PRIVATE_BYTE 0x5a

/* The limit a recycled zero-copy read is measured against: a private
 * buffer of the consumer's own, of the same size, every page faulted in
 * beforehand by a fill. It gets the huge-page advice bb_map gives a host
 * mapping (client/map_host.c), so both ask the kernel for the same; the
 * kernel's modes for anonymous and for shared memory decide what each
 * gets, and the table shows it. */
static unsigned char *zc_private_buffer(size_t n)
{
	unsigned char *p =
		mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	size_t huge = n & ~(((size_t)2 << 20) - 1);

	if (p == MAP_FAILED)
		child_die("mmap of a private %zu-byte buffer failed", n);
	if (huge)
		(void)madvise(p, huge, MADV_HUGEPAGE);
	memset(p, ZC_PRIVATE_BYTE, n);
	return p;
}

/* Consumer through bufbroker: open + map + read, timed from the moment the
 * id arrives. Recycled: round 0 maps the buffer and keeps it (untimed, a
 * pool's first use) and makes the private buffer; later rounds find it
 * mapped, and after the timed read through bufbroker time the same read of
 * the private buffer. After each read (untimed) the report gets the share
 * of the buffer mapped with 2 MiB pages. */
static void zc_bb_consumer(const bench_opts *o, int recycled, int rounds, int from_p, int to_p,
			   zc_report *rep)
{
	bb_client *c;
	bb_buf *keep = NULL;
	unsigned char *priv = NULL;

	bench_pin_client(0);
	child_watchdog((uint64_t)rounds * 60000000000u);
	if (bb_connect(o->rt.bb_socket, &c))
		child_die("bb_connect: %s", bb_last_error());
	for (int i = 0; i < rounds; i++) {
		uint64_t id, t0, t1, sum;
		bb_buf *b;
		void *p;

		if (read_full(from_p, &id, sizeof(id)))
			child_die("consumer lost the producer");
		t0 = bench_now_ns();
		if (bb_open(c, id, &b) || bb_map(b, &p))
			child_die("consumer open + map: %s", bb_last_error());
		sum = sum_words(p, o->zc_bytes);
		t1 = bench_now_ns();
		if (sum != expected_sum(o->zc_bytes, (unsigned char)(i + 1)))
			child_die("consumer read wrong bytes in round %d", i);
		rep->huge[i] = huge_share_of("ShmemPmdMapped", o->zc_bytes);
		rep->secs[i] = (double)(t1 - t0) / 1e9;
		if (recycled && i == 0) {
			keep = b;
			priv = zc_private_buffer(o->zc_bytes);
		} else {
			bb_unref(b);
		}
		if (recycled && i > 0) {
			t0 = bench_now_ns();
			sum = sum_words(priv, o->zc_bytes);
			t1 = bench_now_ns();
			if (sum != expected_sum(o->zc_bytes, ZC_PRIVATE_BYTE))
				child_die("consumer read wrong bytes from its private buffer");
			rep->priv_secs[i] = (double)(t1 - t0) / 1e9;
			rep->priv_huge[i] = huge_share_of("AnonHugePages", o->zc_bytes);
		}
		if (write_full(to_p, "d", 1))
			child_die("consumer lost the producer");
	}
	if (priv)
		munmap(priv, o->zc_bytes);
	bb_unref(keep);
	bb_disconnect(c);
	_exit(0);
}

/* Producer over the socket: a private buffer, filled before each round
 * (untimed), then the same bytes written when the consumer says go. */
static void zc_sock_producer(const bench_opts *o, int rounds, int s)
{
	unsigned char *src = malloc(o->zc_bytes);
	char go;

	bench_pin_server_cpu();
	child_watchdog((uint64_t)rounds * 60000000000u);
	if (!src)
		child_die("out of memory");
	for (int i = 0; i < rounds; i++) {
		memset(src, i + 1, o->zc_bytes);
		if (write_full(s, "R", 1) || read_full(s, &go, 1) ||
		    write_full(s, src, o->zc_bytes))
			child_die("socket producer lost the consumer");
	}
	free(src);
	_exit(0);
}

/* Consumer over the socket: receives into its buffer and reads each chunk
 * right after it arrives (while it is in cache: the socket's best case).
 * Fresh: a new mapping every round; recycled: one, touched beforehand. */
static void zc_sock_consumer(const bench_opts *o, int recycled, int rounds, int s, double *secs)
{
	size_t n = o->zc_bytes;
	unsigned char *dst = NULL;
	char ready;

	bench_pin_client(0);
	child_watchdog((uint64_t)rounds * 60000000000u);
	for (int i = 0; i < rounds; i++) {
		uint64_t t0, t1, sum = 0;
		size_t got = 0, done = 0;

		if (!dst) {
			dst = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
				   0);
			if (dst == MAP_FAILED)
				child_die("mmap of %zu bytes failed", n);
			if (recycled)
				memset(dst, 0, n);
		}
		if (read_full(s, &ready, 1))
			child_die("socket consumer lost the producer");
		t0 = bench_now_ns();
		if (write_full(s, "g", 1))
			child_die("socket consumer lost the producer");
		while (got < n) {
			size_t want = n - got < (1u << 20) ? n - got : (1u << 20);
			ssize_t r = read(s, dst + got, want);
			if (r < 0 && errno == EINTR)
				continue;
			if (r <= 0)
				child_die("socket consumer: short stream");
			got += (size_t)r;
			size_t upto = got & ~(size_t)7;
			sum += sum_words(dst + done, upto - done);
			done = upto;
		}
		t1 = bench_now_ns();
		if (sum != expected_sum(n, (unsigned char)(i + 1)))
			child_die("socket consumer read wrong bytes in round %d", i);
		secs[i] = (double)(t1 - t0) / 1e9;
		if (!recycled) {
			munmap(dst, n);
			dst = NULL;
		}
	}
	if (dst)
		munmap(dst, n);
	_exit(0);
}

/* One timed round of a variant in two new processes (recycled: after an
 * untimed round that maps, or touches, the consumer's memory). 0 and *out,
 * the consumer's report of that round, or -1. */
static int zc_round(const bench_opts *o, int sock, int recycled, zc_report *out)
{
	int rounds = recycled ? 2 : 1;
	zc_report *rep = shared_alloc(sizeof(*rep));
	pid_t prod, cons;
	int fail = 0;

	for (int i = 0; i < 2; i++)
		rep->secs[i] = rep->huge[i] = rep->priv_secs[i] = rep->priv_huge[i] = NAN;

	fflush(stdout);
	fflush(stderr);
	if (sock) {
		int sv[2];
		if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
			die("%s", "socketpair failed");
		prod = fork();
		if (prod == 0) {
			close(sv[1]);
			zc_sock_producer(o, rounds, sv[0]);
		}
		cons = fork();
		if (cons == 0) {
			close(sv[0]);
			zc_sock_consumer(o, recycled, rounds, sv[1], rep->secs);
		}
		close(sv[0]);
		close(sv[1]);
	} else {
		int p2c[2], c2p[2];
		if (pipe2(p2c, O_CLOEXEC) < 0 || pipe2(c2p, O_CLOEXEC) < 0)
			die("%s", "pipe failed");
		prod = fork();
		if (prod == 0) {
			close(p2c[0]);
			close(c2p[1]);
			zc_bb_producer(o, recycled, rounds, p2c[1], c2p[0]);
		}
		cons = fork();
		if (cons == 0) {
			close(p2c[1]);
			close(c2p[0]);
			zc_bb_consumer(o, recycled, rounds, p2c[0], c2p[1], rep);
		}
		close(p2c[0]);
		close(p2c[1]);
		close(c2p[0]);
		close(c2p[1]);
	}
	if (prod < 0 || cons < 0)
		die("%s", "fork failed");
	if (wait_child(cons))
		fail = 1;
	if (wait_child(prod))
		fail = 1;
	/* The last round is the timed one. */
	out->secs[0] = fail ? NAN : rep->secs[rounds - 1];
	out->huge[0] = fail ? NAN : rep->huge[rounds - 1];
	out->priv_secs[0] = fail ? NAN : rep->priv_secs[rounds - 1];
	out->priv_huge[0] = fail ? NAN : rep->priv_huge[rounds - 1];
	munmap(rep, sizeof(*rep));
	return fail ? -1 : 0;
}

/* The bracketed word of a THP mode file into mode ("unknown" where it
 * cannot be read). */
static const char *thp_mode(const char *path, char *mode, size_t len)
{
	char line[256], *a, *b;
	FILE *f = fopen(path, "r");

	snprintf(mode, len, "unknown");
	if (!f)
		return mode;
	/* "always within_size advise [never] deny force" */
	if (fgets(line, sizeof(line), f) && (a = strchr(line, '[')) && (b = strchr(a, ']'))) {
		*b = 0;
		snprintf(mode, len, "%s", a + 1);
	}
	fclose(f);
	return mode;
}

const char *shmem_thp_mode(void)
{
	static char mode[32];
	return thp_mode("/sys/kernel/mm/transparent_hugepage/shmem_enabled", mode, sizeof(mode));
}

const char *anon_thp_mode(void)
{
	static char mode[32];
	return thp_mode("/sys/kernel/mm/transparent_hugepage/enabled", mode, sizeof(mode));
}

#define ZC_MAX_ROUNDS 5

void scenario_zerocopy(const bench_opts *o)
{
	static const struct {
		const char *name, *system, *label;
		int sock, recycled;
	} v[] = {
		{"zerocopy.bufbroker.first", "bufbroker", "bufbroker, first read", 0, 0},
		{"zerocopy.socket.first", "socket", "unix stream, first read", 1, 0},
		{"zerocopy.bufbroker.recycled", "bufbroker", "bufbroker, recycled buffer", 0, 1},
		{"zerocopy.socket.recycled", "socket", "unix stream, recycled buffer", 1, 1},
	};
	/* At most 5 rounds: a first read of 256 MiB takes a second on a busy
	 * small machine, and the run has to stay within five minutes. */
	int rounds = o->reps < ZC_MAX_ROUNDS ? o->reps : ZC_MAX_ROUNDS;
	double gb[4][ZC_MAX_ROUNDS], ms[4][ZC_MAX_ROUNDS], huge[4][ZC_MAX_ROUNDS], q[ZC_MAX_ROUNDS];
	/* The private buffer read in the recycled bufbroker consumer's rounds. */
	double pgb[ZC_MAX_ROUNDS], pms[ZC_MAX_ROUNDS], phuge[ZC_MAX_ROUNDS], qp[ZC_MAX_ROUNDS];

	bench_set_pinned(1);
	/* Round by round, each variant in turn, so a bufbroker figure and its
	 * socket baseline are taken moments apart. */
	for (int r = 0; r < rounds; r++) {
		for (int i = 0; i < 4; i++) {
			zc_report rep;

			fprintf(stderr, "  zero copy: round %d/%d, %s\n", r + 1, rounds,
				v[i].label);
			gb[i][r] = ms[i][r] = huge[i][r] = NAN;
			if (zc_round(o, v[i].sock, v[i].recycled, &rep) == 0) {
				gb[i][r] = (double)o->zc_bytes / rep.secs[0] / 1e9;
				ms[i][r] = rep.secs[0] * 1e3;
				huge[i][r] = rep.huge[0];
			}
			if (!v[i].sock && v[i].recycled) {
				/* NAN when the round failed. Paired: the private
				 * read came right after the one through bufbroker. */
				pgb[r] = (double)o->zc_bytes / rep.priv_secs[0] / 1e9;
				pms[r] = rep.priv_secs[0] * 1e3;
				phuge[r] = rep.priv_huge[0];
				qp[r] = gb[i][r] / pgb[r];
			}
		}
	}
	for (int i = 0; i < 4; i++) {
		result *res = result_new(v[i].name, "zerocopy", v[i].system, v[i].label);

		res->param = o->zc_bytes;
		res->reps = rounds;
		if (!v[i].sock) {
			for (int r = 0; r < rounds; r++)
				q[r] = gb[i][r] / gb[i + 1][r]; /* NAN if either failed */
			res->r_base = median(q, rounds);
			if (v[i].recycled)
				res->r_private = median(qp, rounds);
		}
		res->gbps = median(gb[i], rounds);
		res->extra = median(ms[i], rounds);
		res->huge_share = median(huge[i], rounds);
		snprintf(res->extra_name, sizeof(res->extra_name), "ms");
		if (isnan(res->gbps)) {
			res->skipped = 1;
			result_note(res, "failed (see the messages above)");
		}
	}
	/* The limit the recycled read is held to, as a row of its own. */
	result *res = result_new("zerocopy.private.recycled", "zerocopy", "private",
				 "private buffer, same process");
	res->param = o->zc_bytes;
	res->reps = rounds;
	res->gbps = median(pgb, rounds);
	res->extra = median(pms, rounds);
	res->huge_share = median(phuge, rounds);
	snprintf(res->extra_name, sizeof(res->extra_name), "ms");
	if (isnan(res->gbps)) {
		res->skipped = 1;
		result_note(res, "failed (see the messages above)");
	}
}
