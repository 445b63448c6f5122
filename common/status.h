/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The status codes, BB_OK and the BB_ERR_* codes of bufbroker.h (the same
 * codes travel in Status.code on the wire): one table of each code's name,
 * as logs and metrics write it ("NOT_FOUND"), and its sentence ("no such
 * buffer, name or token"). bb_err_name and bb_strerror, declared in
 * bufbroker.h and exported by the library, read it; so do the daemon, the
 * CLI and, through the library, the Python binding's test of errors.py.
 */
#ifndef BB_STATUS_H
#define BB_STATUS_H

#include "bufbroker/bufbroker.h"

/* How many codes there are: they run without gaps from BB_OK (0) down to
 * -(BB_STATUS_COUNT - 1), BB_ERR_SYSTEM. A new code is a new row in
 * status.c, one more here, and a constant and class in
 * python/bufbroker/errors.py (python/tests/test_errors.py checks it). */
#define BB_STATUS_COUNT 13

#endif /* BB_STATUS_H */
