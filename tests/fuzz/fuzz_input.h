/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The fuzz target's input format (tests/fuzz/README.md), shared by the
 * target (fuzz_dispatch.c) and the seed generator (gen_corpus.c).
 *
 *   input  := header record*
 *   header := 1 byte: FUZZ_HDR_* bits
 *   record := ctl (1 byte) len (2 bytes, little-endian) payload (len bytes;
 *             fewer when the input ends first)
 *
 * ctl: bits 0-2 the action (FUZZ_ACT_*), bit 3 which of the two client
 * connections, bits 4-5 an argument (FUZZ_ARG), bit 6 FUZZ_CTL_HOLD, bit 7
 * FUZZ_CTL_NODRAIN.
 */
#ifndef BB_FUZZ_INPUT_H
#define BB_FUZZ_INPUT_H

/* Header: open every connection with a valid Hello already answered, so
 * that short inputs reach the ops beyond Hello. */
#define FUZZ_HDR_HELLO 0x01
/* Header: the peer class of connection 0 (bits 1-2) and of connection 1
 * (bits 3-4), FUZZ_PEER_*. */
#define FUZZ_HDR_PEER(hdr, i) (((hdr) >> (1 + 2 * (i))) & 3)
#define FUZZ_HDR_MAKE_PEER(i, peer) ((peer) << (1 + 2 * (i)))
/* Header: the daemon has an allow-list (--allow-uids) that admits
 * FUZZ_PEER_SAME_GID's uid (and, as always, root and its own uid) but not
 * FUZZ_PEER_STRANGER. */
#define FUZZ_HDR_ALLOW 0x20
/* Header: a connection stops being read while FUZZ_CONN_INFLIGHT of its
 * requests are parked (--conn-inflight); else the default, which is above
 * FUZZ_CONN_WAITS, so that the wait limit is reached instead. */
#define FUZZ_HDR_INFLIGHT 0x40
/* Header: tight settings: a FUZZ_TIGHT_QUEUE_BYTES output queue (one large
 * response overflows it) and tokens that expire after FUZZ_TIGHT_TOKEN_TTL_MS
 * (FUZZ_ACT_RUN with arg 1 lets the expiry timer fire). */
#define FUZZ_HDR_TIGHT 0x80

/* Who a connection's peer is (its SO_PEERCRED, as the daemon sees it). */
enum {
	FUZZ_PEER_SELF = 0,     /* the daemon's own uid and gid (may use Check) */
	FUZZ_PEER_SAME_GID = 1, /* another uid in the daemon's gid */
	FUZZ_PEER_STRANGER = 2, /* another uid and gid */
	FUZZ_PEER_ROOT = 3,     /* uid 0 */
};

/* Actions. */
enum {
	FUZZ_ACT_SEND = 0,       /* payload as one datagram */
	FUZZ_ACT_SEND_MEMFD = 1, /* payload with a fresh sealable memfd of FUZZ_MEMFD_SIZE(arg)
				  * bytes; arg 0: two of 4096 bytes (one fd too many) */
	FUZZ_ACT_SEND_BADFD = 2, /* payload with an fd the daemon must refuse: arg picks
				  * 0 a pipe, 1 a memfd without MFD_ALLOW_SEALING,
				  * 2 a read-only fd of a memfd, 3 a memfd with F_SEAL_WRITE */
	FUZZ_ACT_ADOPT = 3,      /* Request{id: payload[0], adopt: the last token any TakeReply
				  * carried}; arg 1 flips one bit of the token, arg 2 sets
				  * no_reply, arg 3 sends only its first 15 bytes */
	FUZZ_ACT_RECONNECT = 4,  /* close the connection (client side) and open a new one;
				  * arg bit 0: let the daemon close the old one first */
	FUZZ_ACT_HALF_CLOSE = 5, /* shutdown(SHUT_WR) on the client side */
	FUZZ_ACT_RUN = 6,        /* run the loop and drain, payload[0] % 16 + 1 times; arg 1:
				  * first wait for the next timer (a Wait's timeout, a
				  * token's expiry) if it is due within FUZZ_TIMER_WAIT_MS
				  * (once per input) */
	FUZZ_ACT_OVERSIZE = 7,   /* payload padded with zeros to max_datagram + 1 + arg bytes */
};

#define FUZZ_CTL(act, conn, arg) ((act) | ((conn) << 3) | ((arg) << 4))
#define FUZZ_CTL_ACT(ctl) ((ctl)&7)
#define FUZZ_CTL_CONN(ctl) (((ctl) >> 3) & 1)
#define FUZZ_CTL_ARG(ctl) (((ctl) >> 4) & 3)
/* Do not run the loop after this record: the next datagrams queue up
 * behind it in the daemon's socket. */
#define FUZZ_CTL_HOLD 0x40
/* Run the loop but leave the responses unread: the daemon's output backs
 * up (backpressure, then the queue limit). */
#define FUZZ_CTL_NODRAIN 0x80

/* Size of the memfd FUZZ_ACT_SEND_MEMFD attaches. */
#define FUZZ_MEMFD_SIZE(arg) \
	((arg) <= 0 ? 4096u : (arg) == 1 ? 1u : (arg) == 2 ? 4096u : (1u << 20) + 1)
/* The longest FUZZ_ACT_RUN waits for a timer. */
#define FUZZ_TIMER_WAIT_MS 3

/* The daemon's settings under fuzzing: small, so that limits, paging and
 * backpressure are reached by short inputs. */
#define FUZZ_MAX_DATAGRAM 4096
#define FUZZ_QUEUE_BYTES 16384
#define FUZZ_UID_HOST_BYTES (4u << 20)
#define FUZZ_UID_BUFFERS 48
#define FUZZ_CONNECTIONS 2
#define FUZZ_CONN_TOKENS 8
#define FUZZ_CONN_WAITS 8
#define FUZZ_CONN_INFLIGHT 4
#define FUZZ_TIGHT_QUEUE_BYTES 512
#define FUZZ_TIGHT_TOKEN_TTL_MS 2

#endif /* BB_FUZZ_INPUT_H */
