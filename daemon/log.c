/*
 * key=value log lines on stderr.
 */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static enum log_level current = LOG_INFO;
static const char *names[] = {"error", "warn", "info", "debug"};

int log_level_parse(const char *s)
{
	for (int i = 0; i < 4; i++)
		if (strcmp(s, names[i]) == 0)
			return i;
	return -1;
}

void log_set_level(enum log_level level)
{
	current = level;
}

int log_enabled(enum log_level level)
{
	return level <= current;
}

void log_msg(enum log_level level, const char *fmt, ...)
{
	if (level > current)
		return;
	char line[1024];
	int n = snprintf(line, sizeof(line), "bufbrokerd level=%s ", names[level]);
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
	va_end(ap);
	/* One write per line, so lines from a restart race never interleave. */
	fprintf(stderr, "%s\n", line);
}
