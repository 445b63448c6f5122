/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bb-producer: make a buffer, fill it, and hand it to another process.
 *
 *   bb-producer [--socket PATH] [--name NAME] [--size BYTES] [--pattern BYTE]
 *
 * Allocates a named host buffer through bufbrokerd, fills it with a pattern
 * bb-consumer can check, and prints a token (32 hex digits) on stdout. The
 * token holds a reference of its own, so the buffer outlives this process
 * until a consumer adopts the token or the daemon's token TTL passes:
 *
 *   tok=$(bb-producer) && bb-consumer "$tok"
 *
 * Build against the installed library with
 *   cc producer.c $(pkg-config --cflags --libs bufbroker)
 */
#include <bufbroker/bufbroker.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>

/* Byte i of the buffer; bb-consumer computes the same function. */
static unsigned char pattern_byte(size_t i, unsigned pattern)
{
	return (unsigned char)((i * 31 + pattern) & 0xff);
}

static unsigned long long parse_number(const char *what, const char *text, unsigned long long max)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(text, &end, 0);
	if (errno || end == text || *end || *text == '-' || v > max) {
		fprintf(stderr, "bb-producer: bad %s '%s'\n", what, text);
		exit(2);
	}
	return v;
}

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{"socket", required_argument, NULL, 's'},
		{"name", required_argument, NULL, 'n'},
		{"size", required_argument, NULL, 'z'},
		{"pattern", required_argument, NULL, 'p'},
		{NULL, 0, NULL, 0},
	};
	const char *socket = NULL; /* NULL: $BUFBROKER_SOCKET or the default */
	const char *name = "example";
	size_t size = 1 << 20;
	unsigned pattern = 0;
	bb_client *client = NULL;
	bb_buf *buf = NULL;
	bb_alloc_opts opts;
	bb_token token;
	char text[2 * BB_TOKEN_SIZE + 1];
	void *mem;
	unsigned char *p;
	const char *step; /* what failed, for the message */
	int opt, err;

	while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (opt) {
		case 's': socket = optarg; break;
		case 'n': name = optarg; break;
		case 'z': size = parse_number("size", optarg, SIZE_MAX); break;
		case 'p': pattern = (unsigned)parse_number("pattern", optarg, 255); break;
		default:
			fprintf(stderr, "usage: bb-producer [--socket PATH] [--name NAME] "
					"[--size BYTES] [--pattern BYTE]\n");
			return 2;
		}
	}

	/* One connection to the daemon. Everything it holds is released when
	 * it closes, except what we put into tokens. */
	step = "connect";
	err = bb_connect(socket, &client);
	if (err)
		goto fail;

	/* A new PENDING host buffer that only our uid may open by name. */
	opts = (bb_alloc_opts){
		.size = size,
		.kind = BB_HOST,
		.device = 0,
		.name = name,
		.share = BB_SHARE_UID,
	};
	step = "alloc";
	err = bb_alloc(client, &opts, &buf);
	if (err)
		goto fail;

	/* Host buffers map straight into this process: write as to any memory. */
	step = "map";
	err = bb_map(buf, &mem);
	if (err)
		goto fail;
	p = mem;
	for (size_t i = 0; i < size; i++)
		p[i] = pattern_byte(i, pattern);

	/* bb_take gives one local count away to the token. Take an extra one
	 * first so that our handle stays valid for bb_set_ready below; the
	 * token then holds a daemon reference of its own. */
	step = "take";
	err = bb_take(bb_ref(buf), &token);
	if (err) {
		bb_unref(buf); /* the extra count bb_take did not take */
		goto fail;
	}
	bb_token_format(&token, text);
	printf("%s\n", text);
	fflush(stdout); /* the reader may be waiting on a pipe */

	/* A consumer may adopt the token already; its bb_wait returns once the
	 * buffer is READY. (On a failure, bb_set_error would tell it why.) */
	step = "set_ready";
	err = bb_set_ready(buf);
	if (err)
		goto fail;

	/* Our own reference goes; the token's keeps the buffer alive. */
	bb_unref(buf);
	bb_disconnect(client);
	return 0;

fail:
	fprintf(stderr, "bb-producer: %s: %s\n", step,
		*bb_last_error() ? bb_last_error() : bb_strerror(err));
	bb_unref(buf);         /* NULL is fine */
	bb_disconnect(client); /* so is this */
	return 1;
}
