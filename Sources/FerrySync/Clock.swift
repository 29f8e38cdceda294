#if canImport(Glibc)
    import Glibc
#endif

/// Monotonic seconds for session timers. Injected: tests drive a manual clock.
public protocol MonotonicClock: Sendable {
    func now() -> Double
}

public struct SystemMonotonicClock: MonotonicClock {
    public init() {}
    public func now() -> Double {
        var ts = timespec()
        clock_gettime(CLOCK_MONOTONIC, &ts)
        return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
    }
}
