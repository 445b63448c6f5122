/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The id table (daemon/idmap.c): every entry stays reachable through
 * growth, shrinking and backward-shift deletion, ids whose hashes share
 * the 32 bits the table keeps are told apart, and its size follows its
 * count.
 */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "idmap.h"

/* An item as the table wants it: its id first. */
typedef struct item {
	uint64_t id;
	int seen; /* times an iteration visited it */
} item;

/* The slot index of id, which must be in m. */
static size_t index_of(const idmap *m, uint64_t id)
{
	idmap_slot *s = idmap_find(m, id);
	cr_assert_not_null(s, "id %llu is not found", (unsigned long long)id);
	return (size_t)(s - m->slots);
}

/* The home slot of id in a table of cap slots, read off the hash the
 * table keeps rather than assumed. */
static uint32_t home_of(uint64_t id, uint32_t cap)
{
	idmap m = {0};
	item it = {.id = id};
	cr_assert_eq(idmap_insert(&m, &it, 0), 0);
	uint32_t home = idmap_find(&m, id)->hash & (cap - 1);
	idmap_free(&m);
	return home;
}

/* Fill ids[n] with the first ids from 1 up whose home is home in a table
 * of 8 slots. */
static void ids_with_home(uint32_t home, uint64_t *ids, int n)
{
	uint64_t id = 1;
	for (int i = 0; i < n; id++)
		if (home_of(id, 8) == home)
			ids[i++] = id;
}

static void assert_shape(const idmap *m)
{
	cr_assert(m->cap == 0 || (m->cap & (m->cap - 1)) == 0, "cap %u is not a power of two",
		  m->cap);
	cr_assert_leq((uint64_t)m->count * 4, (uint64_t)m->cap * 3, "%u entries in %u slots",
		      m->count, m->cap);
	uint32_t n = 0;
	for (idmap_slot *s = idmap_next(m, NULL); s; s = idmap_next(m, s))
		n++;
	cr_assert_eq(n, m->count);
}

Test(idmap, an_empty_table_finds_nothing_and_owns_no_memory)
{
	idmap m = {0};
	cr_assert_null(idmap_find(&m, 1));
	cr_assert_null(idmap_next(&m, NULL));
	cr_assert_eq(idmap_count(&m), 0);
	cr_assert_null(m.slots);
	idmap_free(&m);
}

Test(idmap, inserted_items_are_found_with_their_value)
{
	enum { N = 1000 };
	static item items[N];
	idmap m = {0};
	for (int i = 0; i < N; i++) {
		items[i].id = (uint64_t)i + 1;
		cr_assert_eq(idmap_insert(&m, &items[i], (uint32_t)i * 3), 0);
	}
	assert_shape(&m);
	for (int i = 0; i < N; i++) {
		idmap_slot *s = idmap_find(&m, (uint64_t)i + 1);
		cr_assert_not_null(s);
		cr_assert_eq(s->item, &items[i]);
		cr_assert_eq(s->value, (uint32_t)i * 3);
	}
	cr_assert_null(idmap_find(&m, 0));
	cr_assert_null(idmap_find(&m, N + 1));
	cr_assert_null(idmap_find(&m, UINT64_MAX));
	idmap_free(&m);
}

Test(idmap, value_changes_in_place_through_the_found_slot)
{
	item a = {.id = 42};
	idmap m = {0};
	cr_assert_eq(idmap_insert(&m, &a, 1), 0);
	idmap_find(&m, 42)->value += 5;
	cr_assert_eq(idmap_find(&m, 42)->value, 6);
	idmap_free(&m);
}

Test(idmap, iteration_visits_every_item_once)
{
	enum { N = 500 };
	static item items[N];
	idmap m = {0};
	for (int i = 0; i < N; i++) {
		items[i].id = (uint64_t)i * 7919 + 3;
		cr_assert_eq(idmap_insert(&m, &items[i], 0), 0);
	}
	for (idmap_slot *s = idmap_next(&m, NULL); s; s = idmap_next(&m, s))
		((item *)s->item)->seen++;
	for (int i = 0; i < N; i++)
		cr_assert_eq(items[i].seen, 1, "item %d seen %d times", i, items[i].seen);
	idmap_free(&m);
}

Test(idmap, removal_pulls_back_a_cluster_that_wraps_past_the_end)
{
	uint64_t at7[3], at0[1];
	ids_with_home(7, at7, 3);
	ids_with_home(0, at0, 1);
	item a = {.id = at7[0]}, b = {.id = at7[1]}, c = {.id = at7[2]}, d = {.id = at0[0]};
	idmap m = {0};
	/* Four entries stay within 8 slots: 7, then 0 and 1 past the end,
	 * and d, whose home 0 is taken, at 2. */
	cr_assert_eq(idmap_insert(&m, &a, 0), 0);
	cr_assert_eq(idmap_insert(&m, &b, 0), 0);
	cr_assert_eq(idmap_insert(&m, &c, 0), 0);
	cr_assert_eq(idmap_insert(&m, &d, 0), 0);
	cr_assert_eq(m.cap, 8);
	cr_assert_eq(index_of(&m, d.id), 2);

	idmap_remove(&m, idmap_find(&m, a.id));
	cr_assert_null(idmap_find(&m, a.id));
	cr_assert_eq(index_of(&m, b.id), 7);
	cr_assert_eq(index_of(&m, c.id), 0);
	cr_assert_eq(index_of(&m, d.id), 1);
	cr_assert_null(m.slots[2].item, "the hole ends at the cluster's end");
	assert_shape(&m);
	idmap_free(&m);
}

Test(idmap, removal_leaves_an_entry_at_its_home_where_it_is)
{
	uint64_t at3[2], at5[1];
	ids_with_home(3, at3, 2);
	ids_with_home(5, at5, 1);
	item a = {.id = at3[0]}, b = {.id = at3[1]}, c = {.id = at5[0]};
	idmap m = {0};
	cr_assert_eq(idmap_insert(&m, &a, 0), 0);
	cr_assert_eq(idmap_insert(&m, &b, 0), 0);
	cr_assert_eq(idmap_insert(&m, &c, 0), 0);

	idmap_remove(&m, idmap_find(&m, a.id));
	cr_assert_eq(index_of(&m, b.id), 3);
	/* Moving c back to 4 would put it before its home: no lookup
	 * would find it. */
	cr_assert_eq(index_of(&m, c.id), 5);
	cr_assert_null(m.slots[4].item);
	idmap_free(&m);
}

static int by_hash(const void *x, const void *y)
{
	const idmap_slot *a = x, *b = y;
	return (a->hash > b->hash) - (a->hash < b->hash);
}

Test(idmap, ids_whose_kept_hash_bits_match_are_told_apart)
{
	/* Among 300 000 ids some pairs share the 32 hash bits the table
	 * keeps (about ten expected); find one. */
	enum { N = 300000 };
	item *items = calloc(N, sizeof(*items));
	idmap_slot *all = calloc(N, sizeof(*all));
	cr_assert(items && all);
	idmap m = {0};
	for (int i = 0; i < N; i++) {
		items[i].id = (uint64_t)i + 1;
		cr_assert_eq(idmap_insert(&m, &items[i], 0), 0);
	}
	int n = 0;
	for (idmap_slot *s = idmap_next(&m, NULL); s; s = idmap_next(&m, s))
		all[n++] = *s;
	idmap_free(&m);
	qsort(all, (size_t)n, sizeof(*all), by_hash);
	uint64_t x = 0, y = 0;
	for (int i = 1; i < n && !x; i++)
		if (all[i].hash == all[i - 1].hash) {
			x = ((item *)all[i - 1].item)->id;
			y = ((item *)all[i].item)->id;
		}
	cr_assert_neq(x, 0, "no two ids among %d share their hash bits", N);

	item a = {.id = x}, b = {.id = y};
	cr_assert_eq(idmap_insert(&m, &a, 1), 0);
	cr_assert_null(idmap_find(&m, y), "id %llu must not find id %llu", (unsigned long long)y,
		       (unsigned long long)x);
	cr_assert_eq(idmap_insert(&m, &b, 2), 0);
	cr_assert_eq(idmap_find(&m, x)->item, &a);
	cr_assert_eq(idmap_find(&m, y)->item, &b);
	idmap_remove(&m, idmap_find(&m, x));
	cr_assert_null(idmap_find(&m, x));
	cr_assert_eq(idmap_find(&m, y)->value, 2);
	idmap_free(&m);
	free(items);
	free(all);
}

Test(idmap, table_grows_past_three_quarters_and_shrinks_when_sparse)
{
	enum { N = 1000 };
	static item items[N];
	idmap m = {0};
	for (int i = 0; i < 6; i++) {
		items[i].id = (uint64_t)i + 1;
		cr_assert_eq(idmap_insert(&m, &items[i], 0), 0);
	}
	cr_assert_eq(m.cap, 8, "6 of 8 slots is 3/4: no growth yet");
	items[6].id = 7;
	cr_assert_eq(idmap_insert(&m, &items[6], 0), 0);
	cr_assert_eq(m.cap, 16);
	for (int i = 7; i < N; i++) {
		items[i].id = (uint64_t)i + 1;
		cr_assert_eq(idmap_insert(&m, &items[i], 0), 0);
	}
	cr_assert_eq(m.cap, 2048);
	for (int i = 0; i < N; i++) {
		idmap_remove(&m, idmap_find(&m, items[i].id));
		assert_shape(&m);
		for (int j = i + 1; j < N; j += 97)
			cr_assert_not_null(idmap_find(&m, items[j].id));
	}
	cr_assert_eq(m.count, 0);
	cr_assert_eq(m.cap, 8, "an emptied table is back at its smallest, %u slots", m.cap);
	idmap_free(&m);
}

Test(idmap, a_reserve_sizes_the_table_once_for_the_inserts_to_come)
{
	enum { N = 1000 };
	static item items[N];
	idmap m = {0};
	items[0].id = 1;
	cr_assert_eq(idmap_insert(&m, &items[0], 5), 0);
	cr_assert_eq(idmap_reserve(&m, N), 0);
	cr_assert_eq(m.cap, 2048, "1000 entries need 2048 slots at 3/4, not %u", m.cap);
	cr_assert_eq(idmap_find(&m, 1)->value, 5, "the entry moved with its value");
	for (int i = 1; i < N; i++) {
		items[i].id = (uint64_t)i + 1;
		cr_assert_eq(idmap_insert(&m, &items[i], 0), 0);
		cr_assert_eq(m.cap, 2048, "insert %d grew the reserved table", i);
	}
	assert_shape(&m);
	cr_assert_eq(idmap_reserve(&m, 10), 0);
	cr_assert_eq(m.cap, 2048, "a smaller reserve never shrinks the table");
	idmap_free(&m);
}

/* xorshift64: the same churn on every run. */
static uint64_t next_random(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

/* Random inserts, updates and removals in phases that fill the table and
 * drain it. with_aux: second values (idmap_aux_on, turned on once the table
 * holds entries) are checked as well: IDMAP_AUX_NONE for what the table
 * held then and for each entry inserted, and each stays with its entry
 * while insertions, backward shifts, growth and shrinking move it. */
static void churn(bool with_aux)
{
	enum { IDS = 3000, OPS = 200000, AUX_FROM = 1000 };
	static item items[IDS];
	static bool in[IDS];
	static uint32_t values[IDS], aux[IDS];
	uint64_t rnd = 0x9e3779b97f4a7c15u;
	uint32_t most = 0, least_after_most = UINT32_MAX;
	idmap m = {0};

	for (int i = 0; i < IDS; i++)
		items[i].id = (uint64_t)i * 1000003 + 1;
	for (int op = 0; op < OPS; op++) {
		if (with_aux && op == AUX_FROM) {
			cr_assert_gt(m.count, 0);
			cr_assert_eq(idmap_aux_on(&m), 0);
			for (int j = 0; j < IDS; j++)
				aux[j] = IDMAP_AUX_NONE;
		}
		bool aux_on = with_aux && op >= AUX_FROM;
		/* Phases that fill up and drain, so the table grows and shrinks. */
		bool filling = (op / 20000) % 2 == 0;
		int i = (int)(next_random(&rnd) % IDS);
		idmap_slot *s = idmap_find(&m, items[i].id);
		cr_assert_eq(s != NULL, in[i], "op %d: id %llu found %d, present %d", op,
			     (unsigned long long)items[i].id, s != NULL, in[i]);
		if (!in[i] && (filling || next_random(&rnd) % 16 == 0)) {
			values[i] = (uint32_t)op;
			cr_assert_eq(idmap_insert(&m, &items[i], values[i]), 0);
			in[i] = true;
			if (aux_on) {
				uint32_t *a = idmap_aux(&m, idmap_find(&m, items[i].id));
				cr_assert_eq(*a, IDMAP_AUX_NONE, "op %d: a new entry's", op);
				*a = aux[i] = (uint32_t)op;
			}
		} else if (in[i] && (!filling || next_random(&rnd) % 4 == 0)) {
			cr_assert_eq(s->value, values[i]);
			idmap_remove(&m, s);
			in[i] = false;
		} else if (in[i]) {
			s->value = ++values[i];
			if (aux_on)
				*idmap_aux(&m, s) = aux[i] = ~(uint32_t)op;
		}
		if (m.cap > most) {
			most = m.cap;
			least_after_most = m.cap;
		} else if (m.cap < least_after_most) {
			least_after_most = m.cap;
		}
		if (op % 5000 == 0) {
			assert_shape(&m);
			for (int j = 0; j < IDS; j++) {
				idmap_slot *t = idmap_find(&m, items[j].id);
				cr_assert_eq(t != NULL, in[j]);
				if (t)
					cr_assert_eq(t->item, &items[j]);
				if (t && aux_on)
					cr_assert_eq(*idmap_aux(&m, t), aux[j],
						     "op %d: id %llu's second value %u, not %u", op,
						     (unsigned long long)items[j].id,
						     *idmap_aux(&m, t), aux[j]);
			}
		}
	}
	cr_assert_geq(most, 2048, "filling reached only %u slots", most);
	cr_assert_leq(least_after_most, most / 4, "draining shrank %u slots only to %u", most,
		      least_after_most);
	idmap_free(&m);
	cr_assert_null(m.slots);
	cr_assert_null(m.aux);
	cr_assert_eq(m.count, 0);
}

Test(idmap, churn_keeps_every_entry_reachable)
{
	churn(false);
}

Test(idmap, second_values_move_with_their_entries)
{
	churn(true);
}
