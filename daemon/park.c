/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Parked Waits (the broker's waiter and a timer each) and parked Allocs (a
 * FIFO retried after backend jobs).
 */
#include "park.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utlist.h>

struct park {
	uv_loop_t *loop;    /* the timers' loop */
	broker *b;          /* where waits park */
	park_alloc *allocs; /* parked allocs, oldest first */
	uint64_t nallocs;   /* how many */
};

/* A parked Wait: answered by the broker's wake or by its timer. */
struct park_wait {
	broker_waiter w;        /* linked into the broker while parked */
	uv_timer_t timer;       /* the timeout, when there is one */
	bool has_timer;         /* timer was initialised */
	park *p;                /* its lot */
	park_wait **list;       /* the owner's list it is linked in */
	uint64_t req_id;        /* the Wait request's id */
	park_wait_done done;    /* how its owner hears the end */
	void *owner;            /* done's context */
	park_wait *prev, *next; /* the owner's list */
};

park *park_new(uv_loop_t *loop, broker *b)
{
	park *p = calloc(1, sizeof(*p));
	if (p) {
		p->loop = loop;
		p->b = b;
	}
	return p;
}

void park_free(park *p)
{
	free(p);
}

static void wait_free_cb(uv_handle_t *h)
{
	free(h->data);
}

/* Unlink pw and free it (after its timer closes), then tell its owner. */
static void wait_end(park_wait *pw, int code, bb_state state, const char *error)
{
	park_wait_done done = pw->done;
	void *owner = pw->owner;
	uint64_t req_id = pw->req_id;

	DL_DELETE(*pw->list, pw);
	if (pw->has_timer) {
		uv_timer_stop(&pw->timer);
		uv_close((uv_handle_t *)&pw->timer, wait_free_cb);
	} else {
		free(pw);
	}
	done(owner, req_id, code, state, error);
}

static void on_wake(broker_waiter *w, int code, bb_state state, const char *error)
{
	park_wait *pw = (park_wait *)w;
	if (code == 0)
		wait_end(pw, 0, state, error ? error : "");
	else
		wait_end(pw, code, state, "the buffer was freed while waiting");
}

static void on_wait_timeout(uv_timer_t *t)
{
	park_wait *pw = t->data;
	broker_wait_cancel(pw->p->b, &pw->w);
	wait_end(pw, BB_ERR_TIMEOUT, BB_PENDING, "the buffer is still pending");
}

int park_wait_start(park *p, park_wait **list, broker_conn *bc, uint64_t buf_id, uint64_t req_id,
		    int64_t timeout_ms, park_wait_done done, void *owner, bb_state *state,
		    char error[256], broker_error *err)
{
	park_wait *pw = calloc(1, sizeof(*pw));
	if (!pw) {
		snprintf(err->msg, sizeof(err->msg), "daemon out of memory");
		return BB_ERR_NO_MEMORY;
	}
	pw->w.wake = on_wake;
	pw->p = p;
	pw->list = list;
	pw->req_id = req_id;
	pw->done = done;
	pw->owner = owner;
	int rc = broker_wait(p->b, bc, buf_id, &pw->w, state, error, err);
	if (rc != 0) {
		free(pw); /* 1: not pending; < 0: refused */
		return rc;
	}
	if (timeout_ms == 0) {
		broker_wait_cancel(p->b, &pw->w);
		free(pw);
		snprintf(err->msg, sizeof(err->msg), "the buffer is still pending");
		return BB_ERR_TIMEOUT;
	}
	DL_APPEND(*list, pw);
	if (timeout_ms > 0) {
		uv_timer_init(p->loop, &pw->timer);
		pw->timer.data = pw;
		pw->has_timer = true;
		uv_timer_start(&pw->timer, on_wait_timeout, (uint64_t)timeout_ms, 0);
	}
	return 0;
}

void park_waits_drop(park *p, park_wait **list)
{
	while (*list) {
		park_wait *pw = *list;
		broker_wait_cancel(p->b, &pw->w);
		wait_end(pw, BB_ERR_DISCONNECTED, BB_PENDING, "the connection closed");
	}
}

uint32_t park_waits_count(park_wait *const *list)
{
	uint32_t n = 0;
	for (const park_wait *pw = *list; pw; pw = pw->next)
		n++;
	return n;
}

int park_alloc_add(park *p, const park_alloc *a)
{
	park_alloc *pa = malloc(sizeof(*pa));
	if (!pa)
		return BB_ERR_NO_MEMORY;
	*pa = *a;
	pa->name = NULL;
	if (a->name && a->name[0] && !(pa->name = strdup(a->name))) {
		free(pa);
		return BB_ERR_NO_MEMORY;
	}
	DL_APPEND(p->allocs, pa);
	p->nallocs++;
	return 0;
}

static void alloc_free(park *p, park_alloc *pa)
{
	p->nallocs--;
	free(pa->name);
	free(pa);
}

void park_allocs_retry(park *p, bool (*retry)(void *ctx, const park_alloc *a), void *ctx)
{
	/* Detach the list: what parks again during the round goes to the
	 * end of a fresh one, so the order holds and the round ends. */
	park_alloc *list = p->allocs, *pa, *tmp;
	p->allocs = NULL;
	DL_FOREACH_SAFE (list, pa, tmp) {
		DL_DELETE(list, pa);
		if (retry(ctx, pa))
			alloc_free(p, pa);
		else
			DL_APPEND(p->allocs, pa);
	}
}

uint32_t park_allocs_drop(park *p, void *owner)
{
	park_alloc *pa, *tmp;
	uint32_t n = 0;
	DL_FOREACH_SAFE (p->allocs, pa, tmp) {
		if (pa->owner != owner)
			continue;
		DL_DELETE(p->allocs, pa);
		alloc_free(p, pa);
		n++;
	}
	return n;
}

uint64_t park_allocs_count(const park *p)
{
	return p->nallocs;
}
