/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The client API against a real bufbrokerd, across processes: every item of
 * "Behaviour that callers rely on" in API.md, and the DESIGN.md rules the
 * library adds (coalescing, take with several counts, import sealing).
 *
 * Children report through exit codes: 0 is success, any other value names
 * the step that failed (see each child function).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_internal.h"
#include "harness.h"

#define CHILD_TIMEOUT_MS 8000
#define NOBODY 65534

TestSuite(api, .fini = bbt_cleanup, .timeout = 30);

/* What a child needs to know; fork copies it. */
struct ctx {
	const char *sock;
	uint64_t id;
	char name[BB_NAME_MAX + 1];
	bb_token token;
	size_t size;
	uint32_t seed;
	size_t mark_off; /* where a child writes its marker */
	int mode;
	uint64_t waits; /* parked waits a child waits to see (killed_producer_child) */
	bbt_chan ch;
};

static bb_buf *alloc_host(bb_client *c, size_t size, const char *name, int share)
{
	bb_alloc_opts o = {
		.size = size, .kind = BB_HOST, .device = 0, .name = name, .share = share};
	bb_buf *b = NULL;
	int rc = bb_alloc(c, &o, &b);
	cr_assert_eq(rc, 0, "bb_alloc(%zu, %s): %d (%s)", size, name ? name : "-", rc,
		     bb_last_error());
	cr_assert_not_null(b);
	return b;
}

static void *map_of(bb_buf *b)
{
	void *p = NULL;
	int rc = bb_map(b, &p);
	cr_assert_eq(rc, 0, "bb_map: %d (%s)", rc, bb_last_error());
	cr_assert_not_null(p);
	return p;
}

static bb_info stat_of(bb_client *c, uint64_t id)
{
	bb_info info;
	int rc = bb_stat(c, id, &info);
	cr_assert_eq(rc, 0, "bb_stat(%llu): %d (%s)", (unsigned long long)id, rc, bb_last_error());
	return info;
}

static void assert_gone(bb_client *c, uint64_t id)
{
	bb_info info;
	int rc = bb_stat(c, id, &info);
	cr_assert_eq(rc, BB_ERR_NOT_FOUND, "bb_stat(%llu) after the last count: %d, want NOT_FOUND",
		     (unsigned long long)id, rc);
}

/* The connection's own count and the live tokens of a buffer, from the wire
 * (bb_info does not carry them). */
static void raw_stat(bb_client *c, uint64_t id, uint32_t *held, uint32_t *tokens)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Stat st = BUFBROKER__STAT__INIT;
	Bufbroker__Response *resp = NULL;

	st.target_case = BUFBROKER__STAT__TARGET_ID;
	st.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_STAT;
	req.stat = &st;
	int rc = bbc_call(c, &req, -1, &resp, NULL);
	cr_assert_eq(rc, 0, "raw Stat: %d", rc);
	cr_assert(resp->status && resp->status->code == 0, "raw Stat status %d",
		  resp->status ? resp->status->code : 99);
	cr_assert_eq(resp->result_case, BUFBROKER__RESPONSE__RESULT_INFO);
	*held = resp->info->held;
	*tokens = resp->info->tokens;
	bbc_response_free(resp);
}

/* ---- bytes cross processes -------------------------------------------- */

enum { BY_ID = 0, BY_NAME = 1, BY_TOKEN = 2 };

/* Opens the buffer one of three ways, waits for READY, checks the parent's
 * pattern and writes a marker of its own. */
static int reader_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	bb_state st;
	void *p = NULL;
	int rc;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (x->mode == BY_ID)
		rc = bb_open(c, x->id, &b);
	else if (x->mode == BY_NAME)
		rc = bb_open_name(c, x->name, &b);
	else
		rc = bb_adopt(c, &x->token, &b);
	if (rc != 0 || !b)
		return 11;
	if (bb_id(b) != x->id)
		return 12;
	if (bb_size(b) != x->size)
		return 13;
	if (bb_buf_kind(b) != BB_HOST)
		return 14;
	if (bb_wait(b, 3000, &st) != 0 || st != BB_READY)
		return 15;
	if (bb_map(b, &p) != 0 || !p)
		return 16;
	if (!bbt_check(p, x->mark_off, x->seed))
		return 17;
	memcpy((char *)p + x->mark_off + 16 * x->mode, "child-wrote-this", 16);
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(api, bytes_written_in_one_process_are_read_in_another)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock, .size = 65536, .seed = 0xb0f, .mark_off = 60000};
	strcpy(x.name, "bbt-xfer");

	bb_buf *b = alloc_host(c, x.size, x.name, BB_SHARE_UID);
	x.id = bb_id(b);
	cr_assert_eq(bb_size(b), x.size);
	cr_assert_eq(bb_buf_kind(b), BB_HOST);
	char *p = map_of(b);
	memset(p, 0, x.size);
	bbt_fill(p, x.mark_off, x.seed);
	cr_assert_eq(bb_take(bb_ref(b), &x.token), 0, "bb_take: %s", bb_last_error());
	cr_assert_eq(bb_set_ready(b), 0, "bb_set_ready: %s", bb_last_error());

	static const char *how[] = {"open by id", "open by name", "adopt token"};
	for (int mode = BY_ID; mode <= BY_TOKEN; mode++) {
		x.mode = mode;
		int code = bbt_join(bbt_spawn(reader_child, &x), CHILD_TIMEOUT_MS);
		cr_assert_eq(code, 0, "reader (%s) failed at step %d", how[mode], code);
		cr_assert_eq(memcmp(p + x.mark_off + 16 * mode, "child-wrote-this", 16), 0,
			     "the reader's (%s) write is not visible to the allocating process",
			     how[mode]);
	}

	bb_info info = stat_of(c, x.id);
	cr_assert_eq(info.id, x.id);
	cr_assert_eq(info.size, x.size);
	cr_assert_eq(info.kind, BB_HOST);
	cr_assert_eq(info.state, BB_READY);
	cr_assert_str_eq(info.name, "bbt-xfer");
	cr_assert_str_eq(info.error, "");
	cr_assert_eq(bbt_refs_until(c, x.id, 1, 2000), 1, "refs after every reader left");

	bb_unref(b);
	assert_gone(c, x.id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- refs ------------------------------------------------------------------ */

/* Holds the buffer through three local counts (two coalesced opens and a
 * bb_ref), reports, and lets go when told. */
static int holder_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b1 = NULL, *b2 = NULL;
	bb_info info;
	char go;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_open(c, x->id, &b1) != 0 || bb_open(c, x->id, &b2) != 0)
		return 11;
	if (b1 != b2)
		return 12;
	bb_ref(b1);
	if (bb_stat(c, x->id, &info) != 0)
		return 13;
	if (info.refs != 2)
		return 14;
	if (bbt_send(x->ch.fd[1], "r", 1) != 0)
		return 15;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
		return 16;
	bb_unref(b1);
	bb_unref(b1);
	bb_unref(b1);
	bb_disconnect(c);
	return 0;
}

/* A freed host buffer's memfd is kept, emptied, and serves the next alloc
 * of its uid and page-rounded size: the new buffer reads zeros. */
Test(api, freed_host_memfd_is_reused_empty_for_the_same_uid)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	enum { SIZE = 64 * 1024 };
	int memfds0 = bbt_daemon_memfds(d);
	bb_info info;

	bb_buf *b = alloc_host(c, SIZE, NULL, BB_SHARE_UID);
	uint64_t id = bb_id(b);
	memset(map_of(b), 0xab, SIZE);
	bb_unref(b);
	cr_assert_eq(bb_stat(c, id, &info), BB_ERR_NOT_FOUND, "the buffer was not freed");
	cr_assert_eq(bbt_daemon_memfds(d), memfds0 + 1, "the freed memfd was not kept for reuse");
	cr_assert_eq(bbt_daemon_memfd_bytes(d), 0, "the kept memfd still holds memory");

	/* Same page-rounded size: the kept memfd, empty. */
	b = alloc_host(c, SIZE - 100, NULL, BB_SHARE_UID);
	cr_assert_eq(bbt_daemon_memfds(d), memfds0 + 1, "a same-sized alloc made a new memfd");
	const unsigned char *p = map_of(b);
	for (size_t i = 0; i < SIZE - 100; i++)
		cr_assert_eq(p[i], 0, "byte %zu of a reused memfd is %#x, not 0", i, p[i]);
	/* Another size: a new memfd. */
	bb_buf *other = alloc_host(c, 2 * SIZE, NULL, BB_SHARE_UID);
	cr_assert_eq(bbt_daemon_memfds(d), memfds0 + 2, "another size reused a memfd");
	bb_unref(other);
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* A mapping of buffer id made from the memfd of an Open on the wire, the
 * Open's count given back: it outlives the buffer, as a process's stale
 * mapping does. */
static unsigned char *stale_mapping_of(bb_client *c, uint64_t id, size_t size)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Open o = BUFBROKER__OPEN__INIT;
	Bufbroker__Response *resp = NULL;
	int fd = -1;
	o.target_case = BUFBROKER__OPEN__TARGET_ID;
	o.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_OPEN;
	req.open = &o;
	cr_assert_eq(bbc_call(c, &req, -1, &resp, &fd), 0, "Open: %s", bb_last_error());
	cr_assert(resp->status && resp->status->code == 0 && fd >= 0, "Open failed");
	bbc_response_free(resp);
	cr_assert_eq(bb_release(c, id, 1), 0);
	unsigned char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	cr_assert(p != MAP_FAILED, "mmap: %s", strerror(errno));
	close(fd);
	return p;
}

/* What PROTOCOL.md says of the reuse pool: a same-uid process that kept a
 * mapping of a freed buffer sees the next buffer of that size made from
 * the same memfd; --host-pool-memfds 0 closes every memfd at the free, and
 * a stale mapping then sees nothing new. */
Test(api, a_stale_mapping_sees_the_next_buffer_of_its_size_unless_pooling_is_off)
{
	const char *const off[] = {"--host-pool-memfds", "0", NULL};
	const char *const *args[] = {NULL, off};
	enum { SIZE = 64 * 1024 };

	for (int pooled = 1; pooled >= 0; pooled--) {
		bbt_daemon *d = bbt_start(args[!pooled]);
		bb_client *c = bbt_connect(d);
		int memfds0 = bbt_daemon_memfds(d);
		bb_buf *a = alloc_host(c, SIZE, NULL, BB_SHARE_UID);
		uint64_t id = bb_id(a);
		unsigned char *stale = stale_mapping_of(c, id, SIZE);
		bb_unref(a);
		cr_assert_eq(bbt_stat_until_gone(c, id, 2000), BB_ERR_NOT_FOUND);
		cr_assert_eq(bbt_daemon_memfds(d), memfds0 + pooled,
			     "pooling %s: the daemon holds %d memfds after the free, want %d",
			     pooled ? "on" : "off", bbt_daemon_memfds(d), memfds0 + pooled);

		bb_buf *b = alloc_host(c, SIZE, NULL, BB_SHARE_UID);
		bbt_fill(map_of(b), SIZE, 0x5eed);
		bool sees = bbt_check(stale, SIZE, 0x5eed);
		cr_assert_eq(sees, pooled,
			     "pooling %s: a stale mapping of a freed buffer %s the next one",
			     pooled ? "on" : "off", sees ? "sees" : "does not see");
		munmap(stale, SIZE);
		bb_unref(b);
		bb_disconnect(c);
		bbt_stop_clean(d);
	}
}

/* The VMA of this process that holds addr, from /proc/self/smaps: its end
 * and whether its VmFlags carry "hg" (MADV_HUGEPAGE). */
static void vma_of(const void *addr, uintptr_t *end, int *hugepage)
{
	FILE *f = fopen("/proc/self/smaps", "r");
	char line[512];
	int in = 0;

	cr_assert_not_null(f, "/proc/self/smaps: %s", strerror(errno));
	*end = 0;
	*hugepage = -1;
	while (fgets(line, sizeof(line), f)) {
		uintptr_t lo, hi;
		/* A VMA's first line is "LO-HI perms ..."; no field line parses so. */
		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
			in = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
			if (in)
				*end = hi;
		} else if (in && strncmp(line, "VmFlags:", 8) == 0) {
			*hugepage = strstr(line, " hg") != NULL;
			break;
		}
	}
	fclose(f);
	cr_assert_neq(*hugepage, -1, "no VMA with VmFlags holds %p", addr);
}

Test(api, host_mappings_from_2mib_ask_for_huge_pages_over_whole_2mib_extents)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	const size_t mib2 = (size_t)2 << 20, tail = 3 * 4096;
	uintptr_t end;
	int hg;

	/* 4 MiB and three pages: the first 4 MiB advised, the tail not. */
	bb_buf *big = alloc_host(c, 2 * mib2 + tail, NULL, BB_SHARE_UID);
	unsigned char *p = map_of(big);
	vma_of(p, &end, &hg);
	cr_assert_eq(hg, 1, "a %zu-byte mapping was not advised MADV_HUGEPAGE", bb_size(big));
	cr_assert_eq(end, (uintptr_t)p + 2 * mib2, "the advice covers %#lx bytes, not 4 MiB",
		     (unsigned long)(end - (uintptr_t)p));
	vma_of(p + 2 * mib2, &end, &hg);
	cr_assert_eq(hg, 0, "the partial 2 MiB extent at the end was advised");
	cr_assert_eq(end, (uintptr_t)p + 2 * mib2 + tail);
	/* The memory is the buffer's, whatever the advice. */
	memset(p, 0x5a, bb_size(big));
	cr_assert_eq(p[2 * mib2 + tail - 1], 0x5a);

	/* Under 2 MiB: no advice at all. */
	bb_buf *small = alloc_host(c, mib2 - 4096, NULL, BB_SHARE_UID);
	vma_of(map_of(small), &end, &hg);
	cr_assert_eq(hg, 0, "a mapping under 2 MiB was advised MADV_HUGEPAGE");

	bb_unref(small);
	bb_unref(big);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, refs_count_processes_not_local_copies)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock};
	char r;

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	x.id = bb_id(b);
	bb_ref(b);
	bb_ref(b);
	cr_assert_eq(bbt_refs(c, x.id), 1, "one process with three local copies");

	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(holder_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0,
		     "the holder child did not report (exit %d)", bbt_join(pid, 0));
	cr_assert_eq(bbt_refs(c, x.id), 2, "two processes, three local copies each");

	bb_token t;
	cr_assert_eq(bb_take(b, &t), 0, "bb_take: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, x.id), 3, "two holders and a live token");

	cr_assert_eq(bbt_send(x.ch.fd[0], "d", 1), 0);
	int code = bbt_join(pid, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "holder child failed at step %d", code);
	bbt_chan_close(&x.ch);
	cr_assert_eq(bbt_refs_until(c, x.id, 2, 2000), 2,
		     "the holder left: this process and the token");

	bb_buf *a = NULL;
	cr_assert_eq(bb_adopt(c, &t, &a), 0, "bb_adopt: %s", bb_last_error());
	cr_assert_eq(a, b, "adopting a held buffer coalesces into the same handle");
	cr_assert_eq(bbt_refs(c, x.id), 1, "token adopted by a holder: one reference left");

	bb_unref(b); /* 3 local counts: two left after take, one from adopt */
	bb_unref(b);
	cr_assert_eq(bbt_refs(c, x.id), 1);
	bb_unref(b);
	assert_gone(c, x.id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, last_unref_frees_buffer_and_returns_its_memory)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bbt_totals t;
	int memfds0 = bbt_daemon_memfds(d);
	cr_assert_geq(memfds0, 0, "cannot read /proc/%d/fd", (int)d->pid);

	bb_buf *b = alloc_host(c, 1 << 20, NULL, BB_SHARE_UID);
	uint64_t id = bb_id(b);
	memset(map_of(b), 1, 1 << 20);
	cr_assert_geq(bbt_daemon_memfd_bytes(d), 1 << 20, "the buffer's pages are not in a memfd");
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.host_buffers, 1);
	cr_assert_geq(t.bytes, 1 << 20);
	cr_assert_eq(bbt_daemon_memfds(d), memfds0 + 1, "the daemon holds the buffer's memfd");

	bb_ref(b);
	bb_unref(b);
	cr_assert_eq(bbt_refs(c, id), 1, "a non-last unref releases nothing");
	bb_unref(b);
	assert_gone(c, id);
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.buffers, 0, "buffers left after the last unref");
	cr_assert_eq(t.bytes, 0, "bytes left after the last unref");
	cr_assert_eq(bbt_daemon_memfd_bytes(d), 0, "the freed buffer's memory was not returned");
	cr_assert_leq(bbt_daemon_memfds(d), memfds0 + 1,
		      "the daemon has more memfds open than it ever had buffers");
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, release_of_raw_counts_frees_buffer)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	uint64_t id = bb_id(b);
	cr_assert_eq(bb_retain(c, id, 2), 0, "bb_retain: %s", bb_last_error());
	bb_unref(b); /* the handle's count goes; two raw counts stay */
	cr_assert_eq(bbt_refs(c, id), 2);
	cr_assert_eq(bb_release(c, id, 1), 0, "bb_release: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, id), 1);
	cr_assert_eq(bb_release(c, id, 1), 0, "bb_release: %s", bb_last_error());
	assert_gone(c, id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, disconnect_releases_everything_the_connection_held)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_client *c2 = bbt_connect(d);

	bb_buf *keep = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	uint64_t keep_id = bb_id(keep);
	bb_buf *a = alloc_host(c2, 4096, NULL, BB_SHARE_UID);
	bb_buf *n = alloc_host(c2, 8192, "bbt-disconnect", BB_SHARE_UID);
	bb_buf *o = NULL;
	uint64_t a_id = bb_id(a), n_id = bb_id(n);
	bb_ref(a);
	bb_ref(a);
	cr_assert_eq(bb_retain(c2, n_id, 3), 0);
	cr_assert_eq(bb_open(c2, keep_id, &o), 0, "bb_open: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, keep_id), 2);

	bb_disconnect(c2);
	cr_assert_eq(bbt_stat_until_gone(c, a_id, 2000), BB_ERR_NOT_FOUND,
		     "a buffer with local copies");
	cr_assert_eq(bbt_stat_until_gone(c, n_id, 2000), BB_ERR_NOT_FOUND,
		     "a buffer with raw counts");
	cr_assert_eq(bbt_refs_until(c, keep_id, 1, 2000), 1, "an opened buffer");
	bb_buf *again = alloc_host(c, 4096, "bbt-disconnect", BB_SHARE_UID);
	bb_unref(again);
	bb_unref(keep);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, expired_token_releases_buffer)
{
	static const char *const args[] = {"--token-ttl", "300", NULL};
	bbt_daemon *d = bbt_start(args);
	bb_client *c = bbt_connect(d);
	bb_token t;

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	uint64_t id = bb_id(b);
	int64_t t0 = bbt_now_ms();
	cr_assert_eq(bb_take(b, &t), 0, "bb_take: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, id), 1, "the token holds the only reference");
	cr_assert_eq(bbt_stat_until_gone(c, id, 3000), BB_ERR_NOT_FOUND,
		     "the buffer outlived its token's 300 ms TTL by more than 2.7 s");
	cr_assert_geq(bbt_now_ms() - t0, 250, "the token expired before its TTL");

	bb_buf *a = NULL;
	cr_assert_eq(bb_adopt(c, &t, &a), BB_ERR_NOT_FOUND, "adopting an expired token");
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, local_copies_do_not_change_refs)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	uint64_t id = bb_id(b);
	void *p = map_of(b);
	for (int i = 0; i < 10; i++)
		cr_assert_eq(bb_ref(b), b, "bb_ref returns its argument");
	cr_assert_eq(bbt_refs(c, id), 1, "eleven local copies are one reference");
	void *q = map_of(b);
	cr_assert_eq(p, q, "every copy maps the same pointer");
	for (int i = 0; i < 10; i++)
		bb_unref(b);
	cr_assert_eq(bbt_refs(c, id), 1, "unref of a non-last copy is local");
	memset(p, 0x5a, 4096); /* still mapped */
	cr_assert_null(bb_ref(NULL));
	bb_unref(NULL);
	bb_unref(b);
	assert_gone(c, id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, open_of_held_buffer_returns_same_handle)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_buf *o1 = NULL, *o2 = NULL;
	uint32_t held, tokens;

	bb_buf *b = alloc_host(c, 4096, "bbt-coalesce", BB_SHARE_UID);
	uint64_t id = bb_id(b);
	cr_assert_eq(bb_open(c, id, &o1), 0, "bb_open: %s", bb_last_error());
	cr_assert_eq(o1, b, "bb_open of a held id returns the same handle");
	cr_assert_eq(bb_open_name(c, "bbt-coalesce", &o2), 0, "bb_open_name: %s", bb_last_error());
	cr_assert_eq(o2, b, "bb_open_name of a held buffer returns the same handle");
	cr_assert_eq(bbt_refs(c, id), 1);
	raw_stat(c, id, &held, &tokens);
	cr_assert_eq(held, 1, "the connection keeps exactly one count for its handle");

	bb_unref(b);
	bb_unref(b);
	cr_assert_eq(bbt_refs(c, id), 1, "two of three local counts gone");
	bb_unref(b);
	assert_gone(c, id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- tokens --------------------------------------------------------------- */

/* Adopts the token, checks refs, reports them, waits to be told to go. */
static int adopter_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	bb_info info;
	char go;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_adopt(c, &x->token, &b) != 0)
		return 11;
	if (bb_id(b) != x->id)
		return 12;
	if (bb_stat(c, x->id, &info) != 0)
		return 13;
	if (bbt_send(x->ch.fd[1], &info.refs, sizeof(info.refs)) != 0)
		return 14;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
		return 15;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(api, take_with_other_local_counts_retains_into_token)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock};
	uint32_t held, tokens;
	uint64_t child_refs = 0;

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	x.id = bb_id(b);
	bb_ref(b);
	bb_ref(b);
	cr_assert_eq(bb_take(b, &x.token), 0, "bb_take: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, x.id), 2,
		     "take with other counts left adds the token's reference");
	raw_stat(c, x.id, &held, &tokens);
	cr_assert_eq(held, 1);
	cr_assert_eq(tokens, 1);
	/* The handle is still usable. */
	map_of(b);
	cr_assert_eq(bb_id(b), x.id);
	cr_assert_eq(bb_set_ready(b), 0, "bb_set_ready after take: %s", bb_last_error());

	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(adopter_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &child_refs, sizeof(child_refs), CHILD_TIMEOUT_MS), 0,
		     "adopter did not report (exit %d)", bbt_join(pid, 0));
	cr_assert_eq(child_refs, 2, "adopt moves the token's reference: refs unchanged");
	cr_assert_eq(bbt_refs(c, x.id), 2);
	raw_stat(c, x.id, &held, &tokens);
	cr_assert_eq(tokens, 0, "the token is used up");
	cr_assert_eq(bbt_send(x.ch.fd[0], "g", 1), 0);
	int code = bbt_join(pid, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "adopter failed at step %d", code);
	bbt_chan_close(&x.ch);
	cr_assert_eq(bbt_refs_until(c, x.id, 1, 2000), 1);

	bb_unref(b);
	cr_assert_eq(bbt_refs(c, x.id), 1, "one local count left");
	bb_unref(b);
	assert_gone(c, x.id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, take_of_last_count_moves_the_reference)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	uint32_t held, tokens;
	bb_token t;

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	uint64_t id = bb_id(b);
	cr_assert_eq(bb_take(b, &t), 0, "bb_take: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, id), 1, "take of the last count is net zero");
	raw_stat(c, id, &held, &tokens);
	cr_assert_eq(held, 0, "the connection gave its count to the token");
	cr_assert_eq(tokens, 1);

	bb_buf *a = NULL;
	cr_assert_eq(bb_adopt(c, &t, &a), 0, "bb_adopt: %s", bb_last_error());
	cr_assert_eq(bb_id(a), id);
	cr_assert_eq(bbt_refs(c, id), 1, "adopt is net zero");
	raw_stat(c, id, &held, &tokens);
	cr_assert_eq(held, 1);
	cr_assert_eq(tokens, 0);
	bb_unref(a);
	assert_gone(c, id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

static int adopt_once_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	int rc = bb_adopt(c, &x->token, &b);
	if (rc == 0)
		bb_unref(b);
	bb_disconnect(c);
	return rc == 0 ? 0 : rc == BB_ERR_NOT_FOUND ? 2 : 11;
}

Test(api, second_adopt_of_a_token_is_not_found)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock};
	bb_buf *a = NULL;

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	x.id = bb_id(b);
	cr_assert_eq(bb_take(bb_ref(b), &x.token), 0);
	cr_assert_eq(bbt_join(bbt_spawn(adopt_once_child, &x), CHILD_TIMEOUT_MS), 0,
		     "the first adopt (in another process) failed");
	cr_assert_eq(bb_adopt(c, &x.token, &a), BB_ERR_NOT_FOUND, "a second adopt in this process");
	cr_assert_eq(bbt_join(bbt_spawn(adopt_once_child, &x), CHILD_TIMEOUT_MS), 2,
		     "a second adopt in another process is not NOT_FOUND");

	/* Same process adopting twice. */
	bb_token t2, unknown;
	cr_assert_eq(bb_take(bb_ref(b), &t2), 0);
	cr_assert_eq(bb_adopt(c, &t2, &a), 0);
	cr_assert_eq(a, b);
	cr_assert_eq(bb_adopt(c, &t2, &a), BB_ERR_NOT_FOUND);
	memset(&unknown, 0x42, sizeof(unknown));
	cr_assert_eq(bb_adopt(c, &unknown, &a), BB_ERR_NOT_FOUND, "a token never issued");
	cr_assert_eq(bbt_refs(c, x.id), 1);

	bb_unref(b);
	bb_unref(b);
	assert_gone(c, x.id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, token_text_round_trips_and_bad_text_is_rejected)
{
	bb_token t, back;
	char text[2 * BB_TOKEN_SIZE + 1], want[2 * BB_TOKEN_SIZE + 1];

	for (int i = 0; i < BB_TOKEN_SIZE; i++)
		t.bytes[i] = (unsigned char)(i * 37 + (i == 0 ? 0 : 0xa0));
	t.bytes[0] = 0x00;
	t.bytes[15] = 0xff;
	for (int i = 0; i < BB_TOKEN_SIZE; i++)
		sprintf(want + 2 * i, "%02x", t.bytes[i]);
	memset(text, '#', sizeof(text));
	bb_token_format(&t, text);
	cr_assert_str_eq(text, want, "32 lowercase hex digits, in byte order");
	memset(&back, 0, sizeof(back));
	cr_assert_eq(bb_token_parse(text, &back), 0);
	cr_assert_eq(memcmp(&t, &back, sizeof(t)), 0, "parse(format(t)) != t");

	static const char *bad[] = {
		"",
		"0011",
		"000102030405060708090a0b0c0d0e0",   /* 31 digits */
		"000102030405060708090a0b0c0d0e0f0", /* 33 digits */
		"000102030405060708090a0b0c0d0e0g",  /* not hex */
		"000102030405060708090a0b0c0d0e 0",
		"0x0102030405060708090a0b0c0d0e0f",
		"000102030405060708090a0b0c0d0e0f\n",
		"-00102030405060708090a0b0c0d0e0f",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_assert_eq(bb_token_parse(bad[i], &back), BB_ERR_INVALID,
			     "bb_token_parse(\"%s\")", bad[i]);

	/* A real token survives text. */
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID), *a = NULL;
	uint64_t id = bb_id(b);
	cr_assert_eq(bb_take(b, &t), 0);
	bb_token_format(&t, text);
	cr_assert_eq(bb_token_parse(text, &back), 0);
	cr_assert_eq(bb_adopt(c, &back, &a), 0, "adopt of a parsed token: %s", bb_last_error());
	cr_assert_eq(bb_id(a), id);
	bb_unref(a);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- states ----------------------------------------------------------------- */

Test(api, set_ready_or_error_on_a_settled_buffer_is_a_state_error)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_state st;

	bb_buf *r = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	cr_assert_eq(stat_of(c, bb_id(r)).state, BB_PENDING, "a new buffer is PENDING");
	cr_assert_eq(bb_set_ready(r), 0);
	cr_assert_eq(bb_set_ready(r), BB_ERR_STATE, "set_ready twice");
	cr_assert_eq(bb_set_error(r, "late"), BB_ERR_STATE, "set_error after ready");
	cr_assert_eq(stat_of(c, bb_id(r)).state, BB_READY);
	cr_assert_eq(bb_wait(r, 0, &st), 0);
	cr_assert_eq(st, BB_READY);

	bb_buf *f = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	cr_assert_eq(bb_set_error(f, "first"), 0);
	cr_assert_eq(bb_set_error(f, "second"), BB_ERR_STATE, "set_error twice");
	cr_assert_eq(bb_set_ready(f), BB_ERR_STATE, "set_ready after error");
	bb_info info = stat_of(c, bb_id(f));
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_str_eq(info.error, "first", "the first message stays");

	bb_unref(r);
	bb_unref(f);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, wait_on_failed_buffer_returns_failed_and_stat_shows_the_message)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_state st = BB_PENDING;

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	cr_assert_eq(bb_set_error(b, "decoder ran out of input"), 0);
	cr_assert_eq(bb_wait(b, 1000, &st), 0, "bb_wait on FAILED: %s", bb_last_error());
	cr_assert_eq(st, BB_FAILED);
	st = BB_PENDING;
	cr_assert_eq(bb_wait(b, 0, &st), 0, "a poll of a FAILED buffer");
	cr_assert_eq(st, BB_FAILED);
	st = BB_PENDING;
	cr_assert_eq(bb_wait(b, -1, &st), 0, "a forever wait on a FAILED buffer");
	cr_assert_eq(st, BB_FAILED);
	bb_info info = stat_of(c, bb_id(b));
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_str_eq(info.error, "decoder ran out of input");
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, wait_on_pending_buffer_times_out)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_state st;

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	int64_t t0 = bbt_now_ms();
	cr_assert_eq(bb_wait(b, 150, &st), BB_ERR_TIMEOUT);
	int64_t took = bbt_now_ms() - t0;
	/* The daemon's timer: not early (a few ms of clock rounding aside), and
	 * late by no more than a round trip and scheduling can explain, so
	 * that a timer firing 3x late already fails. The slack scales with
	 * the run's slowness (BBT_SLOW), the bound does not widen. */
	cr_assert_geq(took, 145, "a 150 ms wait returned after %lld ms", (long long)took);
	cr_assert_lt(took, 150 + bbt_ms(250), "a 150 ms wait returned after %lld ms",
		     (long long)took);

	t0 = bbt_now_ms();
	cr_assert_eq(bb_wait(b, 0, &st), BB_ERR_TIMEOUT, "a poll of a PENDING buffer");
	cr_assert_eq(bb_wait(b, 0, NULL), BB_ERR_TIMEOUT, "state_out may be NULL");
	cr_assert_lt(bbt_now_ms() - t0, 1000, "polls took too long");
	cr_assert_eq(stat_of(c, bb_id(b)).state, BB_PENDING, "a timeout changes nothing");
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Opens the buffer, says it is about to wait, waits; 0 when it woke READY
 * and sees the producer's bytes. */
static int waiter_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	bb_state st = BB_PENDING;
	void *p;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_open(c, x->id, &b) != 0)
		return 11;
	if (bbt_send(x->ch.fd[1], "p", 1) != 0)
		return 12;
	int rc = bb_wait(b, x->mode ? -1 : CHILD_TIMEOUT_MS, &st);
	if (rc != 0)
		return 13;
	if (st != BB_READY)
		return 14;
	if (bb_map(b, &p) != 0 || !bbt_check(p, x->size, x->seed))
		return 15;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(api, waiter_in_another_process_wakes_when_producer_sets_ready)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock, .size = 8192, .seed = 77, .mode = 1};
	char r;

	bb_buf *b = alloc_host(c, x.size, NULL, BB_SHARE_UID);
	x.id = bb_id(b);
	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(waiter_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0,
		     "waiter did not start (exit %d)", bbt_join(pid, 0));
	uint64_t waits;
	cr_assert(bbt_waits_until(c, 1, CHILD_TIMEOUT_MS, &waits),
		  "the other process's wait never parked (%llu parked waits)",
		  (unsigned long long)waits);
	bbt_fill(map_of(b), x.size, x.seed);
	int64_t t0 = bbt_now_ms();
	cr_assert_eq(bb_set_ready(b), 0);
	int code = bbt_join(pid, 3000);
	cr_assert_eq(code, 0, "waiter failed at step %d", code);
	cr_assert_lt(bbt_now_ms() - t0, bbt_ms(2000), "the waiter woke late");
	bbt_chan_close(&x.ch);
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* The producer allocates, hands its only reference over as a token and
 * exits before setting a state. */
static int vanishing_producer_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	bb_token t;
	uint64_t id;
	char go;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_alloc(c, &o, &b) != 0)
		return 11;
	id = bb_id(b);
	if (bb_take(b, &t) != 0)
		return 12;
	if (bbt_send(x->ch.fd[1], &id, sizeof(id)) != 0 ||
	    bbt_send(x->ch.fd[1], &t, sizeof(t)) != 0)
		return 13;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
		return 14;
	bbt_abandon(c);
	return 0; /* _exit without bb_disconnect: the kernel closes the socket */
}

Test(api, producer_exit_before_ready_fails_the_buffer)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock};
	uint64_t id;
	bb_token t;
	bb_buf *b = NULL;
	bb_state st = BB_PENDING;

	bbt_chan_open(&x.ch);
	pid_t pid = bbt_spawn(vanishing_producer_child, &x);
	cr_assert_eq(bbt_recv(x.ch.fd[0], &id, sizeof(id), CHILD_TIMEOUT_MS), 0, "producer exit %d",
		     bbt_join(pid, 0));
	cr_assert_eq(bbt_recv(x.ch.fd[0], &t, sizeof(t), CHILD_TIMEOUT_MS), 0);
	cr_assert_eq(bb_adopt(c, &t, &b), 0, "bb_adopt: %s", bb_last_error());
	cr_assert_eq(bb_wait(b, 0, &st), BB_ERR_TIMEOUT, "PENDING while the producer lives");
	cr_assert_eq(bbt_send(x.ch.fd[0], "x", 1), 0);
	cr_assert_eq(bb_wait(b, 5000, &st), 0, "bb_wait after the producer exited: %s",
		     bb_last_error());
	cr_assert_eq(st, BB_FAILED);
	cr_assert_eq(bbt_join(pid, CHILD_TIMEOUT_MS), 0);
	bb_info info = stat_of(c, id);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert(strstr(info.error, "producer disconnected"), "error text \"%s\"", info.error);
	cr_assert_eq(bb_set_ready(b), BB_ERR_STATE, "the failure is final");
	bbt_chan_close(&x.ch);
	bb_unref(b);
	assert_gone(c, id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* Allocates, reports the id, and on "go" dies of SIGKILL as soon as the
 * daemon shows x->waits parked waits (those on its buffer). */
static int killed_producer_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
	uint64_t id;
	char go;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_alloc(c, &o, &b) != 0)
		return 11;
	id = bb_id(b);
	if (bbt_send(x->ch.fd[1], &id, sizeof(id)) != 0)
		return 12;
	if (bbt_recv(x->ch.fd[1], &go, 1, CHILD_TIMEOUT_MS) != 0)
		return 13;
	if (!bbt_waits_until(c, x->waits, CHILD_TIMEOUT_MS, NULL))
		return 14;
	kill(getpid(), SIGKILL);
	return 15;
}

/* Waits forever on a buffer opened by id; 0 when it woke FAILED. */
static int failed_waiter_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	bb_state st = BB_PENDING;
	bb_info info;

	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_open(c, x->id, &b) != 0)
		return 11;
	if (bbt_send(x->ch.fd[1], "p", 1) != 0)
		return 12;
	if (bb_wait(b, -1, &st) != 0)
		return 13;
	if (st != BB_FAILED)
		return 14;
	if (bb_stat(c, x->id, &info) != 0 || !strstr(info.error, "producer disconnected"))
		return 15;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(api, producer_killed_while_waited_on_fails_the_buffer)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	/* The producer dies once both waits on its buffer are parked: the
	 * other process's and this one's. */
	struct ctx px = {.sock = d->sock, .waits = 2}, wx = {.sock = d->sock};
	bb_buf *b = NULL;
	bb_state st = BB_PENDING;
	char r;

	bbt_chan_open(&px.ch);
	bbt_chan_open(&wx.ch);
	pid_t producer = bbt_spawn(killed_producer_child, &px);
	cr_assert_eq(bbt_recv(px.ch.fd[0], &wx.id, sizeof(wx.id), CHILD_TIMEOUT_MS), 0,
		     "producer exit %d", bbt_join(producer, 0));
	cr_assert_eq(bb_open(c, wx.id, &b), 0, "bb_open: %s", bb_last_error());
	pid_t waiter = bbt_spawn(failed_waiter_child, &wx);
	cr_assert_eq(bbt_recv(wx.ch.fd[0], &r, 1, CHILD_TIMEOUT_MS), 0, "waiter exit %d",
		     bbt_join(waiter, 0));

	cr_assert_eq(bbt_send(px.ch.fd[0], "k", 1), 0);
	cr_assert_eq(bb_wait(b, 5000, &st), 0, "bb_wait while the producer is killed: %s",
		     bb_last_error());
	cr_assert_eq(st, BB_FAILED);
	cr_assert_eq(bbt_join(producer, CHILD_TIMEOUT_MS), 128 + SIGKILL);
	int code = bbt_join(waiter, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the waiter in another process failed at step %d", code);
	bb_info info = stat_of(c, wx.id);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert(strstr(info.error, "producer disconnected"), "error text \"%s\"", info.error);
	cr_assert_eq(info.refs, 1, "the killed producer's count is gone");
	bbt_chan_close(&px.ch);
	bbt_chan_close(&wx.ch);
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- names and errors -------------------------------------------------------- */

Test(api, name_is_unique_while_live_and_free_again_after)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_client *c2 = bbt_connect(d);
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST, .name = "bbt-unique-name"};
	bb_buf *b = NULL, *dup = NULL;

	cr_assert_eq(bb_alloc(c, &o, &b), 0);
	cr_assert_eq(bb_alloc(c, &o, &dup), BB_ERR_EXISTS, "same connection");
	cr_assert_eq(bb_alloc(c2, &o, &dup), BB_ERR_EXISTS, "another connection");
	bb_ref(b);
	bb_unref(b);
	cr_assert_eq(bb_alloc(c2, &o, &dup), BB_ERR_EXISTS, "still live after a non-last unref");

	uint64_t id = bb_id(b);
	bb_unref(b);
	cr_assert_eq(bb_alloc(c, &o, &b), 0, "the name is free again after the buffer: %s",
		     bb_last_error());
	cr_assert_neq(bb_id(b), id, "ids are never reused");
	id = bb_id(b);
	bb_unref(b);
	/* c's release is fire-and-forget: a round trip on c orders it before
	 * c2's alloc. */
	assert_gone(c, id);
	cr_assert_eq(bb_alloc(c2, &o, &dup), 0, "another connection reuses the name: %s",
		     bb_last_error());
	bb_unref(dup);
	bb_disconnect(c);
	bb_disconnect(c2);
	bbt_stop_clean(d);
}

struct errctx {
	bb_client *c;
	int rc;
	char text[512];
};

static void *not_found_thread(void *arg)
{
	struct errctx *e = arg;
	bb_buf *b = NULL;
	e->rc = bb_open(e->c, 0x7fffffff, &b);
	snprintf(e->text, sizeof(e->text), "%s", bb_last_error());
	return NULL;
}

Test(api, last_error_carries_the_daemons_message_per_thread)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	bb_alloc_opts o = {.size = 4096, .kind = BB_HOST, .name = "bbt-taken-name"};
	bb_buf *b = NULL, *dup = NULL;
	pthread_t th;
	struct errctx e = {.c = c};

	cr_assert_eq(bb_alloc(c, &o, &b), 0);
	cr_assert_eq(bb_alloc(c, &o, &dup), BB_ERR_EXISTS);
	cr_assert(strstr(bb_last_error(), "bbt-taken-name"),
		  "bb_last_error after EXISTS does not name the buffer: \"%s\"", bb_last_error());

	cr_assert_eq(pthread_create(&th, NULL, not_found_thread, &e), 0);
	pthread_join(th, NULL);
	cr_assert_eq(e.rc, BB_ERR_NOT_FOUND);
	cr_assert_neq(e.text[0], '\0', "bb_last_error after NOT_FOUND is empty");
	cr_assert(strstr(bb_last_error(), "bbt-taken-name"),
		  "another thread's failure replaced this thread's bb_last_error: \"%s\"",
		  bb_last_error());
	bb_unref(b);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- import ----------------------------------------------------------------- */

static int memfd_of_size(unsigned flags, off_t size)
{
	int fd = memfd_create("bbt-import", flags | MFD_CLOEXEC);
	cr_assert_geq(fd, 0, "memfd_create: %s", strerror(errno));
	cr_assert_eq(ftruncate(fd, size), 0, "ftruncate: %s", strerror(errno));
	return fd;
}

static int import_rc(bb_client *c, int fd, size_t size)
{
	bb_alloc_opts o = {.size = size, .kind = BB_HOST};
	bb_buf *b = NULL;
	int rc = bb_import_fd(c, fd, &o, &b);
	if (rc == 0)
		bb_unref(b);
	return rc;
}

Test(api, imported_memfd_is_shared_and_sealed)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock, .size = 8192, .seed = 0x1357, .mark_off = 8000};
	bb_alloc_opts o = {.size = x.size, .kind = BB_HOST, .name = "bbt-imported"};
	bb_buf *b = NULL;

	int fd = memfd_of_size(MFD_ALLOW_SEALING, (off_t)x.size);
	char *mine = mmap(NULL, x.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	cr_assert_neq(mine, MAP_FAILED);
	bbt_fill(mine, x.mark_off, x.seed);

	cr_assert_eq(bb_import_fd(c, fd, &o, &b), 0, "bb_import_fd: %s", bb_last_error());
	x.id = bb_id(b);
	cr_assert_eq(bb_size(b), x.size);
	bb_info info = stat_of(c, x.id);
	cr_assert_eq(info.state, BB_PENDING, "an imported buffer starts PENDING");
	cr_assert_eq(info.refs, 1);
	cr_assert_str_eq(info.name, "bbt-imported");

	int seals = fcntl(fd, F_GET_SEALS);
	int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
	cr_assert_eq(seals & want, want, "seals 0x%x after import, want 0x%x", seals, want);
	cr_assert_eq(seals & F_SEAL_WRITE, 0, "import must not write-seal");
	cr_assert_neq(ftruncate(fd, (off_t)x.size * 2), 0, "growing the imported memfd succeeded");
	cr_assert_neq(ftruncate(fd, 0), 0, "shrinking the imported memfd succeeded");
	cr_assert_neq(fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0,
		      "a write seal could still be added (no F_SEAL_SEAL)");

	char *p = map_of(b);
	cr_assert(bbt_check(p, x.mark_off, x.seed), "the buffer does not show the memfd's bytes");
	close(fd); /* the daemon keeps its own */
	cr_assert_eq(bb_set_ready(b), 0);

	x.mode = BY_ID;
	int code = bbt_join(bbt_spawn(reader_child, &x), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "reader of the imported buffer failed at step %d", code);
	cr_assert_eq(memcmp(mine + x.mark_off, "child-wrote-this", 16), 0,
		     "another process's write is not visible through the original memfd mapping");
	munmap(mine, x.size);

	bb_unref(b);
	assert_gone(c, x.id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, import_refuses_fds_it_cannot_seal)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	int pfd[2];
	char path[256];
	bbt_totals t;

	cr_assert_eq(pipe2(pfd, O_CLOEXEC), 0);
	cr_assert_eq(import_rc(c, pfd[0], 4096), BB_ERR_INVALID, "a pipe's read end");
	cr_assert_eq(import_rc(c, pfd[1], 4096), BB_ERR_INVALID, "a pipe's write end");
	close(pfd[0]);
	close(pfd[1]);

	snprintf(path, sizeof(path), "%s/regular-file", d->dir);
	int reg = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	cr_assert_geq(reg, 0);
	cr_assert_eq(ftruncate(reg, 8192), 0);
	cr_assert_eq(import_rc(c, reg, 4096), BB_ERR_INVALID, "a regular file");
	close(reg);

	int nosealing = memfd_of_size(0, 8192);
	cr_assert_eq(import_rc(c, nosealing, 4096), BB_ERR_INVALID,
		     "a memfd without MFD_ALLOW_SEALING");
	close(nosealing);

	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.buffers, 0, "a refused import left a buffer behind");
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, import_refuses_write_sealed_memfd)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);

	int w = memfd_of_size(MFD_ALLOW_SEALING, 8192);
	cr_assert_eq(fcntl(w, F_ADD_SEALS, F_SEAL_WRITE), 0, "F_SEAL_WRITE: %s", strerror(errno));
	cr_assert_eq(import_rc(c, w, 4096), BB_ERR_INVALID, "a memfd with F_SEAL_WRITE");
	close(w);

	int fw = memfd_of_size(MFD_ALLOW_SEALING, 8192);
	cr_assert_eq(fcntl(fw, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);
	cr_assert_eq(import_rc(c, fw, 4096), BB_ERR_INVALID, "a memfd with F_SEAL_FUTURE_WRITE");
	close(fw);

	int ok = memfd_of_size(MFD_ALLOW_SEALING, 8192);
	cr_assert_eq(import_rc(c, ok, 4096), 0, "an acceptable memfd: %s", bb_last_error());
	close(ok);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

Test(api, import_refuses_memfd_smaller_than_size_or_read_only)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	char path[64];

	int small = memfd_of_size(MFD_ALLOW_SEALING, 4096);
	cr_assert_eq(import_rc(c, small, 8192), BB_ERR_INVALID, "a 4096-byte memfd as 8192 bytes");
	cr_assert_eq(import_rc(c, small, 0), BB_ERR_INVALID, "size 0");

	snprintf(path, sizeof(path), "/proc/self/fd/%d", small);
	int ro = open(path, O_RDONLY | O_CLOEXEC);
	cr_assert_geq(ro, 0);
	cr_assert_eq(import_rc(c, ro, 4096), BB_ERR_INVALID, "a read-only fd of a memfd");
	close(ro);
	close(small);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- share policy ------------------------------------------------------------ */

struct share_ctx {
	const char *sock;
	gid_t gid;
	uint64_t uid_id, gid_id, any_id;
	bb_token token; /* for the uid-only buffer */
	uint32_t seed;
	size_t size;
};

static int become(uid_t uid, gid_t gid)
{
	if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
		return -1;
	prctl(PR_SET_DUMPABLE, 1);
	return getuid() == uid && geteuid() == uid && getgid() == gid ? 0 : -1;
}

/* As nobody:nogroup: the same-uid and same-gid buffers refuse it, the
 * anyone buffer and the token admit it. */
static int other_uid_child(void *arg)
{
	struct share_ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL, *b2 = NULL;
	bb_info info;
	void *p;

	if (become(NOBODY, x->gid) != 0)
		return 9;
	if (bb_connect(x->sock, &c) != 0)
		return 10;
	if (bb_open(c, x->uid_id, &b) != BB_ERR_DENIED)
		return 11;
	if (bb_open_name(c, "bbt-share-uid", &b) != BB_ERR_DENIED)
		return 12;
	if (bb_stat(c, x->uid_id, &info) != BB_ERR_DENIED)
		return 13;
	if (bb_retain(c, x->uid_id, 1) != BB_ERR_DENIED)
		return 14;
	if (x->gid != 0 && bb_open(c, x->gid_id, &b) != BB_ERR_DENIED)
		return 15;
	if (x->gid == 0) {
		/* Same group as the owner: admitted. */
		if (bb_open(c, x->gid_id, &b) != 0)
			return 16;
		if (bb_stat(c, x->gid_id, &info) != 0)
			return 17;
		bb_unref(b);
		bb_disconnect(c);
		return 0;
	}

	if (bb_open(c, x->any_id, &b) != 0)
		return 20;
	if (bb_open_name(c, "bbt-share-any", &b2) != 0 || b2 != b)
		return 21;
	if (bb_stat(c, x->any_id, &info) != 0 || info.refs != 2)
		return 22;
	if (bb_map(b, &p) != 0 || !bbt_check(p, x->size, x->seed))
		return 23;
	if (bb_retain(c, x->any_id, 1) != 0 || bb_release(c, x->any_id, 1) != 0)
		return 24;
	bb_unref(b);
	bb_unref(b);

	if (bb_adopt(c, &x->token, &b) != 0)
		return 30;
	if (bb_id(b) != x->uid_id)
		return 31;
	if (bb_map(b, &p) != 0 || !bbt_check(p, x->size, x->seed))
		return 32;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(api, share_policy_admits_by_uid_gid_or_anyone_and_a_token_admits_all)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to switch to another uid");
	static const char *const args[] = {"--socket-mode", "0666", NULL};
	bbt_daemon *d = bbt_start(args);
	cr_assert_eq(chmod(d->dir, 0755), 0);
	bb_client *c = bbt_connect(d);
	struct share_ctx x = {.sock = d->sock, .seed = 4242, .size = 4096};

	bb_buf *u = alloc_host(c, x.size, "bbt-share-uid", BB_SHARE_UID);
	bb_buf *g = alloc_host(c, x.size, "bbt-share-gid", BB_SHARE_GID);
	bb_buf *a = alloc_host(c, x.size, "bbt-share-any", BB_SHARE_ANY);
	bbt_fill(map_of(u), x.size, x.seed);
	bbt_fill(map_of(a), x.size, x.seed);
	x.uid_id = bb_id(u);
	x.gid_id = bb_id(g);
	x.any_id = bb_id(a);
	cr_assert_eq(bb_take(bb_ref(u), &x.token), 0);

	x.gid = NOBODY;
	int code = bbt_join(bbt_spawn(other_uid_child, &x), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the uid %d, gid %d child failed at step %d", NOBODY, NOBODY, code);
	x.gid = 0;
	code = bbt_join(bbt_spawn(other_uid_child, &x), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the uid %d, gid 0 child failed at step %d", NOBODY, code);

	cr_assert_eq(bbt_refs_until(c, x.uid_id, 1, 2000), 1,
		     "the adopted token went with the child");
	cr_assert_eq(bbt_refs_until(c, x.any_id, 1, 2000), 1);
	bb_unref(u);
	bb_unref(g);
	bb_unref(a);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

static int connect_as_nobody_child(void *arg)
{
	struct share_ctx *x = arg;
	bb_client *c = NULL;

	if (become(NOBODY, NOBODY) != 0)
		return 9;
	int rc = bb_connect(x->sock, &c);
	bb_disconnect(c);
	return rc == BB_ERR_DENIED ? 0 : rc == 0 ? 10 : 20 - rc;
}

Test(api, connect_without_socket_permission_is_denied)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to switch to another uid");
	static const char *const args[] = {"--socket-mode", "0660", NULL};
	bbt_daemon *d = bbt_start(args);
	cr_assert_eq(chmod(d->dir, 0755), 0);
	struct share_ctx x = {.sock = d->sock};
	int code = bbt_join(bbt_spawn(connect_as_nobody_child, &x), CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "uid %d on a 0660 root socket: step %d (10: connected; 20 - code)",
		     NOBODY, code);
	bbt_stop_clean(d);
}

/* ---- raw counts ---------------------------------------------------------------- */

Test(api, retain_and_release_counts_show_in_refs)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	uint32_t held, tokens;

	bb_buf *b = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	uint64_t id = bb_id(b);
	cr_assert_eq(bb_retain(c, id, 3), 0, "bb_retain: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, id), 4);
	raw_stat(c, id, &held, &tokens);
	cr_assert_eq(held, 4);
	cr_assert_eq(bb_release(c, id, 2), 0, "bb_release: %s", bb_last_error());
	cr_assert_eq(bbt_refs(c, id), 2);
	cr_assert_eq(bb_release(c, id, 5), BB_ERR_INVALID, "release of more than held");
	cr_assert_eq(bbt_refs(c, id), 2, "a refused release changes nothing");
	cr_assert_eq(bb_retain(c, 0x7ffffff0, 1), BB_ERR_NOT_FOUND);
	cr_assert_eq(bb_release(c, 0x7ffffff0, 1), BB_ERR_NOT_FOUND);
	cr_assert_eq(bb_retain(c, id, 0), BB_ERR_INVALID, "retain of 0");
	cr_assert_eq(bb_release(c, id, 0), BB_ERR_INVALID, "release of 0");

	bb_unref(b);
	cr_assert_eq(bbt_refs(c, id), 1, "the handle's count went; one raw count stays");
	cr_assert_eq(bb_release(c, id, 1), 0);
	assert_gone(c, id);
	bb_disconnect(c);
	bbt_stop_clean(d);
}

/* ---- connecting ----------------------------------------------------------------- */

Test(api, connect_with_null_path_uses_env_socket)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = NULL;
	bbt_totals t;
	char missing[256];

	cr_assert_eq(setenv("BUFBROKER_SOCKET", d->sock, 1), 0);
	int rc = bb_connect(NULL, &c);
	cr_assert_eq(rc, 0, "bb_connect(NULL) with BUFBROKER_SOCKET=%s: %d (%s)", d->sock, rc,
		     bb_last_error());
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.pid, (uint32_t)d->pid,
		     "connected to a daemon other than $BUFBROKER_SOCKET's");
	bb_disconnect(c);

	snprintf(missing, sizeof(missing), "%s/missing.sock", d->dir);
	cr_assert_eq(setenv("BUFBROKER_SOCKET", missing, 1), 0);
	c = NULL;
	cr_assert_eq(bb_connect(NULL, &c), BB_ERR_DISCONNECTED,
		     "$BUFBROKER_SOCKET names no socket");
	unsetenv("BUFBROKER_SOCKET");
	bbt_stop_clean(d);
}

Test(api, connect_to_missing_socket_is_disconnected)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = NULL;
	char path[256];

	snprintf(path, sizeof(path), "%s/missing.sock", d->dir);
	int64_t t0 = bbt_now_ms();
	cr_assert_eq(bb_connect(path, &c), BB_ERR_DISCONNECTED);
	cr_assert_neq(bb_last_error()[0], '\0', "no sentence for a failed connect");
	cr_assert_lt(bbt_now_ms() - t0, 2000, "connect to a missing socket hung");
	bbt_stop_clean(d);
}

/* ---- threads ------------------------------------------------------------------------ */

#define WORKERS 4
#define ROUNDS 150

struct mt {
	bb_client *c;
	bb_buf *shared;
	bb_buf *waited;
	int index;
	atomic_int *failures;
	int first_failure; /* the step of this worker's first failure */
	atomic_bool waiter_done;
	int wait_rc;
	bb_state wait_state;
};

static void mt_fail(struct mt *m, int step)
{
	if (!m->first_failure)
		m->first_failure = step;
	atomic_fetch_add(m->failures, 1);
}

static void *mt_worker(void *arg)
{
	struct mt *m = arg;
	for (int i = 0; i < ROUNDS; i++) {
		char name[64];
		snprintf(name, sizeof(name), "bbt-mt-%d-%d", m->index, i);
		bb_alloc_opts o = {.size = 4096, .kind = BB_HOST, .name = i % 2 ? name : NULL};
		bb_buf *b = NULL, *s = NULL;
		bb_info info;
		bb_state st;
		void *p;
		if (bb_alloc(m->c, &o, &b) != 0) {
			mt_fail(m, 1);
			continue;
		}
		if (bb_map(b, &p) != 0)
			mt_fail(m, 2);
		else
			memset(p, m->index, 4096);
		bb_ref(b);
		if (bb_stat(m->c, bb_id(b), &info) != 0 || info.refs != 1)
			mt_fail(m, 3);
		if (bb_open(m->c, bb_id(m->shared), &s) != 0 || s != m->shared)
			mt_fail(m, 4);
		else
			bb_unref(s);
		if (bb_wait(b, 0, &st) != BB_ERR_TIMEOUT)
			mt_fail(m, 5);
		if (bb_set_ready(b) != 0)
			mt_fail(m, 6);
		if (bb_wait(b, -1, &st) != 0 || st != BB_READY)
			mt_fail(m, 7);
		bb_unref(b);
		bb_unref(b);
	}
	return NULL;
}

static void *mt_waiter(void *arg)
{
	struct mt *m = arg;
	m->wait_rc = bb_wait(m->waited, -1, &m->wait_state);
	atomic_store(&m->waiter_done, true);
	return NULL;
}

/* Opens the waited-on buffer and sets it ready when told. */
static int ready_setter_child(void *arg)
{
	struct ctx *x = arg;
	bb_client *c = NULL;
	bb_buf *b = NULL;
	char go;

	if (bbt_recv(x->ch.fd[1], &go, 1, 20000) != 0)
		return 10;
	if (bb_connect(x->sock, &c) != 0)
		return 11;
	if (bb_open(c, x->id, &b) != 0)
		return 12;
	if (bb_set_ready(b) != 0)
		return 13;
	bb_unref(b);
	bb_disconnect(c);
	return 0;
}

Test(api, one_client_serves_many_threads_while_one_waits_forever)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *c = bbt_connect(d);
	struct ctx x = {.sock = d->sock};
	atomic_int failures = 0;
	struct mt w[WORKERS], waiter = {.c = c};
	pthread_t th[WORKERS], wth;
	bbt_totals t;

	bb_buf *shared = alloc_host(c, 4096, "bbt-mt-shared", BB_SHARE_UID);
	bb_buf *waited = alloc_host(c, 4096, NULL, BB_SHARE_UID);
	x.id = bb_id(waited);
	bbt_chan_open(&x.ch);
	/* Fork before any thread exists. */
	pid_t setter = bbt_spawn(ready_setter_child, &x);

	waiter.waited = waited;
	atomic_store(&waiter.waiter_done, false);
	cr_assert_eq(pthread_create(&wth, NULL, mt_waiter, &waiter), 0);
	uint64_t waits;
	cr_assert(bbt_waits_until(c, 1, CHILD_TIMEOUT_MS, &waits),
		  "the waiting thread's bb_wait(-1) never parked (%llu parked waits)",
		  (unsigned long long)waits);
	for (int i = 0; i < WORKERS; i++) {
		w[i] = (struct mt){.c = c, .shared = shared, .index = i, .failures = &failures};
		cr_assert_eq(pthread_create(&th[i], NULL, mt_worker, &w[i]), 0);
	}
	for (int i = 0; i < WORKERS; i++) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_sec += 20;
		cr_assert_eq(pthread_timedjoin_np(th[i], NULL, &ts), 0,
			     "worker %d is stuck (behind the parked wait?)", i);
	}
	for (int i = 0; i < WORKERS; i++)
		cr_assert_eq(w[i].first_failure, 0, "worker %d: %d failures, first at step %d", i,
			     atomic_load(&failures), w[i].first_failure);
	cr_assert_not(atomic_load(&waiter.waiter_done), "bb_wait(-1) returned early: %d",
		      waiter.wait_rc);
	cr_assert_eq(bbt_server_totals(c, &t), 0);
	cr_assert_eq(t.buffers, 2, "workers' buffers left behind: %llu buffers",
		     (unsigned long long)t.buffers);

	cr_assert_eq(bbt_send(x.ch.fd[0], "g", 1), 0);
	int code = bbt_join(setter, CHILD_TIMEOUT_MS);
	cr_assert_eq(code, 0, "the setter process failed at step %d", code);
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += 5;
	cr_assert_eq(pthread_timedjoin_np(wth, NULL, &ts), 0,
		     "bb_wait(-1) did not wake when another process set the buffer ready");
	cr_assert_eq(waiter.wait_rc, 0, "bb_wait(-1): %d", waiter.wait_rc);
	cr_assert_eq(waiter.wait_state, BB_READY);

	bbt_chan_close(&x.ch);
	bb_unref(shared);
	bb_unref(waited);
	bb_disconnect(c);
	bbt_stop_clean(d);
}
