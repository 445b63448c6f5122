/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A compact table from 64-bit ids to the items that carry them: the
 * broker's buffers by id, and each connection's counts on buffers.
 *
 * Why not uthash, as everywhere else: its handle is 56 bytes inside every
 * item, plus a bucket array, plus (for a count per connection) a malloc per
 * entry. Here an entry is one 16-byte slot in a flat array: the item's
 * pointer, 32 bits of its id's hash and a 32-bit value for the caller (the
 * connection's count), and where the caller asks for it (idmap_aux_on) a
 * second 32-bit value in an array beside the slots (a hold's journal slot).
 * Open addressing with linear probing, a power-of-two
 * capacity kept between 1/8 and 3/4 full, and backward-shift deletion (no
 * tombstones, so lookups never slow down with churn).
 *
 * The table does not own the items. An item is any struct whose first
 * member is its uint64_t id: the table reads it to tell apart ids whose
 * hashes share 32 bits. An item's id must not change while it is in a
 * table.
 */
#ifndef BB_IDMAP_H
#define BB_IDMAP_H

#include <stdbool.h>
#include <stdint.h>

typedef struct idmap_slot {
	void *item;     /* NULL: the slot is empty */
	uint32_t hash;  /* low 32 bits of the id's hash: home slot, cheap first compare */
	uint32_t value; /* the caller's (a count); the table never reads it */
} idmap_slot;

/* A zeroed idmap is an empty table, and owns no memory until the first
 * insert. */
typedef struct idmap {
	idmap_slot *slots; /* cap slots; NULL while cap is 0 */
	uint32_t *aux;     /* with_aux: cap second values, aux[i] slot i's; else NULL */
	uint32_t cap;      /* 0 or a power of two */
	uint32_t count;    /* occupied slots */
	bool with_aux;     /* idmap_aux_on */
} idmap;

/* A new entry's second value (idmap_aux). */
#define IDMAP_AUX_NONE UINT32_MAX

/* Free the slots (not the items); m is empty and usable again. */
void idmap_free(idmap *m);

/* The slot holding id, or NULL. Its value may be changed in place; the
 * pointer is valid until the next insert or remove. */
idmap_slot *idmap_find(const idmap *m, uint64_t id);

/* Add item (whose id must not be in m yet) with value. 0, or
 * BB_ERR_NO_MEMORY with m unchanged when the table could not grow. */
int idmap_insert(idmap *m, void *item, uint32_t value);

/* Room for n entries in all, so that inserts up to n need no growth (a
 * hint for bulk loads). 0, or BB_ERR_NO_MEMORY leaving m as it was. */
int idmap_reserve(idmap *m, uint32_t n);

/* Remove the entry in slot (from idmap_find or idmap_next). Never fails;
 * the table may shrink, so every slot pointer is stale afterwards. */
void idmap_remove(idmap *m, idmap_slot *slot);

/* Give every entry of m a second 32-bit value, kept with it as the table
 * moves entries (the caller's: the journal's slot of a hold, beside its
 * count): IDMAP_AUX_NONE for the entries m has and each one inserted
 * after. 4 bytes more per slot. 0, or BB_ERR_NO_MEMORY leaving m as it
 * was (never on a table that owns no memory yet). */
int idmap_aux_on(idmap *m);

/* The second value of slot (a slot of m, which has idmap_aux_on): it may
 * be changed in place; valid as long as the slot pointer is. */
static inline uint32_t *idmap_aux(const idmap *m, const idmap_slot *slot)
{
	return &m->aux[slot - m->slots];
}

/* Iteration in no particular order: idmap_next(m, NULL) is the first
 * occupied slot, idmap_next(m, s) the one after s, NULL at the end. Any
 * insert or remove ends an iteration (start again from NULL). */
idmap_slot *idmap_next(const idmap *m, const idmap_slot *prev);

static inline uint32_t idmap_count(const idmap *m)
{
	return m->count;
}

#endif /* BB_IDMAP_H */
