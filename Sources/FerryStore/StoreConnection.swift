import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// A serial executor with a thread of its own, for one SQLite connection (GRDB confines each connection to a
/// serial queue; this is that, for Swift concurrency). sqlite3 calls block — an fsync per commit under
/// `synchronous = FULL`, up to 5 s in the busy handler, a long prune — and a blocked thread of the cooperative
/// pool (one per core: two on a small Pi) stalls every task of the process. An actor whose `unownedExecutor` is
/// this one runs all its methods here instead; a task that prefers it as its task executor
/// (`withTaskExecutorPreference`) runs its nonisolated code here (a sync session, with its store).
public final class DatabaseThread: SerialExecutor, TaskExecutor, @unchecked Sendable {
    // Guarded by `mutex` (pthread, not Synchronization.Mutex: ThreadSanitizer sees these handoffs).
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>
    private let condition: UnsafeMutablePointer<pthread_cond_t>
    private var jobs: [UnownedJob] = []
    private var stopping = false
    /// The thread has ended (stopped, nothing left): later jobs go to the global executor (below).
    private var exited = false
    private var threadID: pthread_t?

    /// Starts the thread; `name` shows in `top -H` / /proc (at most 15 bytes are kept).
    public init(name: String) {
        mutex = .allocate(capacity: 1)
        mutex.initialize(to: pthread_mutex_t())
        pthread_mutex_init(mutex, nil)
        condition = .allocate(capacity: 1)
        condition.initialize(to: pthread_cond_t())
        pthread_cond_init(condition, nil)
        // The kernel's name for the thread (top -H, /proc): Foundation's Thread.name does not reach it on Linux.
        // Plain open/write: Foundation's String.write(toFile:) costs more than the thread's first commit.
        let comm = Array(name.utf8.prefix(15))
        let thread = Thread { [self] in
            let fd = open("/proc/thread-self/comm", O_WRONLY | O_CLOEXEC)
            if fd >= 0 {
                _ = comm.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
                close(fd)
            }
            run()
        }
        thread.name = name
        thread.start()
    }

    deinit {
        pthread_cond_destroy(condition)
        condition.deinitialize(count: 1)
        condition.deallocate()
        pthread_mutex_destroy(mutex)
        mutex.deinitialize(count: 1)
        mutex.deallocate()
    }

    public func enqueue(_ job: consuming ExecutorJob) {
        pthread_mutex_lock(mutex)
        if exited {
            // A task that preferred this executor outlived it (a cancelled timer task waking up to end): it must
            // still run, or it would be lost with everything it holds. Only nonisolated work can come here: an
            // actor on this executor stops it from its deinit, when no job of its can be pending.
            pthread_mutex_unlock(mutex)
            globalConcurrentExecutor.enqueue(job)
            return
        }
        jobs.append(UnownedJob(job))
        pthread_cond_signal(condition)
        pthread_mutex_unlock(mutex)
    }

    public func asUnownedSerialExecutor() -> UnownedSerialExecutor {
        UnownedSerialExecutor(ordinary: self)
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
        pthread_cond_signal(condition)
        pthread_mutex_unlock(mutex)
    }

    private func run() {
        pthread_mutex_lock(mutex)
        threadID = pthread_self()
        pthread_mutex_unlock(mutex)
        while true {
            pthread_mutex_lock(mutex)
            while jobs.isEmpty && !stopping { pthread_cond_wait(condition, mutex) }
            if jobs.isEmpty {  // stopping, nothing left
                exited = true
                pthread_mutex_unlock(mutex)
                return
            }
            let batch = jobs
            jobs.removeAll(keepingCapacity: true)
            pthread_mutex_unlock(mutex)
            for job in batch {
                job.runSynchronously(isolatedTo: asUnownedSerialExecutor(), taskExecutor: asUnownedTaskExecutor())
            }
        }
    }
}

/// A `GatewayStore` confined to its own thread (`DatabaseThread`): the one owner of its connection, and every
/// call on it is made off the cooperative pool. Callers hand it a closure: `try await connection.read {
/// try $0.trustedPeripherals() }`. A closure is one unit of work on the connection, so the one-transaction
/// durability rule is kept by the store's own methods as before (a commit is one `GatewayStore.commit`).
public actor StoreConnection {
    private let thread: DatabaseThread
    private var store: GatewayStore?

    public nonisolated var unownedExecutor: UnownedSerialExecutor { thread.asUnownedSerialExecutor() }

    private init(thread: DatabaseThread) {
        self.thread = thread
    }

    deinit { thread.stop() }

    /// Opens (creates, migrates) the store on the connection's own thread.
    public static func open(
        path: String, create: Bool = true, clock: any WallClock = SystemWallClock(), threadName: String = "ferry-sqlite"
    ) async throws -> StoreConnection {
        let connection = StoreConnection(thread: DatabaseThread(name: threadName))
        try await connection.openStore(path: path, create: create, clock: clock)
        return connection
    }

    private func openStore(path: String, create: Bool, clock: any WallClock) throws {
        store = try GatewayStore(path: path, clock: clock, create: create)
    }

    /// Runs `body` with the store, on the connection's thread.
    public func read<T: Sendable>(_ body: @Sendable (GatewayStore) throws -> T) throws -> T {
        guard let store else { preconditionFailure("StoreConnection.open opens the store before handing it out") }
        return try body(store)
    }

    /// Whether the caller runs on this connection's thread (tests).
    public nonisolated var runsOnItsOwnThread: Bool { thread.isCurrent }
}
