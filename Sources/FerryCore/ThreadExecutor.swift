import CSyscall

#if canImport(Glibc)
    import Glibc
#endif

/// A serial executor with a thread of its own, for work that blocks: one SQLite connection (GRDB confines each
/// connection to a serial queue; this is that, for Swift concurrency), or a test's fake peripheral side. sqlite3
/// calls block — an fsync per commit under `synchronous = FULL`, up to 5 s in the busy handler, a long prune — and
/// a blocked thread of the cooperative pool (one per core: two on a small Pi) stalls every task of the process. An
/// actor whose `unownedExecutor` is this one runs all its methods here instead; a task that prefers it as its task
/// executor (`withTaskExecutorPreference`) runs its nonisolated code here (a sync session, with its store).
///
/// It also keeps one timer for the work confined to it (`setTimer`: a live session's next deadline), waited for in
/// the same sleep as the jobs, and can watch one descriptor (`watch`: a live session's notification socket), read
/// on this thread when it is readable instead of by a thread of its own that would wake this one for every read.
///
/// The two roles are two executor objects on one queue: a job an actor enqueues runs isolated to the serial one;
/// a job of a task that prefers the thread runs on the task executor, not isolated to anything. Running the
/// latter as isolated made every nonisolated async call it made a hop (a job enqueued and run again here): some
/// thirty per acknowledged window of a session.
public final class ThreadExecutor: TaskExecutor, @unchecked Sendable {
    // Guarded by `mutex` (pthread, not Synchronization.Mutex: ThreadSanitizer sees these handoffs).
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>
    /// The thread sleeps on this futex word (not a condition variable: see CSyscall). Changed only under `mutex`,
    /// by whoever wakes the thread; the kernel compares it as the thread goes to sleep, so a wake between the
    /// unlock and the sleep is not lost.
    private let wakeWord: UnsafeMutablePointer<UInt32>
    /// The thread is asleep (or about to be) on `wakeWord`: work handed to it must wake it.
    private var sleeping = false
    /// `isolated`: enqueued by an actor through `serialExecutor`.
    private var jobs: [(job: UnownedJob, isolated: Bool)] = []
    /// The thread as an actor's executor (`asUnownedSerialExecutor()`).
    private let serialExecutor = Serial()
    private var stopping = false
    /// The thread has ended (stopped, nothing left): later jobs go to the global executor (below).
    private var exited = false
    private var threadID: pthread_t?
    /// `setTimer`'s: when (CLOCK_MONOTONIC nanoseconds) and what; `generation` tells a replaced timer from the one
    /// waited for.
    private var timer: (deadline: Int64, generation: UInt64, action: @Sendable () -> Void)?
    private var timerGeneration: UInt64 = 0
    /// `watch`'s descriptor and handler; `generation` tells a replaced watch from the one polled.
    private var watched: (fd: Int32, generation: UInt64, handler: @Sendable () -> Bool)?
    private var watchGeneration: UInt64 = 0
    /// Closures to run on the thread between jobs (`endWatch`'s clean-up).
    private var calls: [@Sendable () -> Void] = []
    /// While a descriptor is watched the thread sleeps in poll(), which cannot wait on the futex word: work handed
    /// to it writes this eventfd instead. Created at the first watch.
    private var pollWake: Int32 = -1
    private var sleepingInPoll = false
    /// When the watched descriptor was last polled (coarse CLOCK_MONOTONIC ns): a thread kept busy by jobs still
    /// looks at it every `watchCheckInterval`.
    private var lastWatchCheck: Int64 = 0
    private static let watchCheckInterval: Int64 = 10_000_000
    /// How long the thread waits before polling again after poll() failed with something other than EINTR (ns).
    private static let pollFailurePause = 10_000_000

    /// The serial role: enqueues on the same thread, marked isolated. Unowned back-reference: the thread owns it.
    private final class Serial: SerialExecutor, @unchecked Sendable {
        unowned(unsafe) var thread: ThreadExecutor?
        func enqueue(_ job: consuming ExecutorJob) { thread!.push(UnownedJob(job), isolated: true) }
    }

    /// Starts the thread; `name` shows in `top -H` / /proc (at most 15 bytes are kept).
    public init(name: String) {
        mutex = .allocate(capacity: 1)
        mutex.initialize(to: pthread_mutex_t())
        pthread_mutex_init(mutex, nil)
        wakeWord = .allocate(capacity: 1)
        wakeWord.initialize(to: 0)
        serialExecutor.thread = self
        // Without its thread, jobs go to the global executor as after `stop()`: blocking there, but never lost.
        if !startThread(name: name, { [self] in run() }) { exited = true }
    }

    deinit {
        if pollWake >= 0 { _ = close(pollWake) }
        wakeWord.deallocate()
        pthread_mutex_destroy(mutex)
        mutex.deinitialize(count: 1)
        mutex.deallocate()
    }

    public func enqueue(_ job: consuming ExecutorJob) {
        push(UnownedJob(job), isolated: false)
    }

    private func push(_ job: UnownedJob, isolated: Bool) {
        pthread_mutex_lock(mutex)
        if exited {
            // A task that preferred this executor outlived it: it must still run, or it would be lost with
            // everything it holds. Only nonisolated work can come here: an actor on this executor stops it from
            // its deinit, when no job of its can be pending.
            pthread_mutex_unlock(mutex)
            globalConcurrentExecutor.enqueue(job)
            return
        }
        jobs.append((job, isolated))
        unlockWakingTheThread()
    }

    /// Releases `mutex` (held by the caller, who just handed the thread something) and wakes the thread if it
    /// sleeps: the word is changed under the mutex, so a sleep about to begin returns at once, and the wake comes
    /// after the unlock, so the thread does not wake into a held mutex.
    private func unlockWakingTheThread() {
        let wake = sleeping
        let inPoll = sleepingInPoll
        if wake {
            sleeping = false
            sleepingInPoll = false
            wakeWord.pointee &+= 1
        }
        let pollWake = self.pollWake
        pthread_mutex_unlock(mutex)
        guard wake else { return }
        if inPoll {
            // The counter stays set until the thread reads it: a write before its poll() begins is not lost.
            var one: UInt64 = 1
            _ = write(pollWake, &one, 8)
        } else {
            ferry_futex_wake_one(wakeWord)
        }
    }

    /// For an actor that keeps its state on this thread (`unownedExecutor`).
    public func asUnownedSerialExecutor() -> UnownedSerialExecutor {
        UnownedSerialExecutor(ordinary: serialExecutor)
    }

    /// True on this executor's thread (tests; assertions).
    public var isCurrent: Bool {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return threadID.map { pthread_equal($0, pthread_self()) != 0 } ?? false
    }

    /// The thread ends once the jobs queued so far have run (the owner is going away).
    public func stop() {
        pthread_mutex_lock(mutex)
        stopping = true
        unlockWakingTheThread()
    }

    /// Runs `action` on this thread, between jobs, once `delay` seconds have passed (CLOCK_MONOTONIC); replaces
    /// the timer set before, and nil `delay` cancels it. A live session arms its next deadline here: waiting in the
    /// thread's own sleep wakes no other thread, where a sleeping task's timer goes through the global
    /// executor's timer thread and a pool thread every time it is armed, cancelled or fired.
    public func setTimer(after delay: Double?, _ action: @escaping @Sendable () -> Void = {}) {
        let deadline = delay.map { monotonicDeadline(afterSeconds: $0) }
        pthread_mutex_lock(mutex)
        timerGeneration &+= 1
        timer = deadline.map { ($0, timerGeneration, action) }
        // Wakes the thread only if it sleeps: from its own thread, the next sleep picks the timer up.
        unlockWakingTheThread()
    }

    /// From now on the thread also waits for `fd` to be readable (or hung up) and then calls `handler` on this
    /// thread, between jobs; even a thread kept busy by jobs polls it every 10 ms. The watch ends when `handler`
    /// returns false or at `endWatch`; a new watch replaces the one before. The caller keeps owning `fd`: it must
    /// stay open until the watch has ended (close it in `endWatch`'s `then`). Returns the watch's token, or nil
    /// when the thread has ended or cannot poll (no eventfd): the caller reads the descriptor some other way.
    public func watch(_ fd: Int32, _ handler: @escaping @Sendable () -> Bool) -> UInt64? {
        pthread_mutex_lock(mutex)
        if pollWake < 0 { pollWake = eventfd(0, Int32(EFD_CLOEXEC | EFD_NONBLOCK)) }
        guard !exited, !stopping, pollWake >= 0 else {
            pthread_mutex_unlock(mutex)
            return nil
        }
        watchGeneration &+= 1
        watched = (fd, watchGeneration, handler)
        let token = watchGeneration
        // A thread asleep on the futex must start polling the descriptor.
        unlockWakingTheThread()
        return token
    }

    /// Ends the watch `token` (if it is still the current one) and runs `then` on the thread after any handler
    /// call in progress, or here if the thread has ended: from `then` on, the thread no longer touches the
    /// descriptor, so `then` may close it.
    public func endWatch(_ token: UInt64, then: @escaping @Sendable () -> Void) {
        pthread_mutex_lock(mutex)
        if watched?.generation == token { watched = nil }
        if exited {
            pthread_mutex_unlock(mutex)
            then()
            return
        }
        calls.append(then)
        unlockWakingTheThread()
    }

    /// poll() on the watched descriptor and the wake-up eventfd, until `deadline` (CLOCK_MONOTONIC ns; nil: none)
    /// or not at all (`wait` false: a look without waiting). Called without `mutex`. Returns whether `fd` is
    /// readable, and whether the wait ran out (then `deadline` has passed).
    private func pollWatched(_ fd: Int32, until deadline: Int64?, wait: Bool) -> (readable: Bool, timedOut: Bool) {
        var timeout: Int32 = -1
        if !wait {
            timeout = 0
        } else if let deadline {
            // From the coarse clock, which is behind if anything, and rounded up: the wait ends at the deadline or
            // a few ms after it, never before.
            let remaining = max(0, deadline - coarseMonotonicNanoseconds())
            timeout = Int32(min((remaining + 999_999) / 1_000_000, Int64(Int32.max)))
        }
        var fds = (
            pollfd(fd: pollWake, events: Int16(POLLIN), revents: 0), pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        )
        let ready = withUnsafeMutableBytes(of: &fds) {
            poll($0.baseAddress?.assumingMemoryBound(to: pollfd.self), 2, timeout)
        }
        if ready > 0, fds.0.revents != 0 {
            var count: UInt64 = 0
            _ = read(pollWake, &count, 8)
        } else if ready < 0, errno != EINTR {
            // poll() refusing for another reason (ENOMEM) would likely refuse again at once: without a pause the
            // thread would spin a core until it recovered. Jobs, calls and timers are still run between tries.
            var pause = timespec(tv_sec: 0, tv_nsec: Self.pollFailurePause)
            _ = nanosleep(&pause, nil)
        }
        return (ready > 0 && fds.1.revents != 0, ready == 0 && wait && deadline != nil)
    }

    private func run() {
        pthread_mutex_lock(mutex)
        threadID = pthread_self()
        pthread_mutex_unlock(mutex)
        while true {
            pthread_mutex_lock(mutex)
            var fired: (@Sendable () -> Void)?
            if !jobs.isEmpty, let t = timer, coarseMonotonicNanoseconds() >= t.deadline {
                // Busy with jobs: a due timer still runs after this batch, not only once the queue runs dry.
                fired = t.action
                timer = nil
            }
            var readable: (generation: UInt64, handler: @Sendable () -> Bool)?
            if !jobs.isEmpty, let w = watched, case let now = coarseMonotonicNanoseconds(),
                now - lastWatchCheck >= Self.watchCheckInterval
            {
                // Busy with jobs: the watched descriptor is still read, or its peer's data would wait in the
                // kernel until the queue ran dry.
                lastWatchCheck = now
                pthread_mutex_unlock(mutex)
                let ready = pollWatched(w.fd, until: nil, wait: false).readable
                pthread_mutex_lock(mutex)
                if ready, watched?.generation == w.generation { readable = (w.generation, w.handler) }
            }
            while jobs.isEmpty && calls.isEmpty && !stopping && fired == nil && readable == nil {
                let t = timer
                sleeping = true
                if let w = watched {
                    sleepingInPoll = true
                    pthread_mutex_unlock(mutex)
                    let polled = pollWatched(w.fd, until: t?.deadline, wait: true)
                    pthread_mutex_lock(mutex)
                    sleeping = false
                    sleepingInPoll = false
                    lastWatchCheck = coarseMonotonicNanoseconds()
                    if polled.readable, watched?.generation == w.generation { readable = (w.generation, w.handler) }
                    if let t, timer?.generation == t.generation, polled.timedOut || lastWatchCheck >= t.deadline {
                        fired = t.action
                        timer = nil
                    }
                    continue
                }
                let seen = wakeWord.pointee
                pthread_mutex_unlock(mutex)
                // Deadlines are CLOCK_MONOTONIC, like the session's: a wall-clock step (NTP after days offline)
                // must not fire or postpone a timer.
                var timedOut = false
                if let t {
                    var deadline = monotonicTimespec(nanoseconds: t.deadline)
                    timedOut = ferry_futex_wait(wakeWord, seen, &deadline) == -1 && errno == ETIMEDOUT
                } else {
                    _ = ferry_futex_wait(wakeWord, seen, nil)
                }
                pthread_mutex_lock(mutex)
                sleeping = false
                if timedOut, let t, timer?.generation == t.generation {
                    fired = t.action
                    timer = nil
                }
            }
            if jobs.isEmpty && calls.isEmpty && fired == nil && readable == nil {  // stopping, nothing left
                exited = true
                timer = nil
                watched = nil
                pthread_mutex_unlock(mutex)
                return
            }
            let batch = jobs
            jobs.removeAll(keepingCapacity: true)
            let callBatch = calls
            calls.removeAll()
            pthread_mutex_unlock(mutex)
            for (job, isolated) in batch {
                if isolated {
                    job.runSynchronously(isolatedTo: asUnownedSerialExecutor(), taskExecutor: asUnownedTaskExecutor())
                } else {
                    job.runSynchronously(on: asUnownedTaskExecutor())
                }
            }
            if let readable, !readable.handler() {
                pthread_mutex_lock(mutex)
                if watched?.generation == readable.generation { watched = nil }
                pthread_mutex_unlock(mutex)
            }
            for call in callBatch { call() }
            fired?()
        }
    }
}
