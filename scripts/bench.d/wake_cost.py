#!/usr/bin/env python3
"""What a process pays, in CPU, to wake from a sleep and run a piece of code, against the same piece run without
pause. A diagnostic for the test bed's guest (Hardware/TESTBED.md, "work that follows a sleep"), not a benchmark of
Ferry. Run it inside the guest:

    scripts/testbed run --peripherals 1 --events 10 --peripherals-on host -- python3 scripts/bench.d/wake_cost.py

It builds a C program whose code is F distinct small functions (one basic block each) and runs it with a child that
writes one byte to a pipe every P microseconds (0: without pause); each byte, the parent calls the F functions and
reads one byte of each of N pages of its memory, then waits for the next byte. It prints one JSON line per run:
the parent's CPU (getrusage) per step, after one warm-up pass."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

FUNCTIONS = 4000
STEPS = 200
PERIODS_US = (0, 5000, 15000)
FOOTPRINTS = ((0, 0), (0, 1000), (0, 4000), (400, 4000))  # (pages, functions)

MAIN = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
typedef uint64_t (*fn)(uint64_t);
extern fn table[];
static double cpu(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}
int main(int argc, char **argv) {
    int steps = atoi(argv[1]), period_us = atoi(argv[2]), pages = atoi(argv[3]), funcs = atoi(argv[4]);
    int p[2];
    if (pipe(p) != 0) return 1;
    pid_t feeder = fork();
    if (feeder == 0) {
        close(p[0]);
        for (int i = 0; i < steps; i++) {
            if (period_us) {
                struct timespec ts = {period_us / 1000000, (period_us % 1000000) * 1000L};
                nanosleep(&ts, 0);
            }
            if (write(p[1], "x", 1) != 1) _exit(1);
        }
        _exit(0);
    }
    close(p[1]);
    size_t bytes = (size_t)(pages ? pages : 1) * 4096;
    volatile char *mem = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    memset((char *)mem, 1, bytes);
    uint64_t acc = 1;
    for (int j = 0; j < funcs; j++) acc = table[j](acc);
    for (int k = 0; k < pages; k++) acc += mem[k * 4096];
    double t0 = cpu();
    int n = 0;
    char c;
    while (read(p[0], &c, 1) == 1) {
        for (int j = 0; j < funcs; j++) acc = table[j](acc);
        for (int k = 0; k < pages; k++) acc += mem[k * 4096];
        n++;
    }
    double t1 = cpu();
    waitpid(feeder, 0, 0);
    printf("{\"period_us\":%d,\"pages\":%d,\"functions\":%d,\"steps\":%d,\"cpu_us_per_step\":%.1f,\"sink\":%d}\n",
           period_us, pages, funcs, n, (t1 - t0) / n * 1e6, (int)(acc & 1));
    return 0;
}
"""


def functions_source() -> str:
    lines = ["#include <stdint.h>"]
    for i in range(FUNCTIONS):
        lines.append(f"__attribute__((noinline)) uint64_t f{i}(uint64_t x) {{ x ^= x >> {i % 31 + 1}; "
                     f"x *= {2 * i + 1}ULL; return (x & {1 << (i % 13)}) ? x + {i} : x - {3 * i}; }}")
    lines.append("typedef uint64_t (*fn)(uint64_t);")
    lines.append("fn table[] = {" + ", ".join(f"f{i}" for i in range(FUNCTIONS)) + "};")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1:
        if sys.argv[1] in ("-h", "--help"):
            print(__doc__)
            return 0
        print(f"wake_cost.py takes no arguments (got {sys.argv[1]!r}); see --help", file=sys.stderr)
        return 2
    if shutil.which("cc") is None:
        print("wake_cost.py: needs a C compiler as cc (apt-get install gcc)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as work:
        for name, text in (("main.c", MAIN), ("functions.c", functions_source())):
            with open(os.path.join(work, name), "w") as f:
                f.write(text)
        binary = os.path.join(work, "wake_cost")
        subprocess.run(["cc", "-O1", "-o", binary, os.path.join(work, "main.c"), os.path.join(work, "functions.c")],
                       check=True)
        for pages, functions in FOOTPRINTS:
            for period in PERIODS_US:
                out = subprocess.run([binary, str(STEPS), str(period), str(pages), str(functions)],
                                     check=True, capture_output=True, text=True).stdout
                row = json.loads(out)
                del row["sink"]
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
