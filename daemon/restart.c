/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Keeping the daemon's state across a restart (docs/RESTART.md, "The
 * systemd fd store" and "Starting from a kept state"). The table of the
 * fds a restart needs is kept whether or not there is a store to put them
 * in (restart_each_fd lists it for the execve upgrade); they are sent to
 * systemd's fd store only when NOTIFY_SOCKET is set and the journal is on.
 */
#include "restart.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
#include <uthash.h>
#include <utlist.h>

#include "journal.h"
#include "log.h"
#include "msgio.h"

/* What a legacy CUDA buffer says after a restart (RESTART.md, "Legacy CUDA
 * buffers"). */
#define RESTART_LEGACY_WHY                                                              \
	"the daemon restarted: legacy CUDA IPC memory does not survive its allocating " \
	"process; use VMM buffers (BB_CUDA_HANDLE_VMM) where restarts matter"
#define RESTART_MISSING_WHY "its memory was not kept across the restart"

/* VMM allocation identities of journal generation G start above
 * (G - 1) << this: 2^40 allocations per daemon run. */
#define RESTART_ALLOCATION_SHIFT 40

/* The longest name this daemon gives a stored fd ("journal-" or a letter,
 * then up to 20 digits). */
#define NAME_MAX_LEN 32

/* What the names of the stored fds may take in all. systemd hands them back
 * in one environment string, LISTEN_FDNAMES=<socket's name>:<name>:...,
 * and the kernel refuses any single string over MAX_ARG_STRLEN (32 pages,
 * 128 KiB) with E2BIG: a store whose names are longer could not start the
 * daemon again at all. Room is left for "LISTEN_FDNAMES=", the socket
 * unit's name (at most 255 bytes, as any FDNAME), two journals (the
 * handover at a start) and a margin; each b<id> or a<id> costs its length
 * and a separator. $BUFBROKERD_TEST_FDNAMES_MAX sets another bound (tests
 * only). */
#define RESTART_ENV_MAX (32u * 4096u)
#define RESTART_NAMES_MAX \
	(RESTART_ENV_MAX - sizeof("LISTEN_FDNAMES=") - 256 - 2 * NAME_MAX_LEN - 1024)

/* Kept fds per bundle: a rebuild resends at most this many, and the
 * store needs one entry per this many kept fds (docs/RESTART.md,
 * "Bundles"). Well under what a socket's send buffer holds (about 270
 * messages at the default 208 KiB). */
#define BUNDLE_MAX 64

typedef struct bundle bundle;

/* One kept fd: a live buffer's memfd or a VMM allocation's fd, by id; or,
 * at the start, one that was passed to us. */
typedef struct kept {
	uint64_t id;      /* buffer or allocation id */
	int fd;           /* borrowed from the backend once live; passed: ours, -1 once adopted */
	uint32_t buffers; /* allocations: live buffers in it */
	char letter;      /* 'b' host buffer, 'a' VMM allocation */
	bool named;       /* in the store under its own name ("b<id>", as an
			    * earlier daemon kept it): removed once bundled */
	bundle *bundle;   /* live: the bundle whose queue holds it (a
			    * member); passed: where it was found; NULL: none */
	struct kept *bprev, *bnext; /* live: the bundle's members (utlist DL) */
	UT_hash_handle hh;          /* in one of restart's tables */
} kept;

/* A bundle (docs/RESTART.md, "Bundles"): a datagram socketpair whose
 * receiving end is in the store as "k<n>" and whose queue holds one
 * message per kept fd, the fd attached (SCM_RIGHTS) to a bundle_rec that
 * names it. */
struct bundle {
	uint64_t n;       /* "k<n>" */
	int rx;           /* the stored end, holding the queue; ours too (an upgrade passes it) */
	int tx;           /* the sending end while open; -1 once sealed, or passed */
	uint32_t entries; /* messages in rx's queue */
	uint32_t members; /* of them, live kept fds (the members list) */
	bool dirty;       /* in restart's dirty list: rebuilt at restart_flush */
	bool rebuild;     /* rebuilt even if every message names a member (a name passed twice) */
	kept *first;      /* the members (kept.bprev/bnext) */
	bundle *prev, *next; /* restart's bundles (utlist DL) */
	bundle *dnext;       /* restart's dirty list */
};

/* What one message of a bundle says of its fd. */
typedef struct bundle_rec {
	uint8_t magic[2]; /* 'b', 'k' */
	uint8_t version;  /* BUNDLE_REC_VERSION */
	uint8_t letter;   /* 'b' host buffer, 'a' VMM allocation */
	uint32_t zero;    /* 0 */
	uint64_t id;      /* the buffer's or allocation's id, host byte order */
} bundle_rec;

#define BUNDLE_REC_VERSION 1

/* The two open bundles: new fds go to the fresh one, fds a rebuild moves
 * to the tenured one (they have lived through a rebuild already: kept
 * apart from the churn of new ones, they are seldom moved again). */
enum { BUNDLE_FRESH, BUNDLE_TENURED };

/* A journal that was passed (journal-G). */
typedef struct passed_journal {
	uint64_t generation;
	int fd;
} passed_journal;

struct restart {
	restart_config cfg;
	journal *j;                     /* cfg.journal: this process's journal */
	uint64_t generation;            /* j's: journal-<generation> */
	bool notify;                    /* NOTIFY_SOCKET set: there is a store */
	bool store;                     /* ... and the journal is on: keep fds in it */
	int notify_fd;                  /* connected to NOTIFY_SOCKET; -1: sd_notify's own */
	int listen_fd;                  /* the passed listening socket, -1 */
	kept *bufs;                     /* live host buffers' memfds */
	kept *allocs;                   /* live VMM allocations' fds */
	backend *cuda;                  /* to get an allocation's fd */
	bool restoring;                 /* inside broker_restore: the fds are stored already */
	kept *pbufs;                    /* passed b<id>, until adopted or closed */
	kept *pallocs;                  /* passed a<id>, until adopted or closed */
	bundle *bundles;                /* in the store (made here or passed) */
	bundle *open[2];                /* BUNDLE_FRESH, BUNDLE_TENURED; NULL: none open */
	bundle *dirty;                  /* bundles that lost a member this turn */
	uint64_t next_bundle;           /* the next bundle's number */
	size_t names_max;               /* RESTART_NAMES_MAX, or the test's bound */
	bool warned_names;              /* the first add past names_max was logged */
	bool warned_bundle;             /* the first bundle failure was logged */
	passed_journal *journals;       /* passed journal-G, highest first */
	size_t njournals;               /* entries of journals */
	char (*others)[NAME_MAX_LEN];   /* passed fds of unknown names: removed */
	int *other_fds;                 /* ... and their fds */
	size_t nothers;                 /* entries of others */
	char (*removals)[NAME_MAX_LEN]; /* names to remove at the end of the turn */
	size_t nremovals, capremovals;
	bool warned_unprotected; /* the first failed add was logged */
	uint64_t retried_us;     /* the last try at the unprotected (mono_us) */
	restart_stats stats;
	/* Where the start's time went (us; the restart log line). */
	uint64_t new_at_us; /* restart_new was called */
	uint64_t take_us;   /* taking what LISTEN_FDS passed */
	uint64_t adopt_us;  /* the backends adopting the kept fds (in the rebuild) */
	uint64_t store_us;  /* storing the new journal */
	uint64_t drop_us;   /* removing and closing the old journals and orphans */
};

/* ---- names ------------------------------------------------------------------- */

static int parse_decimal(const char *s, uint64_t *out)
{
	uint64_t v = 0;
	if (!*s || (s[0] == '0'))
		return -1; /* empty, zero or a leading zero */
	for (; *s; s++) {
		if (*s < '0' || *s > '9')
			return -1;
		unsigned d = (unsigned)(*s - '0');
		if (v > (UINT64_MAX - d) / 10)
			return -1;
		v = v * 10 + d;
	}
	*out = v;
	return 0;
}

int restart_name_parse(const char *name, uint64_t *id)
{
	if (!name)
		return RESTART_NAME_OTHER;
	if (!strncmp(name, "journal-", 8))
		return parse_decimal(name + 8, id) ? RESTART_NAME_OTHER : RESTART_NAME_JOURNAL;
	if (name[0] == 'b')
		return parse_decimal(name + 1, id) ? RESTART_NAME_OTHER : RESTART_NAME_BUFFER;
	if (name[0] == 'a')
		return parse_decimal(name + 1, id) ? RESTART_NAME_OTHER : RESTART_NAME_ALLOCATION;
	if (name[0] == 'k')
		return parse_decimal(name + 1, id) ? RESTART_NAME_OTHER : RESTART_NAME_BUNDLE;
	return RESTART_NAME_OTHER;
}

/* ---- talking to the fd store --------------------------------------------------- */

/* A datagram socket connected to NOTIFY_SOCKET when it is a path or an
 * abstract name; -1 otherwise (then sd_pid_notify_with_fds does it). */
static int notify_connect(void)
{
	const char *e = getenv("NOTIFY_SOCKET");
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	size_t n = e ? strlen(e) : 0;
	if (n < 2 || n >= sizeof(sa.sun_path) || (e[0] != '/' && e[0] != '@'))
		return -1;
	memcpy(sa.sun_path, e, n);
	if (e[0] == '@')
		sa.sun_path[0] = '\0';
	int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	/* A full notify socket (systemd busy, or a small max_dgram_qlen)
	 * holds the loop this long per add at most; then the buffer is
	 * served unprotected. */
	struct timeval tv = {.tv_sec = 0, .tv_usec = 10000};
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	if (connect(fd, (struct sockaddr *)&sa,
		    (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n)) < 0) {
		close(fd);
		return -1;
	}
	return fd;
}

/* Send one notification, with fd attached when fd >= 0. 0, or -errno. */
static int notify(restart *r, const char *msg, int fd)
{
	if (r->notify_fd < 0) {
		int rc = sd_pid_notify_with_fds(0, 0, msg, fd >= 0 ? &fd : NULL, fd >= 0 ? 1 : 0);
		return rc > 0 ? 0 : rc < 0 ? rc : -ENOTCONN;
	}
	/* A full notify socket: the send waits at most SO_SNDTIMEO. */
	ssize_t n = msgio_send(r->notify_fd, msg, strlen(msg), fd);
	return n < 0 ? (int)n : 0;
}

/* Store fd under name. A bundle's receiving end says FDPOLL=0: systemd
 * would otherwise drop a stored fd that reports an error or a hangup, and
 * a bundle is kept for its queue alone. */
static int store_add(restart *r, const char *name, int fd, bool bundle)
{
	char msg[64 + NAME_MAX_LEN];
	snprintf(msg, sizeof(msg), "FDSTORE=1\nFDNAME=%s%s", name, bundle ? "\nFDPOLL=0" : "");
	int rc = notify(r, msg, fd);
	if (rc < 0)
		r->stats.store_errors++;
	return rc;
}

static void store_remove_now(restart *r, const char *name)
{
	if (!r->notify)
		return; /* no store (an execve upgrade without systemd) */
	char msg[64 + NAME_MAX_LEN];
	snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", name);
	if (notify(r, msg, -1) < 0)
		r->stats.store_errors++;
}

/* Queue the removal of name for restart_flush. */
static void store_remove(restart *r, const char *name)
{
	if (r->nremovals == r->capremovals) {
		size_t n = r->capremovals ? r->capremovals * 2 : 64;
		void *p = realloc(r->removals, n * sizeof(*r->removals));
		if (!p) {
			store_remove_now(r, name); /* no room to defer: now */
			return;
		}
		r->removals = p;
		r->capremovals = n;
	}
	snprintf(r->removals[r->nremovals++], NAME_MAX_LEN, "%s", name);
}

static void name_of(char *out, char letter, uint64_t id)
{
	snprintf(out, NAME_MAX_LEN, "%c%" PRIu64, letter, id);
}

/* ---- bundles ------------------------------------------------------------------- */

/*
 * The store holds no buffer's fd by itself: systemd passes one name per
 * stored fd in one environment string (LISTEN_FDNAMES, which the kernel
 * bounds at 128 KiB) and compares each fd it is given with every one it
 * has. A bundle holds up to BUNDLE_MAX kept fds for one stored fd and one
 * short name (docs/RESTART.md, "Bundles"):
 *
 * - A new fd is sent (the daemon's own fd, again) to the open fresh
 *   bundle. A bundle is sealed, its sending end closed, once it has
 *   BUNDLE_MAX messages or its queue is full; the store has its receiving
 *   end from the moment it is made.
 * - A message cannot be taken out of a queue, and it keeps its file (and a
 *   closed memfd's pages) alive. So a bundle that lost a member is rebuilt
 *   at the end of the loop turn: its live members are sent to the tenured
 *   bundle, then it leaves the store and is closed. A crash in between
 *   leaves a member in two bundles: one file, found twice, kept once.
 * - At the end of a turn every bundle but the two open ones holds
 *   BUNDLE_MAX live fds: ceil(kept fds / BUNDLE_MAX) + 2 bundles.
 */

static size_t bundle_name(char *out, uint64_t n)
{
	return (size_t)snprintf(out, NAME_MAX_LEN, "k%" PRIu64, n);
}

static void bundle_seal(restart *r, bundle *b)
{
	if (b->tx >= 0)
		close(b->tx);
	b->tx = -1;
	for (int i = 0; i < 2; i++)
		if (r->open[i] == b)
			r->open[i] = NULL;
}

/* Out of the store and closed; its messages' fds with it. */
static void bundle_drop(restart *r, bundle *b)
{
	char name[NAME_MAX_LEN];
	size_t cost = bundle_name(name, b->n) + 1;
	store_remove_now(r, name);
	bundle_seal(r, b);
	close(b->rx);
	DL_DELETE(r->bundles, b);
	r->stats.names_bytes -= cost;
	r->stats.bundles--;
	free(b);
}

static void bundle_warn(restart *r, const char *what, int err)
{
	if (r->warned_bundle)
		return;
	r->warned_bundle = true;
	log_warn("event=fdstore_bundle_failed what=\"%s\" error=\"%s\" note=\"buffers past it are "
		 "served, but lost at a restart; further failures are counted "
		 "(bufbroker_restart_unprotected_buffers), not logged\"",
		 what, strerror(err));
}

/* A new bundle, stored, open as r->open[which]; NULL when none can be had
 * (the names bound, the store's size, no socket, the store refusing). */
static bundle *bundle_open(restart *r, int which)
{
	char name[NAME_MAX_LEN];
	size_t cost = bundle_name(name, r->next_bundle) + 1;
	if (r->stats.names_bytes + cost > r->names_max) {
		/* Stored, it would keep the daemon from starting again. */
		if (!r->warned_names) {
			r->warned_names = true;
			log_warn("event=fdstore_names_full name=%s names_bytes=%" PRIu64
				 " names_max=%zu note=\"served, but lost at a restart: "
				 "LISTEN_FDNAMES would pass the kernel's 128 KiB bound; further "
				 "buffers are counted, not logged\"",
				 name, r->stats.names_bytes, r->names_max);
		}
		return NULL;
	}
	/* Within FileDescriptorStoreMax when it is known: two journals (the
	 * handover at a start) and the bundles. */
	if (r->cfg.store_max && r->stats.bundles + 2 >= r->cfg.store_max) {
		bundle_warn(r, "the fd store is full (FileDescriptorStoreMax)", ENOSPC);
		return NULL;
	}
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) < 0) {
		bundle_warn(r, "socketpair", errno);
		return NULL;
	}
	bundle *b = calloc(1, sizeof(*b));
	int rc = b ? store_add(r, name, sv[1], true) : -ENOMEM;
	if (rc < 0) {
		bundle_warn(r, "storing a bundle", -rc);
		close(sv[0]);
		close(sv[1]);
		free(b);
		return NULL;
	}
	b->n = r->next_bundle++;
	b->tx = sv[0];
	b->rx = sv[1];
	DL_APPEND(r->bundles, b);
	r->stats.names_bytes += cost;
	r->stats.bundles++;
	r->open[which] = b;
	return b;
}

static void bundle_dirty(restart *r, bundle *b)
{
	if (b->dirty)
		return;
	b->dirty = true;
	b->dnext = r->dirty;
	r->dirty = b;
}

/* One message of n records with their fds, in order (n <= BUNDLE_MAX).
 * The bytes sent, or -errno (the sending end is non-blocking). */
static ssize_t bundle_send(int tx, kept *const *ks, size_t n)
{
	bundle_rec recs[BUNDLE_MAX];
	int fds[BUNDLE_MAX];
	for (size_t i = 0; i < n; i++) {
		recs[i] = (bundle_rec){.magic = {'b', 'k'},
				       .version = BUNDLE_REC_VERSION,
				       .letter = (uint8_t)ks[i]->letter,
				       .id = ks[i]->id};
		fds[i] = ks[i]->fd;
	}
	return msgio_send_fds(tx, recs, n * sizeof(recs[0]), fds, n);
}

/* Send the fds of ks[0..n) to the open bundle `which` (one made when there
 * is none or it is full), as few messages as its room allows, and make
 * them its members. How many were placed (a prefix of ks); the rest are in
 * no bundle. A fresh bundle that fills up is sealed and marked to be
 * repacked at the end of the turn: its members, one message each so far,
 * then move to the tenured bundle in one message (a socket buffer per
 * message is what a bundle costs the kernel). */
static size_t bundle_put_many(restart *r, kept *const *ks, size_t n, int which)
{
	size_t done = 0;
	for (int tries = 0; done < n && tries < 2;) {
		bundle *b = r->open[which];
		if (b && b->entries >= BUNDLE_MAX) {
			bundle_seal(r, b);
			b = NULL;
		}
		if (!b && !(b = bundle_open(r, which)))
			break;
		size_t room = BUNDLE_MAX - b->entries;
		size_t c = n - done < room ? n - done : room;
		ssize_t sent = bundle_send(b->tx, ks + done, c);
		if (sent == (ssize_t)(c * sizeof(bundle_rec))) {
			for (size_t i = done; i < done + c; i++) {
				ks[i]->bundle = b;
				DL_APPEND2(b->first, ks[i], bprev, bnext);
			}
			b->entries += (uint32_t)c;
			b->members += (uint32_t)c;
			done += c;
			tries = 0;
			if (b->entries >= BUNDLE_MAX) {
				bundle_seal(r, b);
				if (which == BUNDLE_FRESH) {
					b->rebuild = true;
					bundle_dirty(r, b);
				}
			}
			continue;
		}
		/* Its queue is full (its send buffer), or the send failed: no
		 * more into this one. */
		bundle_seal(r, b);
		if (!b->entries)
			bundle_drop(r, b);
		if (sent != -EAGAIN && sent != -ENOBUFS) {
			bundle_warn(r, "sending fds to a bundle", sent < 0 ? (int)-sent : EIO);
			break;
		}
		tries++;
	}
	return done;
}

/* k's fd to the open bundle `which`. 0, or -1: k is in no bundle. */
static int bundle_put(restart *r, kept *k, int which)
{
	return bundle_put_many(r, &k, 1, which) == 1 ? 0 : -1;
}

/* k leaves its bundle's members (it is freed, or moved). */
static void bundle_leave(restart *r, kept *k)
{
	bundle *b = k->bundle;
	DL_DELETE2(b->first, k, bprev, bnext);
	k->bprev = k->bnext = NULL;
	b->members--;
	k->bundle = NULL;
	bundle_dirty(r, b);
}

/* Rebuild the bundles that lost members: every member moved to the
 * tenured bundle first, then the emptied ones out of the store. A member
 * that cannot be moved keeps its bundle in the store. */
static size_t bundles_rebuild(restart *r)
{
	size_t dropped = 0;
	bundle *drop = NULL;
	for (bundle *b = r->dirty, *next; b; b = next) {
		next = b->dnext;
		b->dirty = false;
		if (b->members && b->members == b->entries && !b->rebuild)
			continue; /* whole again (an empty one goes) */
		bundle_seal(r, b);
		bool all = true;
		/* Taken off b's list first: one that cannot be moved goes
		 * back to it, and must not come round in this walk again.
		 * Moved BUNDLE_MAX at a time, one message each. */
		kept *moving = b->first, *batch[BUNDLE_MAX];
		b->first = NULL;
		while (moving) {
			size_t n = 0;
			while (moving && n < BUNDLE_MAX) {
				kept *k = moving;
				DL_DELETE2(moving, k, bprev, bnext);
				k->bundle = NULL;
				b->members--;
				batch[n++] = k;
			}
			for (size_t i = bundle_put_many(r, batch, n, BUNDLE_TENURED); i < n; i++) {
				batch[i]->bundle = b;
				DL_APPEND2(b->first, batch[i], bprev, bnext);
				b->members++;
				all = false;
			}
		}
		if (all) {
			b->dnext = drop;
			drop = b;
		}
	}
	r->dirty = NULL;
	for (bundle *b = drop, *next; b; b = next) {
		next = b->dnext;
		bundle_drop(r, b);
		dropped++;
	}
	return dropped;
}

static uint64_t mono_us(void);

/* Kept fds that no bundle took (the store or its names full, the notify
 * socket full for 10 ms, no socket): tried again at the end of a turn that
 * dropped a bundle (room may have come back), or a second after the last
 * try; the first that fails again ends the try. A scan of the kept fds,
 * only while some are unprotected. */
static void retry_unprotected(restart *r, bool dropped)
{
	if (!r->store || !r->stats.unprotected || r->restoring)
		return;
	uint64_t now = mono_us();
	if (!dropped && now - r->retried_us < 1000000)
		return;
	r->retried_us = now;
	kept *tables[2] = {r->bufs, r->allocs};
	for (int t = 0; t < 2; t++)
		for (kept *k = tables[t]; k; k = k->hh.next) {
			if (k->bundle || k->named)
				continue;
			if (bundle_put(r, k, BUNDLE_FRESH) < 0)
				return;
			r->stats.unprotected--;
		}
}

void restart_flush(restart *r)
{
	if (!r)
		return;
	retry_unprotected(r, bundles_rebuild(r) > 0);
	for (size_t i = 0; i < r->nremovals; i++)
		store_remove_now(r, r->removals[i]);
	r->nremovals = 0;
}

/* ---- the table of kept fds ------------------------------------------------------ */

static kept *kept_find(kept *table, uint64_t id)
{
	kept *k;
	HASH_FIND(hh, table, &id, sizeof(id), k);
	return k;
}

static kept *kept_add(kept **table, uint64_t id, int fd, char letter)
{
	kept *k = calloc(1, sizeof(*k));
	if (!k)
		return NULL;
	k->id = id;
	k->fd = fd;
	k->letter = letter;
	HASH_ADD(hh, *table, id, sizeof(k->id), k);
	return k;
}

static void count_unprotected(restart *r, const kept *k)
{
	r->stats.unprotected++;
	if (!r->warned_unprotected) {
		r->warned_unprotected = true;
		char name[NAME_MAX_LEN];
		name_of(name, k->letter, k->id);
		log_warn("event=fdstore_add_failed name=%s note=\"served, but lost at a restart; "
			 "further failures are counted, not logged\"",
			 name);
	}
}

/* Keep fd under <letter><id> in table (a second store of an allocation
 * it has is a no-op add): in a bundle when there is a store. Inside
 * broker_restore the fd is in the store already: in the bundle it was
 * found in, or under its own name (then it is bundled now, and that name
 * removed). */
static void store_one(restart *r, kept **table, kept *passed, char letter, uint64_t id, int fd)
{
	if (kept_find(*table, id))
		return;
	kept *k = kept_add(table, id, fd, letter);
	if (!r->store)
		return;
	if (!k) {
		r->stats.unprotected++;
		return;
	}
	kept *p = r->restoring ? kept_find(passed, id) : NULL;
	if (p && p->bundle) {
		k->bundle = p->bundle;
		DL_APPEND2(k->bundle->first, k, bprev, bnext);
		k->bundle->members++;
		return;
	}
	k->named = p && p->named;
	if (bundle_put(r, k, BUNDLE_FRESH) < 0) {
		if (!k->named)
			count_unprotected(r, k);
		return;
	}
	if (k->named) {
		char name[NAME_MAX_LEN];
		name_of(name, letter, id);
		store_remove(r, name);
		k->named = false;
	}
}

static void unstore_one(restart *r, kept **table, uint64_t id)
{
	kept *k = kept_find(*table, id);
	if (!k) {
		if (r->store && r->stats.unprotected)
			r->stats.unprotected--; /* it had no entry: it was counted */
		return;
	}
	if (k->bundle) {
		bundle_leave(r, k);
	} else if (k->named) {
		char name[NAME_MAX_LEN];
		name_of(name, k->letter, k->id);
		store_remove(r, name);
	} else if (r->store) {
		r->stats.unprotected--;
	}
	HASH_DEL(*table, k);
	free(k);
}

void restart_store_buffer(restart *r, uint64_t id, int fd)
{
	store_one(r, &r->bufs, r->pbufs, 'b', id, fd);
}

void restart_unstore_buffer(restart *r, uint64_t id)
{
	unstore_one(r, &r->bufs, id);
}

void restart_store_allocation(restart *r, uint64_t id, int fd)
{
	store_one(r, &r->allocs, r->pallocs, 'a', id, fd);
}

void restart_unstore_allocation(restart *r, uint64_t id)
{
	unstore_one(r, &r->allocs, id);
}

void restart_keep(void *ctx, const broker_kept *k, bool live)
{
	restart *r = ctx;
	if (!r->cfg.journal)
		return;
	if (k->kind == BB_HOST && k->fd >= 0) {
		if (live)
			restart_store_buffer(r, k->id, k->fd);
		else
			restart_unstore_buffer(r, k->id);
		return;
	}
	if (!k->allocation || !r->cuda || !r->cuda->export_allocation)
		return;
	kept *a = kept_find(r->allocs, k->allocation);
	if (live) {
		if (a) {
			a->buffers++;
			return;
		}
		backend_export ex = {.fd = -1};
		char msg[128];
		if (r->cuda->export_allocation(r->cuda, k->allocation, &ex, msg, sizeof(msg)) ||
		    ex.fd < 0)
			return;
		restart_store_allocation(r, k->allocation, ex.fd);
		if ((a = kept_find(r->allocs, k->allocation)))
			a->buffers = 1;
	} else if (a && --a->buffers == 0) {
		restart_unstore_allocation(r, k->allocation);
	}
}

/* fn for each kept fd of table that no bundle holds. */
static int each_unbundled(kept *table, size_t *n, int (*fn)(void *ctx, const char *name, int fd),
			  void *ctx)
{
	char name[NAME_MAX_LEN];
	for (kept *k = table; k; k = k->hh.next) {
		if (k->bundle)
			continue;
		name_of(name, k->letter, k->id);
		++*n;
		if (fn(ctx, name, k->fd))
			return 1;
	}
	return 0;
}

size_t restart_each_fd(restart *r, int (*fn)(void *ctx, const char *name, int fd), void *ctx)
{
	char name[NAME_MAX_LEN];
	size_t n = 0;
	if (!r || !r->j)
		return 0;
	snprintf(name, sizeof(name), "journal-%" PRIu64, r->generation);
	n++;
	if (fn(ctx, name, journal_fd(r->j)))
		return n;
	for (bundle *b = r->bundles; b; b = b->next) {
		bundle_name(name, b->n);
		n++;
		if (fn(ctx, name, b->rx))
			return n;
	}
	if (!each_unbundled(r->bufs, &n, fn, ctx))
		each_unbundled(r->allocs, &n, fn, ctx);
	return n;
}

uint64_t restart_bundle_fds(const restart *r, uint64_t kept_fds)
{
	if (!r || !r->cfg.journal || !r->notify)
		return 0;
	/* Each bundle's receiving end, the two open ones' sending ends, and
	 * a rebuild's new bundle before the old one goes. */
	return (kept_fds + BUNDLE_MAX - 1) / BUNDLE_MAX + 6;
}

uint64_t restart_store_need(uint64_t kept_fds)
{
	/* The bundles (BUNDLE_MAX fds each, two of them open), a rebuild's
	 * new one, and two journals (the handover at a start). */
	return (kept_fds + BUNDLE_MAX - 1) / BUNDLE_MAX + 5;
}

uint64_t restart_held_fds(const restart *r)
{
	uint64_t n = 0;
	for (bundle *b = r ? r->bundles : NULL; b; b = b->next)
		n += 1 + (b->tx >= 0);
	return n;
}

/* ---- the start ------------------------------------------------------------------ */

static uint64_t mono_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int compare_journals(const void *x, const void *y)
{
	const passed_journal *a = x, *b = y;
	return a->generation < b->generation ? 1 : a->generation > b->generation ? -1 : 0;
}

/* A passed bundle: each message's fd to pbufs or pallocs, unless that id
 * has one already (a member moved by a rebuild the last daemon did not
 * finish: one file, kept once). The messages are peeked, never taken:
 * the store keeps them until this daemon has them in bundles of its own. */
static void bundle_take(restart *r, uint64_t n, int fd)
{
	bundle *b = calloc(1, sizeof(*b));
	char name[NAME_MAX_LEN];
	if (!b) {
		snprintf(r->others[r->nothers], NAME_MAX_LEN, "k%" PRIu64, n);
		r->other_fds[r->nothers++] = fd;
		return;
	}
	b->n = n;
	b->rx = fd;
	b->tx = -1;
	/* Two stored fds of one name: one removal takes both, so both are
	 * rebuilt (moved first, then removed). */
	for (bundle *o = r->bundles; o; o = o->next)
		if (o->n == n)
			o->rebuild = b->rebuild = true;
	DL_APPEND(r->bundles, b);
	r->stats.bundles++;
	r->stats.names_bytes += bundle_name(name, n) + 1;
	if (n >= r->next_bundle)
		r->next_bundle = n + 1;
	/* The peek offset is the socket's, shared with the store's copy: a
	 * daemon that died while peeking left it where it stopped. */
	int off = 0;
	if (setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &off, sizeof(off)) < 0) {
		log_warn("event=bundle_unreadable name=%s error=\"%s\"", name, strerror(errno));
		b->rebuild = true;
		return;
	}
	for (;;) {
		bundle_rec recs[BUNDLE_MAX];
		struct iovec iov = {.iov_base = recs, .iov_len = sizeof(recs)};
		union {
			char buf[CMSG_SPACE(BUNDLE_MAX * sizeof(int))];
			struct cmsghdr align;
		} ctl;
		struct msghdr m = {.msg_iov = &iov,
				   .msg_iovlen = 1,
				   .msg_control = ctl.buf,
				   .msg_controllen = sizeof(ctl.buf)};
		ssize_t got = recvmsg(fd, &m, MSG_PEEK | MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (got < 0 && errno == EINTR)
			continue;
		if (got < 0) {
			if (errno != EAGAIN)
				log_warn("event=bundle_unreadable name=%s error=\"%s\"", name,
					 strerror(errno));
			break;
		}
		int fds[BUNDLE_MAX];
		size_t nfds = msgio_fds(&m, fds, BUNDLE_MAX);
		/* A message: 1 to BUNDLE_MAX records, as many fds, in order. */
		size_t nrec = (size_t)got / sizeof(bundle_rec);
		bool whole = got > 0 && (size_t)got % sizeof(bundle_rec) == 0 && nfds == nrec &&
			     !(m.msg_flags & (MSG_TRUNC | MSG_CTRUNC));
		b->entries += nrec ? (uint32_t)nrec : 1;
		for (size_t i = 0; i < nfds; i++) { /* at most BUNDLE_MAX: ctl's room */
			const bundle_rec *rec = &recs[i];
			bool ok = whole && rec->magic[0] == 'b' && rec->magic[1] == 'k' &&
				  rec->version == BUNDLE_REC_VERSION && !rec->zero && rec->id &&
				  (rec->letter == 'b' || rec->letter == 'a');
			kept **table = rec->letter == 'b' ? &r->pbufs : &r->pallocs;
			kept *p = ok && !kept_find(*table, rec->id)
					  ? kept_add(table, rec->id, fds[i], (char)rec->letter)
					  : NULL;
			if (p)
				p->bundle = b;
			else
				close(fds[i]); /* not a member: the bundle is rebuilt */
		}
		if (!whole)
			b->rebuild = true;
		if (b->entries > (1u << 20))
			break; /* no bundle this daemon makes is near it */
	}
	off = -1;
	setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &off, sizeof(off));
}

/* Sort what LISTEN_FDS passed. -1 with why when it cannot be used at all. */
static int take_passed(restart *r, char *why, size_t len)
{
	char **names = NULL;
	int n = sd_listen_fds_with_names(1, &names);
	if (n <= 0)
		return n < 0 ? (snprintf(why, len, "LISTEN_FDS: %s", strerror(-n)), -1) : 0;
	int rc = 0;
	r->journals = calloc((size_t)n, sizeof(*r->journals));
	r->others = calloc((size_t)n, sizeof(*r->others));
	r->other_fds = calloc((size_t)n, sizeof(*r->other_fds));
	if (!r->journals || !r->others || !r->other_fds) {
		snprintf(why, len, "out of memory");
		rc = -1;
	}
	for (int i = 0; i < n; i++) {
		int fd = SD_LISTEN_FDS_START + i;
		const char *name = names ? names[i] : NULL;
		uint64_t id = 0;
		kept *p;
		int type = restart_name_parse(name, &id);
		if (rc < 0) {
			close(fd);
		} else if (type == RESTART_NAME_OTHER &&
			   sd_is_socket_unix(fd, SOCK_SEQPACKET, 1, NULL, 0) > 0) {
			if (r->listen_fd >= 0) {
				snprintf(why, len,
					 "two listening sockets were passed; expected one");
				close(fd);
				rc = -1;
				continue;
			}
			int fl = fcntl(fd, F_GETFL);
			fcntl(fd, F_SETFL, fl | O_NONBLOCK);
			r->listen_fd = fd;
		} else if (type == RESTART_NAME_JOURNAL) {
			r->journals[r->njournals++] = (passed_journal){.generation = id, .fd = fd};
		} else if (type == RESTART_NAME_BUNDLE) {
			bundle_take(r, id, fd);
		} else if (type == RESTART_NAME_BUFFER && !kept_find(r->pbufs, id) &&
			   (p = kept_add(&r->pbufs, id, fd, 'b'))) {
			p->named = true; /* one fd per name: a second b<id> is an orphan */
		} else if (type == RESTART_NAME_ALLOCATION && !kept_find(r->pallocs, id) &&
			   (p = kept_add(&r->pallocs, id, fd, 'a'))) {
			p->named = true; /* likewise a second a<id> */
		} else {
			/* A duplicate, or a name this daemon does not make:
			 * removed and closed at the start. */
			snprintf(r->others[r->nothers], NAME_MAX_LEN, "%s", name ? name : "");
			r->other_fds[r->nothers++] = fd;
		}
		/* Every fd the daemon keeps is close-on-exec (the upgrade clears
		 * it for those it hands over). */
		fcntl(fd, F_SETFD, FD_CLOEXEC);
	}
	if (names)
		for (int i = 0; i < n; i++)
			free(names[i]);
	free(names);
	if (r->njournals > 1)
		qsort(r->journals, r->njournals, sizeof(*r->journals), compare_journals);
	return rc;
}

int restart_new(restart **out, const restart_config *cfg, char *why, size_t len)
{
	restart *r = calloc(1, sizeof(*r));
	*out = r;
	if (!r) {
		snprintf(why, len, "out of memory");
		return -1;
	}
	r->cfg = *cfg;
	r->notify_fd = -1;
	r->stats.journal_fd = -1;
	r->listen_fd = -1;
	r->next_bundle = 1; /* "k0" would not parse: no leading zero */
	r->new_at_us = mono_us();
	if (take_passed(r, why, len) < 0)
		return -1;
	r->take_us = mono_us() - r->new_at_us;
	const char *fdstore = getenv("FDSTORE");
	uint64_t v;
	if (!r->cfg.store_max && fdstore && !parse_decimal(fdstore, &v))
		r->cfg.store_max = v;
	/* A store to talk to: removals of what was passed go to it even with
	 * the journal off; adds only with it on. */
	const char *ns = getenv("NOTIFY_SOCKET");
	r->notify = ns && ns[0];
	if (r->notify)
		r->notify_fd = notify_connect();
	r->names_max = RESTART_NAMES_MAX;
	const char *nm = getenv("BUFBROKERD_TEST_FDNAMES_MAX");
	uint64_t nmax;
	if (nm && !parse_decimal(nm, &nmax) && nmax < r->names_max)
		r->names_max = (size_t)nmax;
	if (!cfg->journal)
		return 0;
	r->generation = (r->njournals ? r->journals[0].generation : 0) + 1;
	char msg[256];
	if (journal_create(NULL, &r->j, msg, sizeof(msg))) {
		snprintf(why, len, "the state journal: %s", msg);
		return -1;
	}
	r->store = r->notify;
	r->stats.journal_fd = journal_fd(r->j);
	return 0;
}

/* What a backend's adopt of passed fd p said (rc, msg): the fd is the
 * backend's now (0); or it is not the buffer's memory (BB_ERR_INVALID:
 * the buffer is FAILED, the restore goes on); or the restore fails. */
static int adopted(restart *r, kept *p, int rc, const char *msg, char *err, size_t len)
{
	if (rc == BB_ERR_INVALID) {
		snprintf(err, len, "%s (%s)", RESTART_MISSING_WHY, msg);
		r->stats.failed_missing++;
		return BROKER_RESTORE_LOST;
	}
	if (rc) {
		snprintf(err, len, "%s", msg);
		return rc;
	}
	p->fd = -1; /* the backend's now (or, a VMM allocation's second buffer, already) */
	return 0;
}

/* The memory of a restored VMM CUDA buffer: its allocation's kept fd
 * (a<id>) imported by the backend at the first buffer of it, the buffer's
 * range marked in it. */
static int restore_carved(restart *r, backend *be, const journal_buffer *rec, backend_mem *out,
			  char *err, size_t len)
{
	kept *p = rec->allocation ? kept_find(r->pallocs, rec->allocation) : NULL;
	if (!p || !be || !be->adopt_carved) {
		snprintf(err, len, "%s", RESTART_MISSING_WHY);
		r->stats.failed_missing++;
		return BROKER_RESTORE_LOST;
	}
	backend_carved c = {
		.allocation = rec->allocation,
		.allocation_size = rec->allocation_size,
		.offset = rec->offset,
		.size = rec->size,
		.device = rec->device,
		.uid = rec->owner_uid,
		.share = (int)rec->share,
	};
	char msg[200] = "";
	int rc = be->adopt_carved(be, p->fd, &c, out, msg, sizeof(msg));
	return adopted(r, p, rc, msg, err, len);
}

/* The memory of a restored buffer: its kept fd adopted by the backend. */
static int restore_mem(void *ctx, backend *be, const journal_buffer *rec, backend_mem *out,
		       char *err, size_t len)
{
	restart *r = ctx;
	if (rec->kind == BB_CUDA && rec->cuda_handle == BB_CUDA_HANDLE_LEGACY) {
		snprintf(err, len, "%s", RESTART_LEGACY_WHY);
		r->stats.failed_legacy++;
		return BROKER_RESTORE_LOST;
	}
	if (rec->kind == BB_CUDA)
		return restore_carved(r, be, rec, out, err, len);
	kept *p = rec->kind == BB_HOST ? kept_find(r->pbufs, rec->id) : NULL;
	if (!p || p->fd < 0 || !be || !be->adopt) {
		snprintf(err, len, "%s", RESTART_MISSING_WHY);
		r->stats.failed_missing++;
		return BROKER_RESTORE_LOST;
	}
	char msg[200] = "";
	uint64_t t = mono_us();
	int rc = be->adopt(be, p->fd, rec->size, rec->owner_uid,
			   rec->flags & (JOURNAL_BUF_IMPORTED | JOURNAL_BUF_EXPOSED), out, msg,
			   sizeof(msg));
	r->adopt_us += mono_us() - t;
	return adopted(r, p, rc, msg, err, len);
}

/* Close every passed fd of table that is not in use (an fd passed by its
 * own name also leaves the store; one found in a bundle makes the bundle
 * short of a member, so it is rebuilt), and forget them all. */
static void drop_table(restart *r, kept **table)
{
	char name[NAME_MAX_LEN];
	kept *k, *tmp;
	HASH_ITER (hh, *table, k, tmp) {
		/* Adopted: the live table has it (and its place in the store). */
		if (k->fd >= 0) {
			if (k->named) {
				name_of(name, k->letter, k->id);
				store_remove_now(r, name);
			}
			close(k->fd);
			r->stats.orphans_closed++;
		}
		HASH_DEL(*table, k);
		free(k);
	}
}

/* Close and remove every passed fd that is not in use: the orphans after a
 * restore, everything after a refusal; and rebuild the passed bundles that
 * hold an fd no live buffer or allocation has (every one after a refusal:
 * they have no member left). */
static void drop_passed(restart *r, bool journals)
{
	char name[NAME_MAX_LEN];
	drop_table(r, &r->pbufs);
	drop_table(r, &r->pallocs);
	for (size_t i = 0; i < r->nothers; i++) {
		if (r->others[i][0])
			store_remove_now(r, r->others[i]);
		close(r->other_fds[i]);
		r->stats.orphans_closed++;
	}
	r->nothers = 0;
	for (size_t i = 0; journals && i < r->njournals; i++) {
		snprintf(name, sizeof(name), "journal-%" PRIu64, r->journals[i].generation);
		store_remove_now(r, name);
		close(r->journals[i].fd);
	}
	if (journals)
		r->njournals = 0;
	for (bundle *b = r->bundles; b; b = b->next)
		if (b->members < b->entries || !b->members || b->rebuild)
			bundle_dirty(r, b); /* an empty one: made just before a crash */
	restart_flush(r);
}

int restart_start(restart *r, broker *b, backend *host, backend *cuda, int *listen_fd, char *why,
		  size_t len)
{
	(void)host;
	r->cuda = cuda;
	*listen_fd = r->listen_fd;
	r->listen_fd = -1; /* the caller's */
	uint64_t t0 = mono_us();
	/* Allocation identities of earlier runs are never given again: a
	 * client that resumed keys its mappings by them (client/cuda_map.c).
	 * Generation G hands out identities above (G - 1) << 40. */
	if (r->j && cuda && cuda->allocation_floor)
		cuda->allocation_floor(cuda, (r->generation - 1) << RESTART_ALLOCATION_SHIFT);
	if (!r->j) {
		/* Journal off: nothing to rebuild from, nothing to keep. */
		drop_passed(r, true);
		return 0;
	}
	broker_error err = {""};
	int rc = 0;
	bool tried = false;
	for (size_t i = 0; i < r->njournals; i++) {
		tried = true;
		r->restoring = true;
		rc = broker_restore(b, r->journals[i].fd, restore_mem, r, &err);
		r->restoring = false;
		if (!rc) {
			r->stats.restarts = r->journals[i].generation;
			break;
		}
		/* An older journal (a crash during the last start's handover)
		 * only while no fd was adopted: a failed restore closes those. */
		log_warn("event=journal_refused name=journal-%" PRIu64 " error=\"%s\"",
			 r->journals[i].generation, err.msg);
		bool adopted = false;
		for (kept *k = r->pbufs; k; k = k->hh.next)
			adopted |= k->fd < 0;
		for (kept *k = r->pallocs; k; k = k->hh.next)
			adopted |= k->fd < 0;
		if (adopted)
			break;
	}
	if (tried && rc) {
		snprintf(r->stats.refused_why, sizeof(r->stats.refused_why), "%s", err.msg);
		r->stats.refused = true;
		log_error("event=restart_refused error=\"%s\" strict=%s", err.msg,
			  r->cfg.strict ? "yes" : "no");
		if (r->cfg.strict) {
			snprintf(why, len, "the kept state is refused (--restart-strict): %s",
				 err.msg);
			return -1;
		}
		/* Start empty, as a daemon starts without a kept state: the
		 * broker was left empty, every kept fd goes. */
		r->stats.restarts = r->journals[0].generation;
	}
	if (!rc && tried) {
		uint64_t lost;
		broker_restored(b, &r->stats.restored_buffers, &lost);
		broker_expire_tokens(b); /* past their deadline while the daemon was away */
	}
	/* The new generation in the store, then the old ones and the orphans
	 * out. */
	char name[NAME_MAX_LEN];
	uint64_t t = mono_us();
	snprintf(name, sizeof(name), "journal-%" PRIu64, r->generation);
	r->stats.protected_by_store = r->store && store_add(r, name, journal_fd(r->j), false) == 0;
	if (r->store && !r->stats.protected_by_store)
		log_warn("event=fdstore_add_failed name=%s note=\"the state will not survive a "
			 "restart\"",
			 name);
	uint64_t t1 = mono_us();
	r->store_us = t1 - t;
	drop_passed(r, true);
	r->drop_us = mono_us() - t1;
	r->stats.start_us = mono_us() - t0;
	if (tried) {
		/* The phases in ms (RESTART.md, "Starting from a kept state"):
		 * taking the passed fds, the journal read and check, the rebuild
		 * (adopting the fds counted apart), broker_check, the fresh
		 * journal, its store, the old journals and orphans out. */
		broker_restore_times tm;
		broker_restore_times_get(b, &tm);
		log_info("event=restart_restored generation=%" PRIu64 " buffers=%" PRIu64
			 " sessions=%u failed_legacy=%" PRIu64 " failed_missing=%" PRIu64
			 " orphans_closed=%" PRIu64 " refused=%s duration_us=%" PRIu64
			 " take_ms=%.1f read_ms=%.1f check_ms=%.1f rebuild_ms=%.1f adopt_ms=%.1f"
			 " broker_check_ms=%.1f journal_ms=%.1f store_ms=%.1f drop_ms=%.1f",
			 r->generation, r->stats.restored_buffers, broker_absent_sessions(b),
			 r->stats.failed_legacy, r->stats.failed_missing, r->stats.orphans_closed,
			 r->stats.refused ? "yes" : "no", r->stats.start_us, r->take_us / 1e3,
			 tm.read_us / 1e3, tm.check_us / 1e3, tm.rebuild_us / 1e3,
			 r->adopt_us / 1e3, tm.broker_check_us / 1e3, tm.journal_us / 1e3,
			 r->store_us / 1e3, r->drop_us / 1e3);
	}
	return 0;
}

void restart_free(restart *r)
{
	if (!r)
		return;
	kept *k, *tmp;
	HASH_ITER (hh, r->bufs, k, tmp) {
		HASH_DEL(r->bufs, k);
		free(k);
	}
	HASH_ITER (hh, r->allocs, k, tmp) {
		HASH_DEL(r->allocs, k);
		free(k);
	}
	HASH_ITER (hh, r->pbufs, k, tmp) {
		if (k->fd >= 0)
			close(k->fd);
		HASH_DEL(r->pbufs, k);
		free(k);
	}
	HASH_ITER (hh, r->pallocs, k, tmp) {
		if (k->fd >= 0)
			close(k->fd);
		HASH_DEL(r->pallocs, k);
		free(k);
	}
	/* The store keeps the bundles it has (a stop keeps what a restart
	 * needs; systemd drops the store when the unit stops). */
	bundle *b, *btmp;
	DL_FOREACH_SAFE (r->bundles, b, btmp) {
		if (b->tx >= 0)
			close(b->tx);
		close(b->rx);
		DL_DELETE(r->bundles, b);
		free(b);
	}
	for (size_t i = 0; i < r->njournals; i++)
		close(r->journals[i].fd);
	for (size_t i = 0; i < r->nothers; i++)
		close(r->other_fds[i]);
	if (r->listen_fd >= 0)
		close(r->listen_fd);
	if (r->notify_fd >= 0)
		close(r->notify_fd);
	journal_free(r->j);
	free(r->journals);
	free(r->others);
	free(r->other_fds);
	free(r->removals);
	free(r);
}

struct journal *restart_journal(restart *r)
{
	return r ? r->j : NULL;
}

uint64_t restart_generation(const restart *r)
{
	return r && r->j ? r->generation : 0;
}

const restart_stats *restart_get_stats(const restart *r)
{
	return &r->stats;
}

const restart_config *restart_config_of(const restart *r)
{
	return &r->cfg;
}
