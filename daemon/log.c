/* SPDX-License-Identifier: Apache-2.0 */
/*
 * key=value log lines on stderr.
 */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static enum log_level current = LOG_INFO;
static const char *names[] = {"error", "warn", "info", "debug"};

int log_level_parse(const char *s)
{
	for (int i = 0; i < 4; i++)
		if (strcmp(s, names[i]) == 0)
			return i;
	return -1;
}

const char *log_level_name(enum log_level level)
{
	return level <= LOG_DEBUG ? names[level] : "?";
}

void log_set_level(enum log_level level)
{
	current = level;
}

int log_enabled(enum log_level level)
{
	return level <= current;
}

const char *log_escape(const char *s, char *buf, size_t len)
{
	static const char hex[] = "0123456789abcdef";
	size_t o = 0;
	if (!len)
		return buf;
	for (; *s && o + 1 < len; s++) {
		unsigned char ch = (unsigned char)*s;
		char esc[4];
		size_t n = 0;
		if (ch == '"' || ch == '\\') {
			esc[n++] = '\\';
			esc[n++] = (char)ch;
		} else if (ch < 0x20 || ch == 0x7f) {
			esc[n++] = '\\';
			esc[n++] = 'x';
			esc[n++] = hex[ch >> 4];
			esc[n++] = hex[ch & 15];
		} else {
			esc[n++] = (char)ch;
		}
		if (o + n + 1 > len)
			break;
		memcpy(buf + o, esc, n);
		o += n;
	}
	buf[o] = '\0';
	return buf;
}

void log_msg(enum log_level level, const char *fmt, ...)
{
	if (level > current)
		return;
	char body[1024], line[1200];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(body, sizeof(body), fmt, ap);
	va_end(ap);
	/* A value a client chose (a name, a message) must not start a line of
	 * its own: control characters are written as \xHH. */
	size_t o = (size_t)snprintf(line, sizeof(line), "bufbrokerd level=%s ", names[level]);
	for (const char *p = body; *p && o + 5 < sizeof(line); p++) {
		unsigned char ch = (unsigned char)*p;
		if (ch < 0x20 || ch == 0x7f)
			o += (size_t)snprintf(line + o, sizeof(line) - o, "\\x%02x", ch);
		else
			line[o++] = (char)ch;
	}
	line[o++] = '\n';
	/* One write per line, so lines from a restart race never interleave. */
	int saved = errno;
	ssize_t w;
	do
		w = write(STDERR_FILENO, line, o);
	while (w < 0 && errno == EINTR);
	errno = saved;
}
