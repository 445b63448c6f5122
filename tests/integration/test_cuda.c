/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA buffers end to end: a real bufbrokerd with its CUDA backend, and
 * client processes that map what it hands out, against the driver named by
 * $BUFBROKER_CUDA_LIBRARY. ctest points BB_FAKECUDA at tests/fakecuda's
 * libfakecuda.so and every test runs against it; with BB_REAL_CUDA=1 and
 * no BB_FAKECUDA the same tests run against the real driver, except the
 * checks that need the fake's test hooks, which are skipped.
 *
 * ctest runs this program twice: integration.test_cuda with the daemons'
 * default handle kind (legacy IPC handles) and integration.test_cuda_vmm
 * with BBT_CUDA_HANDLE=vmm (harness.h), where every buffer bb_alloc makes
 * is a VMM allocation's: the same tests, with what is kind-specific (the
 * handle's accessor, the driver calls counted) checked for that kind. The
 * tests that ask for a kind themselves (bb_alloc_cuda) run in both.
 *
 * Every CUDA call happens in forked children; the test process itself
 * never loads the driver (a real driver cannot be used in a child forked
 * after the parent initialized it). Children report through exit codes: 0
 * is success, any other value names the step that failed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client_internal.h"
#include "cuda_api.h"
#include "harness.h"

#define CHILD_TIMEOUT_MS 15000
#define MIB (1024u * 1024u)
#define MAX_DEVS 8
#define MAX_IDS 64

/* ---- environment ------------------------------------------------------- */

static bool g_fake; /* the driver is libfakecuda.so: its test hooks exist */
static bool g_vmm;  /* bb_alloc makes VMM buffers (BBT_CUDA_HANDLE=vmm) */

/* After the daemon is gone: remove what the test's fake namespace left in
 * /dev/shm (allocations of killed processes, the devices' accounting). */
static void cuda_fini(void)
{
	bbt_cleanup_fakecuda(g_fake);
}

TestSuite(cuda, .fini = cuda_fini, .timeout = 90);

/* Point daemon and clients at the driver under test, in a fake namespace of
 * this test's own (so parallel tests never share device accounting), with
 * every device visible. fake_memory: FAKECUDA_MEMORY, or NULL for the
 * fake's default. Call before bbt_start: the daemon inherits it. */
static void cuda_env(const char *fake_memory)
{
	static int seq;
	const char *fake = getenv("BB_FAKECUDA");
	char ns[64];

	unsetenv("CUDA_VISIBLE_DEVICES");
	unsetenv("FAKECUDA_LEGACY_IPC_NAMESPACE");
	g_vmm = bbt_cuda_handle() && strcmp(bbt_cuda_handle(), "vmm") == 0;
	if (fake && fake[0]) {
		g_fake = true;
		snprintf(ns, sizeof(ns), "bbt%d_%d", (int)getpid(), ++seq);
		setenv("BUFBROKER_CUDA_LIBRARY", fake, 1);
		setenv("FAKECUDA_NAMESPACE", ns, 1);
		setenv("FAKECUDA_DEVICES", "2", 1);
		if (fake_memory)
			setenv("FAKECUDA_MEMORY", fake_memory, 1);
		else
			unsetenv("FAKECUDA_MEMORY");
		return;
	}
	cr_assert(getenv("BB_REAL_CUDA"),
		  "BB_FAKECUDA is not set (ctest sets it to the built libfakecuda.so); "
		  "set BB_REAL_CUDA=1 to run against the real driver");
	g_fake = false;
}

/* Skip what only the fake can show. */
#define NEED_FAKE()                                                     \
	do {                                                            \
		if (!g_fake)                                            \
			cr_skip_test("needs libfakecuda's test hooks"); \
	} while (0)

/* ---- the daemon's view -------------------------------------------------- */

typedef struct devinfo {
	int ordinal;
	unsigned char uuid[16];
	uint64_t total, used, reserved, limit;
} devinfo;

typedef struct devstat {
	int n;               /* devices the daemon serves */
	devinfo d[MAX_DEVS]; /* by position in ServerStatus */
	char cuda[256];      /* ServerStatus.cuda: why CUDA is not served, "" when it is */
	uint64_t buffers;    /* live buffers, all kinds */
} devstat;

/* ServerStatus through the library's raw path: 0 or the error. */
static int dev_status(bb_client *c, devstat *out)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__ServerStatus ss = BUFBROKER__SERVER_STATUS__INIT;
	Bufbroker__Response *resp = NULL;
	int rc;

	memset(out, 0, sizeof(*out));
	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &ss;
	rc = bbc_call(c, &req, -1, &resp, NULL);
	if (rc)
		return rc;
	if (!resp->status || resp->status->code != 0) {
		rc = resp->status ? resp->status->code : BB_ERR_PROTOCOL;
	} else if (resp->result_case != BUFBROKER__RESPONSE__RESULT_SERVER_STATUS) {
		rc = BB_ERR_PROTOCOL;
	} else {
		const Bufbroker__ServerStatusReply *s = resp->server_status;

		for (size_t i = 0; i < s->n_kinds; i++)
			out->buffers += s->kinds[i]->buffers;
		snprintf(out->cuda, sizeof(out->cuda), "%s", s->cuda ? s->cuda : "");
		for (size_t i = 0; i < s->n_devices && i < MAX_DEVS; i++) {
			const Bufbroker__DeviceInfo *di = s->devices[i];
			devinfo *d = &out->d[out->n++];

			d->ordinal = di->ordinal;
			if (di->uuid.len == 16)
				memcpy(d->uuid, di->uuid.data, 16);
			else
				rc = BB_ERR_PROTOCOL;
			d->total = di->total_bytes;
			d->used = di->used_bytes;
			d->reserved = di->reserved_bytes;
			d->limit = di->limit_bytes;
		}
	}
	bbc_response_free(resp);
	return rc;
}

static devstat dev_status_ok(bb_client *c)
{
	devstat s;
	int rc = dev_status(c, &s);
	cr_assert_eq(rc, 0, "ServerStatus: %d (%s)", rc, bb_last_error());
	return s;
}

/* The daemon's device with ordinal `ordinal` (asserts it exists). */
static const devinfo *dev_of(const devstat *s, int ordinal)
{
	for (int i = 0; i < s->n; i++)
		if (s->d[i].ordinal == ordinal)
			return &s->d[i];
	cr_assert_fail("the daemon reports no CUDA device %d (it reports %d)", ordinal, s->n);
	return NULL;
}

/* Poll until every device's used bytes (and, with reserved, its reserved
 * bytes) are 0; returns the last answer. */
static bool devices_until_empty(bb_client *c, bool reserved, int timeout_ms, devstat *last)
{
	int64_t deadline = bbt_now_ms() + timeout_ms;

	for (;;) {
		bool empty = dev_status(c, last) == 0;

		for (int i = 0; empty && i < last->n; i++)
			if (last->d[i].used != 0 || (reserved && last->d[i].reserved != 0))
				empty = false;
		if (empty)
			return true;
		if (bbt_now_ms() >= deadline) {
			for (int i = 0; i < last->n; i++)
				fprintf(stderr, "device %d: used %llu reserved %llu bytes\n",
					last->d[i].ordinal, (unsigned long long)last->d[i].used,
					(unsigned long long)last->d[i].reserved);
			return false;
		}
		bbt_sleep_ms(10);
	}
}

/* ---- buffers ---------------------------------------------------------------- */

static int alloc_kind(bb_client *c, bb_kind kind, size_t size, int device, bb_buf **out)
{
	bb_alloc_opts o = {.size = size, .kind = kind, .device = device, .share = BB_SHARE_UID};
	*out = NULL;
	return bb_alloc(c, &o, out);
}

static bb_buf *alloc_cuda(bb_client *c, size_t size, int device)
{
	bb_buf *b;
	int rc = alloc_kind(c, BB_CUDA, size, device, &b);
	cr_assert_eq(rc, 0, "bb_alloc(CUDA, %zu bytes, device %d): %d (%s)", size, device, rc,
		     bb_last_error());
	cr_assert_not_null(b);
	return b;
}

static bb_buf *alloc_handle(bb_client *c, size_t size, bb_cuda_handle h)
{
	bb_alloc_opts o = {.size = size, .kind = BB_CUDA, .share = BB_SHARE_UID};
	bb_buf *b = NULL;
	int rc = bb_alloc_cuda(c, &o, h, &b);
	cr_assert_eq(rc, 0, "bb_alloc_cuda(%zu bytes, handle %d): %d (%s)", size, (int)h, rc,
		     bb_last_error());
	return b;
}

/* Where a CUDA buffer lives, whichever its handle kind. */
typedef struct where {
	bb_cuda_handle kind;                    /* bb_cuda_handle_of */
	unsigned char slab[BB_IPC_HANDLE_SIZE]; /* legacy: the IPC handle; VMM: the allocation id */
	uint64_t allocation_size;               /* VMM: the allocation's bytes */
	uint64_t offset;                        /* the buffer's start in the allocation */
	size_t size;                            /* the buffer's bytes */
	unsigned char uuid[16];                 /* its device */
} where;

/* b's place through bb_cuda_ipc_of or bb_cuda_vmm_of (whose fd is closed
 * here): 0 or that call's error. Safe in a child. */
static int where_get(bb_buf *b, where *w)
{
	int rc;

	memset(w, 0, sizeof(*w));
	w->kind = bb_cuda_handle_of(b);
	if (w->kind == BB_CUDA_HANDLE_VMM) {
		bb_cuda_vmm v;

		rc = bb_cuda_vmm_of(b, &v);
		if (rc)
			return rc;
		close(v.fd);
		memcpy(w->slab, &v.allocation, sizeof(v.allocation));
		w->allocation_size = v.allocation_size;
		w->offset = v.offset;
		w->size = v.size;
		memcpy(w->uuid, v.device_uuid, 16);
		return 0;
	}
	bb_cuda_ipc ipc;
	rc = bb_cuda_ipc_of(b, &ipc);
	if (rc)
		return rc;
	memcpy(w->slab, ipc.handle, BB_IPC_HANDLE_SIZE);
	w->offset = ipc.offset;
	w->size = ipc.size;
	memcpy(w->uuid, ipc.device_uuid, 16);
	return 0;
}

/* where_get, asserting it works and that b is of the kind this run's
 * daemons make. */
static where where_of(bb_buf *b)
{
	where w;
	int rc = where_get(b, &w);
	cr_assert_eq(rc, 0, "where buffer %llu lives: %d (%s)", (unsigned long long)bb_id(b), rc,
		     bb_last_error());
	cr_assert_eq(w.kind, g_vmm ? BB_CUDA_HANDLE_VMM : BB_CUDA_HANDLE_LEGACY,
		     "buffer %llu has handle kind %d", (unsigned long long)bb_id(b), (int)w.kind);
	return w;
}

static bool same_slab(const where *a, const where *b)
{
	return memcmp(a->slab, b->slab, sizeof(a->slab)) == 0;
}

static void unref_gone(bb_client *c, bb_buf *b)
{
	uint64_t id = bb_id(b);
	bb_unref(b);
	cr_assert_eq(bbt_stat_until_gone(c, id, 2000), BB_ERR_NOT_FOUND,
		     "buffer %llu outlived its last count", (unsigned long long)id);
}

static const char *uuid_str(const unsigned char u[16], char out[48])
{
	bb_cuda_uuid_format(u, out);
	return out;
}

/* ---- the driver in a child --------------------------------------------------- */

/* The driver as a test child uses it: the library the client loads (the
 * same dlopen instance), and the fake's hooks when it is the fake. */
struct cu {
	bb_cuda api;
	CUdevice dev; /* with a UUID given to cu_load: the device that has it */
	void (*stats)(unsigned long *opens, unsigned long *closes);
	unsigned long (*vmm_calls)(const char *name);
	int (*pointer_device)(CUdeviceptr p, unsigned char uuid[16]);
	int (*open_context_device)(CUdeviceptr p, unsigned char uuid[16]);
};

/* Load the driver; with uuid, make the primary context of the device with
 * that UUID current on this thread. 0, or -1 with a line on stderr. */
static int cu_load(struct cu *cu, const unsigned char *uuid)
{
	char err[256];
	int n = 0;

	memset(cu, 0, sizeof(*cu));
	if (bb_cuda_load(&cu->api, err, sizeof(err)) != 0) {
		fprintf(stderr, "test child: %s\n", err);
		return -1;
	}
	if (!cu->api.MemcpyHtoD || !cu->api.MemcpyDtoH || !cu->api.CtxSynchronize) {
		fprintf(stderr, "test child: the driver lacks cuMemcpy*_v2 or cuCtxSynchronize\n");
		return -1;
	}
	cu->stats =
		(void (*)(unsigned long *, unsigned long *))dlsym(cu->api.lib, "fakecuda_stats");
	cu->vmm_calls = (unsigned long (*)(const char *))dlsym(cu->api.lib, "fakecuda_vmm_calls");
	cu->pointer_device = (int (*)(CUdeviceptr, unsigned char *))dlsym(
		cu->api.lib, "fakecuda_pointer_device");
	cu->open_context_device = (int (*)(CUdeviceptr, unsigned char *))dlsym(
		cu->api.lib, "fakecuda_open_context_device");
	if (g_fake && (!cu->stats || !cu->pointer_device || !cu->open_context_device)) {
		fprintf(stderr, "test child: libfakecuda lacks its test hooks\n");
		return -1;
	}
	if (!uuid)
		return 0;
	if (cu->api.DeviceGetCount(&n) != CUDA_SUCCESS)
		return -1;
	for (int i = 0; i < n; i++) {
		CUdevice dev;
		CUuuid u;
		CUcontext ctx;

		if (cu->api.DeviceGet(&dev, i) != CUDA_SUCCESS ||
		    cu->api.DeviceGetUuid(&u, dev) != CUDA_SUCCESS)
			return -1;
		if (memcmp(u.bytes, uuid, 16) != 0)
			continue;
		if (cu->api.DevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
		    cu->api.CtxSetCurrent(ctx) != CUDA_SUCCESS)
			return -1;
		cu->dev = dev;
		return 0;
	}
	fprintf(stderr, "test child: no device with the buffer's UUID\n");
	return -1;
}

/* The driver calls that open and close an allocation in this process, so
 * far: legacy cuIpcOpenMemHandle and cuIpcCloseMemHandle (successful ones);
 * VMM cuMemImportFromShareableHandle and cuMemUnmap calls, with *opens
 * ~0 unless each import came with one cuMemAddressReserve, cuMemMap and
 * cuMemSetAccess and each unmap with one cuMemAddressFree. 0, or -1 (with
 * a line on stderr) where the fake lacks its hooks. */
static int cu_stats(const struct cu *cu, unsigned long *opens, unsigned long *closes)
{
	*opens = *closes = 0;
	if (!g_vmm) {
		if (cu->stats)
			cu->stats(opens, closes);
		return 0;
	}
	if (!cu->vmm_calls) {
		if (g_fake)
			fprintf(stderr, "test child: libfakecuda lacks fakecuda_vmm_calls\n");
		return g_fake ? -1 : 0;
	}
	*opens = cu->vmm_calls("cuMemImportFromShareableHandle");
	*closes = cu->vmm_calls("cuMemUnmap");
	if (cu->vmm_calls("cuMemAddressReserve") != *opens || cu->vmm_calls("cuMemMap") != *opens ||
	    cu->vmm_calls("cuMemSetAccess") != *opens ||
	    cu->vmm_calls("cuMemAddressFree") != *closes) {
		fprintf(stderr,
			"test child: VMM calls out of step: %lu imports, %lu maps, %lu unmaps\n",
			*opens, cu->vmm_calls("cuMemMap"), *closes);
		*opens = ~0ul;
	}
	return 0;
}

static CUdeviceptr dptr(const void *p)
{
	return (CUdeviceptr)(uintptr_t)p;
}

/* Write bbt_fill(seed) over size bytes at device pointer p: 0 or -1. */
static int cu_write(struct cu *cu, void *p, size_t size, uint32_t seed)
{
	void *h = malloc(size);
	int rc = -1;

	if (!h)
		return -1;
	bbt_fill(h, size, seed);
	if (cu->api.MemcpyHtoD(dptr(p), h, size) == CUDA_SUCCESS &&
	    cu->api.CtxSynchronize() == CUDA_SUCCESS)
		rc = 0;
	free(h);
	return rc;
}

/* Read size bytes at p and check them against bbt_fill(seed): 0 or -1. */
static int cu_check(struct cu *cu, const void *p, size_t size, uint32_t seed)
{
	void *h = malloc(size);
	int rc = -1;

	if (!h)
		return -1;
	memset(h, 0, size);
	if (cu->api.MemcpyDtoH(h, dptr(p), size) == CUDA_SUCCESS && bbt_check(h, size, seed))
		rc = 0;
	free(h);
	return rc;
}

/* ---- children ------------------------------------------------------------------ */

/* What a child needs to know; fork copies it. */
struct ctx {
	const char *sock;
	uint64_t ids[MAX_IDS];
	uint64_t offsets[MAX_IDS];
	int n;
	int ndev; /* devices to spread buffers over */
	size_t size;
	uint32_t seed;
	unsigned char uuid[16];
	const char *visible; /* CUDA_VISIBLE_DEVICES for the child, or NULL: unset */
	where w;             /* where ids[0] lives */
	int vmm_fd;          /* VMM: its allocation's fd (bb_cuda_vmm_of), inherited */
	bbt_chan ch;
};

/* Apply x->visible, connect and open ids[0] and map it; *cu gets the driver
 * with the buffer's device current. 0, or the failing step. */
static int child_open_map(const struct ctx *x, struct cu *cu, bb_client **c, bb_buf **b, void **p)
{
	if (x->visible)
		setenv("CUDA_VISIBLE_DEVICES", x->visible, 1);
	else
		unsetenv("CUDA_VISIBLE_DEVICES");
	if (bb_connect(x->sock, c) != 0)
		return 2;
	if (bb_open(*c, x->ids[0], b) != 0)
		return 3;
	if (bb_map(*b, p) != 0 || !*p) {
		fprintf(stderr, "test child: bb_map: %s\n", bb_last_error());
		return 4;
	}
	if (cu_load(cu, x->uuid) != 0)
		return 5;
	return 0;
}

/* Maps ids[0], writes bbt_fill(seed) through the driver, sets it READY. */
static int writer_child(void *arg)
{
	struct ctx *x = arg;
	struct cu cu;
	bb_client *c;
	bb_buf *b;
	void *p;
	int step = child_open_map(x, &cu, &c, &b, &p);

	if (step)
		return step;
	if (cu_write(&cu, p, x->size, x->seed) != 0)
		return 10;
	if (bb_set_ready(b) != 0)
		return 11;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

/* Maps ids[0], checks the writer's bytes and (fake) that the mapping is on
 * the device with x->uuid, opened with that device's context current; then,
 * when x->ch is set, reports and holds the mapping until told to go. */
static int reader_child(void *arg)
{
	struct ctx *x = arg;
	unsigned char u[16];
	struct cu cu;
	bb_client *c;
	bb_buf *b;
	bb_state st;
	void *p;
	char go;
	int step = child_open_map(x, &cu, &c, &b, &p);

	if (step)
		return step;
	if (bb_wait(b, 5000, &st) != 0 || st != BB_READY)
		return 20;
	if (cu_check(&cu, p, x->size, x->seed) != 0)
		return 21;
	if (g_fake) {
		if (cu.pointer_device(dptr(p), u) != 0 || memcmp(u, x->uuid, 16) != 0)
			return 22;
		/* A legacy handle is opened in a context; a VMM mapping has
		 * none, its device's access is what cu_check's copy needed. */
		if (bb_cuda_handle_of(b) == BB_CUDA_HANDLE_LEGACY &&
		    (cu.open_context_device(dptr(p), u) != 0 || memcmp(u, x->uuid, 16) != 0))
			return 23;
	}
	if (x->ch.fd[1] > 0) {
		if (bbt_send(x->ch.fd[1], "m", 1) != 0)
			return 24;
		if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
			return 25;
		/* Still readable after the other reader has mapped it too. */
		if (cu_check(&cu, p, x->size, x->seed) != 0)
			return 26;
	}
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

static void run_child(int (*fn)(void *), struct ctx *x, const char *what)
{
	int code = bbt_join(bbt_spawn(fn, x), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "%s failed at step %d", what, code);
}

/* ---- bytes cross processes on every device --------------------------------- */

Test(cuda, every_device_maps_in_other_processes_and_bytes_cross)
{
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c), after;
	char us[48];

	cr_assert_str_eq(s.cuda, "", "the daemon does not serve CUDA: %s", s.cuda);
	cr_assert_geq(s.n, g_fake ? 2 : 1, "the daemon sees %d CUDA devices", s.n);
	for (int i = 0; i < s.n; i++)
		for (int j = i + 1; j < s.n; j++)
			cr_assert_neq(memcmp(s.d[i].uuid, s.d[j].uuid, 16), 0,
				      "devices %d and %d share a UUID", i, j);

	for (int dev = 0; dev < s.n; dev++) {
		const devinfo *di = dev_of(&s, dev);
		struct ctx x = {.sock = d->sock, .size = MIB + 4096, .seed = 0xc0de00u + dev};
		bb_buf *b = alloc_cuda(c, x.size, dev);
		where w = where_of(b);
		bb_info info;

		cr_assert_eq(bb_buf_kind(b), BB_CUDA);
		cr_assert_eq(bb_size(b), x.size);
		cr_assert_eq(bb_stat(c, bb_id(b), &info), 0, "bb_stat: %s", bb_last_error());
		cr_assert_eq(info.kind, BB_CUDA);
		cr_assert_eq(info.device, dev);
		cr_assert_eq(memcmp(w.uuid, di->uuid, 16), 0, "buffer on device %d carries UUID %s",
			     dev, uuid_str(w.uuid, us));
		x.ids[0] = bb_id(b);
		memcpy(x.uuid, di->uuid, 16);

		run_child(writer_child, &x, "the writer");

		/* Two readers hold the mapping at the same time. */
		struct ctx r1 = x, r2 = x;
		char m;
		bbt_chan_open(&r1.ch);
		bbt_chan_open(&r2.ch);
		pid_t p1 = bbt_spawn(reader_child, &r1);
		pid_t p2 = bbt_spawn(reader_child, &r2);
		int ok1 = bbt_recv(r1.ch.fd[0], &m, 1, CHILD_TIMEOUT_MS);
		int ok2 = bbt_recv(r2.ch.fd[0], &m, 1, CHILD_TIMEOUT_MS);
		bbt_send(r1.ch.fd[0], "g", 1);
		bbt_send(r2.ch.fd[0], "g", 1);
		int code1 = bbt_join(p1, CHILD_TIMEOUT_MS);
		int code2 = bbt_join(p2, CHILD_TIMEOUT_MS);
		cr_assert_eq(code1, 0, "reader 1 on device %d failed at step %d", dev, code1);
		cr_assert_eq(code2, 0, "reader 2 on device %d failed at step %d", dev, code2);
		cr_assert(ok1 == 0 && ok2 == 0, "a reader did not report its mapping");
		bbt_chan_close(&r1.ch);
		bbt_chan_close(&r2.ch);

		unref_gone(c, b);
	}
	cr_assert(devices_until_empty(c, false, 3000, &after),
		  "device bytes still in use after every buffer went");
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- one IPC open per slab ---------------------------------------------------- */

/* Maps every buffer of one slab (several threads at once), then a second
 * connection in the same process maps one of them; checks one open for
 * all, pointers at base + offset, and that the allocation is closed only
 * when the last mapped handle goes, and again on disconnect. */
struct slab_thread {
	bb_client *c;
	const struct ctx *x;
	int first, step;
	void *ptrs[MAX_IDS];
	bb_buf *bufs[MAX_IDS];
};

static void *slab_thread_main(void *arg)
{
	struct slab_thread *t = arg;

	for (int i = t->first; i < t->x->n; i += 4) {
		if (bb_open(t->c, t->x->ids[i], &t->bufs[i]) != 0) {
			t->step = 40;
			break;
		}
		if (bb_map(t->bufs[i], &t->ptrs[i]) != 0 || !t->ptrs[i]) {
			fprintf(stderr, "test child: bb_map: %s\n", bb_last_error());
			t->step = 41;
			break;
		}
	}
	return NULL;
}

static int slab_child(void *arg)
{
	struct ctx *x = arg;
	struct slab_thread th[4];
	pthread_t tid[4];
	void *ptrs[MAX_IDS];
	bb_buf *bufs[MAX_IDS];
	unsigned long o0, c0, o, cl;
	struct cu cu;
	bb_client *c, *c2;
	bb_buf *b2;
	void *p2;

	if (cu_load(&cu, x->uuid) != 0)
		return 2;
	if (cu_stats(&cu, &o0, &c0) != 0)
		return 5;
	if (bb_connect(x->sock, &c) != 0 || bb_connect(x->sock, &c2) != 0)
		return 3;

	for (int t = 0; t < 4; t++) {
		th[t] = (struct slab_thread){.c = c, .x = x, .first = t};
		if (pthread_create(&tid[t], NULL, slab_thread_main, &th[t]) != 0)
			return 4;
	}
	for (int t = 0; t < 4; t++) {
		pthread_join(tid[t], NULL);
		if (th[t].step)
			return th[t].step;
		for (int i = t; i < x->n; i += 4) {
			ptrs[i] = th[t].ptrs[i];
			bufs[i] = th[t].bufs[i];
		}
	}
	cu_stats(&cu, &o, &cl);
	if (o - o0 != 1)
		return 10; /* one open for the whole slab */
	if (cl != c0)
		return 11;
	for (int i = 0; i < x->n; i++) {
		uintptr_t want = (uintptr_t)ptrs[0] + (uintptr_t)(x->offsets[i] - x->offsets[0]);
		if ((uintptr_t)ptrs[i] != want)
			return 12; /* base + offset */
	}
	/* Every buffer is its own bytes inside the shared mapping. */
	for (int i = 0; i < x->n; i++)
		if (cu_write(&cu, ptrs[i], 64, x->seed + (uint32_t)i) != 0)
			return 13;
	for (int i = 0; i < x->n; i++)
		if (cu_check(&cu, ptrs[i], 64, x->seed + (uint32_t)i) != 0)
			return 14;

	/* Another connection of this process shares the opened allocation. */
	if (bb_open(c2, x->ids[0], &b2) != 0 || bb_map(b2, &p2) != 0)
		return 20;
	if (p2 != ptrs[0])
		return 21;
	cu_stats(&cu, &o, &cl);
	if (o - o0 != 1)
		return 22;
	bb_unref(b2);

	/* Closed when the last mapped handle goes, not before. */
	for (int i = 0; i < x->n - 1; i++)
		bb_unref(bufs[i]);
	cu_stats(&cu, &o, &cl);
	if (cl != c0)
		return 30;
	bb_unref(bufs[x->n - 1]);
	cu_stats(&cu, &o, &cl);
	if (cl - c0 != 1)
		return 31; /* closed by the time bb_unref returns: before its Release */

	/* Mapped again, and closed by bb_disconnect. */
	if (bb_open(c, x->ids[1], &bufs[0]) != 0 || bb_open(c, x->ids[2], &bufs[1]) != 0)
		return 32;
	if (bb_map(bufs[0], &ptrs[0]) != 0 || bb_map(bufs[1], &ptrs[1]) != 0)
		return 33;
	cu_stats(&cu, &o, &cl);
	if (o - o0 != 2 || cl - c0 != 1)
		return 34;
	bb_disconnect(c);
	cu_stats(&cu, &o, &cl);
	if (cl - c0 != 2)
		return 35;
	bb_disconnect(c2);
	return 0;
}

Test(cuda, dozens_of_small_buffers_open_their_slab_once)
{
	cuda_env(NULL);
	NEED_FAKE();
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c), after;
	struct ctx x = {.sock = d->sock, .n = 48, .seed = 0x51ab};
	bb_buf *bufs[MAX_IDS];
	where first;

	memcpy(x.uuid, dev_of(&s, 0)->uuid, 16);
	for (int i = 0; i < x.n; i++) {
		bufs[i] = alloc_cuda(c, 1000 + 37 * (size_t)i, 0);
		where w = where_of(bufs[i]);
		if (i == 0)
			first = w;
		cr_assert(same_slab(&w, &first),
			  "small buffer %d is not in the first buffer's slab", i);
		x.ids[i] = bb_id(bufs[i]);
		x.offsets[i] = w.offset;
	}
	run_child(slab_child, &x, "the slab mapper");
	for (int i = 0; i < x.n; i++)
		cr_assert_eq(bbt_refs_until(c, x.ids[i], 1, 2000), 1,
			     "buffer %d still held by the mapper", i);
	for (int i = 0; i < x.n; i++)
		unref_gone(c, bufs[i]);
	cr_assert(devices_until_empty(c, false, 3000, &after), "device bytes left in use");
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Maps ids[0], writes, and takes its only count into a token: the
 * allocation is closed by the time bb_take returns; the token goes to the
 * parent. */
static int taker_child(void *arg)
{
	struct ctx *x = arg;
	unsigned long o0, c0, o, cl;
	struct cu cu;
	bb_client *c;
	bb_buf *b;
	bb_token t;
	void *p;
	int step = child_open_map(x, &cu, &c, &b, &p);

	if (step)
		return step;
	if (cu_stats(&cu, &o0, &c0) != 0)
		return 9;
	if (cu_write(&cu, p, x->size, x->seed) != 0 || bb_set_ready(b) != 0)
		return 10;
	if (bb_take(b, &t) != 0)
		return 11;
	cu_stats(&cu, &o, &cl);
	if (g_fake && cl - c0 != 1)
		return 12;
	if (bbt_send(x->ch.fd[1], &t, sizeof(t)) != 0)
		return 13;
	bb_disconnect(c);
	return 0;
}

Test(cuda, taking_the_last_count_of_a_mapped_buffer_closes_it_and_the_token_carries_it)
{
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	struct ctx x = {.sock = d->sock, .size = 8192, .seed = 0x7a4e};
	bb_buf *b = alloc_cuda(c, x.size, 0), *a = NULL;
	bb_token t;

	x.ids[0] = bb_id(b);
	memcpy(x.uuid, dev_of(&s, 0)->uuid, 16);
	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(taker_child, &x);
	int got = bbt_recv(x.ch.fd[0], &t, sizeof(t), CHILD_TIMEOUT_MS);
	int code = bbt_join(pid, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the taker failed at step %d", code);
	cr_assert_eq(got, 0, "no token from the taker");
	bbt_chan_close(&x.ch);
	/* The parent's count and the token's. */
	cr_assert_eq(bbt_refs_until(c, x.ids[0], 2, 2000), 2, "refs after the taker left");
	bb_unref(b);
	cr_assert_eq(bbt_refs_until(c, x.ids[0], 1, 2000), 1, "the token alone keeps it");

	/* Another process adopts it and reads the taker's bytes. */
	bb_client *c2 = bbt_connect(d);
	cr_assert_eq(bb_adopt(c2, &t, &a), 0, "bb_adopt: %s", bb_last_error());
	x.ch.fd[0] = x.ch.fd[1] = -1;
	run_child(reader_child, &x, "the reader after adopt");
	unref_gone(c2, a);
	bb_disconnect(c2);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- slab space is reused ------------------------------------------------------ */

Test(cuda, freed_slab_space_is_reused)
{
	static const char *const args[] = {"--cuda-slab-bytes", "2097152", NULL};
	const size_t q = 512 * 1024;

	cuda_env(NULL);
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	bb_buf *a = alloc_cuda(c, q, 0);
	where ia = where_of(a);
	devstat s = dev_status_ok(c);
	uint64_t reserved = dev_of(&s, 0)->reserved;

	cr_assert_geq(reserved, q, "reserved %llu bytes for a %zu-byte buffer",
		      (unsigned long long)reserved, q);
	cr_assert_eq(dev_of(&s, 0)->used, q, "used bytes with one %zu-byte buffer", q);

	/* The only buffer goes; its (cached) slab serves the next one. */
	unref_gone(c, a);
	s = dev_status_ok(c);
	cr_assert_eq(dev_of(&s, 0)->used, 0, "used bytes after the free");
	bb_buf *a2 = alloc_cuda(c, q, 0);
	where ia2 = where_of(a2);
	cr_assert(same_slab(&ia2, &ia), "the freed slab was not reused");
	cr_assert_eq(ia2.offset, ia.offset, "the freed extent was not reused");
	s = dev_status_ok(c);
	cr_assert_eq(dev_of(&s, 0)->reserved, reserved, "reserved bytes changed on reuse");

	/* A hole in the middle of a full slab is filled again. */
	bb_buf *m[3];
	where im[3];
	for (int i = 0; i < 3; i++) {
		m[i] = alloc_cuda(c, q, 0);
		im[i] = where_of(m[i]);
		cr_assert(same_slab(&im[i], &ia), "buffer %d of four did not fit in the 2 MiB slab",
			  i + 2);
	}
	unref_gone(c, m[1]);
	bb_buf *h = alloc_cuda(c, q, 0);
	where ih = where_of(h);
	cr_assert(same_slab(&ih, &ia), "the hole was not used");
	cr_assert_eq(ih.offset, im[1].offset, "the hole was not used");
	s = dev_status_ok(c);
	cr_assert_eq(dev_of(&s, 0)->reserved, reserved, "reserved bytes grew to fill a hole");
	cr_assert_eq(dev_of(&s, 0)->used, 4 * q);

	/* Writes through the reused space land where they should. */
	struct ctx x = {.sock = d->sock, .size = q, .seed = 0x4e05};
	x.ids[0] = bb_id(h);
	memcpy(x.uuid, dev_of(&s, 0)->uuid, 16);
	run_child(writer_child, &x, "the writer");
	x.ch.fd[0] = x.ch.fd[1] = -1;
	run_child(reader_child, &x, "the reader");

	unref_gone(c, a2);
	unref_gone(c, m[0]);
	unref_gone(c, m[2]);
	unref_gone(c, h);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(cuda, empty_slabs_beyond_the_cache_go_back_to_the_driver)
{
	static const char *const args[] = {"--cuda-slab-bytes", "2097152", "--cuda-cache-bytes",
					   "0", NULL};
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	devstat s;

	bb_buf *a = alloc_cuda(c, 4096, 0);
	bb_buf *big = alloc_cuda(c, 5 * MIB, 0);
	s = dev_status_ok(c);
	cr_assert_geq(dev_of(&s, 0)->reserved, 2 * MIB + 5 * MIB);
	unref_gone(c, a);
	unref_gone(c, big);
	cr_assert(devices_until_empty(c, true, 3000, &s),
		  "device 0 still has %llu bytes reserved with no buffers and no cache",
		  (unsigned long long)dev_of(&s, 0)->reserved);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- devices are matched by UUID ----------------------------------------------- */

/* With x->visible applied: this process's device 0 must be the buffer's
 * device (the list really reorders), and the buffer maps there. */
static int visible_child(void *arg)
{
	struct ctx *x = arg;
	unsigned char u[16];
	struct cu cu0;
	CUdevice dev;
	CUuuid uu;
	int step;

	setenv("CUDA_VISIBLE_DEVICES", x->visible, 1);
	if (cu_load(&cu0, NULL) != 0)
		return 50;
	if (cu0.api.DeviceGet(&dev, 0) != CUDA_SUCCESS ||
	    cu0.api.DeviceGetUuid(&uu, dev) != CUDA_SUCCESS)
		return 51;
	if (memcmp(uu.bytes, x->uuid, 16) != 0)
		return 52; /* CUDA_VISIBLE_DEVICES did not put the device first */

	struct cu cu;
	bb_client *c;
	bb_buf *b;
	void *p;
	step = child_open_map(x, &cu, &c, &b, &p);
	if (step)
		return step;
	if (g_fake) {
		if (cu.pointer_device(dptr(p), u) != 0 || memcmp(u, x->uuid, 16) != 0)
			return 53;
		if (bb_cuda_handle_of(b) == BB_CUDA_HANDLE_LEGACY &&
		    (cu.open_context_device(dptr(p), u) != 0 || memcmp(u, x->uuid, 16) != 0))
			return 54;
	}
	if (cu_write(&cu, p, x->size, x->seed) != 0)
		return 55;
	int rc = bb_set_ready(b);
	if (rc != 0 && rc != BB_ERR_STATE) /* a second writer finds it READY */
		return 56;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

/* With x->visible hiding the buffer's device, bb_map says so. */
static int hidden_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c;
	bb_buf *b;
	void *p = (void *)1;
	int rc;

	setenv("CUDA_VISIBLE_DEVICES", x->visible, 1);
	if (bb_connect(x->sock, &c) != 0 || bb_open(c, x->ids[0], &b) != 0)
		return 60;
	rc = bb_map(b, &p);
	if (rc != BB_ERR_NOT_FOUND)
		return 61;
	if (p != NULL)
		return 62;
	if (!strstr(bb_last_error(), "CUDA_VISIBLE_DEVICES"))
		return 63;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(cuda, a_client_with_reordered_visible_devices_maps_the_right_device)
{
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	char us[48], vis[64];

	if (s.n < 2)
		cr_skip_test("needs two CUDA devices");
	struct ctx x = {.sock = d->sock, .size = 65536, .seed = 0x0e0d};
	bb_buf *b = alloc_cuda(c, x.size, 1);
	x.ids[0] = bb_id(b);
	memcpy(x.uuid, dev_of(&s, 1)->uuid, 16);

	/* Device 1 of the daemon is device 0 here; the writer maps it there. */
	x.visible = "1,0";
	run_child(visible_child, &x, "the writer with CUDA_VISIBLE_DEVICES=1,0");
	/* A reader numbering devices as the daemon does reads it back. */
	x.visible = NULL;
	x.ch.fd[0] = x.ch.fd[1] = -1;
	run_child(reader_child, &x, "the reader with every device visible");
	/* The device named by UUID, as the driver allows. */
	snprintf(vis, sizeof(vis), "%s", uuid_str(x.uuid, us));
	x.visible = vis;
	x.seed++;
	run_child(visible_child, &x, "the writer with CUDA_VISIBLE_DEVICES=<its UUID>");
	x.visible = NULL;
	run_child(reader_child, &x, "the reader of the second write");
	x.visible = "0";
	run_child(hidden_child, &x, "the client with the buffer's device hidden");

	unref_gone(c, b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- capacity -------------------------------------------------------------------- */

Test(cuda, the_device_limit_gives_no_memory)
{
	static const char *const args[] = {"--cuda-slab-bytes", "2097152", "--cuda-device-bytes",
					   "8388608", NULL};
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	bb_buf *b, *x;
	devstat s;
	int rc;

	s = dev_status_ok(c);
	cr_assert_eq(dev_of(&s, 0)->limit, 8 * MIB, "limit_bytes with --cuda-device-bytes");
	rc = alloc_kind(c, BB_CUDA, 9 * MIB, 0, &x);
	cr_assert_eq(rc, BB_ERR_NO_MEMORY, "9 MiB under an 8 MiB limit: %d (%s)", rc,
		     bb_last_error());
	cr_assert_null(x);
	cr_assert_neq(bb_last_error()[0], '\0', "NO_MEMORY without a message");

	b = alloc_cuda(c, 5 * MIB, 0);
	rc = alloc_kind(c, BB_CUDA, 4 * MIB, 0, &x);
	cr_assert_eq(rc, BB_ERR_NO_MEMORY, "5 + 4 MiB under an 8 MiB limit: %d (%s)", rc,
		     bb_last_error());
	/* The other device has a limit of its own. */
	if (s.n > 1) {
		bb_buf *o = alloc_cuda(c, 4 * MIB, 1);
		unref_gone(c, o);
	}

	unref_gone(c, b);
	/* Buffers larger than a slab have allocations of their own, freed
	 * with them. */
	if (!devices_until_empty(c, true, 3000, &s)) {
		bbt_dump_log(d);
		cr_assert_fail("device memory still used or reserved after every buffer went");
	}
	b = alloc_cuda(c, 4 * MIB, 0);
	unref_gone(c, b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Takes all but 256 KiB of the device's memory straight from the driver,
 * reports, and gives it back when told. */
static int hog_child(void *arg)
{
	struct ctx *x = arg;
	size_t freeb = 0, total = 0;
	CUdeviceptr p;
	struct cu cu;
	char go;

	if (cu_load(&cu, x->uuid) != 0)
		return 70;
	if (cu.api.MemGetInfo(&freeb, &total) != CUDA_SUCCESS || freeb < 4 * MIB)
		return 71;
	if (cu.api.MemAlloc(&p, freeb - 256 * 1024) != CUDA_SUCCESS)
		return 72;
	if (bbt_send(x->ch.fd[1], "h", 1) != 0)
		return 73;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
		return 74;
	if (cu.api.MemFree(p) != CUDA_SUCCESS)
		return 75;
	return 0;
}

Test(cuda, a_full_device_gives_no_memory)
{
	static const char *const args[] = {"--cuda-slab-bytes", "8388608", NULL};
	cuda_env("67108864"); /* 64 MiB per fake device */
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	struct ctx x = {.sock = d->sock};
	bb_buf *b;
	char h;
	int rc;

	memcpy(x.uuid, dev_of(&s, 0)->uuid, 16);
	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(hog_child, &x);
	if (bbt_recv(x.ch.fd[0], &h, 1, CHILD_TIMEOUT_MS) != 0)
		cr_assert_fail("the hog failed at step %d", bbt_join(pid, CHILD_TIMEOUT_MS));

	rc = alloc_kind(c, BB_CUDA, MIB, 0, &b);
	cr_assert_eq(rc, BB_ERR_NO_MEMORY, "alloc on a full device: %d (%s)", rc, bb_last_error());
	cr_assert_neq(bb_last_error()[0], '\0', "NO_MEMORY without a message");

	bbt_send(x.ch.fd[0], "g", 1);
	int code = bbt_join(pid, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the hog failed at step %d", code);
	bbt_chan_close(&x.ch);

	/* The memory is back: the daemon grows again. */
	b = alloc_cuda(c, MIB, 0);
	unref_gone(c, b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- a killed holder ---------------------------------------------------------- */

/* Allocates on every device, maps and writes, reports, and waits to die. */
static int holder_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c;
	char go;

	if (bb_connect(x->sock, &c) != 0)
		return 80;
	for (int i = 0; i < x->n; i++) {
		bb_buf *b;
		void *p;
		struct cu cu;
		where w;

		if (alloc_kind(c, BB_CUDA, x->size + (size_t)i * 4096, i % x->ndev, &b) != 0)
			return 81;
		if (bb_map(b, &p) != 0 || where_get(b, &w) != 0)
			return 82;
		if (cu_load(&cu, w.uuid) != 0 || cu_write(&cu, p, 4096, (uint32_t)i) != 0)
			return 83;
		if (i == 0 && bb_set_ready(b) != 0)
			return 84;
	}
	if (bbt_send(x->ch.fd[1], "h", 1) != 0)
		return 85;
	bbt_recv(x->ch.fd[1], &go, 1, -1);
	return 86;
}

Test(cuda, a_killed_holders_device_memory_is_free_again)
{
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	struct ctx x = {.sock = d->sock, .n = 4, .ndev = s.n > 1 ? 2 : 1, .size = 300000};
	uint64_t used = 0;
	char h;

	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(holder_child, &x);
	if (bbt_recv(x.ch.fd[0], &h, 1, CHILD_TIMEOUT_MS) != 0)
		cr_assert_fail("the holder failed at step %d", bbt_join(pid, CHILD_TIMEOUT_MS));
	s = dev_status_ok(c);
	for (int i = 0; i < s.n; i++)
		used += s.d[i].used;
	cr_assert_geq(used, (uint64_t)x.n * x.size, "used bytes while the holder lives: %llu",
		      (unsigned long long)used);
	cr_assert_eq(s.buffers, (uint64_t)x.n);

	kill(pid, SIGKILL);
	cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 128 + SIGKILL);
	bbt_chan_close(&x.ch);
	cr_assert(devices_until_empty(c, false, 5000, &s),
		  "device bytes still in use after the holder was killed");
	cr_assert_eq(s.buffers, 0, "buffers left after the holder was killed");

	/* And the space serves again. */
	bb_buf *b = alloc_cuda(c, x.size, 0);
	unref_gone(c, b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- no driver ----------------------------------------------------------------- */

/* A daemon without CUDA: BB_CUDA allocs are unsupported, host buffers work. */
static void check_daemon_without_cuda(bbt_daemon *d)
{
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	bb_buf *b;
	char *p;
	int rc;

	cr_assert_eq(s.n, 0, "a daemon without CUDA lists %d devices", s.n);
	cr_assert_neq(s.cuda[0], '\0', "ServerStatus.cuda does not say why CUDA is off");
	rc = alloc_kind(c, BB_CUDA, 4096, 0, &b);
	cr_assert_eq(rc, BB_ERR_UNSUPPORTED, "BB_CUDA alloc: %d (%s)", rc, bb_last_error());
	cr_assert_null(b);
	cr_assert(strstr(bb_last_error(), "CUDA"), "the reason: \"%s\"", bb_last_error());

	rc = alloc_kind(c, BB_HOST, 65536, 0, &b);
	cr_assert_eq(rc, 0, "host alloc: %d (%s)", rc, bb_last_error());
	cr_assert_eq(bb_map(b, (void **)&p), 0, "bb_map(host): %s", bb_last_error());
	bbt_fill(p, 65536, 77);
	cr_assert(bbt_check(p, 65536, 77));
	bb_cuda_ipc ipc;
	cr_assert_eq(bb_cuda_ipc_of(b, &ipc), BB_ERR_INVALID);
	unref_gone(c, b);
	bb_disconnect(c);
}

Test(cuda, a_daemon_without_a_driver_answers_unsupported_and_serves_host_buffers)
{
	static const char *const no_cuda[] = {"--no-cuda", NULL};

	cuda_env(NULL);
	setenv("BUFBROKER_CUDA_LIBRARY", "/nonexistent/libcuda.so.1", 1);
	bbt_daemon *d = bbt_start(NULL);
	check_daemon_without_cuda(d);
	bbt_stop_clean(d);

	cuda_env(NULL);
	d = bbt_start(no_cuda);
	check_daemon_without_cuda(d);
	bbt_stop_clean(d);
}

/* ---- bb_cuda_ipc_of and bb_cuda_vmm_of -------------------------------------- */

/* Opens x->w's allocation itself, as a framework would (legacy: its IPC
 * handle; VMM: imports x->vmm_fd, reserves, maps and grants access), and
 * checks the writer's bytes at its offset. */
static int framework_child(void *arg)
{
	struct ctx *x = arg;
	struct cu cu;
	CUdeviceptr base;

	if (cu_load(&cu, x->w.uuid) != 0)
		return 90;
	if (x->w.kind == BB_CUDA_HANDLE_LEGACY) {
		CUipcMemHandle h;

		memcpy(h.reserved, x->w.slab, sizeof(h.reserved));
		if (cu.api.IpcOpenMemHandle(&base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) !=
		    CUDA_SUCCESS)
			return 91;
		if (cu_check(&cu, (void *)(uintptr_t)(base + x->w.offset), x->size, x->seed) != 0)
			return 92;
		if (cu.api.IpcCloseMemHandle(base) != CUDA_SUCCESS)
			return 93;
		return 0;
	}
	CUmemGenericAllocationHandle h;
	size_t n = x->w.allocation_size;

	if (!bb_cuda_has_vmm(&cu.api, NULL, 0))
		return 94;
	CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = (int)cu.dev},
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	if (cu.api.MemImportFromShareableHandle(&h, (void *)(uintptr_t)x->vmm_fd,
						CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) !=
	    CUDA_SUCCESS)
		return 95;
	if (cu.api.MemAddressReserve(&base, n, 0, 0, 0) != CUDA_SUCCESS ||
	    cu.api.MemMap(base, n, 0, h, 0) != CUDA_SUCCESS ||
	    cu.api.MemSetAccess(base, n, &acc, 1) != CUDA_SUCCESS)
		return 96;
	if (cu_check(&cu, (void *)(uintptr_t)(base + x->w.offset), x->size, x->seed) != 0)
		return 97;
	if (cu.api.MemUnmap(base, n) != CUDA_SUCCESS ||
	    cu.api.MemAddressFree(base, n) != CUDA_SUCCESS || cu.api.MemRelease(h) != CUDA_SUCCESS)
		return 98;
	return 0;
}

Test(cuda, the_handle_gives_allocation_offset_size_and_device)
{
	static const char *const args[] = {"--cuda-slab-bytes", "2097152", NULL};
	static const size_t sizes[] = {1, 255, 256, 257, 4097, 100000};
	enum { N = sizeof(sizes) / sizeof(sizes[0]) };
	static const unsigned char zero[BB_IPC_HANDLE_SIZE];

	cuda_env(NULL);
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	bb_buf *b[N];
	where w[N];

	for (int i = 0; i < N; i++) {
		b[i] = alloc_cuda(c, sizes[i], 0);
		w[i] = where_of(b[i]);
		cr_assert_eq(w[i].size, sizes[i], "size of buffer %d", i);
		cr_assert_eq(w[i].offset % 256, 0, "offset %llu of buffer %d",
			     (unsigned long long)w[i].offset, i);
		cr_assert_eq(memcmp(w[i].uuid, dev_of(&s, 0)->uuid, 16), 0);
		cr_assert_neq(memcmp(w[i].slab, zero, sizeof(zero)), 0, "an all-zero handle");
		cr_assert(same_slab(&w[i], &w[0]), "buffer %d is not in the slab of buffer 0", i);
		if (g_vmm)
			cr_assert(w[i].allocation_size >= 2 * MIB &&
					  w[i].offset + w[i].size <= w[i].allocation_size,
				  "buffer %d at %llu+%zu in an allocation of %llu bytes", i,
				  (unsigned long long)w[i].offset, w[i].size,
				  (unsigned long long)w[i].allocation_size);
		for (int j = 0; j < i; j++)
			cr_assert(w[i].offset >= w[j].offset + w[j].size ||
					  w[j].offset >= w[i].offset + w[i].size,
				  "buffers %d and %d overlap", i, j);
	}
	/* Larger than a slab: an allocation of its own. */
	bb_buf *big = alloc_cuda(c, 5 * MIB, 0);
	where wbig = where_of(big);
	cr_assert_eq(wbig.offset, 0);
	cr_assert_eq(wbig.size, 5 * MIB);
	cr_assert(!same_slab(&wbig, &w[0]), "a buffer larger than a slab shares the slab's handle");
	if (g_vmm)
		cr_assert_geq(wbig.allocation_size, 5 * MIB);
	if (s.n > 1) {
		bb_buf *o = alloc_cuda(c, 4096, 1);
		where wo = where_of(o);
		cr_assert_eq(memcmp(wo.uuid, dev_of(&s, 1)->uuid, 16), 0);
		cr_assert(!same_slab(&wo, &w[0]), "devices 0 and 1 share a handle");
		unref_gone(c, o);
	}

	/* What the handle gives is what any framework can open itself. */
	struct ctx x = {.sock = d->sock, .size = sizes[N - 1], .seed = 0xf4a3, .vmm_fd = -1};
	x.ids[0] = bb_id(b[N - 1]);
	memcpy(x.uuid, dev_of(&s, 0)->uuid, 16);
	x.w = w[N - 1];
	run_child(writer_child, &x, "the writer");
	if (g_vmm) {
		bb_cuda_vmm v;
		cr_assert_eq(bb_cuda_vmm_of(b[N - 1], &v), 0, "bb_cuda_vmm_of: %s",
			     bb_last_error());
		cr_assert_geq(v.fd, 0);
		cr_assert(fcntl(v.fd, F_GETFD) & FD_CLOEXEC,
			  "bb_cuda_vmm_of's fd is not O_CLOEXEC");
		x.vmm_fd = v.fd;
		run_child(framework_child, &x, "the framework-style reader");
		close(v.fd);
	} else {
		run_child(framework_child, &x, "the framework-style reader");
	}

	/* Not for host buffers, and each kind has its own. */
	bb_buf *hb;
	bb_cuda_ipc junk;
	bb_cuda_vmm vjunk;
	cr_assert_eq(alloc_kind(c, BB_HOST, 4096, 0, &hb), 0);
	cr_assert_eq(bb_cuda_ipc_of(hb, &junk), BB_ERR_INVALID);
	cr_assert_eq(bb_cuda_vmm_of(hb, &vjunk), BB_ERR_INVALID);
	cr_assert_eq(bb_cuda_handle_of(hb), BB_CUDA_HANDLE_DEFAULT);
	cr_assert_eq(bb_cuda_handle_of(NULL), BB_CUDA_HANDLE_DEFAULT);
	cr_assert_eq(bb_cuda_ipc_of(NULL, &junk), BB_ERR_INVALID);
	cr_assert_eq(bb_cuda_ipc_of(b[0], NULL), BB_ERR_INVALID);
	cr_assert_eq(bb_cuda_vmm_of(NULL, &vjunk), BB_ERR_INVALID);
	cr_assert_eq(bb_cuda_vmm_of(b[0], NULL), BB_ERR_INVALID);
	if (g_vmm)
		cr_assert_eq(bb_cuda_ipc_of(b[0], &junk), BB_ERR_UNSUPPORTED);
	else
		cr_assert_eq(bb_cuda_vmm_of(b[0], &vjunk), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(bb_last_error(), g_vmm ? "bb_cuda_vmm_of" : "bb_cuda_ipc_of"),
		  "the other accessor's refusal does not name the right one: %s", bb_last_error());
	unref_gone(c, hb);

	for (int i = 0; i < N; i++)
		unref_gone(c, b[i]);
	unref_gone(c, big);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- a client without the driver ------------------------------------------- */

/* No driver here: bb_map of a CUDA buffer is unsupported, its handle
 * (IPC handle or allocation fd) still comes, and host buffers map. */
static int driverless_child(void *arg)
{
	struct ctx *x = arg;
	where w;
	bb_client *c;
	bb_buf *b, *hb;
	void *p = (void *)1;

	setenv("BUFBROKER_CUDA_LIBRARY", "/nonexistent/libcuda.so.1", 1);
	if (bb_connect(x->sock, &c) != 0 || bb_open(c, x->ids[0], &b) != 0)
		return 100;
	if (bb_map(b, &p) != BB_ERR_UNSUPPORTED)
		return 101;
	if (p != NULL)
		return 102;
	if (!strstr(bb_last_error(), "/nonexistent/libcuda.so.1"))
		return 103;
	if (bb_map(b, &p) != BB_ERR_UNSUPPORTED)
		return 104; /* and again: the reason is kept */
	if (where_get(b, &w) != 0)
		return 105;
	if (memcmp(&w, &x->w, sizeof(w)) != 0)
		return 106;
	if (bb_open(c, x->ids[1], &hb) != 0 || bb_map(hb, &p) != 0 || !p)
		return 107;
	memset(p, 0x5a, 4096);
	bb_unref(hb);
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(cuda, a_client_without_the_driver_cannot_map_but_gets_the_handle)
{
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_cuda(c, 12345, 0), *hb;
	struct ctx x = {.sock = d->sock};
	unsigned char *hp;

	x.w = where_of(b);
	cr_assert_eq(alloc_kind(c, BB_HOST, 4096, 0, &hb), 0);
	cr_assert_eq(bb_map(hb, (void **)&hp), 0);
	memset(hp, 0, 4096);
	x.ids[0] = bb_id(b);
	x.ids[1] = bb_id(hb);
	run_child(driverless_child, &x, "the driverless client");
	cr_assert_eq(hp[4095], 0x5a, "the driverless client's host write did not land");
	unref_gone(c, hb);
	unref_gone(c, b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- handle kinds ---------------------------------------------------------------- */

/* Writes then reads every one of x->n buffers (ids) in children. */
static void bytes_cross(struct ctx *x, const char *what)
{
	for (int i = 0; i < x->n; i++) {
		struct ctx y = *x;

		y.ids[0] = x->ids[i];
		y.seed = x->seed + (uint32_t)i;
		y.ch.fd[0] = y.ch.fd[1] = -1;
		run_child(writer_child, &y, what);
		run_child(reader_child, &y, what);
	}
}

Test(cuda, each_handle_kind_is_what_was_asked_for_and_refuses_the_others_accessor)
{
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	bb_alloc_opts o = {.size = 4096, .kind = BB_CUDA};
	bb_cuda_ipc ipc;
	bb_cuda_vmm v;
	bb_buf *b;

	bb_buf *leg = alloc_handle(c, 8192, BB_CUDA_HANDLE_LEGACY);
	bb_buf *vmm = alloc_handle(c, 8192, BB_CUDA_HANDLE_VMM);
	bb_buf *aut = alloc_handle(c, 8192, BB_CUDA_HANDLE_AUTO);
	bb_buf *dfl = alloc_handle(c, 8192, BB_CUDA_HANDLE_DEFAULT);
	cr_assert_eq(bb_cuda_handle_of(leg), BB_CUDA_HANDLE_LEGACY);
	cr_assert_eq(bb_cuda_handle_of(vmm), BB_CUDA_HANDLE_VMM);
	/* Every fake device exports file descriptors. */
	cr_assert_eq(bb_cuda_handle_of(aut), g_fake ? BB_CUDA_HANDLE_VMM : bb_cuda_handle_of(aut));
	cr_assert_eq(bb_cuda_handle_of(dfl), g_vmm ? BB_CUDA_HANDLE_VMM : BB_CUDA_HANDLE_LEGACY);

	cr_assert_eq(bb_cuda_vmm_of(leg, &v), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(bb_last_error(), "bb_cuda_ipc_of"), "%s", bb_last_error());
	cr_assert_eq(bb_cuda_ipc_of(vmm, &ipc), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(bb_last_error(), "bb_cuda_vmm_of"), "%s", bb_last_error());
	cr_assert_eq(bb_cuda_ipc_of(leg, &ipc), 0, "%s", bb_last_error());
	cr_assert_eq(bb_cuda_vmm_of(vmm, &v), 0, "%s", bb_last_error());
	close(v.fd);

	/* Out of range, or a kind for a host buffer: invalid, not sent. */
	cr_assert_eq(bb_alloc_cuda(c, &o, (bb_cuda_handle)7, &b), BB_ERR_INVALID);
	cr_assert_null(b);
	o.kind = BB_HOST;
	cr_assert_eq(bb_alloc_cuda(c, &o, BB_CUDA_HANDLE_VMM, &b), BB_ERR_INVALID);
	cr_assert_eq(bb_alloc_cuda(c, &o, BB_CUDA_HANDLE_LEGACY, &b), BB_ERR_INVALID);
	cr_assert_eq(bb_alloc_cuda(c, &o, BB_CUDA_HANDLE_DEFAULT, &b), 0, "%s", bb_last_error());
	cr_assert_eq(bb_cuda_handle_of(b), BB_CUDA_HANDLE_DEFAULT);
	unref_gone(c, b);

	/* Both kinds map in other processes and carry bytes, side by side. */
	struct ctx x = {.sock = d->sock, .n = 2, .size = 8192, .seed = 0x6b1d};
	x.ids[0] = bb_id(leg);
	x.ids[1] = bb_id(vmm);
	memcpy(x.uuid, dev_of(&s, 0)->uuid, 16);
	bytes_cross(&x, "a child mapping a legacy and a VMM buffer");

	unref_gone(c, leg);
	unref_gone(c, vmm);
	unref_gone(c, aut);
	unref_gone(c, dfl);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(cuda, a_forbidden_kind_is_refused_with_the_reason_never_replaced)
{
	static const char *const no_vmm[] = {"--cuda-forbid", "vmm", "--cuda-handle", "legacy",
					     NULL};
	static const char *const no_legacy[] = {"--cuda-forbid", "legacy", "--cuda-handle", "vmm",
						NULL};
	bb_alloc_opts o = {.size = 4096, .kind = BB_CUDA};
	bb_buf *b;
	int rc;

	cuda_env(NULL);
	bbt_daemon *d = bbt_start(no_vmm);
	bb_client *c = bbt_connect(d);
	rc = bb_alloc_cuda(c, &o, BB_CUDA_HANDLE_VMM, &b);
	cr_assert_eq(rc, BB_ERR_UNSUPPORTED, "VMM where forbidden: %d (%s)", rc, bb_last_error());
	cr_assert_null(b);
	cr_assert(strstr(bb_last_error(), "cuda-forbid"), "the reason: %s", bb_last_error());
	b = alloc_handle(c, 4096, BB_CUDA_HANDLE_AUTO);
	cr_assert_eq(bb_cuda_handle_of(b), BB_CUDA_HANDLE_LEGACY, "AUTO where VMM is forbidden");
	unref_gone(c, b);
	bb_disconnect(c);
	bbt_stop_clean(d);

	cuda_env(NULL);
	d = bbt_start(no_legacy);
	c = bbt_connect(d);
	rc = bb_alloc_cuda(c, &o, BB_CUDA_HANDLE_LEGACY, &b);
	cr_assert_eq(rc, BB_ERR_UNSUPPORTED, "legacy where forbidden: %d (%s)", rc,
		     bb_last_error());
	cr_assert(strstr(bb_last_error(), "cuda-forbid"), "the reason: %s", bb_last_error());
	b = alloc_handle(c, 4096, BB_CUDA_HANDLE_DEFAULT);
	cr_assert_eq(bb_cuda_handle_of(b), BB_CUDA_HANDLE_VMM);
	unref_gone(c, b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- a VMM allocation's fd on one connection ------------------------------------ */

/* ids[0] and ids[1] are VMM buffers of one allocation, ids[1] written with
 * seed. The connection lets its only handle in the allocation go while
 * keeping a raw count on it, so the daemon grants ids[1] without the fd
 * (it held a count there) although the connection closed the fd: bb_map
 * and bb_cuda_vmm_of must get it again. */
static int refetch_child(void *arg)
{
	struct ctx *x = arg;
	struct cu cu;
	bb_client *c;
	bb_buf *first, *second;
	bb_cuda_vmm v;
	void *p;

	if (bb_connect(x->sock, &c) != 0 || bb_open(c, x->ids[0], &first) != 0)
		return 110;
	if (bb_retain(c, x->ids[0], 1) != 0)
		return 111;
	bb_unref(first);
	if (bb_open(c, x->ids[1], &second) != 0)
		return 112;
	if (bb_map(second, &p) != 0) {
		fprintf(stderr, "test child: bb_map: %s\n", bb_last_error());
		return 113;
	}
	if (cu_load(&cu, x->uuid) != 0 || cu_check(&cu, p, x->size, x->seed) != 0)
		return 114;
	if (bb_cuda_vmm_of(second, &v) != 0) {
		fprintf(stderr, "test child: bb_cuda_vmm_of: %s\n", bb_last_error());
		return 115;
	}
	close(v.fd);
	bb_unref(second);
	if (bb_release(c, x->ids[0], 1) != 0)
		return 116;
	bb_disconnect(c);
	return 0;
}

/* Two VMM buffers of one allocation, ids[0] and ids[1] (written with
 * seed) for child to use; then nothing of them is left behind. */
static void two_in_one_allocation(int (*child)(void *), uint32_t seed, const char *what)
{
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	struct ctx x = {.sock = d->sock, .size = 65536, .seed = seed};
	where w0, w1;

	memcpy(x.uuid, dev_of(&s, 0)->uuid, 16);
	bb_buf *b0 = alloc_handle(c, 4096, BB_CUDA_HANDLE_VMM);
	bb_buf *b1 = alloc_handle(c, x.size, BB_CUDA_HANDLE_VMM);
	cr_assert_eq(where_get(b0, &w0), 0);
	cr_assert_eq(where_get(b1, &w1), 0);
	cr_assert(same_slab(&w0, &w1), "two small VMM buffers in different allocations");
	x.ids[0] = bb_id(b1);
	run_child(writer_child, &x, "the writer");
	x.ids[0] = bb_id(b0);
	x.ids[1] = bb_id(b1);
	run_child(child, &x, what);
	cr_assert_eq(bbt_refs_until(c, x.ids[1], 1, 2000), 1, "%s left counts", what);
	unref_gone(c, b0);
	unref_gone(c, b1);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(cuda, a_vmm_grant_that_came_without_the_fd_it_needs_maps_through_allocation_fd)
{
	two_in_one_allocation(refetch_child, 0xfd0, "the client that let the fd go");
}

/* One thread drops the connection's last handle of an allocation while
 * another adopts a token of another buffer in it, round after round:
 * whichever the daemon sees first, the adopted buffer maps and reads. */
struct race {
	bb_client *c;
	bb_buf *drop;    /* the handle to let go */
	bb_token token;  /* the buffer to adopt */
	bb_buf *adopted; /* what bb_adopt gave */
	int rc;          /* bb_adopt's answer */
	pthread_barrier_t *go;
};

static void *race_drop(void *arg)
{
	struct race *r = arg;

	pthread_barrier_wait(r->go);
	bb_unref(r->drop);
	return NULL;
}

static void *race_adopt(void *arg)
{
	struct race *r = arg;

	pthread_barrier_wait(r->go);
	r->rc = bb_adopt(r->c, &r->token, &r->adopted);
	return NULL;
}

static int race_child(void *arg)
{
	struct ctx *x = arg;
	pthread_barrier_t go;
	struct cu cu;
	bb_client *c, *keeper;
	bb_buf *kept;
	void *p;

	if (pthread_barrier_init(&go, NULL, 2) != 0)
		return 120;
	if (bb_connect(x->sock, &c) != 0 || bb_connect(x->sock, &keeper) != 0)
		return 121;
	if (bb_open(keeper, x->ids[1], &kept) != 0 || cu_load(&cu, x->uuid) != 0)
		return 122;
	for (int round = 0; round < 40; round++) {
		struct race r = {.c = c, .go = &go};
		pthread_t t1, t2;

		if (bb_open(c, x->ids[0], &r.drop) != 0 || bb_take(bb_ref(kept), &r.token) != 0)
			return 123;
		if (pthread_create(&t1, NULL, race_drop, &r) != 0 ||
		    pthread_create(&t2, NULL, race_adopt, &r) != 0)
			return 124;
		pthread_join(t1, NULL);
		pthread_join(t2, NULL);
		if (r.rc != 0)
			return 125;
		if (bb_map(r.adopted, &p) != 0) {
			fprintf(stderr, "test child: round %d: bb_map: %s\n", round,
				bb_last_error());
			return 126;
		}
		if (cu_check(&cu, p, x->size, x->seed) != 0)
			return 127;
		/* The last handle of the allocation goes: unmapped, fd closed. */
		bb_unref(r.adopted);
	}
	bb_unref(kept);
	bb_disconnect(keeper);
	bb_disconnect(c);
	pthread_barrier_destroy(&go);
	return 0;
}

Test(cuda, dropping_an_allocations_last_handle_while_adopting_another_buffer_of_it_loses_no_fd)
{
	two_in_one_allocation(race_child, 0x4ace, "the racing client");
}

/* ---- a restarted daemon's allocations are not the old one's ------------------- */

/* Maps a VMM buffer of the daemon, holds it across the daemon's restart
 * (told through x->ch), then maps a buffer of the new daemon run whose
 * allocation has the same id: it must be imported afresh, not taken for
 * the old run's mapping that this process still holds. */
static int restart_child(void *arg)
{
	struct ctx *x = arg;
	bb_alloc_opts o = {.size = 4096, .kind = BB_CUDA};
	unsigned long i0;
	bb_client *c, *c2;
	bb_buf *old, *cur;
	bb_cuda_vmm v1, v2;
	struct cu cu;
	void *p1, *p2;
	char go;

	if (bb_connect(x->sock, &c) != 0 || bb_alloc_cuda(c, &o, BB_CUDA_HANDLE_VMM, &old) != 0)
		return 140;
	if (bb_map(old, &p1) != 0 || bb_cuda_vmm_of(old, &v1) != 0)
		return 141;
	close(v1.fd);
	if (cu_load(&cu, v1.device_uuid) != 0 || (g_fake && !cu.vmm_calls))
		return 142;
	i0 = g_fake ? cu.vmm_calls("cuMemImportFromShareableHandle") : 0;
	if (bbt_send(x->ch.fd[1], "m", 1) != 0 || bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS))
		return 143;
	/* The daemon was restarted on the same socket path. */
	if (bb_connect(x->sock, &c2) != 0 || bb_alloc_cuda(c2, &o, BB_CUDA_HANDLE_VMM, &cur) != 0)
		return 144;
	if (bb_cuda_vmm_of(cur, &v2) != 0)
		return 145;
	close(v2.fd);
	if (v2.allocation != v1.allocation || v2.offset != v1.offset)
		return 146; /* the test needs the same identity in the new run */
	if (bb_map(cur, &p2) != 0)
		return 147;
	if (p2 == p1)
		return 148; /* the old run's mapping */
	if (g_fake && cu.vmm_calls("cuMemImportFromShareableHandle") - i0 != 1)
		return 149;
	if (cu_write(&cu, p2, 4096, x->seed) != 0 || cu_check(&cu, p2, 4096, x->seed) != 0)
		return 150;
	bb_unref(cur);
	bb_unref(old);
	bb_disconnect(c2);
	bb_disconnect(c);
	return 0;
}

Test(cuda, a_restarted_daemons_allocation_is_never_taken_for_the_old_runs_mapping)
{
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	struct ctx x = {.sock = d->sock, .seed = 0x4e57};
	char m;

	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(restart_child, &x);
	if (bbt_recv(x.ch.fd[0], &m, 1, CHILD_TIMEOUT_MS) != 0)
		cr_assert_fail("the client failed at step %d", bbt_join(pid, CHILD_TIMEOUT_MS));
	bbt_kill(d);
	bbt_restart(d);
	bbt_send(x.ch.fd[0], "g", 1);
	int code = bbt_join(pid, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the client across the restart failed at step %d", code);
	bbt_chan_close(&x.ch);
	bbt_stop_clean(d);
}

/* ---- containers: a consumer in a PID namespace of its own -------------------------- */

/* In a new PID namespace (as `unshare --pid --fork` makes), with nothing
 * of its parent but the socket's path: opens and maps the VMM buffer
 * ids[0] and checks its bytes, and the legacy buffer ids[1], whose IPC
 * handle cannot be opened there (FAKECUDA_LEGACY_IPC_NAMESPACE=strict),
 * fails to map with a reason. */
static int ns_consumer(const struct ctx *x)
{
	struct cu cu;
	bb_client *c;
	bb_buf *v, *l;
	void *p = NULL;
	int rc;

	if (getpid() != 1)
		return 131; /* not in a namespace of its own */
	if (bb_connect(x->sock, &c) != 0 || bb_open(c, x->ids[0], &v) != 0 ||
	    bb_open(c, x->ids[1], &l) != 0)
		return 132;
	if (bb_map(v, &p) != 0) {
		fprintf(stderr, "test child: bb_map of the VMM buffer: %s\n", bb_last_error());
		return 133;
	}
	if (cu_load(&cu, x->uuid) != 0 || cu_check(&cu, p, x->size, x->seed) != 0)
		return 134;
	rc = bb_map(l, &p);
	if (rc == 0)
		return 135;
	if (!strstr(bb_last_error(), "namespace") || !strstr(bb_last_error(), "VMM")) {
		fprintf(stderr, "test child: the legacy failure does not say why: %s\n",
			bb_last_error());
		return 136;
	}
	bb_unref(v);
	bb_unref(l);
	bb_disconnect(c);
	return 0;
}

static int ns_child(void *arg)
{
	struct ctx *x = arg;
	int status;

	if (unshare(CLONE_NEWPID) != 0) {
		fprintf(stderr, "test child: unshare(CLONE_NEWPID): %s\n", strerror(errno));
		return errno == EPERM || errno == EINVAL || errno == ENOSPC ? 77 : 130;
	}
	pid_t pid = fork();
	if (pid < 0)
		return 130;
	if (pid == 0) {
		/* Only the socket's path leads to the daemon: no inherited fd. */
		close_range(3, ~0u, 0);
		_exit(ns_consumer(x));
	}
	if (waitpid(pid, &status, 0) != pid)
		return 130;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

Test(cuda, a_consumer_in_its_own_pid_namespace_maps_vmm_buffers_and_is_told_why_legacy_fail)
{
	/* With the fake, FAKECUDA_LEGACY_IPC_NAMESPACE=strict makes the legacy
	 * open fail as a real driver's does across PID namespaces; against a
	 * real driver (scripts/gpu-check.sh) the driver itself is tested. */
	cuda_env(NULL);
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	devstat s = dev_status_ok(c);
	struct ctx x = {.sock = d->sock, .n = 2, .size = 65536, .seed = 0x9a5e};

	bb_buf *v = alloc_handle(c, x.size, BB_CUDA_HANDLE_VMM);
	bb_buf *l = alloc_handle(c, x.size, BB_CUDA_HANDLE_LEGACY);
	x.ids[0] = bb_id(v);
	x.ids[1] = bb_id(l);
	memcpy(x.uuid, dev_of(&s, 0)->uuid, 16);
	run_child(writer_child, &x, "the writer");

	setenv("FAKECUDA_LEGACY_IPC_NAMESPACE", "strict", 1);
	int code = bbt_join(bbt_spawn(ns_child, &x), CHILD_TIMEOUT_MS);
	unsetenv("FAKECUDA_LEGACY_IPC_NAMESPACE");
	/* A skip fails the program under CI (tests/criterion_main.c). */
	if (code == 77)
		cr_skip_test("unshare(CLONE_NEWPID) is not permitted here (needs root)");
	cr_assert_eq(code, 0, "the consumer in its own PID namespace failed at step %d", code);
	unref_gone(c, v);
	unref_gone(c, l);
	bb_disconnect(c);
	bbt_stop_clean(d);
}
