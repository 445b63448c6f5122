/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA: alloc from the daemon's slab pool versus a plain cuMemAlloc, and
 * mapping a buffer whose allocation this process already has open versus
 * one that needs a fresh cuIpcOpenMemHandle (and the bare driver calls),
 * for legacy IPC buffers and for VMM buffers (a cuMemCreate slab exported
 * as a file descriptor): a VMM buffer in a slab this process has mapped
 * already, the first map of a slab, and the driver's import + map + unmap
 * alone.
 *
 * The driver is whatever $BUFBROKER_CUDA_LIBRARY names (run.sh points it
 * at tests/fakecuda's libfakecuda.so when no real driver is found), for the
 * daemon and this program alike. Every driver call here happens in a
 * forked child: a process forked after cuInit cannot use CUDA, so the
 * parent never loads the driver.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "bufbroker/bufbroker.h"
#include "cuda_api.h"

#define CUDA_BUF_BYTES (1u << 20)
#define WARMUP 20

/* Figures a child leaves for the parent. */
struct cuda_shared {
	hist h;
	uint64_t ops, elapsed_ns;
	char err[256];
};

enum cuda_mode {
	MODE_MEMALLOC,       /* cuMemAlloc + cuMemFree in this process */
	MODE_MAP_WARM,       /* bb_open + bb_map, the allocation already open here */
	MODE_MAP_COLD,       /* bb_open + bb_map, nothing of the allocation open here */
	MODE_IPC_OPEN,       /* cuIpcOpenMemHandle of the buffer's allocation */
	MODE_IPC_OPEN_CLOSE, /* cuIpcOpenMemHandle + cuIpcCloseMemHandle */
	MODE_VMM_COLD,       /* bb_open + bb_map of VMM buffers, each the first of its slab here */
	MODE_VMM_RAW, /* the driver's import, reserve, map, set access, unmap, free, release */
};

/* VMM buffers for the first-map row: each in a slab of its own. */
#define VMM_COLD_BUFS 8

__attribute__((noreturn, format(printf, 2, 3))) static void cuda_child_fail(struct cuda_shared *s,
									    const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(s->err, sizeof(s->err), fmt, ap);
	va_end(ap);
	_exit(1);
}

/* Load the driver and make the primary context of the device with this
 * UUID (or, uuid NULL, the first device) current. */
static int child_driver(struct cuda_shared *s, bb_cuda *api, const unsigned char *uuid)
{
	char err[256], eb[128];
	int n = 0;
	CUresult cr;

	if (bb_cuda_load(api, err, sizeof(err)))
		cuda_child_fail(s, "%s", err);
	cr = api->DeviceGetCount(&n);
	if (cr != CUDA_SUCCESS || n < 1)
		cuda_child_fail(s, "no CUDA device: %s", bb_cuda_error(api, cr, eb, sizeof(eb)));
	for (int i = 0; i < n; i++) {
		CUdevice dev;
		CUuuid u;
		CUcontext ctx;

		if (api->DeviceGet(&dev, i) != CUDA_SUCCESS ||
		    api->DeviceGetUuid(&u, dev) != CUDA_SUCCESS)
			continue;
		if (uuid && memcmp(u.bytes, uuid, 16))
			continue;
		cr = api->DevicePrimaryCtxRetain(&ctx, dev);
		if (cr == CUDA_SUCCESS)
			cr = api->CtxSetCurrent(ctx);
		if (cr != CUDA_SUCCESS)
			cuda_child_fail(s, "primary context: %s",
					bb_cuda_error(api, cr, eb, sizeof(eb)));
		return i;
	}
	cuda_child_fail(s, "no CUDA device in this process matches the buffer's UUID");
}

/* The driver's whole cycle for one VMM allocation this process imports
 * itself from fd: what bb_map does on a slab's first map, and undoes. */
static CUresult vmm_cycle(const bb_cuda *api, int fd, size_t bytes, int ordinal)
{
	CUmemGenericAllocationHandle h;
	CUmemAccessDesc access = {
		.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal},
		.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
	};
	CUdeviceptr va = 0;
	CUresult cr, cr2;

	cr = api->MemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
					       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (cr != CUDA_SUCCESS)
		return cr;
	cr = api->MemAddressReserve(&va, bytes, 0, 0, 0);
	if (cr == CUDA_SUCCESS) {
		cr = api->MemMap(va, bytes, 0, h, 0);
		if (cr == CUDA_SUCCESS) {
			cr = api->MemSetAccess(va, bytes, &access, 1);
			cr2 = api->MemUnmap(va, bytes);
			cr = cr != CUDA_SUCCESS ? cr : cr2;
		}
		cr2 = api->MemAddressFree(va, bytes);
		cr = cr != CUDA_SUCCESS ? cr : cr2;
	}
	cr2 = api->MemRelease(h);
	return cr != CUDA_SUCCESS ? cr : cr2;
}

/* First maps of the VMM buffers ids[0..n), each in a slab of its own: one
 * timed bb_open + bb_map each; the handles are kept until all are timed. */
__attribute__((noreturn)) static void vmm_cold_child(const bench_opts *o, const uint64_t *ids,
						     int n, struct cuda_shared *s)
{
	bb_client *c = NULL;
	bb_buf *m[VMM_COLD_BUFS] = {0};
	uint64_t t0, t1, all = 0;

	bench_pin_client(0);
	if (bb_connect(o->rt.bb_socket, &c))
		cuda_child_fail(s, "bb_connect: %s", bb_last_error());
	for (int i = 0; i < n && i < VMM_COLD_BUFS; i++) {
		void *p;
		t0 = bench_now_ns();
		if (bb_open(c, ids[i], &m[i]) || bb_map(m[i], &p))
			cuda_child_fail(s, "bb_open + bb_map (VMM): %s", bb_last_error());
		t1 = bench_now_ns();
		hist_add(&s->h, t1 - t0);
		all += t1 - t0;
		s->ops++;
	}
	s->elapsed_ns = all;
	for (int i = 0; i < VMM_COLD_BUFS; i++)
		bb_unref(m[i]);
	bb_disconnect(c);
	_exit(0);
}

__attribute__((noreturn)) static void cuda_child(const bench_opts *o, enum cuda_mode mode,
						 uint64_t keep_id, uint64_t id, uint64_t dur_ns,
						 struct cuda_shared *s)
{
	bb_cuda api;
	bb_client *c = NULL;
	bb_buf *keep = NULL, *b = NULL;
	bb_cuda_ipc ipc;
	bb_cuda_vmm vmm = {.fd = -1};
	CUipcMemHandle h;
	char eb[128];
	int ordinal = 0;
	uint64_t start = 0, t0, t1 = 0;

	bench_pin_client(0);
	child_watchdog(dur_ns);
	if (mode != MODE_MEMALLOC && bb_connect(o->rt.bb_socket, &c))
		cuda_child_fail(s, "bb_connect: %s", bb_last_error());
	if (mode == MODE_MEMALLOC)
		child_driver(s, &api, NULL);
	if (mode == MODE_MAP_WARM) {
		void *p;
		if (bb_open(c, keep_id, &keep) || bb_map(keep, &p))
			cuda_child_fail(s, "mapping the buffer that keeps the slab open: %s",
					bb_last_error());
	}
	if (mode == MODE_IPC_OPEN || mode == MODE_IPC_OPEN_CLOSE) {
		/* The raw handle, without mapping it through the library. */
		if (bb_open(c, id, &b) || bb_cuda_ipc_of(b, &ipc))
			cuda_child_fail(s, "bb_cuda_ipc_of: %s", bb_last_error());
		memcpy(&h, ipc.handle, sizeof(h));
		child_driver(s, &api, ipc.device_uuid);
	}
	if (mode == MODE_VMM_RAW) {
		char why[256];
		if (bb_open(c, id, &b) || bb_cuda_vmm_of(b, &vmm))
			cuda_child_fail(s, "bb_cuda_vmm_of: %s", bb_last_error());
		ordinal = child_driver(s, &api, vmm.device_uuid);
		if (!bb_cuda_has_vmm(&api, why, sizeof(why)))
			cuda_child_fail(s, "%s", why);
	}
	for (int i = 0;; i++) {
		CUdeviceptr dp = 0;
		CUresult cr = CUDA_SUCCESS;
		bb_buf *m = NULL;
		void *p;

		t0 = bench_now_ns();
		if (i == WARMUP)
			start = t0;
		switch (mode) {
		case MODE_MEMALLOC:
			cr = api.MemAlloc(&dp, CUDA_BUF_BYTES);
			if (cr == CUDA_SUCCESS)
				cr = api.MemFree(dp);
			break;
		case MODE_MAP_WARM:
		case MODE_MAP_COLD:
			if (bb_open(c, id, &m) || bb_map(m, &p))
				cuda_child_fail(s, "bb_open + bb_map: %s", bb_last_error());
			break;
		case MODE_IPC_OPEN:
		case MODE_IPC_OPEN_CLOSE:
			cr = api.IpcOpenMemHandle(&dp, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
			if (cr == CUDA_SUCCESS && mode == MODE_IPC_OPEN_CLOSE) {
				cr = api.IpcCloseMemHandle(dp);
				dp = 0;
			}
			break;
		case MODE_VMM_RAW:
			cr = vmm_cycle(&api, vmm.fd, vmm.allocation_size, ordinal);
			break;
		case MODE_VMM_COLD: break; /* vmm_cold_child */
		}
		t1 = bench_now_ns();
		if (cr != CUDA_SUCCESS)
			cuda_child_fail(s, "driver: %s", bb_cuda_error(&api, cr, eb, sizeof(eb)));
		/* Undo, untimed: the unref closes a cold allocation again. */
		if (m)
			bb_unref(m);
		if (mode == MODE_IPC_OPEN && api.IpcCloseMemHandle(dp) != CUDA_SUCCESS)
			cuda_child_fail(s, "cuIpcCloseMemHandle failed");
		if (i >= WARMUP) {
			hist_add(&s->h, t1 - t0);
			s->ops++;
			if (t1 - start >= dur_ns)
				break;
		}
	}
	s->elapsed_ns = t1 - start;
	if (vmm.fd >= 0)
		close(vmm.fd);
	bb_unref(b);
	bb_unref(keep);
	bb_disconnect(c);
	_exit(0);
}

/* One child-measured figure into res (p50, p99). MODE_VMM_COLD maps
 * ids[0..n) once each. */
static void cuda_measure_ids(const bench_opts *o, enum cuda_mode mode, uint64_t keep_id,
			     uint64_t id, const uint64_t *ids, int n, result *res)
{
	struct cuda_shared *s =
		mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	int st = 0;
	pid_t pid;

	if (s == MAP_FAILED) {
		res->skipped = 1;
		result_note(res, "mmap failed");
		return;
	}
	fflush(stdout);
	fflush(stderr);
	pid = fork();
	if (pid == 0 && mode == MODE_VMM_COLD)
		vmm_cold_child(o, ids, n, s);
	if (pid == 0)
		cuda_child(o, mode, keep_id, id, o->dur_ns / 2, s);
	if (pid > 0)
		while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
			;
	if (pid < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0 || !s->ops) {
		res->skipped = 1;
		result_note(res, "failed: %.180s",
			    s->err[0] ? s->err : "the measuring process died");
	} else {
		res->p50_us = hist_quantile(&s->h, 0.5) / 1e3;
		res->p99_us = hist_quantile(&s->h, 0.99) / 1e3;
		res->ops_per_s = (double)s->ops * 1e9 / (double)s->elapsed_ns;
		res->reps = 1;
	}
	munmap(s, sizeof(*s));
}

static void cuda_measure(const bench_opts *o, enum cuda_mode mode, uint64_t keep_id, uint64_t id,
			 result *res)
{
	cuda_measure_ids(o, mode, keep_id, id, NULL, 0, res);
}

static const struct {
	const char *name, *label;
} cuda_rows[] = {
	{"cuda.alloc_slab", "bb_alloc+unref 1 MiB (slab pool)"},
	{"cuda.memalloc", "cuMemAlloc+cuMemFree 1 MiB"},
	{"cuda.map_warm", "open+map, allocation already mapped"},
	{"cuda.map_cold", "open+map, fresh allocation (IPC open)"},
	{"cuda.ipc_open", "cuIpcOpenMemHandle alone"},
	{"cuda.ipc_open_close", "cuIpcOpenMemHandle+cuIpcCloseMemHandle"},
	{"cuda.vmm_map_warm", "VMM open+map, slab already mapped"},
	{"cuda.vmm_map_cold", "VMM open+map, first map of a slab"},
	{"cuda.vmm_import_map", "VMM import+reserve+map+access+unmap+release"},
};
enum { ROW_IPC_OPEN = 4, ROW_IPC_OPEN_CLOSE, ROW_VMM_WARM, ROW_VMM_COLD, ROW_VMM_RAW };
#define CUDA_ROWS (int)(sizeof(cuda_rows) / sizeof(cuda_rows[0]))

static void cuda_skip_all(const char *why)
{
	for (int i = 0; i < CUDA_ROWS; i++) {
		result *res = result_new(cuda_rows[i].name, "cuda", "cuda", cuda_rows[i].label);
		res->skipped = 1;
		result_note(res, "%.190s", why);
	}
}

/* The VMM rows, on c: two buffers in one slab (warm map, the driver's own
 * cycle), then VMM_COLD_BUFS buffers larger than the daemon's default
 * slab (64 MiB), each in an allocation of its own (first maps). */
static void scenario_vmm(const bench_opts *o, bb_client *c)
{
	bb_alloc_opts ao = {.size = CUDA_BUF_BYTES, .kind = BB_CUDA};
	bb_buf *a = NULL, *b = NULL, *cold[VMM_COLD_BUFS] = {0};
	uint64_t ids[VMM_COLD_BUFS];
	bb_cuda_vmm va, vb;
	char why[300] = "";
	int rc, n = 0;

	rc = bb_alloc_cuda(c, &ao, BB_CUDA_HANDLE_VMM, &a);
	if (rc == 0)
		rc = bb_alloc_cuda(c, &ao, BB_CUDA_HANDLE_VMM, &b);
	if (rc == 0 && bb_cuda_vmm_of(a, &va) == 0) {
		close(va.fd);
		if (bb_cuda_vmm_of(b, &vb) == 0) {
			close(vb.fd);
			if (va.allocation != vb.allocation)
				snprintf(why, sizeof(why),
					 "the two buffers are in different "
					 "slabs: this is a first map");
		}
	}
	if (rc)
		snprintf(why, sizeof(why), "skipped: the daemon answered %s: %.200s",
			 bb_strerror(rc), bb_last_error());
	for (int i = ROW_VMM_WARM; i <= ROW_VMM_RAW; i++) {
		result *res =
			result_new(cuda_rows[i].name, "cuda",
				   i == ROW_VMM_RAW ? "cuda" : "bufbroker", cuda_rows[i].label);
		if (rc) {
			res->skipped = 1;
			result_note(res, "%s", why);
			continue;
		}
		if (i == ROW_VMM_WARM) {
			result_note(res, "%s", why);
			cuda_measure(o, MODE_MAP_WARM, bb_id(a), bb_id(b), res);
		} else if (i == ROW_VMM_RAW) {
			cuda_measure(o, MODE_VMM_RAW, 0, bb_id(b), res);
		} else {
			bb_alloc_opts big = {.size = (64u << 20) + 1, .kind = BB_CUDA};
			uint64_t prev = 0;
			int shared = 0;
			for (n = 0; n < VMM_COLD_BUFS; n++) {
				bb_cuda_vmm v;
				if (bb_alloc_cuda(c, &big, BB_CUDA_HANDLE_VMM, &cold[n]))
					break;
				ids[n] = bb_id(cold[n]);
				if (bb_cuda_vmm_of(cold[n], &v) == 0) {
					close(v.fd);
					shared |= v.allocation == prev;
					prev = v.allocation;
				}
			}
			result_note(res, "%d buffers of 64 MiB + 1 B, one map each%s", n,
				    shared ? "; some share a slab (a larger --cuda-slab-bytes?): "
					     "not all maps are first maps"
					   : "");
			if (n)
				cuda_measure_ids(o, MODE_VMM_COLD, 0, 0, ids, n, res);
			else {
				res->skipped = 1;
				result_note(res, "failed: %.200s", bb_last_error());
			}
			for (int k = 0; k < n; k++)
				bb_unref(cold[k]);
		}
	}
	bb_unref(b);
	bb_unref(a);
}

void scenario_cuda(const bench_opts *o)
{
	bb_alloc_opts ao = {.size = CUDA_BUF_BYTES, .kind = BB_CUDA};
	bb_client *c = NULL;
	bb_buf *a = NULL, *b = NULL;
	bb_cuda_ipc ia, ib;
	hist *h;
	uint64_t start, t0, t1;
	int rc;

	if (!o->cuda) {
		cuda_skip_all("skipped: no CUDA driver (set $BUFBROKER_CUDA_LIBRARY or build "
			      "tests/fakecuda)");
		return;
	}
	fprintf(stderr, "  cuda\n");
	bench_set_pinned(1);
	if (bb_connect(o->rt.bb_socket, &c)) {
		cuda_skip_all(bb_last_error());
		return;
	}
	rc = bb_alloc(c, &ao, &a);
	if (rc) {
		char why[300];
		snprintf(why, sizeof(why), "skipped: the daemon answered %s: %s",
			 rc == BB_ERR_UNSUPPORTED ? "Unsupported" : bb_strerror(rc),
			 bb_last_error());
		cuda_skip_all(why);
		bb_disconnect(c);
		return;
	}

	/* Slab alloc (+ the unref that frees it) from this process. */
	result *res = result_new(cuda_rows[0].name, "cuda", "bufbroker", cuda_rows[0].label);
	h = calloc(1, sizeof(*h));
	bench_pin_client(0);
	start = t0 = bench_now_ns();
	for (int i = 0; h; i++) {
		bb_buf *x;
		if (bb_alloc(c, &ao, &x)) {
			res->skipped = 1;
			result_note(res, "failed: %s", bb_last_error());
			break;
		}
		bb_unref(x);
		t1 = bench_now_ns();
		if (i == WARMUP)
			start = t1;
		else if (i > WARMUP)
			hist_add(h, t1 - t0);
		t0 = t1;
		if (i > WARMUP && t1 - start >= o->dur_ns / 2)
			break;
	}
	bench_pin_client(-1);
	if (h && h->count) {
		res->p50_us = hist_quantile(h, 0.5) / 1e3;
		res->p99_us = hist_quantile(h, 0.99) / 1e3;
		res->ops_per_s = (double)h->count * 1e9 / (double)(t0 - start);
		res->reps = 1;
	}
	free(h);

	res = result_new(cuda_rows[1].name, "cuda", "cuda", cuda_rows[1].label);
	cuda_measure(o, MODE_MEMALLOC, 0, 0, res);

	/* Two buffers in one slab: a keeps the allocation open in the
	 * mapping process, b is the one opened and mapped. */
	rc = bb_alloc(c, &ao, &b);
	if (rc == 0)
		rc = bb_cuda_ipc_of(a, &ia) || bb_cuda_ipc_of(b, &ib);
	for (int i = 2; i <= ROW_IPC_OPEN_CLOSE; i++) {
		res = result_new(cuda_rows[i].name, "cuda",
				 i >= ROW_IPC_OPEN ? "cuda" : "bufbroker", cuda_rows[i].label);
		if (rc) {
			res->skipped = 1;
			result_note(res, "failed: %s", bb_last_error());
			continue;
		}
		if (i == 2 && memcmp(ia.handle, ib.handle, sizeof(ia.handle)))
			result_note(
				res,
				"the two buffers are in different allocations: this is a cold map");
		cuda_measure(o,
			     i == 2              ? MODE_MAP_WARM
			     : i == 3            ? MODE_MAP_COLD
			     : i == ROW_IPC_OPEN ? MODE_IPC_OPEN
						 : MODE_IPC_OPEN_CLOSE,
			     bb_id(a), bb_id(b), res);
	}
	bb_unref(b);
	bb_unref(a);
	scenario_vmm(o, c);
	bb_disconnect(c);
}
