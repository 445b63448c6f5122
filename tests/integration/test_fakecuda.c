/*
 * tests/fakecuda's libfakecuda.so behaves as the CUDA driver does, across
 * processes: devices and UUIDs from its knobs, CUDA_VISIBLE_DEVICES,
 * memory that an IPC handle reaches from other processes, the driver's
 * errors (cuInit first, a current context, opening in the exporter, a
 * second open, running out), device-wide accounting, fork, threads, and
 * its test hooks. It is loaded the way the project loads the driver:
 * bb_cuda_load with BUFBROKER_CUDA_LIBRARY = $BB_FAKECUDA.
 *
 * Each test runs in a fresh namespace (FAKECUDA_NAMESPACE) and removes its
 * shared memory objects at the end. CUDA work of children happens in
 * processes forked before their parent initialized the driver (a child
 * forked after cuInit cannot use it, as with the real driver). Children
 * report through exit codes: 0 is success, any other value names the step
 * that failed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <poll.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_api.h"
#include "harness.h"

#define CHILD_TIMEOUT_MS 10000
#define MiB (1024ull * 1024)
#define MAXDEV 8

static char g_ns[64];

static void setup(void)
{
	const char *lib = getenv("BB_FAKECUDA");
	if (lib && lib[0])
		setenv("BUFBROKER_CUDA_LIBRARY", lib, 1);
	snprintf(g_ns, sizeof(g_ns), "bbtest-fakecuda-%d", (int)getpid());
	setenv("FAKECUDA_NAMESPACE", g_ns, 1);
	unsetenv("FAKECUDA_DEVICES");
	unsetenv("FAKECUDA_MEMORY");
	unsetenv("CUDA_VISIBLE_DEVICES");
}

/* The library itself, for its hooks, whether or not the driver is loaded. */
static void *fake_lib(void)
{
	const char *lib = getenv("BB_FAKECUDA");
	cr_assert(lib && lib[0], "BB_FAKECUDA must name the built libfakecuda.so");
	void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	cr_assert_not_null(h, "dlopen %s: %s", lib, dlerror());
	return h;
}

static void reset_namespace(void)
{
	const char *lib = getenv("BB_FAKECUDA");
	void *h = lib ? dlopen(lib, RTLD_NOW | RTLD_LOCAL) : NULL;
	if (!h)
		return;
	void (*reset)(void) = (void (*)(void))dlsym(h, "fakecuda_reset_namespace");
	if (reset)
		reset();
	dlclose(h);
}

static void teardown(void)
{
	reset_namespace();
}

TestSuite(fakecuda, .init = setup, .fini = teardown, .timeout = 60);

/* ---- helpers ---------------------------------------------------------- */

static const char *cuerr(const bb_cuda *api, CUresult rc)
{
	static _Thread_local char buf[160];
	return bb_cuda_error(api, rc, buf, sizeof(buf));
}

#define CU_EQ(api, call, want)                                                                  \
	do {                                                                                    \
		CUresult rc_ = (call);                                                          \
		cr_assert_eq(rc_, (want), "%s: %s, want %d", #call, cuerr((api), rc_), (want)); \
	} while (0)
#define CU_OK(api, call) CU_EQ(api, call, CUDA_SUCCESS)

/* In a child: fail with this step number unless cond. */
#define STEP(n, cond)               \
	do {                        \
		if (!(cond))        \
			return (n); \
	} while (0)

static void load(bb_cuda *api)
{
	char err[256];
	int rc = bb_cuda_load(api, err, sizeof(err));
	cr_assert_eq(rc, 0, "bb_cuda_load: %s", err);
	cr_assert(api->MemcpyHtoD && api->MemcpyDtoH && api->MemsetD8 && api->CtxSynchronize,
		  "the fake lacks an optional entry point");
}

static int child_load(bb_cuda *api)
{
	char err[256];
	if (bb_cuda_load(api, err, sizeof(err)) == 0)
		return 0;
	fprintf(stderr, "child %d: %s\n", (int)getpid(), err);
	return -1;
}

/* Retain ordinal's primary context and make it current on this thread. */
static CUresult make_current(const bb_cuda *api, int ordinal, CUcontext *out)
{
	CUdevice dev;
	CUcontext ctx;
	CUresult rc = api->DeviceGet(&dev, ordinal);
	if (rc == CUDA_SUCCESS)
		rc = api->DevicePrimaryCtxRetain(&ctx, dev);
	if (rc == CUDA_SUCCESS)
		rc = api->CtxSetCurrent(ctx);
	if (rc == CUDA_SUCCESS && out)
		*out = ctx;
	return rc;
}

static void current(const bb_cuda *api, int ordinal)
{
	CU_OK(api, make_current(api, ordinal, NULL));
}

static void uuid_of(const bb_cuda *api, int ordinal, unsigned char out[16])
{
	CUuuid u;
	CU_OK(api, api->DeviceGetUuid(&u, ordinal));
	memcpy(out, u.bytes, 16);
}

static void mem_info(const bb_cuda *api, size_t *free_b, size_t *total_b)
{
	CU_OK(api, api->MemGetInfo(free_b, total_b));
}

static size_t free_now(const bb_cuda *api)
{
	size_t f, t;
	mem_info(api, &f, &t);
	return f;
}

/* /dev/shm objects of this test's namespace whose name contains `with`
 * after the namespace prefix ("" for all). */
static int shm_objects(const char *with)
{
	void *h = fake_lib();
	void (*prefix)(char *, size_t) = (void (*)(char *, size_t))dlsym(h, "fakecuda_shm_prefix");
	cr_assert_not_null(prefix, "fakecuda_shm_prefix not exported");
	char p[64];
	prefix(p, sizeof(p));
	dlclose(h);
	DIR *d = opendir("/dev/shm");
	cr_assert_not_null(d, "opendir /dev/shm: %s", strerror(errno));
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strncmp(e->d_name, p, strlen(p)) == 0 && strstr(e->d_name + strlen(p), with))
			n++;
	}
	closedir(d);
	return n;
}

/* ---- children ------------------------------------------------------------ */

/* What one process sees of the devices. */
struct seen {
	int loaded;    /* bb_cuda_load succeeded */
	char err[200]; /* its error otherwise */
	int n;         /* cuDeviceGetCount */
	unsigned char uuid[MAXDEV][16];
	char name[MAXDEV][64];
	size_t total[MAXDEV];
};

struct see_arg {
	const char *cvd; /* CUDA_VISIBLE_DEVICES, NULL: unset */
	bbt_chan ch;
};

static int see_child(void *arg)
{
	struct see_arg *a = arg;
	struct seen s;
	bb_cuda api;
	memset(&s, 0, sizeof(s));
	if (a->cvd)
		setenv("CUDA_VISIBLE_DEVICES", a->cvd, 1);
	else
		unsetenv("CUDA_VISIBLE_DEVICES");
	if (bb_cuda_load(&api, s.err, sizeof(s.err)) == 0) {
		s.loaded = 1;
		STEP(1, api.DeviceGetCount(&s.n) == CUDA_SUCCESS);
		for (int i = 0; i < s.n && i < MAXDEV; i++) {
			CUdevice dev;
			CUuuid u;
			STEP(2, api.DeviceGet(&dev, i) == CUDA_SUCCESS && dev == i);
			STEP(3, api.DeviceGetUuid(&u, dev) == CUDA_SUCCESS);
			memcpy(s.uuid[i], u.bytes, 16);
			STEP(4,
			     api.DeviceGetName(s.name[i], sizeof(s.name[i]), dev) == CUDA_SUCCESS);
			STEP(5, api.DeviceTotalMem(&s.total[i], dev) == CUDA_SUCCESS);
		}
		CUdevice dev;
		STEP(6, api.DeviceGet(&dev, s.n) == CUDA_ERROR_INVALID_DEVICE);
		bb_cuda_unload(&api);
	}
	STEP(7, bbt_send(a->ch.fd[1], &s, sizeof(s)) == 0);
	return 0;
}

/* The devices a fresh process sees with CUDA_VISIBLE_DEVICES = cvd. */
static struct seen see(const char *cvd)
{
	struct see_arg a = {.cvd = cvd};
	struct seen s;
	bbt_chan_open(&a.ch);
	pid_t pid = bbt_spawn(see_child, &a);
	int got = bbt_recv(a.ch.fd[0], &s, sizeof(s), CHILD_TIMEOUT_MS);
	int rc = bbt_join(pid, CHILD_TIMEOUT_MS);
	bbt_chan_close(&a.ch);
	cr_assert_eq(rc, 0, "device child (CUDA_VISIBLE_DEVICES=%s) failed at step %d",
		     cvd ? cvd : "(unset)", rc);
	cr_assert_eq(got, 0, "device child sent nothing");
	return s;
}

/* Sees exactly the physical devices want[0..n) of ref, in that order. */
static void assert_sees(const char *cvd, const struct seen *ref, const int *want, int n)
{
	struct seen s = see(cvd);
	if (n == 0) {
		cr_assert(!s.loaded, "CUDA_VISIBLE_DEVICES=%s: cuInit succeeded with %d devices",
			  cvd, s.n);
		cr_assert(strstr(s.err, "CUDA_ERROR_NO_DEVICE"), "CUDA_VISIBLE_DEVICES=%s: %s", cvd,
			  s.err);
		return;
	}
	cr_assert(s.loaded, "CUDA_VISIBLE_DEVICES=%s: %s", cvd, s.err);
	cr_assert_eq(s.n, n, "CUDA_VISIBLE_DEVICES=%s: %d devices, want %d", cvd, s.n, n);
	for (int i = 0; i < n; i++)
		cr_assert(memcmp(s.uuid[i], ref->uuid[want[i]], 16) == 0,
			  "CUDA_VISIBLE_DEVICES=%s: ordinal %d is not physical device %d", cvd, i,
			  want[i]);
}

/* A process that allocates on one device, fills it, exports it, and holds it
 * until told: 'f' frees it (answers cuMemFree's result) and exits; anything
 * else exits without freeing. */
struct holder {
	int ordinal;
	size_t size;
	uint32_t seed;
	const char *ns; /* FAKECUDA_NAMESPACE for it; NULL: the test's */
	bbt_chan ch;
};

static int holder_child(void *arg)
{
	struct holder *h = arg;
	bb_cuda api;
	CUdeviceptr p;
	CUipcMemHandle hd;
	unsetenv("CUDA_VISIBLE_DEVICES");
	if (h->ns)
		setenv("FAKECUDA_NAMESPACE", h->ns, 1);
	STEP(1, child_load(&api) == 0);
	STEP(2, make_current(&api, h->ordinal, NULL) == CUDA_SUCCESS);
	STEP(3, api.MemAlloc(&p, h->size) == CUDA_SUCCESS);
	char *buf = malloc(h->size);
	STEP(4, buf);
	bbt_fill(buf, h->size, h->seed);
	STEP(5, api.MemcpyHtoD(p, buf, h->size) == CUDA_SUCCESS);
	free(buf);
	STEP(6, api.IpcGetMemHandle(&hd, p) == CUDA_SUCCESS);
	STEP(7, bbt_send(h->ch.fd[1], &hd, sizeof(hd)) == 0);
	char cmd;
	STEP(8, bbt_recv(h->ch.fd[1], &cmd, 1, 30000) == 0);
	if (cmd == 'f') {
		int rc = api.MemFree(p);
		STEP(9, bbt_send(h->ch.fd[1], &rc, sizeof(rc)) == 0);
		bb_cuda_unload(&api);
	}
	return 0;
}

static pid_t holder_start(struct holder *h, CUipcMemHandle *hd)
{
	bbt_chan_open(&h->ch);
	pid_t pid = bbt_spawn(holder_child, h);
	if (bbt_recv(h->ch.fd[0], hd, sizeof(*hd), CHILD_TIMEOUT_MS) != 0) {
		int rc = bbt_join(pid, 1000);
		cr_assert_fail("holder sent no handle; it failed at step %d", rc);
	}
	return pid;
}

static void holder_free(struct holder *h, pid_t pid)
{
	int rc = -1;
	cr_assert_eq(bbt_send(h->ch.fd[0], "f", 1), 0);
	cr_assert_eq(bbt_recv(h->ch.fd[0], &rc, sizeof(rc), CHILD_TIMEOUT_MS), 0,
		     "holder did not answer 'f'");
	cr_assert_eq(rc, CUDA_SUCCESS, "holder's cuMemFree: %d", rc);
	cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 0, "holder failed");
	bbt_chan_close(&h->ch);
}

/* ---- devices -------------------------------------------------------------- */

Test(fakecuda, devices_come_from_env_with_distinct_stable_uuids)
{
	setenv("FAKECUDA_DEVICES", "3", 1);
	setenv("FAKECUDA_MEMORY", "64M", 1);
	struct seen a = see(NULL);
	cr_assert(a.loaded, "%s", a.err);
	cr_assert_eq(a.n, 3);
	for (int i = 0; i < 3; i++) {
		char want[64];
		snprintf(want, sizeof(want), "FakeCUDA Device %d", i);
		cr_assert_str_eq(a.name[i], want);
		cr_assert_eq(a.total[i], 64 * MiB, "device %d total %zu", i, a.total[i]);
		for (int j = 0; j < i; j++)
			cr_assert(memcmp(a.uuid[i], a.uuid[j], 16) != 0,
				  "devices %d and %d share a UUID", i, j);
	}
	/* Stable: another process, and another device count, see the same UUIDs. */
	struct seen b = see(NULL);
	cr_assert(memcmp(a.uuid, b.uuid, sizeof(a.uuid)) == 0, "UUIDs changed between processes");
	setenv("FAKECUDA_DEVICES", "5", 1);
	struct seen c = see(NULL);
	cr_assert_eq(c.n, 5);
	cr_assert(memcmp(a.uuid, c.uuid, 3 * 16) == 0, "UUIDs depend on the device count");
	unsetenv("FAKECUDA_DEVICES");
	unsetenv("FAKECUDA_MEMORY");
	struct seen d = see(NULL);
	cr_assert_eq(d.n, 2, "default device count");
	cr_assert_eq(d.total[0], 1024 * MiB, "default memory %zu", d.total[0]);
}

typedef CUresult (*fn_init)(unsigned int);
typedef CUresult (*fn_count)(int *);
typedef CUresult (*fn_alloc)(CUdeviceptr *, size_t);
typedef CUresult (*fn_setcur)(CUcontext);
typedef CUresult (*fn_version)(int *);
typedef CUresult (*fn_errname)(CUresult, const char **);

Test(fakecuda, calls_before_cuInit_fail_not_initialized)
{
	void *h = fake_lib();
	fn_init init = (fn_init)dlsym(h, "cuInit");
	fn_count count = (fn_count)dlsym(h, "cuDeviceGetCount");
	fn_alloc alloc = (fn_alloc)dlsym(h, "cuMemAlloc_v2");
	fn_setcur setcur = (fn_setcur)dlsym(h, "cuCtxSetCurrent");
	fn_version version = (fn_version)dlsym(h, "cuDriverGetVersion");
	fn_errname errname = (fn_errname)dlsym(h, "cuGetErrorName");
	cr_assert(init && count && alloc && setcur && version && errname);
	int n = -1, v = 0;
	CUdeviceptr p;
	const char *s = NULL;
	cr_assert_eq(count(&n), CUDA_ERROR_NOT_INITIALIZED);
	cr_assert_eq(alloc(&p, 4096), CUDA_ERROR_NOT_INITIALIZED);
	cr_assert_eq(setcur(NULL), CUDA_ERROR_NOT_INITIALIZED);
	/* These work before cuInit, as the driver's do. */
	cr_assert_eq(version(&v), CUDA_SUCCESS);
	cr_assert_geq(v, 12000, "driver version %d", v);
	cr_assert_eq(errname(CUDA_ERROR_NOT_INITIALIZED, &s), CUDA_SUCCESS);
	cr_assert_str_eq(s, "CUDA_ERROR_NOT_INITIALIZED");
	cr_assert_eq(init(1), CUDA_ERROR_INVALID_VALUE, "cuInit flags must be 0");
	cr_assert_eq(count(&n), CUDA_ERROR_NOT_INITIALIZED);
	cr_assert_eq(init(0), CUDA_SUCCESS);
	cr_assert_eq(init(0), CUDA_SUCCESS, "a second cuInit is fine");
	cr_assert_eq(count(&n), CUDA_SUCCESS);
	cr_assert_eq(n, 2);
	cr_assert_eq(count(NULL), CUDA_ERROR_INVALID_VALUE);
	dlclose(h);
}

Test(fakecuda, no_visible_device_fails_cuInit_with_no_device)
{
	struct seen s = see("");
	cr_assert(!s.loaded && strstr(s.err, "CUDA_ERROR_NO_DEVICE"), "empty list: %s", s.err);
	s = see("-1");
	cr_assert(!s.loaded && strstr(s.err, "CUDA_ERROR_NO_DEVICE"), "-1: %s", s.err);
	setenv("FAKECUDA_DEVICES", "0", 1);
	s = see(NULL);
	cr_assert(!s.loaded && strstr(s.err, "CUDA_ERROR_NO_DEVICE"), "0 devices: %s", s.err);
	setenv("FAKECUDA_DEVICES", "2", 1);
	setenv("FAKECUDA_MEMORY", "lots", 1);
	s = see(NULL);
	cr_assert(!s.loaded && strstr(s.err, "CUDA_ERROR_INVALID_VALUE"), "bad memory: %s", s.err);
}

Test(fakecuda, visible_devices_reorder_and_hide_by_index)
{
	setenv("FAKECUDA_DEVICES", "4", 1);
	struct seen ref = see(NULL);
	cr_assert_eq(ref.n, 4);
	assert_sees("2,0", &ref, (int[]){2, 0}, 2);
	assert_sees("3", &ref, (int[]){3}, 1);
	assert_sees("3,2,1,0", &ref, (int[]){3, 2, 1, 0}, 4);
	/* The first entry that names no device ends the list. */
	assert_sees("1,7,0", &ref, (int[]){1}, 1);
	assert_sees("1,x,0", &ref, (int[]){1}, 1);
	assert_sees("2,2,3", &ref, (int[]){2}, 1);
	assert_sees("1,-1,0", &ref, (int[]){1}, 1);
	assert_sees("9,0", &ref, NULL, 0);
}

Test(fakecuda, visible_devices_accept_uuid_strings_and_unique_prefixes)
{
	setenv("FAKECUDA_DEVICES", "4", 1);
	struct seen ref = see(NULL);
	cr_assert_eq(ref.n, 4);
	char u[4][41], cvd[200];
	for (int i = 0; i < 4; i++)
		bb_cuda_uuid_format(ref.uuid[i], u[i]);

	snprintf(cvd, sizeof(cvd), "%s,0", u[3]);
	assert_sees(cvd, &ref, (int[]){3, 0}, 2);
	snprintf(cvd, sizeof(cvd), "%s,%s,%s", u[1], u[2], u[0]);
	assert_sees(cvd, &ref, (int[]){1, 2, 0}, 3);

	/* The shortest prefix of device 2's UUID that no other device shares. */
	size_t len = 5;
	for (; len < 40; len++) {
		int hits = 0;
		for (int i = 0; i < 4; i++)
			hits += strncmp(u[i], u[2], len) == 0;
		if (hits == 1)
			break;
	}
	snprintf(cvd, sizeof(cvd), "%.*s,1", (int)len, u[2]);
	assert_sees(cvd, &ref, (int[]){2, 1}, 2);
	/* "GPU-" alone names every device: ambiguous, so it ends the list. */
	assert_sees("1,GPU-,2", &ref, (int[]){1}, 1);
	snprintf(cvd, sizeof(cvd), "%s,GPU-zzzzzzzz,2", u[1]);
	assert_sees(cvd, &ref, (int[]){1}, 1);
	/* A full UUID of no device. */
	char none[41];
	memcpy(none, u[0], sizeof(none));
	none[39] = none[39] == '0' ? '1' : '0';
	none[38] = none[38] == '0' ? '1' : '0';
	assert_sees(none, &ref, NULL, 0);
}

/* ---- memory across processes ------------------------------------------------ */

struct peer {
	int ordinal; /* device made current */
	size_t size; /* of the allocation */
	int role;    /* importer: which part it checks and writes */
	bbt_chan ch;
};

#define SHARED_SIZE (1 * MiB + 123) /* not a whole number of pages */
#define HALF (SHARED_SIZE / 2)

/* Allocates, writes seed 1 everywhere, exports; when told, checks that the
 * importers wrote seed 2 in the first half and seed 3 in the second. */
static int exporter_child(void *arg)
{
	struct peer *x = arg;
	bb_cuda api;
	CUdeviceptr p;
	CUipcMemHandle hd;
	char *buf = malloc(x->size);
	STEP(1, buf && child_load(&api) == 0);
	STEP(2, make_current(&api, x->ordinal, NULL) == CUDA_SUCCESS);
	STEP(3, api.MemAlloc(&p, x->size) == CUDA_SUCCESS);
	bbt_fill(buf, x->size, 1);
	STEP(4, api.MemcpyHtoD(p, buf, x->size) == CUDA_SUCCESS);
	STEP(5, api.IpcGetMemHandle(&hd, p) == CUDA_SUCCESS);
	STEP(6, bbt_send(x->ch.fd[1], &hd, sizeof(hd)) == 0);
	char cmd;
	STEP(7, bbt_recv(x->ch.fd[1], &cmd, 1, 30000) == 0);
	memset(buf, 0, x->size);
	STEP(8, api.MemcpyDtoH(buf, p, x->size) == CUDA_SUCCESS);
	STEP(9, bbt_check(buf, HALF, 2));
	STEP(10, bbt_check(buf + HALF, x->size - HALF, 3));
	STEP(11, api.MemFree(p) == CUDA_SUCCESS);
	free(buf);
	bb_cuda_unload(&api);
	return 0;
}

/* role 2: finds seed 1 everywhere, writes seed 2 in the first half.
 * role 3: finds seed 2 then seed 1, writes seed 3 in the second half. */
static int importer_child(void *arg)
{
	struct peer *x = arg;
	bb_cuda api;
	CUdeviceptr p;
	CUipcMemHandle hd;
	char *buf = malloc(x->size);
	STEP(1, buf && bbt_recv(x->ch.fd[1], &hd, sizeof(hd), 30000) == 0);
	STEP(2, child_load(&api) == 0);
	STEP(3, make_current(&api, x->ordinal, NULL) == CUDA_SUCCESS);
	STEP(4, api.IpcOpenMemHandle(&p, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) == CUDA_SUCCESS);
	STEP(5, api.MemcpyDtoH(buf, p, x->size) == CUDA_SUCCESS);
	if (x->role == 2) {
		STEP(6, bbt_check(buf, x->size, 1));
		bbt_fill(buf, HALF, 2);
		STEP(7, api.MemcpyHtoD(p, buf, HALF) == CUDA_SUCCESS);
	} else {
		STEP(8, bbt_check(buf, HALF, 2));
		char *want = malloc(x->size);
		STEP(9, want);
		bbt_fill(want, x->size, 1);
		STEP(10, memcmp(buf + HALF, want + HALF, x->size - HALF) == 0);
		free(want);
		bbt_fill(buf, x->size - HALF, 3);
		STEP(11, api.MemcpyHtoD(p + HALF, buf, x->size - HALF) == CUDA_SUCCESS);
	}
	STEP(14, api.CtxSynchronize() == CUDA_SUCCESS);
	STEP(15, api.IpcCloseMemHandle(p) == CUDA_SUCCESS);
	free(buf);
	bb_cuda_unload(&api);
	return 0;
}

Test(fakecuda, bytes_written_in_one_process_are_read_in_others)
{
	struct peer ex = {.ordinal = 1, .size = SHARED_SIZE};
	struct peer im[2] = {{.ordinal = 0, .size = SHARED_SIZE, .role = 2},
			     {.ordinal = 1, .size = SHARED_SIZE, .role = 3}};
	CUipcMemHandle hd;
	bbt_chan_open(&ex.ch);
	pid_t epid = bbt_spawn(exporter_child, &ex);
	cr_assert_eq(bbt_recv(ex.ch.fd[0], &hd, sizeof(hd), CHILD_TIMEOUT_MS), 0,
		     "exporter sent no handle (step %d)", bbt_join(epid, 1000));
	/* One importer after the other: the second must see the first's bytes. */
	for (int i = 0; i < 2; i++) {
		bbt_chan_open(&im[i].ch);
		pid_t pid = bbt_spawn(importer_child, &im[i]);
		cr_assert_eq(bbt_send(im[i].ch.fd[0], &hd, sizeof(hd)), 0);
		int rc = bbt_join(pid, CHILD_TIMEOUT_MS);
		cr_assert_eq(rc, 0, "importer %d failed at step %d", i, rc);
		bbt_chan_close(&im[i].ch);
	}
	cr_assert_eq(bbt_send(ex.ch.fd[0], "v", 1), 0);
	int rc = bbt_join(epid, CHILD_TIMEOUT_MS);
	cr_assert_eq(rc, 0, "exporter failed at step %d", rc);
	bbt_chan_close(&ex.ch);
	cr_assert_eq(shm_objects("dev"), 2, "the devices' accounting objects");
	cr_assert_eq(shm_objects(""), 2, "the freed allocation's object is gone");
}

Test(fakecuda, open_in_exporting_process_fails_invalid_context)
{
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUdeviceptr p, q;
	CUipcMemHandle a, b;
	CU_OK(&api, api.MemAlloc(&p, 65536));
	CU_OK(&api, api.IpcGetMemHandle(&a, p));
	CU_OK(&api, api.IpcGetMemHandle(&b, p));
	cr_assert(memcmp(&a, &b, sizeof(a)) == 0, "one allocation, one handle");
	CU_EQ(&api, api.IpcOpenMemHandle(&q, a, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
	      CUDA_ERROR_INVALID_CONTEXT);
	CU_EQ(&api, api.IpcGetMemHandle(&b, p + 256), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.IpcCloseMemHandle(p), CUDA_ERROR_INVALID_VALUE);
	/* A new allocation, even at the same address, has another handle. */
	CU_OK(&api, api.MemFree(p));
	CU_OK(&api, api.MemAlloc(&q, 65536));
	CU_OK(&api, api.IpcGetMemHandle(&b, q));
	cr_assert(memcmp(&a, &b, sizeof(a)) != 0, "a handle was reused");
	CU_OK(&api, api.MemFree(q));
	bb_cuda_unload(&api);
}

Test(fakecuda, second_open_in_one_process_fails_already_mapped)
{
	struct holder h = {.ordinal = 0, .size = 8192, .seed = 7};
	CUipcMemHandle hd;
	pid_t pid = holder_start(&h, &hd);
	bb_cuda api;
	load(&api);
	void (*stats)(unsigned long *, unsigned long *) =
		(void (*)(unsigned long *, unsigned long *))dlsym(api.lib, "fakecuda_stats");
	cr_assert_not_null(stats);
	unsigned long opens, closes;
	CUdeviceptr p, q;
	current(&api, 0);
	CU_OK(&api, api.IpcOpenMemHandle(&p, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
	CU_EQ(&api, api.IpcOpenMemHandle(&q, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
	      CUDA_ERROR_ALREADY_MAPPED);
	current(&api, 1); /* another context of the process: still the same process */
	CU_EQ(&api, api.IpcOpenMemHandle(&q, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
	      CUDA_ERROR_ALREADY_MAPPED);
	stats(&opens, &closes);
	cr_assert_eq(opens, 1);
	cr_assert_eq(closes, 0);
	char buf[8192];
	CU_OK(&api, api.MemcpyDtoH(buf, p, sizeof(buf)));
	cr_assert(bbt_check(buf, sizeof(buf), 7), "the opened bytes are the holder's");
	CU_OK(&api, api.IpcCloseMemHandle(p));
	CU_EQ(&api, api.IpcCloseMemHandle(p), CUDA_ERROR_INVALID_VALUE);
	/* Closed, it may be opened again. */
	CU_OK(&api, api.IpcOpenMemHandle(&q, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
	CU_OK(&api, api.IpcCloseMemHandle(q));
	stats(&opens, &closes);
	cr_assert_eq(opens, 2);
	cr_assert_eq(closes, 2);
	holder_free(&h, pid);
	bb_cuda_unload(&api);
}

Test(fakecuda, open_checks_flags_and_refuses_dead_handles)
{
	struct holder h1 = {.ordinal = 0, .size = 4096, .seed = 1};
	struct holder h2 = {.ordinal = 1, .size = 4096, .seed = 2};
	CUipcMemHandle hd1, hd2, bad;
	pid_t pid1 = holder_start(&h1, &hd1);
	pid_t pid2 = holder_start(&h2, &hd2);
	bb_cuda api;
	CUdeviceptr p;
	load(&api);
	CU_EQ(&api, api.IpcOpenMemHandle(&p, hd1, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
	      CUDA_ERROR_INVALID_CONTEXT); /* no current context */
	current(&api, 0);
	CU_EQ(&api, api.IpcOpenMemHandle(&p, hd1, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.IpcOpenMemHandle(&p, hd1, 2), CUDA_ERROR_INVALID_VALUE);
	memset(&bad, 0, sizeof(bad));
	CU_EQ(&api, api.IpcOpenMemHandle(&p, bad, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
	      CUDA_ERROR_INVALID_HANDLE);
	bad = hd1;
	bad.reserved[40] ^= 0x5a; /* inside the name: another object */
	bad.reserved[30] ^= 0x5a;
	CU_EQ(&api, api.IpcOpenMemHandle(&p, bad, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
	      CUDA_ERROR_INVALID_HANDLE);
	/* Freed by its owner: gone. */
	holder_free(&h1, pid1);
	CU_EQ(&api, api.IpcOpenMemHandle(&p, hd1, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
	      CUDA_ERROR_INVALID_HANDLE);
	/* Its owner killed: gone with it. */
	CU_OK(&api, api.IpcOpenMemHandle(&p, hd2, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
	CU_OK(&api, api.IpcCloseMemHandle(p));
	kill(pid2, SIGKILL);
	cr_assert_eq(bbt_join(pid2, CHILD_TIMEOUT_MS), 128 + SIGKILL);
	bbt_chan_close(&h2.ch);
	CU_EQ(&api, api.IpcOpenMemHandle(&p, hd2, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
	      CUDA_ERROR_INVALID_HANDLE);
	bb_cuda_unload(&api);
}

/* ---- accounting ------------------------------------------------------------ */

Test(fakecuda, free_releases_memory_and_its_shm_object)
{
	setenv("FAKECUDA_MEMORY", "64M", 1);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	size_t f, t, total;
	CU_OK(&api, api.DeviceTotalMem(&total, 0));
	cr_assert_eq(total, 64 * MiB);
	mem_info(&api, &f, &t);
	cr_assert_eq(t, 64 * MiB);
	cr_assert_eq(f, 64 * MiB);
	int before = shm_objects("");
	CUdeviceptr p;
	CU_OK(&api, api.MemAlloc(&p, 3 * MiB + 5));
	cr_assert_eq(free_now(&api), 64 * MiB - (3 * MiB + 5));
	cr_assert_eq(shm_objects(""), before + 1, "one shm object per allocation");
	CU_EQ(&api, api.MemFree(p + 256), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemFree(p));
	cr_assert_eq(free_now(&api), 64 * MiB, "freed memory is free again");
	cr_assert_eq(shm_objects(""), before, "cuMemFree unlinks its object");
	CU_EQ(&api, api.MemFree(p), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemFree(0), CUDA_ERROR_INVALID_VALUE);
	bb_cuda_unload(&api);
}

Test(fakecuda, accounting_is_shared_across_processes_per_device)
{
	setenv("FAKECUDA_MEMORY", "64M", 1);
	struct holder h1 = {.ordinal = 0, .size = 10 * MiB, .seed = 1};
	struct holder h2 = {.ordinal = 0, .size = 10 * MiB, .seed = 2};
	CUipcMemHandle hd;
	pid_t pid1 = holder_start(&h1, &hd);
	pid_t pid2 = holder_start(&h2, &hd);
	bb_cuda api;
	load(&api);
	current(&api, 1);
	cr_assert_eq(free_now(&api), 64 * MiB, "device 1 is untouched");
	current(&api, 0);
	cr_assert_eq(free_now(&api), 44 * MiB, "two holders hold 10 MiB each on device 0");
	holder_free(&h1, pid1);
	cr_assert_eq(free_now(&api), 54 * MiB, "freed in another process");
	/* A killed process's memory is free again, as with the driver. Its
	 * objects' names carry its token (bytes 4..7 of its handles). */
	char mark[32];
	uint32_t token;
	memcpy(&token, hd.reserved + 4, sizeof(token));
	snprintf(mark, sizeof(mark), "%08x.", (unsigned)token);
	cr_assert_eq(shm_objects(mark), 1);
	kill(pid2, SIGKILL);
	siginfo_t si;
	cr_assert_eq(waitid(P_PID, (id_t)pid2, &si, WEXITED | WNOWAIT), 0, "waitid: %s",
		     strerror(errno));
	cr_assert_eq(free_now(&api), 64 * MiB, "a killed holder's memory is free, reaped or not");
	cr_assert_eq(bbt_join(pid2, CHILD_TIMEOUT_MS), 128 + SIGKILL);
	bbt_chan_close(&h2.ch);
	cr_assert_eq(free_now(&api), 64 * MiB, "a killed holder's memory is free");
	CUdeviceptr p;
	CU_OK(&api, api.MemAlloc(&p, MiB));
	cr_assert_eq(shm_objects(mark), 0, "the next allocation removed the dead one's object");
	CU_OK(&api, api.MemFree(p));
	bb_cuda_unload(&api);
}

Test(fakecuda, running_out_gives_out_of_memory)
{
	setenv("FAKECUDA_MEMORY", "8M", 1);
	struct holder h = {.ordinal = 0, .size = 6 * MiB, .seed = 1};
	CUipcMemHandle hd;
	pid_t pid = holder_start(&h, &hd);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUdeviceptr a, b, c, d;
	CU_EQ(&api, api.MemAlloc(&a, 4 * MiB), CUDA_ERROR_OUT_OF_MEMORY);
	const char *name = NULL;
	CU_OK(&api, api.GetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &name));
	cr_assert_str_eq(name, "CUDA_ERROR_OUT_OF_MEMORY");
	CU_OK(&api, api.MemAlloc(&a, 2 * MiB)); /* exactly full */
	cr_assert_eq(free_now(&api), 0);
	CU_EQ(&api, api.MemAlloc(&b, 1), CUDA_ERROR_OUT_OF_MEMORY);
	CU_EQ(&api, api.MemAlloc(&b, 0), CUDA_ERROR_INVALID_VALUE);
	current(&api, 1); /* the other device has its own memory */
	CU_EQ(&api, api.MemAlloc(&b, 9 * MiB), CUDA_ERROR_OUT_OF_MEMORY);
	CU_OK(&api, api.MemAlloc(&b, 4 * MiB));
	holder_free(&h, pid);
	current(&api, 0);
	CU_OK(&api, api.MemAlloc(&c, 4 * MiB));
	CU_EQ(&api, api.MemAlloc(&d, 4 * MiB), CUDA_ERROR_OUT_OF_MEMORY);
	CU_OK(&api, api.MemFree(a));
	CU_OK(&api, api.MemFree(b));
	CU_OK(&api, api.MemFree(c));
	cr_assert_eq(free_now(&api), 8 * MiB);
	bb_cuda_unload(&api);
}

Test(fakecuda, namespaces_keep_separate_accounting)
{
	setenv("FAKECUDA_MEMORY", "16M", 1);
	char other[80];
	snprintf(other, sizeof(other), "%s-other", g_ns);
	struct holder h = {.ordinal = 0, .size = 10 * MiB, .seed = 1, .ns = other};
	CUipcMemHandle hd;
	pid_t pid = holder_start(&h, &hd);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	cr_assert_eq(free_now(&api), 16 * MiB, "another namespace's memory counted here");
	holder_free(&h, pid);
	bb_cuda_unload(&api);
	setenv("FAKECUDA_NAMESPACE", other, 1);
	reset_namespace();
	cr_assert_eq(shm_objects(""), 0);
	setenv("FAKECUDA_NAMESPACE", g_ns, 1);
}

/* ---- contexts and copies ---------------------------------------------------- */

struct thread_try {
	const bb_cuda *api;
	CUcontext ctx;
	CUresult without; /* cuMemAlloc before making ctx current */
	CUresult with;    /* and after */
};

static void *alloc_in_thread(void *arg)
{
	struct thread_try *t = arg;
	CUdeviceptr p;
	t->without = t->api->MemAlloc(&p, 4096);
	if (t->without == CUDA_SUCCESS)
		t->api->MemFree(p);
	t->with = t->api->CtxSetCurrent(t->ctx);
	if (t->with == CUDA_SUCCESS)
		t->with = t->api->MemAlloc(&p, 4096);
	if (t->with == CUDA_SUCCESS)
		t->with = t->api->MemFree(p);
	return NULL;
}

Test(fakecuda, memory_ops_need_a_current_context_per_thread)
{
	setenv("FAKECUDA_MEMORY", "16M", 1);
	bb_cuda api;
	load(&api);
	CUdeviceptr p;
	CUcontext ctx, got;
	size_t f, t;
	char buf[64] = {0};
	CU_EQ(&api, api.MemAlloc(&p, 4096), CUDA_ERROR_INVALID_CONTEXT);
	CU_EQ(&api, api.MemGetInfo(&f, &t), CUDA_ERROR_INVALID_CONTEXT);
	CU_EQ(&api, api.CtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
	CU_OK(&api, api.CtxGetCurrent(&got));
	cr_assert_null(got);
	CU_EQ(&api, api.CtxSetCurrent((CUcontext)(void *)buf), CUDA_ERROR_INVALID_CONTEXT);
	CU_EQ(&api, api.DevicePrimaryCtxRetain(&ctx, 2), CUDA_ERROR_INVALID_DEVICE);
	CU_OK(&api, make_current(&api, 0, &ctx));
	CU_OK(&api, api.CtxGetCurrent(&got));
	cr_assert_eq(got, ctx);
	CU_OK(&api, api.MemAlloc(&p, 4096));

	/* The current context is per thread. */
	struct thread_try tt = {.api = &api, .ctx = ctx};
	pthread_t th;
	cr_assert_eq(pthread_create(&th, NULL, alloc_in_thread, &tt), 0);
	pthread_join(th, NULL);
	cr_assert_eq(tt.without, CUDA_ERROR_INVALID_CONTEXT, "a new thread has no context");
	cr_assert_eq(tt.with, CUDA_SUCCESS, "after cuCtxSetCurrent: %s", cuerr(&api, tt.with));

	CU_OK(&api, api.CtxSetCurrent(NULL));
	CU_EQ(&api, api.MemcpyHtoD(p, buf, 64), CUDA_ERROR_INVALID_CONTEXT);
	CU_OK(&api, api.CtxSetCurrent(ctx));
	CU_OK(&api, api.MemcpyHtoD(p, buf, 64));
	cr_assert_eq(free_now(&api), 16 * MiB - 4096);

	/* The last release resets the primary context: its memory is freed. */
	CU_OK(&api, api.DevicePrimaryCtxRelease(0));
	CU_EQ(&api, api.MemcpyHtoD(p, buf, 64), CUDA_ERROR_INVALID_CONTEXT);
	CU_EQ(&api, api.DevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);
	CU_OK(&api, api.DevicePrimaryCtxRetain(&got, 0));
	cr_assert_eq(got, ctx, "the primary context keeps its handle");
	cr_assert_eq(free_now(&api), 16 * MiB, "the reset freed the allocation");
	CU_EQ(&api, api.MemcpyHtoD(p, buf, 64), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.DevicePrimaryCtxRelease(0));
	bb_cuda_unload(&api);
}

/* Permissions of the mapping that holds addr in /proc/self/maps ("" if none). */
static void maps_perms(uintptr_t addr, char perms[5])
{
	FILE *f = fopen("/proc/self/maps", "r");
	char line[512];
	perms[0] = 0;
	while (f && fgets(line, sizeof(line), f)) {
		unsigned long lo, hi;
		char pr[5];
		if (sscanf(line, "%lx-%lx %4s", &lo, &hi, pr) == 3 && addr >= lo && addr < hi) {
			memcpy(perms, pr, 5);
			break;
		}
	}
	if (f)
		fclose(f);
}

Test(fakecuda, copies_stay_inside_live_allocations)
{
	bb_cuda api;
	load(&api);
	current(&api, 1);
	enum { N = 4096 + 100 };
	static char src[N], dst[N];
	bbt_fill(src, N, 9);
	CUdeviceptr p;
	CU_OK(&api, api.MemAlloc(&p, N));
	cr_assert_eq(p % 256, 0, "device pointers are aligned for any dtype");
	CU_OK(&api, api.MemcpyHtoD(p, src, N));
	CU_OK(&api, api.MemcpyDtoH(dst, p, N));
	cr_assert(memcmp(src, dst, N) == 0);
	CU_EQ(&api, api.MemcpyHtoD(p + 1, src, N), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemcpyDtoH(dst, p + N - 10, 10));
	CU_EQ(&api, api.MemcpyDtoH(dst, p + N - 10, 11), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemsetD8(p + N, 1, 1), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, 16), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemsetD8(p + 100, 0xab, 50));
	CU_OK(&api, api.MemcpyDtoH(dst, p, N));
	for (int i = 0; i < N; i++)
		cr_assert_eq((unsigned char)dst[i],
			     i >= 100 && i < 150 ? 0xab : (unsigned char)src[i], "byte %d", i);
	CU_OK(&api, api.MemcpyHtoD(p, src, 0));
	/* A device pointer is no host address: reading it would fault. */
	char perms[5];
	maps_perms((uintptr_t)p, perms);
	cr_assert_str_eq(perms, "---p", "device memory mapped %s at its device address", perms);
	CU_OK(&api, api.MemFree(p));
	CU_EQ(&api, api.MemcpyDtoH(dst, p, 1), CUDA_ERROR_INVALID_VALUE);
	bb_cuda_unload(&api);
}

/* ---- hooks ------------------------------------------------------------------ */

typedef int (*fn_ptrdev)(CUdeviceptr, unsigned char[16]);

Test(fakecuda, hooks_name_the_devices_of_memory_and_of_the_opening_context)
{
	setenv("FAKECUDA_DEVICES", "3", 1);
	struct holder h = {.ordinal = 2, .size = 65536, .seed = 4};
	CUipcMemHandle hd;
	pid_t pid = holder_start(&h, &hd); /* on physical device 2 */
	setenv("CUDA_VISIBLE_DEVICES", "2,0,1", 1);
	bb_cuda api;
	load(&api);
	fn_ptrdev ptrdev = (fn_ptrdev)dlsym(api.lib, "fakecuda_pointer_device");
	fn_ptrdev ctxdev = (fn_ptrdev)dlsym(api.lib, "fakecuda_open_context_device");
	cr_assert(ptrdev && ctxdev, "hooks not exported");
	unsigned char phys2[16], phys1[16], u[16];
	uuid_of(&api, 0, phys2);
	uuid_of(&api, 2, phys1);
	current(&api, 2);
	CUdeviceptr p, q;
	CU_OK(&api, api.IpcOpenMemHandle(&p, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
	cr_assert_eq(ptrdev(p + 100, u), 0);
	cr_assert(memcmp(u, phys2, 16) == 0, "the opened memory lives on physical device 2");
	cr_assert_eq(ctxdev(p, u), 0);
	cr_assert(memcmp(u, phys1, 16) == 0, "opened with device 1's context current");
	CU_OK(&api, api.MemAlloc(&q, 4096));
	cr_assert_eq(ptrdev(q, u), 0);
	cr_assert(memcmp(u, phys1, 16) == 0, "allocated in device 1's context");
	cr_assert_eq(ctxdev(q, u), -1, "an allocation was not opened from a handle");
	/* mmap may place the allocation right below the opened mapping, so
	 * one past its end can be p itself; anywhere else it is no memory. */
	if (q + 4096 != p)
		cr_assert_eq(ptrdev(q + 4096, u), -1, "one past the end");
	CU_OK(&api, api.IpcCloseMemHandle(p));
	cr_assert_eq(ptrdev(p, u), -1, "closed");
	CU_OK(&api, api.MemFree(q));
	holder_free(&h, pid);
	bb_cuda_unload(&api);
}

static int forked_child(void *arg)
{
	const bb_cuda *api = arg;
	int n;
	CUdeviceptr p;
	bb_cuda again;
	char err[256];
	STEP(1, api->Init(0) == CUDA_ERROR_NOT_INITIALIZED);
	STEP(2, api->DeviceGetCount(&n) == CUDA_ERROR_NOT_INITIALIZED);
	STEP(3, api->CtxSetCurrent(NULL) == CUDA_ERROR_NOT_INITIALIZED);
	STEP(4, api->MemAlloc(&p, 4096) == CUDA_ERROR_NOT_INITIALIZED);
	STEP(5, bb_cuda_load(&again, err, sizeof(err)) != 0);
	STEP(6, strstr(err, "CUDA_ERROR_NOT_INITIALIZED") != NULL);
	return 0;
}

Test(fakecuda, child_forked_after_cuInit_is_not_initialized)
{
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUdeviceptr p;
	char buf[4096];
	bbt_fill(buf, sizeof(buf), 5);
	CU_OK(&api, api.MemAlloc(&p, sizeof(buf)));
	CU_OK(&api, api.MemcpyHtoD(p, buf, sizeof(buf)));
	int rc = bbt_join(bbt_spawn(forked_child, &api), CHILD_TIMEOUT_MS);
	cr_assert_eq(rc, 0, "forked child failed at step %d", rc);
	/* The parent is unaffected. */
	memset(buf, 0, sizeof(buf));
	CU_OK(&api, api.MemcpyDtoH(buf, p, sizeof(buf)));
	cr_assert(bbt_check(buf, sizeof(buf), 5));
	CU_OK(&api, api.MemFree(p));
	bb_cuda_unload(&api);
}

Test(fakecuda, error_names_and_strings_are_the_drivers)
{
	static const struct {
		CUresult code;
		const char *name, *str;
	} want[] = {
		{CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
		{CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
		{CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
		{CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
		{CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
		{CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE",
		 "no CUDA-capable device is detected"},
		{CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
		{CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT",
		 "invalid device context"},
		{205, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
		{CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
		{304, "CUDA_ERROR_OPERATING_SYSTEM",
		 "OS call failed or operation not supported on this OS"},
		{CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
		{CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
		{CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
		{999, "CUDA_ERROR_UNKNOWN", "unknown error"},
	};
	bb_cuda api;
	load(&api);
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
		const char *n = NULL, *s = NULL;
		CU_OK(&api, api.GetErrorName(want[i].code, &n));
		CU_OK(&api, api.GetErrorString(want[i].code, &s));
		cr_assert_str_eq(n, want[i].name);
		cr_assert_str_eq(s, want[i].str);
	}
	const char *s = "x";
	CU_EQ(&api, api.GetErrorName(77777, &s), CUDA_ERROR_INVALID_VALUE);
	cr_assert_null(s, "unknown codes give NULL");
	s = "x";
	CU_EQ(&api, api.GetErrorString(77777, &s), CUDA_ERROR_INVALID_VALUE);
	cr_assert_null(s);
	CU_EQ(&api, api.GetErrorName(CUDA_SUCCESS, NULL), CUDA_ERROR_INVALID_VALUE);
	bb_cuda_unload(&api);
}

/* ---- threads and cleanup ------------------------------------------------------ */

#define THREADS 8
#define ROUNDS 150

struct worker {
	const bb_cuda *api;
	CUcontext ctx;
	uint32_t seed;
	int failed_step; /* 0: all fine */
};

static void *churn(void *arg)
{
	struct worker *w = arg;
	const bb_cuda *api = w->api;
	static _Thread_local char src[65536], dst[65536];
	if (api->CtxSetCurrent(w->ctx) != CUDA_SUCCESS) {
		w->failed_step = 1;
		return NULL;
	}
	for (int i = 0; i < ROUNDS; i++) {
		size_t n = 1 + (w->seed * 2654435761u + (uint32_t)i * 40503u) % sizeof(src);
		CUdeviceptr p;
		size_t f, t;
		bbt_fill(src, n, w->seed + (uint32_t)i);
		int step = api->MemAlloc(&p, n) != CUDA_SUCCESS         ? 2
			   : api->MemcpyHtoD(p, src, n) != CUDA_SUCCESS ? 3
			   : api->MemGetInfo(&f, &t) != CUDA_SUCCESS    ? 4
			   : api->MemcpyDtoH(dst, p, n) != CUDA_SUCCESS ? 5
			   : !bbt_check(dst, n, w->seed + (uint32_t)i)  ? 6
			   : api->MemFree(p) != CUDA_SUCCESS            ? 7
									: 0;
		if (step) {
			w->failed_step = step;
			return NULL;
		}
	}
	return NULL;
}

Test(fakecuda, threads_share_the_driver_safely)
{
	setenv("FAKECUDA_MEMORY", "64M", 1);
	bb_cuda api;
	load(&api);
	CUcontext ctx[2];
	CU_OK(&api, make_current(&api, 1, &ctx[1]));
	CU_OK(&api, make_current(&api, 0, &ctx[0]));
	struct worker w[THREADS];
	pthread_t th[THREADS];
	for (int i = 0; i < THREADS; i++) {
		w[i] = (struct worker){.api = &api, .ctx = ctx[i % 2], .seed = (uint32_t)i * 77};
		cr_assert_eq(pthread_create(&th[i], NULL, churn, &w[i]), 0);
	}
	for (int i = 0; i < THREADS; i++)
		pthread_join(th[i], NULL);
	for (int i = 0; i < THREADS; i++)
		cr_assert_eq(w[i].failed_step, 0, "thread %d failed at step %d", i,
			     w[i].failed_step);
	cr_assert_eq(free_now(&api), 64 * MiB);
	current(&api, 1);
	cr_assert_eq(free_now(&api), 64 * MiB);
	cr_assert_eq(shm_objects(""), 2, "only the devices' objects remain");
	bb_cuda_unload(&api);
}

Test(fakecuda, reset_namespace_removes_every_object)
{
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUdeviceptr p;
	CU_OK(&api, api.MemAlloc(&p, 4096));
	cr_assert_eq(shm_objects(""), 3, "two devices' accounting and one allocation");
	reset_namespace();
	cr_assert_eq(shm_objects(""), 0);
	CU_OK(&api, api.MemFree(p)); /* its object already gone: still fine */
	bb_cuda_unload(&api);
	cr_assert_eq(shm_objects(""), 0);
}

Test(fakecuda, unloading_frees_what_the_process_allocated)
{
	setenv("FAKECUDA_MEMORY", "32M", 1);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUdeviceptr p;
	CU_OK(&api, api.MemAlloc(&p, 5 * MiB));
	cr_assert_eq(shm_objects(""), 3);
	bb_cuda_unload(&api); /* dlclose: the driver goes with the process */
	cr_assert_eq(shm_objects(""), 2, "the allocation's object outlived the driver");
	load(&api);
	current(&api, 0);
	cr_assert_eq(free_now(&api), 32 * MiB);
	bb_cuda_unload(&api);
}

/* ---- virtual memory management (cuMemCreate and its family) ---------------- */

#define GRAN (2 * MiB)

/* Send or receive one fd (SCM_RIGHTS) with one byte. 0 or -1. */
static int send_fd(int sock, int fd)
{
	char byte = 'f';
	struct iovec iov = {.iov_base = &byte, .iov_len = 1};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} u;
	memset(&u, 0, sizeof(u));
	struct msghdr msg = {.msg_iov = &iov,
			     .msg_iovlen = 1,
			     .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf)};
	struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &fd, sizeof(int));
	return sendmsg(sock, &msg, MSG_NOSIGNAL) == 1 ? 0 : -1;
}

static int recv_fd(int sock, int timeout_ms)
{
	struct pollfd pfd = {.fd = sock, .events = POLLIN};
	if (poll(&pfd, 1, timeout_ms) != 1)
		return -1;
	char byte;
	struct iovec iov = {.iov_base = &byte, .iov_len = 1};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} u;
	struct msghdr msg = {.msg_iov = &iov,
			     .msg_iovlen = 1,
			     .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf)};
	if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) != 1)
		return -1;
	struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
	if (!c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
		return -1;
	int fd;
	memcpy(&fd, CMSG_DATA(c), sizeof(int));
	return fd;
}

/* Pinned device memory on ordinal, with the POSIX fd type when exportable. */
static CUmemAllocationProp vmm_prop(int ordinal, bool exportable)
{
	CUmemAllocationProp prop;
	memset(&prop, 0, sizeof(prop));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.requestedHandleTypes =
		exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = ordinal;
	return prop;
}

/* Reserve size bytes, map h there and let ordinal read and write it; the
 * mapped address, or 0 with *rc the failing call's code. */
static CUdeviceptr vmm_map(const bb_cuda *api, CUmemGenericAllocationHandle h, size_t size,
			   int ordinal, CUresult *rc)
{
	CUdeviceptr p = 0;
	CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal},
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	*rc = api->MemAddressReserve(&p, size, 0, 0, 0);
	if (*rc != CUDA_SUCCESS)
		return 0;
	*rc = api->MemMap(p, size, 0, h, 0);
	if (*rc == CUDA_SUCCESS)
		*rc = api->MemSetAccess(p, size, &acc, 1);
	if (*rc == CUDA_SUCCESS)
		return p;
	api->MemUnmap(p, size);
	api->MemAddressFree(p, size);
	return 0;
}

static CUresult vmm_unmap(const bb_cuda *api, CUdeviceptr p, size_t size)
{
	CUresult rc = api->MemUnmap(p, size);
	CUresult rc2 = api->MemAddressFree(p, size);
	return rc != CUDA_SUCCESS ? rc : rc2;
}

struct vmm_peer {
	int ordinal;  /* device made current and given access */
	size_t size;  /* of the allocation */
	bool keep_fd; /* keep the received fd open until told (else close it at once) */
	bbt_chan ch;
};

/* Receives the fd, imports, maps; finds seed 1, writes seed 2 in the first
 * half; tells the test ('w'), and when told ('u') unmaps and releases. */
static int vmm_importer_child(void *arg)
{
	struct vmm_peer *x = arg;
	bb_cuda api;
	CUmemGenericAllocationHandle h;
	CUresult rc;
	char *buf = malloc(x->size);
	int fd = recv_fd(x->ch.fd[1], 30000);
	STEP(1, buf && fd >= 0);
	STEP(2, child_load(&api) == 0);
	STEP(3, make_current(&api, x->ordinal, NULL) == CUDA_SUCCESS);
	STEP(4, api.MemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
						 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ==
			CUDA_SUCCESS);
	if (!x->keep_fd)
		STEP(5, close(fd) == 0);
	CUdeviceptr p = vmm_map(&api, h, x->size, x->ordinal, &rc);
	STEP(6, p != 0);
	STEP(7, api.MemcpyDtoH(buf, p, x->size) == CUDA_SUCCESS);
	STEP(8, bbt_check(buf, x->size, 1));
	bbt_fill(buf, x->size / 2, 2);
	STEP(9, api.MemcpyHtoD(p, buf, x->size / 2) == CUDA_SUCCESS);
	STEP(10, bbt_send(x->ch.fd[1], "w", 1) == 0);
	char cmd;
	STEP(11, bbt_recv(x->ch.fd[1], &cmd, 1, 30000) == 0 && cmd == 'u');
	STEP(12, vmm_unmap(&api, p, x->size) == CUDA_SUCCESS);
	STEP(13, api.MemRelease(h) == CUDA_SUCCESS);
	if (x->keep_fd)
		STEP(14, close(fd) == 0);
	STEP(15, bbt_send(x->ch.fd[1], "d", 1) == 0);
	STEP(16, bbt_recv(x->ch.fd[1], &cmd, 1, 30000) == 0 && cmd == 'x');
	free(buf);
	bb_cuda_unload(&api);
	return 0;
}

static void child_says(struct vmm_peer *x, pid_t pid, char want)
{
	char got = 0;
	if (bbt_recv(x->ch.fd[0], &got, 1, CHILD_TIMEOUT_MS) != 0 || got != want) {
		int rc = bbt_join(pid, 1000);
		cr_assert_fail("importer did not say '%c'; it failed at step %d", want, rc);
	}
}

Test(fakecuda, vmm_fd_crosses_scm_rights_and_maps_the_same_bytes)
{
	struct vmm_peer im = {.ordinal = 0, .size = 2 * GRAN};
	bbt_chan_open(&im.ch);
	pid_t pid = bbt_spawn(vmm_importer_child, &im);
	bb_cuda api;
	load(&api);
	char why[256];
	cr_assert(bb_cuda_has_vmm(&api, why, sizeof(why)), "%s", why);
	current(&api, 1);
	CUmemAllocationProp prop = vmm_prop(1, true);
	size_t gran = 0;
	CU_OK(&api,
	      api.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
	cr_assert_eq(gran, GRAN);
	CUmemGenericAllocationHandle h;
	CU_OK(&api, api.MemCreate(&h, im.size, &prop, 0));
	int fd = -1;
	CU_OK(&api,
	      api.MemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	cr_assert_geq(fd, 0);
	CUresult rc;
	CUdeviceptr p = vmm_map(&api, h, im.size, 1, &rc);
	cr_assert_neq(p, 0, "map: %s", cuerr(&api, rc));
	cr_assert_eq(p % GRAN, 0, "reservations are aligned to the granularity");
	char *buf = malloc(im.size);
	bbt_fill(buf, im.size, 1);
	CU_OK(&api, api.MemcpyHtoD(p, buf, im.size));
	cr_assert_eq(send_fd(im.ch.fd[0], fd), 0);
	cr_assert_eq(close(fd), 0);
	child_says(&im, pid, 'w');
	memset(buf, 0, im.size);
	CU_OK(&api, api.MemcpyDtoH(buf, p, im.size));
	cr_assert(bbt_check(buf, im.size / 2, 2), "the importer's bytes");
	char *want = malloc(im.size);
	bbt_fill(want, im.size, 1);
	cr_assert(memcmp(buf + im.size / 2, want + im.size / 2, im.size / 2) == 0);
	cr_assert_eq(bbt_send(im.ch.fd[0], "u", 1), 0);
	child_says(&im, pid, 'd');
	cr_assert_eq(bbt_send(im.ch.fd[0], "x", 1), 0);
	cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 0);
	CU_OK(&api, vmm_unmap(&api, p, im.size));
	CU_OK(&api, api.MemRelease(h));
	free(buf);
	free(want);
	bbt_chan_close(&im.ch);
	bb_cuda_unload(&api);
}

/*
 * Device accounting of VMM memory: an allocation counts once on its device
 * while any living process holds a handle or mapping of it, whoever made
 * it. The bytes themselves live while any fd, handle or mapping lives (a
 * memfd): an fd alone keeps them but is not counted (the fake cannot see
 * fds; README.md).
 */

/* Create im->size bytes on ordinal 0, map them, write seed 1; the handle,
 * the mapping (*p) and an exported fd (*fd). */
static CUmemGenericAllocationHandle vmm_made(const bb_cuda *api, size_t size, CUdeviceptr *p,
					     int *fd)
{
	CUmemAllocationProp prop = vmm_prop(0, true);
	CUmemGenericAllocationHandle h;
	CU_OK(api, api->MemCreate(&h, size, &prop, 0));
	CUresult rc;
	*p = vmm_map(api, h, size, 0, &rc);
	cr_assert_neq(*p, 0, "map: %s", cuerr(api, rc));
	char *buf = malloc(size);
	bbt_fill(buf, size, 1);
	CU_OK(api, api->MemcpyHtoD(*p, buf, size));
	free(buf);
	CU_OK(api,
	      api->MemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	return h;
}

Test(fakecuda, vmm_allocation_counts_once_while_any_process_holds_it)
{
	setenv("FAKECUDA_MEMORY", "64M", 1);
	struct vmm_peer im = {.ordinal = 0, .size = 4 * GRAN, .keep_fd = true};
	bbt_chan_open(&im.ch);
	pid_t pid = bbt_spawn(vmm_importer_child, &im);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUdeviceptr p;
	int fd;
	CUmemGenericAllocationHandle h = vmm_made(&api, im.size, &p, &fd);
	cr_assert_eq(free_now(&api), 64 * MiB - im.size, "created: counted");
	cr_assert_eq(send_fd(im.ch.fd[0], fd), 0);
	cr_assert_eq(close(fd), 0);
	child_says(&im, pid, 'w');
	cr_assert_eq(free_now(&api), 64 * MiB - im.size, "two holders: counted once");
	char *buf = malloc(im.size);
	CU_OK(&api, api.MemcpyDtoH(buf, p, im.size));
	cr_assert(bbt_check(buf, im.size / 2, 2), "the importer's bytes");
	/* Released while mapped: the mapping keeps it. */
	CU_OK(&api, api.MemRelease(h));
	CU_EQ(&api, api.MemRelease(h), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemcpyDtoH(buf, p, im.size));
	cr_assert(bbt_check(buf, im.size / 2, 2), "released but mapped: the bytes are there");
	CU_OK(&api, vmm_unmap(&api, p, im.size));
	cr_assert_eq(free_now(&api), 64 * MiB - im.size, "the importer still holds it: counted");
	cr_assert_eq(bbt_send(im.ch.fd[0], "u", 1), 0);
	child_says(&im, pid, 'd');
	cr_assert_eq(free_now(&api), 64 * MiB, "the last holder let go");
	cr_assert_eq(bbt_send(im.ch.fd[0], "x", 1), 0);
	cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 0);
	bbt_chan_close(&im.ch);
	free(buf);
	bb_cuda_unload(&api);
}

Test(fakecuda, vmm_fd_alone_keeps_the_bytes_and_a_killed_holder_counts_no_more)
{
	setenv("FAKECUDA_MEMORY", "64M", 1);
	struct vmm_peer im = {.ordinal = 0, .size = 4 * GRAN};
	bbt_chan_open(&im.ch);
	pid_t pid = bbt_spawn(vmm_importer_child, &im);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUdeviceptr p;
	int fd;
	CUmemGenericAllocationHandle h = vmm_made(&api, im.size, &p, &fd);
	CU_OK(&api, vmm_unmap(&api, p, im.size));
	CU_OK(&api, api.MemRelease(h));
	cr_assert_eq(free_now(&api), 64 * MiB, "no handle nor mapping left: not counted");
	/* Only the fd is left; the importer finds seed 1 (vmm_importer_child). */
	cr_assert_eq(send_fd(im.ch.fd[0], fd), 0);
	cr_assert_eq(close(fd), 0);
	child_says(&im, pid, 'w');
	cr_assert_eq(free_now(&api), 64 * MiB - im.size, "imported and mapped: counted");
	kill(pid, SIGKILL);
	siginfo_t si;
	cr_assert_eq(waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT), 0, "waitid: %s",
		     strerror(errno));
	cr_assert_eq(free_now(&api), 64 * MiB, "its holder was killed: free, reaped or not");
	cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 128 + SIGKILL);
	bbt_chan_close(&im.ch);
	bb_cuda_unload(&api);
}

typedef CUresult (*fn_memcreate)(CUmemGenericAllocationHandle *, size_t,
				 const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*fn_attr)(int *, CUdevice_attribute, CUdevice);

Test(fakecuda, vmm_calls_need_cuInit_a_context_and_no_fork)
{
	void *lib = fake_lib();
	fn_memcreate create = (fn_memcreate)dlsym(lib, "cuMemCreate");
	fn_attr attr = (fn_attr)dlsym(lib, "cuDeviceGetAttribute");
	cr_assert(create && attr);
	CUmemAllocationProp prop = vmm_prop(0, true);
	CUmemGenericAllocationHandle h;
	int v;
	cr_assert_eq(create(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_INITIALIZED);
	cr_assert_eq(attr(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0),
		     CUDA_ERROR_NOT_INITIALIZED);
	dlclose(lib);
	bb_cuda api;
	load(&api);
	CUdeviceptr p;
	size_t gran;
	CU_EQ(&api, api.MemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_CONTEXT);
	CU_EQ(&api, api.MemAddressReserve(&p, GRAN, 0, 0, 0), CUDA_ERROR_INVALID_CONTEXT);
	/* Device queries need no context. */
	CU_OK(&api,
	      api.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
	cr_assert_eq(gran, GRAN);
	CU_OK(&api, api.DeviceGetAttribute(
			    &v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
	cr_assert_eq(v, 1);
	current(&api, 0);
	CU_OK(&api, api.MemCreate(&h, GRAN, &prop, 0));
	/* A child forked after cuInit cannot use the driver, nor free ours. */
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		int fd;
		CUmemGenericAllocationHandle h2;
		bool ok = api.MemCreate(&h2, GRAN, &prop, 0) == CUDA_ERROR_NOT_INITIALIZED &&
			  api.MemExportToShareableHandle(&fd, h,
							 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
							 0) == CUDA_ERROR_NOT_INITIALIZED &&
			  api.MemRelease(h) == CUDA_ERROR_NOT_INITIALIZED;
		_exit(ok ? 0 : 1);
	}
	cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 0, "the forked child got another answer");
	CU_OK(&api, api.MemRelease(h));
	bb_cuda_unload(&api);
}

Test(fakecuda, vmm_attributes_and_granularity_are_the_drivers)
{
	bb_cuda api;
	load(&api);
	int v = -1;
	CU_OK(&api, api.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1));
	cr_assert_eq(v, 1);
	CU_OK(&api,
	      api.DeviceGetAttribute(
		      &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 1));
	cr_assert_eq(v, 1);
	CU_EQ(&api, api.DeviceGetAttribute(&v, (CUdevice_attribute)9999, 0),
	      CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 2),
	      CUDA_ERROR_INVALID_DEVICE);
	CU_EQ(&api, api.DeviceGetAttribute(NULL, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 0),
	      CUDA_ERROR_INVALID_VALUE);
	size_t gran = 0;
	CUmemAllocationProp prop = vmm_prop(1, false);
	CU_OK(&api,
	      api.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
	cr_assert_eq(gran, GRAN);
	CU_EQ(&api,
	      api.MemGetAllocationGranularity(&gran, &prop, (CUmemAllocationGranularity_flags)2),
	      CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemGetAllocationGranularity(NULL, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
	      CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemGetAllocationGranularity(&gran, NULL, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
	      CUDA_ERROR_INVALID_VALUE);
	prop.type = CU_MEM_ALLOCATION_TYPE_INVALID;
	CU_EQ(&api, api.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
	      CUDA_ERROR_INVALID_VALUE);
	prop = vmm_prop(2, false);
	CU_EQ(&api, api.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
	      CUDA_ERROR_INVALID_DEVICE);
	bb_cuda_unload(&api);
}

Test(fakecuda, vmm_create_export_and_import_refuse_what_the_driver_refuses)
{
	setenv("FAKECUDA_MEMORY", "16M", 1);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUmemAllocationProp prop = vmm_prop(0, true);
	CUmemGenericAllocationHandle h, h2, plain;
	CU_EQ(&api, api.MemCreate(&h, 0, &prop, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemCreate(&h, GRAN + 4096, &prop, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemCreate(&h, GRAN, &prop, 1), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemCreate(NULL, GRAN, &prop, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemCreate(&h, 10 * GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
	prop.location.id = 5;
	CU_EQ(&api, api.MemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_DEVICE);
	prop = vmm_prop(0, true);
	prop.requestedHandleTypes = (CUmemAllocationHandleType)0x2; /* Win32 */
	CU_EQ(&api, api.MemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
	prop = vmm_prop(0, true);
	CU_OK(&api, api.MemCreate(&h, 4 * GRAN, &prop, 0));
	cr_assert_eq(free_now(&api), 16 * MiB - 4 * GRAN);
	CU_EQ(&api, api.MemCreate(&h2, 6 * GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);

	/* Export: a new fd per call, of the POSIX fd type only, and only when
	 * it was requested at create. */
	int fd1 = -1, fd2 = -1;
	CU_OK(&api,
	      api.MemExportToShareableHandle(&fd1, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	CU_OK(&api,
	      api.MemExportToShareableHandle(&fd2, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	cr_assert(fd1 >= 0 && fd2 >= 0 && fd1 != fd2, "fds %d and %d", fd1, fd2);
	cr_assert_eq(fcntl(fd1, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
	CU_EQ(&api,
	      api.MemExportToShareableHandle(NULL, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	      CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemExportToShareableHandle(&fd2, h, (CUmemAllocationHandleType)0x2, 0),
	      CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api,
	      api.MemExportToShareableHandle(&fd2, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1),
	      CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api,
	      api.MemExportToShareableHandle(&fd2, h + 8, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
					     0),
	      CUDA_ERROR_INVALID_VALUE);
	prop = vmm_prop(0, false);
	CU_OK(&api, api.MemCreate(&plain, GRAN, &prop, 0));
	CU_EQ(&api,
	      api.MemExportToShareableHandle(&fd2, plain, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
					     0),
	      CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemRelease(plain));

	/* Import: our memfd, whole; never another fd. It leaves the fd open. */
	CU_OK(&api, api.MemImportFromShareableHandle(&h2, (void *)(uintptr_t)fd1,
						     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
	cr_assert_eq(fcntl(fd1, F_GETFD) >= 0, true, "import closed the fd");
	cr_assert_eq(free_now(&api), 16 * MiB - 4 * GRAN,
		     "one allocation, two handles: counted once");
	CU_EQ(&api,
	      api.MemImportFromShareableHandle(&h2, (void *)(uintptr_t)fd1,
					       (CUmemAllocationHandleType)0x2),
	      CUDA_ERROR_INVALID_VALUE);
	int pfd[2];
	cr_assert_eq(pipe(pfd), 0);
	int other = memfd_create("fakecuda.00000000.vmm.0.2097152.1", MFD_CLOEXEC);
	cr_assert_geq(other, 0);
	cr_assert_eq(ftruncate(other, GRAN), 0);
	int bad[] = {-1, pfd[0], other, 9999};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		CU_EQ(&api,
		      api.MemImportFromShareableHandle(&plain, (void *)(uintptr_t)bad[i],
						       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
		      CUDA_ERROR_INVALID_VALUE);
	close(pfd[0]);
	close(pfd[1]);
	close(other);
	/* An imported handle is not exported again by the fake. */
	CU_EQ(&api,
	      api.MemExportToShareableHandle(&fd2, h2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	      CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemRelease(h2));
	CU_OK(&api, api.MemRelease(h));
	cr_assert_eq(free_now(&api), 16 * MiB);
	close(fd1);
	close(fd2);
	bb_cuda_unload(&api);
}

Test(fakecuda, vmm_map_access_and_unmap_follow_the_drivers_rules)
{
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUmemAllocationProp prop = vmm_prop(0, false);
	CUmemGenericAllocationHandle h;
	CU_OK(&api, api.MemCreate(&h, 2 * GRAN, &prop, 0));
	CUdeviceptr r, q;
	CU_EQ(&api, api.MemAddressReserve(&r, GRAN + 4096, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemAddressReserve(&r, 4 * GRAN, 3 * GRAN, 0, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemAddressReserve(&r, 4 * GRAN, 0, 0, 1), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemAddressReserve(&q, 2 * GRAN, 8 * GRAN, 0, 0));
	cr_assert_eq(q % (8 * GRAN), 0, "alignment");
	CU_OK(&api, api.MemAddressFree(q, 2 * GRAN));
	CU_OK(&api, api.MemAddressReserve(&r, 4 * GRAN, 0, 0, 0));
	/* Map: offset 0, the whole allocation, aligned, inside a reservation,
	 * where nothing is mapped. */
	CU_EQ(&api, api.MemMap(r, 2 * GRAN, GRAN, h, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemMap(r, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemMap(r, 2 * GRAN, 0, h, 1), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemMap(r + 4096, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemMap(r + 3 * GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemMap(r + 8 * GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemMap(r, 2 * GRAN, 0, h + 8, 0), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemMap(r + 2 * GRAN, 2 * GRAN, 0, h, 0));
	CU_EQ(&api, api.MemMap(r + 2 * GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemMap(r + GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	CUdeviceptr p = r + 2 * GRAN;
	/* No access until cuMemSetAccess. */
	char buf[256] = {0};
	CU_EQ(&api, api.MemcpyHtoD(p, buf, sizeof(buf)), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemcpyDtoH(buf, p, sizeof(buf)), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemsetD8(p, 1, sizeof(buf)), CUDA_ERROR_INVALID_VALUE);
	CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 1},
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	CU_EQ(&api, api.MemSetAccess(p, GRAN, &acc, 1),
	      CUDA_ERROR_INVALID_VALUE); /* half a mapping */
	CU_EQ(&api, api.MemSetAccess(r, 4 * GRAN, &acc, 1), CUDA_ERROR_INVALID_VALUE); /* a gap */
	CU_EQ(&api, api.MemSetAccess(p, 2 * GRAN, &acc, 0), CUDA_ERROR_INVALID_VALUE);
	acc.location.id = 7;
	CU_EQ(&api, api.MemSetAccess(p, 2 * GRAN, &acc, 1), CUDA_ERROR_INVALID_DEVICE);
	acc.location.id = 0;
	acc.flags = (CUmemAccess_flags)2;
	CU_EQ(&api, api.MemSetAccess(p, 2 * GRAN, &acc, 1), CUDA_ERROR_INVALID_VALUE);
	/* Access for device 1 only: a context of device 0 still cannot copy. */
	acc.location.id = 1;
	acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	CU_OK(&api, api.MemSetAccess(p, 2 * GRAN, &acc, 1));
	CU_EQ(&api, api.MemcpyHtoD(p, buf, sizeof(buf)), CUDA_ERROR_INVALID_VALUE);
	/* Read access: reads only. */
	acc.location.id = 0;
	acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
	CU_OK(&api, api.MemSetAccess(p, 2 * GRAN, &acc, 1));
	CU_OK(&api, api.MemcpyDtoH(buf, p, sizeof(buf)));
	CU_EQ(&api, api.MemcpyHtoD(p, buf, sizeof(buf)), CUDA_ERROR_INVALID_VALUE);
	acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	CU_OK(&api, api.MemSetAccess(p, 2 * GRAN, &acc, 1));
	CU_OK(&api, api.MemsetD8(p + 2 * GRAN - 256, 0xab, 256));
	CU_OK(&api, api.MemcpyDtoH(buf, p + 2 * GRAN - 256, 256));
	cr_assert_eq((unsigned char)buf[255], 0xab);
	CU_EQ(&api, api.MemcpyDtoH(buf, p + 2 * GRAN - 128, 256), CUDA_ERROR_INVALID_VALUE);
	/* Not a cuMemAlloc pointer, nor one for legacy IPC. */
	CUipcMemHandle ipc;
	CU_EQ(&api, api.MemFree(p), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.IpcGetMemHandle(&ipc, p), CUDA_ERROR_INVALID_VALUE);
	/* Unmap: whole mappings; the reservation goes when nothing is mapped. */
	CU_EQ(&api, api.MemUnmap(p, GRAN), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemUnmap(r, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemAddressFree(r, 4 * GRAN), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemAddressFree(r, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemUnmap(r, 4 * GRAN));
	CU_EQ(&api, api.MemcpyDtoH(buf, p, sizeof(buf)), CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api, api.MemUnmap(p, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemAddressFree(r, 4 * GRAN));
	CU_EQ(&api, api.MemAddressFree(r, 4 * GRAN), CUDA_ERROR_INVALID_VALUE);
	/* A released handle maps no more. */
	CU_OK(&api, api.MemAddressReserve(&r, 2 * GRAN, 0, 0, 0));
	CU_OK(&api, api.MemRelease(h));
	CU_EQ(&api, api.MemMap(r, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	CU_OK(&api, api.MemAddressFree(r, 2 * GRAN));
	bb_cuda_unload(&api);
}

Test(fakecuda, vmm_fd_knobs_take_posix_fd_export_from_devices)
{
	setenv("FAKECUDA_VMM_FD_LACKING", "1", 1);
	bb_cuda api;
	load(&api);
	int v = -1;
	CU_OK(&api,
	      api.DeviceGetAttribute(
		      &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0));
	cr_assert_eq(v, 1);
	CU_OK(&api,
	      api.DeviceGetAttribute(
		      &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 1));
	cr_assert_eq(v, 0);
	CU_OK(&api, api.DeviceGetAttribute(
			    &v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1));
	cr_assert_eq(v, 1, "VMM itself is there");
	current(&api, 1);
	CUmemAllocationProp prop = vmm_prop(1, true);
	CUmemGenericAllocationHandle h;
	CU_EQ(&api, api.MemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
	prop = vmm_prop(1, false);
	CU_OK(&api, api.MemCreate(&h, GRAN, &prop, 0));
	CU_OK(&api, api.MemRelease(h));
	bb_cuda_unload(&api);

	/* FAKECUDA_VMM_FD=0: no device; a bad value fails cuInit. */
	unsetenv("FAKECUDA_VMM_FD_LACKING");
	setenv("FAKECUDA_VMM_FD", "0", 1);
	load(&api);
	for (int d = 0; d < 2; d++) {
		CU_OK(&api,
		      api.DeviceGetAttribute(
			      &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
			      d));
		cr_assert_eq(v, 0, "device %d", d);
	}
	current(&api, 0);
	prop = vmm_prop(0, true);
	CU_EQ(&api, api.MemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
	bb_cuda_unload(&api);
	setenv("FAKECUDA_VMM_FD", "maybe", 1);
	char err[256];
	cr_assert_neq(bb_cuda_load(&api, err, sizeof(err)), 0);
	cr_assert(strstr(err, "CUDA_ERROR_INVALID_VALUE"), "%s", err);
	unsetenv("FAKECUDA_VMM_FD");
}

Test(fakecuda, novmm_build_is_a_driver_too_old_for_vmm)
{
	const char *lib = getenv("BB_FAKECUDA_NOVMM");
	cr_assert(lib && lib[0], "BB_FAKECUDA_NOVMM must name the built libfakecuda_novmm.so");
	setenv("BUFBROKER_CUDA_LIBRARY", lib, 1);
	bb_cuda api;
	char err[256], why[256] = "";
	cr_assert_eq(bb_cuda_load(&api, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(bb_cuda_has_vmm(&api, why, sizeof(why)), 0);
	cr_assert(strstr(why, "cuMemCreate"), "why: %s", why);
	cr_assert_null(dlsym(api.lib, "cuMemImportFromShareableHandle"));
	int v = -1;
	CU_OK(&api, api.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 0));
	cr_assert_eq(v, 1);
	CU_EQ(&api,
	      api.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
				     0),
	      CUDA_ERROR_INVALID_VALUE);
	CU_EQ(&api,
	      api.DeviceGetAttribute(
		      &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0),
	      CUDA_ERROR_INVALID_VALUE);
	/* Legacy memory works as ever. */
	current(&api, 0);
	CUdeviceptr p;
	CU_OK(&api, api.MemAlloc(&p, 4096));
	CU_OK(&api, api.MemFree(p));
	bb_cuda_unload(&api);
}

/* ---- PID namespaces ---------------------------------------------------------- */

#define NS_DENIED 99 /* the child may not make a PID namespace */

/* What a consumer in its own PID namespace is given and does. */
struct ns_peer {
	bool strict;        /* FAKECUDA_LEGACY_IPC_NAMESPACE=strict in there */
	size_t legacy_size; /* of the holder's cuMemAlloc, seed legacy_seed */
	uint32_t legacy_seed;
	size_t vmm_size;   /* of the test's VMM allocation, seed 1 */
	char outer_ns[64]; /* readlink /proc/self/ns/pid of the test */
	bbt_chan ch;
};

/* In the new namespace (pid 1 there): open the legacy handle (refused under
 * strict), import and map the VMM fd; find the seeds, write seed 2 in the
 * VMM allocation. */
static int ns_consumer(struct ns_peer *x)
{
	bb_cuda api;
	CUipcMemHandle hd;
	CUresult rc;
	char ns[64] = "";
	STEP(2,
	     readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1) > 0 && strcmp(ns, x->outer_ns) != 0);
	STEP(3, getpid() == 1);
	STEP(4, bbt_recv(x->ch.fd[1], &hd, sizeof(hd), 30000) == 0);
	int fd = recv_fd(x->ch.fd[1], 30000);
	STEP(5, fd >= 0);
	if (x->strict)
		setenv("FAKECUDA_LEGACY_IPC_NAMESPACE", "strict", 1);
	STEP(6, child_load(&api) == 0);
	STEP(7, make_current(&api, 0, NULL) == CUDA_SUCCESS);
	char *buf = malloc(x->vmm_size > x->legacy_size ? x->vmm_size : x->legacy_size);
	STEP(8, buf);
	CUdeviceptr p;
	rc = api.IpcOpenMemHandle(&p, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	if (x->strict) {
		STEP(9, rc == CUDA_ERROR_INVALID_CONTEXT);
	} else {
		STEP(10, rc == CUDA_SUCCESS);
		STEP(11, api.MemcpyDtoH(buf, p, x->legacy_size) == CUDA_SUCCESS);
		STEP(12, bbt_check(buf, x->legacy_size, x->legacy_seed));
		STEP(13, api.IpcCloseMemHandle(p) == CUDA_SUCCESS);
	}
	CUmemGenericAllocationHandle h;
	STEP(14, api.MemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
						  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ==
			 CUDA_SUCCESS);
	close(fd);
	p = vmm_map(&api, h, x->vmm_size, 0, &rc);
	STEP(15, p != 0);
	STEP(16, api.MemcpyDtoH(buf, p, x->vmm_size) == CUDA_SUCCESS);
	STEP(17, bbt_check(buf, x->vmm_size, 1));
	bbt_fill(buf, x->vmm_size, 2);
	STEP(18, api.MemcpyHtoD(p, buf, x->vmm_size) == CUDA_SUCCESS);
	STEP(19, vmm_unmap(&api, p, x->vmm_size) == CUDA_SUCCESS);
	STEP(20, api.MemRelease(h) == CUDA_SUCCESS);
	free(buf);
	bb_cuda_unload(&api);
	return 0;
}

/* Forked before the test's cuInit: unshare the PID namespace, and run the
 * consumer as pid 1 of it (as `unshare --pid --fork` does). */
static int ns_child(void *arg)
{
	if (unshare(CLONE_NEWPID) != 0) {
		fprintf(stderr, "unshare(CLONE_NEWPID): %s\n", strerror(errno));
		return NS_DENIED;
	}
	pid_t pid = fork();
	if (pid < 0)
		return 1;
	if (pid == 0)
		_exit(ns_consumer(arg));
	int st;
	while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
		;
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* The consumer in its own PID namespace reaches a legacy allocation of a
 * holder and a VMM allocation of this process through what it was sent. */
static void across_namespaces(bool strict)
{
	setenv("FAKECUDA_MEMORY", "64M", 1);
	if (strict)
		setenv("FAKECUDA_LEGACY_IPC_NAMESPACE", "strict", 1);
	struct ns_peer x = {
		.strict = strict, .legacy_size = 8192 + 17, .legacy_seed = 9, .vmm_size = 2 * GRAN};
	cr_assert_gt(readlink("/proc/self/ns/pid", x.outer_ns, sizeof(x.outer_ns) - 1), 0);
	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(ns_child, &x);
	struct holder hl = {.ordinal = 0, .size = x.legacy_size, .seed = x.legacy_seed};
	CUipcMemHandle hd;
	pid_t hpid = holder_start(&hl, &hd);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	/* In one namespace the strict knob changes nothing. */
	CUdeviceptr q;
	CU_OK(&api, api.IpcOpenMemHandle(&q, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
	CU_OK(&api, api.IpcCloseMemHandle(q));
	CUdeviceptr p;
	int fd;
	CUmemGenericAllocationHandle h = vmm_made(&api, x.vmm_size, &p, &fd);
	cr_assert_eq(bbt_send(x.ch.fd[0], &hd, sizeof(hd)), 0);
	cr_assert_eq(send_fd(x.ch.fd[0], fd), 0);
	close(fd);
	int rc = bbt_join(pid, CHILD_TIMEOUT_MS);
	if (rc == NS_DENIED) {
		holder_free(&hl, hpid);
		CU_OK(&api, vmm_unmap(&api, p, x.vmm_size));
		CU_OK(&api, api.MemRelease(h));
		bb_cuda_unload(&api);
		cr_skip_test(
			"this process may not make a PID namespace (unshare --pid needs root)");
	}
	cr_assert_eq(rc, 0, "the consumer in its own PID namespace failed at step %d", rc);
	char *buf = malloc(x.vmm_size);
	CU_OK(&api, api.MemcpyDtoH(buf, p, x.vmm_size));
	cr_assert(bbt_check(buf, x.vmm_size, 2), "the consumer's bytes");
	free(buf);
	CU_OK(&api, vmm_unmap(&api, p, x.vmm_size));
	CU_OK(&api, api.MemRelease(h));
	holder_free(&hl, hpid);
	bbt_chan_close(&x.ch);
	bb_cuda_unload(&api);
}

Test(fakecuda, another_pid_namespace_opens_legacy_handles_and_maps_vmm_fds)
{
	across_namespaces(false);
}

Test(fakecuda, strict_knob_refuses_legacy_ipc_across_pid_namespaces_not_vmm)
{
	across_namespaces(true);
}

Test(fakecuda, vmm_memory_goes_with_the_process_not_with_its_context)
{
	setenv("FAKECUDA_MEMORY", "32M", 1);
	bb_cuda api;
	load(&api);
	current(&api, 0);
	CUdeviceptr p;
	int fd;
	CUmemGenericAllocationHandle h = vmm_made(&api, 2 * GRAN, &p, &fd);
	close(fd);
	(void)h;
	/* A primary context reset leaves VMM memory (the process owns it). */
	CU_OK(&api, api.DevicePrimaryCtxRelease(0));
	current(&api, 0);
	char buf[64];
	CU_OK(&api, api.MemcpyDtoH(buf, p, sizeof(buf)));
	cr_assert(bbt_check(buf, sizeof(buf), 1));
	cr_assert_eq(free_now(&api), 32 * MiB - 2 * GRAN);
	bb_cuda_unload(&api); /* dlclose: handle, mapping and reservation go */
	load(&api);
	current(&api, 0);
	cr_assert_eq(free_now(&api), 32 * MiB);
	bb_cuda_unload(&api);
}

Test(fakecuda, vmm_calls_hook_counts_every_call_of_each_entry_point)
{
	bb_cuda api;
	load(&api);
	unsigned long (*calls)(const char *) =
		(unsigned long (*)(const char *))dlsym(api.lib, "fakecuda_vmm_calls");
	cr_assert_not_null(calls, "fakecuda_vmm_calls not exported");
	cr_assert_eq(calls("cuMemAlloc_v2"), (unsigned long)-1, "not a VMM call");
	cr_assert_eq(calls("cuMemMap"), 0);
	current(&api, 0);
	CUdeviceptr p;
	int fd;
	CUmemGenericAllocationHandle h = vmm_made(&api, GRAN, &p, &fd);
	CU_EQ(&api, api.MemMap(p, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* counted too */
	char buf[64];
	for (int i = 0; i < 3; i++)
		CU_OK(&api, api.MemcpyDtoH(buf, p, sizeof(buf)));
	cr_assert_eq(calls("cuMemCreate"), 1);
	cr_assert_eq(calls("cuMemAddressReserve"), 1);
	cr_assert_eq(calls("cuMemMap"), 2);
	cr_assert_eq(calls("cuMemSetAccess"), 1);
	cr_assert_eq(calls("cuMemExportToShareableHandle"), 1);
	cr_assert_eq(calls("cuMemImportFromShareableHandle"), 0);
	CU_OK(&api, vmm_unmap(&api, p, GRAN));
	CU_OK(&api, api.MemRelease(h));
	cr_assert_eq(calls("cuMemUnmap"), 1);
	cr_assert_eq(calls("cuMemAddressFree"), 1);
	cr_assert_eq(calls("cuMemRelease"), 1);
	close(fd);
	bb_cuda_unload(&api);
}
