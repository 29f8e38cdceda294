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
/// the same sleep as the jobs.
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
    private var timer: (deadline: Int, generation: UInt64, action: @Sendable () -> Void)?
    private var timerGeneration: UInt64 = 0

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
        if wake {
            sleeping = false
            wakeWord.pointee &+= 1
        }
        pthread_mutex_unlock(mutex)
        if wake { ferry_futex_wake_one(wakeWord) }
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
        // Capped (about 11 days): a deadline that far out is "never" for a session, and the sum cannot overflow.
        // Not a number (a deadline computed from a broken clock) is "never" too, not a trap in Int().
        let deadline = delay.map { delay in
            monotonicNanoseconds() + Int((delay.isNaN ? 1_000_000 : min(max(0, delay), 1_000_000)) * 1e9)
        }
        pthread_mutex_lock(mutex)
        timerGeneration &+= 1
        timer = deadline.map { ($0, timerGeneration, action) }
        // Wakes the thread only if it sleeps: from its own thread, the next sleep picks the timer up.
        unlockWakingTheThread()
    }

    private func run() {
        pthread_mutex_lock(mutex)
        threadID = pthread_self()
        pthread_mutex_unlock(mutex)
        while true {
            pthread_mutex_lock(mutex)
            var fired: (@Sendable () -> Void)?
            if !jobs.isEmpty, let t = timer, monotonicNanoseconds() >= t.deadline {
                // Busy with jobs: a due timer still runs after this batch, not only once the queue runs dry.
                fired = t.action
                timer = nil
            }
            while jobs.isEmpty && !stopping && fired == nil {
                let t = timer
                sleeping = true
                let seen = wakeWord.pointee
                pthread_mutex_unlock(mutex)
                // Deadlines are CLOCK_MONOTONIC, like the session's: a wall-clock step (NTP after days offline)
                // must not fire or postpone a timer.
                var timedOut = false
                if let t {
                    var deadline = timespec(tv_sec: t.deadline / 1_000_000_000, tv_nsec: t.deadline % 1_000_000_000)
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
            if jobs.isEmpty && fired == nil {  // stopping, nothing left
                exited = true
                timer = nil
                pthread_mutex_unlock(mutex)
                return
            }
            let batch = jobs
            jobs.removeAll(keepingCapacity: true)
            pthread_mutex_unlock(mutex)
            for (job, isolated) in batch {
                if isolated {
                    job.runSynchronously(isolatedTo: asUnownedSerialExecutor(), taskExecutor: asUnownedTaskExecutor())
                } else {
                    job.runSynchronously(on: asUnownedTaskExecutor())
                }
            }
            fired?()
        }
    }
}
