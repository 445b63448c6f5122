/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The CUDA backend's VMM slabs and the choice of a buffer's handle kind
 * (daemon/backend_cuda.h): a VMM slab is a cuMemCreate allocation whose
 * POSIX fd the backend exports once and keeps, carved by the same extents
 * as a legacy slab but never shared with one; freeing it closes the fd and
 * releases the allocation; their number is bounded (each is an fd); DEFAULT
 * is the configured kind, AUTO follows the device, and a kind that cannot
 * be had is refused with why, never replaced by the other. A broker over
 * the backend journals where each VMM buffer lies (its allocation, offset
 * and the allocation's size) as the backend said once, when the buffer was
 * made, with every put of it.
 *
 * The backend runs on tests/fakecuda's driver ($BB_FAKECUDA, else the
 * libfakecuda.so built next to this binary), whose VMM allocations are
 * memfds: the fd the backend keeps is a real file descriptor. Jobs run when
 * the test says, as in test_cuda_extents.c.
 */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../../daemon/backend_cuda.c"
#include "../../daemon/broker.h"
#include "../../daemon/journal.h"
#include "../../daemon/log.c"
#include "cuda_fixture.h"

#define UID 1000
#define MiB (1024ull * 1024)

static void setup(void)
{
	fake_setup("cuda-vmm");
	unsetenv("FAKECUDA_VMM_FD");
}

/* A backend with 8 MiB slabs, no cache, and the given handle policy. */
static void start_with(int handle_default, int handle_forbid, uint64_t vmm_allocations)
{
	backend_cuda_config cfg;
	backend_cuda_config_default(&cfg);
	cfg.slab_bytes = 8 * MiB;
	cfg.cache_bytes = 0;
	cfg.handle_default = handle_default;
	cfg.handle_forbid = handle_forbid;
	cfg.vmm_allocations = vmm_allocations;
	be = backend_cuda_new(&cfg, err, sizeof(err));
	cr_assert_not_null(be, "backend_cuda_new: %s", err);
	be->submit = queue_job;
}

static void start(void)
{
	start_with(BB_CUDA_HANDLE_LEGACY, 0, BACKEND_CUDA_VMM_ALLOCATIONS_DEFAULT);
}

TestSuite(cuda_vmm, .init = setup, .fini = teardown);

static cuda_backend *cub(void)
{
	return be->ctx;
}

/* Alloc size bytes asking for handle, running jobs while the backend
 * grows: the code, with *got the kind given. */
static int try_alloc(uint64_t size, int handle, int *got, backend_mem *m)
{
	int rc;
	*got = handle;
	memset(m, 0, sizeof(*m));
	while ((rc = be->alloc(be, size, 0, UID, BB_SHARE_UID, got, m, err, sizeof(err))) ==
	       BACKEND_GROW)
		cr_assert(run_one(), "alloc waits for a grow but no job is queued");
	return rc;
}

static backend_mem alloc_kind(uint64_t size, int handle, int want)
{
	backend_mem m;
	int got;
	int rc = try_alloc(size, handle, &got, &m);
	cr_assert_eq(rc, 0, "alloc of %llu bytes: %s", (unsigned long long)size, err);
	cr_assert_eq(got, want, "asked %d, got handle kind %d", handle, got);
	return m;
}

static slab *slab_of(const backend_mem *m)
{
	return ((const extent *)m->priv)->slab;
}

static bool fd_open(int fd)
{
	return fd >= 0 && fcntl(fd, F_GETFD) >= 0;
}

/* ---- VMM slabs ---------------------------------------------------------------------- */

Test(cuda_vmm, a_vmm_buffer_lies_in_a_slab_whose_fd_is_exported_once)
{
	start();
	backend_mem a = alloc_kind(4096, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	backend_mem b = alloc_kind(4096, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	slab *s = slab_of(&a);
	cr_assert_eq(slab_of(&b), s, "the second buffer is carved from the same slab");
	cr_assert(fd_open(s->fd), "the slab keeps its exported fd");
	struct stat st;
	cr_assert_eq(fstat(s->fd, &st), 0);
	cr_assert_eq(s->size, 8 * MiB);
	cr_assert_eq(s->size % cub()->devs[0].vmm_unit, 0);

	backend_export ex;
	memset(&ex, 0, sizeof(ex));
	cr_assert_eq(be->export_mem(be, &b, &ex, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(ex.cuda_handle, BB_CUDA_HANDLE_VMM);
	cr_assert_eq(ex.fd, s->fd);
	cr_assert_eq(ex.has_ipc, 0);
	cr_assert_eq(ex.allocation, s->allocation);
	cr_assert_eq(ex.allocation_size, s->size);
	cr_assert_eq(ex.offset, BACKEND_CUDA_ALIGN * 16, "4096 bytes after the first buffer");
	cr_assert_eq(be->fd_allocation(be, &b), s->allocation);
	cr_assert_eq(cub()->vmm_allocations, 1);

	memset(&ex, 0, sizeof(ex));
	cr_assert_eq(be->export_allocation(be, s->allocation, &ex, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(ex.fd, s->fd);
	cr_assert_eq(ex.allocation_size, s->size);
	be->free(be, &a);
	be->free(be, &b);
}

Test(cuda_vmm, vmm_and_legacy_buffers_never_share_a_slab)
{
	start();
	backend_mem l = alloc_kind(4096, BB_CUDA_HANDLE_LEGACY, BB_CUDA_HANDLE_LEGACY);
	backend_mem v = alloc_kind(4096, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	cr_assert_neq(slab_of(&l), slab_of(&v));
	cr_assert_eq(slab_of(&l)->fd, -1);
	cr_assert_eq(be->fd_allocation(be, &l), 0, "a legacy buffer's grant carries no fd");
	backend_export ex;
	memset(&ex, 0, sizeof(ex));
	cr_assert_eq(be->export_mem(be, &l, &ex, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(ex.cuda_handle, BB_CUDA_HANDLE_LEGACY);
	cr_assert_eq(ex.has_ipc, 1);
	cr_assert_eq(ex.fd, -1);
	be->free(be, &l);
	be->free(be, &v);
}

Test(cuda_vmm, freeing_the_last_buffer_closes_the_fd_and_releases_the_slab)
{
	start();
	backend_mem m = alloc_kind(12 * MiB, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	slab *s = slab_of(&m);
	int fd = s->fd;
	uint64_t allocation = s->allocation;
	cr_assert(s->dedicated);
	cr_assert_eq(s->size, 12 * MiB, "a dedicated slab is whole granules");
	drain();
	cr_assert_eq(cub()->devs[0].reserved, 12 * MiB);
	be->free(be, &m);
	drain();
	cr_assert(!fd_open(fd), "the slab's fd is closed");
	cr_assert_eq(cub()->devs[0].reserved, 0);
	cr_assert_eq(cub()->vmm_allocations, 0);
	cr_assert_eq(cub()->devs[0].vmm_allocations, 0);
	backend_export ex;
	cr_assert_eq(be->export_allocation(be, allocation, &ex, err, sizeof(err)),
		     BB_ERR_NOT_FOUND);
}

Test(cuda_vmm, vmm_allocations_are_bounded_and_cached_ones_make_room)
{
	start_with(BB_CUDA_HANDLE_LEGACY, 0, 1);
	backend_mem a = alloc_kind(12 * MiB, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	backend_mem b;
	int got;
	cr_assert_eq(try_alloc(12 * MiB, BB_CUDA_HANDLE_VMM, &got, &b), BB_ERR_NO_MEMORY);
	cr_assert(strstr(err, "would hold 2 VMM CUDA allocations") &&
			  strstr(err, "the limit is 1 (--max-cuda-vmm-allocations)"),
		  "%s", err);
	/* Legacy buffers need no fd: not bounded by it. */
	backend_mem l = alloc_kind(4096, BB_CUDA_HANDLE_LEGACY, BB_CUDA_HANDLE_LEGACY);
	be->free(be, &l);
	be->free(be, &a);
	drain();
	b = alloc_kind(12 * MiB, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	be->free(be, &b);
}

/* ---- the handle kind ------------------------------------------------------------------ */

Test(cuda_vmm, default_is_the_configured_kind)
{
	start();
	backend_mem m = alloc_kind(4096, BB_CUDA_HANDLE_DEFAULT, BB_CUDA_HANDLE_LEGACY);
	be->free(be, &m);
	drain();
	be->destroy(be);
	be = NULL;
	start_with(BB_CUDA_HANDLE_VMM, 0, 16);
	m = alloc_kind(4096, BB_CUDA_HANDLE_DEFAULT, BB_CUDA_HANDLE_VMM);
	be->free(be, &m);
}

Test(cuda_vmm, auto_is_vmm_where_the_device_exports_fds)
{
	start();
	cr_assert(cub()->devs[0].vmm, "%s", cub()->devs[0].vmm_why);
	backend_mem m = alloc_kind(4096, BB_CUDA_HANDLE_AUTO, BB_CUDA_HANDLE_VMM);
	be->free(be, &m);
}

Test(cuda_vmm, auto_is_legacy_where_vmm_is_forbidden)
{
	start_with(BB_CUDA_HANDLE_LEGACY, BB_CUDA_HANDLE_VMM, 16);
	backend_mem m = alloc_kind(4096, BB_CUDA_HANDLE_AUTO, BB_CUDA_HANDLE_LEGACY);
	be->free(be, &m);
	int got;
	cr_assert_eq(try_alloc(4096, BB_CUDA_HANDLE_VMM, &got, &m), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(err, "forbidden by the operator") && strstr(err, "cuda-forbid = vmm"),
		  "%s", err);
	cr_assert_eq(got, BACKEND_HANDLE_REFUSED, "the caller learns it was the kind");
}

Test(cuda_vmm, legacy_forbidden_is_refused_never_replaced)
{
	start_with(BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_LEGACY, 16);
	backend_mem m;
	int got;
	cr_assert_eq(try_alloc(4096, BB_CUDA_HANDLE_LEGACY, &got, &m), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(err, "cuda-forbid = legacy"), "%s", err);
	cr_assert_eq(got, BACKEND_HANDLE_REFUSED, "the caller learns it was the kind");
	m = alloc_kind(4096, BB_CUDA_HANDLE_AUTO, BB_CUDA_HANDLE_VMM);
	be->free(be, &m);
}

Test(cuda_vmm, a_device_that_cannot_export_fds_refuses_vmm_and_auto_is_legacy)
{
	setenv("FAKECUDA_VMM_FD", "0", 1);
	start();
	cr_assert(!cub()->devs[0].vmm);
	backend_mem m;
	int got;
	cr_assert_eq(try_alloc(4096, BB_CUDA_HANDLE_VMM, &got, &m), BB_ERR_UNSUPPORTED);
	cr_assert_eq(got, BACKEND_HANDLE_REFUSED, "the caller learns it was the kind");
	cr_assert(strstr(err, "device 0 cannot export allocations as file descriptors") &&
			  strstr(err, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_"
				      "SUPPORTED"),
		  "%s", err);
	m = alloc_kind(4096, BB_CUDA_HANDLE_AUTO, BB_CUDA_HANDLE_LEGACY);
	be->free(be, &m);
	backend_device d;
	cr_assert_eq(be->devices(be, &d, 1), 1);
	cr_assert_eq(d.vmm, 0);
	cr_assert(strstr(d.vmm_why, "cannot export allocations"), "%s", d.vmm_why);
}

Test(cuda_vmm, a_policy_whose_default_is_forbidden_is_refused)
{
	backend_cuda_config cfg;
	char why[128];
	backend_cuda_config_default(&cfg);
	cr_assert_eq(backend_cuda_handles_check(&cfg, why, sizeof(why)), 0, "%s", why);
	cfg.handle_forbid = BB_CUDA_HANDLE_LEGACY;
	cr_assert_eq(backend_cuda_handles_check(&cfg, why, sizeof(why)), -1);
	cr_assert_str_eq(why, "cuda-handle = legacy is forbidden by cuda-forbid = legacy");
	cfg.handle_default = BB_CUDA_HANDLE_AUTO;
	cr_assert_eq(backend_cuda_handles_check(&cfg, why, sizeof(why)), 0, "%s", why);
}

/* ---- the check ------------------------------------------------------------------------ */

Test(cuda_vmm, the_check_finds_a_vmm_allocation_that_lost_its_fd)
{
	start();
	char report[512];
	backend_mem v = alloc_kind(4096, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	backend_mem l = alloc_kind(4096, BB_CUDA_HANDLE_LEGACY, BB_CUDA_HANDLE_LEGACY);
	cr_assert_eq(be->check(be, report, sizeof(report)), 0, "%s", report);
	slab *s = slab_of(&v);
	int fd = s->fd;
	s->fd = dup(fd);
	close(s->fd); /* the number the slab keeps is no open file */
	cr_assert_eq(be->check(be, report, sizeof(report)), 1, "%s", report);
	char want[96];
	snprintf(want, sizeof(want), "VMM CUDA allocation %llu has no open fd",
		 (unsigned long long)s->allocation);
	cr_assert(strstr(report, want), "%s", report);
	s->fd = fd;
	cr_assert_eq(be->check(be, report, sizeof(report)), 0, "%s", report);
	be->free(be, &v);
	be->free(be, &l);
	drain();
	cr_assert_eq(be->check(be, report, sizeof(report)), 0, "%s", report);
}

/* ---- a restart: adopting kept allocations ------------------------------------------- */

static int adopt(int fd, uint64_t allocation, uint64_t offset, uint64_t size, uint32_t uid,
		 backend_mem *m)
{
	backend_carved c = {.allocation = allocation,
			    .allocation_size = 8 * MiB,
			    .offset = offset,
			    .size = size,
			    .device = 0,
			    .uid = uid,
			    .share = BB_SHARE_UID};
	memset(m, 0, sizeof(*m));
	return be->adopt_carved(be, fd, &c, m, err, sizeof(err));
}

Test(cuda_vmm, a_kept_allocation_is_imported_and_its_buffers_ranges_rebuilt)
{
	start();
	/* What a daemon made before it died: two buffers of one slab, whose
	 * fd the store kept (a dup). */
	backend_mem a = alloc_kind(4096, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	backend_mem b = alloc_kind(8192, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	slab *s = slab_of(&a);
	uint64_t id = s->allocation, oa = ((extent *)a.priv)->off, ob = ((extent *)b.priv)->off;
	int kept = fcntl(s->fd, F_DUPFD_CLOEXEC, 3);
	be->free(be, &a);
	be->free(be, &b);
	drain();
	cr_assert_eq(cub()->vmm_allocations, 0);
	be->allocation_floor(be, 1ull << 40);

	backend_mem ra, rb, x;
	cr_assert_eq(adopt(kept, id, ob, 8192, UID, &rb), 0, "%s", err);
	slab *r = slab_of(&rb);
	cr_assert_eq(r->fd, kept, "the kept fd is the slab's now");
	cr_assert_eq(r->allocation, id, "under its old identity");
	cr_assert_eq(r->size, 8 * MiB);
	cr_assert_not(r->dedicated);
	cr_assert_eq(cub()->vmm_allocations, 1);
	cr_assert_eq(cub()->devs[0].reserved, 8 * MiB);
	cr_assert_eq(cub()->devs[0].used, 8192);
	cr_assert_eq(adopt(-1, id, oa, 4096, UID, &ra), 0, "%s", err);
	cr_assert_eq(slab_of(&ra), r, "the second buffer of it finds the slab");
	cr_assert_eq(r->live, 2);
	/* A range that is not free, or not aligned, is refused. */
	cr_assert_eq(adopt(-1, id, ob + 4096, 4096, UID, &x), BB_ERR_INVALID);
	cr_assert(strstr(err, "not free"), "%s", err);
	cr_assert_eq(adopt(-1, id, 12288 + 8, 256, UID, &x), BB_ERR_INVALID);
	/* Another owner of the same identity is refused. */
	cr_assert_eq(adopt(-1, id, 1 * MiB, 4096, UID + 1, &x), BB_ERR_INVALID);
	/* An fd that does not import: refused, and still the caller's. */
	int plain = memfd_create("not-cuda", MFD_CLOEXEC);
	cr_assert_eq(adopt(plain, 77, 0, 4096, UID, &x), BB_ERR_INVALID);
	cr_assert(fd_open(plain));
	close(plain);
	cr_assert_eq(cub()->vmm_allocations, 1);

	/* New buffers are carved around the restored ones; new allocations get
	 * identities above the floor. */
	backend_mem c = alloc_kind(4096, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	cr_assert_eq(slab_of(&c), r);
	uint64_t oc = ((extent *)c.priv)->off;
	cr_assert(oc >= ob + 8192 || oc + 4096 <= oa, "carved at %llu", (unsigned long long)oc);
	backend_mem d = alloc_kind(12 * MiB, BB_CUDA_HANDLE_VMM, BB_CUDA_HANDLE_VMM);
	cr_assert_gt(slab_of(&d)->allocation, 1ull << 40);
	char report[1024];
	cr_assert_eq(be->check(be, report, sizeof(report)), 0, "%s", report);

	be->free(be, &d);
	be->free(be, &c);
	be->free(be, &ra);
	be->free(be, &rb);
	drain();
	cr_assert(!fd_open(kept), "the adopted fd is closed with its slab");
	cr_assert_eq(cub()->devs[0].reserved, 0);
	cr_assert_eq(cub()->devs[0].used, 0);
	cr_assert_eq(cub()->vmm_allocations, 0);
}

/* ---- the broker over VMM slabs: where a buffer lies, journaled ------------------------ */

static int exports; /* export_mem calls through the counting backend */

/* The backend under test's export_mem, counted. */
static int count_export(backend *b, const backend_mem *mem, backend_export *out, char *e,
			size_t elen)
{
	(void)b;
	exports++;
	return be->export_mem(be, mem, out, e, elen);
}

/* A VMM buffer of size bytes through bk, running jobs while the backend
 * grows. */
static broker_buf *broker_vmm_alloc(broker *bk, broker_conn *c, uint64_t size)
{
	broker_alloc_req req = {.size = size,
				.kind = BB_CUDA,
				.share = BB_SHARE_ANY,
				.import_fd = -1,
				.cuda_handle = BB_CUDA_HANDLE_VMM};
	broker_error e;
	broker_buf *buf;
	int rc;
	while ((rc = broker_alloc(bk, c, &req, &buf, &e)) == BACKEND_GROW)
		cr_assert(run_one(), "alloc waits for a grow but no job is queued");
	cr_assert_eq(rc, 0, "alloc: %s", e.msg);
	return buf;
}

/* The journal's record of buffer id. */
static journal_buffer journaled(journal *j, uint64_t id)
{
	journal_state s;
	cr_assert_eq(journal_read(journal_fd(j), &s, err, sizeof(err)), 0, "%s", err);
	journal_buffer r = {0};
	for (size_t i = 0; i < s.n_buffers; i++)
		if (s.buffers[i].id == id)
			r = s.buffers[i];
	journal_state_free(&s);
	cr_assert_eq(r.id, id, "buffer %llu is not journaled", (unsigned long long)id);
	return r;
}

Test(cuda_vmm, the_journal_keeps_where_each_vmm_buffer_lies_without_asking_the_backend_again)
{
	start();
	backend counted = *be;
	counted.export_mem = count_export;
	journal *j;
	cr_assert_eq(journal_create(NULL, &j, err, sizeof(err)), 0, "%s", err);
	broker_config cfg = {.journal = j};
	broker_limits_default(&cfg.limits);
	broker *bk = broker_new(&cfg);
	cr_assert_not_null(bk);
	broker_set_backend(bk, BB_CUDA, &counted, NULL);
	broker_error e;
	broker_conn *p = broker_conn_open(bk, UID, 100, 1, &e);
	broker_conn *q = broker_conn_open(bk, UID + 1, 100, 2, &e);
	cr_assert(p && q);

	/* Two buffers carved from one slab, a third in a slab of its own. */
	exports = 0;
	broker_buf *bufs[3] = {broker_vmm_alloc(bk, p, 4096), broker_vmm_alloc(bk, p, 8192),
			       broker_vmm_alloc(bk, p, 12 * MiB)};
	cr_assert_eq(exports, 3, "the backend is asked once per buffer, as it is made");
	uint64_t ids[3];
	backend_export want[3];
	for (int i = 0; i < 3; i++) {
		broker_info info;
		broker_buf_info(bk, bufs[i], NULL, &info);
		ids[i] = info.id;
		cr_assert_eq(broker_buf_export(bk, bufs[i], &want[i], &e), 0, "%s", e.msg);
	}
	cr_assert_eq(want[0].allocation, want[1].allocation);
	cr_assert_neq(want[0].offset, want[1].offset);
	cr_assert_neq(want[2].allocation, want[0].allocation);
	cr_assert_neq(want[2].allocation_size, want[0].allocation_size);

	/* Holds, states, a grant to another uid, a token moved: of them only
	 * the grant exports (for its answer). */
	exports = 0;
	cr_assert_eq(broker_retain(bk, p, ids[0], 2, NULL, NULL, &e), 0, "%s", e.msg);
	cr_assert_eq(broker_release(bk, p, ids[0], 2, NULL, NULL, &e), 0, "%s", e.msg);
	cr_assert_eq(broker_set_ready(bk, p, ids[0], &e), 0, "%s", e.msg);
	cr_assert_eq(broker_set_error(bk, p, ids[1], "the kernel failed", &e), 0, "%s", e.msg);
	cr_assert_eq(broker_set_ready(bk, p, ids[2], &e), 0, "%s", e.msg);
	broker_buf *opened;
	cr_assert_eq(broker_open_id(bk, q, ids[2], &opened, &e), 0, "%s", e.msg);
	broker_granted gr;
	cr_assert_eq(broker_grant(bk, q, opened, &gr, &e), 0, "%s", e.msg);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(bk, p, ids[0], false, tok, &e), 0, "%s", e.msg);
	cr_assert_eq(broker_adopt(bk, q, tok, &opened, &e), 0, "%s", e.msg);
	cr_assert_eq(exports, 1, "%d export_mem calls: only the grant's", exports);

	static const uint32_t state[3] = {BB_READY, BB_FAILED, BB_READY};
	for (int i = 0; i < 3; i++) {
		journal_buffer r = journaled(j, ids[i]);
		cr_assert_eq(r.state, state[i], "buffer %d", i);
		cr_assert_eq(r.cuda_handle, BB_CUDA_HANDLE_VMM);
		cr_assert_eq(r.allocation, want[i].allocation, "buffer %d", i);
		cr_assert_eq(r.offset, want[i].offset, "buffer %d", i);
		cr_assert_eq(r.allocation_size, want[i].allocation_size, "buffer %d", i);
	}

	broker_free(bk);
	journal_free(j);
}
