/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The client side of bench/callgrind.sh: one loop of N iterations of one
 * operation against the daemon at $BUFBROKER_SOCKET, nothing else, so that
 * the difference between two runs of different N is the cost of N more.
 *
 * Usage: cgloop rt N       bb_retain + bb_release of a held 4 KiB buffer
 *        cgloop alloc N    bb_alloc (1 MiB host) + bb_map + bb_unref
 *        cgloop mt N       rt N in each of MT_THREADS threads sharing one
 *                          connection (pipelined requests)
 */
#include <bufbroker/bufbroker.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MT_THREADS 8

static int fail(const char *what)
{
	fprintf(stderr, "cgloop: %s: %s\n", what, bb_last_error());
	return 1;
}

struct mt {
	bb_client *c;
	uint64_t id;
	long n;
	int rc;
};

static void *mt_thread(void *arg)
{
	struct mt *m = arg;
	for (long i = 0; i < m->n && !m->rc; i++)
		if (bb_retain(m->c, m->id, 1) || bb_release(m->c, m->id, 1))
			m->rc = fail("bb_retain/bb_release");
	return NULL;
}

int main(int argc, char **argv)
{
	bb_client *c;
	bb_buf *held;
	bb_info info;

	if (argc != 3 ||
	    (strcmp(argv[1], "rt") && strcmp(argv[1], "alloc") && strcmp(argv[1], "mt"))) {
		fprintf(stderr, "usage: cgloop rt|alloc|mt N\n");
		return 2;
	}
	long n = atol(argv[2]);
	bool rt = strcmp(argv[1], "alloc") != 0;
	bb_alloc_opts o = {.size = rt ? 4096 : 1 << 20, .kind = BB_HOST};

	if (bb_connect(NULL, &c))
		return fail("bb_connect");
	if (bb_alloc(c, &o, &held))
		return fail("bb_alloc");
	if (!strcmp(argv[1], "mt")) {
		struct mt m[MT_THREADS];
		pthread_t th[MT_THREADS];
		for (int t = 0; t < MT_THREADS; t++) {
			m[t] = (struct mt){.c = c, .id = bb_id(held), .n = n};
			if (pthread_create(&th[t], NULL, mt_thread, &m[t]))
				return fail("pthread_create");
		}
		int rc = 0;
		for (int t = 0; t < MT_THREADS; t++) {
			pthread_join(th[t], NULL);
			rc |= m[t].rc;
		}
		if (rc)
			return rc;
		n = 0;
	}
	for (long i = 0; i < n; i++) {
		if (rt) {
			if (bb_retain(c, bb_id(held), 1) || bb_release(c, bb_id(held), 1))
				return fail("bb_retain/bb_release");
		} else {
			bb_buf *b;
			void *p;
			if (bb_alloc(c, &o, &b) || bb_map(b, &p))
				return fail("bb_alloc/bb_map");
			bb_unref(b);
		}
	}
	/* A round trip after the last fire-and-forget Release: the daemon
	 * has handled everything before the client goes. */
	if (bb_stat(c, bb_id(held), &info))
		return fail("bb_stat");
	bb_unref(held);
	bb_disconnect(c);
	return 0;
}
