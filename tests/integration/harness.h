/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Integration-test harness: a real bufbrokerd on a temporary socket, child
 * processes that report through exit codes, and a raw SOCK_SEQPACKET peer
 * for protocol tests.
 *
 * Functions marked "asserts" fail the calling Criterion test on error and
 * may only be used in the test's own process. Everything else is safe in a
 * forked child, which must end with _exit (Criterion asserts in a child do
 * not reach the runner).
 */
#ifndef BB_TEST_HARNESS_H
#define BB_TEST_HARNESS_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "bufbroker.pb-c.h"
#include "bufbroker/bufbroker.h"

#define BBT_MAX_ARGS 16

/* One daemon under test. */
typedef struct bbt_daemon {
	char dir[128];                  /* fresh mkdtemp directory, removed by bbt_cleanup */
	char sock[160];                 /* dir/bb.sock, passed with --socket */
	char log[160];                  /* dir/daemon.log: the daemon's stdout and stderr */
	const char *args[BBT_MAX_ARGS]; /* extra arguments, NULL-terminated */
	pid_t pid;                      /* the running daemon, or -1 */
	pid_t sd_pid;                   /* its systemd stand-in (bbt_start_sd), or 0 */
} bbt_daemon;

/* ---- the daemon ------------------------------------------------------- */

/* $BBT_CUDA_HANDLE ("legacy", "auto" or "vmm"; ctest's *_vmm runs set
 * vmm), or NULL when unset or empty: bbt_start and bbt_restart pass it to
 * every daemon as --cuda-handle (unless the test's own arguments have
 * one), so that one test program checks CUDA buffers of each kind. */
const char *bbt_cuda_handle(void);
/* Start $BUFBROKERD with --socket in a new temporary directory plus the
 * NULL-terminated extra arguments (may be NULL), and wait (up to 5 s) until
 * the socket accepts connections. Asserts. The daemon is registered for
 * bbt_cleanup and dies with the test process (PR_SET_PDEATHSIG). */
bbt_daemon *bbt_start(const char *const *extra);
/* Start the daemon again on the same socket path and arguments after it
 * was stopped or killed; its log is appended to. Asserts. */
void bbt_restart(bbt_daemon *d);
/* SIGTERM and reap (up to 5 s, then SIGKILL). Returns the wait status, or
 * -1 when it had to be killed. */
int bbt_stop(bbt_daemon *d);
/* SIGTERM and assert a clean exit (status 0); dumps the log otherwise. */
void bbt_stop_clean(bbt_daemon *d);
/* SIGKILL and reap. */
void bbt_kill(bbt_daemon *d);
/* Print the tail of the daemon's log to stderr (for failure reports). */
void bbt_dump_log(const bbt_daemon *d);
/* Current size of the log, to look at what came after a point. */
size_t bbt_log_size(const bbt_daemon *d);
/* Poll (up to timeout_ms) for a line of the log that starts at or after
 * byte offset `from` and contains every one of the NULL-terminated needles
 * (case-insensitive). */
bool bbt_log_wait_line(const bbt_daemon *d, size_t from, int timeout_ms,
		       const char *const *needles);
/* memfds the daemon process has open (from /proc/PID/fd), or -1. Freed
 * host buffers' memfds may stay open, empty, in the daemon's reuse pool
 * (at most BBT_HOST_POOL_MAX). */
int bbt_daemon_memfds(const bbt_daemon *d);
#define BBT_HOST_POOL_MAX 64
/* Bytes of memory the daemon's memfds hold (their st_blocks), or -1. */
long long bbt_daemon_memfd_bytes(const bbt_daemon *d);
/* Every fd the daemon process has open (from /proc/PID/fd), or -1. */
int bbt_daemon_fds(const bbt_daemon *d);
/* The daemon's resident memory in KiB (VmRSS in /proc/PID/status), or -1. */
long bbt_daemon_rss_kb(const bbt_daemon *d);
/* CPU time the daemon has used, user and system, in ms (from
 * /proc/PID/stat: in clock ticks, 10 ms apart), or -1. */
long bbt_daemon_cpu_ms(const bbt_daemon *d);
/* Lower the daemon's soft open-file limit (prlimit) so that only room fd
 * numbers below it are free: after room more open files, the next fails
 * with EMFILE. Returns the soft limit it had (for bbt_daemon_set_nofile),
 * or -1. */
long bbt_daemon_squeeze_fds(const bbt_daemon *d, int room);
/* Set the daemon's soft open-file limit to soft. 0 or -1. */
int bbt_daemon_set_nofile(const bbt_daemon *d, long soft);
/* Kill any daemon still running and remove the temporary directories.
 * Use as every suite's .fini. */
void bbt_cleanup(void);
/* bbt_cleanup, then, when used_fake, remove what the test's fake CUDA
 * namespaces left in /dev/shm (allocations of killed processes, the
 * devices' accounting) through $BB_FAKECUDA's fakecuda_reset_namespace.
 * The .fini of suites that run the fake driver. */
void bbt_cleanup_fakecuda(bool used_fake);

/* ---- the daemon under a systemd stand-in (restarts) ---------------------
 * tests/integration/fakesd.c plays systemd's part for bufbrokerd.service
 * and bufbrokerd.socket: it owns the listening socket (passed as
 * LISTEN_FDS with LISTEN_FDNAMES "bufbrokerd.socket"), gives the daemon a
 * NOTIFY_SOCKET with an fd store (FDSTORE=1, FDSTOREREMOVE=1, FDNAME=,
 * FileDescriptorStoreMax 65536 unless set), and relaunches it when it
 * dies of a signal or exits non-zero (Restart=on-failure, after 100 ms),
 * passing the stored fds after the socket, newest first, as systemd does.
 * bbt_stop / bbt_kill / bbt_cleanup end the stand-in and its daemon. */

/* Start $BUFBROKERD (--socket, extra, and --restart unless extra has it:
 * the journal is on) under the stand-in; returns once the daemon said
 * READY=1. Asserts. d->pid is the daemon's pid, kept current by the
 * functions below. */
bbt_daemon *bbt_start_sd(const char *const *extra);
/* Run any program (argv[0] a path) as the service under the stand-in (for
 * test_fakesd's toy service); wait_ready: return once it said READY=1,
 * else once it is started. Asserts. */
bbt_daemon *bbt_sd_start_program(const char *const *argv, bool wait_ready);
/* SIGKILL the running daemon; returns once the stand-in relaunched it and
 * the new process said READY=1 (asserts, within 10 s times bbt_slow). */
void bbt_sd_crash(bbt_daemon *d);
/* What the stand-in knows. */
typedef struct bbt_sd_state {
	pid_t pid;        /* the service's main process, or -1 between starts */
	unsigned gen;     /* starts so far (1: the first) */
	bool ready;       /* this start's process said READY=1 */
	char state[16];   /* starting, running, stopping, auto-restart, dead */
	unsigned stored;  /* fds in the store */
	unsigned max;     /* FileDescriptorStoreMax */
	unsigned refused; /* notifications refused: not from the main pid */
	unsigned exfull;  /* notifications whose fds hit the store's limit */
	unsigned dups;    /* fds not stored: that file was stored already */
	unsigned readys;  /* READY=1 notifications, all starts together */
} bbt_sd_state;
/* 0 or -errno. */
int bbt_sd_status(const bbt_daemon *d, bbt_sd_state *st);
/* The current daemon pid, or -1 (between a death and its relaunch). */
pid_t bbt_sd_pid(const bbt_daemon *d);
/* fds in the store, or -errno. */
int bbt_sd_store_count(const bbt_daemon *d);
/* The stored fds' names (FDNAME=) in the order a start passes them,
 * newest first: their number, *names a NULL-terminated array for
 * bbt_sd_names_free; or -errno. */
int bbt_sd_store_names(const bbt_daemon *d, char ***names);
void bbt_sd_names_free(char **names);
/* A dup of the (newest) stored fd of that name: the fd, -ENOENT, or
 * -errno. The same open file: writes to it change what a restart gets. */
int bbt_sd_store_fd(const bbt_daemon *d, const char *name);
/* A dup of the newest stored journal ("journal-G", the highest G): the
 * fd, -ENOENT when the store has none, or -errno. */
int bbt_sd_journal_fd(const bbt_daemon *d);
/* What a stored bundle holds (fd: its receiving end, e.g. from
 * bbt_sd_store_fd), peeked as a starting daemon peeks it: SO_PEEK_OFF 0,
 * every message peeked (the fds that come with them closed), SO_PEEK_OFF
 * -1; nothing is taken. One name a message: "b<id>" or "a<id>" for a
 * well-formed record with one fd (docs/RESTART.md, "Bundles"), "?" for any
 * other. The count, *names NULL-terminated for bbt_sd_names_free; or
 * -errno. The peek offset is the socket's: not while a daemon starts. */
int bbt_bundle_names(int fd, char ***names);
/* The store as kept: the stored names (journal-G, and b<id>/a<id> stored
 * by their own names), each bundle k<n> replaced by what it holds
 * (bbt_bundle_names). A name in two bundles (a rebuild under way) is
 * there twice. The count, *names for bbt_sd_names_free; or -errno. */
int bbt_sd_kept_names(const bbt_daemon *d, char ***names);
/* Set FileDescriptorStoreMax (takes effect for the next FDSTORE=1 and the
 * next start's $FDSTORE): 0 or -errno. */
int bbt_sd_set_store_max(const bbt_daemon *d, unsigned max);

/* bb_connect to d's socket; asserts success. */
bb_client *bbt_connect(const bbt_daemon *d);

/* ---- children ----------------------------------------------------------- */

/* Fork; the child runs fn(arg) and _exits with its return value. */
pid_t bbt_spawn(int (*fn)(void *arg), void *arg);
/* For a child that exits on purpose without cleaning up (a client that
 * "vanishes" holding its connection): keep p reachable until the process
 * ends, so that a leak checker (valgrind) counts what hangs off it as
 * still reachable, not lost. Does nothing else; at most 16 pointers. */
void bbt_abandon(const void *p);
/* Reap pid: its exit code, 128 + signal number when a signal killed it,
 * or -1 when it was still running after timeout_ms (it is then killed). */
int bbt_join(pid_t pid, int timeout_ms);

/* A bidirectional channel between a test and its child (socketpair).
 * Both sides may use both ends; by convention the parent uses fd[0]. */
typedef struct bbt_chan {
	int fd[2];
} bbt_chan;
void bbt_chan_open(bbt_chan *ch); /* asserts */
void bbt_chan_close(bbt_chan *ch);
/* Whole-message send and receive; 0 or -1 (receive: also on timeout or
 * end of stream). timeout_ms < 0 waits forever. */
int bbt_send(int fd, const void *p, size_t n);
int bbt_recv(int fd, void *p, size_t n, int timeout_ms);

/* ---- time ----------------------------------------------------------------- */

int64_t bbt_now_ms(void);
void bbt_sleep_ms(int ms);
/* How much slower than usual this run is: $BBT_SLOW, a whole factor (e.g.
 * 20 under valgrind); 1 when unset or not a number >= 1. scripts/valgrind.sh
 * also sets $BBT_VALGRIND=1 (every traced process is then named after the
 * tool in /proc/PID/comm). */
int bbt_slow(void);
/* ms times bbt_slow() (0 and negative values unchanged). Every timeout the
 * harness takes (start, stop, join, receive, the *_until polls) is scaled
 * already; use this for a test's own bounds on how long something may take
 * to happen, never for a delay the daemon must honour. */
int bbt_ms(int ms);

/* ---- daemon state through a client ------------------------------------- */

/* Poll bb_stat until it answers something else than 0 or timeout_ms passed;
 * returns the last code (BB_ERR_NOT_FOUND once the buffer is gone). */
int bbt_stat_until_gone(bb_client *c, uint64_t id, int timeout_ms);
/* Poll bb_stat until refs == want; returns the last refs seen (or the
 * negative bb_stat error). */
int64_t bbt_refs_until(bb_client *c, uint64_t id, uint64_t want, int timeout_ms);
/* bb_stat's refs, or the negative error. */
int64_t bbt_refs(bb_client *c, uint64_t id);

/* The daemon's ServerStatus, summed. */
typedef struct bbt_totals {
	uint64_t buffers; /* all kinds */
	uint64_t bytes;   /* all kinds */
	uint64_t host_buffers;
	uint32_t connections;
	uint64_t tokens;
	uint64_t waits;
	uint32_t pid;
} bbt_totals;
/* 0 or the bbc_call / Status error. */
int bbt_server_totals(bb_client *c, bbt_totals *out);
/* ServerStatus's restart fields (protocol 1.3, docs/RESTART.md). */
typedef struct bbt_restart_info {
	uint64_t restarts;            /* starts from a kept state */
	uint64_t restored_buffers;    /* buffers this process rebuilt */
	uint32_t absent_sessions;     /* restored sessions not resumed yet */
	uint64_t journal_bytes;       /* 0: journal off */
	bool restart_protected;       /* journal on and its fds kept */
	uint64_t unprotected_buffers; /* live buffers whose fd is not stored */
} bbt_restart_info;
/* 0 or the bbc_call / Status error. */
int bbt_server_restart(bb_client *c, bbt_restart_info *out);
/* ServerStatus on c: 0 with *out its answer, a ServerStatusReply (free
 * with bbc_response_free), or the call's or the Status's error code. */
int bbt_server_status(bb_client *c, Bufbroker__Response **out);
/* The daemon's invariant check (the Check request): the number of
 * problems it found, each of its sentences printed to stderr after
 * "check: ", or the negative bbc_call / Status error. */
int bbt_check_problems(bb_client *c);
/* Poll ServerStatus until the daemon has exactly want parked waits (all
 * connections together) or timeout_ms passed: true when reached, *last (may
 * be NULL) gets the last count seen (UINT64_MAX when ServerStatus failed).
 * How a test knows that a bb_wait in another thread or process is parked,
 * rather than sleeping and hoping. */
bool bbt_waits_until(bb_client *c, uint64_t want, int timeout_ms, uint64_t *last);
/* Poll ServerStatus until buffers, tokens and waits are all 0 and
 * connections == conns; returns true when reached, *last gets the last
 * answer. */
bool bbt_totals_until_idle(bb_client *c, uint32_t conns, int timeout_ms, bbt_totals *last);

/* ---- the metrics endpoint -------------------------------------------------- */

/* The port of d's metrics endpoint (--metrics-listen 127.0.0.1:0), from
 * its last metrics_listening line (the current process's, after
 * restarts); asserts. */
int bbt_metrics_port(const bbt_daemon *d);
/* The memfds the daemon says its reuse pool keeps (open, empty, not
 * buffers): bufbroker_host_pooled_memfds, scraped from its metrics
 * endpoint on port; asserts. */
long long bbt_pooled_memfds(int port);

/* ---- raw protocol peer ---------------------------------------------------- */

/* A SOCK_SEQPACKET connection to path: the fd, or -errno. */
int bbt_raw_connect(const char *path);
/* Send these bytes as one datagram with attach_fd unless < 0: 0 or -errno. */
int bbt_raw_send_bytes(int sock, const void *buf, size_t len, int attach_fd);
/* Pack req and send it as one datagram: 0 or -errno. */
int bbt_raw_send(int sock, const Bufbroker__Request *req, int attach_fd);
/* Send Wait {id, timeout_ms} (< 0: forever) as request req_id: 0 or
 * -errno. */
int bbt_raw_wait(int sock, uint64_t req_id, uint64_t id, int32_t timeout_ms);
/* Send Stat {id} as request req_id: 0 or -errno. */
int bbt_raw_stat(int sock, uint64_t req_id, uint64_t id);
/* Wait up to timeout_ms for one datagram. 1: *out is a decoded response
 * (free with bufbroker__response__free_unpacked(*out, NULL)) and *fd_in an
 * attached fd or -1 (fd_in may be NULL: then it is closed); 0: end of
 * stream (the daemon closed the connection); -ETIMEDOUT; -EBADMSG: the
 * datagram did not decode; other -errno. */
int bbt_raw_recv(int sock, int timeout_ms, Bufbroker__Response **out, int *fd_in);
/* Hello with the given major version as request id req_id; returns the
 * response status code, or a negative errno-based BB_ERR_DISCONNECTED when
 * no response came. */
int bbt_raw_hello(int sock, uint64_t req_id, uint32_t major);
/* True when the daemon closed sock: recv gives 0 within timeout_ms. */
bool bbt_raw_closed(int sock, int timeout_ms);

/* Packed bytes of req (malloc'd; free them); *len gets the size. */
uint8_t *bbt_pack_request(const Bufbroker__Request *req, size_t *len);
/* NULL when buf does not decode as a Response. */
Bufbroker__Response *bbt_unpack_response(const void *buf, size_t len);
/* NULL when buf does not decode as a Request. */
Bufbroker__Request *bbt_unpack_request(const void *buf, size_t len);

/* ---- small things --------------------------------------------------------- */

/* Fill p with a pattern derived from seed; check it back (true: matches). */
void bbt_fill(void *p, size_t n, uint32_t seed);
bool bbt_check(const void *p, size_t n, uint32_t seed);

#endif /* BB_TEST_HARNESS_H */
