/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Handles (bb_buf): their life from a grant to the last bb_unref, the
 * calls that make them (alloc, import, open, adopt) or surrender one
 * (take), tokens as text, the buffer's state (set_ready, set_error, wait),
 * queries, and raw retain/release.
 *
 * Each handle stands for exactly one daemon count of this connection;
 * local copies (bb_ref) only move the handle's atomic count. A count can
 * only reach 0 under the client lock, so a bb_open that finds a listed
 * handle under that lock never revives a dying one.
 */
#include "handle.h"
#include "cuda_map.h"
#include "vmm_fd.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <utlist.h>

#include "kinds.h"
#include "utf8.h"
#include "wire.h"

/* Unmap, close and free a handle that is off every list. A CUDA handle
 * gives up its use of the allocation, which closes it when it was the
 * last: callers free before they send the Release. */
void bbc_buf_free(bb_buf *b)
{
	void *m = atomic_load_explicit(&b->map, memory_order_acquire);

	if (b->cmap)
		bbc_cuda_unuse(b->cmap);
	else if (b->vmap)
		bbc_cuda_vmm_unuse(b->vmap);
	else if (m)
		munmap(m, b->size);
	bbc_vmm_fd_drop(b);
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
	bb_cuda_handle handle = BB_CUDA_HANDLE_DEFAULT;
	bb_buf *b, *old;
	uint64_t id;
	int vfd = -1, rc = 0;

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
			bbc_release_one(c, info->id);
		return rc;
	}
	id = info->id;
	grant = r->grant;
	if (info->kind == BUFBROKER__KIND__KIND_CUDA) {
		/* A VMM allocation's fd comes with the first grant of that
		 * allocation on this connection; kept per connection below. A
		 * legacy buffer has none. */
		handle = info->cuda_handle == BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM
				 ? BB_CUDA_HANDLE_VMM
				 : BB_CUDA_HANDLE_LEGACY;
		if (handle == BB_CUDA_HANDLE_VMM && grant->allocation_fd)
			vfd = fd;
		else if (fd >= 0)
			close(fd);
		fd = -1;
	}

	b = calloc(1, sizeof(*b));
	if (!b) {
		if (fd >= 0)
			close(fd);
		if (vfd >= 0)
			close(vfd);
		bbc_release_one(c, id);
		return bbc_fail(BB_ERR_NO_MEMORY, "out of memory for a buffer handle");
	}
	b->client = c;
	b->id = id;
	b->size = (size_t)info->size;
	b->kind = (bb_kind)info->kind;
	b->device = info->device;
	b->handle = handle;
	atomic_init(&b->count, 1);
	atomic_init(&b->map, NULL);
	b->fd = fd;
	/* A CUDA grant without a well-formed handle still makes a handle:
	 * it can be counted, waited on and passed on; bb_map,
	 * bb_cuda_ipc_of and bb_cuda_vmm_of say what is missing. */
	if (handle == BB_CUDA_HANDLE_LEGACY && grant->ipc_handle.len == BB_IPC_HANDLE_SIZE &&
	    grant->device_uuid.len == sizeof(b->device_uuid)) {
		b->has_ipc = 1;
		memcpy(b->ipc_handle, grant->ipc_handle.data, BB_IPC_HANDLE_SIZE);
		b->ipc_offset = grant->offset;
		b->allocation = grant->allocation;
		memcpy(b->device_uuid, grant->device_uuid.data, sizeof(b->device_uuid));
	} else if (handle == BB_CUDA_HANDLE_VMM && grant->allocation != 0 &&
		   grant->device_uuid.len == sizeof(b->device_uuid) &&
		   grant->allocation_size <= SIZE_MAX && grant->offset <= grant->allocation_size &&
		   info->size <= grant->allocation_size - grant->offset) {
		b->has_vmm = 1;
		b->ipc_offset = grant->offset;
		b->allocation = grant->allocation;
		b->allocation_size = grant->allocation_size;
		memcpy(b->device_uuid, grant->device_uuid.data, sizeof(b->device_uuid));
	}
	pthread_mutex_init(&b->map_mu, NULL);

	pthread_mutex_lock(&c->mu);
	HASH_FIND(hh, c->bufs, &id, sizeof(id), old);
	if (old) {
		atomic_fetch_add_explicit(&old->count, 1, memory_order_relaxed);
		if (b->has_vmm)
			bbc_vmm_fd_offer_locked(c, b->allocation, vfd);
		else if (vfd >= 0)
			close(vfd);
		pthread_mutex_unlock(&c->mu);
		bbc_buf_free(b);
		bbc_release_one(c, id);
		*out = old;
		return 0;
	}
	if (b->has_vmm)
		bbc_vmm_fd_add_locked(c, b, vfd);
	else if (vfd >= 0)
		close(vfd);
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

	rc = bbc_rpc(c, req, fd, BUFBROKER__RESPONSE__RESULT_GRANT, &r, &rfd);
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
	return bb_alloc_cuda(c, opts, BB_CUDA_HANDLE_DEFAULT, out);
}

static const char *handle_name(bb_cuda_handle h)
{
	switch (h) {
	case BB_CUDA_HANDLE_DEFAULT: return "default";
	case BB_CUDA_HANDLE_AUTO: return "auto";
	case BB_CUDA_HANDLE_LEGACY: return "legacy";
	case BB_CUDA_HANDLE_VMM: return "vmm";
	}
	return "unknown";
}

BB_EXPORT int bb_alloc_cuda(bb_client *c, const bb_alloc_opts *opts, bb_cuda_handle handle,
			    bb_buf **out)
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
	if (handle < BB_CUDA_HANDLE_DEFAULT || handle > BB_CUDA_HANDLE_VMM)
		return bbc_fail(BB_ERR_INVALID, "unknown CUDA handle kind %d", (int)handle);
	if (opts->kind != BB_CUDA && handle != BB_CUDA_HANDLE_DEFAULT)
		return bbc_fail(BB_ERR_INVALID,
				"a host buffer has no CUDA handle kind (asked for %s)",
				handle_name(handle));
	/* A daemon before protocol 1.2 ignores the kind asked for and makes
	 * a legacy buffer: never let that stand for VMM. */
	if (handle == BB_CUDA_HANDLE_VMM && c->proto_minor < 2)
		return bbc_fail(BB_ERR_UNSUPPORTED,
				"VMM CUDA buffers need protocol 1.2; bufbrokerd speaks %d.%u: "
				"upgrade bufbrokerd",
				BB_PROTO_MAJOR, c->proto_minor);
	a.size = opts->size;
	a.kind = (Bufbroker__Kind)opts->kind;
	a.device = opts->device;
	a.name = opts->name ? (char *)opts->name : "";
	a.share = (uint32_t)opts->share;
	a.cuda_handle = (Bufbroker__CudaHandle)handle;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &a;
	rc = buf_rpc_grant(c, &req, -1, out);
	if (rc == 0 && (handle == BB_CUDA_HANDLE_LEGACY || handle == BB_CUDA_HANDLE_VMM) &&
	    (*out)->handle != handle) {
		bb_cuda_handle got = (*out)->handle;

		bb_unref(*out);
		*out = NULL;
		rc = bbc_fail(BB_ERR_PROTOCOL,
			      "asked bufbrokerd for a %s CUDA buffer and got a %s one",
			      handle_name(handle), handle_name(got));
	}
	return rc;
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
		rc = bbc_fail_dead(c);
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
	bbc_buf_free(b);
	if (!dead)
		bbc_release_one(c, id);
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
	rc = bbc_rpc(c, &req, -1, BUFBROKER__RESPONSE__RESULT_TAKE, &r, NULL);
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
		bbc_buf_free(b);
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
	rc = bbc_rpc(b->client, &req, -1, BUFBROKER__RESPONSE__RESULT__NOT_SET, &r, NULL);
	if (rc == 0)
		bbc_response_free(r);
	return rc;
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
	size_t len = bb_utf8_prefix(message, sizeof(msg) - 1);
	memcpy(msg, message, len);
	msg[len] = '\0';
	se.id = b->id;
	se.message = msg;
	req.op_case = BUFBROKER__REQUEST__OP_SET_ERROR;
	req.set_error = &se;
	rc = bbc_rpc(b->client, &req, -1, BUFBROKER__RESPONSE__RESULT__NOT_SET, &r, NULL);
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
	rc = bbc_rpc(b->client, &req, -1, BUFBROKER__RESPONSE__RESULT_WAIT, &r, NULL);
	if (rc)
		return rc;
	if (state_out)
		*state_out = (bb_state)r->wait->state;
	bbc_response_free(r);
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
	rc = bbc_rpc(c, &req, -1, BUFBROKER__RESPONSE__RESULT_INFO, &r, NULL);
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

BB_EXPORT int bb_retain(bb_client *c, uint64_t id, uint32_t count)
{
	return bbc_refs_rpc(c, id, count, 0);
}

BB_EXPORT int bb_release(bb_client *c, uint64_t id, uint32_t count)
{
	return bbc_refs_rpc(c, id, count, 1);
}
