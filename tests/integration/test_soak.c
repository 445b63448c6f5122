/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Soak: rounds of client processes running random workloads against one
 * daemon (alloc host and, with the fake CUDA driver, CUDA buffers; import
 * memfds; open by id and by name; local and raw counts; tokens passed
 * between processes; ready and error; waits with timeouts; mapped reads and
 * writes) while the test SIGKILLs most of them at random moments. After
 * every round the daemon's invariant check (the Check request) finds
 * nothing wrong; at the end, with every client gone and every token
 * expired, the daemon holds no buffer and no byte, and its open fds (less
 * the memfds it says its reuse pool keeps) and resident memory are back
 * where they were after a warm-up round.
 *
 * One seeded PRNG drives everything the test chooses; the seed is printed
 * and every failure names it. Knobs (environment): BBT_SOAK_SEED,
 * BBT_SOAK_ROUNDS (default 12), BBT_SOAK_CLIENTS (default 8),
 * BBT_SOAK_ROUND_MS (the longest round, default 3000).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "cuda_api.h"
#include "harness.h"

#define MAX_CLIENTS 32
#define THREADS 2      /* workers per client process, sharing its bb_client */
#define HELD_MAX 24    /* counts one worker holds at most */
#define TOKEN_SLOTS 64 /* tokens in flight between processes */
#define ID_SLOTS 64    /* ids offered for bb_open */
#define NAME_SLOTS 32  /* names offered for bb_open_name */
#define MAX_DEVS 4
#define TOKEN_TTL_MS 300
/* How far the daemon's RSS may end above its level after the warm-up: a
 * few MiB (it ends within a few hundred KiB). Not compared for an ASan
 * daemon: its allocator keeps every chunk it ever handed out resident
 * (besides the quarantine), so its RSS follows the peak of live memory,
 * which depends on how many clients happened to overlap, not on what is
 * left; a leak there is LeakSanitizer's to find, at the daemon's clean
 * exit (bbt_stop_clean). */
#if defined(__SANITIZE_ADDRESS__)
#define SOAK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SOAK_ASAN 1
#endif
#endif
#define RSS_MARGIN_KB (4 * 1024)

static bool rss_is_the_allocators_peak(void)
{
#ifdef SOAK_ASAN
	return true;
#else
	return false;
#endif
}

TestSuite(soak, .timeout = 180);

/* ---- what the processes share ------------------------------------------- */

enum { SLOT_EMPTY, SLOT_WRITING, SLOT_FULL, SLOT_READING };

/* One shared anonymous mapping, made before the first fork. A process
 * killed inside a slot leaves it WRITING or READING; the test frees such
 * slots between rounds, when no client is left. */
struct board {
	atomic_int stop;    /* set at the end of a round: survivors leave cleanly */
	atomic_int started; /* clients that connected this round */
	struct {
		atomic_int state; /* SLOT_* */
		bb_token token;
	} tokens[TOKEN_SLOTS];
	atomic_uint_least64_t ids[ID_SLOTS]; /* 0: empty */
	struct {
		atomic_int state;
		char name[48];
	} names[NAME_SLOTS];
	/* Counts of what happened, over the whole test. */
	atomic_ulong ops;          /* library calls made */
	atomic_ulong adopted;      /* tokens adopted */
	atomic_ulong opened;       /* buffers opened by id or name */
	atomic_ulong verified;     /* READY buffers of another process whose bytes were checked */
	atomic_ulong cuda_allocs;  /* CUDA buffers allocated */
	atomic_ulong cuda_checked; /* CUDA buffers whose bytes were checked */
	atomic_ulong imported;     /* memfds imported */
};

/* What one client process is told. */
struct client_arg {
	const char *sock;
	struct board *bd;
	uint64_t seed;
	int index;
	bool cuda;   /* the daemon serves CUDA through the fake driver */
	bool vanish; /* at the end of the round, exit without cleaning up */
};

/* ---- a small PRNG (splitmix64) ------------------------------------------ */

static uint64_t rnd(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint32_t below(uint64_t *s, uint32_t n)
{
	return n ? (uint32_t)(rnd(s) % n) : 0;
}

static bool chance(uint64_t *s, uint32_t percent)
{
	return below(s, 100) < percent;
}

/* ---- the client process ------------------------------------------------- */

/* The bytes a buffer's allocator writes: the first half of a host buffer is
 * this pattern (the rest is scratch anyone may write); every byte of a CUDA
 * buffer is cuda_byte(id). */
static uint32_t pattern_seed(uint64_t id)
{
	return (uint32_t)(id * 2654435761u) ^ 0x5eedu;
}

static unsigned char cuda_byte(uint64_t id)
{
	return (unsigned char)(id * 131u | 1u);
}

/* One count this worker holds. */
struct held {
	bb_buf *b;
	uint64_t id;
	bb_kind kind;
	size_t size;
	bool mine;    /* allocated or imported here: this worker fills and settles it */
	bool filled;  /* mine: the pattern is written */
	bool settled; /* mine: set_ready or set_error done */
	uint32_t raw; /* raw counts retained through this entry */
};

struct worker {
	const struct client_arg *x;
	bb_client *c;
	uint64_t rng;
	int thread;
	struct held h[HELD_MAX];
	int n;
	unsigned seq; /* names made */
};

/* The driver in a client process: every device's primary context, so that a
 * worker can read and write what bb_map returns. */
static struct {
	bb_cuda api;
	int n;
	unsigned char uuid[MAX_DEVS][16];
	CUcontext ctx[MAX_DEVS];
} g_cu;

/* Every worker of the process, reachable until it ends (see vanish). */
static struct worker g_workers[THREADS];

/* An unexpected answer: say what, with the seed, and end the process with
 * the failed operation's number (the test reports it). */
__attribute__((noreturn, format(printf, 3, 4))) static void fail(const struct worker *w, int op,
								 const char *fmt, ...)
{
	char msg[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	fprintf(stderr,
		"soak client %d thread %d (client seed %llu): operation %d: %s (last error: %s)\n",
		w->x->index, w->thread, (unsigned long long)w->x->seed, op, msg, bb_last_error());
	_exit(20 + op);
}

enum {
	OP_CONNECT = 1,
	OP_ALLOC_HOST,
	OP_ALLOC_CUDA,
	OP_IMPORT,
	OP_OPEN_ID,
	OP_OPEN_NAME,
	OP_ADOPT,
	OP_TAKE,
	OP_REF,
	OP_RETAIN,
	OP_RELEASE,
	OP_STAT,
	OP_WAIT,
	OP_SETTLE,
	OP_MAP,
	OP_DROP,
	OP_CUDA,
	OP_COUNT
};

static void count_op(const struct worker *w)
{
	atomic_fetch_add(&w->x->bd->ops, 1);
}

static int cu_ctx_of(const unsigned char uuid[16])
{
	for (int i = 0; i < g_cu.n; i++)
		if (!memcmp(g_cu.uuid[i], uuid, 16))
			return g_cu.api.CtxSetCurrent(g_cu.ctx[i]) == CUDA_SUCCESS ? 0 : -1;
	return -1;
}

/* The device and size of CUDA buffer b from its handle, which must be of
 * the kind the daemon makes in this run (BBT_CUDA_HANDLE): 0 or -1. */
static int cuda_where(bb_buf *b, unsigned char uuid[16], size_t *size)
{
	const char *h = bbt_cuda_handle();
	bool vmm = h && strcmp(h, "vmm") == 0;
	bb_cuda_ipc ipc;
	bb_cuda_vmm v;

	if (bb_cuda_handle_of(b) != (vmm ? BB_CUDA_HANDLE_VMM : BB_CUDA_HANDLE_LEGACY))
		return -1;
	if (!vmm) {
		if (bb_cuda_ipc_of(b, &ipc) != 0)
			return -1;
		memcpy(uuid, ipc.device_uuid, 16);
		*size = ipc.size;
		return 0;
	}
	if (bb_cuda_vmm_of(b, &v) != 0)
		return -1;
	close(v.fd);
	memcpy(uuid, v.device_uuid, 16);
	*size = v.size;
	return 0;
}

/* Fill (fill) or check a CUDA buffer through its mapping: 0, or -1 with a
 * mismatch or a driver error. */
static int cuda_bytes(struct held *e, void *p, bool fill)
{
	unsigned char want = cuda_byte(e->id), got[4096], uuid[16];
	size_t n = e->size < sizeof(got) ? e->size : sizeof(got), size;
	CUdeviceptr d = (CUdeviceptr)(uintptr_t)p;

	if (cuda_where(e->b, uuid, &size) != 0 || size != e->size || cu_ctx_of(uuid) != 0)
		return -1;
	if (fill)
		return g_cu.api.MemsetD8(d, want, e->size) == CUDA_SUCCESS ? 0 : -1;
	/* The first bytes and the last. */
	if (g_cu.api.MemcpyDtoH(got, d, n) != CUDA_SUCCESS)
		return -1;
	for (size_t i = 0; i < n; i++)
		if (got[i] != want)
			return -1;
	if (g_cu.api.MemcpyDtoH(got, d + e->size - n, n) != CUDA_SUCCESS)
		return -1;
	for (size_t i = 0; i < n; i++)
		if (got[i] != want)
			return -1;
	return 0;
}

/* Map e and, when its allocator finished writing it, check its bytes. */
static void map_and_check(struct worker *w, struct held *e, bool written)
{
	void *p = NULL;
	int rc = bb_map(e->b, &p);

	count_op(w);
	if (rc != 0 || !p)
		fail(w, OP_MAP, "bb_map of buffer %llu: %d", (unsigned long long)e->id, rc);
	if (e->kind == BB_CUDA) {
		if (written) {
			if (cuda_bytes(e, p, false) != 0)
				fail(w, OP_CUDA, "CUDA buffer %llu does not hold its bytes",
				     (unsigned long long)e->id);
			atomic_fetch_add(&w->x->bd->cuda_checked, 1);
		}
		return;
	}
	size_t half = e->size / 2;
	if (written) {
		if (!bbt_check(p, half, pattern_seed(e->id)))
			fail(w, OP_MAP, "host buffer %llu does not hold its pattern",
			     (unsigned long long)e->id);
		if (!e->mine)
			atomic_fetch_add(&w->x->bd->verified, 1);
	}
	/* The scratch half: anyone writes it, nobody checks it. */
	memset((char *)p + half, (int)below(&w->rng, 256), e->size - half);
}

static struct held *add_held(struct worker *w, bb_buf *b, bool mine)
{
	struct held *e = &w->h[w->n++];
	memset(e, 0, sizeof(*e));
	e->b = b;
	e->id = bb_id(b);
	e->kind = bb_buf_kind(b);
	e->size = bb_size(b);
	e->mine = mine;
	return e;
}

/* Offer a buffer for bb_open and (named) bb_open_name in other processes. */
static void offer(struct worker *w, uint64_t id, const char *name)
{
	struct board *bd = w->x->bd;
	atomic_store(&bd->ids[below(&w->rng, ID_SLOTS)], id);
	if (name) {
		int s = (int)below(&w->rng, NAME_SLOTS), want = SLOT_EMPTY;
		if (atomic_load(&bd->names[s].state) == SLOT_FULL)
			want = SLOT_FULL; /* replace an older name */
		if (atomic_compare_exchange_strong(&bd->names[s].state, &want, SLOT_WRITING)) {
			snprintf(bd->names[s].name, sizeof(bd->names[s].name), "%s", name);
			atomic_store(&bd->names[s].state, SLOT_FULL);
		}
	}
}

/* A new buffer of ours: write it, maybe settle it, offer it. */
static void new_mine(struct worker *w, bb_buf *b, const char *name)
{
	struct held *e = add_held(w, b, true);
	void *p = NULL;

	if (chance(&w->rng, 85)) {
		count_op(w);
		if (bb_map(b, &p) != 0)
			fail(w, OP_MAP, "bb_map of our new buffer %llu", (unsigned long long)e->id);
		if (e->kind == BB_CUDA) {
			if (cuda_bytes(e, p, true) != 0)
				fail(w, OP_CUDA, "cuMemsetD8 on CUDA buffer %llu",
				     (unsigned long long)e->id);
		} else {
			bbt_fill(p, e->size / 2, pattern_seed(e->id));
		}
		e->filled = true;
		if (chance(&w->rng, 70)) {
			int rc = chance(&w->rng, 85) ? bb_set_ready(b)
						     : bb_set_error(b, "soak says no");
			count_op(w);
			if (rc != 0)
				fail(w, OP_SETTLE, "settling our new buffer: %d", rc);
			e->settled = true;
		}
	}
	offer(w, e->id, name);
}

static void op_alloc(struct worker *w, bb_kind kind)
{
	bb_alloc_opts o = {.kind = kind, .share = (int)below(&w->rng, 3)};
	char name[64];
	bb_buf *b = NULL;

	if (kind == BB_CUDA) {
		o.size = (size_t)256 << below(&w->rng, 12); /* 256 B .. 512 KiB */
		o.device = (int)below(&w->rng, (uint32_t)g_cu.n);
	} else {
		o.size = chance(&w->rng, 20) ? 1 + below(&w->rng, 100000)
					     : (size_t)4096 << below(&w->rng, 6);
	}
	if (chance(&w->rng, 30)) {
		snprintf(name, sizeof(name), "soak-%d-%d-%d-%u", (int)getpid(), w->x->index,
			 w->thread, w->seq++);
		o.name = name;
	}
	int rc = bb_alloc(w->c, &o, &b);
	count_op(w);
	if (kind == BB_CUDA && rc == BB_ERR_NO_MEMORY)
		return; /* the fake devices are small; others may hold them */
	if (rc != 0)
		fail(w, kind == BB_CUDA ? OP_ALLOC_CUDA : OP_ALLOC_HOST,
		     "bb_alloc(%zu bytes%s): %d", o.size, o.name ? ", named" : "", rc);
	if (kind == BB_CUDA)
		atomic_fetch_add(&w->x->bd->cuda_allocs, 1);
	new_mine(w, b, o.name);
}

static void op_import(struct worker *w)
{
	bb_alloc_opts o = {.kind = BB_HOST, .size = (size_t)4096 << below(&w->rng, 5)};
	bb_buf *b = NULL;
	int fd = memfd_create("soak-import", MFD_ALLOW_SEALING | MFD_CLOEXEC);

	if (fd < 0 || ftruncate(fd, (off_t)o.size + (chance(&w->rng, 50) ? 4096 : 0)) != 0)
		fail(w, OP_IMPORT, "memfd_create: %s", strerror(errno));
	int rc = bb_import_fd(w->c, fd, &o, &b);
	count_op(w);
	close(fd);
	if (rc != 0)
		fail(w, OP_IMPORT, "bb_import_fd(%zu bytes): %d", o.size, rc);
	atomic_fetch_add(&w->x->bd->imported, 1);
	new_mine(w, b, NULL);
}

/* Check what another process made, when its state says it is written. */
static void look_at(struct worker *w, struct held *e)
{
	bb_state st = BB_PENDING;
	int rc = bb_wait(e->b, 0, &st);

	count_op(w);
	if (rc == BB_ERR_TIMEOUT)
		return;
	if (rc != 0)
		fail(w, OP_WAIT, "bb_wait(0) on buffer %llu: %d", (unsigned long long)e->id, rc);
	if (st == BB_READY && chance(&w->rng, 60))
		map_and_check(w, e, true);
}

static void op_open_id(struct worker *w)
{
	uint64_t id = atomic_load(&w->x->bd->ids[below(&w->rng, ID_SLOTS)]);
	bb_buf *b = NULL;

	if (!id)
		return;
	int rc = bb_open(w->c, id, &b);
	count_op(w);
	if (rc == BB_ERR_NOT_FOUND)
		return;
	if (rc != 0)
		fail(w, OP_OPEN_ID, "bb_open(%llu): %d", (unsigned long long)id, rc);
	if (bb_id(b) != id)
		fail(w, OP_OPEN_ID, "bb_open(%llu) gave buffer %llu", (unsigned long long)id,
		     (unsigned long long)bb_id(b));
	atomic_fetch_add(&w->x->bd->opened, 1);
	look_at(w, add_held(w, b, false));
}

static void op_open_name(struct worker *w)
{
	struct board *bd = w->x->bd;
	int s = (int)below(&w->rng, NAME_SLOTS), want = SLOT_FULL;
	char name[48];
	bb_buf *b = NULL;

	/* Copy the name out of its slot without a writer changing it. */
	if (!atomic_compare_exchange_strong(&bd->names[s].state, &want, SLOT_READING))
		return;
	memcpy(name, bd->names[s].name, sizeof(name));
	atomic_store(&bd->names[s].state, SLOT_FULL);
	name[sizeof(name) - 1] = '\0';
	int rc = bb_open_name(w->c, name, &b);
	count_op(w);
	if (rc == BB_ERR_NOT_FOUND)
		return;
	if (rc != 0)
		fail(w, OP_OPEN_NAME, "bb_open_name(%s): %d", name, rc);
	atomic_fetch_add(&bd->opened, 1);
	look_at(w, add_held(w, b, false));
}

static void op_adopt(struct worker *w)
{
	struct board *bd = w->x->bd;
	int s = (int)below(&w->rng, TOKEN_SLOTS), want = SLOT_FULL;
	bb_token t;
	bb_buf *b = NULL;

	if (!atomic_compare_exchange_strong(&bd->tokens[s].state, &want, SLOT_READING))
		return;
	t = bd->tokens[s].token;
	atomic_store(&bd->tokens[s].state, SLOT_EMPTY);
	int rc = bb_adopt(w->c, &t, &b);
	count_op(w);
	if (rc == BB_ERR_NOT_FOUND)
		return; /* expired: its maker died more than a TTL ago, or never took */
	if (rc != 0)
		fail(w, OP_ADOPT, "bb_adopt: %d", rc);
	atomic_fetch_add(&bd->adopted, 1);
	look_at(w, add_held(w, b, false));
}

/* Surrender one count of e into a token on the board. */
static void op_take(struct worker *w, struct held *e)
{
	struct board *bd = w->x->bd;
	int s = (int)below(&w->rng, TOKEN_SLOTS), want = SLOT_EMPTY;
	bb_token t;

	if (!atomic_compare_exchange_strong(&bd->tokens[s].state, &want, SLOT_WRITING))
		return;
	bb_buf *extra = bb_ref(e->b);
	int rc = bb_take(extra, &t);
	count_op(w);
	if (rc != 0)
		fail(w, OP_TAKE, "bb_take of buffer %llu: %d", (unsigned long long)e->id, rc);
	bd->tokens[s].token = t;
	atomic_store(&bd->tokens[s].state, SLOT_FULL);
}

static void op_stat(struct worker *w, struct held *e)
{
	bb_info info;
	int rc = bb_stat(w->c, e->id, &info);

	count_op(w);
	if (rc != 0)
		fail(w, OP_STAT, "bb_stat of held buffer %llu: %d", (unsigned long long)e->id, rc);
	if (info.refs < 1 || info.size != e->size || info.kind != e->kind || info.id != e->id)
		fail(w, OP_STAT, "bb_stat of buffer %llu: refs %llu, size %zu (want %zu), kind %d",
		     (unsigned long long)e->id, (unsigned long long)info.refs, info.size, e->size,
		     (int)info.kind);
}

static void op_wait(struct worker *w, struct held *e)
{
	int timeout = chance(&w->rng, 10) ? 100 : (int)below(&w->rng, 20);
	bb_state st = BB_PENDING;
	int rc = bb_wait(e->b, timeout, &st);

	count_op(w);
	if (rc == BB_ERR_TIMEOUT)
		return;
	if (rc != 0 || (st != BB_READY && st != BB_FAILED))
		fail(w, OP_WAIT, "bb_wait(%d ms) on buffer %llu: %d, state %d", timeout,
		     (unsigned long long)e->id, rc, (int)st);
	if (st == BB_READY && !e->mine)
		map_and_check(w, e, true);
}

/* Give up e's count (and, mostly, its raw counts first). */
static void drop(struct worker *w, int i)
{
	struct held *e = &w->h[i];

	if (e->raw && chance(&w->rng, 90)) {
		int rc = bb_release(w->c, e->id, e->raw);
		count_op(w);
		if (rc != 0)
			fail(w, OP_RELEASE, "bb_release(%llu, %u): %d", (unsigned long long)e->id,
			     e->raw, rc);
	}
	bb_unref(e->b);
	count_op(w);
	w->h[i] = w->h[--w->n];
}

/* One random step. */
static void step(struct worker *w)
{
	uint32_t r = below(&w->rng, 100);

	if (w->n == HELD_MAX || (w->n > 0 && r < 12)) {
		drop(w, (int)below(&w->rng, (uint32_t)w->n));
		return;
	}
	if (w->n == 0 || r < 45) {
		uint32_t k = below(&w->rng, 100);
		if (k < 25)
			op_alloc(w, BB_HOST);
		else if (k < 35 && w->x->cuda && g_cu.n > 0)
			op_alloc(w, BB_CUDA);
		else if (k < 45)
			op_import(w);
		else if (k < 65)
			op_open_id(w);
		else if (k < 75)
			op_open_name(w);
		else
			op_adopt(w);
		return;
	}
	struct held *e = &w->h[below(&w->rng, (uint32_t)w->n)];
	uint32_t k = below(&w->rng, 100);
	if (k < 15) {
		op_take(w, e);
	} else if (k < 25) {
		if (w->n < HELD_MAX) /* a local copy, dropped on its own later */
			add_held(w, bb_ref(e->b), false);
	} else if (k < 35) {
		uint32_t cnt = 1 + below(&w->rng, 3);
		int rc = bb_retain(w->c, e->id, cnt);
		count_op(w);
		if (rc != 0)
			fail(w, OP_RETAIN, "bb_retain(%llu, %u): %d", (unsigned long long)e->id,
			     cnt, rc);
		e->raw += cnt;
	} else if (k < 42) {
		if (e->raw) {
			int rc = bb_release(w->c, e->id, 1);
			count_op(w);
			if (rc != 0)
				fail(w, OP_RELEASE, "bb_release(%llu, 1): %d",
				     (unsigned long long)e->id, rc);
			e->raw--;
		}
	} else if (k < 55) {
		op_stat(w, e);
	} else if (k < 75) {
		if (e->mine && e->filled && !e->settled) {
			int rc = chance(&w->rng, 80) ? bb_set_ready(e->b)
						     : bb_set_error(e->b, "soak changed its mind");
			count_op(w);
			if (rc != 0)
				fail(w, OP_SETTLE, "settling buffer %llu: %d",
				     (unsigned long long)e->id, rc);
			e->settled = true;
		} else {
			op_wait(w, e);
		}
	} else {
		map_and_check(w, e, e->mine && e->filled);
	}
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	while (!atomic_load(&w->x->bd->stop))
		step(w);
	return NULL;
}

/* Every device's primary context, before any worker runs: 0 or -1. */
static int cuda_setup(void)
{
	char err[256];
	int n = 0;

	if (bb_cuda_load(&g_cu.api, err, sizeof(err)) != 0) {
		fprintf(stderr, "soak client: %s\n", err);
		return -1;
	}
	if (!g_cu.api.MemsetD8 || !g_cu.api.MemcpyDtoH ||
	    g_cu.api.DeviceGetCount(&n) != CUDA_SUCCESS)
		return -1;
	for (int i = 0; i < n && i < MAX_DEVS; i++) {
		CUdevice dev;
		CUuuid u;
		if (g_cu.api.DeviceGet(&dev, i) != CUDA_SUCCESS ||
		    g_cu.api.DeviceGetUuid(&u, dev) != CUDA_SUCCESS ||
		    g_cu.api.DevicePrimaryCtxRetain(&g_cu.ctx[i], dev) != CUDA_SUCCESS)
			return -1;
		memcpy(g_cu.uuid[i], u.bytes, 16);
		g_cu.n = i + 1;
	}
	return 0;
}

static int client_main(void *arg)
{
	const struct client_arg *x = arg;
	pthread_t th[THREADS];
	bb_client *c = NULL;

	if (x->cuda && cuda_setup() != 0)
		return 11;
	if (bb_connect(x->sock, &c) != 0) {
		fprintf(stderr, "soak client %d (seed %llu): bb_connect: %s\n", x->index,
			(unsigned long long)x->seed, bb_last_error());
		return 10;
	}
	atomic_fetch_add(&x->bd->started, 1);
	for (int i = 0; i < THREADS; i++) {
		g_workers[i] = (struct worker){
			.x = x, .c = c, .thread = i, .rng = x->seed + (uint64_t)i * 7919};
		if (pthread_create(&th[i], NULL, worker_main, &g_workers[i]) != 0)
			return 12;
	}
	for (int i = 0; i < THREADS; i++)
		pthread_join(th[i], NULL);
	if (x->vanish) {
		/* Exit holding everything: the kernel closes the connection. */
		bbt_abandon(c);
		return 0;
	}
	for (int i = 0; i < THREADS; i++)
		while (g_workers[i].n > 0)
			drop(&g_workers[i], g_workers[i].n - 1);
	bb_disconnect(c);
	return 0;
}

/* ---- the test ------------------------------------------------------------- */

static int env_int(const char *name, int def, int lo, int hi)
{
	const char *v = getenv(name);
	long n = v && *v ? strtol(v, NULL, 10) : def;
	return n < lo ? lo : n > hi ? hi : (int)n;
}

/* The fake driver's namespace for this test, removed at the end. */
static bool g_fake_ns;

static void soak_fini(void)
{
	bbt_cleanup_fakecuda(g_fake_ns);
}

/* Run one round: spawn the clients, kill most at random moments, stop the
 * rest, reap all. */
static void run_round(bbt_daemon *d, struct board *bd, uint64_t *rng, uint64_t seed, int round,
		      int nclients, int round_ms, bool cuda)
{
	struct client_arg args[MAX_CLIENTS];
	pid_t pids[MAX_CLIENTS];
	int kill_at[MAX_CLIENTS]; /* ms after the clients started; -1: stopped at the end */
	int len = round_ms / 3 + (int)below(rng, (uint32_t)(round_ms - round_ms / 3));

	atomic_store(&bd->stop, 0);
	atomic_store(&bd->started, 0);
	for (int i = 0; i < nclients; i++) {
		args[i] = (struct client_arg){.sock = d->sock,
					      .bd = bd,
					      .seed = rnd(rng),
					      .index = i,
					      .cuda = cuda,
					      .vanish = chance(rng, 15)};
		/* Most die by SIGKILL, a few of those before they even connect. */
		kill_at[i] = chance(rng, 70) ? (chance(rng, 5) ? 0 : (int)below(rng, (uint32_t)len))
					     : -1;
		pids[i] = bbt_spawn(client_main, &args[i]);
	}
	/* Those killed at 0 die at once, most before they connect. */
	int expect = nclients;
	for (int i = 0; i < nclients; i++)
		if (kill_at[i] == 0) {
			kill(pids[i], SIGKILL);
			kill_at[i] = -2;
			expect--;
		}
	/* Kill moments count from when the others are at work. */
	int64_t t0 = bbt_now_ms(), wait_until = t0 + bbt_ms(5000);
	while (atomic_load(&bd->started) < expect && bbt_now_ms() < wait_until)
		bbt_sleep_ms(2);
	t0 = bbt_now_ms();
	for (;;) {
		int64_t now = bbt_now_ms() - t0;
		int next = -1;
		for (int i = 0; i < nclients; i++)
			if (kill_at[i] >= 0 && kill_at[i] <= now) {
				kill(pids[i], SIGKILL);
				kill_at[i] = -2;
			} else if (kill_at[i] >= 0 && (next < 0 || kill_at[i] < next)) {
				next = kill_at[i];
			}
		if (now >= len && next < 0)
			break;
		int64_t until = next >= 0 && next < len ? next : len;
		bbt_sleep_ms(until > now ? (int)(until - now) : 1);
	}
	atomic_store(&bd->stop, 1);
	for (int i = 0; i < nclients; i++) {
		int code = bbt_join(pids[i], 10000);
		bool killed = kill_at[i] == -2;
		cr_assert(code == 0 || (killed && code == 128 + SIGKILL),
			  "soak (seed %llu; BBT_SOAK_SEED=%llu repeats it) round %d: client %d "
			  "exited %d (20 + n: operation n gave an unexpected answer, see its line "
			  "above; 10-12: it could not start; -1: it hung)",
			  (unsigned long long)seed, (unsigned long long)seed, round, i, code);
	}
	/* Nobody is left to finish what a killed client left half done. */
	for (int s = 0; s < TOKEN_SLOTS; s++)
		if (atomic_load(&bd->tokens[s].state) != SLOT_FULL)
			atomic_store(&bd->tokens[s].state, SLOT_EMPTY);
	for (int s = 0; s < NAME_SLOTS; s++)
		if (atomic_load(&bd->names[s].state) != SLOT_FULL)
			atomic_store(&bd->names[s].state, SLOT_EMPTY);
}

/* Poll ServerStatus until every CUDA device has 0 bytes used and 0
 * reserved (the daemon runs with no slab cache); false on timeout, with
 * the last numbers in why. */
static bool devices_until_empty(bb_client *c, int timeout_ms, char *why, size_t len)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	for (;;) {
		Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
		Bufbroker__ServerStatus ss = BUFBROKER__SERVER_STATUS__INIT;
		Bufbroker__Response *resp = NULL;
		bool empty = false;

		req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
		req.server_status = &ss;
		snprintf(why, len, "no answer");
		if (bbc_call(c, &req, -1, &resp, NULL) == 0) {
			if (resp->result_case == BUFBROKER__RESPONSE__RESULT_SERVER_STATUS) {
				const Bufbroker__ServerStatusReply *r = resp->server_status;
				empty = true;
				why[0] = '\0';
				for (size_t i = 0; i < r->n_devices; i++) {
					const Bufbroker__DeviceInfo *di = r->devices[i];
					size_t at = strlen(why);
					snprintf(why + at, len - at,
						 "device %d: %llu used, %llu reserved; ",
						 (int)di->ordinal,
						 (unsigned long long)di->used_bytes,
						 (unsigned long long)di->reserved_bytes);
					if (di->used_bytes || di->reserved_bytes)
						empty = false;
				}
			}
			bbc_response_free(resp);
		}
		if (empty)
			return true;
		if (bbt_now_ms() >= deadline)
			return false;
		bbt_sleep_ms(20);
	}
}

/* Wait for the daemon to hold nothing but our connection; asserts. */
static void until_empty(bb_client *c, uint64_t seed, const char *when)
{
	bbt_totals t;
	cr_assert(bbt_totals_until_idle(c, 1, 5000, &t),
		  "soak (seed %llu) %s: the daemon still holds %llu buffers, %llu bytes, "
		  "%llu tokens, %llu waits, %u connections",
		  (unsigned long long)seed, when, (unsigned long long)t.buffers,
		  (unsigned long long)t.bytes, (unsigned long long)t.tokens,
		  (unsigned long long)t.waits, t.connections);
}

Test(soak, random_clients_killed_at_random_leave_the_daemon_as_they_found_it, .fini = soak_fini)
{
	char ns[64], ttl[16];
	int rounds = env_int("BBT_SOAK_ROUNDS", 12, 2, 1000);
	int nclients = env_int("BBT_SOAK_CLIENTS", 8, 1, MAX_CLIENTS);
	int round_ms = env_int("BBT_SOAK_ROUND_MS", 3000, 100, 600000);
	const char *fake = getenv("BB_FAKECUDA");
	bool cuda = fake && *fake;
	uint64_t seed = getenv("BBT_SOAK_SEED") && *getenv("BBT_SOAK_SEED")
				? strtoull(getenv("BBT_SOAK_SEED"), NULL, 0)
				: (uint64_t)time(NULL) * 1000003u ^ (uint64_t)getpid();
	uint64_t rng = seed;

	fprintf(stderr,
		"soak: seed %llu (BBT_SOAK_SEED=%llu repeats it), %d rounds of %d clients%s\n",
		(unsigned long long)seed, (unsigned long long)seed, rounds, nclients,
		cuda ? ", host and fake CUDA buffers" : ", host buffers");

	snprintf(ttl, sizeof(ttl), "%d", TOKEN_TTL_MS);
	const char *args[] = {
		"--metrics-listen",   "127.0.0.1:0", "--token-ttl", ttl, "--cuda-slab-bytes", "1M",
		"--cuda-cache-bytes", "0",           NULL};
	if (cuda) {
		snprintf(ns, sizeof(ns), "bbsoak%d", (int)getpid());
		unsetenv("CUDA_VISIBLE_DEVICES");
		setenv("BUFBROKER_CUDA_LIBRARY", fake, 1);
		setenv("FAKECUDA_NAMESPACE", ns, 1);
		setenv("FAKECUDA_DEVICES", "2", 1);
		setenv("FAKECUDA_MEMORY", "256M", 1);
		g_fake_ns = true;
	} else {
		args[4] = "--no-cuda";
		args[5] = NULL;
	}
#ifdef SOAK_ASAN
	/* An ASan daemon keeps what it frees in quarantine (256 MiB by default),
	 * which would read as growth: a small one here. */
	char asan[512];
	const char *prev = getenv("ASAN_OPTIONS");
	snprintf(asan, sizeof(asan), "%s%squarantine_size_mb=4", prev ? prev : "",
		 prev && *prev ? ":" : "");
	setenv("ASAN_OPTIONS", asan, 1);
#endif
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	int port = bbt_metrics_port(d);
	struct board *bd =
		mmap(NULL, sizeof(*bd), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	cr_assert(bd != MAP_FAILED, "mmap: %s", strerror(errno));
	memset(bd, 0, sizeof(*bd));

	int fds0 = -1;
	long long pooled0 = -1;
	long rss0 = -1;
	for (int round = 0; round < rounds; round++) {
		run_round(d, bd, &rng, seed, round, nclients, round_ms, cuda);
		int problems = bbt_check_problems(c);
		cr_assert_eq(problems, 0,
			     "soak (seed %llu; BBT_SOAK_SEED=%llu repeats it) round %d: the "
			     "invariant check answered %d (problems above, or the error)",
			     (unsigned long long)seed, (unsigned long long)seed, round, problems);
		if (round == 0) {
			/* The warm-up: what the daemon keeps from now on is its baseline. */
			until_empty(c, seed, "after the warm-up round");
			/* The fds first: the scrape's own connection is not
			 * among them. */
			fds0 = bbt_daemon_fds(d);
			pooled0 = bbt_pooled_memfds(port);
			rss0 = bbt_daemon_rss_kb(d);
			cr_assert(fds0 > 0 && rss0 > 0, "cannot read /proc/%d", (int)d->pid);
		}
	}

	/* Every client is gone; tokens outlive them by the TTL. */
	until_empty(c, seed, "after the last round");
	if (cuda) {
		char why[512];
		cr_assert(devices_until_empty(c, 3000, why, sizeof(why)),
			  "soak (seed %llu): the daemon still holds device memory: %s",
			  (unsigned long long)seed, why);
	}
	cr_assert_eq(bbt_check_problems(c), 0, "soak (seed %llu): the final check",
		     (unsigned long long)seed);
	/* Between the two counts the reuse pool may have filled (up to
	 * BBT_HOST_POOL_MAX memfds): compare what the pool does not explain,
	 * by the daemon's own figure. */
	int fds = bbt_daemon_fds(d);
	long long pooled = bbt_pooled_memfds(port);
	for (int64_t until = bbt_now_ms() + bbt_ms(2000);
	     fds - pooled != fds0 - pooled0 && bbt_now_ms() < until;) {
		bbt_sleep_ms(20);
		fds = bbt_daemon_fds(d);
		pooled = bbt_pooled_memfds(port);
	}
	cr_assert_eq(fds - pooled, fds0 - pooled0,
		     "soak (seed %llu): the daemon has %d fds open, %lld of them pooled memfds; "
		     "after the warm-up %d, %lld pooled",
		     (unsigned long long)seed, fds, pooled, fds0, pooled0);
	long rss = bbt_daemon_rss_kb(d);
	fprintf(stderr,
		"soak: %lu library calls, %lu tokens adopted, %lu opens, %lu checked reads "
		"of others' buffers, %lu imports, %lu CUDA buffers (%lu checked); daemon: "
		"%d fds (%lld pooled memfds; %d and %lld after the warm-up), RSS %ld KiB (%ld "
		"KiB after the warm-up)\n",
		atomic_load(&bd->ops), atomic_load(&bd->adopted), atomic_load(&bd->opened),
		atomic_load(&bd->verified), atomic_load(&bd->imported),
		atomic_load(&bd->cuda_allocs), atomic_load(&bd->cuda_checked), fds, pooled, fds0,
		pooled0, rss, rss0);
	/* Under valgrind RSS is the tool's, not the daemon's; under ASan, see
	 * RSS_MARGIN_KB. */
	if (bbt_slow() == 1 && !rss_is_the_allocators_peak())
		cr_assert_leq(
			rss, rss0 + RSS_MARGIN_KB,
			"soak (seed %llu): the daemon's RSS grew from %ld KiB after the warm-up "
			"to %ld KiB",
			(unsigned long long)seed, rss0, rss);

	/* The test did what it says. */
	cr_assert_gt(atomic_load(&bd->adopted), 0, "no token was ever adopted");
	cr_assert_gt(atomic_load(&bd->opened), 0, "no buffer was ever opened by another process");
	cr_assert_gt(atomic_load(&bd->verified), 0, "no process ever checked another's bytes");
	cr_assert_gt(atomic_load(&bd->imported), 0, "no memfd was ever imported");
	if (cuda)
		cr_assert_gt(atomic_load(&bd->cuda_checked), 0,
			     "no CUDA buffer's bytes were checked");

	munmap(bd, sizeof(*bd));
	bb_disconnect(c);
	bbt_stop_clean(d);
}
