import FerryCore
import Synchronization

/// A monotonic clock that only moves when told to: the session driver advances it to the runner's next
/// deadline when nothing is in flight, so idle and response timeouts fire deterministically and a whole
/// session with minutes of simulated timeouts runs in milliseconds.
public final class ManualClock: MonotonicClock {
    private let current: Mutex<Double>

    public init(start: Double = 0) {
        current = Mutex(start)
    }

    public func now() -> Double {
        current.withLock { $0 }
    }

    public func advance(by seconds: Double) {
        precondition(seconds >= 0, "a monotonic clock never goes back")
        current.withLock { $0 += seconds }
    }

    /// Moves to `time`, or stays put if `time` is already past.
    public func advance(to time: Double) {
        current.withLock { $0 = max($0, time) }
    }
}
