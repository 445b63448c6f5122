/*
 * Parked requests: Waits that answer when their buffer leaves PENDING or
 * their timeout fires, and Allocs that wait for a backend job (a new CUDA
 * slab). Parking knows the broker and the loop's timers, never a socket:
 * an answer goes to the callback its owner handed in.
 *
 * Everything here runs on the loop thread.
 */
#ifndef BB_PARK_H
#define BB_PARK_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "broker.h"

typedef struct park park;
typedef struct park_wait park_wait;

/* A parked wait ended: code 0 with the buffer's state and error text
 * (woken), or BB_ERR_NOT_FOUND (the buffer was freed), BB_ERR_TIMEOUT (its
 * timeout fired) or BB_ERR_DISCONNECTED (dropped with park_waits_drop: not
 * to be answered), with error the sentence that says so. The wait is gone
 * when this runs; it must not call into the broker. */
typedef void (*park_wait_done)(void *owner, uint64_t req_id, int code, bb_state state,
			       const char *error);

/* An Alloc the backend could not answer yet (BACKEND_GROW), as its owner
 * asked it: retried, in arrival order, after each backend job. */
typedef struct park_alloc {
	void *owner;     /* who asked (the owner's context) */
	uint64_t req_id; /* the Alloc request's id */
	bool quiet;      /* Request.no_reply */
	uint64_t size;   /* the Alloc's fields, copied */
	int kind;
	int32_t device;
	uint32_t share;
	int cuda_handle;                /* BB_CUDA_HANDLE_* asked for */
	char *name;                     /* copy, or NULL */
	struct park_alloc *prev, *next; /* the lot's list, oldest first */
} park_alloc;

/* A parking lot on loop for buffers of broker b. NULL out of memory. */
park *park_new(uv_loop_t *loop, broker *b);
/* Free the lot. Every wait must have ended and every alloc been dropped
 * (park_waits_drop, park_allocs_drop); the loop must then run once more
 * for the timers' handles to close. */
void park_free(park *p);

/* Wait on buffer buf_id for connection bc, at most timeout_ms (< 0: no
 * limit). 1: the buffer is not PENDING, nothing parked (*state and error,
 * 256 bytes, filled); 0: parked, linked into *list, and done(owner, req_id,
 * ...) will run once; BB_ERR_TIMEOUT with timeout_ms 0 and the buffer
 * pending (nothing parked); or another BB_ERR_* refusal. err says why on
 * every error. */
int park_wait_start(park *p, park_wait **list, broker_conn *bc, uint64_t buf_id, uint64_t req_id,
		    int64_t timeout_ms, park_wait_done done, void *owner, bb_state *state,
		    char error[256], broker_error *err);
/* End every wait of *list with BB_ERR_DISCONNECTED (their owner is going),
 * cancelling them in the broker. */
void park_waits_drop(park *p, park_wait **list);
/* How many waits *list holds. */
uint32_t park_waits_count(park_wait *const *list);

/* Park a copy of *a (its list links ignored). 0, or BB_ERR_NO_MEMORY. */
int park_alloc_add(park *p, const park_alloc *a);
/* Retry every parked alloc once, oldest first: retry returns true when it
 * answered one (it is freed), false to keep it parked, behind those that
 * were parked meanwhile. */
void park_allocs_retry(park *p, bool (*retry)(void *ctx, const park_alloc *a), void *ctx);
/* Free owner's parked allocs, unanswered; returns how many there were. */
uint32_t park_allocs_drop(park *p, void *owner);
/* Allocs parked in all. */
uint64_t park_allocs_count(const park *p);

#endif /* BB_PARK_H */
