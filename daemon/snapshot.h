/* SPDX-License-Identifier: Apache-2.0 */
/*
 * One snapshot of the daemon's state, gathered from the broker, the
 * backends, the parking lot and the request counters: what the
 * ServerStatus answer and the metrics endpoint report, so that both say
 * the same thing and neither reaches into the layers that serve requests.
 *
 * Loop thread only (the broker is not thread-safe).
 */
#ifndef BB_SNAPSHOT_H
#define BB_SNAPSHOT_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "broker.h"
#include "metrics.h"
#include "park.h"

/* The most devices a snapshot lists. */
#define SNAPSHOT_DEVICES_MAX 64

/* Where a snapshot is read from: set up by the server, read-only here. */
typedef struct snapshot_sources {
	uv_loop_t *loop;                     /* its clock, for the uptime */
	uint64_t started_ms;                 /* uv_now when the daemon started serving */
	broker *b;                           /* buffers, connections, tokens, limits */
	backend *host;                       /* the host backend (its reuse pool) */
	backend *cuda;                       /* the CUDA backend, or NULL */
	const char *cuda_why;                /* why CUDA is not served; "" when it is */
	const park *park;                    /* parked allocs */
	const metrics_counters *counters;    /* requests, latency, the server's refusals */
	const struct restart_stats *restart; /* the start from a kept state, or NULL */
} snapshot_sources;

/* Live buffers of one owner uid. */
typedef struct snapshot_uid {
	uint32_t uid;                 /* the owner */
	uint64_t buffers;             /* its live buffers */
	uint64_t bytes[BROKER_KINDS]; /* their bytes, by kind */
} snapshot_uid;

/* Keeping state across restarts (docs/RESTART.md). */
typedef struct snapshot_restart {
	uint64_t restarts;         /* starts from a kept state since the journal was made */
	uint64_t restored_buffers; /* buffers rebuilt at this process's start */
	uint64_t failed_legacy;    /* ... made FAILED: legacy CUDA */
	uint64_t failed_missing;   /* ... made FAILED: their fd was not kept */
	uint64_t unprotected;      /* live buffers whose fd is not in the store */
	uint64_t bundles;          /* fd store entries holding the buffers' fds */
	uint32_t absent_sessions;  /* restored sessions not resumed yet */
	uint64_t journal_bytes;    /* the journal's size; 0: off */
	uint64_t journal_errors;   /* journal puts refused */
	bool protected_by_store;   /* the journal is in the fd store */
	bool refused;              /* the kept state was refused at start */
} snapshot_restart;

typedef struct snapshot {
	uint64_t uptime_ms;                           /* since the daemon started serving */
	broker_totals totals;                         /* the broker's */
	uint64_t parked_allocs;                       /* allocs waiting for a backend job */
	backend_host_pool_stats pool;                 /* the host memfd reuse pool */
	backend_device devices[SNAPSHOT_DEVICES_MAX]; /* CUDA devices served */
	int n_devices;                                /* entries of devices */
	const char *cuda_why;                         /* why CUDA is not served; "" when it is */
	const metrics_counters *counters;             /* the counters (not copied) */
	snapshot_uid *uids;                           /* with_uids: per owner uid, malloc'ed */
	size_t n_uids;                                /* entries of uids */
	snapshot_restart restart;                     /* restarts and the journal */
} snapshot;

/* Fill *out from src; with_uids also lists the owner uids (in no
 * particular order). 0, or -1 out of memory (*out is then empty and needs
 * no release). */
int snapshot_take(const snapshot_sources *src, snapshot *out, bool with_uids);
/* Free what snapshot_take allocated in *s. */
void snapshot_release(snapshot *s);

#endif /* BB_SNAPSHOT_H */
