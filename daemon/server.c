/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Listen and accept: the SOCK_SEQPACKET socket (our own, or the one
 * systemd passed); the layers, from the transport down, set up and torn
 * down in order; the reaper that closes doomed connections after each loop
 * turn; the send-timeout sweep; backend jobs; clean shutdown on
 * SIGTERM/SIGINT.
 */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
#include <utlist.h>

#include "codec.h"
#include "conn.h"
#include "cuda_api.h"
#include "handler.h"
#include "journal.h"
#include "restart.h"
#include "log.h"
#include "metrics.h"
#include "park.h"
#include "snapshot.h"
#include "upgrade.h"
#include "wire.h"

#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59 /* Linux 4.13; older kernels answer ENOPROTOOPT */
#endif

struct server {
	uv_loop_t *loop;             /* the loop everything runs on */
	server_config cfg;           /* as given (reload changes the live part) */
	broker *b;                   /* the state machine */
	restart *restart;            /* the fd store and the start from it (restart.h) */
	uv_timer_t grace_timer;      /* the next absent session's grace deadline */
	bool journal_errors_logged;  /* the first refused journal write was logged */
	backend *host;               /* host backend */
	backend *cuda;               /* CUDA backend, or NULL (cuda_why says why) */
	char cuda_why[256];          /* why CUDA is not served; "" when it is */
	park *park;                  /* parked waits and allocs */
	handler *h;                  /* the request layer */
	codec *codec;                /* the wire */
	conn_env conns;              /* the transport: every connection */
	snapshot_sources src;        /* what the snapshot reads */
	metrics_counters counters;   /* requests, latency, refusals (metrics.h) */
	metrics_endpoint *metrics;   /* the HTTP endpoint, or NULL */
	uint32_t jobs;               /* backend jobs in flight */
	bool retry_allocs;           /* a job ran inline: retry parked allocs after this turn */
	int listen_fd;               /* listening socket */
	bool own_socket_file;        /* we bound it (so we unlink it on exit) */
	uv_poll_t listen_poll;       /* accept readiness */
	uv_timer_t accept_timer;     /* accepting paused (accept failed): resumes it */
	uint64_t nofile;             /* the open-file limit (RLIMIT_NOFILE) */
	uint64_t fds_own;            /* fds open once the daemon was set up */
	uint64_t host_buffers;       /* max_host_buffers in effect (0 in cfg: what nofile leaves) */
	int reserve_fd;              /* held to accept and refuse with when out of fds; -1: lost */
	bool accept_failing;         /* accept failed since the last connection accepted */
	uint64_t accept_refused;     /* connections refused for want of fds, not yet logged */
	uint64_t accept_logged_ms;   /* loop time of the last accept_failed line */
	uv_timer_t send_timer;       /* while output is queued: the send-timeout sweep */
	uv_check_t reaper;           /* after each turn: close doomed conns, retry_allocs */
	uv_idle_t reap_soon;         /* active while conns are doomed: the turn does not block */
	uv_signal_t sigterm, sigint; /* clean shutdown */
	bool stopping;               /* shutdown begun */
	upgrade *upgrade;            /* Upgrade and SIGUSR2 (journal on), or NULL */
};

/* mkdir -p for the socket's parent directory. */
static int make_parents(const char *path)
{
	char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (!slash || slash == dir)
		return 0;
	*slash = '\0';
	for (char *p = dir + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(dir, 0755) < 0 && errno != EEXIST)
			return -1;
		*p = '/';
	}
	if (mkdir(dir, 0755) < 0 && errno != EEXIST)
		return -1;
	return 0;
}

/* Whether path is a socket file that no daemon serves (safe to replace).
 * 1 stale, 0 absent, -1 live or not a socket (with the reason logged). */
static int stale_socket(const char *path, const struct sockaddr_un *addr)
{
	struct stat st;
	if (lstat(path, &st) < 0)
		return 0;
	if (!S_ISSOCK(st.st_mode)) {
		log_error(
			"event=listen_failed socket=\"%s\" error=\"the path exists and is not a socket\"",
			path);
		return -1;
	}
	/* Only a refused connect proves that no daemon is serving it. */
	int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	int live = probe >= 0 && connect(probe, (const struct sockaddr *)addr, sizeof(*addr)) == 0;
	if (probe >= 0)
		close(probe);
	if (live) {
		log_error(
			"event=listen_failed socket=\"%s\" error=\"another daemon is serving it\"",
			path);
		return -1;
	}
	return 1;
}

/* Listen on our own socket file. It is bound under a temporary name, given
 * its mode and group, made to listen, and only then renamed into place, so
 * that a client never finds the path refusing connections or with the
 * wrong permissions. */
static int listen_on(server *s)
{
	const char *path = s->cfg.socket_path;
	struct sockaddr_un addr = {.sun_family = AF_UNIX}, tmp = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(addr.sun_path)) {
		log_error("event=listen_failed socket=\"%s\" error=\"path too long\"", path);
		return -1;
	}
	strcpy(addr.sun_path, path);
	/* The temporary name must fit too; a path with no room for it is
	 * bound directly (a short window of refused connects, nothing worse). */
	int n = snprintf(tmp.sun_path, sizeof(tmp.sun_path), "%s.%ld.tmp", path, (long)getpid());
	if (n < 0 || (size_t)n >= sizeof(tmp.sun_path))
		tmp = addr;
	if (make_parents(path) < 0) {
		log_error(
			"event=listen_failed socket=\"%s\" error=\"cannot create its directory: %s\"",
			path, strerror(errno));
		return -1;
	}
	int stale = stale_socket(path, &addr);
	if (stale < 0)
		return -1;
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		log_error("event=listen_failed error=\"socket: %s\"", strerror(errno));
		return -1;
	}
	const char *bound = tmp.sun_path;
	if (strcmp(bound, path) == 0 && stale)
		unlink(path);
	else
		unlink(bound); /* a leftover of a daemon with our pid */
	if (bind(fd, (struct sockaddr *)&tmp, sizeof(tmp)) < 0) {
		log_error("event=listen_failed socket=\"%s\" error=\"bind: %s\"", bound,
			  strerror(errno));
		close(fd);
		return -1;
	}
	if (chmod(bound, s->cfg.socket_mode) < 0) {
		log_error("event=listen_failed socket=\"%s\" error=\"chmod: %s\"", path,
			  strerror(errno));
		goto err_file;
	}
	if (s->cfg.socket_group) {
		struct group *g = getgrnam(s->cfg.socket_group);
		if (!g || chown(bound, (uid_t)-1, g->gr_gid) < 0) {
			log_error(
				"event=listen_failed socket=\"%s\" error=\"cannot give it group %s: %s\"",
				path, s->cfg.socket_group, g ? strerror(errno) : "no such group");
			goto err_file;
		}
	}
	if (listen(fd, 256) < 0) {
		log_error("event=listen_failed socket=\"%s\" error=\"listen: %s\"", path,
			  strerror(errno));
		goto err_file;
	}
	/* rename replaces a stale socket file atomically. */
	if (strcmp(bound, path) != 0 && rename(bound, path) < 0) {
		log_error("event=listen_failed socket=\"%s\" error=\"rename: %s\"", path,
			  strerror(errno));
		goto err_file;
	}
	s->own_socket_file = true;
	s->listen_fd = fd;
	return 0;

err_file:
	unlink(bound);
	close(fd);
	return -1;
}

bool server_allows(const server_config *cfg, uint32_t uid, uint32_t gid, const uint32_t *groups,
		   size_t ngroups)
{
	const server_allow *u = &cfg->allow_uids, *g = &cfg->allow_gids;
	if (u->n == 0 && g->n == 0)
		return true;
	/* Root could read every buffer anyway, and the daemon's own uid runs
	 * the admin tools: neither can be locked out by a list. */
	if (uid == 0 || uid == (uint32_t)geteuid())
		return true;
	for (uint32_t i = 0; i < u->n; i++)
		if (u->ids[i] == uid)
			return true;
	for (uint32_t i = 0; i < g->n; i++) {
		if (g->ids[i] == gid)
			return true;
		for (size_t j = 0; j < ngroups; j++)
			if (g->ids[i] == groups[j])
				return true;
	}
	return false;
}

/* Whether the allow-lists admit the peer on fd. Its supplementary groups
 * (SO_PEERGROUPS: those it had when it connected) are looked up only when
 * its uid and primary gid are not enough. */
static bool peer_allowed(server *s, int fd, uint32_t uid, uint32_t gid)
{
	if (server_allows(&s->cfg, uid, gid, NULL, 0))
		return true;
	if (s->cfg.allow_gids.n == 0)
		return false;
	gid_t small[64], *groups = small;
	socklen_t len = sizeof(small);
	bool ok = false;
	int rc = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
	if (rc < 0 && errno == ERANGE && (groups = malloc(len)))
		rc = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
	if (rc == 0) {
		size_t n = len / sizeof(gid_t);
		uint32_t *ids = malloc((n ? n : 1) * sizeof(*ids));
		for (size_t i = 0; ids && i < n; i++)
			ids[i] = (uint32_t)groups[i];
		ok = ids && server_allows(&s->cfg, uid, gid, ids, n);
		free(ids);
	}
	if (groups != small)
		free(groups);
	return ok;
}

int server_add_conn(server *s, int fd, uint32_t uid, uint32_t gid, uint32_t pid)
{
	/* The allow-lists are the server's: supplementary groups are read
	 * from the socket. The request layer refuses a denied peer. */
	bool denied = !peer_allowed(s, fd, uid, gid);
	return conn_start(&s->conns, fd, uid, gid, pid, denied) ? 0 : -1;
}

/* ---- accepting, and running out of file descriptors ------------------------- */

/* Answer the connections waiting to be accepted when the daemon has no file
 * descriptor for them (err: EMFILE or ENFILE): each is accepted on the
 * number the reserve fd frees, told why, and closed, so that a client
 * learns at once what it would otherwise wait for in the backlog. Returns
 * how many were refused. */
static uint64_t refuse_waiting(server *s, int err)
{
	char msg[256];
	uint64_t n = 0;
	if (err == ENFILE)
		snprintf(msg, sizeof(msg),
			 "the daemon is out of file descriptors: the system's file table is full "
			 "(fs.file-max); try again later");
	else
		snprintf(msg, sizeof(msg),
			 "the daemon is out of file descriptors: all %" PRIu64
			 " that its open-file limit (RLIMIT_NOFILE) allows are in use; try again "
			 "once buffers or connections are released",
			 s->nofile);
	while (s->reserve_fd >= 0 && n < SERVER_ACCEPT_BATCH) {
		close(s->reserve_fd);
		int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd >= 0) {
			conn_refuse(&s->conns, fd, BB_ERR_NO_MEMORY, msg);
			metrics_refused(&s->counters, METRICS_LIMIT_OPEN_FILES);
			n++;
		}
		/* Another thread may have taken the number: then the reserve
		 * is lost until the pause ends. */
		s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			break;
	}
	return n;
}

static void on_accept(uv_poll_t *p, int status, int events);

static void on_accept_timer(uv_timer_t *t)
{
	server *s = t->data;
	if (s->reserve_fd < 0)
		s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
}

/* accept failed with err (not EAGAIN): a waiting connection keeps the
 * listener readable, so retrying at once would spin. Refuse what waits
 * when err is the want of fds, pause accepting for SERVER_ACCEPT_PAUSE_MS,
 * and log the first failure and then one line per SERVER_ACCEPT_LOG_MS. */
static void accept_failed(server *s, int err)
{
	uint64_t now = uv_now(s->loop);
	if (err == EMFILE || err == ENFILE)
		s->accept_refused += refuse_waiting(s, err);
	if (!s->accept_failing || now - s->accept_logged_ms >= SERVER_ACCEPT_LOG_MS) {
		log_warn("event=accept_failed error=\"%s\" open_file_limit=%" PRIu64
			 " refused=%" PRIu64 " pause_ms=%d",
			 strerror(err), s->nofile, s->accept_refused, SERVER_ACCEPT_PAUSE_MS);
		s->accept_logged_ms = now;
		s->accept_refused = 0;
	}
	s->accept_failing = true;
	uv_poll_stop(&s->listen_poll);
	uv_timer_start(&s->accept_timer, on_accept_timer, SERVER_ACCEPT_PAUSE_MS, 0);
}

static void on_accept(uv_poll_t *p, int status, int events)
{
	server *s = p->data;
	(void)events;
	if (status < 0)
		return;
	/* Accept what waits, a batch per turn: each accept is cheap and a
	 * burst of clients should not need one loop turn each, but the fds of
	 * connections refused in one turn are bounded (SERVER_FDS_SPARE). */
	for (int i = 0; i < SERVER_ACCEPT_BATCH; i++) {
		int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			if (errno != EAGAIN && errno != EWOULDBLOCK)
				accept_failed(s, errno);
			return;
		}
		if (s->accept_failing) {
			log_info("event=accept_resumed refused=%" PRIu64, s->accept_refused);
			s->accept_failing = false;
			s->accept_refused = 0;
		}
		struct ucred cred;
		socklen_t len = sizeof(cred);
		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
			log_warn("event=accept_failed error=\"SO_PEERCRED: %s\"", strerror(errno));
			close(fd);
			continue;
		}
		if (server_add_conn(s, fd, cred.uid, cred.gid, (uint32_t)cred.pid) < 0) {
			log_error("event=accept_failed error=\"out of memory\"");
			close(fd);
		}
	}
}

/* ---- the open-file budget ------------------------------------------------------ */

/* Raise the soft open-file limit to the hard one: the soft default (1024)
 * is kept low for select(), which the daemon does not use. */
static void raise_nofile(void)
{
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur >= rl.rlim_max)
		return;
	struct rlimit up = {.rlim_cur = rl.rlim_max, .rlim_max = rl.rlim_max};
	if (setrlimit(RLIMIT_NOFILE, &up) < 0)
		log_warn(
			"event=open_file_limit error=\"cannot raise the soft limit %llu to the hard "
			"limit %llu: %s\"",
			(unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_max,
			strerror(errno));
}

/* The file descriptors cfg's limits may make the daemon hold, against its
 * open-file limit (docs/OPERATIONS.md, "Open files"): those it had open
 * when it was set up, SERVER_FDS_SPARE, the memfd pool (host_pool), SERVER_FDS_PER_CONN
 * per connection and one per host buffer. 0 with *host_buffers set (a
 * max_host_buffers of 0 is what the limit leaves), or -1 with why naming
 * the limit to lower. */
static int fd_budget(const server *s, const server_config *cfg, uint64_t *host_buffers, char *why,
		     size_t len)
{
	const broker_limits *l = &cfg->limits;
	/* Each VMM CUDA allocation is an fd the daemon keeps (bounded by
	 * max_vmm_allocations, which takes effect at start); none when CUDA
	 * is not served. */
	uint64_t vmm = s->cuda ? backend_cuda_config_of(s->cuda)->vmm_allocations : 0;
	/* The fd store's bundles (docs/RESTART.md, "Bundles"): bounded for as
	 * many kept fds as the limit allows at all. */
	uint64_t fixed = s->fds_own + SERVER_FDS_SPARE + cfg->host_pool +
			 restart_bundle_fds(s->restart, s->nofile);
	uint64_t conns = (uint64_t)l->connections * SERVER_FDS_PER_CONN;
	if (fixed + conns >= s->nofile) {
		uint64_t most =
			s->nofile > fixed + 1 ? (s->nofile - fixed - 1) / SERVER_FDS_PER_CONN : 0;
		snprintf(why, len,
			 "%" PRIu32 " connections need %" PRIu64
			 " file descriptors (%d each) on top of the %" PRIu64
			 " the daemon keeps for itself, but its open-file limit (RLIMIT_NOFILE) is "
			 "%" PRIu64 ": lower --max-connections to at most %" PRIu64
			 ", or raise the limit (LimitNOFILE= in the unit, ulimit -n)",
			 l->connections, conns, SERVER_FDS_PER_CONN, fixed, s->nofile, most);
		return -1;
	}
	if (fixed + conns + vmm >= s->nofile) {
		uint64_t most = s->nofile - fixed - conns - 1;
		snprintf(why, len,
			 "%" PRIu64 " VMM CUDA allocations (one each) and %" PRIu32
			 " connections (%" PRIu64 ") need %" PRIu64
			 " file descriptors with the %" PRIu64
			 " the daemon keeps for itself, but its open-file limit (RLIMIT_NOFILE) is "
			 "%" PRIu64 ": lower --max-cuda-vmm-allocations to at most %" PRIu64
			 " (or --max-connections), or raise the limit (LimitNOFILE= in the unit, "
			 "ulimit -n)",
			 vmm, l->connections, conns, vmm + conns + fixed, fixed, s->nofile, most);
		return -1;
	}
	fixed += vmm;
	uint64_t room = s->nofile - fixed - conns;
	if (l->host_buffers > room) {
		snprintf(why, len,
			 "%" PRIu64 " host buffers (one each) and %" PRIu32 " connections (%" PRIu64
			 ") need %" PRIu64 " file descriptors with the %" PRIu64
			 " the daemon keeps for itself, but its open-file limit (RLIMIT_NOFILE) is "
			 "%" PRIu64 ": lower --max-host-buffers to at most %" PRIu64
			 " (or --max-connections), or raise the limit (LimitNOFILE= in the unit, "
			 "ulimit -n)",
			 l->host_buffers, l->connections, conns, l->host_buffers + conns + fixed,
			 fixed, s->nofile, room);
		return -1;
	}
	*host_buffers = l->host_buffers ? l->host_buffers : room;
	return 0;
}

/* Learn the open-file limit and what the daemon holds already, check
 * cfg's limits against them and hand the broker its host-buffer limit;
 * hold the reserve fd. 0, or -1 with the reason logged. */
static int fds_start(server *s, const server_config *cfg)
{
	struct rlimit rl;
	char why[512];
	s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	s->nofile = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < SERVER_NOFILE_MAX
			    ? rl.rlim_cur
			    : SERVER_NOFILE_MAX;
	int own = metrics_open_fds();
	s->fds_own = own > 0 ? (uint64_t)own : SERVER_FDS_SPARE;
	/* Restored host buffers' memfds are open already: the host-buffer
	 * limit counts them, not the daemon's own. */
	broker_totals t;
	broker_totals_get(s->b, &t);
	if (own > 0 && s->fds_own > t.buffers[BB_HOST] + 1)
		s->fds_own -= t.buffers[BB_HOST];
	/* Likewise the bundles a restart kept: fd_budget counts them. */
	uint64_t held = restart_held_fds(s->restart);
	if (own > 0 && s->fds_own > held + 1)
		s->fds_own -= held;
	if (fd_budget(s, cfg, &s->host_buffers, why, sizeof(why)) < 0) {
		log_error("event=start_failed error=\"%s\"", why);
		return -1;
	}
	broker_limits l = cfg->limits;
	l.host_buffers = s->host_buffers;
	broker_set_limits(s->b, &l);
	log_info("event=open_files limit=%" PRIu64 " own=%" PRIu64 " spare=%d pool=%u "
		 "vmm_allocations=%" PRIu64 " connections=%" PRIu32
		 " per_connection=%d host_buffers=%" PRIu64 "%s",
		 s->nofile, s->fds_own, SERVER_FDS_SPARE, cfg->host_pool,
		 s->cuda ? backend_cuda_config_of(s->cuda)->vmm_allocations : 0,
		 cfg->limits.connections, SERVER_FDS_PER_CONN, s->host_buffers,
		 cfg->limits.host_buffers ? "" : " (what the limit leaves)");
	return 0;
}

/* The send-timeout sweep: close each connection whose queued output has
 * not moved for send_timeout_ms (its client stopped reading; backpressure
 * keeps its queue short, so the queue limit alone would never close it),
 * and run again when the next one could be due. */
static void on_send_timer(uv_timer_t *t)
{
	server *s = t->data;
	uint64_t next = conn_sweep_stalled(&s->conns, uv_now(s->loop));
	if (next != UINT64_MAX)
		uv_timer_start(&s->send_timer, on_send_timer, next, 0);
}

/* A connection's output queue just started: make sure the send-timeout
 * sweep runs (conn_env's output_queued). */
static void output_queued(void *ctx)
{
	server *s = ctx;
	if (s->stopping || uv_is_active((uv_handle_t *)&s->send_timer))
		return;
	uv_timer_start(&s->send_timer, on_send_timer, s->cfg.send_timeout_ms, 0);
}

static void on_reap_soon(uv_idle_t *h)
{
	(void)h; /* being active is its whole job: the loop polls without blocking */
}

/* A connection was doomed (conn_env's reap_soon): the reaper closes it
 * this loop turn, even when no I/O would wake the loop (a doom from a
 * timer callback). */
static void reap_soon(void *ctx)
{
	server *s = ctx;
	if (!s->stopping && !uv_is_active((uv_handle_t *)&s->reap_soon))
		uv_idle_start(&s->reap_soon, on_reap_soon);
}

static void on_reap(uv_check_t *h)
{
	server *s = h->data;
	uv_idle_stop(&s->reap_soon);
	/* Freed buffers leave the fd store after the commits that freed them. */
	restart_flush(s->restart);
	if (!s->journal_errors_logged && broker_journal_errors(s->b)) {
		s->journal_errors_logged = true;
		log_error("event=journal_error note=\"the state journal could not grow: it no "
			  "longer matches the daemon, and a restart would serve an older state; "
			  "further errors are counted (bufbroker_journal_errors_total)\"");
	}
	if (s->retry_allocs) {
		s->retry_allocs = false;
		handler_retry_allocs(s->h);
	}
	conn *c;
	while ((c = conn_next_doomed(&s->conns)))
		conn_close(c);
}

static void on_signal(uv_signal_t *h, int signum)
{
	server *s = h->data;
	log_info("event=stopping signal=%s", signum == SIGTERM ? "SIGTERM" : "SIGINT");
	uv_stop(s->loop);
}

/* ---- backend jobs ---------------------------------------------------------- */

/* A backend job on libuv's thread pool. */
typedef struct server_job {
	uv_work_t req;    /* req.data: the server */
	backend_job *job; /* the backend's job */
} server_job;

static void job_work(uv_work_t *req)
{
	server_job *sj = (server_job *)req;
	sj->job->work(sj->job);
}

static void job_after(uv_work_t *req, int status)
{
	server_job *sj = (server_job *)req;
	server *s = req->data;
	backend_job *job = sj->job;
	free(sj);
	/* Jobs are never cancelled; should one be, its work still runs. */
	if (status == UV_ECANCELED)
		job->work(job);
	s->jobs--;
	job->done(job);
	/* The memory a parked alloc waited for may be there now. */
	handler_retry_allocs(s->h);
}

static void server_submit(backend *be, backend_job *job)
{
	server *s = be->server;
	server_job *sj = malloc(sizeof(*sj));
	if (sj) {
		sj->job = job;
		sj->req.data = s;
		if (uv_queue_work(s->loop, &sj->req, job_work, job_after) == 0) {
			s->jobs++;
			return;
		}
		free(sj);
	}
	/* No memory to queue it: do it here, and retry the parked allocs
	 * (the caller's among them) at the end of this loop turn. */
	log_warn("event=job_inline error=\"could not queue a backend job\"");
	job->work(job);
	job->done(job);
	s->retry_allocs = true;
}

/* Load the driver and serve CUDA buffers, or say why not (in the log and
 * in every CUDA Alloc's answer). */
/* "legacy", "auto", "vmm" or "none", for the log. */
static const char *handle_name(int h)
{
	return h == BB_CUDA_HANDLE_LEGACY ? "legacy"
	       : h == BB_CUDA_HANDLE_AUTO ? "auto"
	       : h == BB_CUDA_HANDLE_VMM  ? "vmm"
					  : "none";
}

static void start_cuda(server *s)
{
	char why[200] = "";
	if (s->cfg.no_cuda)
		snprintf(why, sizeof(why), "disabled with --no-cuda");
	else
		s->cuda = backend_cuda_new(&s->cfg.cuda, why, sizeof(why));
	if (!s->cuda) {
		snprintf(s->cuda_why, sizeof(s->cuda_why), "%s", why);
		char msg[300];
		snprintf(msg, sizeof(msg), "CUDA is not available on this daemon: %s", why);
		broker_set_backend(s->b, BB_CUDA, NULL, msg);
		log_info("event=cuda_unavailable reason=\"%s\"", why);
		return;
	}
	s->cuda->submit = server_submit;
	s->cuda->server = s;
	broker_set_backend(s->b, BB_CUDA, s->cuda, NULL);

	backend_device devs[64];
	char uuid[48];
	int n = s->cuda->devices(s->cuda, devs, 64);
	int v = backend_cuda_driver_version(s->cuda);
	const backend_cuda_config *cc = backend_cuda_config_of(s->cuda);
	log_info("event=cuda_ready library=\"%s\" driver=%d.%d devices=%d slab_bytes=%" PRIu64
		 " cache_bytes=%" PRIu64 " handle=%s forbid=%s max_vmm_allocations=%" PRIu64,
		 backend_cuda_library(s->cuda), v / 1000, v % 1000 / 10, n, cc->slab_bytes,
		 cc->cache_bytes, handle_name(cc->handle_default), handle_name(cc->handle_forbid),
		 cc->vmm_allocations);
	for (int i = 0; i < n; i++) {
		bb_cuda_uuid_format(devs[i].uuid, uuid);
		log_info("event=cuda_device ordinal=%d name=\"%s\" uuid=%s total_bytes=%llu "
			 "free_bytes=%llu limit_bytes=%llu vmm=%d vmm_unavailable=\"%s\"",
			 devs[i].ordinal, devs[i].name, uuid, devs[i].total, devs[i].free,
			 devs[i].limit, devs[i].vmm, devs[i].vmm_why);
	}
}

/* The transport's limits in cfg. */
static conn_limits limits_of(const server_config *cfg)
{
	return (conn_limits){
		.max_datagram = cfg->max_datagram,
		.queue_bytes = cfg->queue_bytes,
		.send_timeout_ms = cfg->send_timeout_ms,
		.conn_inflight = cfg->conn_inflight,
	};
}

/* What server_start and server_start_detached share: the layers from the
 * backends up to the transport, the timers and the reaper. *out is set
 * once s is allocated. */
static int server_init(server **out, uv_loop_t *loop, const server_config *cfg, bool passed)
{
	server *s = calloc(1, sizeof(*s));
	*out = s;
	if (!s) {
		log_error("event=start_failed error=\"out of memory\"");
		return -1;
	}
	s->loop = loop;
	s->cfg = *cfg;
	s->listen_fd = -1;
	s->reserve_fd = -1;
	raise_nofile();
	broker_config bc = {.limits = cfg->limits};
	if (passed || cfg->journal) {
		/* What systemd passed (the listening socket, a kept state) and
		 * the journal the broker writes. */
		char why[256];
		restart_config rc = {
			.journal = cfg->journal,
			.strict = cfg->restart_strict,
			.grace_ms = cfg->restart_grace_ms,
		};
		if (restart_new(&s->restart, &rc, why, sizeof(why)) < 0) {
			log_error("event=start_failed error=\"%s\"", why);
			return -1;
		}
		bc.journal = restart_journal(s->restart);
		bc.keep = restart_keep;
		bc.keep_ctx = s->restart;
		if (bc.journal)
			log_info("event=journal_on fd=%d generation=%" PRIu64,
				 journal_fd(bc.journal), restart_generation(s->restart));
	}
	s->b = broker_new(&bc);
	s->host = backend_host_new();
	if (!s->b || !s->host) {
		log_error("event=start_failed error=\"out of memory\"");
		return -1;
	}
	broker_set_backend(s->b, BB_HOST, s->host, NULL);
	broker_set_grace(s->b, cfg->restart_grace_ms);
	/* Safe because the broker's grant reports cross-uid sends to the
	 * backend (its expose); on failure pooling stays off. */
	backend_host_pool(s->host, cfg->host_pool, BACKEND_HOST_POOL_PER_CLASS_DEFAULT);
	start_cuda(s);

	s->park = park_new(loop, s->b);
	s->src = (snapshot_sources){
		.loop = loop,
		.started_ms = uv_now(loop),
		.b = s->b,
		.host = s->host,
		.cuda = s->cuda,
		.cuda_why = s->cuda_why,
		.park = s->park,
		.counters = &s->counters,
		.restart = s->restart ? restart_get_stats(s->restart) : NULL,
	};
	s->h = s->park ? handler_new(loop, &s->src, s->park, &s->counters, cfg->max_datagram)
		       : NULL;
	s->codec = codec_new(cfg->max_datagram);
	s->conns = (conn_env){
		.loop = loop,
		.limits = limits_of(cfg),
		.codec = s->codec,
		.h = s->h,
		.counters = &s->counters,
		.reap_soon = reap_soon,
		.output_queued = output_queued,
		.ctx = s,
	};
	if (!s->park || !s->h || !s->codec || conn_env_init(&s->conns) < 0) {
		log_error("event=start_failed error=\"out of memory\"");
		return -1;
	}

	uv_timer_init(loop, &s->send_timer);
	s->send_timer.data = s;
	uv_timer_init(loop, &s->accept_timer);
	s->accept_timer.data = s;
	uv_check_init(loop, &s->reaper);
	s->reaper.data = s;
	uv_check_start(&s->reaper, on_reap);
	uv_idle_init(loop, &s->reap_soon);
	s->reap_soon.data = s;
	uv_timer_init(loop, &s->grace_timer);
	s->grace_timer.data = s;
	return 0;
}

static uint64_t mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Restored sessions nobody resumed within the grace period are closed as
 * disconnects (docs/RESTART.md, "The grace period"); the timer follows the
 * earliest deadline (the broker's clock is CLOCK_MONOTONIC). */
static void on_grace(uv_timer_t *t)
{
	server *s = t->data;
	uint32_t n = broker_release_absent(s->b);
	if (n)
		log_info("event=sessions_released count=%u reason=\"not resumed within the grace "
			 "period\" absent=%u",
			 n, broker_absent_sessions(s->b));
	uint64_t next = broker_next_grace(s->b);
	if (next) {
		uint64_t now = mono_ms();
		/* At least 1 ms: a timer due now would run again in the same
		 * loop turn, and a deadline that could not be met would spin. */
		uv_timer_start(&s->grace_timer, on_grace, next > now ? next - now : 1, 0);
	}
}

/* The store must hold a bundle per 64 kept fds (host buffers and VMM
 * allocations), a few more and two journals (docs/OPERATIONS.md, "Restarts
 * and upgrades"). */
static void check_store_max(server *s)
{
	uint64_t max = s->restart ? restart_config_of(s->restart)->store_max : 0;
	uint64_t vmm = s->cuda ? backend_cuda_config_of(s->cuda)->vmm_allocations : 0;
	uint64_t need = restart_store_need(s->host_buffers + vmm);
	if (max && max < need)
		log_warn("event=fdstore_too_small fdstore_max=%" PRIu64 " needed=%" PRIu64
			 " host_buffers=%" PRIu64 " vmm_allocations=%" PRIu64
			 " note=\"buffers past it are lost at a restart: raise "
			 "FileDescriptorStoreMax= in the unit\"",
			 max, need, s->host_buffers, vmm);
}

/* The kept state's fds for an upgrade (upgrade.h): restart_each_fd, once
 * the batched store removals are sent (the fd store then holds what the
 * new image gets, and no freed buffer). */
static size_t upgrade_each(void *ctx, int (*fn)(void *fctx, const char *name, int fd), void *fctx)
{
	restart_flush(ctx);
	return restart_each_fd(ctx, fn, fctx);
}

int server_start(server **out, uv_loop_t *loop, const server_config *cfg)
{
	if (server_init(out, loop, cfg, true) < 0)
		return -1;
	server *s = *out;
	char why[512];
	/* The passed socket, and the state kept across a restart. */
	if (restart_start(s->restart, s->b, s->host, s->cuda, &s->listen_fd, why, sizeof(why)) <
	    0) {
		log_error("event=start_failed error=\"%s\"", why);
		return -1;
	}
	int passed = s->listen_fd >= 0;
	/* Before listening: a daemon whose limits do not fit makes no socket. */
	if (fds_start(s, cfg) < 0)
		return -1;
	check_store_max(s);
	if (passed)
		s->own_socket_file = false;
	else if (listen_on(s) < 0)
		return -1;
	on_grace(&s->grace_timer);
	handler_restored(s->h);

	uv_poll_init(loop, &s->listen_poll, s->listen_fd);
	s->listen_poll.data = s;
	uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
	uv_signal_init(loop, &s->sigterm);
	uv_signal_init(loop, &s->sigint);
	s->sigterm.data = s->sigint.data = s;
	uv_signal_start(&s->sigterm, on_signal, SIGTERM);
	uv_signal_start(&s->sigint, on_signal, SIGINT);

	if (cfg->journal) {
		upgrade_env ue = {.loop = loop,
				  .listen_fd = s->listen_fd,
				  .each = upgrade_each,
				  .each_ctx = s->restart};
		handler_upgrade hu;
		if (!(s->upgrade = upgrade_new(&ue))) {
			log_error("event=start_failed error=\"out of memory\"");
			return -1;
		}
		hu = upgrade_hooks(s->upgrade);
		handler_set_upgrade(s->h, &hu);
	}
	log_info("event=listening socket=\"%s\" activation=%s max_datagram=%u",
		 passed ? "(passed by systemd)" : s->cfg.socket_path, passed ? "systemd" : "none",
		 s->cfg.max_datagram);
	sd_notify(0, "READY=1\nSTATUS=serving");
	return 0;
}

int server_start_detached(server **out, uv_loop_t *loop, const server_config *cfg)
{
	if (server_init(out, loop, cfg, false) < 0)
		return -1;
	return fds_start(*out, cfg);
}

int server_metrics_start(server *s, const char *listen_addr)
{
	s->metrics = metrics_start(s->loop, &s->src, listen_addr);
	return s->metrics ? 0 : -1;
}

int server_reload_check(const server *s, const server_config *cfg, char *why, size_t len)
{
	uint64_t host_buffers;
	return fd_budget(s, cfg, &host_buffers, why, len);
}

void server_reload(server *s, const server_config *cfg)
{
	char why[512];
	broker_limits l = cfg->limits;
	/* Checked by the caller (server_reload_check); should it not fit, the
	 * host-buffer limit stays. */
	if (fd_budget(s, cfg, &s->host_buffers, why, sizeof(why)) < 0)
		log_error("event=config_reload_failed error=\"%s\"", why);
	l.host_buffers = s->host_buffers;
	s->cfg.limits = cfg->limits;
	s->cfg.queue_bytes = cfg->queue_bytes;
	s->cfg.send_timeout_ms = cfg->send_timeout_ms;
	s->cfg.conn_inflight = cfg->conn_inflight;
	s->cfg.allow_uids = cfg->allow_uids;
	s->cfg.allow_gids = cfg->allow_gids;
	if (cfg->host_pool != s->cfg.host_pool) {
		s->cfg.host_pool = cfg->host_pool;
		backend_host_pool(s->host, cfg->host_pool, BACKEND_HOST_POOL_PER_CLASS_DEFAULT);
	}
	s->cfg.cuda.handle_default = cfg->cuda.handle_default;
	s->cfg.cuda.handle_forbid = cfg->cuda.handle_forbid;
	if (s->cuda)
		backend_cuda_set_handles(s->cuda, &s->cfg.cuda);
	broker_set_limits(s->b, &l);
	conn_limits lim = limits_of(&s->cfg);
	lim.max_datagram = s->conns.limits.max_datagram;
	s->conns.limits = lim;
	/* A connection paused at the old in-flight limit may read again. */
	conn_update_all(&s->conns);
}

static void close_walk(uv_handle_t *h, void *arg)
{
	(void)arg;
	if (!uv_is_closing(h))
		uv_close(h, NULL);
}

void server_shutdown(server *s)
{
	if (!s)
		return;
	/* Its thread reads nothing of ours, but it asks the loop for
	 * snapshots: stop it before the loop's handles close. */
	metrics_stop(s->metrics);
	s->metrics = NULL;
	s->stopping = true;
	sd_notify(0, "STOPPING=1");
	if (s->h)
		handler_stop(s->h);
	if (s->loop) {
		if (s->h)
			conn_close_all(&s->conns);
		upgrade_close(s->upgrade);
		/* Connections closed above free themselves in their close
		 * callbacks; everything else has no callback to wait for. */
		uv_walk(s->loop, close_walk, NULL);
		/* This also waits for backend jobs in flight. */
		uv_run(s->loop, UV_RUN_DEFAULT);
	}
	if (s->listen_fd >= 0)
		close(s->listen_fd);
	if (s->reserve_fd >= 0)
		close(s->reserve_fd);
	if (s->own_socket_file)
		unlink(s->cfg.socket_path);
	broker_free(s->b);
	restart_free(s->restart); /* after the broker: its frees reach the table */
	/* Buffers that tokens kept alive were freed just now; their backend
	 * jobs must finish before the backend goes. */
	if (s->loop)
		uv_run(s->loop, UV_RUN_DEFAULT);
	if (s->cuda)
		s->cuda->destroy(s->cuda);
	if (s->host)
		s->host->destroy(s->host);
	handler_free(s->h);
	park_free(s->park);
	codec_free(s->codec);
	conn_env_free(&s->conns);
	free(s);
}

/* ---- for the fuzz target ------------------------------------------------------ */

broker *server_broker(server *s)
{
	return s->b;
}

backend *server_host(server *s)
{
	return s->host;
}

bool server_has_conns(const server *s)
{
	return s->conns.conns != NULL;
}

bool server_has_doomed(const server *s)
{
	return s->conns.doomed != NULL;
}

uint64_t server_first_conn(const server *s)
{
	return conn_first_serial(&s->conns);
}

size_t server_reading_fds(server *s, int *fds, size_t max)
{
	return conn_reading_fds(&s->conns, fds, max);
}

int server_check(server *s, char *report, size_t cap)
{
	return handler_check(s->h, report, cap);
}
