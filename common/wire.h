/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Constants both ends of the wire agree on.
 */
#ifndef BB_WIRE_H
#define BB_WIRE_H

#define BB_PROTO_MAJOR 1
#define BB_PROTO_MINOR 3

/* Largest datagram either side sends or accepts by default (bytes). */
#define BB_MAX_DATAGRAM (64 * 1024)

/* The system socket, and the per-user one under $XDG_RUNTIME_DIR. */
#define BB_SYSTEM_SOCKET "/run/bufbroker/bufbroker.sock"
#define BB_USER_SOCKET_NAME "bufbroker.sock"

#endif /* BB_WIRE_H */
