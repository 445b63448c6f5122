/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The buffer kinds (bb_kind): how many there are and what logs, metrics,
 * messages and the CLI call them. The wire's Kind enum has the same values
 * (kinds.c checks it when it compiles), so a Kind from a message is a
 * bb_kind here.
 */
#ifndef BB_KINDS_H
#define BB_KINDS_H

#include <stdbool.h>

/* How many kinds there are. They are numbered 1 .. BB_KIND_COUNT (BB_HOST,
 * BB_CUDA) with no gaps; 0 is no kind (the wire's KIND_UNSPECIFIED). Arrays
 * indexed by kind have BB_KIND_COUNT + 1 entries, or BB_KIND_COUNT indexed
 * by kind - 1. */
#define BB_KIND_COUNT 2

/* Whether kind is one of the kinds. */
bool bb_kind_valid(int kind);
/* The name of kind: "host" for BB_HOST, "cuda" for BB_CUDA; "unknown" for
 * anything else. Static storage. */
const char *bb_kind_name(int kind);
/* The kind whose bb_kind_name is name (exactly: "host", not "HOST"); 0 for
 * any other string and for NULL. */
int bb_kind_parse(const char *name);

#endif /* BB_KINDS_H */
