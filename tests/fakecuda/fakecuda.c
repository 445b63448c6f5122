/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libfakecuda.so: a stand-in for the CUDA driver (libcuda.so.1), so the
 * project's real CUDA code runs, and is tested, on machines without a GPU.
 * Point $BUFBROKER_CUDA_LIBRARY at it. A test tool: never installed.
 * tests/fakecuda/README.md lists what it models and its knobs.
 *
 * The model:
 * - Physical devices 0..FAKECUDA_DEVICES-1, FAKECUDA_MEMORY bytes each, with
 *   fixed UUIDs; CUDA_VISIBLE_DEVICES picks and orders the ones a process
 *   sees, as the driver does.
 * - Device memory is POSIX shared memory: each cuMemAlloc is one shm object
 *   and the IPC handle names it, so another process maps the same bytes.
 *   The device address is a PROT_NONE reservation of the same length: host
 *   code that dereferences a device pointer faults, as it would with a GPU.
 *   The fake's copies go through a second, writable mapping.
 * - Each device's memory is accounted in one small shm object per
 *   namespace (FAKECUDA_NAMESPACE): a table of (pid, bytes) under flock(),
 *   which the kernel releases when a holder dies. A dead process's bytes
 *   count as free (the driver frees a process's memory when it exits) and
 *   its objects are unlinked when the next allocation reclaims its slot.
 * - Per-process state sits behind one rwlock (copies hold it shared); the
 *   current context is per thread. A process forked after cuInit gets
 *   CUDA_ERROR_NOT_INITIALIZED from every call, as from the driver.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include <utlist.h>

#ifdef FAKECUDA_CHECK_CUDA_H
/* Signature check against the toolkit (see README.md): the driver's own
 * view of cuda.h declares every versioned name, so each definition below is
 * compiled against the real prototype. */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>
#else
#include "cuda_api.h"
/* Codes the fake returns beyond those cuda_api.h names (values as in cuda.h). */
enum {
	CUDA_ERROR_MAP_FAILED = 205,
	CUDA_ERROR_OPERATING_SYSTEM = 304,
	CUDA_ERROR_UNKNOWN = 999,
};
#endif

#define FAKECUDA_API __attribute__((visibility("default")))

#define MAX_DEVICES 64
#define SLOTS 256            /* processes that may hold memory on one device at once */
#define DRIVER_VERSION 13000 /* cuDriverGetVersion: CUDA 13.0 */
#define DEFAULT_DEVICES 2
#define DEFAULT_MEMORY (1ull << 30)
#define CTX_MAGIC 0x46434358u /* "FCCX" */
#define NAME_LEN 44           /* shm name in a handle, NUL included */

static const char handle_magic[4] = {'F', 'K', 'C', 'U'};

/* A process's primary context on one physical device. */
struct fake_ctx {
	uint32_t magic; /* CTX_MAGIC: tells our contexts from stray pointers */
	int phys;       /* physical device */
	int retained;   /* cuDevicePrimaryCtxRetain count; 0: inactive */
};

/* One allocation of this process, or one opened from another's handle. */
struct fake_map {
	CUdeviceptr dptr;     /* device address: a PROT_NONE reservation */
	char *data;           /* the bytes: the shm object mapped writable */
	size_t size;          /* bytes asked for */
	size_t maplen;        /* size rounded up to pages (both mappings) */
	int phys;             /* physical device of the allocation */
	bool imported;        /* opened by cuIpcOpenMemHandle, not cuMemAlloc */
	struct fake_ctx *ctx; /* current when it was made; its reset frees it */
	char name[NAME_LEN];  /* the shm object */
	struct fake_map *prev, *next;
};

/* The 64 bytes of a CUipcMemHandle. */
struct fake_handle {
	char magic[4];
	uint32_t pid;        /* the exporting process */
	uint64_t size;       /* bytes of the allocation */
	uint32_t phys;       /* its physical device */
	char name[NAME_LEN]; /* its shm object */
};
_Static_assert(sizeof(struct fake_handle) == CU_IPC_HANDLE_SIZE, "handle layout");
_Static_assert(sizeof(CUipcMemHandle) == CU_IPC_HANDLE_SIZE, "handle size");

/* A device's accounting, shared by the namespace's processes. Guarded by
 * flock() on the object's fd (the kernel drops it when a holder dies). */
struct dev_shared {
	struct {
		int32_t pid; /* 0: a free slot */
		uint32_t pad;
		uint64_t bytes; /* what pid holds on the device */
	} slot[SLOTS];
};

enum { ST_UNINIT, ST_READY, ST_FORKED };

static struct {
	pthread_rwlock_t lock;            /* guards all below; shared for copies and queries */
	int state;                        /* ST_*: ST_FORKED after fork() of a ready process */
	int nphys;                        /* FAKECUDA_DEVICES */
	uint64_t total;                   /* FAKECUDA_MEMORY, bytes per device */
	int nvis;                         /* devices this process sees */
	int vis[MAX_DEVICES];             /* ordinal -> physical device */
	char prefix[20];                  /* "/fakecuda.<namespace hash>." */
	struct fake_ctx ctx[MAX_DEVICES]; /* primary contexts, by physical device */
	int devfd[MAX_DEVICES];           /* accounting objects, by physical device */
	struct dev_shared *dev[MAX_DEVICES];
	struct fake_map *maps;      /* allocations and opened handles */
	uint64_t serial;            /* mixed into shm names */
	atomic_ulong opens, closes; /* successful cuIpcOpen/CloseMemHandle */
} g = {.lock = PTHREAD_RWLOCK_INITIALIZER};

/* This thread's current context. initial-exec: LeakSanitizer (gcc 12,
 * clang 14) crashes scanning the dynamic TLS of a dlopened library on
 * threads still alive at exit (the daemon's libuv workers). */
static _Thread_local struct fake_ctx *cur __attribute__((tls_model("initial-exec")));

/* ---- error names ------------------------------------------------------ */

static const struct {
	CUresult code;
	const char *name;
	const char *str; /* the driver's cuGetErrorString text */
} errors[] = {
	{CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
	{CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	{CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	{CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	{CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
	{CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	{CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
	{CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
	{CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
	{CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
	{CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
	 "OS call failed or operation not supported on this OS"},
	{CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	{CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	{CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	{CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

/* ---- small helpers ------------------------------------------------------ */

static uint32_t fnv1a(const char *s)
{
	uint32_t h = 2166136261u;
	for (; *s; s++)
		h = (h ^ (unsigned char)*s) * 16777619u;
	return h;
}

/* "/fakecuda.<hash of FAKECUDA_NAMESPACE, default uid<N>>." */
static void ns_prefix(char *out, size_t len)
{
	const char *ns = getenv("FAKECUDA_NAMESPACE");
	char uidns[32];
	if (!ns || !ns[0]) {
		snprintf(uidns, sizeof(uidns), "uid%u", (unsigned)getuid());
		ns = uidns;
	}
	snprintf(out, len, "/fakecuda.%08x.", fnv1a(ns));
}

static uint64_t splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* A physical device's UUID: fixed, distinct per index. */
static void phys_uuid(int phys, unsigned char out[16])
{
	for (int half = 0; half < 2; half++) {
		uint64_t v = splitmix64(0x66616b6563756461ull + 2 * (uint64_t)phys + half);
		for (int i = 0; i < 8; i++)
			out[half * 8 + i] = (unsigned char)(v >> (56 - 8 * i));
	}
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (41 bytes with the NUL). */
static void uuid_string(const unsigned char u[16], char out[41])
{
	char *p = out + sprintf(out, "GPU-");
	for (int i = 0; i < 16; i++) {
		if (i == 4 || i == 6 || i == 8 || i == 10)
			*p++ = '-';
		p += sprintf(p, "%02x", u[i]);
	}
}

static bool all_digits(const char *s, size_t n)
{
	if (n == 0)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!isdigit((unsigned char)s[i]))
			return false;
	return true;
}

/* "1073741824", "512M", "2G" (binary multiples). -1 when not a size. */
static int parse_size(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (!isdigit((unsigned char)*s))
		return -1;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno)
		return -1;
	static const char units[] = "kKmMgGtT"; /* 2^10, 2^20, 2^30, 2^40 */
	const char *u = *end ? strchr(units, *end) : NULL;
	int shift = u ? 10 * (1 + (int)(u - units) / 2) : 0;
	if (u)
		end++;
	if (*end || (shift && v > (UINT64_MAX >> shift)))
		return -1;
	*out = (uint64_t)v << shift;
	return 0;
}

/*
 * CUDA_VISIBLE_DEVICES as the driver reads it: a comma list of indices or
 * UUID strings ("GPU-..."; a prefix that names one device is enough). The
 * first entry that names no device (out of range, unknown, ambiguous,
 * repeated, malformed) ends the list. Unset: every device in order.
 */
static int visible_parse(const char *env, int nphys, int vis[MAX_DEVICES])
{
	int n = 0;
	if (!env) {
		for (int i = 0; i < nphys; i++)
			vis[n++] = i;
		return n;
	}
	const char *p = env;
	for (;;) {
		const char *comma = strchr(p, ',');
		size_t len = comma ? (size_t)(comma - p) : strlen(p);
		const char *tok = p;
		while (len && isspace((unsigned char)*tok))
			tok++, len--;
		while (len && isspace((unsigned char)tok[len - 1]))
			len--;
		int phys = -1;
		if (all_digits(tok, len)) {
			if (len <= 4) {
				int idx = atoi(tok);
				if (idx < nphys)
					phys = idx;
			}
		} else if (len > 4 && len <= 40 && strncmp(tok, "GPU-", 4) == 0) {
			for (int i = 0; i < nphys; i++) {
				unsigned char u[16];
				char s[41];
				phys_uuid(i, u);
				uuid_string(u, s);
				if (strncasecmp(tok, s, len) == 0) {
					if (phys >= 0) {
						phys = -1; /* ambiguous */
						break;
					}
					phys = i;
				}
			}
		}
		for (int i = 0; i < n && phys >= 0; i++)
			if (vis[i] == phys)
				phys = -1;
		if (phys < 0)
			return n;
		vis[n++] = phys;
		if (!comma || n == MAX_DEVICES)
			return n;
		p = comma + 1;
	}
}

/* A process that has freed its memory: gone, or a zombie (the driver frees a
 * process's memory at exit, before its parent reaps it). */
static bool pid_alive(pid_t pid)
{
	if (kill(pid, 0) != 0 && errno == ESRCH)
		return false;
	char path[64], buf[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return true;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return true;
	buf[n] = 0;
	const char *rp = strrchr(buf, ')');
	return !(rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'));
}

/* shm_unlink every object whose name (without '/') starts with start. */
static void unlink_matching(const char *start)
{
	DIR *d = opendir("/dev/shm");
	if (!d)
		return;
	size_t n = strlen(start);
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strncmp(e->d_name, start, n) != 0)
			continue;
		char name[NAME_MAX + 2];
		snprintf(name, sizeof(name), "/%s", e->d_name);
		shm_unlink(name);
	}
	closedir(d);
}

/* ---- device accounting (g.lock held exclusively) ------------------------- */

static void dev_lock(int phys, int op)
{
	while (flock(g.devfd[phys], op) != 0 && errno == EINTR)
		;
}

/* Bytes that living processes hold on the device. With reclaim (exclusive
 * flock), dead processes' slots are emptied and their objects unlinked. */
static uint64_t dev_used(int phys, bool reclaim)
{
	struct dev_shared *d = g.dev[phys];
	uint64_t used = 0;
	for (int i = 0; i < SLOTS; i++) {
		pid_t pid = d->slot[i].pid;
		if (!pid)
			continue;
		if (pid_alive(pid)) {
			used += d->slot[i].bytes;
		} else if (reclaim) {
			char start[64];
			snprintf(start, sizeof(start), "%.18s%u.", g.prefix + 1, (unsigned)pid);
			unlink_matching(start);
			d->slot[i].pid = 0;
			d->slot[i].bytes = 0;
		}
	}
	return used;
}

/* This process's slot on the device; claim is to take a free one. -1: none. */
static int dev_slot(int phys, bool claim)
{
	struct dev_shared *d = g.dev[phys];
	pid_t me = getpid();
	int free_slot = -1;
	for (int i = 0; i < SLOTS; i++) {
		if (d->slot[i].pid == me)
			return i;
		if (!d->slot[i].pid && free_slot < 0)
			free_slot = i;
	}
	if (claim && free_slot >= 0) {
		d->slot[free_slot].pid = me;
		d->slot[free_slot].bytes = 0;
	}
	return claim ? free_slot : -1;
}

static int dev_open(int phys)
{
	char name[64];
	snprintf(name, sizeof(name), "%sdev%d", g.prefix, phys);
	int fd = shm_open(name, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
	if (fd < 0)
		return -1;
	struct stat st;
	/* 0666: processes of other uids that share the namespace share it. */
	(void)fchmod(fd, 0666);
	if (fstat(fd, &st) != 0 || (st.st_size < (off_t)sizeof(struct dev_shared) &&
				    ftruncate(fd, sizeof(struct dev_shared)) != 0)) {
		close(fd);
		return -1;
	}
	void *p = mmap(NULL, sizeof(struct dev_shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		close(fd);
		return -1;
	}
	g.devfd[phys] = fd;
	g.dev[phys] = p;
	return 0;
}

static void dev_close_all(void)
{
	for (int i = 0; i < g.nphys; i++) {
		if (g.dev[i])
			munmap(g.dev[i], sizeof(struct dev_shared));
		if (g.devfd[i] >= 0)
			close(g.devfd[i]);
		g.dev[i] = NULL;
		g.devfd[i] = -1;
	}
}

/* ---- mappings (g.lock held exclusively) ---------------------------------- */

/* Map fd's first size bytes writable, and reserve a device address for them. */
static int map_fd(struct fake_map *m, int fd, size_t size)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	m->size = size;
	m->maplen = (size + page - 1) / page * page;
	m->data = mmap(NULL, m->maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m->data == MAP_FAILED)
		return -1;
	void *res = mmap(NULL, m->maplen, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
			 -1, 0);
	if (res == MAP_FAILED) {
		munmap(m->data, m->maplen);
		return -1;
	}
	m->dptr = (CUdeviceptr)(uintptr_t)res;
	return 0;
}

/* Unmap m and forget it; an allocation of ours is also unlinked and its
 * bytes given back to the device. */
static void map_drop(struct fake_map *m)
{
	if (!m->imported) {
		dev_lock(m->phys, LOCK_EX);
		int s = dev_slot(m->phys, false);
		if (s >= 0) {
			uint64_t *b = &g.dev[m->phys]->slot[s].bytes;
			*b = *b >= m->size ? *b - m->size : 0;
		}
		dev_lock(m->phys, LOCK_UN);
		shm_unlink(m->name); /* ENOENT after fakecuda_reset_namespace: fine */
	}
	munmap(m->data, m->maplen);
	munmap((void *)(uintptr_t)m->dptr, m->maplen);
	DL_DELETE(g.maps, m);
	free(m);
}

/* The mapping that holds [p, p + n), n >= 1. */
static struct fake_map *map_find(CUdeviceptr p, size_t n)
{
	struct fake_map *m;
	DL_FOREACH (g.maps, m) {
		if (p >= m->dptr && n <= m->size && p - m->dptr <= m->size - n)
			return m;
	}
	return NULL;
}

static struct fake_map *map_at_base(CUdeviceptr p, bool imported)
{
	struct fake_map *m;
	DL_FOREACH (g.maps, m) {
		if (m->dptr == p && m->imported == imported)
			return m;
	}
	return NULL;
}

/* ---- state checks --------------------------------------------------------- */

static CUresult need_init(void)
{
	return g.state == ST_READY ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* cuInit done and an active context current on this thread. */
static CUresult need_ctx(void)
{
	if (g.state != ST_READY)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!cur || cur->retained == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	return CUDA_SUCCESS;
}

/* One of g.ctx of an initialized device (not a stray pointer). */
static bool is_ctx(const void *p)
{
	uintptr_t a = (uintptr_t)p, base = (uintptr_t)g.ctx;
	if (a < base || a >= base + sizeof(g.ctx) || (a - base) % sizeof(struct fake_ctx))
		return false;
	return ((const struct fake_ctx *)p)->magic == CTX_MAGIC;
}

/* ---- fork and unload ------------------------------------------------------ */

static void fork_prepare(void)
{
	pthread_rwlock_wrlock(&g.lock);
}

static void fork_parent(void)
{
	pthread_rwlock_unlock(&g.lock);
}

/* The driver does not survive fork(): a child of an initialized process gets
 * CUDA_ERROR_NOT_INITIALIZED from everything, and must never free or unlink
 * what its parent owns. */
static void fork_child(void)
{
	if (g.state == ST_READY)
		g.state = ST_FORKED;
	/* Not unlock: glibc takes an unlock from another thread id (the child's)
	 * for a reader's. The child has one thread; a fresh lock is right. */
	pthread_rwlock_init(&g.lock, NULL);
}

__attribute__((constructor)) static void fake_load(void)
{
	for (int i = 0; i < MAX_DEVICES; i++)
		g.devfd[i] = -1;
	pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* dlclose or exit: free what this process allocated, as the driver does when
 * a process ends. */
__attribute__((destructor)) static void fake_unload(void)
{
	pthread_rwlock_wrlock(&g.lock);
	if (g.state == ST_READY) {
		struct fake_map *m, *tmp;
		DL_FOREACH_SAFE (g.maps, m, tmp)
			map_drop(m);
		dev_close_all();
		g.state = ST_UNINIT;
	}
	pthread_rwlock_unlock(&g.lock);
}

/* ---- initialization and devices ------------------------------------------- */

FAKECUDA_API CUresult cuDriverGetVersion(int *version)
{
	if (!version)
		return CUDA_ERROR_INVALID_VALUE;
	*version = DRIVER_VERSION;
	return CUDA_SUCCESS;
}

FAKECUDA_API CUresult cuInit(unsigned int flags)
{
	CUresult rc = CUDA_SUCCESS;
	pthread_rwlock_wrlock(&g.lock);
	if (flags != 0) {
		rc = CUDA_ERROR_INVALID_VALUE;
		goto out;
	}
	if (g.state != ST_UNINIT) {
		rc = g.state == ST_READY ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
		goto out;
	}
	const char *s = getenv("FAKECUDA_DEVICES");
	int ndev = DEFAULT_DEVICES;
	if (s && (!all_digits(s, strlen(s)) || strlen(s) > 3 || (ndev = atoi(s)) > MAX_DEVICES)) {
		fprintf(stderr, "fakecuda: FAKECUDA_DEVICES=%s: want 0..%d\n", s, MAX_DEVICES);
		rc = CUDA_ERROR_INVALID_VALUE;
		goto out;
	}
	uint64_t total = DEFAULT_MEMORY;
	s = getenv("FAKECUDA_MEMORY");
	if (s && (parse_size(s, &total) != 0 || total == 0)) {
		fprintf(stderr, "fakecuda: FAKECUDA_MEMORY=%s: want bytes (K, M, G suffixes)\n", s);
		rc = CUDA_ERROR_INVALID_VALUE;
		goto out;
	}
	g.nphys = ndev;
	g.total = total;
	g.nvis = visible_parse(getenv("CUDA_VISIBLE_DEVICES"), g.nphys, g.vis);
	if (g.nvis == 0) {
		rc = CUDA_ERROR_NO_DEVICE;
		goto out;
	}
	ns_prefix(g.prefix, sizeof(g.prefix));
	for (int i = 0; i < g.nphys; i++) {
		g.ctx[i] = (struct fake_ctx){.magic = CTX_MAGIC, .phys = i, .retained = 0};
		if (dev_open(i) != 0) {
			fprintf(stderr,
				"fakecuda: cannot open device %d's accounting in /dev/shm: %s\n", i,
				strerror(errno));
			dev_close_all();
			rc = CUDA_ERROR_OPERATING_SYSTEM;
			goto out;
		}
	}
	g.state = ST_READY;
out:
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuDeviceGetCount(int *count)
{
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_init();
	if (rc == CUDA_SUCCESS && !count)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		*count = g.nvis;
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* need_init, a valid ordinal and a non-NULL out pointer; *phys gets the device. */
static CUresult dev_check(CUdevice dev, const void *out, int *phys)
{
	CUresult rc = need_init();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (!out)
		return CUDA_ERROR_INVALID_VALUE;
	if (dev < 0 || dev >= g.nvis)
		return CUDA_ERROR_INVALID_DEVICE;
	*phys = g.vis[dev];
	return CUDA_SUCCESS;
}

FAKECUDA_API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
	int phys;
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = dev_check(ordinal, device, &phys);
	if (rc == CUDA_SUCCESS)
		*device = ordinal;
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
	int phys;
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = dev_check(dev, name, &phys);
	if (rc == CUDA_SUCCESS && len <= 0)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		snprintf(name, (size_t)len, "FakeCUDA Device %d", phys);
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
	int phys;
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = dev_check(dev, uuid, &phys);
	if (rc == CUDA_SUCCESS)
		phys_uuid(phys, (unsigned char *)uuid->bytes);
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* Without MIG both versions answer the GPU's UUID. */
FAKECUDA_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	return cuDeviceGetUuid_v2(uuid, dev);
}

FAKECUDA_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	int phys;
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = dev_check(dev, bytes, &phys);
	if (rc == CUDA_SUCCESS)
		*bytes = (size_t)g.total;
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* ---- contexts --------------------------------------------------------------- */

FAKECUDA_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
	int phys;
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = dev_check(dev, pctx, &phys);
	if (rc == CUDA_SUCCESS) {
		g.ctx[phys].retained++;
		*pctx = (CUcontext)(void *)&g.ctx[phys];
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* The last release resets the context: what was allocated or opened in it
 * is freed or closed, as the driver does. */
FAKECUDA_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
	int phys;
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_init();
	if (rc == CUDA_SUCCESS && (dev < 0 || dev >= g.nvis))
		rc = CUDA_ERROR_INVALID_DEVICE;
	if (rc == CUDA_SUCCESS) {
		phys = g.vis[dev];
		struct fake_ctx *c = &g.ctx[phys];
		if (c->retained == 0) {
			rc = CUDA_ERROR_INVALID_CONTEXT;
		} else if (--c->retained == 0) {
			struct fake_map *m, *tmp;
			DL_FOREACH_SAFE (g.maps, m, tmp) {
				if (m->ctx == c)
					map_drop(m);
			}
		}
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuCtxSetCurrent(CUcontext ctx)
{
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_init();
	if (rc == CUDA_SUCCESS && ctx && !is_ctx(ctx))
		rc = CUDA_ERROR_INVALID_CONTEXT;
	if (rc == CUDA_SUCCESS)
		cur = (struct fake_ctx *)(void *)ctx;
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_init();
	if (rc == CUDA_SUCCESS && !pctx)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		*pctx = (CUcontext)(void *)cur;
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* Every copy is synchronous: nothing to wait for but a context to check. */
FAKECUDA_API CUresult cuCtxSynchronize(void)
{
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_ctx();
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* ---- memory ----------------------------------------------------------------- */

FAKECUDA_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && (!dptr || bytesize == 0))
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc != CUDA_SUCCESS)
		goto out;
	int phys = cur->phys;
	struct fake_map *m = calloc(1, sizeof(*m));
	if (!m) {
		rc = CUDA_ERROR_OUT_OF_MEMORY;
		goto out;
	}
	dev_lock(phys, LOCK_EX);
	int slot = -1;
	if (bytesize <= g.total && dev_used(phys, true) <= g.total - bytesize)
		slot = dev_slot(phys, true);
	int fd = -1;
	for (int tries = 0; slot >= 0 && fd < 0 && tries < 8; tries++) {
		uint64_t r;
		if (getrandom(&r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r))
			r = splitmix64(++g.serial ^ (uint64_t)time(NULL));
		snprintf(m->name, sizeof(m->name), "%.19s%u.%012llx", g.prefix, (unsigned)getpid(),
			 (unsigned long long)(r & 0xffffffffffffull));
		fd = shm_open(m->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
		if (fd < 0 && errno != EEXIST)
			break;
	}
	if (fd >= 0) {
		/* Any process may open a handle, as with the driver (no uid check). */
		(void)fchmod(fd, 0666);
		if (ftruncate(fd, (off_t)bytesize) != 0 || map_fd(m, fd, bytesize) != 0) {
			shm_unlink(m->name);
			close(fd);
			fd = -1;
		}
	}
	if (fd < 0) {
		dev_lock(phys, LOCK_UN);
		free(m);
		rc = CUDA_ERROR_OUT_OF_MEMORY;
		goto out;
	}
	close(fd);
	g.dev[phys]->slot[slot].bytes += bytesize;
	dev_lock(phys, LOCK_UN);
	m->phys = phys;
	m->ctx = cur;
	DL_APPEND(g.maps, m);
	*dptr = m->dptr;
out:
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS) {
		struct fake_map *m = map_at_base(dptr, false);
		if (m)
			map_drop(m);
		else
			rc = CUDA_ERROR_INVALID_VALUE;
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* Device-wide, every process of the namespace included, as the driver's. */
FAKECUDA_API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
	/* Exclusive: flock is per open file, so two threads' shared locks would
	 * end at the first one's unlock. */
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && (!free_bytes || !total_bytes))
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS) {
		int phys = cur->phys;
		dev_lock(phys, LOCK_SH);
		uint64_t used = dev_used(phys, false);
		dev_lock(phys, LOCK_UN);
		*free_bytes = (size_t)(used < g.total ? g.total - used : 0);
		*total_bytes = (size_t)g.total;
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* Copies need the whole range inside one allocation or opened handle of
 * this process. */
FAKECUDA_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && n) {
		struct fake_map *m = src ? map_find(dst, n) : NULL;
		if (m)
			memcpy(m->data + (dst - m->dptr), src, n);
		else
			rc = CUDA_ERROR_INVALID_VALUE;
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && n) {
		struct fake_map *m = dst ? map_find(src, n) : NULL;
		if (m)
			memcpy(dst, m->data + (src - m->dptr), n);
		else
			rc = CUDA_ERROR_INVALID_VALUE;
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n)
{
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && n) {
		struct fake_map *m = map_find(dst, n);
		if (m)
			memset(m->data + (dst - m->dptr), value, n);
		else
			rc = CUDA_ERROR_INVALID_VALUE;
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* ---- IPC -------------------------------------------------------------------- */

/* The same bytes every time for one allocation; a new allocation at the same
 * address gets another handle (another shm object). */
FAKECUDA_API CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && !pHandle)
		rc = CUDA_ERROR_INVALID_VALUE;
	struct fake_map *m = rc == CUDA_SUCCESS ? map_at_base(dptr, false) : NULL;
	if (rc == CUDA_SUCCESS && !m)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS) {
		struct fake_handle h;
		memset(&h, 0, sizeof(h));
		memcpy(h.magic, handle_magic, sizeof(h.magic));
		h.pid = (uint32_t)getpid();
		h.size = m->size;
		h.phys = (uint32_t)m->phys;
		memcpy(h.name, m->name, sizeof(h.name));
		memcpy(pHandle, &h, sizeof(h));
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/*
 * Stricter than the driver in one way, on purpose: a handle already open in
 * this process gives CUDA_ERROR_ALREADY_MAPPED (the driver may count it), so
 * a client that opens twice is caught. The handle's device need not be
 * visible here (as with the driver); the mapping belongs to the current
 * context, whose device fakecuda_open_context_device reports.
 */
FAKECUDA_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
					    unsigned int Flags)
{
	struct fake_handle h;
	memcpy(&h, &handle, sizeof(h));
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		goto out;
	if (!pdptr || Flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) {
		rc = CUDA_ERROR_INVALID_VALUE;
		goto out;
	}
	if (memcmp(h.magic, handle_magic, sizeof(h.magic)) != 0 || h.size == 0 ||
	    h.phys >= MAX_DEVICES || !memchr(h.name, 0, sizeof(h.name)) ||
	    strncmp(h.name, "/fakecuda.", 10) != 0 || strchr(h.name + 1, '/')) {
		rc = CUDA_ERROR_INVALID_HANDLE;
		goto out;
	}
	if ((pid_t)h.pid == getpid()) {
		rc = CUDA_ERROR_INVALID_CONTEXT; /* the driver's answer in the exporter */
		goto out;
	}
	struct fake_map *m;
	DL_FOREACH (g.maps, m) {
		if (m->imported && strcmp(m->name, h.name) == 0) {
			rc = CUDA_ERROR_ALREADY_MAPPED;
			goto out;
		}
	}
	if (!pid_alive((pid_t)h.pid)) {
		rc = CUDA_ERROR_INVALID_HANDLE; /* its memory went with it */
		goto out;
	}
	int fd = shm_open(h.name, O_RDWR | O_CLOEXEC, 0);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) != 0 || (uint64_t)st.st_size < h.size) {
		rc = fd < 0 && errno != ENOENT ? CUDA_ERROR_MAP_FAILED : CUDA_ERROR_INVALID_HANDLE;
		if (fd >= 0)
			close(fd);
		goto out;
	}
	m = calloc(1, sizeof(*m));
	if (!m || map_fd(m, fd, (size_t)h.size) != 0) {
		free(m);
		close(fd);
		rc = CUDA_ERROR_MAP_FAILED;
		goto out;
	}
	close(fd);
	m->phys = (int)h.phys;
	m->imported = true;
	m->ctx = cur;
	memcpy(m->name, h.name, sizeof(m->name));
	DL_APPEND(g.maps, m);
	atomic_fetch_add(&g.opens, 1);
	*pdptr = m->dptr;
out:
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS) {
		struct fake_map *m = map_at_base(dptr, true);
		if (m) {
			map_drop(m);
			atomic_fetch_add(&g.closes, 1);
		} else {
			rc = CUDA_ERROR_INVALID_VALUE;
		}
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* ---- errors ----------------------------------------------------------------- */

FAKECUDA_API CUresult cuGetErrorName(CUresult error, const char **pStr)
{
	if (!pStr)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++) {
		if (errors[i].code == error) {
			*pStr = errors[i].name;
			return CUDA_SUCCESS;
		}
	}
	*pStr = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

FAKECUDA_API CUresult cuGetErrorString(CUresult error, const char **pStr)
{
	if (!pStr)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++) {
		if (errors[i].code == error) {
			*pStr = errors[i].str;
			return CUDA_SUCCESS;
		}
	}
	*pStr = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

/* ---- test hooks (not in the driver; resolve with dlsym) --------------------- */

/* Successful cuIpcOpenMemHandle / cuIpcCloseMemHandle calls in this process. */
FAKECUDA_API void fakecuda_stats(unsigned long *ipc_opens, unsigned long *ipc_closes)
{
	if (ipc_opens)
		*ipc_opens = atomic_load(&g.opens);
	if (ipc_closes)
		*ipc_closes = atomic_load(&g.closes);
}

/* The UUID of the physical device whose memory holds p (an allocation or an
 * opened handle of this process). 0, or -1 when p is in neither. */
FAKECUDA_API int fakecuda_pointer_device(CUdeviceptr p, unsigned char uuid_out[16])
{
	pthread_rwlock_rdlock(&g.lock);
	struct fake_map *m = g.state == ST_READY ? map_find(p, 1) : NULL;
	if (m)
		phys_uuid(m->phys, uuid_out);
	pthread_rwlock_unlock(&g.lock);
	return m ? 0 : -1;
}

/* The UUID of the device whose context was current when the handle holding
 * p was opened. -1 when p is not in an opened handle of this process. */
FAKECUDA_API int fakecuda_open_context_device(CUdeviceptr p, unsigned char uuid_out[16])
{
	pthread_rwlock_rdlock(&g.lock);
	struct fake_map *m = g.state == ST_READY ? map_find(p, 1) : NULL;
	if (m && !m->imported)
		m = NULL;
	if (m)
		phys_uuid(m->ctx->phys, uuid_out);
	pthread_rwlock_unlock(&g.lock);
	return m ? 0 : -1;
}

/* "fakecuda.<hash>." : every /dev/shm object of the namespace that
 * $FAKECUDA_NAMESPACE names now starts with it. */
FAKECUDA_API void fakecuda_shm_prefix(char *out, size_t len)
{
	char p[32];
	ns_prefix(p, sizeof(p));
	snprintf(out, len, "%s", p + 1);
}

/* shm_unlink every object of the namespace $FAKECUDA_NAMESPACE names now:
 * the devices' accounting and any allocation a killed process left. Call it
 * when no process of the namespace uses the fake any more (a test's end). */
FAKECUDA_API void fakecuda_reset_namespace(void)
{
	char p[32];
	ns_prefix(p, sizeof(p));
	unlink_matching(p + 1);
}
