/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The library's raw request path, for the admin CLI and tests that speak
 * the wire protocol through an established bb_client. Not installed, and
 * not exported by libbufbroker.so (which exports bb_* only): a program
 * that calls these links the static library (bufbroker_static).
 */
#ifndef BB_CLIENT_INTERNAL_H
#define BB_CLIENT_INTERNAL_H

#include "bufbroker.pb-c.h"
#include "bufbroker/bufbroker.h"

/* Send req (its id is assigned here) with fd attached unless fd < 0, and
 * wait for the matching response. 0: *resp is set (free it with
 * bbc_response_free) and *fd_in gets an attached fd or -1 (the caller
 * closes it; fd_in may be NULL, then it is closed here). Otherwise
 * BB_ERR_DISCONNECTED / BB_ERR_PROTOCOL, with bb_last_error set. The
 * response's Status is not interpreted. */
int bbc_call(bb_client *c, Bufbroker__Request *req, int fd, Bufbroker__Response **resp, int *fd_in);
void bbc_response_free(Bufbroker__Response *r);

/* The socket bb_connect(NULL, ...) uses: $BUFBROKER_SOCKET, else
 * $XDG_RUNTIME_DIR/bufbroker.sock when it exists and the caller is not root,
 * else the system socket. Written into buf (len bytes) when it is built. */
const char *bbc_default_socket(char *buf, size_t len);

/* Record a failure for bb_last_error() on this thread; returns code. */
int bbc_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif /* BB_CLIENT_INTERNAL_H */
