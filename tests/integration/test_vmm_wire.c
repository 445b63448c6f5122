/* SPDX-License-Identifier: Apache-2.0 */
/*
 * VMM CUDA buffers on the wire (protocol 1.2, docs/PROTOCOL.md), against a
 * real bufbrokerd on tests/fakecuda's driver, through raw SOCK_SEQPACKET
 * peers: the Grant's fields for each handle kind, the allocation's fd
 * attached exactly with a connection's first grant of that allocation,
 * AllocationFd, the daemon's cuda-handle and cuda-forbid, refusals that say
 * why, a 1.1 client that gets legacy buffers and a clear refusal for VMM
 * ones without losing a count or a token, VMM allocations freed when their
 * holder is killed, and the limits.
 *
 * The fake driver's VMM allocation is a memfd: the fd a grant carries is a
 * real file descriptor that crossed SCM_RIGHTS.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <unistd.h>

#include "cuda_api.h"
#include "harness.h"
#include "wire.h"

#define MIB (1024u * 1024u)
#define RECV_MS 5000

/* ---- environment ------------------------------------------------------------ */

static void vmm_fini(void)
{
	bbt_cleanup_fakecuda(true);
}

TestSuite(vmm_wire, .fini = vmm_fini, .timeout = 90);

/* The fake driver for the daemon, in a namespace of this test's own, one
 * device of 256 MiB that can (fd_export) or cannot export POSIX fds. */
static void fake_env(bool fd_export)
{
	static int seq;
	const char *fake = getenv("BB_FAKECUDA");
	char ns[64];
	cr_assert(fake && fake[0], "BB_FAKECUDA is not set (ctest sets it)");
	snprintf(ns, sizeof(ns), "bbtvmm%d_%d", (int)getpid(), ++seq);
	unsetenv("CUDA_VISIBLE_DEVICES");
	setenv("BUFBROKER_CUDA_LIBRARY", fake, 1);
	setenv("FAKECUDA_NAMESPACE", ns, 1);
	setenv("FAKECUDA_DEVICES", "1", 1);
	setenv("FAKECUDA_MEMORY", "256M", 1);
	setenv("FAKECUDA_VMM_FD", fd_export ? "1" : "0", 1);
}

/* A daemon on the fake driver with 8 MiB slabs and these extra flags
 * (NULL-terminated, at most 8). */
static bbt_daemon *start(bool fd_export, const char *const *flags)
{
	const char *args[BBT_MAX_ARGS] = {"--cuda-slab-bytes", "8M", "--cuda-cache-bytes", "0"};
	int n = 4;
	for (int i = 0; flags && flags[i] && n < BBT_MAX_ARGS - 1; i++)
		args[n++] = flags[i];
	args[n] = NULL;
	fake_env(fd_export);
	return bbt_start(args);
}

/* ---- a raw peer ----------------------------------------------------------------- */

typedef struct peer {
	int sock;
	uint64_t next; /* request ids */
} peer;

/* Hello with protocol 1.minor as request 1; safe in a child. 0 when the
 * daemon accepted it and speaks our minor, else -1. */
static int hello_minor(int sock, uint32_t minor)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	Bufbroker__Response *resp;
	h.version_major = 1;
	h.version_minor = minor;
	h.client_name = "bbt-vmm";
	req.id = 1;
	req.op_case = BUFBROKER__REQUEST__OP_HELLO;
	req.hello = &h;
	if (bbt_raw_send(sock, &req, -1) || bbt_raw_recv(sock, RECV_MS, &resp, NULL) != 1)
		return -1;
	int ok = resp->status && resp->status->code == 0 && resp->hello &&
		 resp->hello->version_minor == BB_PROTO_MINOR;
	bufbroker__response__free_unpacked(resp, NULL);
	return ok ? 0 : -1;
}

/* Connect and say Hello with protocol 1.minor. */
static peer connect_minor(const bbt_daemon *d, uint32_t minor)
{
	peer p = {.sock = bbt_raw_connect(d->sock), .next = 2};
	cr_assert_geq(p.sock, 0, "connect: %s", strerror(-p.sock));
	cr_assert_eq(hello_minor(p.sock, minor), 0, "Hello 1.%u refused", minor);
	return p;
}

static peer connect_new(const bbt_daemon *d)
{
	return connect_minor(d, 2);
}

/* Send req (its id set here) and receive its answer: 1 with *out (free it)
 * and *fd (or -1). */
static Bufbroker__Response *call(peer *p, Bufbroker__Request *req, int *fd)
{
	Bufbroker__Response *resp = NULL;
	int got = -1;
	req->id = p->next++;
	cr_assert_eq(bbt_raw_send(p->sock, req, -1), 0);
	cr_assert_eq(bbt_raw_recv(p->sock, RECV_MS, &resp, &got), 1, "no answer");
	cr_assert_eq(resp->id, req->id);
	cr_assert_not_null(resp->status);
	if (fd)
		*fd = got;
	else if (got >= 0)
		close(got);
	return resp;
}

static int code_of(const Bufbroker__Response *r)
{
	return r->status->code;
}

/* Alloc a CUDA buffer of size bytes on device 0 asking for handle. */
static Bufbroker__Response *alloc_cuda(peer *p, uint64_t size, Bufbroker__CudaHandle handle,
				       int *fd)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Alloc a = BUFBROKER__ALLOC__INIT;
	a.size = size;
	a.kind = BUFBROKER__KIND__KIND_CUDA;
	a.share = BB_SHARE_ANY;
	a.cuda_handle = handle;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &a;
	return call(p, &req, fd);
}

/* The Grant of a successful answer (asserts). */
static const Bufbroker__Grant *grant_of(const Bufbroker__Response *r)
{
	cr_assert_eq(code_of(r), 0, "refused: %s", r->status->message);
	cr_assert_eq(r->result_case, BUFBROKER__RESPONSE__RESULT_GRANT);
	return r->grant;
}

static Bufbroker__Response *open_id(peer *p, uint64_t id, int *fd)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Open o = BUFBROKER__OPEN__INIT;
	o.target_case = BUFBROKER__OPEN__TARGET_ID;
	o.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_OPEN;
	req.open = &o;
	return call(p, &req, fd);
}

static int release(peer *p, uint64_t id)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Release r = BUFBROKER__RELEASE__INIT;
	r.id = id;
	r.count = 1;
	req.op_case = BUFBROKER__REQUEST__OP_RELEASE;
	req.release = &r;
	Bufbroker__Response *resp = call(p, &req, NULL);
	int code = code_of(resp);
	bufbroker__response__free_unpacked(resp, NULL);
	return code;
}

static Bufbroker__Response *allocation_fd(peer *p, uint64_t allocation, int *fd)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__AllocationFd a = BUFBROKER__ALLOCATION_FD__INIT;
	a.allocation = allocation;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOCATION_FD;
	req.allocation_fd = &a;
	return call(p, &req, fd);
}

/* Stat's BufferInfo (asserts success; free the response). */
static Bufbroker__Response *stat_id(peer *p, uint64_t id)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Stat s = BUFBROKER__STAT__INIT;
	s.target_case = BUFBROKER__STAT__TARGET_ID;
	s.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_STAT;
	req.stat = &s;
	Bufbroker__Response *resp = call(p, &req, NULL);
	cr_assert_eq(code_of(resp), 0, "stat: %s", resp->status->message);
	return resp;
}

/* Device 0 of ServerStatus: whether VMM can be had, why not, and the VMM
 * allocations held. */
typedef struct vmm_dev {
	bool vmm;
	char why[256];
	uint64_t allocations;
	uint64_t reserved;
} vmm_dev;

static vmm_dev device0(peer *p)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__ServerStatus ss = BUFBROKER__SERVER_STATUS__INIT;
	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &ss;
	Bufbroker__Response *resp = call(p, &req, NULL);
	cr_assert_eq(code_of(resp), 0);
	cr_assert_geq(resp->server_status->n_devices, 1, "no device: %s",
		      resp->server_status->cuda);
	const Bufbroker__DeviceInfo *di = resp->server_status->devices[0];
	vmm_dev v = {
		.vmm = di->vmm, .allocations = di->vmm_allocations, .reserved = di->reserved_bytes};
	snprintf(v.why, sizeof(v.why), "%s", di->vmm_unavailable);
	bufbroker__response__free_unpacked(resp, NULL);
	return v;
}

/* Poll ServerStatus until device 0 holds want VMM allocations. */
static bool vmm_allocations_until(peer *p, uint64_t want, int timeout_ms, uint64_t *last)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	for (;;) {
		*last = device0(p).allocations;
		if (*last == want)
			return true;
		if (bbt_now_ms() > deadline)
			return false;
		bbt_sleep_ms(10);
	}
}

static void check_clean(peer *p)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Check c = BUFBROKER__CHECK__INIT;
	req.op_case = BUFBROKER__REQUEST__OP_CHECK;
	req.check = &c;
	Bufbroker__Response *resp = call(p, &req, NULL);
	cr_assert_eq(code_of(resp), 0, "check: %s", resp->status->message);
	cr_assert_eq(resp->check->problems, 0, "check: %s", resp->check->report);
	bufbroker__response__free_unpacked(resp, NULL);
}

/* fd is a file of size bytes (the fake's VMM allocation is a memfd). */
static void assert_allocation_fd(int fd, uint64_t size)
{
	struct stat st;
	cr_assert_geq(fd, 0, "no fd attached");
	cr_assert_eq(fstat(fd, &st), 0, "fstat: %s", strerror(errno));
	cr_assert_eq((uint64_t)st.st_size, size, "the fd is %lld bytes, the allocation %llu",
		     (long long)st.st_size, (unsigned long long)size);
}

/* ---- grants -------------------------------------------------------------------- */

Test(vmm_wire, a_vmm_grant_carries_the_allocation_and_its_fd_with_the_first_grant_only)
{
	bbt_daemon *d = start(true, NULL);
	peer p = connect_new(d);
	int fd;

	Bufbroker__Response *r1 =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, &fd);
	const Bufbroker__Grant *g1 = grant_of(r1);
	cr_assert_eq(g1->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM);
	cr_assert_eq(g1->ipc_handle.len, 0, "a VMM grant has no IPC handle");
	cr_assert_neq(g1->allocation, 0);
	cr_assert_eq(g1->allocation_size, 8 * MIB);
	cr_assert_eq(g1->device_uuid.len, 16);
	cr_assert(g1->allocation_fd);
	assert_allocation_fd(fd, g1->allocation_size);
	close(fd);

	Bufbroker__Response *r2 =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, &fd);
	const Bufbroker__Grant *g2 = grant_of(r2);
	cr_assert_eq(g2->allocation, g1->allocation, "carved from the same slab");
	cr_assert_neq(g2->offset, g1->offset);
	cr_assert(!g2->allocation_fd, "the connection holds a buffer of that allocation");
	cr_assert_eq(fd, -1, "an fd came with a grant whose allocation_fd is false");

	/* Another connection's first grant of it carries the fd. */
	peer q = connect_new(d);
	Bufbroker__Response *r3 = open_id(&q, g2->info->id, &fd);
	const Bufbroker__Grant *g3 = grant_of(r3);
	cr_assert(g3->allocation_fd);
	cr_assert_eq(g3->offset, g2->offset);
	assert_allocation_fd(fd, g3->allocation_size);
	close(fd);

	/* Released all: the next grant carries it again. */
	cr_assert_eq(release(&p, g1->info->id), 0);
	cr_assert_eq(release(&p, g2->info->id), 0);
	Bufbroker__Response *r4 = open_id(&p, g2->info->id, &fd);
	cr_assert(grant_of(r4)->allocation_fd);
	assert_allocation_fd(fd, g1->allocation_size);
	close(fd);

	check_clean(&p);
	bufbroker__response__free_unpacked(r1, NULL);
	bufbroker__response__free_unpacked(r2, NULL);
	bufbroker__response__free_unpacked(r3, NULL);
	bufbroker__response__free_unpacked(r4, NULL);
	close(p.sock);
	close(q.sock);
	bbt_stop_clean(d);
}

Test(vmm_wire, a_legacy_grant_carries_an_ipc_handle_and_no_fd)
{
	bbt_daemon *d = start(true, NULL);
	peer p = connect_new(d);
	int fd;
	Bufbroker__Response *r =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_DEFAULT, &fd);
	const Bufbroker__Grant *g = grant_of(r);
	cr_assert_eq(g->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_LEGACY,
		     "the built-in default is legacy");
	cr_assert_eq(g->ipc_handle.len, 64);
	cr_assert(!g->allocation_fd);
	cr_assert_eq(g->allocation_size, 0);
	cr_assert_eq(fd, -1);
	Bufbroker__Response *s = stat_id(&p, g->info->id);
	cr_assert_eq(s->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_LEGACY);
	bufbroker__response__free_unpacked(s, NULL);
	bufbroker__response__free_unpacked(r, NULL);
	close(p.sock);
	bbt_stop_clean(d);
}

Test(vmm_wire, the_daemons_default_and_auto_give_vmm_where_the_device_exports_fds)
{
	const char *flags[] = {"--cuda-handle", "vmm", NULL};
	bbt_daemon *d = start(true, flags);
	peer p = connect_new(d);
	Bufbroker__Response *r =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_DEFAULT, NULL);
	cr_assert_eq(grant_of(r)->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM);
	Bufbroker__Response *s = stat_id(&p, r->grant->info->id);
	cr_assert_eq(s->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM);
	Bufbroker__Response *a =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_AUTO, NULL);
	cr_assert_eq(grant_of(a)->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM);
	vmm_dev v = device0(&p);
	cr_assert(v.vmm, "%s", v.why);
	cr_assert_eq(v.allocations, 1);
	bufbroker__response__free_unpacked(r, NULL);
	bufbroker__response__free_unpacked(s, NULL);
	bufbroker__response__free_unpacked(a, NULL);
	close(p.sock);
	bbt_stop_clean(d);
}

/* ---- the fd maps the bytes, across processes -------------------------------------- */

/* Import the allocation behind fd on the device with uuid, map it whole
 * and grant access, as PROTOCOL.md says a client does: the mapping's base,
 * or 0 on failure (the step in *step). */
static CUdeviceptr vmm_map(bb_cuda *api, int fd, uint64_t allocation_size,
			   const unsigned char uuid[16], int *step)
{
	char err[256];
	int n = 0;
	CUdevice dev = -1;
	CUcontext ctx;
	CUmemGenericAllocationHandle h;
	CUdeviceptr base = 0;
	*step = 10;
	if (bb_cuda_load(api, err, sizeof(err)) != 0 || api->DeviceGetCount(&n) != CUDA_SUCCESS)
		return 0;
	*step = 11;
	for (int i = 0; i < n; i++) {
		CUdevice d;
		CUuuid u;
		if (api->DeviceGet(&d, i) == CUDA_SUCCESS &&
		    api->DeviceGetUuid(&u, d) == CUDA_SUCCESS && memcmp(u.bytes, uuid, 16) == 0)
			dev = d;
	}
	if (dev < 0 || api->DevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
	    api->CtxSetCurrent(ctx) != CUDA_SUCCESS)
		return 0;
	*step = 12;
	if (api->MemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
					      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) !=
	    CUDA_SUCCESS)
		return 0;
	*step = 13;
	if (api->MemAddressReserve(&base, allocation_size, 0, 0, 0) != CUDA_SUCCESS)
		return 0;
	*step = 14;
	if (api->MemMap(base, allocation_size, 0, h, 0) != CUDA_SUCCESS)
		return 0;
	CUmemAccessDesc acc;
	memset(&acc, 0, sizeof(acc));
	acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	acc.location.id = dev;
	acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	*step = 15;
	if (api->MemSetAccess(base, allocation_size, &acc, 1) != CUDA_SUCCESS)
		return 0;
	*step = 0;
	return base;
}

typedef struct mapper_arg {
	const char *sock;
	int chan;   /* the child's end: tokens go out (producer) or come in (consumer) */
	bool write; /* producer: write the pattern; consumer: check it */
} mapper_arg;

#define PATTERN_BYTES 65536u
#define PATTERN_SEED 0x766d6du

/* Producer: a VMM buffer (the second in its slab, so its offset is not 0),
 * the pattern written through its own mapping, SetReady, and a token for
 * the parent. Consumer: adopt the token the parent passes, map the fd that
 * came with the grant, and check the pattern. Exit codes name the step. */
static int mapper(void *arg)
{
	mapper_arg *m = arg;
	int sock = bbt_raw_connect(m->sock), fd = -1, step;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *resp;
	static unsigned char buf[PATTERN_BYTES];
	bb_cuda api;
	if (sock < 0)
		return 1;
	if (hello_minor(sock, 2))
		return 2;
	if (m->write) {
		Bufbroker__Alloc a = BUFBROKER__ALLOC__INIT;
		a.size = PATTERN_BYTES;
		a.kind = BUFBROKER__KIND__KIND_CUDA;
		a.share = BB_SHARE_ANY;
		a.cuda_handle = BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM;
		req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
		req.alloc = &a;
		for (int i = 0; i < 2; i++) {
			int got = -1;
			req.id = 2 + (uint64_t)i;
			if (bbt_raw_send(sock, &req, -1) ||
			    bbt_raw_recv(sock, 5000, &resp, &got) != 1)
				return 3;
			if (!resp->status || resp->status->code || !resp->grant)
				return 4;
			if (i == 0) {
				fd = got; /* the first grant brought the fd */
				bufbroker__response__free_unpacked(resp, NULL);
			} else if (got >= 0) {
				return 5;
			}
		}
	} else {
		unsigned char tok[BB_TOKEN_SIZE];
		if (bbt_recv(m->chan, tok, sizeof(tok), 10000))
			return 3;
		Bufbroker__Adopt ad = BUFBROKER__ADOPT__INIT;
		ad.token.data = tok;
		ad.token.len = sizeof(tok);
		req.id = 2;
		req.op_case = BUFBROKER__REQUEST__OP_ADOPT;
		req.adopt = &ad;
		if (bbt_raw_send(sock, &req, -1) || bbt_raw_recv(sock, 5000, &resp, &fd) != 1)
			return 4;
		if (!resp->status || resp->status->code || !resp->grant ||
		    !resp->grant->allocation_fd || fd < 0)
			return 5;
	}
	const Bufbroker__Grant *g = resp->grant;
	if (g->offset == 0 || g->offset + PATTERN_BYTES > g->allocation_size)
		return 6;
	CUdeviceptr base = vmm_map(&api, fd, g->allocation_size, g->device_uuid.data, &step);
	if (!base)
		return step;
	close(fd); /* the import keeps the allocation */
	if (m->write) {
		bbt_fill(buf, sizeof(buf), PATTERN_SEED);
		if (api.MemcpyHtoD(base + g->offset, buf, sizeof(buf)) != CUDA_SUCCESS)
			return 20;
		Bufbroker__SetReady sr = BUFBROKER__SET_READY__INIT;
		Bufbroker__Take t = BUFBROKER__TAKE__INIT;
		sr.id = g->info->id;
		t.id = g->info->id;
		Bufbroker__Request r2 = BUFBROKER__REQUEST__INIT;
		r2.id = 10;
		r2.op_case = BUFBROKER__REQUEST__OP_SET_READY;
		r2.set_ready = &sr;
		Bufbroker__Response *a2;
		if (bbt_raw_send(sock, &r2, -1) || bbt_raw_recv(sock, 5000, &a2, NULL) != 1 ||
		    a2->status->code)
			return 21;
		bufbroker__response__free_unpacked(a2, NULL);
		r2.id = 11;
		r2.op_case = BUFBROKER__REQUEST__OP_TAKE;
		r2.take = &t;
		if (bbt_raw_send(sock, &r2, -1) || bbt_raw_recv(sock, 5000, &a2, NULL) != 1 ||
		    a2->status->code || a2->take->token.len != BB_TOKEN_SIZE)
			return 22;
		if (bbt_send(m->chan, a2->take->token.data, BB_TOKEN_SIZE))
			return 23;
		bufbroker__response__free_unpacked(a2, NULL);
	} else {
		memset(buf, 0, sizeof(buf));
		if (api.MemcpyDtoH(buf, base + g->offset, sizeof(buf)) != CUDA_SUCCESS)
			return 20;
		if (!bbt_check(buf, sizeof(buf), PATTERN_SEED))
			return 21;
	}
	bufbroker__response__free_unpacked(resp, NULL);
	close(sock);
	return 0;
}

Test(vmm_wire, the_fd_a_grant_carries_maps_the_bytes_another_process_wrote)
{
	bbt_daemon *d = start(true, NULL);
	bbt_chan ch;
	bbt_chan_open(&ch);
	mapper_arg pa = {.sock = d->sock, .chan = ch.fd[1], .write = true};
	mapper_arg ca = {.sock = d->sock, .chan = ch.fd[1], .write = false};
	pid_t prod = bbt_spawn(mapper, &pa);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(bbt_recv(ch.fd[0], tok, sizeof(tok), bbt_ms(10000)), 0,
		     "no token from the producer");
	cr_assert_eq(bbt_join(prod, 10000), 0, "the producer failed");
	pid_t cons = bbt_spawn(mapper, &ca);
	cr_assert_eq(bbt_send(ch.fd[0], tok, sizeof(tok)), 0);
	cr_assert_eq(bbt_join(cons, 10000), 0, "the consumer failed");
	bbt_chan_close(&ch);
	bbt_stop_clean(d);
}

/* ---- AllocationFd ------------------------------------------------------------------ */

Test(vmm_wire, allocation_fd_sends_the_fd_again_while_a_buffer_of_it_is_held)
{
	bbt_daemon *d = start(true, NULL);
	peer p = connect_new(d), q = connect_new(d);
	Bufbroker__Response *r =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, NULL);
	const Bufbroker__Grant *g = grant_of(r);
	int fd;

	Bufbroker__Response *a = allocation_fd(&p, g->allocation, &fd);
	cr_assert_eq(code_of(a), 0, "%s", a->status->message);
	cr_assert_eq(a->result_case, BUFBROKER__RESPONSE__RESULT_ALLOCATION_FD);
	cr_assert_eq(a->allocation_fd->allocation, g->allocation);
	cr_assert_eq(a->allocation_fd->allocation_size, g->allocation_size);
	cr_assert_eq(a->allocation_fd->device_uuid.len, 16);
	cr_assert_eq(memcmp(a->allocation_fd->device_uuid.data, g->device_uuid.data, 16), 0);
	assert_allocation_fd(fd, g->allocation_size);
	close(fd);
	bufbroker__response__free_unpacked(a, NULL);

	/* Not to a connection that holds none of it, nor for no allocation. */
	a = allocation_fd(&q, g->allocation, &fd);
	cr_assert_eq(code_of(a), BB_ERR_NOT_FOUND);
	cr_assert_eq(fd, -1);
	cr_assert(strstr(a->status->message, "holds no buffer in VMM allocation"), "%s",
		  a->status->message);
	bufbroker__response__free_unpacked(a, NULL);
	a = allocation_fd(&p, g->allocation + 1000, &fd);
	cr_assert_eq(code_of(a), BB_ERR_NOT_FOUND);
	bufbroker__response__free_unpacked(a, NULL);
	cr_assert_eq(release(&p, g->info->id), 0);
	a = allocation_fd(&p, g->allocation, &fd);
	cr_assert_eq(code_of(a), BB_ERR_NOT_FOUND, "released: it holds none any more");
	cr_assert_eq(fd, -1);
	bufbroker__response__free_unpacked(a, NULL);
	bufbroker__response__free_unpacked(r, NULL);
	close(p.sock);
	close(q.sock);
	bbt_stop_clean(d);
}

/* ---- what cannot be had -------------------------------------------------------------- */

/* On d, where VMM cannot be had: an Alloc asking for VMM is refused with
 * refusal (the whole message), one asking for other (AUTO, or DEFAULT
 * where the default is auto) gets a legacy buffer, and ServerStatus says
 * why (why_part in vmm_unavailable). Stops d. */
static void vmm_unavailable(bbt_daemon *d, Bufbroker__CudaHandle other, const char *refusal,
			    const char *why_part)
{
	peer p = connect_new(d);
	Bufbroker__Response *r =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, NULL);
	cr_assert_eq(code_of(r), BB_ERR_UNSUPPORTED);
	cr_assert_str_eq(r->status->message, refusal);
	bufbroker__response__free_unpacked(r, NULL);
	r = alloc_cuda(&p, 4096, other, NULL);
	cr_assert_eq(grant_of(r)->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_LEGACY);
	bufbroker__response__free_unpacked(r, NULL);
	vmm_dev v = device0(&p);
	cr_assert(!v.vmm);
	cr_assert(strstr(v.why, why_part), "%s", v.why);
	close(p.sock);
	bbt_stop_clean(d);
}

Test(vmm_wire, a_forbidden_kind_is_refused_with_the_key_and_auto_takes_the_other)
{
	const char *flags[] = {"--cuda-forbid", "vmm", NULL};
	vmm_unavailable(start(true, flags), BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_AUTO,
			"VMM CUDA buffers are forbidden by the operator of this daemon "
			"(cuda-forbid = vmm)",
			"cuda-forbid = vmm");

	const char *legacy[] = {"--cuda-handle", "vmm", "--cuda-forbid", "legacy", NULL};
	bbt_daemon *d = start(true, legacy);
	peer p = connect_new(d);
	Bufbroker__Response *r =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_LEGACY, NULL);
	cr_assert_eq(code_of(r), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(r->status->message, "cuda-forbid = legacy"), "%s", r->status->message);
	bufbroker__response__free_unpacked(r, NULL);
	close(p.sock);
	bbt_stop_clean(d);
}

Test(vmm_wire, a_device_without_fd_export_refuses_vmm_and_says_so)
{
	vmm_unavailable(start(false, NULL), BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_AUTO,
			"VMM CUDA buffers cannot be had on device 0: device 0 cannot export "
			"allocations as file descriptors "
			"(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 0)",
			"POSIX_FILE_DESCRIPTOR_SUPPORTED");
}

Test(vmm_wire, a_driver_without_the_vmm_calls_refuses_vmm_naming_what_it_lacks)
{
	const char *novmm = getenv("BB_FAKECUDA_NOVMM");
	cr_assert(novmm && novmm[0], "BB_FAKECUDA_NOVMM is not set (ctest sets it)");
	fake_env(true);
	setenv("BUFBROKER_CUDA_LIBRARY", novmm, 1);
	const char *args[] = {"--cuda-handle", "auto", NULL};
	char want[512];
	snprintf(want, sizeof(want),
		 "VMM CUDA buffers cannot be had on device 0: the CUDA driver %s lacks "
		 "cuMemCreate (too old for VMM allocations)",
		 novmm);
	/* The default, auto, is legacy there. */
	vmm_unavailable(bbt_start(args), BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_DEFAULT, want,
			"too old for VMM allocations");
}

Test(vmm_wire, a_host_buffer_with_a_cuda_handle_is_invalid)
{
	bbt_daemon *d = start(true, NULL);
	peer p = connect_new(d);
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Alloc a = BUFBROKER__ALLOC__INIT;
	a.size = 4096;
	a.kind = BUFBROKER__KIND__KIND_HOST;
	a.cuda_handle = BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &a;
	Bufbroker__Response *r = call(&p, &req, NULL);
	cr_assert_eq(code_of(r), BB_ERR_INVALID);
	cr_assert(strstr(r->status->message, "CUDA buffers only"), "%s", r->status->message);
	bufbroker__response__free_unpacked(r, NULL);
	close(p.sock);
	bbt_stop_clean(d);
}

/* ---- a 1.1 client ---------------------------------------------------------------------- */

Test(vmm_wire, an_old_client_gets_legacy_and_a_clear_refusal_for_vmm_losing_nothing)
{
	const char *flags[] = {"--cuda-handle", "vmm", NULL};
	bbt_daemon *d = start(true, flags);
	peer now = connect_new(d), old = connect_minor(d, 1);

	/* Its Alloc names no kind: legacy, whatever the daemon's default. */
	Bufbroker__Response *r =
		alloc_cuda(&old, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_DEFAULT, NULL);
	cr_assert_eq(grant_of(r)->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_LEGACY);
	cr_assert_eq(r->grant->ipc_handle.len, 64);
	bufbroker__response__free_unpacked(r, NULL);

	Bufbroker__Response *v =
		alloc_cuda(&now, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_DEFAULT, NULL);
	uint64_t id = grant_of(v)->info->id;
	cr_assert_eq(v->grant->info->cuda_handle, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM);

	int fd;
	r = open_id(&old, id, &fd);
	cr_assert_eq(code_of(r), BB_ERR_UNSUPPORTED);
	cr_assert_eq(fd, -1);
	char want[200];
	snprintf(want, sizeof(want),
		 "buffer %llu is a VMM CUDA buffer, which needs protocol 1.2 (this client speaks "
		 "1.1): upgrade libbufbroker",
		 (unsigned long long)id);
	cr_assert_str_eq(r->status->message, want);
	bufbroker__response__free_unpacked(r, NULL);
	Bufbroker__Response *s = stat_id(&now, id);
	cr_assert_eq(s->info->refs, 1, "the refused Open took no count");
	bufbroker__response__free_unpacked(s, NULL);

	/* A token of it stays live for a client that can map it. */
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Take t = BUFBROKER__TAKE__INIT;
	t.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_TAKE;
	req.take = &t;
	Bufbroker__Response *tk = call(&now, &req, NULL);
	cr_assert_eq(code_of(tk), 0, "%s", tk->status->message);
	Bufbroker__Request ar = BUFBROKER__REQUEST__INIT;
	Bufbroker__Adopt ad = BUFBROKER__ADOPT__INIT;
	ad.token = tk->take->token;
	ar.op_case = BUFBROKER__REQUEST__OP_ADOPT;
	ar.adopt = &ad;
	r = call(&old, &ar, &fd);
	cr_assert_eq(code_of(r), BB_ERR_UNSUPPORTED);
	cr_assert_str_eq(r->status->message, want);
	bufbroker__response__free_unpacked(r, NULL);
	peer other = connect_new(d);
	r = call(&other, &ar, &fd);
	cr_assert_eq(grant_of(r)->info->id, id, "the token was still live");
	cr_assert(r->grant->allocation_fd);
	close(fd);
	bufbroker__response__free_unpacked(r, NULL);
	bufbroker__response__free_unpacked(tk, NULL);
	bufbroker__response__free_unpacked(v, NULL);
	check_clean(&now);
	close(now.sock);
	close(old.sock);
	close(other.sock);
	bbt_stop_clean(d);
}

Test(vmm_wire, an_old_client_where_legacy_is_forbidden_is_told_to_upgrade)
{
	const char *flags[] = {"--cuda-handle", "vmm", "--cuda-forbid", "legacy", NULL};
	bbt_daemon *d = start(true, flags);
	peer old = connect_minor(d, 1);
	Bufbroker__Response *r =
		alloc_cuda(&old, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_DEFAULT, NULL);
	cr_assert_eq(code_of(r), BB_ERR_UNSUPPORTED);
	cr_assert_str_eq(r->status->message,
			 "legacy CUDA IPC buffers are forbidden by the operator of this daemon "
			 "(cuda-forbid = legacy); this client speaks protocol 1.1, which maps "
			 "legacy CUDA buffers only: upgrade libbufbroker");
	bufbroker__response__free_unpacked(r, NULL);
	close(old.sock);
	bbt_stop_clean(d);
}

/* ---- lifetimes and limits -------------------------------------------------------------- */

typedef struct holder_arg {
	const char *sock;
	int report; /* the child writes its allocation count here, then waits */
} holder_arg;

/* A client that allocates a VMM buffer larger than a slab (a dedicated
 * allocation) and one in a slab, says so, and waits to be killed. */
static int holder(void *arg)
{
	holder_arg *h = arg;
	int sock = bbt_raw_connect(h->sock);
	if (sock < 0)
		return 1;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Alloc a = BUFBROKER__ALLOC__INIT;
	Bufbroker__Response *resp;
	if (hello_minor(sock, 2))
		return 2;
	uint64_t sizes[2] = {12 * MIB, 4096};
	for (int i = 0; i < 2; i++) {
		a.size = sizes[i];
		a.kind = BUFBROKER__KIND__KIND_CUDA;
		a.cuda_handle = BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM;
		req.id = 2 + (uint64_t)i;
		req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
		req.alloc = &a;
		int fd = -1;
		if (bbt_raw_send(sock, &req, -1) || bbt_raw_recv(sock, 5000, &resp, &fd) != 1)
			return 3;
		int ok = resp->status && resp->status->code == 0 && fd >= 0;
		bufbroker__response__free_unpacked(resp, NULL);
		if (!ok)
			return 4;
	}
	char c = 'k';
	if (bbt_send(h->report, &c, 1))
		return 5;
	for (;;)
		pause();
}

Test(vmm_wire, a_killed_holders_vmm_allocations_are_freed)
{
	bbt_daemon *d = start(true, NULL);
	peer p = connect_new(d);
	cr_assert_eq(bbt_daemon_memfds(d), 0);
	bbt_chan ch;
	bbt_chan_open(&ch);
	holder_arg h = {.sock = d->sock, .report = ch.fd[1]};
	pid_t pid = bbt_spawn(holder, &h);
	char c;
	cr_assert_eq(bbt_recv(ch.fd[0], &c, 1, bbt_ms(10000)), 0, "the holder did not allocate");
	cr_assert_eq(device0(&p).allocations, 2, "a dedicated allocation and a slab");
	/* The fake's VMM allocations are memfds: the daemon keeps each one's
	 * exported fd (and the fake its own). */
	cr_assert_geq(bbt_daemon_memfds(d), 2, "the two allocations' fds");
	kill(pid, SIGKILL);
	cr_assert_eq(bbt_join(pid, 5000), 128 + SIGKILL);
	uint64_t last;
	cr_assert(vmm_allocations_until(&p, 0, 5000, &last), "%llu VMM allocations left",
		  (unsigned long long)last);
	cr_assert_eq(device0(&p).reserved, 0, "--cuda-cache-bytes 0: nothing kept");
	cr_assert_eq(bbt_daemon_memfds(d), 0, "the allocations' fds are closed");
	check_clean(&p);
	bbt_chan_close(&ch);
	close(p.sock);
	bbt_stop_clean(d);
}

Test(vmm_wire, limits_apply_to_vmm_buffers_as_to_legacy_ones)
{
	const char *flags[] = {"--uid-cuda-bytes", "20M", "--max-cuda-vmm-allocations", "2", NULL};
	bbt_daemon *d = start(true, flags);
	peer p = connect_new(d);
	/* Per-uid bytes: both kinds count together. */
	Bufbroker__Response *l =
		alloc_cuda(&p, 10 * MIB, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_LEGACY, NULL);
	grant_of(l);
	Bufbroker__Response *r =
		alloc_cuda(&p, 12 * MIB, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, NULL);
	cr_assert_eq(code_of(r), BB_ERR_NO_MEMORY);
	cr_assert(strstr(r->status->message, "(--uid-cuda-bytes)"), "%s", r->status->message);
	bufbroker__response__free_unpacked(r, NULL);
	cr_assert_eq(release(&p, l->grant->info->id), 0);
	bufbroker__response__free_unpacked(l, NULL);

	/* VMM allocations (their fds): two dedicated ones, not a third. */
	Bufbroker__Response *a =
		alloc_cuda(&p, 9 * MIB, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, NULL);
	grant_of(a);
	Bufbroker__Response *b =
		alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, NULL);
	grant_of(b);
	r = alloc_cuda(&p, 4096, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, NULL);
	cr_assert_eq(grant_of(r)->allocation, b->grant->allocation, "the slab has room");
	bufbroker__response__free_unpacked(r, NULL);
	r = alloc_cuda(&p, 9 * MIB, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, NULL);
	cr_assert_eq(code_of(r), BB_ERR_NO_MEMORY);
	cr_assert(strstr(r->status->message, "(--max-cuda-vmm-allocations)"), "%s",
		  r->status->message);
	bufbroker__response__free_unpacked(r, NULL);
	cr_assert_eq(release(&p, a->grant->info->id), 0);
	r = alloc_cuda(&p, 9 * MIB, BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM, NULL);
	grant_of(r);
	bufbroker__response__free_unpacked(r, NULL);
	bufbroker__response__free_unpacked(a, NULL);
	bufbroker__response__free_unpacked(b, NULL);
	check_clean(&p);
	close(p.sock);
	bbt_stop_clean(d);
}
