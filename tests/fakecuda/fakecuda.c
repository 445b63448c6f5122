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
 * - VMM memory (cuMemCreate) is a memfd per physical allocation: its
 *   exported fd crosses SCM_RIGHTS, and cuMemMap of it in another process
 *   shows the same bytes through a reservation like a device pointer's.
 * - Each device's memory is accounted in one small shm object per
 *   namespace (FAKECUDA_NAMESPACE) under flock(): a table of process slots
 *   (bytes of cuMemAlloc) and one of VMM allocations (each counted once
 *   while any living process holds it). A slot lives while its process
 *   holds an OFD lock on it, which the kernel drops when the process dies,
 *   whatever PID namespace it is in. A dead process's bytes count as free
 *   (the driver frees a process's memory when it exits) and its objects
 *   are unlinked when the next allocation reclaims its slot.
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
#define VMM_ENTRIES 1024     /* VMM allocations alive on one device at once */
#define DRIVER_VERSION 13000 /* cuDriverGetVersion: CUDA 13.0 */
#define DEFAULT_DEVICES 2
#define DEFAULT_MEMORY (1ull << 30)
#define CTX_MAGIC 0x46434358u    /* "FCCX" */
#define NAME_LEN 48              /* shm name of an allocation, NUL included */
#define GRANULARITY (2ull << 20) /* VMM: minimum and recommended, as real devices */
/* cuMemExportToShareableHandle of a handle created without the type, and
 * cuMemImportFromShareableHandle of an fd that is not a fakecuda memfd of
 * this namespace: "invalid argument", as the driver answers both. */
#define VMM_NOT_REQUESTED_RC CUDA_ERROR_INVALID_VALUE
#define VMM_BAD_FD_RC CUDA_ERROR_INVALID_VALUE

static const char handle_magic[4] = {'F', 'K', 'C', 'U'};

/* A process's primary context on one physical device. */
struct fake_ctx {
	uint32_t magic; /* CTX_MAGIC: tells our contexts from stray pointers */
	int phys;       /* physical device */
	int retained;   /* cuDevicePrimaryCtxRetain count; 0: inactive */
};

/* A CUmemGenericAllocationHandle of this process (VMM): made by cuMemCreate
 * or cuMemImportFromShareableHandle. The physical memory is a memfd. Lives
 * until cuMemRelease and the last cuMemUnmap of it (or exit). */
struct fake_alloc {
	uint64_t id;     /* the physical allocation's identity, the same in every process */
	int fd;          /* the memfd (kept to export it), or -1 (imported, or not exportable) */
	char *data;      /* the bytes: the memfd mapped writable, the whole allocation */
	size_t size;     /* bytes, a multiple of GRANULARITY */
	int phys;        /* physical device */
	bool created;    /* by cuMemCreate here (not imported) */
	bool exportable; /* POSIX_FILE_DESCRIPTOR requested at create */
	bool released;   /* cuMemRelease done; lives on while mapped */
	int maps;        /* cuMemMap mappings of it */
	struct fake_alloc *prev, *next;
};

/* A cuMemAddressReserve range: PROT_NONE, as device pointers are. */
struct fake_resv {
	CUdeviceptr base;
	size_t size;
	struct fake_resv *prev, *next;
};

/* One allocation of this process, or one opened from another's handle, or
 * one VMM mapping (cuMemMap of an allocation into a reservation). */
struct fake_map {
	CUdeviceptr dptr;     /* device address: a PROT_NONE reservation */
	char *data;           /* the bytes: the shm object mapped writable */
	size_t size;          /* bytes asked for */
	size_t maplen;        /* size rounded up to pages (both mappings) */
	int phys;             /* physical device of the allocation */
	bool imported;        /* opened by cuIpcOpenMemHandle, not cuMemAlloc */
	struct fake_ctx *ctx; /* current when it was made; its reset frees it */
	char name[NAME_LEN];  /* the shm object */
	/* VMM mappings only: the allocation (data is its bytes), and the
	 * physical devices cuMemSetAccess let read and write it (bit i: device
	 * i); a copy from a context of a device without access fails. */
	struct fake_alloc *alloc;
	uint64_t rdev, wdev;
	struct fake_map *prev, *next;
};

/* The 64 bytes of a CUipcMemHandle. The exporter is known by its slot and
 * token, not its pid, which another PID namespace cannot see. */
struct fake_handle {
	char magic[4];
	uint32_t token;  /* the exporting process's token */
	uint64_t size;   /* bytes of the allocation */
	uint32_t phys;   /* its physical device */
	uint32_t slot;   /* the exporter's accounting slot on phys */
	uint64_t rnd;    /* the allocation's part of the shm name */
	uint32_t nshash; /* the namespace's hash: with token and rnd, the name */
	uint32_t pad;
	uint64_t pidns; /* the exporter's PID namespace (inode of /proc/self/ns/pid), 0: unknown */
	char reserved[16];
};
_Static_assert(sizeof(struct fake_handle) == CU_IPC_HANDLE_SIZE, "handle layout");
_Static_assert(sizeof(CUipcMemHandle) == CU_IPC_HANDLE_SIZE, "handle size");

/* A device's accounting, shared by the namespace's processes. Guarded by
 * flock() on the object's fd (the kernel drops it when a holder dies). */
struct dev_shared {
	struct {
		int32_t pid;    /* 0: a free slot; else its holder's pid, as it sees it */
		uint32_t token; /* its holder's token: the shm names of its allocations */
		uint64_t bytes; /* what pid holds on the device (cuMemAlloc) */
	} slot[SLOTS];
	/* VMM allocations: each counts once while any living process holds a
	 * handle or mapping of it (its creator or an importer). */
	struct {
		uint64_t id; /* 0: a free entry */
		uint64_t bytes;
		uint64_t holders[SLOTS / 64]; /* bit i: slot i's process holds it */
	} vmm[VMM_ENTRIES];
};

/* The calls fakecuda_vmm_calls counts, by name. */
enum {
	VC_ATTRIBUTE,
	VC_GRANULARITY,
	VC_CREATE,
	VC_RELEASE,
	VC_EXPORT,
	VC_IMPORT,
	VC_RESERVE,
	VC_ADDRESS_FREE,
	VC_MAP,
	VC_UNMAP,
	VC_SET_ACCESS,
	VC_COUNT
};
static const char *const vmm_call_names[VC_COUNT] = {
	[VC_ATTRIBUTE] = "cuDeviceGetAttribute",
	[VC_GRANULARITY] = "cuMemGetAllocationGranularity",
	[VC_CREATE] = "cuMemCreate",
	[VC_RELEASE] = "cuMemRelease",
	[VC_EXPORT] = "cuMemExportToShareableHandle",
	[VC_IMPORT] = "cuMemImportFromShareableHandle",
	[VC_RESERVE] = "cuMemAddressReserve",
	[VC_ADDRESS_FREE] = "cuMemAddressFree",
	[VC_MAP] = "cuMemMap",
	[VC_UNMAP] = "cuMemUnmap",
	[VC_SET_ACCESS] = "cuMemSetAccess",
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
	struct fake_map *maps;            /* allocations, opened handles, VMM mappings */
	struct fake_alloc *allocs;        /* VMM allocation handles */
	struct fake_resv *resvs;          /* VMM address reservations */
	uint64_t vmm_fd;                  /* physical devices with POSIX-fd export (bit i) */
	int myslot[MAX_DEVICES];          /* this process's accounting slot per device, or -1 */
	uint32_t token;                   /* this process's token: names its shm objects */
	uint64_t pidns;                   /* inode of /proc/self/ns/pid, 0: unknown */
	bool strict_ns;                   /* FAKECUDA_LEGACY_IPC_NAMESPACE=strict */
	uint64_t serial;                  /* mixed into shm names */
	atomic_ulong opens, closes;       /* successful cuIpcOpen/CloseMemHandle */
	atomic_ulong vmm_calls[VC_COUNT]; /* calls of each of vmm_call_names, any outcome */
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

/*
 * A slot's liveness: its holder keeps a read lock (an OFD lock, owned by its
 * open file of the device's object) on byte SLOT_LOCK + i of that object. The
 * kernel drops it when the process exits (a zombie holds no files), and
 * any process sees it, whatever PID namespace either is in.
 */
#define SLOT_LOCK ((off_t)sizeof(struct dev_shared))

static bool slot_alive(int phys, int i)
{
	if (!g.dev[phys]->slot[i].pid)
		return false;
	if (i == g.myslot[phys])
		return true; /* our own lock conflicts with nothing of ours */
	struct flock fl = {
		.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = SLOT_LOCK + i, .l_len = 1};
	if (fcntl(g.devfd[phys], F_OFD_GETLK, &fl) != 0)
		return true; /* cannot tell: keep its memory */
	return fl.l_type != F_UNLCK;
}

/* Empty a dead process's slot: unlink its objects, forget its bytes. */
static void slot_reclaim(int phys, int i)
{
	struct dev_shared *d = g.dev[phys];
	char start[64];
	snprintf(start, sizeof(start), "%.18s%08x.", g.prefix + 1, (unsigned)d->slot[i].token);
	unlink_matching(start);
	d->slot[i].pid = 0;
	d->slot[i].token = 0;
	d->slot[i].bytes = 0;
	for (int e = 0; e < VMM_ENTRIES; e++)
		d->vmm[e].holders[i / 64] &= ~(1ull << (i % 64));
}

/* Bytes that living processes hold on the device. With reclaim (exclusive
 * flock), dead processes' slots are emptied and their objects unlinked. */
static uint64_t dev_used(int phys, bool reclaim)
{
	struct dev_shared *d = g.dev[phys];
	uint64_t used = 0;
	for (int i = 0; i < SLOTS; i++) {
		if (!d->slot[i].pid)
			continue;
		if (slot_alive(phys, i))
			used += d->slot[i].bytes;
		else if (reclaim)
			slot_reclaim(phys, i);
	}
	for (int e = 0; e < VMM_ENTRIES; e++) {
		if (!d->vmm[e].id)
			continue;
		bool held = false;
		for (int w = 0; w < SLOTS / 64 && !held; w++) {
			for (uint64_t b = d->vmm[e].holders[w]; b && !held; b &= b - 1) {
				held = slot_alive(phys, w * 64 + __builtin_ctzll(b));
			}
		}
		if (held)
			used += d->vmm[e].bytes;
		else if (reclaim)
			memset(&d->vmm[e], 0, sizeof(d->vmm[e]));
	}
	return used;
}

/* This process's slot on the device; claim is to take a free one (or a
 * dead process's). -1: none. */
static int dev_slot(int phys, bool claim)
{
	struct dev_shared *d = g.dev[phys];
	if (g.myslot[phys] >= 0 || !claim)
		return g.myslot[phys];
	for (int i = 0; i < SLOTS; i++) {
		if (d->slot[i].pid && slot_alive(phys, i))
			continue;
		struct flock fl = {.l_type = F_RDLCK,
				   .l_whence = SEEK_SET,
				   .l_start = SLOT_LOCK + i,
				   .l_len = 1};
		if (fcntl(g.devfd[phys], F_OFD_SETLK, &fl) != 0)
			continue;
		if (d->slot[i].pid)
			slot_reclaim(phys, i);
		d->slot[i].pid = (int32_t)getpid();
		d->slot[i].token = g.token;
		d->slot[i].bytes = 0;
		g.myslot[phys] = i;
		return i;
	}
	return -1;
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
		g.myslot[i] = -1;
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
#ifndef FAKECUDA_NO_VMM
static void alloc_unref(struct fake_alloc *a);
#endif

static void map_drop(struct fake_map *m)
{
#ifndef FAKECUDA_NO_VMM
	if (m->alloc) {
		struct fake_alloc *a = m->alloc;
		DL_DELETE(g.maps, m);
		free(m);
		a->maps--;
		alloc_unref(a);
		return;
	}
#endif
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

/* The mapping that holds [p, p + n) for a copy in the current context: a
 * VMM mapping only where cuMemSetAccess let the context's device read it
 * (write: and write it). */
static struct fake_map *map_copy(CUdeviceptr p, size_t n, bool write)
{
	struct fake_map *m = map_find(p, n);
	if (m && m->alloc && !((write ? m->wdev : m->rdev) & (1ull << cur->phys)))
		return NULL;
	return m;
}

static struct fake_map *map_at_base(CUdeviceptr p, bool imported)
{
	struct fake_map *m;
	DL_FOREACH (g.maps, m) {
		if (m->dptr == p && m->imported == imported && !m->alloc)
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

/* ---- VMM allocations (g.lock held exclusively) ---------------------------- */
#ifndef FAKECUDA_NO_VMM

/* Mark this process a holder of VMM allocation id on phys (on), or not any
 * more (off: the entry goes with its last holder). -1 when the device's
 * tables are full. */
static int vmm_hold_locked(int phys, uint64_t id, uint64_t bytes, bool on)
{
	struct dev_shared *d = g.dev[phys];
	int rc = 0;
	int slot = dev_slot(phys, on);
	int e, free_e = -1;
	for (e = 0; e < VMM_ENTRIES && d->vmm[e].id != id; e++)
		if (!d->vmm[e].id && free_e < 0)
			free_e = e;
	if (on && e == VMM_ENTRIES && free_e >= 0) {
		e = free_e;
		d->vmm[e].id = id;
		d->vmm[e].bytes = bytes;
	}
	if (slot < 0 || e == VMM_ENTRIES) {
		rc = on ? -1 : 0;
	} else if (on) {
		d->vmm[e].holders[slot / 64] |= 1ull << (slot % 64);
	} else {
		d->vmm[e].holders[slot / 64] &= ~(1ull << (slot % 64));
		bool any = false;
		for (int w = 0; w < SLOTS / 64; w++)
			any = any || d->vmm[e].holders[w];
		if (!any)
			memset(&d->vmm[e], 0, sizeof(d->vmm[e]));
	}
	return rc;
}

static int vmm_hold(int phys, uint64_t id, uint64_t bytes, bool on)
{
	dev_lock(phys, LOCK_EX);
	int rc = vmm_hold_locked(phys, id, bytes, on);
	dev_lock(phys, LOCK_UN);
	return rc;
}

/* Another handle of this process on the same physical allocation as a. */
static bool alloc_twin(const struct fake_alloc *a)
{
	const struct fake_alloc *o;
	DL_FOREACH (g.allocs, o) {
		if (o != a && o->id == a->id)
			return true;
	}
	return false;
}

/* A live (not released) handle of this process. */
static struct fake_alloc *alloc_find(CUmemGenericAllocationHandle h)
{
	struct fake_alloc *a;
	DL_FOREACH (g.allocs, a) {
		if ((CUmemGenericAllocationHandle)(uintptr_t)a == h && !a->released)
			return a;
	}
	return NULL;
}

/* Free a once released and unmapped: its bytes stay alive while another
 * process holds a handle, mapping or fd of the memfd. */
static void alloc_unref(struct fake_alloc *a)
{
	if (!a->released || a->maps > 0)
		return;
	munmap(a->data, a->size);
	if (a->fd >= 0)
		close(a->fd);
	DL_DELETE(g.allocs, a);
	if (!alloc_twin(a))
		vmm_hold(a->phys, a->id, a->size, false);
	free(a);
}

static void vmm_unload(void)
{
	struct fake_alloc *a, *at;
	DL_FOREACH_SAFE (g.allocs, a, at) {
		a->released = true;
		alloc_unref(a);
	}
	struct fake_resv *r, *rt;
	DL_FOREACH_SAFE (g.resvs, r, rt) {
		munmap((void *)(uintptr_t)r->base, r->size);
		DL_DELETE(g.resvs, r);
		free(r);
	}
}
#endif /* FAKECUDA_NO_VMM */

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
		g.devfd[i] = g.myslot[i] = -1;
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
#ifndef FAKECUDA_NO_VMM
		vmm_unload();
#endif
		dev_close_all();
		g.state = ST_UNINIT;
	}
	pthread_rwlock_unlock(&g.lock);
}

/* ---- initialization and devices ------------------------------------------- */

/* FAKECUDA_VMM_FD (0: no device exports POSIX fds; 1, the default: every
 * one) and FAKECUDA_VMM_FD_LACKING (a comma list of physical devices that
 * do not) into a mask of the devices that do (bit i: device i). */
static int vmm_fd_parse(uint64_t *mask)
{
	const char *s = getenv("FAKECUDA_VMM_FD");
	if (s && strcmp(s, "0") != 0 && strcmp(s, "1") != 0) {
		fprintf(stderr, "fakecuda: FAKECUDA_VMM_FD=%s: want 0 or 1\n", s);
		return -1;
	}
	*mask = s && strcmp(s, "0") == 0 ? 0 : ~0ull;
	const char *p = getenv("FAKECUDA_VMM_FD_LACKING");
	while (p && *p) {
		size_t len = strcspn(p, ",");
		if (!all_digits(p, len) || len > 2 || atoi(p) >= MAX_DEVICES) {
			fprintf(stderr,
				"fakecuda: FAKECUDA_VMM_FD_LACKING=%s: want device indices\n",
				getenv("FAKECUDA_VMM_FD_LACKING"));
			return -1;
		}
		*mask &= ~(1ull << atoi(p));
		p += len + (p[len] == ',');
	}
	return 0;
}

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
	if (vmm_fd_parse(&g.vmm_fd) != 0) {
		rc = CUDA_ERROR_INVALID_VALUE;
		goto out;
	}
	s = getenv("FAKECUDA_LEGACY_IPC_NAMESPACE");
	if (s && strcmp(s, "strict") != 0 && strcmp(s, "permissive") != 0) {
		fprintf(stderr,
			"fakecuda: FAKECUDA_LEGACY_IPC_NAMESPACE=%s: want strict or permissive\n",
			s);
		rc = CUDA_ERROR_INVALID_VALUE;
		goto out;
	}
	g.strict_ns = s && strcmp(s, "strict") == 0;
	struct stat nst;
	g.pidns = stat("/proc/self/ns/pid", &nst) == 0 ? (uint64_t)nst.st_ino : 0;
	while (!g.token) {
		if (getrandom(&g.token, sizeof(g.token), GRND_NONBLOCK) != (ssize_t)sizeof(g.token))
			g.token = (uint32_t)splitmix64(++g.serial ^ (uint64_t)time(NULL) ^
						       (uint64_t)getpid());
	}
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
		snprintf(m->name, sizeof(m->name), "%.19s%08x.%016llx", g.prefix, (unsigned)g.token,
			 (unsigned long long)r);
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
		struct fake_map *m = src ? map_copy(dst, n, true) : NULL;
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
		struct fake_map *m = dst ? map_copy(src, n, false) : NULL;
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
		struct fake_map *m = map_copy(dst, n, true);
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
		h.token = g.token;
		h.size = m->size;
		h.phys = (uint32_t)m->phys;
		h.slot = (uint32_t)g.myslot[m->phys];
		unsigned tok;
		unsigned long long rnd;
		sscanf(m->name, "/fakecuda.%8x.%8x.%16llx", &h.nshash, &tok, &rnd);
		h.rnd = rnd;
		h.pidns = g.pidns;
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
	    h.phys >= (uint32_t)g.nphys || h.slot >= SLOTS || !h.token) {
		rc = CUDA_ERROR_INVALID_HANDLE;
		goto out;
	}
	if (h.token == g.token) {
		rc = CUDA_ERROR_INVALID_CONTEXT; /* the driver's answer in the exporter */
		goto out;
	}
	/* Across PID namespaces the driver refuses legacy IPC: it answers
	 * "invalid device context" (CUDA_ERROR_INVALID_CONTEXT), as a process
	 * in an isolated container reports. Only with the strict knob. */
	if (g.strict_ns && h.pidns && g.pidns && h.pidns != g.pidns) {
		rc = CUDA_ERROR_INVALID_CONTEXT;
		goto out;
	}
	char name[NAME_LEN];
	snprintf(name, sizeof(name), "/fakecuda.%08x.%08x.%016llx", (unsigned)h.nshash,
		 (unsigned)h.token, (unsigned long long)h.rnd);
	struct fake_map *m;
	DL_FOREACH (g.maps, m) {
		if (m->imported && strcmp(m->name, name) == 0) {
			rc = CUDA_ERROR_ALREADY_MAPPED;
			goto out;
		}
	}
	dev_lock((int)h.phys, LOCK_SH);
	bool alive = g.dev[h.phys]->slot[h.slot].token == h.token &&
		     slot_alive((int)h.phys, (int)h.slot);
	dev_lock((int)h.phys, LOCK_UN);
	if (!alive) {
		rc = CUDA_ERROR_INVALID_HANDLE; /* its memory went with it */
		goto out;
	}
	int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
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
	memcpy(m->name, name, sizeof(m->name));
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

/* ---- virtual memory management (cuMemCreate and its family) ---------------- */

/*
 * A physical allocation is a memfd named
 * "fakecuda.<namespace hash>.vmm.<physical device>.<bytes>.<id>", so the
 * fd that cuMemExportToShareableHandle gives really crosses SCM_RIGHTS, and
 * import checks by the name that the fd is one of ours. The memory lives
 * while any fd, handle or mapping of it lives, in any process (the kernel's
 * count of the memfd). The device accounting counts it once while any
 * living process of the namespace holds a handle or mapping of it.
 */

#define VMM_NAME_FMT "%.18svmm.%d.%zu.%016llx"

#ifndef FAKECUDA_NO_VMM
/* prop as cuMemCreate and cuMemGetAllocationGranularity take it; *phys gets
 * the device of prop->location.id. */
static CUresult prop_check(const CUmemAllocationProp *prop, int *phys)
{
	if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
	    prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
		return CUDA_ERROR_INVALID_VALUE;
	if (prop->location.id < 0 || prop->location.id >= g.nvis)
		return CUDA_ERROR_INVALID_DEVICE;
	*phys = g.vis[prop->location.id];
	return CUDA_SUCCESS;
}
#endif

FAKECUDA_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
	atomic_fetch_add(&g.vmm_calls[VC_ATTRIBUTE], 1);
	int phys;
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = dev_check(dev, pi, &phys);
	if (rc != CUDA_SUCCESS)
		goto out;
	switch ((int)attrib) {
	case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *pi = 1; break;
#ifndef FAKECUDA_NO_VMM
	case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *pi = 1; break;
	case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
		*pi = (g.vmm_fd >> phys) & 1 ? 1 : 0;
		break;
#endif
	default: /* an attribute the fake (or, without VMM, an old driver) does not know */
		rc = CUDA_ERROR_INVALID_VALUE;
	}
out:
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

#ifndef FAKECUDA_NO_VMM
FAKECUDA_API CUresult cuMemGetAllocationGranularity(size_t *granularity,
						    const CUmemAllocationProp *prop,
						    CUmemAllocationGranularity_flags option)
{
	atomic_fetch_add(&g.vmm_calls[VC_GRANULARITY], 1);
	int phys;
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_init();
	if (rc == CUDA_SUCCESS &&
	    (!granularity || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
			      option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		rc = prop_check(prop, &phys);
	if (rc == CUDA_SUCCESS)
		*granularity = (size_t)GRANULARITY;
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
				  const CUmemAllocationProp *prop, unsigned long long flags)
{
	atomic_fetch_add(&g.vmm_calls[VC_CREATE], 1);
	int phys = -1;
	struct fake_alloc *a = NULL;
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && (!handle || flags != 0 || size == 0 || size % GRANULARITY))
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		rc = prop_check(prop, &phys);
	if (rc == CUDA_SUCCESS &&
	    ((prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ||
	     ((prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) &&
	      !((g.vmm_fd >> phys) & 1))))
		rc = CUDA_ERROR_NOT_SUPPORTED;
	if (rc != CUDA_SUCCESS)
		goto out;
	rc = CUDA_ERROR_OUT_OF_MEMORY;
	if (!(a = calloc(1, sizeof(*a))))
		goto out;
	a->fd = -1;
	do {
		if (getrandom(&a->id, sizeof(a->id), GRND_NONBLOCK) != (ssize_t)sizeof(a->id))
			a->id = splitmix64(++g.serial ^ (uint64_t)time(NULL) ^ (uint64_t)getpid());
	} while (!a->id);
	char name[96];
	snprintf(name, sizeof(name), VMM_NAME_FMT, g.prefix + 1, phys, size,
		 (unsigned long long)a->id);
	/* Room on the device (every living holder's allocations) and in its
	 * tables; the entry is ours while the lock is held. */
	dev_lock(phys, LOCK_EX);
	bool room = size <= g.total && dev_used(phys, true) <= g.total - size;
	int fd = room ? memfd_create(name, MFD_CLOEXEC) : -1;
	a->data = MAP_FAILED;
	if (fd >= 0 && (ftruncate(fd, (off_t)size) != 0 ||
			(a->data = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
				MAP_FAILED ||
			vmm_hold_locked(phys, a->id, size, true) != 0)) {
		if (a->data != MAP_FAILED)
			munmap(a->data, size);
		close(fd);
		fd = -1;
	}
	dev_lock(phys, LOCK_UN);
	if (fd < 0)
		goto out;
	a->size = size;
	a->phys = phys;
	a->created = true;
	a->exportable = prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	if (a->exportable)
		a->fd = fd;
	else
		close(fd);
	DL_APPEND(g.allocs, a);
	*handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
	a = NULL;
	rc = CUDA_SUCCESS;
out:
	free(a);
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
	atomic_fetch_add(&g.vmm_calls[VC_RELEASE], 1);
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	struct fake_alloc *a = rc == CUDA_SUCCESS ? alloc_find(handle) : NULL;
	if (rc == CUDA_SUCCESS && !a)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS) {
		a->released = true;
		alloc_unref(a);
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* A new fd per call, the caller's to close. Only for a handle created here
 * with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested. */
FAKECUDA_API CUresult cuMemExportToShareableHandle(void *shareableHandle,
						   CUmemGenericAllocationHandle handle,
						   CUmemAllocationHandleType handleType,
						   unsigned long long flags)
{
	atomic_fetch_add(&g.vmm_calls[VC_EXPORT], 1);
	pthread_rwlock_rdlock(&g.lock);
	CUresult rc = need_ctx();
	struct fake_alloc *a = rc == CUDA_SUCCESS ? alloc_find(handle) : NULL;
	if (rc == CUDA_SUCCESS && (!a || !shareableHandle || flags != 0 ||
				   handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS && !a->exportable)
		rc = VMM_NOT_REQUESTED_RC;
	if (rc == CUDA_SUCCESS) {
		int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
		if (fd < 0)
			rc = CUDA_ERROR_OPERATING_SYSTEM;
		else
			memcpy(shareableHandle, &fd, sizeof(fd));
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* The fd stays the caller's. It must be a fakecuda memfd of this
 * namespace, whole. */
FAKECUDA_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
						     void *osHandle,
						     CUmemAllocationHandleType shHandleType)
{
	atomic_fetch_add(&g.vmm_calls[VC_IMPORT], 1);
	struct fake_alloc *a = NULL;
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS &&
	    (!handle || shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc != CUDA_SUCCESS)
		goto out;
	rc = VMM_BAD_FD_RC;
	int fd = (int)(intptr_t)osHandle;
	char path[64], link[256], want[64];
	struct stat st;
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	ssize_t n = fd >= 0 && fstat(fd, &st) == 0 ? readlink(path, link, sizeof(link) - 1) : -1;
	if (n <= 0)
		goto out;
	link[n] = 0;
	int phys, used = 0;
	size_t size;
	unsigned long long id;
	snprintf(want, sizeof(want), "/memfd:%.18svmm.", g.prefix + 1);
	if (strncmp(link, want, strlen(want)) != 0 ||
	    sscanf(link + strlen(want), "%d.%zu.%llx%n", &phys, &size, &id, &used) != 3 ||
	    (link[strlen(want) + used] && strcmp(link + strlen(want) + used, " (deleted)") != 0) ||
	    phys < 0 || phys >= g.nphys || !size || size % GRANULARITY || !id ||
	    st.st_size != (off_t)size)
		goto out;
	rc = CUDA_ERROR_OUT_OF_MEMORY;
	if (!(a = calloc(1, sizeof(*a))))
		goto out;
	a->fd = -1;
	a->id = id;
	a->size = size;
	a->phys = phys;
	a->data = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (a->data == MAP_FAILED)
		goto out;
	if (!alloc_twin(a) && vmm_hold(phys, id, size, true) != 0) {
		munmap(a->data, size);
		goto out;
	}
	DL_APPEND(g.allocs, a);
	*handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
	a = NULL;
	rc = CUDA_SUCCESS;
out:
	free(a);
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

FAKECUDA_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
					  CUdeviceptr addr, unsigned long long flags)
{
	atomic_fetch_add(&g.vmm_calls[VC_RESERVE], 1);
	(void)addr; /* a hint; the fake takes whatever the kernel gives */
	struct fake_resv *r = NULL;
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && (!ptr || size == 0 || size % GRANULARITY || flags != 0 ||
				   (alignment & (alignment - 1))))
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc != CUDA_SUCCESS)
		goto out;
	size_t align = alignment > GRANULARITY ? alignment : (size_t)GRANULARITY;
	rc = CUDA_ERROR_OUT_OF_MEMORY;
	if (size > SIZE_MAX - align || !(r = calloc(1, sizeof(*r))))
		goto out;
	char *p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
		       -1, 0);
	if (p == MAP_FAILED)
		goto out;
	uintptr_t base = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
	if (base > (uintptr_t)p)
		munmap(p, base - (uintptr_t)p);
	if ((uintptr_t)p + size + align > base + size)
		munmap((void *)(base + size), (uintptr_t)p + size + align - (base + size));
	r->base = (CUdeviceptr)base;
	r->size = size;
	DL_APPEND(g.resvs, r);
	*ptr = r->base;
	r = NULL;
	rc = CUDA_SUCCESS;
out:
	free(r);
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* The VMM mapping that overlaps [p, p + n), n >= 1, from `from` on. */
static struct fake_map *vmm_overlap(struct fake_map *from, CUdeviceptr p, size_t n)
{
	for (struct fake_map *m = from; m; m = m->next) {
		if (m->alloc && m->dptr < p + n && p < m->dptr + m->size)
			return m;
	}
	return NULL;
}

/* The whole of one reservation, with nothing mapped in it. */
FAKECUDA_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
	atomic_fetch_add(&g.vmm_calls[VC_ADDRESS_FREE], 1);
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	struct fake_resv *r = NULL;
	if (rc == CUDA_SUCCESS) {
		DL_FOREACH (g.resvs, r) {
			if (r->base == ptr && r->size == size)
				break;
		}
		if (!r || vmm_overlap(g.maps, ptr, size))
			rc = CUDA_ERROR_INVALID_VALUE;
	}
	if (rc == CUDA_SUCCESS) {
		munmap((void *)(uintptr_t)r->base, r->size);
		DL_DELETE(g.resvs, r);
		free(r);
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* The whole allocation (offset 0, its size), at a granularity-aligned place
 * of one reservation where nothing is mapped. No access until
 * cuMemSetAccess. */
FAKECUDA_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			       CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	atomic_fetch_add(&g.vmm_calls[VC_MAP], 1);
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	struct fake_alloc *a = rc == CUDA_SUCCESS ? alloc_find(handle) : NULL;
	struct fake_resv *r = NULL;
	if (rc == CUDA_SUCCESS && a && size == a->size && offset == 0 && flags == 0) {
		DL_FOREACH (g.resvs, r) {
			if (ptr >= r->base && ptr - r->base <= r->size &&
			    size <= r->size - (ptr - r->base))
				break;
		}
	}
	if (rc == CUDA_SUCCESS &&
	    (!r || (ptr - r->base) % GRANULARITY || vmm_overlap(g.maps, ptr, size)))
		rc = CUDA_ERROR_INVALID_VALUE;
	struct fake_map *m = rc == CUDA_SUCCESS ? calloc(1, sizeof(*m)) : NULL;
	if (rc == CUDA_SUCCESS && !m)
		rc = CUDA_ERROR_OUT_OF_MEMORY;
	if (rc == CUDA_SUCCESS) {
		m->dptr = ptr;
		m->data = a->data;
		m->size = m->maplen = size;
		m->phys = a->phys;
		m->alloc = a;
		a->maps++;
		DL_APPEND(g.maps, m);
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* Whole mappings only: [ptr, ptr + size) must hold at least one and cut
 * none. */
FAKECUDA_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	atomic_fetch_add(&g.vmm_calls[VC_UNMAP], 1);
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS &&
	    (size == 0 || ptr + size < ptr || !vmm_overlap(g.maps, ptr, size)))
		rc = CUDA_ERROR_INVALID_VALUE;
	for (struct fake_map *m = rc == CUDA_SUCCESS ? vmm_overlap(g.maps, ptr, size) : NULL; m;
	     m = vmm_overlap(m->next, ptr, size)) {
		if (m->dptr < ptr || m->dptr + m->size > ptr + size)
			rc = CUDA_ERROR_INVALID_VALUE;
	}
	if (rc == CUDA_SUCCESS) {
		struct fake_map *m, *tmp;
		DL_FOREACH_SAFE (g.maps, m, tmp) {
			if (m->alloc && m->dptr >= ptr && m->dptr + m->size <= ptr + size)
				map_drop(m);
		}
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}

/* [ptr, ptr + size) must be whole mappings, with no gap. Each descriptor
 * sets one device's access (none, read, read-write). */
FAKECUDA_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
				     size_t count)
{
	atomic_fetch_add(&g.vmm_calls[VC_SET_ACCESS], 1);
	pthread_rwlock_wrlock(&g.lock);
	CUresult rc = need_ctx();
	if (rc == CUDA_SUCCESS && (!desc || count == 0 || size == 0 || ptr + size < ptr))
		rc = CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; rc == CUDA_SUCCESS && i < count; i++) {
		if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
		    (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
		     desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
		     desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
			rc = CUDA_ERROR_INVALID_VALUE;
		else if (desc[i].location.id < 0 || desc[i].location.id >= g.nvis)
			rc = CUDA_ERROR_INVALID_DEVICE;
	}
	size_t covered = 0;
	for (struct fake_map *m = rc == CUDA_SUCCESS ? vmm_overlap(g.maps, ptr, size) : NULL; m;
	     m = vmm_overlap(m->next, ptr, size)) {
		if (m->dptr < ptr || m->dptr + m->size > ptr + size)
			rc = CUDA_ERROR_INVALID_VALUE;
		covered += m->size;
	}
	if (rc == CUDA_SUCCESS && covered != size)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS) {
		struct fake_map *m;
		DL_FOREACH (g.maps, m) {
			if (!m->alloc || m->dptr < ptr || m->dptr + m->size > ptr + size)
				continue;
			for (size_t i = 0; i < count; i++) {
				uint64_t bit = 1ull << g.vis[desc[i].location.id];
				m->rdev = desc[i].flags & CU_MEM_ACCESS_FLAGS_PROT_READ
						  ? m->rdev | bit
						  : m->rdev & ~bit;
				m->wdev = desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE
						  ? m->wdev | bit
						  : m->wdev & ~bit;
			}
		}
	}
	pthread_rwlock_unlock(&g.lock);
	return rc;
}
#endif /* FAKECUDA_NO_VMM */

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

/* Calls of the VMM entry point `name` (cuMemCreate and its family,
 * cuDeviceGetAttribute, cuMemGetAllocationGranularity) this process made,
 * whatever they returned: what a client's driver work costs. (unsigned
 * long)-1 for a name it does not count. */
FAKECUDA_API unsigned long fakecuda_vmm_calls(const char *name)
{
	for (int i = 0; i < VC_COUNT; i++) {
		if (name && strcmp(name, vmm_call_names[i]) == 0)
			return atomic_load(&g.vmm_calls[i]);
	}
	return (unsigned long)-1;
}

/* The UUID of the physical device whose memory holds p (an allocation, an
 * opened handle or a VMM mapping of this process). 0, or -1 when p is in
 * none. */
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
