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
    }

    private let state = LockedValue(State())

    public init() {}

    public func signal() {
        let waiter = state.withLock { s -> CheckedContinuation<Void, Never>? in
            s.signalled = true
            defer { s.waiter = nil }
            return s.waiter
        }
        waiter?.resume()
    }

    /// Returns when signalled (consuming the signal; true), after `timeout` (nil: none; false), or at once in a
    /// cancelled task. One waiter at a time: the loop that owns this wake-up.
    @discardableResult
    public func wait(timeout: Duration?) async -> Bool {
        if consume() { return true }
        if timeout == .zero || Task.isCancelled { return false }
        // The signal and the timer race in a task group; the loser is cancelled, so nothing outlives the wait.
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.waitForSignal() }
            if let timeout { group.addTask { try? await Task.sleep(for: timeout) } }
            await group.next()
            group.cancelAll()
        }
        return consume()
    }

    private func consume() -> Bool {
        state.withLock { s in
            defer { s.signalled = false }
            return s.signalled
        }
    }

    private func waitForSignal() async {
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLock { s -> Bool in
                    if s.signalled || Task.isCancelled { return true }
                    s.waiter = continuation
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            let waiter = state.withLock { s -> CheckedContinuation<Void, Never>? in
                defer { s.waiter = nil }
                return s.waiter
            }
            waiter?.resume()
        }
    }
}
