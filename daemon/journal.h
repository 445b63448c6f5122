/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The state journal: what a later daemon needs to rebuild its tables after
 * a crash or an upgrade (docs/RESTART.md), kept in a memfd that outlives the
 * process (systemd's fd store, or across execve). Written on the hot path
 * with memory writes only: a transaction (one request's changes) costs no
 * system call, except when a table grows (doubling, so rarely).
 *
 * Crash-consistent at any instruction. Every record has two copies in its
 * slot; each copy carries the sequence number of the transaction that wrote
 * it and a 64-bit checksum over its slot index, sequence number, type and
 * payload. A transaction writes the copy that is not the record's committed
 * one, then the commit record (itself two copies, the older overwritten)
 * names the transaction. A reader takes, per slot, the valid copy with the
 * highest sequence number not above the commit's, so a crash anywhere in a
 * transaction yields the state before it, and a crash after the commit's
 * last store the state after it. The commit also carries a digest (the sum
 * of the checksums of every live record's committed copy) and the number of
 * records of each type, so a copy that is lost or stale (memory corrupted
 * rather than torn) makes the reader refuse, never yield wrong counts.
 *
 * One writer: a journal is written from one thread (the loop thread, where
 * the broker runs) and is not thread-safe; that is also why a compiler
 * barrier, not a memory fence, orders its stores (a crash stops that one
 * thread at an instruction boundary).
 *
 * The journal holds records, not the broker's structures: this module knows
 * nothing of the broker, and the layer that wires it in maps one to the
 * other. The caller keeps each record's slot (journal_slot) beside its own
 * object and names it to update or drop the record.
 */
#ifndef BB_JOURNAL_H
#define BB_JOURNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bufbroker/bufbroker.h"

#define JOURNAL_MAGIC 0x4c4e524a42425542ull /* "BUBBJRNL" little-endian */
/* The file layout journal_create writes, and the oldest journal_read reads
 * (docs/RESTART.md, "Layout"). */
#define JOURNAL_VERSION 2
#define JOURNAL_VERSION_OLDEST 1
#define JOURNAL_ERROR_MAX 255 /* a buffer's error text, without the NUL */
#define JOURNAL_NO_SLOT UINT32_MAX
#define JOURNAL_EXTENTS 32 /* the most extents a journal file has */

/* A buffer. Its references are not here: they are the sum of the holds and
 * tokens that name it, so a retain writes one hold and nothing else. */
typedef struct journal_buffer {
	uint64_t id;              /* never reused (journal_ids) */
	uint64_t size;            /* bytes */
	uint64_t producer;        /* the session that allocated it; 0 once it has none */
	uint64_t allocation;      /* CUDA: the slab or allocation it is carved from; 0 host */
	uint64_t offset;          /* CUDA: its offset in that allocation */
	uint64_t allocation_size; /* VMM CUDA: bytes of that allocation (a restart
				   * imports it again: the driver's fd does not
				   * say); 0 otherwise */
	uint32_t kind;            /* bb_kind */
	int32_t device;           /* CUDA device ordinal; -1 host */
	uint32_t cuda_handle;     /* bb_cuda_handle; 0 host */
	uint32_t state;           /* bb_state */
	uint32_t owner_uid;
	uint32_t owner_gid;
	uint32_t share;         /* BB_SHARE_* */
	uint32_t flags;         /* JOURNAL_BUF_*: */
#define JOURNAL_BUF_IMPORTED 1u /* its fd came from a client (ImportFd) */
#define JOURNAL_BUF_EXPOSED 2u  /* granted to another uid: its memfd is never pooled */
#define JOURNAL_BUF_LOST \
	4u                                 /* its memory was not kept across a restart:
					    * FAILED, memoryless (broker_restore) */
	char name[BB_NAME_MAX + 1];        /* "" unnamed */
	char error[JOURNAL_ERROR_MAX + 1]; /* FAILED: the message */
} journal_buffer;

/* A client session: what lets a reconnecting client resume it. */
typedef struct journal_session {
	uint64_t id;           /* never reused (journal_ids) */
	uint64_t last_request; /* requests with ids up to this one are all applied */
	uint64_t applied_mask; /* bit i: request last_request + 1 + i is applied too
				* (a threaded client's ids may reach the wire out of
				* order) */
	uint64_t grace_ms;     /* CLOCK_MONOTONIC ms when an absent session is
				* released; 0 while it is connected */
	uint32_t uid, gid, pid;
	uint32_t minor;                      /* the protocol minor its Hello said */
	unsigned char secret[BB_TOKEN_SIZE]; /* what resumes it (Hello's answer) */
} journal_session;

/* One session's references on one buffer (count > 0). */
typedef struct journal_hold {
	uint64_t session;
	uint64_t buffer;
	uint32_t count;
} journal_hold;

/* A live token: one reference of buffer, adoptable by whoever has the bytes. */
typedef struct journal_token {
	unsigned char token[BB_TOKEN_SIZE];
	uint64_t buffer;
	uint64_t session;     /* the session that made it; 0 once closed */
	uint64_t deadline_ms; /* CLOCK_MONOTONIC ms of its TTL's end */
	uint32_t maker_uid;   /* counts against this uid's token limit */
} journal_token;

/* The answer of one applied result-bearing request (Alloc, ImportFd, Open,
 * Adopt, Take), so that the request sent again after a restart is answered
 * without being applied twice (docs/RESTART.md, "Exactly once"). A ring of
 * JOURNAL_RESULT_RING per session: request id mod JOURNAL_RESULT_RING is
 * its place, and a newer request's result replaces the older one there. */
#define JOURNAL_RESULT_RING 64
typedef struct journal_result {
	uint64_t session;
	uint64_t request;                   /* its request id (> 0) */
	uint64_t buffer;                    /* Alloc, ImportFd, Open, Adopt: the buffer granted */
	int32_t status;                     /* 0 or the BB_ERR_* it was answered with */
	uint32_t reserved;                  /* 0 */
	unsigned char token[BB_TOKEN_SIZE]; /* Take: the token made */
} journal_result;

/* The counters that keep ids unique. */
typedef struct journal_ids {
	uint64_t next_buffer;  /* every buffer id is below it */
	uint64_t next_session; /* every session id is below it */
} journal_ids;

/* A whole state as a reader rebuilds it: arrays sorted (buffers and
 * sessions by id, holds by session then buffer, tokens by their bytes). */
typedef struct journal_state {
	uint64_t seq; /* the transaction it is the state after */
	journal_ids ids;
	journal_buffer *buffers;
	size_t n_buffers;
	journal_session *sessions;
	size_t n_sessions;
	journal_hold *holds;
	size_t n_holds;
	journal_token *tokens;
	size_t n_tokens;
	journal_result *results; /* by session, then request id */
	size_t n_results;
} journal_state;

typedef struct journal journal;

typedef struct journal_config {
	uint32_t big_slots;   /* buffer slots of the first extent (0: 1024) */
	uint32_t small_slots; /* session/hold/token/result slots of the first extent (0: 4096) */
	uint32_t version;     /* tests only: the layout to write, JOURNAL_VERSION_OLDEST to
			       * JOURNAL_VERSION (0: JOURNAL_VERSION), so that a reader's
			       * handling of an older daemon's journal can be tested */
} journal_config;

/* A new, empty journal in a new memfd (sealed against shrinking), with
 * transaction 1 committed: the empty state, ids from 1. 0, or BB_ERR_SYSTEM / BB_ERR_NO_MEMORY
 * with *err (len bytes) saying why; BB_ERR_INVALID for a cfg->version this
 * build does not write. */
int journal_create(const journal_config *cfg, journal **out, char *err, size_t len);
/* Unmaps and closes the memfd (a dup of journal_fd, e.g. in the fd store,
 * keeps the file). */
void journal_free(journal *j);
/* The memfd, for the fd store or an execve handover. Borrowed. */
int journal_fd(const journal *j);

/* Make room for at least big new buffer records and small new session,
 * hold, token and result records in one step per class (one extent), so
 * that that many puts need no growth: for
 * writing a whole state (the start from a kept state). 0, or
 * BB_ERR_NO_MEMORY (the journal is unchanged but for room it could add;
 * puts still grow it as they need). */
int journal_reserve(journal *j, uint32_t big, uint32_t small);

/* A transaction: journal_begin, any number of puts and drops, then
 * journal_commit. There is no abort: a begun transaction is committed
 * (committing the changes that were made; the broker journals only what it
 * has done). Nothing written since journal_begin is visible to a reader of
 * the file until journal_commit's last store. */
void journal_begin(journal *j);
/* Write a record. *slot: JOURNAL_NO_SLOT for a new record (the slot it got
 * is written back), else the slot an earlier put of the same record gave.
 * 0, or BB_ERR_NO_MEMORY when a new slot was needed and the file (or the
 * writer's tables) could not grow, or BB_ERR_INVALID for a slot this
 * journal did not give; either way nothing was written (the transaction is
 * still open and may be committed). */
int journal_put_buffer(journal *j, uint32_t *slot, const journal_buffer *b);
int journal_put_session(journal *j, uint32_t *slot, const journal_session *s);
int journal_put_hold(journal *j, uint32_t *slot, const journal_hold *h);
int journal_put_token(journal *j, uint32_t *slot, const journal_token *t);
int journal_put_result(journal *j, uint32_t *slot, const journal_result *r);
/* Remove a record; *slot becomes JOURNAL_NO_SLOT (the slot is reused after
 * the commit). buffer: true for a buffer's slot, false for the others'.
 * Never fails: it needs no memory. (A slot this journal did not give is
 * left alone.) */
void journal_drop(journal *j, uint32_t *slot, bool buffer);
void journal_set_ids(journal *j, const journal_ids *ids);
/* Make the transaction's changes the journal's state. */
void journal_commit(journal *j);
/* The last committed transaction's number. */
uint64_t journal_seq(const journal *j);

/* Tests only: fn is called after each store of at most 8 bytes into the
 * file (with the store done), so a test can copy the file at every point a
 * crash could stop the writer. NULL: none. */
void journal_set_store_hook(journal *j, void (*fn)(void *ctx), void *ctx);

/* Rebuild the state from a journal file (a memfd from the fd store) of any
 * layout from JOURNAL_VERSION_OLDEST to JOURNAL_VERSION. The file is only
 * read. 0 and *out (free with journal_state_free), or
 * BB_ERR_INVALID when it is not a journal, or BB_ERR_PROTOCOL when it is
 * inconsistent (a record lost or stale, counts or digest that do not match
 * the commit): never a state that was not committed. BB_ERR_SYSTEM /
 * BB_ERR_NO_MEMORY otherwise. err says why. */
int journal_read(int fd, journal_state *out, char *err, size_t len);
void journal_state_free(journal_state *s);

/* The invariants a daemon checks before it serves a rebuilt state: ids
 * unique and below the counters; holds and tokens name known buffers, holds
 * known sessions, counts > 0; every buffer has a reference (a hold or a
 * token); a producer is a known session or 0; names unique; kinds, states
 * and share policies in range; a result names a known session and at most
 * one result per session has each place of the ring. Writes one line per problem into report (len
 * bytes, always NUL-terminated, "" when all hold) and returns how many
 * there were. */
int journal_check(const journal_state *s, char *report, size_t len);

#endif /* BB_JOURNAL_H */
