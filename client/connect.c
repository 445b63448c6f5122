/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Making and ending a connection: bb_connect (the socket to use, connect,
 * Hello and the daemon's datagram limit) and bb_disconnect.
 */
#include "handle.h"
#include "vmm_fd.h"
#include "wire.h"

#include <errno.h>
#include <poll.h>
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

/*
 * Which daemon instance a connection reaches, as a number unique in this
 * process (bb_client.daemon): the process-wide cache of imported VMM
 * allocations (cuda_map.c) is keyed by it and the daemon's allocation id,
 * which only one daemon run never reuses. Connections share a number when
 * they connected to the same socket file (device and inode) while another
 * connection to it was still open: then they reach the same daemon, since
 * a daemon that is gone has hung up every connection it had, and one that
 * lives keeps its socket file's inode. Anything else (a daemon restarted
 * on the same path, another daemon) gets a new number, so an allocation id
 * of a new daemon run never finds a mapping of an old one.
 */
struct daemon_rec {
	dev_t dev;                      /* the socket file's device */
	ino_t ino;                      /* and inode */
	uint64_t daemon;                /* the number its connections get */
	int listed;                     /* in daemons.recs: new connections may join */
	struct bb_client *conns;        /* its connections (dprev, dnext) */
	struct daemon_rec *prev, *next; /* daemons.recs */
};

static struct {
	pthread_mutex_t mu;      /* guards everything here and every drec link */
	struct daemon_rec *recs; /* joinable records */
	uint64_t next;           /* the next daemon number */
} daemons = {.mu = PTHREAD_MUTEX_INITIALIZER, .next = 1};

/* True when the daemon has hung up sock (or it is in error). */
static int conn_hung_up(int sock)
{
	struct pollfd p = {.fd = sock, .events = POLLRDHUP};

	return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL));
}

/* Give c (connected and greeted through path) its daemon number. */
static void daemon_identify(bb_client *c, const char *path)
{
	struct daemon_rec *r;
	struct bb_client *m;
	struct stat st;
	int known = stat(path, &st) == 0;

	pthread_mutex_lock(&daemons.mu);
	DL_FOREACH (daemons.recs, r) {
		if (!known || r->dev != st.st_dev || r->ino != st.st_ino)
			continue;
		DL_FOREACH2 (r->conns, m, dnext)
			if (!conn_hung_up(m->sock))
				break;
		if (m)
			break;
		/* Every connection of it is hung up: whatever listens now is
		 * another daemon run. */
		DL_DELETE(daemons.recs, r);
		r->listed = 0;
		break;
	}
	if (!r || !r->listed) {
		r = known ? calloc(1, sizeof(*r)) : NULL;
		if (r) {
			r->dev = st.st_dev;
			r->ino = st.st_ino;
			r->daemon = daemons.next++;
			r->listed = 1;
			DL_APPEND(daemons.recs, r);
		}
	}
	if (r) {
		c->daemon = r->daemon;
		c->drec = r;
		DL_APPEND2(r->conns, c, dprev, dnext);
	} else {
		c->daemon = daemons.next++; /* shares with no other connection */
	}
	pthread_mutex_unlock(&daemons.mu);
}

/* c leaves its daemon record; the last one frees it. */
static void daemon_leave(bb_client *c)
{
	struct daemon_rec *r = c->drec;

	if (!r)
		return;
	pthread_mutex_lock(&daemons.mu);
	DL_DELETE2(r->conns, c, dprev, dnext);
	if (!r->conns) {
		if (r->listed)
			DL_DELETE(daemons.recs, r);
		free(r);
	}
	c->drec = NULL;
	pthread_mutex_unlock(&daemons.mu);
}

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
	bbc_vmm_fd_clear(c);
	daemon_leave(c);
	if (c->sock >= 0)
		close(c->sock);
	free(c->rbuf);
	free(c->rels);
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
	c->proto_minor = hr->version_minor;
	if (hr->session_id && hr->session_secret.len == sizeof(c->secret)) {
		/* The daemon keeps its state across restarts: this session can
		 * be resumed. */
		c->session = hr->session_id;
		memcpy(c->secret, hr->session_secret.data, sizeof(c->secret));
	}
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
	const char *env;
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
	memcpy(c->path, path, len + 1);
	env = getenv("BUFBROKER_RECONNECT");
	c->env_enabled = !(env && strcmp(env, "0") == 0);
	c->ropts.enabled = c->env_enabled;
	bbc_reconnect_defaults(&c->ropts);
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
	daemon_identify(c, path);
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

BB_EXPORT int bb_client_set_reconnect(bb_client *c, const bb_reconnect_opts *opts)
{
	bb_reconnect_opts o = {0};

	if (!c)
		return bbc_fail(BB_ERR_INVALID, "bb_client_set_reconnect: client is required");
	if (opts) {
		o = *opts;
		for (size_t i = 0; i < sizeof(o.reserved) / sizeof(o.reserved[0]); i++)
			if (o.reserved[i])
				return bbc_fail(
					BB_ERR_INVALID,
					"bb_client_set_reconnect: reserved fields must be 0");
		o.enabled = o.enabled != 0;
	} else {
		o.enabled = c->env_enabled;
	}
	bbc_reconnect_defaults(&o);
	if (o.backoff_ms > o.max_backoff_ms)
		return bbc_fail(BB_ERR_INVALID,
				"bb_client_set_reconnect: backoff_ms %u is above max_backoff_ms %u",
				o.backoff_ms, o.max_backoff_ms);
	pthread_mutex_lock(&c->mu);
	c->ropts = o;
	pthread_mutex_unlock(&c->mu);
	return 0;
}

BB_EXPORT uint64_t bb_client_resumes(const bb_client *c)
{
	uint64_t n;

	if (!c)
		return 0;
	pthread_mutex_lock((pthread_mutex_t *)&c->mu);
	n = c->resumes;
	pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
	return n;
}
