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

/// CPU seconds (user + system) this process has used so far: where a session's CPU goes, phase by phase
/// (`ferry sync --json`'s `phases_cpu`). One getrusage call; not meant for per-notification use.
public enum ProcessCPU {
    public static func seconds() -> Double {
        var usage = rusage()
        guard getrusage(Int32(RUSAGE_SELF.rawValue), &usage) == 0 else { return 0 }
        return Double(usage.ru_utime.tv_sec) + Double(usage.ru_utime.tv_usec) / 1e6 + Double(usage.ru_stime.tv_sec)
            + Double(usage.ru_stime.tv_usec) / 1e6
    }
}
