#ifndef FERRY_CSYSCALL_SHIM_H
#define FERRY_CSYSCALL_SHIM_H
#include <linux/futex.h>
#include <malloc.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* System calls Swift cannot make itself: syscall() and prctl() are variadic, and Glibc's module has neither
   sys/eventfd.h (ThreadExecutor's wake-up while it polls a watched descriptor) nor malloc.h (mallopt). */

/* The kernel's futex, for ThreadExecutor's sleep: a thread woken from pthread_cond_wait takes its mutex back
   marked "contended" (glibc), so its next unlock is one more system call (FUTEX_WAKE) although nobody waits:
   measured with perf in the test bed, one extra system call per notification of a sync session. */

/* Sleeps while *word == expected, until woken, or until `deadline` (absolute, CLOCK_MONOTONIC; NULL: none).
   Returns 0 when woken, else -1 with errno: ETIMEDOUT, EAGAIN (*word had already changed) or EINTR. */
static inline int ferry_futex_wait(uint32_t *word, uint32_t expected, const struct timespec *deadline) {
    /* FUTEX_WAIT_BITSET's timeout is absolute, on CLOCK_MONOTONIC unless FUTEX_CLOCK_REALTIME is given. */
    return (int)syscall(SYS_futex, word, FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, expected, deadline, NULL,
                        FUTEX_BITSET_MATCH_ANY);
}

/* Wakes one thread sleeping on `word`. */
static inline void ferry_futex_wake_one(uint32_t *word) {
    (void)syscall(SYS_futex, word, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, 1, NULL, NULL, 0);
}

/* Opts this process (and what it would start) out of transparent huge pages. Where the kernel backs anonymous
   memory with 2 MiB pages ("always", Debian's default), the first touch of every thread's stack allocates and
   zeroes a whole 2 MiB page (pthread_create writes the thread's descriptor there). Ferry's few threads and small
   heap gain nothing from huge pages and paid ~2 MB of RSS for them (measured in the test bed, for `ferry sync`
   and for a daemon with five sessions). Returns 0, or -1 with errno. */
static inline int ferry_disable_transparent_huge_pages(void) {
    return prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
}

/* One malloc arena for every thread. glibc gives threads arenas of their own and grows a thread's arena by one
   mprotect() per page as its heap grows (only the main arena's growth is padded, 128 KiB per brk): ~80 system calls
   on a window-20 sync session's thread as SQLite's page cache filled (strace in the test bed), each one changing the
   process's mappings under every thread. The main arena grows a few times instead; small allocations still come
   from each thread's own cache without the arena's lock, and fewer arenas hold less memory half-used. Returns 1 on
   success (mallopt). */
static inline int ferry_use_one_malloc_arena(void) {
    return mallopt(M_ARENA_MAX, 1);
}
#endif
