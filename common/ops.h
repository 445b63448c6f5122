/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The ops a Request carries: the fields of its `op` oneof, named as
 * proto/bufbroker.proto spells them ("alloc", "import_fd", ...). The names
 * are protobuf-c's descriptor's, so an op added to the schema names itself
 * in the daemon's logs (op=...) and metrics (op label).
 */
#ifndef BB_OPS_H
#define BB_OPS_H

/* The name of the op whose Request.op_case is op, its field's name in the
 * schema: "alloc" for BUFBROKER__REQUEST__OP_ALLOC. "unknown" for 0 (no op
 * set) and for any number that is not a field of the op oneof. Static
 * storage; safe from any thread. */
const char *bb_op_name(int op);

#endif /* BB_OPS_H */
