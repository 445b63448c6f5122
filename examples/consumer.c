/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bb-consumer: receive a buffer from another process and check its bytes.
 *
 *   bb-consumer [--socket PATH] [--size BYTES] [--pattern BYTE]
 *               [--timeout-ms N] (TOKEN | --name NAME)
 *
 * Adopts the token bb-producer printed (or opens the buffer by name), waits
 * until the producer has set it READY, and verifies every byte against the
 * producer's pattern. --size, when given, is the size the buffer must have.
 * Exits 0 when every byte matches, 1 otherwise.
 *
 * Build against the installed library with
 *   cc consumer.c $(pkg-config --cflags --libs bufbroker)
 */
#include <bufbroker/bufbroker.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

/* Byte i of the buffer, exactly as bb-producer wrote it. */
static unsigned char pattern_byte(size_t i, unsigned pattern)
{
	return (unsigned char)((i * 31 + pattern) & 0xff);
}

static long long parse_number(const char *what, const char *text, long long min, long long max)
{
	char *end;
	long long v;

	errno = 0;
	v = strtoll(text, &end, 0);
	if (errno || end == text || *end || v < min || v > max) {
		fprintf(stderr, "bb-consumer: bad %s '%s'\n", what, text);
		exit(2);
	}
	return v;
}

static void usage(void)
{
	fprintf(stderr, "usage: bb-consumer [--socket PATH] [--size BYTES] [--pattern BYTE]\n"
			"                   [--timeout-ms N] (TOKEN | --name NAME)\n");
	exit(2);
}

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{"socket", required_argument, NULL, 's'},
		{"name", required_argument, NULL, 'n'},
		{"size", required_argument, NULL, 'z'},
		{"pattern", required_argument, NULL, 'p'},
		{"timeout-ms", required_argument, NULL, 't'},
		{NULL, 0, NULL, 0},
	};
	const char *socket = NULL; /* NULL: $BUFBROKER_SOCKET or the default */
	const char *name = NULL;
	const char *token_text = NULL;
	long long want_size = -1; /* -1: whatever size the buffer has */
	unsigned pattern = 0;
	int timeout_ms = 10000;
	bb_client *client = NULL;
	bb_buf *buf = NULL;
	bb_token token;
	bb_state state;
	bb_info info;
	const unsigned char *p;
	void *mem;
	size_t size;
	const char *step; /* what failed, for the message */
	int opt, err, rc = 1;

	while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (opt) {
		case 's': socket = optarg; break;
		case 'n': name = optarg; break;
		case 'z': want_size = parse_number("size", optarg, 1, LLONG_MAX); break;
		case 'p': pattern = (unsigned)parse_number("pattern", optarg, 0, 255); break;
		case 't':
			timeout_ms = (int)parse_number("timeout", optarg, INT_MIN, INT_MAX);
			break;
		default: usage();
		}
	}
	if (optind < argc)
		token_text = argv[optind++];
	if (optind < argc || !token_text == !name) /* exactly one of the two */
		usage();
	/* A token travels as 32 hex digits; check it before connecting. */
	if (token_text && bb_token_parse(token_text, &token) != 0) {
		fprintf(stderr, "bb-consumer: '%s' is not a token (32 hex digits)\n", token_text);
		return 2;
	}

	step = "connect";
	err = bb_connect(socket, &client);
	if (err)
		goto fail;

	/* Either way we now hold one reference. A token can be adopted once,
	 * by anyone who has it; a name opens only if the share policy admits us. */
	if (token_text) {
		step = "adopt";
		err = bb_adopt(client, &token, &buf);
	} else {
		step = "open";
		err = bb_open_name(client, name, &buf);
	}
	if (err)
		goto fail;

	/* The producer may still be filling it. */
	step = "wait";
	err = bb_wait(buf, timeout_ms, &state);
	if (err)
		goto fail;

	/* Fresh from the daemon: the buffer's name, and the producer's error. */
	step = "stat";
	err = bb_stat(client, bb_id(buf), &info);
	if (err)
		goto fail;
	if (state == BB_FAILED) {
		fprintf(stderr, "bb-consumer: the producer failed buffer %" PRIu64 ": %s\n",
			info.id, info.error);
		goto out;
	}
	if (bb_buf_kind(buf) != BB_HOST) {
		fprintf(stderr, "bb-consumer: buffer %" PRIu64 " is not a host buffer\n", info.id);
		goto out;
	}

	size = bb_size(buf);
	if (want_size >= 0 && (unsigned long long)want_size != size) {
		fprintf(stderr, "bb-consumer: buffer %" PRIu64 " has %zu bytes, expected %lld\n",
			info.id, size, want_size);
		goto out;
	}

	step = "map";
	err = bb_map(buf, &mem);
	if (err)
		goto fail;
	p = mem;
	for (size_t i = 0; i < size; i++) {
		if (p[i] != pattern_byte(i, pattern)) {
			fprintf(stderr,
				"bb-consumer: mismatch at offset %zu: got 0x%02x, expected 0x%02x\n",
				i, p[i], pattern_byte(i, pattern));
			goto out;
		}
	}

	printf("consumer: verified %zu bytes of buffer %" PRIu64 "%s%s%s\n", size, info.id,
	       *info.name ? " (" : "", info.name, *info.name ? ")" : "");
	rc = 0;
	goto out;

fail:
	fprintf(stderr, "bb-consumer: %s: %s\n", step,
		*bb_last_error() ? bb_last_error() : bb_strerror(err));
out:
	/* Our reference goes; the buffer is freed once no one else holds it. */
	bb_unref(buf);
	bb_disconnect(client);
	return rc;
}
