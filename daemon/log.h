/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's log: one line per event, key=value, to stderr (journald adds
 * the time and unit). Lines at a level above the configured one are dropped.
 */
#ifndef BB_LOG_H
#define BB_LOG_H

#include <stddef.h>

enum log_level { LOG_ERROR = 0, LOG_WARN = 1, LOG_INFO = 2, LOG_DEBUG = 3 };

/* Parse "error", "warn", "info" or "debug"; -1 for anything else. */
int log_level_parse(const char *s);
/* "error", "warn", "info" or "debug". */
const char *log_level_name(enum log_level level);
void log_set_level(enum log_level level);
/* Whether a line at level would be printed (to skip building it). */
int log_enabled(enum log_level level);
/* s with '"' and '\' backslash-escaped and control characters as \xHH, into
 * buf (len bytes, truncated to fit): for a value written key="%s" that may
 * hold anything (a name, an error message). Returns buf. */
const char *log_escape(const char *s, char *buf, size_t len);
/* Print "bufbrokerd level=L " followed by fmt and a newline, in one write
 * to stderr. Control characters in the line are written as \xHH, so no
 * value can start a line of its own. */
void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_debug(...)                                   \
	do {                                             \
		if (log_enabled(LOG_DEBUG))              \
			log_msg(LOG_DEBUG, __VA_ARGS__); \
	} while (0)

#endif /* BB_LOG_H */
