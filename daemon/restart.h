/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Keeping the daemon's state across a restart (docs/RESTART.md): the fds
 * a restart needs (the journal, each host buffer's memfd, each VMM
 * allocation's exported fd) in systemd's fd store, or handed to a fresh
 * execve of the binary (planned upgrade); and the start from them.
 *
 * Names (FDNAME, LISTEN_FDNAMES): "journal-G" (generation G) and "k<n>"
 * (bundle n: a datagram socket whose queue holds up to 64 of the kept fds,
 * each with a record naming its buffer or allocation; docs/RESTART.md,
 * "Bundles") in systemd's store; "b<id>" (host buffer id) and "a<id>" (VMM
 * allocation id) for an fd passed by itself (an upgrade without a store,
 * or one no bundle could take). The listening socket is whatever the
 * socket unit names it ("bufbrokerd.socket" by systemd's default) and is
 * recognised by being a listening SOCK_SEQPACKET.
 *
 * Layer: between server (which owns it) and handler (it calls the broker,
 * the journal and the backends; nothing above it). Everything here runs on
 * the loop thread.
 */
#ifndef BB_RESTART_H
#define BB_RESTART_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "broker.h"

struct journal;
typedef struct restart restart;

typedef struct restart_config {
	bool journal;       /* [restart] journal: keep state at all */
	bool strict;        /* [restart] strict: a kept state that is refused
			      * makes the start fail (exit non-zero) instead of
			      * starting empty */
	uint64_t grace_ms;  /* [restart] grace: absent sessions' grace period */
	uint64_t store_max; /* FileDescriptorStoreMax as known ($FDSTORE), 0 unknown */
} restart_config;

/* What the start found (logs, metrics, ServerStatus). */
typedef struct restart_stats {
	uint64_t restarts;         /* starts from a kept state: the generation rebuilt from */
	uint64_t restored_buffers; /* buffers rebuilt by this process */
	uint64_t failed_legacy;    /* legacy CUDA buffers made FAILED at start */
	uint64_t failed_missing;   /* buffers whose fd was not kept: FAILED */
	uint64_t orphans_closed;   /* stored fds no buffer named */
	uint64_t unprotected;      /* live buffers whose fd could not be stored */
	uint64_t store_errors;     /* FDSTORE sends that failed */
	uint64_t names_bytes;      /* the stored bundles' names, with a separator
				    * each: what they add to LISTEN_FDNAMES
				    * (bounded: docs/RESTART.md) */
	uint64_t bundles;          /* bundles in the store */
	uint64_t start_us;         /* the restore's duration */
	bool refused;              /* a kept state was refused: started empty */
	bool protected_by_store;   /* the journal is in the fd store */
	int journal_fd;            /* the journal (its size for status), -1 off */
	char refused_why[256];
} restart_stats;

/* Take what LISTEN_FDS/LISTEN_FDNAMES passed (the listening
 * socket, journal-G, k<n> with the fds in its queue, b<id>, a<id>; unsets
 * the variables) and create the
 * journal (cfg->journal; generation one above the highest passed), which
 * the broker is then made with (restart_journal). Nothing is rebuilt yet.
 * 0, or an error with why (then the daemon does not start).
 * (Refined from the contract's single restart_start: the broker needs the
 * journal before it exists, and restart_start needs the broker.) */
int restart_new(restart **out, const restart_config *cfg, char *why, size_t len);
/* When a kept state was passed, rebuild broker b from it (made
 * with restart_journal(r) and broker_config.keep = restart_keep, its
 * backends set) with the backends adopting the fds (docs/RESTART.md,
 * "Starting from a kept state"); store the new journal generation and
 * remove the old one and the orphans; the bundles that hold an orphan are
 * rebuilt. A state that is refused: logged
 * (restart_refused), every stored fd removed and closed, b left empty; or,
 * with cfg->strict, an error. *listen_fd: the passed listening socket, or
 * -1. 0, or an error with why (then the daemon does not start). */
int restart_start(restart *r, broker *b, backend *host, backend *cuda, int *listen_fd, char *why,
		  size_t len);
void restart_free(restart *r);
/* The journal to hand the broker (broker_config.journal), or NULL when off. */
struct journal *restart_journal(restart *r);
/* The broker's fd store hook (broker_config.keep, keep_ctx r): dispatches
 * to restart_store_buffer / _allocation and their removals (an
 * allocation's fd goes in with its first live buffer and out with its
 * last). */
void restart_keep(void *r, const broker_kept *k, bool live);
/* The journal generation this process writes (journal-G), 0 when off. */
uint64_t restart_generation(const restart *r);

/* What a stored fd's name says (FDNAME, LISTEN_FDNAMES): RESTART_NAME_JOURNAL
 * ("journal-G", *id = G > 0), _BUFFER ("b<id>", id > 0), _ALLOCATION
 * ("a<id>", id > 0), _BUNDLE ("k<n>", n > 0), or _OTHER (anything else: a socket's name, a name this
 * daemon does not make). Decimal without sign or leading zero, no more than
 * fits 64 bits. */
enum {
	RESTART_NAME_OTHER,
	RESTART_NAME_JOURNAL,
	RESTART_NAME_BUFFER,
	RESTART_NAME_ALLOCATION,
	RESTART_NAME_BUNDLE
};
int restart_name_parse(const char *name, uint64_t *id);
const restart_stats *restart_get_stats(const restart *r);
const restart_config *restart_config_of(const restart *r);

/* The broker's store hooks: a buffer's or allocation's fd goes into a
 * bundle in the store before its first Grant is sent; after the commit
 * that frees it, its bundle is rebuilt without it at the end of the loop
 * turn (restart_flush). */
void restart_store_buffer(restart *r, uint64_t id, int fd);
void restart_unstore_buffer(restart *r, uint64_t id);
void restart_store_allocation(restart *r, uint64_t id, int fd);
void restart_unstore_allocation(restart *r, uint64_t id);
void restart_flush(restart *r); /* rebuild the bundles, send the batched removals */

/* Every fd a new image needs, as (name, fd) pairs, the journal first,
 * then the bundles, then the kept fds no bundle holds: what the store
 * holds, and what it could not take. For the execve upgrade. Returns
 * how many were given to fn; fn returning non-zero stops the walk. */
size_t restart_each_fd(restart *r, int (*fn)(void *ctx, const char *name, int fd), void *ctx);

/* The fds the store's bundles may make the daemon hold for kept_fds kept
 * fds (docs/OPERATIONS.md, "Open files"); 0 when nothing is stored. */
uint64_t restart_bundle_fds(const restart *r, uint64_t kept_fds);
/* The fd store entries (FileDescriptorStoreMax) kept_fds kept fds need. */
uint64_t restart_store_need(uint64_t kept_fds);
/* The fds the bundles hold now. */
uint64_t restart_held_fds(const restart *r);

#endif /* BB_RESTART_H */
