#if canImport(Glibc)
    import Glibc
#endif

/// One thread for the timeouts of the process's waiting loops (`Wakeup`): it sleeps in one timed wait, on
/// CLOCK_MONOTONIC, until the earliest deadline, runs what is due, and sleeps again.
///
/// Why not `Task.sleep` (how `Wakeup` waited before): a wait with a timeout was a task group of two child tasks,
/// one of them a `Task.sleep` whose timer libdispatch fires on its manager thread and hands to a pool thread. Each
/// turn of an idle loop woke several threads for that. With this thread, `scripts/bench-idle` counted a third
/// fewer wake-ups of an idle daemon (voluntary context switches of its threads over 30 s: 134 → 82 without an
/// uplink, 142 → 98 with one). What is left includes libdispatch's own once-a-second timer, which runs in any
/// process that has used Swift's global executor.
public final class DeadlineThread: @unchecked Sendable {
    public static let shared = DeadlineThread()

    /// A scheduled action, for `cancel`.
    public struct Token: Hashable, Sendable {
        fileprivate let id: UInt64
    }

    // Guarded by `mutex`.
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>
    private let condition: UnsafeMutablePointer<pthread_cond_t>
    private var entries: [UInt64: (deadline: Int64, action: @Sendable () -> Void)] = [:]
    private var nextID: UInt64 = 0
    private var started = false
    /// The deadline the thread sleeps until (nil: it sleeps until signalled, or runs): only an earlier one wakes it.
    private var sleepingUntil: Int64?

    private init() {
        mutex = .allocate(capacity: 1)
        mutex.initialize(to: pthread_mutex_t())
        pthread_mutex_init(mutex, nil)
        condition = .allocate(capacity: 1)
        condition.initialize(to: pthread_cond_t())
        var attributes = pthread_condattr_t()
        pthread_condattr_init(&attributes)
        // Deadlines on the monotonic clock: a wall-clock step (NTP after days offline) moves none of them.
        pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC)
        pthread_cond_init(condition, &attributes)
        pthread_condattr_destroy(&attributes)
    }

    /// Runs `action` on the deadline thread once `delay` has passed. A delay absurdly far (over ~11 days) waits
    /// that long, not forever and never a trap. `action` must be short: it delays the
    /// ones due after it.
    @discardableResult
    public func schedule(after delay: Duration, _ action: @escaping @Sendable () -> Void) -> Token {
        let deadline = monotonicDeadline(afterSeconds: delay.inSeconds)
        pthread_mutex_lock(mutex)
        nextID &+= 1
        let id = nextID
        entries[id] = (deadline, action)
        if !started {
            // Without its thread, no timeout fires (a waiting loop waits for its signal only); the next schedule
            // tries again.
            started = startThread(name: "ferry-deadlines") { [self] in run() }
        }
        // A thread asleep until an earlier deadline sees this one when it wakes: no need to wake it now.
        if sleepingUntil.map({ deadline < $0 }) ?? true { pthread_cond_signal(condition) }
        pthread_mutex_unlock(mutex)
        return Token(id: id)
    }

    /// Forgets a scheduled action that has not run (nothing happens if it already ran).
    public func cancel(_ token: Token) {
        pthread_mutex_lock(mutex)
        // No wake-up: the thread finds the earliest deadline gone when it wakes, and sleeps again.
        entries[token.id] = nil
        pthread_mutex_unlock(mutex)
    }

    private func run() {
        pthread_mutex_lock(mutex)
        while true {
            guard let earliest = entries.min(by: { $0.value.deadline < $1.value.deadline }) else {
                pthread_cond_wait(condition, mutex)
                continue
            }
            if monotonicNanoseconds() >= earliest.value.deadline {
                entries[earliest.key] = nil
                pthread_mutex_unlock(mutex)
                earliest.value.action()
                pthread_mutex_lock(mutex)
                continue
            }
            var until = monotonicTimespec(nanoseconds: earliest.value.deadline)
            sleepingUntil = earliest.value.deadline
            _ = pthread_cond_timedwait(condition, mutex, &until)
            sleepingUntil = nil
        }
    }
}
