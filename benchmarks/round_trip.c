// Microseconds per call of one syscall in a loop, for round_trip.sh:
//   round_trip fstat|getxattr PATH CALLS
// fstat: of an open file (one GETATTR with caches off); getxattr: of
// security.selinux by path (a LOOKUP with caches off, and a GETXATTR).
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: round_trip fstat|getxattr PATH CALLS\n");
        return 64;
    }
    const char *what = argv[1], *path = argv[2];
    int calls = atoi(argv[3]);
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        perror(path);
        return 1;
    }
    char value[256];
    struct stat st;
    int getattr = strcmp(what, "fstat") == 0;
    double start = now_us();
    for (int i = 0; i < calls; i++) {
        if (getattr) fstat(fd, &st);
        else lgetxattr(path, "security.selinux", value, sizeof value);
    }
    printf("%.2f\n", (now_us() - start) / calls);
    return 0;
}
