/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Replay saved inputs through the fuzz target without libFuzzer (any
 * compiler): every file named, and every file in every directory named
 * (in name order; names starting with '.' and *.md files are skipped).
 * An input that breaks a rule aborts, naming itself first. Fails, too,
 * when there was nothing to replay: a misplaced corpus must not pass.
 *
 * Usage: fuzz_dispatch_replay FILE_OR_DIR...
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		perror(path);
		return -1;
	}
	size_t cap = 4096, len = 0, n;
	unsigned char *buf = malloc(cap);
	while (buf && (n = fread(buf + len, 1, cap - len, f)) > 0) {
		len += n;
		if (len == cap) {
			unsigned char *more = realloc(buf, cap * 2);
			if (!more) {
				free(buf);
				buf = NULL;
				break;
			}
			buf = more;
			cap *= 2;
		}
	}
	int err = ferror(f) || !buf;
	fclose(f);
	if (err) {
		fprintf(stderr, "%s: could not read it\n", path);
		free(buf);
		return -1;
	}
	fprintf(stderr, "replay %s (%zu bytes)\n", path, len);
	LLVMFuzzerTestOneInput(buf, len);
	free(buf);
	return 0;
}

static int skipped(const char *name)
{
	size_t n = strlen(name);
	return name[0] == '.' || (n > 3 && strcmp(name + n - 3, ".md") == 0);
}

int main(int argc, char **argv)
{
	size_t replayed = 0;
	int failed = 0;
	for (int i = 1; i < argc; i++) {
		struct stat st;
		if (stat(argv[i], &st) < 0) {
			perror(argv[i]);
			failed = 1;
			continue;
		}
		if (!S_ISDIR(st.st_mode)) {
			if (replay_file(argv[i]) < 0)
				failed = 1;
			else
				replayed++;
			continue;
		}
		struct dirent **ents;
		int n = scandir(argv[i], &ents, NULL, alphasort);
		if (n < 0) {
			perror(argv[i]);
			failed = 1;
			continue;
		}
		for (int k = 0; k < n; k++) {
			char path[4096];
			snprintf(path, sizeof(path), "%s/%s", argv[i], ents[k]->d_name);
			struct stat fst;
			if (!skipped(ents[k]->d_name) && stat(path, &fst) == 0 &&
			    S_ISREG(fst.st_mode)) {
				if (replay_file(path) < 0)
					failed = 1;
				else
					replayed++;
			}
			free(ents[k]);
		}
		free(ents);
	}
	if (replayed == 0) {
		fprintf(stderr, "fuzz_dispatch_replay: no input to replay\n");
		return 1;
	}
	printf("fuzz_dispatch_replay: %zu inputs replayed%s\n", replayed,
	       failed ? ", some could not be read" : ", every rule held");
	return failed;
}
