/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's snapshot: read from the sources on the loop thread.
 */
#include "snapshot.h"
#include <sys/stat.h>
#include "restart.h"

#include <stdlib.h>
#include <string.h>

typedef struct uid_acc {
	snapshot *s; /* where rows go */
	size_t cap;  /* rows allocated */
	bool failed; /* out of memory */
} uid_acc;

static void uid_row(uint32_t uid, uint64_t buffers, const uint64_t bytes[BROKER_KINDS], void *arg)
{
	uid_acc *a = arg;
	if (a->failed)
		return;
	if (a->s->n_uids == a->cap) {
		size_t cap = a->cap ? a->cap * 2 : 16;
		snapshot_uid *rows = realloc(a->s->uids, cap * sizeof(*rows));
		if (!rows) {
			a->failed = true;
			return;
		}
		a->s->uids = rows;
		a->cap = cap;
	}
	snapshot_uid *r = &a->s->uids[a->s->n_uids++];
	r->uid = uid;
	r->buffers = buffers;
	memcpy(r->bytes, bytes, sizeof(r->bytes));
}

int snapshot_take(const snapshot_sources *src, snapshot *out, bool with_uids)
{
	memset(out, 0, sizeof(*out));
	out->uptime_ms = uv_now(src->loop) - src->started_ms;
	broker_totals_get(src->b, &out->totals);
	out->parked_allocs = park_allocs_count(src->park);
	backend_host_pool_info(src->host, &out->pool);
	if (src->cuda && src->cuda->devices)
		out->n_devices = src->cuda->devices(src->cuda, out->devices, SNAPSHOT_DEVICES_MAX);
	out->cuda_why = src->cuda_why;
	out->counters = src->counters;
	snapshot_restart *rs = &out->restart;
	rs->absent_sessions = broker_absent_sessions(src->b);
	rs->journal_errors = broker_journal_errors(src->b);
	const restart_stats *st = src->restart;
	if (st) {
		struct stat sb;
		rs->restarts = st->restarts;
		rs->restored_buffers = st->restored_buffers;
		rs->failed_legacy = st->failed_legacy;
		rs->failed_missing = st->failed_missing;
		rs->unprotected = st->unprotected;
		rs->bundles = st->bundles;
		rs->protected_by_store = st->protected_by_store;
		rs->refused = st->refused;
		if (st->journal_fd >= 0 && fstat(st->journal_fd, &sb) == 0)
			rs->journal_bytes = (uint64_t)sb.st_size;
	}
	if (with_uids) {
		uid_acc a = {.s = out};
		broker_uid_usage(src->b, uid_row, &a);
		if (a.failed) {
			snapshot_release(out);
			return -1;
		}
	}
	return 0;
}

void snapshot_release(snapshot *s)
{
	free(s->uids);
	s->uids = NULL;
	s->n_uids = 0;
}
