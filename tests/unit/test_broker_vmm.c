/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The broker's rules for VMM CUDA buffers (daemon/broker.h): a grant
 * carries the allocation's fd exactly when the connection held no count on
 * any buffer of that allocation just before it; AllocationFd needs a held
 * buffer of the allocation; a connection whose Hello said protocol 1.1 is
 * refused Open and Adopt of a VMM buffer and loses nothing; the handle kind
 * is kept per buffer, counted per kind and checked; a VMM buffer's journal
 * record says where it lies, and a restored one says it again from its
 * record, without asking the backend.
 *
 * A slab backend stands in for the CUDA one: each buffer lies in the
 * allocation the test names before allocating it, VMM when asked for VMM,
 * LEGACY otherwise.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "broker.h"
#include "journal.h"

#define UID_A 1000
#define UID_B 2000
#define GID 100
#define SLAB_FD 77 /* what the slab backend says a VMM allocation's fd is */

/* ---- slab backend ------------------------------------------------------------ */

typedef struct slab_mem {
	uint64_t allocation; /* the allocation it lies in */
	int handle;          /* BB_CUDA_HANDLE_LEGACY or _VMM */
} slab_mem;

static uint64_t next_allocation = 1; /* the allocation the next alloc lies in */
static int live;                     /* mems not yet freed */
static int exported;                 /* sb_export calls */
static int refused_kind;             /* a handle kind sb_alloc cannot give; 0: none */

static int sb_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		    backend_mem *out, char *err, size_t errlen)
{
	(void)be, (void)device, (void)uid, (void)share;
	if (refused_kind && *handle == refused_kind) {
		snprintf(err, errlen, "handle kind %d cannot be had", refused_kind);
		*handle = BACKEND_HANDLE_REFUSED;
		return BB_ERR_UNSUPPORTED;
	}
	slab_mem *m = calloc(1, sizeof(*m));
	cr_assert_not_null(m);
	m->allocation = next_allocation;
	m->handle = *handle == BB_CUDA_HANDLE_VMM ? BB_CUDA_HANDLE_VMM : BB_CUDA_HANDLE_LEGACY;
	*handle = m->handle;
	out->fd = -1;
	out->size = size;
	out->priv = m;
	live++;
	return 0;
}

static void sb_free(backend *be, backend_mem *mem)
{
	(void)be;
	free(mem->priv);
	mem->priv = NULL;
	live--;
}

static int sb_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
		     size_t errlen)
{
	(void)be, (void)err, (void)errlen;
	const slab_mem *m = mem->priv;
	exported++;
	out->cuda_handle = m->handle;
	out->allocation = m->allocation;
	out->allocation_size = 1 << 20;
	out->offset = 512 * m->allocation; /* where it lies, as the journal keeps it */
	out->has_ipc = m->handle == BB_CUDA_HANDLE_LEGACY;
	out->fd = m->handle == BB_CUDA_HANDLE_VMM ? SLAB_FD : -1;
	return 0;
}

static uint64_t sb_fd_allocation(backend *be, const backend_mem *mem)
{
	(void)be;
	const slab_mem *m = mem->priv;
	return m->handle == BB_CUDA_HANDLE_VMM ? m->allocation : 0;
}

static int sb_export_allocation(backend *be, uint64_t allocation, backend_export *out, char *err,
				size_t errlen)
{
	(void)be;
	if (allocation == 0 || allocation >= 1000) {
		snprintf(err, errlen, "no allocation %llu", (unsigned long long)allocation);
		return BB_ERR_NOT_FOUND;
	}
	out->fd = SLAB_FD;
	out->allocation = allocation;
	out->allocation_size = 1 << 20;
	out->cuda_handle = BB_CUDA_HANDLE_VMM;
	return 0;
}

static backend slabs = {
	.name = "slabs",
	.alloc = sb_alloc,
	.free = sb_free,
	.export_mem = sb_export,
	.fd_allocation = sb_fd_allocation,
	.export_allocation = sb_export_allocation,
};

static int heap_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		      backend_mem *out, char *err, size_t errlen)
{
	(void)be, (void)device, (void)uid, (void)share, (void)handle, (void)err, (void)errlen;
	out->fd = -1;
	out->size = size;
	out->priv = malloc(1);
	live++;
	return 0;
}

static void heap_free(backend *be, backend_mem *mem)
{
	(void)be;
	free(mem->priv);
	live--;
}

static int heap_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
		       size_t errlen)
{
	(void)be, (void)mem, (void)err, (void)errlen;
	out->fd = -1;
	return 0;
}

static backend heap = {
	.name = "heap", .alloc = heap_alloc, .free = heap_free, .export_mem = heap_export};

/* ---- fixture ------------------------------------------------------------------- */

static broker *b;
static broker_error err;

static void setup(void)
{
	broker_config cfg;
	memset(&cfg, 0, sizeof(cfg));
	broker_limits_default(&cfg.limits);
	b = broker_new(&cfg);
	cr_assert_not_null(b);
	broker_set_backend(b, BB_HOST, &heap, NULL);
	broker_set_backend(b, BB_CUDA, &slabs, NULL);
	next_allocation = 1;
	live = 0;
	refused_kind = 0;
}

static void teardown(void)
{
	char report[1024];
	int problems = broker_check(b, report, sizeof(report));
	cr_expect_eq(problems, 0, "%s", report);
	broker_free(b);
	b = NULL;
	cr_expect_eq(live, 0, "memory the broker did not free");
}

TestSuite(broker_vmm, .init = setup, .fini = teardown);

static broker_conn *conn(uint32_t uid)
{
	broker_conn *c = broker_conn_open(b, uid, GID, uid, &err);
	cr_assert_not_null(c, "%s", err.msg);
	return c;
}

/* A CUDA buffer of handle kind handle in allocation, shared with anyone. */
static broker_buf *alloc_in(broker_conn *c, uint64_t allocation, int handle)
{
	broker_buf *buf;
	broker_alloc_req req = {.size = 4096,
				.kind = BB_CUDA,
				.share = BB_SHARE_ANY,
				.import_fd = -1,
				.cuda_handle = handle};
	next_allocation = allocation;
	int rc = broker_alloc(b, c, &req, &buf, &err);
	cr_assert_eq(rc, 0, "alloc: %s", err.msg);
	return buf;
}

static uint64_t id_of_in(broker *bk, broker_buf *buf)
{
	broker_info info;
	broker_buf_info(bk, buf, NULL, &info);
	return info.id;
}

static uint64_t id_of(broker_buf *buf)
{
	return id_of_in(b, buf);
}

static broker_granted grant(broker_conn *c, broker_buf *buf)
{
	broker_granted gr;
	int rc = broker_grant(b, c, buf, &gr, &err);
	cr_assert_eq(rc, 0, "grant: %s", err.msg);
	return gr;
}

static broker_buf *open_id(broker_conn *c, uint64_t id)
{
	broker_buf *buf;
	int rc = broker_open_id(b, c, id, &buf, &err);
	cr_assert_eq(rc, 0, "open: %s", err.msg);
	return buf;
}

/* ---- the fd goes with the first grant of an allocation ----------------------- */

Test(broker_vmm, first_grant_of_an_allocation_carries_its_fd)
{
	broker_conn *a = conn(UID_A);
	broker_granted gr = grant(a, alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	cr_assert(gr.allocation_fd);
	cr_assert_eq(gr.ex.fd, SLAB_FD);
	cr_assert_eq(gr.ex.allocation, 5);
	cr_assert_eq(gr.info.cuda_handle, BB_CUDA_HANDLE_VMM);
	cr_assert_eq(broker_conn_allocation_buffers(a, 5), 1);
}

Test(broker_vmm, grant_of_another_buffer_of_a_held_allocation_carries_no_fd)
{
	broker_conn *a = conn(UID_A);
	grant(a, alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	broker_granted gr = grant(a, alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	cr_assert(!gr.allocation_fd);
	cr_assert_eq(gr.ex.fd, -1);
	cr_assert_eq(broker_conn_allocation_buffers(a, 5), 2);
	/* Another allocation is another first. */
	gr = grant(a, alloc_in(a, 6, BB_CUDA_HANDLE_VMM));
	cr_assert(gr.allocation_fd);
}

Test(broker_vmm, second_open_of_a_held_buffer_carries_no_fd)
{
	broker_conn *a = conn(UID_A), *c = conn(UID_B);
	uint64_t id = id_of(alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	broker_granted gr = grant(c, open_id(c, id));
	cr_assert(gr.allocation_fd, "the other connection's first grant");
	gr = grant(c, open_id(c, id));
	cr_assert(!gr.allocation_fd);
	cr_assert_eq(gr.ex.fd, -1);
	cr_assert_eq(broker_conn_allocation_buffers(c, 5), 1);
}

Test(broker_vmm, grant_after_every_buffer_of_the_allocation_was_released_carries_the_fd_again)
{
	broker_conn *a = conn(UID_A);
	uint64_t first = id_of(alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	broker_buf *keep = alloc_in(a, 5, BB_CUDA_HANDLE_VMM);
	/* A second connection keeps the buffers alive. */
	broker_conn *c = conn(UID_B);
	broker_buf *other = open_id(c, id_of(keep));
	cr_assert_eq(broker_release(b, a, first, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_release(b, a, id_of(keep), 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_conn_allocation_buffers(a, 5), 0);
	broker_granted gr = grant(a, open_id(a, id_of(other)));
	cr_assert(gr.allocation_fd);
	cr_assert_eq(gr.ex.fd, SLAB_FD);
}

Test(broker_vmm, a_token_moves_the_books_to_the_adopter)
{
	broker_conn *a = conn(UID_A), *c = conn(UID_B);
	uint64_t id = id_of(alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_conn_allocation_buffers(a, 5), 0, "its last count went into the token");
	broker_buf *buf;
	cr_assert_eq(broker_adopt(b, c, tok, &buf, &err), 0, "%s", err.msg);
	broker_granted gr = grant(c, buf);
	cr_assert(gr.allocation_fd);
	cr_assert_eq(broker_conn_allocation_buffers(c, 5), 1);
}

Test(broker_vmm, closing_a_connection_drops_its_books)
{
	broker_conn *a = conn(UID_A), *c = conn(UID_B);
	uint64_t id = id_of(alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	grant(c, open_id(c, id));
	broker_conn_close(b, c);
	cr_assert_eq(broker_conn_allocation_buffers(a, 5), 1);
}

Test(broker_vmm, legacy_grants_carry_no_allocation_fd_and_need_no_books)
{
	broker_conn *a = conn(UID_A);
	broker_granted gr = grant(a, alloc_in(a, 5, BB_CUDA_HANDLE_LEGACY));
	cr_assert(!gr.allocation_fd);
	cr_assert_eq(gr.ex.fd, -1);
	cr_assert_eq(gr.info.cuda_handle, BB_CUDA_HANDLE_LEGACY);
	cr_assert_eq(broker_conn_allocation_buffers(a, 5), 0);
}

/* ---- AllocationFd -------------------------------------------------------------- */

Test(broker_vmm, allocation_fd_is_given_only_while_a_buffer_of_it_is_held)
{
	broker_conn *a = conn(UID_A), *c = conn(UID_B);
	uint64_t id = id_of(alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	backend_export ex;
	cr_assert_eq(broker_allocation_fd(b, c, 5, &ex, &err), BB_ERR_NOT_FOUND);
	cr_assert(strstr(err.msg, "holds no buffer in VMM allocation 5"), "%s", err.msg);
	grant(c, open_id(c, id));
	cr_assert_eq(broker_allocation_fd(b, c, 5, &ex, &err), 0, "%s", err.msg);
	cr_assert_eq(ex.fd, SLAB_FD);
	cr_assert_eq(ex.allocation, 5);
	cr_assert_eq(ex.allocation_size, 1 << 20);
	cr_assert_eq(broker_release(b, c, id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_allocation_fd(b, c, 5, &ex, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_allocation_fd(b, a, 6, &ex, &err), BB_ERR_NOT_FOUND);
}

/* ---- a 1.1 client -------------------------------------------------------------- */

Test(broker_vmm, old_client_open_of_a_vmm_buffer_is_unsupported_and_takes_no_count)
{
	broker_conn *a = conn(UID_A), *old = conn(UID_B);
	broker_conn_set_minor(old, 1);
	broker_buf *buf = alloc_in(a, 5, BB_CUDA_HANDLE_VMM);
	broker_buf *out;
	cr_assert_eq(broker_open_id(b, old, id_of(buf), &out, &err), BB_ERR_UNSUPPORTED);
	char want[160];
	snprintf(want, sizeof(want),
		 "buffer %llu is a VMM CUDA buffer, which needs protocol 1.2 (this client speaks "
		 "1.1): upgrade libbufbroker",
		 (unsigned long long)id_of(buf));
	cr_assert_str_eq(err.msg, want);
	broker_info info;
	broker_buf_info(b, buf, old, &info);
	cr_assert_eq(info.refs, 1);
	cr_assert_eq(info.held, 0);
	/* Legacy buffers it opens as before. */
	broker_buf *leg = alloc_in(a, 6, BB_CUDA_HANDLE_LEGACY);
	cr_assert_eq(broker_open_id(b, old, id_of(leg), &out, &err), 0, "%s", err.msg);
}

Test(broker_vmm, old_client_adopt_of_a_vmm_buffer_leaves_the_token_live)
{
	broker_conn *a = conn(UID_A), *old = conn(UID_B), *now = conn(UID_B);
	broker_conn_set_minor(old, 1);
	uint64_t id = id_of(alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id, false, tok, &err), 0, "%s", err.msg);
	broker_buf *buf;
	cr_assert_eq(broker_adopt(b, old, tok, &buf, &err), BB_ERR_UNSUPPORTED);
	cr_assert(strstr(err.msg, "needs protocol 1.2"), "%s", err.msg);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.tokens, 1, "the token is still live");
	cr_assert_eq(broker_adopt(b, now, tok, &buf, &err), 0, "%s", err.msg);
	cr_assert_eq(id_of(buf), id);
}

/* ---- handle kinds --------------------------------------------------------------- */

Test(broker_vmm, handle_kinds_are_counted_and_reported)
{
	broker_conn *a = conn(UID_A);
	uint64_t v = id_of(alloc_in(a, 5, BB_CUDA_HANDLE_VMM));
	alloc_in(a, 6, BB_CUDA_HANDLE_LEGACY);
	alloc_in(a, 6, BB_CUDA_HANDLE_DEFAULT);
	broker_totals t;
	broker_totals_get(b, &t);
	cr_assert_eq(t.cuda_buffers[BB_CUDA_HANDLE_VMM], 1);
	cr_assert_eq(t.cuda_buffers[BB_CUDA_HANDLE_LEGACY], 2);
	cr_assert_eq(t.cuda_bytes[BB_CUDA_HANDLE_LEGACY], 8192);
	broker_info info;
	cr_assert_eq(broker_stat_id(b, a, v, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.cuda_handle, BB_CUDA_HANDLE_VMM);
	cr_assert_eq(broker_release(b, a, v, 1, NULL, NULL, &err), 0, "%s", err.msg);
	broker_totals_get(b, &t);
	cr_assert_eq(t.cuda_buffers[BB_CUDA_HANDLE_VMM], 0);
	cr_assert_eq(t.cuda_bytes[BB_CUDA_HANDLE_VMM], 0);
}

Test(broker_vmm, a_host_buffer_takes_no_cuda_handle_and_unknown_kinds_are_invalid)
{
	broker_conn *a = conn(UID_A);
	broker_buf *buf;
	broker_alloc_req req = {.size = 10,
				.kind = BB_HOST,
				.share = BB_SHARE_UID,
				.import_fd = -1,
				.cuda_handle = BB_CUDA_HANDLE_VMM};
	cr_assert_eq(broker_alloc(b, a, &req, &buf, &err), BB_ERR_INVALID);
	cr_assert(strstr(err.msg, "CUDA buffers only"), "%s", err.msg);
	req.kind = BB_CUDA;
	req.cuda_handle = 4;
	cr_assert_eq(broker_alloc(b, a, &req, &buf, &err), BB_ERR_INVALID);
	cr_assert(strstr(err.msg, "unknown CUDA handle kind 4"), "%s", err.msg);
	req.kind = BB_HOST;
	req.cuda_handle = BB_CUDA_HANDLE_DEFAULT;
	cr_assert_eq(broker_alloc(b, a, &req, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, a, &info);
	cr_assert_eq(info.cuda_handle, BB_CUDA_HANDLE_DEFAULT);
}

/* ---- the journal and the fd store (docs/RESTART.md) -------------------------- */

static uint64_t kept_live[8]; /* keep(live) calls per allocation */
static uint64_t kept_gone[8]; /* keep(freed) calls per allocation */

static void keep(void *ctx, const broker_kept *k, bool live_now)
{
	(void)ctx;
	cr_assert_eq(k->kind, BB_CUDA);
	cr_assert_eq(k->fd, -1, "a CUDA buffer has no memfd of its own");
	cr_assert_lt(k->allocation, 8);
	(live_now ? kept_live : kept_gone)[k->allocation]++;
}

Test(broker_vmm, a_vmm_buffer_is_journaled_with_its_allocation_and_offset)
{
	journal *j = NULL;
	char why[256];
	cr_assert_eq(journal_create(NULL, &j, why, sizeof(why)), 0, "%s", why);
	broker_config cfg = {.journal = j, .keep = keep};
	broker_limits_default(&cfg.limits);
	broker *jb = broker_new(&cfg);
	broker_set_backend(jb, BB_CUDA, &slabs, NULL);
	memset(kept_live, 0, sizeof(kept_live));
	memset(kept_gone, 0, sizeof(kept_gone));
	broker_conn *c = broker_conn_open(jb, 1000, GID, 1, &err);
	broker_alloc_req req = {
		.size = 4096, .kind = BB_CUDA, .import_fd = -1, .cuda_handle = BB_CUDA_HANDLE_VMM};
	broker_buf *vmm, *legacy;
	next_allocation = 5;
	cr_assert_eq(broker_alloc(jb, c, &req, &vmm, &err), 0, "%s", err.msg);
	next_allocation = 6;
	req.cuda_handle = BB_CUDA_HANDLE_LEGACY;
	cr_assert_eq(broker_alloc(jb, c, &req, &legacy, &err), 0, "%s", err.msg);
	broker_info iv, il;
	broker_buf_info(jb, vmm, c, &iv);
	broker_buf_info(jb, legacy, c, &il);
	/* The store hook: the VMM buffer with its allocation, the legacy one
	 * with none (it has no fd to keep). */
	cr_assert_eq(kept_live[5], 1);
	cr_assert_eq(kept_live[0], 1);

	journal_state s;
	cr_assert_eq(journal_read(journal_fd(j), &s, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(s.n_buffers, 2);
	for (size_t i = 0; i < s.n_buffers; i++) {
		const journal_buffer *r = &s.buffers[i];
		if (r->id == iv.id) {
			cr_assert_eq(r->cuda_handle, BB_CUDA_HANDLE_VMM);
			cr_assert_eq(r->allocation, 5);
			cr_assert_eq(r->offset, 512 * 5);
		} else {
			cr_assert_eq(r->cuda_handle, BB_CUDA_HANDLE_LEGACY);
			cr_assert_eq(r->allocation, 0, "only VMM buffers' allocations are kept");
		}
	}
	journal_state_free(&s);
	cr_assert_eq(broker_release(jb, c, iv.id, 1, NULL, NULL, &err), 0);
	cr_assert_eq(kept_gone[5], 1, "a freed VMM buffer leaves the store's books");
	broker_free(jb);
	journal_free(j);
}

/* broker_restore's memory: the slab mem a record names. */
static int restore_slab(void *ctx, backend *be, const journal_buffer *rec, backend_mem *out,
			char *e, size_t elen)
{
	(void)ctx;
	int handle = (int)rec->cuda_handle;
	next_allocation = rec->allocation;
	return be->alloc(be, rec->size, rec->device, rec->owner_uid, (int)rec->share, &handle, out,
			 e, elen);
}

/* The state journal j holds, in *s (journal_state_free it). */
static void read_journal(journal *j, journal_state *s)
{
	char why[256];
	cr_assert_eq(journal_read(journal_fd(j), s, why, sizeof(why)), 0, "%s", why);
}

Test(broker_vmm, a_restored_vmm_buffer_is_journaled_where_its_record_said)
{
	char why[256];
	journal *j1 = NULL, *j2 = NULL;
	cr_assert_eq(journal_create(NULL, &j1, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(journal_create(NULL, &j2, why, sizeof(why)), 0, "%s", why);
	broker_config cfg = {.journal = j1};
	broker_limits_default(&cfg.limits);
	broker *before = broker_new(&cfg);
	broker_set_backend(before, BB_CUDA, &slabs, NULL);
	broker_conn *c = broker_conn_open(before, UID_A, GID, 1, &err);
	broker_alloc_req req = {
		.size = 4096, .kind = BB_CUDA, .import_fd = -1, .cuda_handle = BB_CUDA_HANDLE_VMM};
	broker_buf *x, *y;
	next_allocation = 5;
	cr_assert_eq(broker_alloc(before, c, &req, &x, &err), 0, "%s", err.msg);
	next_allocation = 6;
	cr_assert_eq(broker_alloc(before, c, &req, &y, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_set_ready(before, c, id_of_in(before, y), &err), 0, "%s", err.msg);
	journal_state s1;
	read_journal(j1, &s1);
	cr_assert_eq(s1.n_buffers, 2);

	/* The rebuild journals every buffer again, from its record. */
	cfg.journal = j2;
	broker *after = broker_new(&cfg);
	broker_set_backend(after, BB_CUDA, &slabs, NULL);
	exported = 0;
	broker_error e;
	cr_assert_eq(broker_restore(after, journal_fd(j1), restore_slab, NULL, &e), 0, "%s", e.msg);
	cr_assert_eq(exported, 0, "%d export_mem calls", exported);
	journal_state s2;
	read_journal(j2, &s2);
	cr_assert_eq(s2.n_buffers, 2);
	for (size_t i = 0; i < 2; i++) {
		const journal_buffer *r1 = &s1.buffers[i], *r2 = &s2.buffers[i];
		cr_assert_eq(r2->id, r1->id);
		cr_assert_eq(r2->cuda_handle, BB_CUDA_HANDLE_VMM);
		cr_assert_eq(r2->allocation, 5 + i);
		cr_assert_eq(r2->allocation, r1->allocation);
		cr_assert_eq(r2->offset, r1->offset);
		cr_assert_eq(r2->allocation_size, r1->allocation_size);
		cr_assert_eq(r2->allocation_size, 1 << 20);
	}
	journal_state_free(&s1);
	journal_state_free(&s2);
	broker_free(after);
	broker_free(before);
	journal_free(j2);
	journal_free(j1);
}

/* ---- a handle kind that cannot be had ---------------------------------------------- */

Test(broker_vmm, a_refused_handle_kind_is_said_apart_from_other_refusals)
{
	broker_conn *a = conn(UID_A);
	broker_buf *buf;
	bool refused = false;
	broker_alloc_req req = {.size = 4096,
				.kind = BB_CUDA,
				.import_fd = -1,
				.cuda_handle = BB_CUDA_HANDLE_LEGACY,
				.handle_refused = &refused};
	refused_kind = BB_CUDA_HANDLE_LEGACY;
	cr_assert_eq(broker_alloc(b, a, &req, &buf, &err), BB_ERR_UNSUPPORTED);
	cr_assert(refused, "the backend refused the kind: %s", err.msg);
	cr_assert_str_eq(err.msg, "handle kind 2 cannot be had");

	/* Refused for another reason: the slab backend imports no fd. */
	req.import_fd = 0;
	cr_assert_eq(broker_alloc(b, a, &req, &buf, &err), BB_ERR_UNSUPPORTED);
	cr_assert_not(refused, "%s", err.msg);

	/* A kind the backend gives. */
	req.import_fd = -1;
	refused = true;
	req.cuda_handle = BB_CUDA_HANDLE_VMM;
	cr_assert_eq(broker_alloc(b, a, &req, &buf, &err), 0, "%s", err.msg);
	cr_assert_not(refused);
}
