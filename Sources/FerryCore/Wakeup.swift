/// A level-triggered wake-up for one waiting loop (the daemon's scheduling loop, the storage watch, the outbox
/// forwarder): anyone may `signal()` that something changed; the loop's `wait` returns at once if a signal is
/// pending, else when one comes or its next due time arrives. Signals coalesce: a burst of them costs the loop
/// one turn, and a loop with nothing due and nothing signalled sleeps (no polling, so an idle daemon uses no CPU).
///
/// The loop re-evaluates everything on each turn, so the wake-up carries no payload: what happened is in the
/// state the loop reads (sessions, signals, the BlueZ object cache).
public final class Wakeup: Sendable {
    private struct State {
        var signalled = false
        var waiter: CheckedContinuation<Void, Never>?
        /// The waiter's timeout on the deadline thread (cancelled when something else ends the wait).
        var timeout: DeadlineThread.Token?
        /// Counts waits: a timeout that fires for an earlier wait finds another number and does nothing.
        var wait: UInt64 = 0
    }

    private let state = LockedValue(State())

    public init() {}

    public func signal() {
        endWait { s in
            s.signalled = true
            return true
        }
    }

    /// Returns when signalled (consuming the signal; true), after `timeout` (nil: none; false), or at once in a
    /// cancelled task. One waiter at a time: the loop that owns this wake-up.
    ///
    /// The timeout runs on `DeadlineThread`, not as a `Task.sleep`: see there why.
    @discardableResult
    public func wait(timeout: Duration?) async -> Bool {
        if consume() { return true }
        if timeout == .zero || Task.isCancelled { return false }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLock { s -> Bool in
                    if s.signalled || Task.isCancelled { return true }
                    s.waiter = continuation
                    s.wait &+= 1
                    if let timeout {
                        // Scheduled under the lock, so a signal that follows at once finds the token to cancel.
                        let wait = s.wait
                        s.timeout = DeadlineThread.shared.schedule(after: timeout) { [weak self] in
                            self?.endWait { $0.wait == wait }
                        }
                    }
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            endWait { _ in true }
        }
        return consume()
    }

    private func consume() -> Bool {
        state.withLock { s in
            defer { s.signalled = false }
            return s.signalled
        }
    }

    /// Ends the current wait, if any, when `ending` (run under the lock, may change the state) says so: resumes
    /// the waiter and cancels its timeout.
    private func endWait(_ ending: (inout State) -> Bool) {
        let (waiter, timeout) = state.withLock { s -> (CheckedContinuation<Void, Never>?, DeadlineThread.Token?) in
            guard ending(&s) else { return (nil, nil) }
            defer {
                s.waiter = nil
                s.timeout = nil
            }
            return (s.waiter, s.timeout)
        }
        if let timeout { DeadlineThread.shared.cancel(timeout) }
        waiter?.resume()
    }
}
