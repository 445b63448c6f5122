/*
 * libbufbroker: one connection to bufbrokerd (bb_client) and the
 * process-local, reference-counted handles it hands out (bb_buf).
 *
 * Receiving is leader/follower, without a reader thread of its own: a
 * thread waiting for its response becomes the reader when no other thread
 * is reading, receives one datagram with the state lock dropped, hands it
 * to the call it answers and wakes everyone; the others sleep on the
 * condition variable. A round trip thus costs one context switch, and a
 * thread parked in bb_wait(-1) keeps delivering other threads' responses.
 *
 * Each handle stands for exactly one daemon count of this connection;
 * local copies (bb_ref) only move the handle's atomic count. A count can
 * only reach 0 under the client lock, so a bb_open that finds a listed
 * handle under that lock never revives a dying one.
 *
 * CUDA buffers are mapped through one process-wide cache of opened
 * allocations (see "CUDA mapping" below), shared by every bb_client.
 */
#include "client_internal.h"
#include "cuda_api.h"
#include "flatwire.h"
#include "kinds.h"
#include "msgio.h"
#include "wire.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* A handle the table cannot take (out of memory) stays unlisted: it works,
 * it just is not coalesced with later opens of the same id. A CUDA
 * allocation the cache cannot list is closed again (see cuda_open). */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) ((obj)->listed = 0)
#include <uthash.h>
#include <utlist.h>

#define BB_EXPORT __attribute__((visibility("default")))

/* Requests that pack into this many bytes are sent from the stack. */
#define SEND_STACK_BYTES 512
/* Cap on the receive buffer, whatever the daemon announces. */
#define RECV_MAX_BYTES (16u << 20)

/* One request waiting for its response; lives on the caller's stack. */
struct call {
	uint64_t id;               /* the request id the response echoes */
	int done;                  /* resp (or flat) and fd are set */
	int want_flat;             /* a plain RefsReply may be answered in flat */
	int flat_ok;               /* flat holds the answer; resp is NULL */
	flat_refs_resp flat;       /* a successful RefsReply, read by flatwire */
	Bufbroker__Response *resp; /* the response, owned by the caller */
	int fd;                    /* the fd attached to it, or -1 */
	struct call *prev, *next;  /* bb_client.calls */
};

struct bb_buf {
	bb_client *client;
	uint64_t id;
	size_t size;
	bb_kind kind;
	int device;
	_Atomic uint64_t count;     /* local counts; reaches 0 only under client->mu */
	pthread_mutex_t map_mu;     /* serializes the first bb_map */
	int fd;                     /* host memfd until mapped, else -1 (map_mu) */
	_Atomic(void *) map;        /* host mapping or CUDA device pointer, once made */
	struct cuda_alloc *cmap;    /* CUDA: the opened allocation, once mapped (map_mu) */
	int listed;                 /* in client->bufs (client->mu) */
	UT_hash_handle hh;          /* client->bufs, keyed by id */
	struct bb_buf *prev, *next; /* client->all (client->mu) */
	/* CUDA: where the buffer lives, from the grant; fixed once made. */
	int has_ipc;                                  /* the grant carried these fields */
	unsigned char ipc_handle[BB_IPC_HANDLE_SIZE]; /* the allocation's IPC handle */
	uint64_t ipc_offset;                          /* buffer start inside the allocation */
	uint64_t allocation;                          /* the daemon's id of the allocation */
	unsigned char device_uuid[16];                /* the device it lives on */
};

struct bb_client {
	int sock;                /* SOCK_SEQPACKET, blocking */
	pthread_mutex_t mu;      /* guards the fields below */
	pthread_cond_t cv;       /* a response was delivered, the reader left, or death */
	pthread_mutex_t send_mu; /* one sendmsg at a time; never taken under mu */
	uint64_t next_id;        /* next request id (non-zero) */
	struct call *calls;      /* requests waiting for a response */
	int reading;             /* a thread is receiving (the leader) */
	int dead;                /* the connection is gone; set once */
	char dead_msg[384];      /* why, for bb_last_error; fixed once dead */
	unsigned char *rbuf;     /* receive buffer, used by the reader only */
	size_t rcap;             /* its size */
	size_t max_send;         /* the daemon's datagram limit */
	struct bb_buf *bufs;     /* listed handles by id (uthash) */
	struct bb_buf *all;      /* every live handle, listed or not */
};

static _Thread_local char last_error[512];

/* ---- errors ---------------------------------------------------------------- */

BB_EXPORT int bbc_fail(int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	return code;
}

BB_EXPORT const char *bb_last_error(void)
{
	return last_error;
}

/* A thread-safe strerror. */
static const char *errstr(int err, char *buf, size_t len)
{
	return strerror_r(err, buf, len);
}

/* ---- connection state ------------------------------------------------------ */

/* Mark the connection gone (the first reason sticks), stop the socket so a
 * blocked reader or sender returns, and wake every waiting call. mu held. */
__attribute__((format(printf, 2, 3))) static void client_die_locked(bb_client *c, const char *fmt,
								    ...)
{
	if (!c->dead) {
		va_list ap;

		c->dead = 1;
		va_start(ap, fmt);
		vsnprintf(c->dead_msg, sizeof(c->dead_msg), fmt, ap);
		va_end(ap);
		shutdown(c->sock, SHUT_RDWR);
	}
	pthread_cond_broadcast(&c->cv);
}

/* The error every call on a dead client answers. dead_msg is fixed once
 * dead is set, so reading it after seeing dead (under mu) is safe. */
static int client_fail_dead(const bb_client *c)
{
	return bbc_fail(BB_ERR_DISCONNECTED, "%s", c->dead_msg);
}

/* Send one packed request, fd attached unless fd < 0. No lock held. */
static int client_send_packed(bb_client *c, const uint8_t *buf, size_t len, int fd)
{
	ssize_t n;
	char eb[128];

	pthread_mutex_lock(&c->send_mu);
	n = msgio_send(c->sock, buf, len, fd);
	pthread_mutex_unlock(&c->send_mu);
	if (n >= 0)
		return 0;
	if (n == -EPIPE || n == -ECONNRESET || n == -ENOTCONN) {
		int rc;

		pthread_mutex_lock(&c->mu);
		client_die_locked(c, "lost the connection to bufbrokerd: %s",
				  errstr((int)-n, eb, sizeof(eb)));
		rc = client_fail_dead(c);
		pthread_mutex_unlock(&c->mu);
		return rc;
	}
	return bbc_fail(BB_ERR_SYSTEM, "sending a request to bufbrokerd failed: %s",
			errstr((int)-n, eb, sizeof(eb)));
}

/* Pack and send one request, fd attached unless fd < 0. No lock held. */
static int client_send(bb_client *c, const Bufbroker__Request *req, int fd)
{
	uint8_t stackbuf[SEND_STACK_BYTES];
	size_t len = bufbroker__request__get_packed_size(req);
	uint8_t *buf = stackbuf;
	int rc;

	if (len > c->max_send)
		return bbc_fail(BB_ERR_INVALID,
				"request of %zu bytes exceeds the daemon's limit of %zu bytes", len,
				c->max_send);
	if (len > sizeof(stackbuf)) {
		buf = malloc(len);
		if (!buf)
			return bbc_fail(BB_ERR_NO_MEMORY, "out of memory packing a request");
	}
	bufbroker__request__pack(req, buf);
	rc = client_send_packed(c, buf, len, fd);
	if (buf != stackbuf)
		free(buf);
	return rc;
}

/* Become the reader for one datagram: drop mu while receiving, then hand
 * the response to the call it answers (or drop it) and wake everyone.
 * Called and returns with mu held; c->reading must be 0. */
static void client_read_locked(bb_client *c)
{
	Bufbroker__Response *r = NULL;
	int fd = -1, truncated = 0, delivered = 0, flat_ok = 0;
	flat_refs_resp flat;
	struct call *k;
	ssize_t n;
	char eb[128];

	c->reading = 1;
	pthread_mutex_unlock(&c->mu);
	n = msgio_recv(c->sock, c->rbuf, c->rcap, &fd, &truncated);
	if (n > 0 && !truncated) {
		flat_ok = fd < 0 && flat_refs_resp_decode(c->rbuf, (size_t)n, &flat);
		if (!flat_ok)
			r = bufbroker__response__unpack(NULL, (size_t)n, c->rbuf);
	}
	pthread_mutex_lock(&c->mu);
	c->reading = 0;

	if (flat_ok) {
		/* A plain RefsReply: a call that asked for flat answers takes it
		 * as it is; any other (bbc_call's callers) gets it unpacked. */
		DL_FOREACH (c->calls, k) {
			if (k->id == flat.id && !k->done && k->want_flat) {
				k->flat = flat;
				k->flat_ok = 1;
				k->done = 1;
				pthread_cond_broadcast(&c->cv);
				return;
			}
		}
		r = bufbroker__response__unpack(NULL, (size_t)n, c->rbuf);
	}

	if (n == 0) {
		client_die_locked(c, "bufbrokerd closed the connection");
	} else if (n < 0) {
		client_die_locked(c, "lost the connection to bufbrokerd: %s",
				  errstr((int)-n, eb, sizeof(eb)));
	} else if (truncated) {
		client_die_locked(c,
				  "bufbrokerd sent a datagram over %zu bytes or with several "
				  "file descriptors; connection closed",
				  c->rcap);
	} else if (!r) {
		client_die_locked(c, "bufbrokerd sent a response that could not be decoded; "
				     "connection closed");
	} else if (r->id == 0) {
		/* The daemon could not attribute our request and is closing us. */
		const char *m =
			r->status && r->status->message[0] ? r->status->message : "no reason given";
		client_die_locked(c, "bufbrokerd ended the connection: %s", m);
	} else {
		DL_FOREACH (c->calls, k) {
			if (k->id == r->id && !k->done) {
				k->resp = r;
				k->fd = fd;
				k->done = 1;
				delivered = 1;
				break;
			}
		}
	}
	if (!delivered) {
		/* Unsolicited, for a call that gave up, or fatal: nobody takes it. */
		if (r)
			bufbroker__response__free_unpacked(r, NULL);
		if (fd >= 0)
			close(fd);
	}
	pthread_cond_broadcast(&c->cv);
}

/* Give k its request id and list it, before the request is sent: the
 * response may be read by another thread before send returns. */
static int call_register(bb_client *c, struct call *k)
{
	int rc = 0;

	pthread_mutex_lock(&c->mu);
	if (c->dead)
		rc = client_fail_dead(c);
	else {
		k->id = c->next_id++;
		DL_APPEND(c->calls, k);
	}
	pthread_mutex_unlock(&c->mu);
	return rc;
}

/* After sending k's request (send_rc, 0 when sent): read until k is
 * answered or the connection dies, then unlist k. */
static int call_complete(bb_client *c, struct call *k, int send_rc)
{
	int rc = send_rc;

	pthread_mutex_lock(&c->mu);
	if (rc == 0) {
		while (!k->done && !c->dead) {
			if (!c->reading)
				client_read_locked(c);
			else
				pthread_cond_wait(&c->cv, &c->mu);
		}
		if (!k->done)
			rc = client_fail_dead(c);
	}
	DL_DELETE(c->calls, k);
	pthread_mutex_unlock(&c->mu);
	if (rc && k->resp) {
		bufbroker__response__free_unpacked(k->resp, NULL);
		k->resp = NULL;
	}
	if (rc && k->fd >= 0) {
		close(k->fd);
		k->fd = -1;
	}
	return rc;
}

BB_EXPORT int bbc_call(bb_client *c, Bufbroker__Request *req, int fd, Bufbroker__Response **resp,
		       int *fd_in)
{
	struct call k = {.fd = -1};
	int rc;

	if (fd_in)
		*fd_in = -1;
	if (resp)
		*resp = NULL;
	if (!c || !req || !resp)
		return bbc_fail(BB_ERR_INVALID,
				"bbc_call: client, request and response are required");
	if (req->no_reply)
		return bbc_fail(BB_ERR_INVALID, "bbc_call: a no_reply request gets no response");

	rc = call_register(c, &k);
	if (rc)
		return rc;
	req->id = k.id;
	rc = call_complete(c, &k, client_send(c, req, fd));
	if (rc)
		return rc;

	*resp = k.resp;
	if (fd_in)
		*fd_in = k.fd;
	else if (k.fd >= 0)
		close(k.fd);
	return 0;
}

BB_EXPORT void bbc_response_free(Bufbroker__Response *r)
{
	if (r)
		bufbroker__response__free_unpacked(r, NULL);
}

static int response_check(Bufbroker__Response *r, int rfd, Bufbroker__Response__ResultCase want,
			  Bufbroker__Response **resp, int *fd_in);

/* Round trip req. 0: *resp is a successful response carrying `want` (any
 * result when NOT_SET) and *fd_in its fd or -1 (closed when fd_in is NULL).
 * Otherwise the daemon's code with its message as the last error. */
static int client_rpc(bb_client *c, Bufbroker__Request *req, int fd,
		      Bufbroker__Response__ResultCase want, Bufbroker__Response **resp, int *fd_in)
{
	Bufbroker__Response *r;
	int rfd = -1, rc;

	rc = bbc_call(c, req, fd, &r, fd_in ? &rfd : NULL);
	if (rc)
		return rc;
	return response_check(r, rfd, want, resp, fd_in);
}

/* client_rpc's verdict on the response r (with its fd rfd): r and rfd are
 * the caller's on success, freed and closed otherwise. */
static int response_check(Bufbroker__Response *r, int rfd, Bufbroker__Response__ResultCase want,
			  Bufbroker__Response **resp, int *fd_in)
{
	int rc = 0;
	const Bufbroker__Status *st = r->status;
	if (!st)
		rc = bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent a response without a status");
	else if (st->code > 0)
		rc = bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent an invalid status code %d",
			      (int)st->code);
	else if (st->code < 0)
		rc = bbc_fail(st->code, "%s", st->message[0] ? st->message : bb_strerror(st->code));
	else if (want != BUFBROKER__RESPONSE__RESULT__NOT_SET && r->result_case != want)
		rc = bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent an unexpected kind of response");
	if (rc) {
		bbc_response_free(r);
		if (rfd >= 0)
			close(rfd);
		return rc;
	}
	*resp = r;
	if (fd_in)
		*fd_in = rfd;
	else if (rfd >= 0)
		close(rfd);
	return 0;
}

/* Fire-and-forget Release{id, 1}: the last count of a handle, or the extra
 * count a coalesced open brought. Nothing to do on a dead connection: the
 * daemon released everything when it went. */
static void client_release_one(bb_client *c, uint64_t id)
{
	flat_refs_req rel = {.no_reply = true, .op = FLAT_OP_RELEASE, .buf_id = id, .count = 1};
	uint8_t buf[FLAT_MAX_BYTES];
	char saved[sizeof(last_error)];

	pthread_mutex_lock(&c->mu);
	if (c->dead) {
		pthread_mutex_unlock(&c->mu);
		return;
	}
	rel.id = c->next_id++;
	pthread_mutex_unlock(&c->mu);
	/* The callers report nothing, so keep the thread's last error. */
	memcpy(saved, last_error, sizeof(saved));
	(void)client_send_packed(c, buf, flat_refs_req_encode(&rel, buf), -1);
	memcpy(last_error, saved, sizeof(saved));
}

/* ---- CUDA mapping ---------------------------------------------------------- */

/*
 * One view of the CUDA driver per process, shared by every bb_client: the
 * driver is loaded once, each device's primary context is retained once
 * (and kept for the life of the process), and each allocation the daemon
 * hands out (a slab, or a large buffer's own allocation) is opened with
 * cuIpcOpenMemHandle once; a buffer inside it is base + offset. Real
 * drivers refuse a second open of the same handle in one process, and an
 * open costs about a millisecond, so the cache counts the mapped handles
 * using each allocation and closes it when the last one goes, before that
 * handle's Release can let the daemon free the memory (freeing legacy-IPC
 * memory that another process still has open is undefined).
 *
 * Devices are matched by UUID, never by ordinal: CUDA_VISIBLE_DEVICES may
 * number them differently here than in the daemon.
 */

/* One device as this process sees it. */
struct cuda_dev {
	CUdevice dev;           /* the ordinal this process uses */
	unsigned char uuid[16]; /* cuDeviceGetUuid */
	CUcontext ctx;          /* its primary context once retained, else NULL (cuda.mu) */
};

/* What identifies an allocation: its handle and the daemon's allocation id
 * (which changes when an allocation is replaced, so a mapping of an old
 * one is never trusted for a new one). */
struct cuda_alloc_key {
	unsigned char handle[BB_IPC_HANDLE_SIZE];
	uint64_t allocation;
};

/* One opened allocation. */
struct cuda_alloc {
	struct cuda_alloc_key key; /* the hash key */
	CUdeviceptr base;          /* where cuIpcOpenMemHandle mapped it */
	struct cuda_dev *dev;      /* the device it lives on */
	unsigned long users;       /* mapped handles using it */
	int listed;                /* in cuda.allocs (uthash's out-of-memory flag) */
	UT_hash_handle hh;         /* cuda.allocs, keyed by key */
};

static struct {
	pthread_once_t once;       /* cuda_load runs once */
	int loaded;                /* the driver is usable; fixed after once */
	char why[384];             /* why it is not, for every bb_map */
	bb_cuda api;               /* the driver's entry points */
	struct cuda_dev *devs;     /* every device this process sees */
	int ndevs;                 /* how many */
	pthread_mutex_t mu;        /* guards devs[].ctx and allocs */
	struct cuda_alloc *allocs; /* opened allocations (uthash) */
} cuda = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER};

/* Load the driver and list its devices; on failure cuda.why says why. */
static void cuda_load(void)
{
	char eb[160];
	CUresult cr;
	int n = 0;

	if (bb_cuda_load(&cuda.api, cuda.why, sizeof(cuda.why)) != 0)
		return;
	cr = cuda.api.DeviceGetCount(&n);
	if (cr == CUDA_ERROR_NO_DEVICE) {
		n = 0;
	} else if (cr != CUDA_SUCCESS) {
		snprintf(cuda.why, sizeof(cuda.why), "cuDeviceGetCount failed: %s",
			 bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
		goto err_unload;
	}
	cuda.devs = calloc(n > 0 ? (size_t)n : 1, sizeof(*cuda.devs));
	if (!cuda.devs) {
		snprintf(cuda.why, sizeof(cuda.why), "out of memory listing CUDA devices");
		goto err_unload;
	}
	for (int i = 0; i < n; i++) {
		struct cuda_dev *d = &cuda.devs[i];
		CUuuid u;

		cr = cuda.api.DeviceGet(&d->dev, i);
		if (cr == CUDA_SUCCESS)
			cr = cuda.api.DeviceGetUuid(&u, d->dev);
		if (cr != CUDA_SUCCESS) {
			snprintf(cuda.why, sizeof(cuda.why),
				 "cannot identify CUDA device %d of this process: %s", i,
				 bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
			goto err_free;
		}
		memcpy(d->uuid, u.bytes, sizeof(d->uuid));
	}
	cuda.ndevs = n;
	cuda.loaded = 1;
	return;

err_free:
	free(cuda.devs);
	cuda.devs = NULL;
err_unload:
	bb_cuda_unload(&cuda.api);
}

/* 0 when the driver is loaded; BB_ERR_UNSUPPORTED with the reason else. */
static int cuda_require(void)
{
	pthread_once(&cuda.once, cuda_load);
	if (cuda.loaded)
		return 0;
	return bbc_fail(BB_ERR_UNSUPPORTED, "CUDA is not available in this process: %s", cuda.why);
}

/* Make ctx current on the calling thread; *prev gets the context that was,
 * for cuda_ctx_pop. */
static CUresult cuda_ctx_push(CUcontext ctx, CUcontext *prev)
{
	CUresult cr = cuda.api.CtxGetCurrent(prev);

	if (cr != CUDA_SUCCESS)
		return cr;
	return *prev == ctx ? CUDA_SUCCESS : cuda.api.CtxSetCurrent(ctx);
}

/* Give the calling thread back the context cuda_ctx_push found. */
static void cuda_ctx_pop(CUcontext ctx, CUcontext prev)
{
	if (prev != ctx)
		(void)cuda.api.CtxSetCurrent(prev);
}

/* The opened allocation holding b, with one more user: from the cache, or
 * opened now in the primary context of the device with b's UUID. The
 * driver must be loaded. 0, or BB_ERR_* with the last error set. */
static int cuda_open(const bb_buf *b, struct cuda_alloc **out)
{
	struct cuda_alloc_key key;
	struct cuda_alloc *a = NULL;
	struct cuda_dev *d = NULL;
	CUipcMemHandle h;
	CUcontext prev;
	CUresult cr;
	char ub[48], eb[160];
	int rc = 0;

	memset(&key, 0, sizeof(key));
	memcpy(key.handle, b->ipc_handle, sizeof(key.handle));
	key.allocation = b->allocation;

	/* Opening under the lock is what makes a second open of one handle
	 * impossible; it only delays threads mapping a new allocation. */
	pthread_mutex_lock(&cuda.mu);
	HASH_FIND(hh, cuda.allocs, &key, sizeof(key), a);
	if (a) {
		a->users++;
		goto out;
	}
	for (int i = 0; i < cuda.ndevs; i++) {
		if (memcmp(cuda.devs[i].uuid, b->device_uuid, sizeof(b->device_uuid)) == 0) {
			d = &cuda.devs[i];
			break;
		}
	}
	if (!d) {
		bb_cuda_uuid_format(b->device_uuid, ub);
		rc = bbc_fail(BB_ERR_NOT_FOUND,
			      "no CUDA device in this process has UUID %s (buffer %" PRIu64
			      " lives there); is it hidden by CUDA_VISIBLE_DEVICES?",
			      ub, b->id);
		goto out;
	}
	if (!d->ctx) {
		CUcontext ctx = NULL;

		cr = cuda.api.DevicePrimaryCtxRetain(&ctx, d->dev);
		if (cr != CUDA_SUCCESS) {
			rc = bbc_fail(cr == CUDA_ERROR_OUT_OF_MEMORY ? BB_ERR_NO_MEMORY
								     : BB_ERR_SYSTEM,
				      "retaining the primary context of CUDA device %d failed: %s",
				      (int)d->dev, bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
			goto out;
		}
		d->ctx = ctx;
	}
	a = calloc(1, sizeof(*a));
	if (!a) {
		rc = bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a CUDA mapping");
		goto out;
	}
	cr = cuda_ctx_push(d->ctx, &prev);
	if (cr != CUDA_SUCCESS) {
		rc = bbc_fail(BB_ERR_SYSTEM, "making CUDA device %d current failed: %s",
			      (int)d->dev, bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
		goto err_free;
	}
	memcpy(h.reserved, key.handle, sizeof(h.reserved));
	cr = cuda.api.IpcOpenMemHandle(&a->base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	if (cr != CUDA_SUCCESS) {
		cuda_ctx_pop(d->ctx, prev);
		rc = bbc_fail(cr == CUDA_ERROR_OUT_OF_MEMORY ? BB_ERR_NO_MEMORY : BB_ERR_SYSTEM,
			      "opening the CUDA IPC handle of buffer %" PRIu64
			      " (allocation %" PRIu64 ") on device %d failed: %s",
			      b->id, b->allocation, (int)d->dev,
			      bb_cuda_error(&cuda.api, cr, eb, sizeof(eb)));
		goto err_free;
	}
	a->key = key;
	a->dev = d;
	a->users = 1;
	a->listed = 1;
	HASH_ADD(hh, cuda.allocs, key, sizeof(a->key), a);
	if (!a->listed) {
		/* Unlisted, the next buffer of this allocation would open it
		 * a second time: give it up instead. */
		(void)cuda.api.IpcCloseMemHandle(a->base);
		cuda_ctx_pop(d->ctx, prev);
		rc = bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a CUDA mapping");
		goto err_free;
	}
	cuda_ctx_pop(d->ctx, prev);
	goto out;

err_free:
	free(a);
	a = NULL;
out:
	pthread_mutex_unlock(&cuda.mu);
	*out = a;
	return rc;
}

/* Drop one user of a; the last one closes the allocation (in its device's
 * context) and forgets it. Closing under the lock keeps a concurrent
 * cuda_open of the same handle from opening it before it is closed. */
static void cuda_unuse(struct cuda_alloc *a)
{
	CUcontext prev;

	pthread_mutex_lock(&cuda.mu);
	if (--a->users == 0) {
		HASH_DEL(cuda.allocs, a);
		if (cuda_ctx_push(a->dev->ctx, &prev) == CUDA_SUCCESS) {
			/* Nothing to tell anyone if it fails: the handle is
			 * gone either way. */
			(void)cuda.api.IpcCloseMemHandle(a->base);
			cuda_ctx_pop(a->dev->ctx, prev);
		}
		free(a);
	}
	pthread_mutex_unlock(&cuda.mu);
}

/* bb_map of a CUDA buffer: the device pointer, opening its allocation on
 * the first map of this handle. */
static int cuda_map(bb_buf *b, void **ptr_out)
{
	struct cuda_alloc *a;
	void *p;
	int rc = 0;

	p = atomic_load_explicit(&b->map, memory_order_acquire);
	if (p) {
		*ptr_out = p;
		return 0;
	}
	if (!b->has_ipc)
		return bbc_fail(BB_ERR_PROTOCOL,
				"bufbrokerd sent no IPC handle for CUDA buffer %" PRIu64, b->id);
	rc = cuda_require();
	if (rc)
		return rc;
	pthread_mutex_lock(&b->map_mu);
	p = atomic_load_explicit(&b->map, memory_order_relaxed);
	if (!p) {
		rc = cuda_open(b, &a);
		if (rc == 0) {
			b->cmap = a;
			p = (void *)(uintptr_t)(a->base + b->ipc_offset);
			atomic_store_explicit(&b->map, p, memory_order_release);
		}
	}
	pthread_mutex_unlock(&b->map_mu);
	*ptr_out = p;
	return rc;
}

/* ---- handles --------------------------------------------------------------- */

/* Unmap, close and free a handle that is off every list. A CUDA handle
 * gives up its use of the allocation, which closes it when it was the
 * last: callers free before they send the Release. */
static void buf_free(bb_buf *b)
{
	void *m = atomic_load_explicit(&b->map, memory_order_acquire);

	if (b->cmap)
		cuda_unuse(b->cmap);
	else if (m)
		munmap(m, b->size);
	if (b->fd >= 0)
		close(b->fd);
	pthread_mutex_destroy(&b->map_mu);
	free(b);
}

/* Turn a Grant (and its fd, which this consumes) into a handle: the
 * listed one for that id with one more count, or a new one. The daemon
 * counted +1 either way; a coalesced grant gives that count back. */
static int buf_from_grant(bb_client *c, const Bufbroker__Response *r, int fd, bb_buf **out)
{
	const Bufbroker__BufferInfo *info = r->grant ? r->grant->info : NULL;
	const Bufbroker__Grant *grant;
	bb_buf *b, *old;
	uint64_t id;
	int rc = 0;

	if (!info || info->id == 0 || info->size == 0 || info->size > SIZE_MAX ||
	    !bb_kind_valid(info->kind))
		rc = bbc_fail(BB_ERR_PROTOCOL,
			      "bufbrokerd sent a grant without valid buffer information");
	else if (info->kind == BUFBROKER__KIND__KIND_HOST && fd < 0)
		rc = bbc_fail(BB_ERR_PROTOCOL,
			      "bufbrokerd granted host buffer %" PRIu64
			      " without its file descriptor",
			      info->id);
	if (rc) {
		if (fd >= 0)
			close(fd);
		if (info && info->id)
			client_release_one(c, info->id);
		return rc;
	}
	id = info->id;
	if (info->kind == BUFBROKER__KIND__KIND_CUDA && fd >= 0) {
		close(fd);
		fd = -1;
	}
	grant = r->grant;

	b = calloc(1, sizeof(*b));
	if (!b) {
		if (fd >= 0)
			close(fd);
		client_release_one(c, id);
		return bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a buffer handle");
	}
	b->client = c;
	b->id = id;
	b->size = (size_t)info->size;
	b->kind = (bb_kind)info->kind;
	b->device = info->device;
	atomic_init(&b->count, 1);
	atomic_init(&b->map, NULL);
	b->fd = fd;
	/* A CUDA grant without a well-formed handle still makes a handle:
	 * it can be counted, waited on and passed on; bb_map and
	 * bb_cuda_ipc_of say what is missing. */
	if (b->kind == BB_CUDA && grant->ipc_handle.len == BB_IPC_HANDLE_SIZE &&
	    grant->device_uuid.len == sizeof(b->device_uuid)) {
		b->has_ipc = 1;
		memcpy(b->ipc_handle, grant->ipc_handle.data, BB_IPC_HANDLE_SIZE);
		b->ipc_offset = grant->offset;
		b->allocation = grant->allocation;
		memcpy(b->device_uuid, grant->device_uuid.data, sizeof(b->device_uuid));
	}
	pthread_mutex_init(&b->map_mu, NULL);

	pthread_mutex_lock(&c->mu);
	HASH_FIND(hh, c->bufs, &id, sizeof(id), old);
	if (old) {
		atomic_fetch_add_explicit(&old->count, 1, memory_order_relaxed);
		pthread_mutex_unlock(&c->mu);
		buf_free(b);
		client_release_one(c, id);
		*out = old;
		return 0;
	}
	b->listed = 1;
	HASH_ADD(hh, c->bufs, id, sizeof(b->id), b);
	DL_APPEND(c->all, b);
	pthread_mutex_unlock(&c->mu);
	*out = b;
	return 0;
}

/* Round trip a request answered by a Grant and make the handle. */
static int buf_rpc_grant(bb_client *c, Bufbroker__Request *req, int fd, bb_buf **out)
{
	Bufbroker__Response *r;
	int rfd, rc;

	rc = client_rpc(c, req, fd, BUFBROKER__RESPONSE__RESULT_GRANT, &r, &rfd);
	if (rc)
		return rc;
	rc = buf_from_grant(c, r, rfd, out);
	bbc_response_free(r);
	return rc;
}

static int check_name(const char *name)
{
	size_t len = strlen(name);

	if (len > BB_NAME_MAX)
		return bbc_fail(BB_ERR_INVALID, "buffer name of %zu bytes is longer than %d", len,
				BB_NAME_MAX);
	return 0;
}

static int check_opts(const bb_alloc_opts *opts)
{
	if (!opts)
		return bbc_fail(BB_ERR_INVALID, "allocation options are required");
	if (opts->size == 0)
		return bbc_fail(BB_ERR_INVALID, "buffer size must be greater than 0");
	if (!bb_kind_valid(opts->kind))
		return bbc_fail(BB_ERR_INVALID, "unknown buffer kind %d", (int)opts->kind);
	if (opts->share < BB_SHARE_UID || opts->share > BB_SHARE_ANY)
		return bbc_fail(BB_ERR_INVALID, "unknown share policy %d", opts->share);
	return opts->name ? check_name(opts->name) : 0;
}

BB_EXPORT int bb_alloc(bb_client *c, const bb_alloc_opts *opts, bb_buf **out)
{
	Bufbroker__Alloc a = BUFBROKER__ALLOC__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	int rc;

	if (!c || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_alloc: client and out are required");
	*out = NULL;
	rc = check_opts(opts);
	if (rc)
		return rc;
	a.size = opts->size;
	a.kind = (Bufbroker__Kind)opts->kind;
	a.device = opts->device;
	a.name = opts->name ? (char *)opts->name : "";
	a.share = (uint32_t)opts->share;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &a;
	return buf_rpc_grant(c, &req, -1, out);
}

BB_EXPORT int bb_import_fd(bb_client *c, int fd, const bb_alloc_opts *opts, bb_buf **out)
{
	Bufbroker__ImportFd im = BUFBROKER__IMPORT_FD__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	int rc;

	if (!c || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_import_fd: client and out are required");
	*out = NULL;
	if (fd < 0)
		return bbc_fail(BB_ERR_INVALID, "bb_import_fd: invalid file descriptor %d", fd);
	rc = check_opts(opts);
	if (rc)
		return rc;
	if (opts->kind != BB_HOST)
		return bbc_fail(BB_ERR_INVALID,
				"bb_import_fd: only BB_HOST memory can be imported");
	im.size = opts->size;
	im.kind = BUFBROKER__KIND__KIND_HOST;
	im.device = opts->device;
	im.name = opts->name ? (char *)opts->name : "";
	im.share = (uint32_t)opts->share;
	req.op_case = BUFBROKER__REQUEST__OP_IMPORT_FD;
	req.import_fd = &im;
	return buf_rpc_grant(c, &req, fd, out);
}

BB_EXPORT int bb_open(bb_client *c, uint64_t id, bb_buf **out)
{
	Bufbroker__Open op = BUFBROKER__OPEN__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	bb_buf *b;
	int rc;

	if (!c || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_open: client and out are required");
	*out = NULL;
	pthread_mutex_lock(&c->mu);
	if (c->dead) {
		rc = client_fail_dead(c);
		pthread_mutex_unlock(&c->mu);
		return rc;
	}
	HASH_FIND(hh, c->bufs, &id, sizeof(id), b);
	if (b) {
		/* Listed handles have count >= 1: it only drops to 0 under mu. */
		atomic_fetch_add_explicit(&b->count, 1, memory_order_relaxed);
		pthread_mutex_unlock(&c->mu);
		*out = b;
		return 0;
	}
	pthread_mutex_unlock(&c->mu);

	op.target_case = BUFBROKER__OPEN__TARGET_ID;
	op.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_OPEN;
	req.open = &op;
	return buf_rpc_grant(c, &req, -1, out);
}

BB_EXPORT int bb_open_name(bb_client *c, const char *name, bb_buf **out)
{
	Bufbroker__Open op = BUFBROKER__OPEN__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	int rc;

	if (!c || !out || !name || !name[0])
		return bbc_fail(BB_ERR_INVALID,
				"bb_open_name: client, a name and out are required");
	*out = NULL;
	rc = check_name(name);
	if (rc)
		return rc;
	op.target_case = BUFBROKER__OPEN__TARGET_NAME;
	op.name = (char *)name;
	req.op_case = BUFBROKER__REQUEST__OP_OPEN;
	req.open = &op;
	return buf_rpc_grant(c, &req, -1, out);
}

BB_EXPORT int bb_adopt(bb_client *c, const bb_token *t, bb_buf **out)
{
	Bufbroker__Adopt ad = BUFBROKER__ADOPT__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;

	if (!c || !t || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_adopt: client, token and out are required");
	*out = NULL;
	ad.token.len = BB_TOKEN_SIZE;
	ad.token.data = (uint8_t *)t->bytes;
	req.op_case = BUFBROKER__REQUEST__OP_ADOPT;
	req.adopt = &ad;
	return buf_rpc_grant(c, &req, -1, out);
}

BB_EXPORT bb_buf *bb_ref(bb_buf *b)
{
	if (b)
		atomic_fetch_add_explicit(&b->count, 1, memory_order_relaxed);
	return b;
}

BB_EXPORT void bb_unref(bb_buf *b)
{
	bb_client *c;
	uint64_t n, id;
	int dead;

	if (!b)
		return;
	n = atomic_load_explicit(&b->count, memory_order_relaxed);
	while (n > 1) {
		if (atomic_compare_exchange_weak_explicit(
			    &b->count, &n, n - 1, memory_order_release, memory_order_relaxed))
			return;
	}
	/* Possibly the last count: decide under mu, where coalescing opens
	 * look the handle up. */
	c = b->client;
	pthread_mutex_lock(&c->mu);
	n = atomic_fetch_sub_explicit(&b->count, 1, memory_order_acq_rel);
	if (n != 1) {
		pthread_mutex_unlock(&c->mu);
		return;
	}
	if (b->listed) {
		HASH_DEL(c->bufs, b);
		b->listed = 0;
	}
	DL_DELETE(c->all, b);
	dead = c->dead;
	pthread_mutex_unlock(&c->mu);

	/* Unmap before the release that may let the daemon free the memory. */
	id = b->id;
	buf_free(b);
	if (!dead)
		client_release_one(c, id);
}

BB_EXPORT int bb_take(bb_buf *b, bb_token *out)
{
	Bufbroker__Take tk = BUFBROKER__TAKE__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	bb_client *c;
	int last = 0, rc;

	if (!b || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_take: buffer and out are required");
	c = b->client;
	/* A mapped CUDA handle's last count is not moved into the token: the
	 * token's adopter could release the buffer, and the daemon free its
	 * allocation, while this process still has it open. The token gets a
	 * reference of its own instead, and the bb_unref below closes the
	 * allocation before it releases the connection's. */
	if (atomic_load_explicit(&b->count, memory_order_acquire) == 1 &&
	    !(b->kind == BB_CUDA && atomic_load_explicit(&b->map, memory_order_acquire))) {
		/* The caller holds the only count, and unlisting it under mu
		 * keeps bb_open from adding one: the handle is ours alone. */
		pthread_mutex_lock(&c->mu);
		if (atomic_load_explicit(&b->count, memory_order_acquire) == 1) {
			last = 1;
			if (b->listed) {
				HASH_DEL(c->bufs, b);
				b->listed = 0;
			}
		}
		pthread_mutex_unlock(&c->mu);
	}

	/* Last count: move the connection's reference into the token (net
	 * zero). Otherwise the token gets a new reference and the caller's
	 * count is dropped afterwards like any bb_unref, which sends the
	 * Release itself if other holders let go meanwhile. */
	tk.id = b->id;
	tk.retain = !last;
	req.op_case = BUFBROKER__REQUEST__OP_TAKE;
	req.take = &tk;
	rc = client_rpc(c, &req, -1, BUFBROKER__RESPONSE__RESULT_TAKE, &r, NULL);
	if (rc == 0) {
		if (!r->take || r->take->token.len != BB_TOKEN_SIZE)
			rc = bbc_fail(BB_ERR_PROTOCOL, "bufbrokerd sent a token of the wrong size");
		else
			memcpy(out->bytes, r->take->token.data, BB_TOKEN_SIZE);
		bbc_response_free(r);
	}

	if (!last) {
		if (rc == 0)
			bb_unref(b);
		return rc;
	}
	pthread_mutex_lock(&c->mu);
	if (rc == 0) {
		DL_DELETE(c->all, b);
		pthread_mutex_unlock(&c->mu);
		buf_free(b);
		return 0;
	}
	/* Failed: the caller keeps its count. List the handle again unless
	 * an open made another one for this id meanwhile; then this one
	 * stays unlisted with its own daemon count. */
	{
		bb_buf *other;
		uint64_t id = b->id;

		HASH_FIND(hh, c->bufs, &id, sizeof(id), other);
		if (!other) {
			b->listed = 1;
			HASH_ADD(hh, c->bufs, id, sizeof(b->id), b);
		}
	}
	pthread_mutex_unlock(&c->mu);
	return rc;
}

BB_EXPORT void bb_token_format(const bb_token *t, char out[2 * BB_TOKEN_SIZE + 1])
{
	static const char hex[] = "0123456789abcdef";

	if (!out)
		return;
	if (!t) {
		out[0] = '\0';
		return;
	}
	for (int i = 0; i < BB_TOKEN_SIZE; i++) {
		out[2 * i] = hex[t->bytes[i] >> 4];
		out[2 * i + 1] = hex[t->bytes[i] & 0xf];
	}
	out[2 * BB_TOKEN_SIZE] = '\0';
}

static int hex_value(char ch)
{
	if (ch >= '0' && ch <= '9')
		return ch - '0';
	if (ch >= 'a' && ch <= 'f')
		return ch - 'a' + 10;
	if (ch >= 'A' && ch <= 'F')
		return ch - 'A' + 10;
	return -1;
}

BB_EXPORT int bb_token_parse(const char *text, bb_token *out)
{
	bb_token t;

	if (!text || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_token_parse: text and out are required");
	for (int i = 0; i < 2 * BB_TOKEN_SIZE; i++) {
		if (hex_value(text[i]) < 0)
			return bbc_fail(BB_ERR_INVALID, "a token is exactly %d hex digits",
					2 * BB_TOKEN_SIZE);
	}
	if (text[2 * BB_TOKEN_SIZE] != '\0')
		return bbc_fail(BB_ERR_INVALID, "a token is exactly %d hex digits",
				2 * BB_TOKEN_SIZE);
	for (int i = 0; i < BB_TOKEN_SIZE; i++)
		t.bytes[i] =
			(unsigned char)(hex_value(text[2 * i]) << 4 | hex_value(text[2 * i + 1]));
	*out = t;
	return 0;
}

/* ---- state ----------------------------------------------------------------- */

BB_EXPORT int bb_set_ready(bb_buf *b)
{
	Bufbroker__SetReady sr = BUFBROKER__SET_READY__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	int rc;

	if (!b)
		return bbc_fail(BB_ERR_INVALID, "bb_set_ready: buffer is required");
	sr.id = b->id;
	req.op_case = BUFBROKER__REQUEST__OP_SET_READY;
	req.set_ready = &sr;
	rc = client_rpc(b->client, &req, -1, BUFBROKER__RESPONSE__RESULT__NOT_SET, &r, NULL);
	if (rc == 0)
		bbc_response_free(r);
	return rc;
}

/* Keep at most max bytes of s without splitting a UTF-8 sequence. */
static size_t utf8_prefix(const char *s, size_t max)
{
	size_t len = strlen(s);

	if (len <= max)
		return len;
	while (max > 0 && ((unsigned char)s[max] & 0xc0) == 0x80)
		max--;
	return max;
}

BB_EXPORT int bb_set_error(bb_buf *b, const char *message)
{
	Bufbroker__SetError se = BUFBROKER__SET_ERROR__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	char msg[256];
	int rc;

	if (!b)
		return bbc_fail(BB_ERR_INVALID, "bb_set_error: buffer is required");
	/* The daemon keeps 255 bytes; a longer message would only risk the
	 * datagram limit. */
	if (!message)
		message = "";
	size_t len = utf8_prefix(message, sizeof(msg) - 1);
	memcpy(msg, message, len);
	msg[len] = '\0';
	se.id = b->id;
	se.message = msg;
	req.op_case = BUFBROKER__REQUEST__OP_SET_ERROR;
	req.set_error = &se;
	rc = client_rpc(b->client, &req, -1, BUFBROKER__RESPONSE__RESULT__NOT_SET, &r, NULL);
	if (rc == 0)
		bbc_response_free(r);
	return rc;
}

BB_EXPORT int bb_wait(bb_buf *b, int timeout_ms, bb_state *state_out)
{
	Bufbroker__Wait w = BUFBROKER__WAIT__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	int rc;

	if (!b)
		return bbc_fail(BB_ERR_INVALID, "bb_wait: buffer is required");
	w.id = b->id;
	w.timeout_ms = timeout_ms;
	req.op_case = BUFBROKER__REQUEST__OP_WAIT;
	req.wait = &w;
	rc = client_rpc(b->client, &req, -1, BUFBROKER__RESPONSE__RESULT_WAIT, &r, NULL);
	if (rc)
		return rc;
	if (state_out)
		*state_out = (bb_state)r->wait->state;
	bbc_response_free(r);
	return 0;
}

/* ---- mapping --------------------------------------------------------------- */

/* Host mappings from 2 MiB up ask for transparent huge pages over their
 * whole 2 MiB extents. Where the kernel lets shmem use them
 * (/sys/kernel/mm/transparent_hugepage/shmem_enabled advise, within_size
 * or always), the first touch of a buffer costs one fault per 2 MiB instead
 * of one per 4 KiB page: the cost of a consumer's first read of a buffer it
 * has never mapped. Elsewhere the advice is kept and does nothing. The
 * partial tail is left out, so a huge page never holds memory past the
 * buffer's end. Where it may use huge pages, shmem places mappings
 * this large on a 2 MiB boundary. */
#define THP_BYTES ((size_t)2 << 20)

static void *map_host(int fd, size_t size)
{
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	size_t huge = size & ~(THP_BYTES - 1);

	/* Advice only: a kernel without THP says EINVAL and maps as before. */
	if (p != MAP_FAILED && huge)
		(void)madvise(p, huge, MADV_HUGEPAGE);
	return p;
}

BB_EXPORT int bb_map(bb_buf *b, void **ptr_out)
{
	void *p;
	int rc = 0;

	if (!b || !ptr_out)
		return bbc_fail(BB_ERR_INVALID, "bb_map: buffer and ptr_out are required");
	*ptr_out = NULL;
	if (b->kind == BB_CUDA)
		return cuda_map(b, ptr_out);
	p = atomic_load_explicit(&b->map, memory_order_acquire);
	if (p) {
		*ptr_out = p;
		return 0;
	}
	pthread_mutex_lock(&b->map_mu);
	p = atomic_load_explicit(&b->map, memory_order_relaxed);
	if (!p) {
		if (b->fd < 0) {
			rc = bbc_fail(BB_ERR_SYSTEM, "buffer %" PRIu64 " has no memory to map",
				      b->id);
		} else {
			p = map_host(b->fd, b->size);
			if (p == MAP_FAILED) {
				int e = errno;
				char eb[128];

				p = NULL;
				rc = bbc_fail(e == ENOMEM ? BB_ERR_NO_MEMORY : BB_ERR_SYSTEM,
					      "mapping buffer %" PRIu64 " (%zu bytes) failed: %s",
					      b->id, b->size, errstr(e, eb, sizeof(eb)));
			} else {
				/* The mapping keeps the file; the fd is no longer needed. */
				close(b->fd);
				b->fd = -1;
				atomic_store_explicit(&b->map, p, memory_order_release);
			}
		}
	}
	pthread_mutex_unlock(&b->map_mu);
	*ptr_out = p;
	return rc;
}

BB_EXPORT int bb_cuda_ipc_of(bb_buf *b, bb_cuda_ipc *out)
{
	if (!b || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_cuda_ipc_of: buffer and out are required");
	if (b->kind != BB_CUDA)
		return bbc_fail(BB_ERR_INVALID, "buffer %" PRIu64 " is not a CUDA buffer", b->id);
	if (!b->has_ipc)
		return bbc_fail(BB_ERR_PROTOCOL,
				"bufbrokerd sent no IPC handle for CUDA buffer %" PRIu64, b->id);
	memset(out, 0, sizeof(*out));
	memcpy(out->handle, b->ipc_handle, BB_IPC_HANDLE_SIZE);
	out->offset = b->ipc_offset;
	out->size = b->size;
	memcpy(out->device_uuid, b->device_uuid, sizeof(out->device_uuid));
	return 0;
}

/* ---- queries --------------------------------------------------------------- */

BB_EXPORT uint64_t bb_id(const bb_buf *b)
{
	return b ? b->id : 0;
}

BB_EXPORT size_t bb_size(const bb_buf *b)
{
	return b ? b->size : 0;
}

BB_EXPORT bb_kind bb_buf_kind(const bb_buf *b)
{
	return b ? b->kind : (bb_kind)0;
}

BB_EXPORT int bb_stat(bb_client *c, uint64_t id, bb_info *out)
{
	Bufbroker__Stat st = BUFBROKER__STAT__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	const Bufbroker__BufferInfo *in;
	int rc;

	if (!c || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_stat: client and out are required");
	st.target_case = BUFBROKER__STAT__TARGET_ID;
	st.id = id;
	req.op_case = BUFBROKER__REQUEST__OP_STAT;
	req.stat = &st;
	rc = client_rpc(c, &req, -1, BUFBROKER__RESPONSE__RESULT_INFO, &r, NULL);
	if (rc)
		return rc;
	in = r->info;
	memset(out, 0, sizeof(*out));
	out->id = in->id;
	out->size = (size_t)in->size;
	out->kind = (bb_kind)in->kind;
	out->device = in->device;
	out->state = (bb_state)in->state;
	out->refs = in->refs;
	snprintf(out->name, sizeof(out->name), "%s", in->name ? in->name : "");
	snprintf(out->error, sizeof(out->error), "%s", in->error ? in->error : "");
	bbc_response_free(r);
	return 0;
}

/* Retain and Release are what busy callers send most: packed and read by
 * flatwire, not protobuf-c (an error answer still comes unpacked). */
static int refs_rpc(bb_client *c, uint64_t id, uint32_t count, int release)
{
	flat_refs_req fr = {.op = release ? FLAT_OP_RELEASE : FLAT_OP_RETAIN, .buf_id = id,
			    .count = count};
	struct call k = {.fd = -1, .want_flat = 1};
	uint8_t buf[FLAT_MAX_BYTES];
	const char *what = release ? "bb_release" : "bb_retain";
	int rc;

	if (!c)
		return bbc_fail(BB_ERR_INVALID, "%s: client is required", what);
	if (count == 0)
		return bbc_fail(BB_ERR_INVALID, "%s: count must be at least 1", what);
	rc = call_register(c, &k);
	if (rc)
		return rc;
	fr.id = k.id;
	rc = call_complete(c, &k, client_send_packed(c, buf, flat_refs_req_encode(&fr, buf), -1));
	if (rc || k.flat_ok)
		return rc;
	rc = response_check(k.resp, k.fd, BUFBROKER__RESPONSE__RESULT_REFS, &k.resp, NULL);
	if (rc == 0)
		bbc_response_free(k.resp);
	return rc;
}

BB_EXPORT int bb_retain(bb_client *c, uint64_t id, uint32_t count)
{
	return refs_rpc(c, id, count, 0);
}

BB_EXPORT int bb_release(bb_client *c, uint64_t id, uint32_t count)
{
	return refs_rpc(c, id, count, 1);
}

/* ---- connect / disconnect -------------------------------------------------- */

/* Free c and every handle still alive: unmap first, then close the socket,
 * which makes the daemon release everything the connection held. */
static void client_free(bb_client *c)
{
	bb_buf *b, *tmp;

	HASH_CLEAR(hh, c->bufs);
	DL_FOREACH_SAFE (c->all, b, tmp) {
		DL_DELETE(c->all, b);
		buf_free(b);
	}
	if (c->sock >= 0)
		close(c->sock);
	free(c->rbuf);
	pthread_cond_destroy(&c->cv);
	pthread_mutex_destroy(&c->send_mu);
	pthread_mutex_destroy(&c->mu);
	free(c);
}

/* The socket to use when the caller names none, in buf (len bytes). */
static const char *default_socket(char *buf, size_t len)
{
	const char *env = getenv("BUFBROKER_SOCKET");
	const char *xdg;
	struct stat st;

	if (env && env[0])
		return env;
	xdg = getenv("XDG_RUNTIME_DIR");
	if (geteuid() != 0 && xdg && xdg[0]) {
		int n = snprintf(buf, len, "%s/%s", xdg, BB_USER_SOCKET_NAME);
		if (n > 0 && (size_t)n < len && stat(buf, &st) == 0)
			return buf;
	}
	return BB_SYSTEM_SOCKET;
}

static int client_hello(bb_client *c, const char *path)
{
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	const Bufbroker__HelloReply *hr;
	int rc;

	h.version_major = BB_PROTO_MAJOR;
	h.version_minor = BB_PROTO_MINOR;
	h.client_name = program_invocation_short_name ? program_invocation_short_name : "";
	req.op_case = BUFBROKER__REQUEST__OP_HELLO;
	req.hello = &h;
	rc = client_rpc(c, &req, -1, BUFBROKER__RESPONSE__RESULT_HELLO, &r, NULL);
	if (rc)
		return rc;
	hr = r->hello;
	if (hr->version_major != BB_PROTO_MAJOR) {
		rc = bbc_fail(BB_ERR_PROTOCOL,
			      "bufbrokerd at %s speaks protocol %u.%u; this library speaks %d.%d",
			      path, hr->version_major, hr->version_minor, BB_PROTO_MAJOR,
			      BB_PROTO_MINOR);
	} else if (hr->max_datagram > 0) {
		size_t want = hr->max_datagram < RECV_MAX_BYTES ? hr->max_datagram : RECV_MAX_BYTES;

		c->max_send = hr->max_datagram;
		/* Nobody else reads yet: the buffer may move. */
		if (want > c->rcap) {
			unsigned char *nb = realloc(c->rbuf, want);
			if (nb) {
				c->rbuf = nb;
				c->rcap = want;
			}
		}
	}
	bbc_response_free(r);
	return rc;
}

BB_EXPORT int bb_connect(const char *path, bb_client **out)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	char dflt[4096], eb[128];
	bb_client *c;
	size_t len;
	int rc;

	if (!out)
		return bbc_fail(BB_ERR_INVALID, "bb_connect: out is required");
	*out = NULL;
	if (path && !path[0])
		return bbc_fail(BB_ERR_INVALID, "bb_connect: the socket path is empty");
	if (!path)
		path = default_socket(dflt, sizeof(dflt));
	len = strlen(path);
	if (len >= sizeof(sa.sun_path))
		return bbc_fail(BB_ERR_INVALID,
				"socket path %s is too long (%zu bytes, at most %zu)", path, len,
				sizeof(sa.sun_path) - 1);
	memcpy(sa.sun_path, path, len + 1);

	c = calloc(1, sizeof(*c));
	if (!c)
		return bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a client");
	c->sock = -1;
	c->next_id = 1;
	c->max_send = BB_MAX_DATAGRAM;
	c->rcap = BB_MAX_DATAGRAM;
	pthread_mutex_init(&c->mu, NULL);
	pthread_mutex_init(&c->send_mu, NULL);
	pthread_cond_init(&c->cv, NULL);
	c->rbuf = malloc(c->rcap);
	if (!c->rbuf) {
		rc = bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a client");
		goto err;
	}

	c->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (c->sock < 0) {
		rc = bbc_fail(BB_ERR_SYSTEM, "cannot create a socket: %s",
			      errstr(errno, eb, sizeof(eb)));
		goto err;
	}
	for (;;) {
		if (connect(c->sock, (struct sockaddr *)&sa, sizeof(sa)) == 0 || errno == EISCONN)
			break;
		if (errno == EINTR)
			continue;
		int e = errno;
		switch (e) {
		case ENOENT:
		case ECONNREFUSED:
		case ENOTDIR: rc = BB_ERR_DISCONNECTED; break;
		case EACCES:
		case EPERM: rc = BB_ERR_DENIED; break;
		case EPROTOTYPE: rc = BB_ERR_PROTOCOL; break;
		default: rc = BB_ERR_SYSTEM; break;
		}
		rc = bbc_fail(rc, "cannot connect to bufbrokerd at %s: %s%s", path,
			      errstr(e, eb, sizeof(eb)),
			      rc == BB_ERR_DISCONNECTED ? " (is bufbrokerd running?)" : "");
		goto err;
	}

	rc = client_hello(c, path);
	if (rc)
		goto err;
	*out = c;
	return 0;

err:
	client_free(c);
	return rc;
}

BB_EXPORT void bb_disconnect(bb_client *c)
{
	if (c)
		client_free(c);
}
