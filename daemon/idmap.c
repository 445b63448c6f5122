/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The id table: open addressing, linear probing, backward-shift deletion.
 * See idmap.h for the contract.
 */
#include "idmap.h"

#include <stdlib.h>

#include "bufbroker/bufbroker.h"

/* The first allocation, and the smallest a table shrinks to: a connection
 * that holds a buffer or two does not reallocate as it churns. */
#define IDMAP_MIN_CAP 8
/* The largest capacity cap (uint32_t) can hold. */
#define IDMAP_MAX_CAP (UINT32_C(1) << 31)

/* Ids are handed out in sequence; the low bits of the table index must
 * still spread them, so every bit of the id has to reach every bit of the
 * hash (MurmurHash3's 64-bit finaliser). */
static uint32_t idmap__hash(uint64_t id)
{
	id ^= id >> 33;
	id *= UINT64_C(0xff51afd7ed558ccd);
	id ^= id >> 33;
	id *= UINT64_C(0xc4ceb9fe1a85ec53);
	id ^= id >> 33;
	return (uint32_t)id;
}

static uint64_t idmap__id(const void *item)
{
	return *(const uint64_t *)item;
}

/* Put an entry known to be absent into the first free slot of its probe
 * sequence; its index. */
static uint32_t idmap__place(idmap_slot *slots, uint32_t cap, const idmap_slot *entry)
{
	uint32_t mask = cap - 1;
	uint32_t i = entry->hash & mask;
	while (slots[i].item)
		i = (i + 1) & mask;
	slots[i] = *entry;
	return i;
}

/* Move every entry (and its second value) into new arrays of cap slots.
 * BB_ERR_NO_MEMORY leaves m as it was. */
static int idmap__resize(idmap *m, uint32_t cap)
{
	idmap_slot *slots = calloc(cap, sizeof(*slots));
	uint32_t *aux = m->with_aux ? malloc(cap * sizeof(*aux)) : NULL;
	if (!slots || (m->with_aux && !aux)) {
		free(slots);
		free(aux);
		return BB_ERR_NO_MEMORY;
	}
	for (uint32_t i = 0; i < m->cap; i++)
		if (m->slots[i].item) {
			uint32_t k = idmap__place(slots, cap, &m->slots[i]);
			if (aux)
				aux[k] = m->aux[i];
		}
	free(m->slots);
	free(m->aux);
	m->slots = slots;
	m->aux = aux;
	m->cap = cap;
	return 0;
}

void idmap_free(idmap *m)
{
	free(m->slots);
	free(m->aux);
	m->slots = NULL;
	m->aux = NULL;
	m->cap = 0;
	m->count = 0;
}

int idmap_aux_on(idmap *m)
{
	if (m->with_aux)
		return 0;
	if (m->cap) {
		m->aux = malloc(m->cap * sizeof(*m->aux));
		if (!m->aux)
			return BB_ERR_NO_MEMORY;
		for (uint32_t i = 0; i < m->cap; i++)
			m->aux[i] = IDMAP_AUX_NONE;
	}
	m->with_aux = true;
	return 0;
}

idmap_slot *idmap_find(const idmap *m, uint64_t id)
{
	if (m->cap == 0)
		return NULL;
	uint32_t hash = idmap__hash(id);
	uint32_t mask = m->cap - 1;
	/* At most 3/4 full, so an empty slot ends every probe sequence. */
	for (uint32_t i = hash & mask;; i = (i + 1) & mask) {
		idmap_slot *s = &m->slots[i];
		if (!s->item)
			return NULL;
		if (s->hash == hash && idmap__id(s->item) == id)
			return s;
	}
}

int idmap_reserve(idmap *m, uint32_t n)
{
	uint64_t cap = m->cap ? m->cap : IDMAP_MIN_CAP;
	while ((uint64_t)n * 4 > cap * 3)
		cap *= 2;
	if (cap <= m->cap)
		return 0;
	if (cap > IDMAP_MAX_CAP)
		return BB_ERR_NO_MEMORY;
	return idmap__resize(m, (uint32_t)cap);
}

int idmap_insert(idmap *m, void *item, uint32_t value)
{
	/* Grow before the table passes 3/4: linear probing's sequences get
	 * long quickly beyond that. */
	if ((uint64_t)(m->count + 1) * 4 > (uint64_t)m->cap * 3) {
		if (m->cap >= IDMAP_MAX_CAP)
			return BB_ERR_NO_MEMORY;
		int rc = idmap__resize(m, m->cap ? m->cap * 2 : IDMAP_MIN_CAP);
		if (rc)
			return rc;
	}
	idmap_slot entry = {.item = item, .hash = idmap__hash(idmap__id(item)), .value = value};
	uint32_t k = idmap__place(m->slots, m->cap, &entry);
	if (m->aux)
		m->aux[k] = IDMAP_AUX_NONE;
	m->count++;
	return 0;
}

void idmap_remove(idmap *m, idmap_slot *slot)
{
	uint32_t mask = m->cap - 1;
	uint32_t hole = (uint32_t)(slot - m->slots);

	/* Backward shift: walk the rest of the cluster and pull back into the
	 * hole each entry whose probe sequence passes it, so that no lookup
	 * meets an empty slot before its entry. */
	for (uint32_t j = (hole + 1) & mask; m->slots[j].item; j = (j + 1) & mask) {
		uint32_t home = m->slots[j].hash & mask;
		if (((j - home) & mask) >= ((j - hole) & mask)) {
			m->slots[hole] = m->slots[j];
			if (m->aux)
				m->aux[hole] = m->aux[j];
			hole = j;
		}
	}
	m->slots[hole] = (idmap_slot){0};
	m->count--;

	/* Give memory back after a peak, halving at most 1/8 full so that
	 * the table lands at most 1/4 full, far from growing again. A failed
	 * shrink only keeps the larger table. */
	if (m->cap > IDMAP_MIN_CAP && (uint64_t)m->count * 8 <= m->cap)
		(void)idmap__resize(m, m->cap / 2);
}

idmap_slot *idmap_next(const idmap *m, const idmap_slot *prev)
{
	for (uint32_t i = prev ? (uint32_t)(prev - m->slots) + 1 : 0; i < m->cap; i++)
		if (m->slots[i].item)
			return &m->slots[i];
	return NULL;
}
