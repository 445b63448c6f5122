/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Making and ending a connection: bb_connect (the socket to use, connect,
 * Hello and the daemon's datagram limit) and bb_disconnect.
 */
#include "handle.h"
#include "wire.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <utlist.h>

/* Cap on the receive buffer, whatever the daemon announces. */
#define RECV_MAX_BYTES (16u << 20)

/* Free c and every handle still alive: unmap first, then close the socket,
 * which makes the daemon release everything the connection held. */
static void client_free(bb_client *c)
{
	bb_buf *b, *tmp;

	HASH_CLEAR(hh, c->bufs);
	DL_FOREACH_SAFE (c->all, b, tmp) {
		DL_DELETE(c->all, b);
		bbc_buf_free(b);
	}
	if (c->sock >= 0)
		close(c->sock);
	free(c->rbuf);
	pthread_cond_destroy(&c->cv);
	pthread_mutex_destroy(&c->send_mu);
	pthread_mutex_destroy(&c->mu);
	free(c);
}

const char *bbc_default_socket(char *buf, size_t len)
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
	rc = bbc_rpc(c, &req, -1, BUFBROKER__RESPONSE__RESULT_HELLO, &r, NULL);
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
		path = bbc_default_socket(dflt, sizeof(dflt));
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
			      bbc_errstr(errno, eb, sizeof(eb)));
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
			      bbc_errstr(e, eb, sizeof(eb)),
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
