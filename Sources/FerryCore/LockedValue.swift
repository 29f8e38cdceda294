#if canImport(Glibc)
    import Glibc
#endif

/// A value behind a pthread mutex.
///
/// Used instead of `Synchronization.Mutex` on purpose: on Linux, Mutex is built on raw futex
/// syscalls that ThreadSanitizer cannot see, so every handoff through it is reported as a data race
/// and real races would drown in the noise. pthread mutexes are intercepted by TSan.
public final class LockedValue<Value: Sendable>: @unchecked Sendable {
    // Sole owner of the heap-allocated mutex: a pthread_mutex_t must not move once initialised.
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>
    private var value: Value

    public init(_ value: Value) {
        mutex = .allocate(capacity: 1)
        mutex.initialize(to: pthread_mutex_t())
        pthread_mutex_init(mutex, nil)
        self.value = value
    }

    deinit {
        pthread_mutex_destroy(mutex)
        mutex.deinitialize(count: 1)
        mutex.deallocate()
    }

    public func withLock<Result>(_ body: (inout Value) throws -> Result) rethrows -> Result {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body(&value)
    }
}
