#if canImport(Glibc)
    import Glibc
#endif

/// Ferry's one clock for timers, deadlines and durations: CLOCK_MONOTONIC, in seconds. A wall-clock step (NTP
/// after days offline, a Pi without a clock chip setting its time at boot) moves none of them. Wall time, for
/// what is recorded (received_at, created_at), is `WallClock`'s.
///
/// Components that decide on time take one (`any MonotonicClock`), so tests drive a manual clock; code that only
/// bounds a wait or measures a duration uses `SystemMonotonicClock`. Durations at the API (timeouts, intervals)
/// stay `Duration`; `deadline(after:)` and `remaining(until:)` convert.
public protocol MonotonicClock: Sendable {
    /// Seconds on the clock's timeline (for `SystemMonotonicClock`: since boot, suspend excluded).
    func now() -> Double
}

extension MonotonicClock {
    /// The reading `duration` from now.
    public func deadline(after duration: Duration) -> Double {
        now() + duration.inSeconds
    }

    /// The time left until the reading `deadline`; zero once it has passed. At most `Duration.longestWait`: a
    /// deadline from an absurd timeout (`--timeout 1e300`) is a very long wait, not a `Duration` out of range.
    public func remaining(until deadline: Double) -> Duration {
        .secondsClamped(deadline - now())
    }

    /// Seconds since the reading `start`.
    public func seconds(since start: Double) -> Double {
        now() - start
    }
}

public struct SystemMonotonicClock: MonotonicClock {
    public init() {}
    public func now() -> Double {
        Double(monotonicNanoseconds()) / 1e9
    }
}

/// CLOCK_MONOTONIC in nanoseconds: `SystemMonotonicClock`'s timeline, as an integer for the threads that sleep
/// on their own (ThreadExecutor, DeadlineThread). 64 bits on every platform: a 32-bit `Int` overflows after two
/// seconds of nanoseconds.
public func monotonicNanoseconds() -> Int64 {
    var now = timespec()
    clock_gettime(CLOCK_MONOTONIC, &now)
    return Int64(now.tv_sec) * 1_000_000_000 + Int64(now.tv_nsec)
}

/// The point of `monotonicNanoseconds`' timeline `seconds` from now, for the threads that wait on their own.
/// Capped at about 11 days (a deadline that far out is "never" for them, and the sum cannot overflow); a negative
/// delay is now, and not a number (a deadline computed from a broken clock) is the cap, never a trap in the
/// conversion.
func monotonicDeadline(afterSeconds seconds: Double) -> Int64 {
    let capped = seconds.isNaN ? maximumWaitSeconds : min(max(0, seconds), maximumWaitSeconds)
    return monotonicNanoseconds() + Int64(capped * 1e9)
}

private let maximumWaitSeconds = 1_000_000.0

/// A point of `monotonicNanoseconds`' timeline as the `timespec` a timed wait takes (seconds since boot fit any
/// `time_t`).
func monotonicTimespec(nanoseconds: Int64) -> timespec {
    timespec(tv_sec: time_t(nanoseconds / 1_000_000_000), tv_nsec: Int(nanoseconds % 1_000_000_000))
}

/// CLOCK_MONOTONIC_COARSE in nanoseconds: the same timeline as `monotonicNanoseconds`, as of the kernel's last
/// tick (a few ms behind at most), read from the vDSO whatever the clock source. Where the clock source cannot be
/// read from user space (an HPET, as in a TCG virtual machine), `monotonicNanoseconds` is a system call each time:
/// ThreadExecutor's loop, which looks at the time after every wake-up, uses this one.
public func coarseMonotonicNanoseconds() -> Int64 {
    var now = timespec()
    clock_gettime(CLOCK_MONOTONIC_COARSE, &now)
    return Int64(now.tv_sec) * 1_000_000_000 + Int64(now.tv_nsec)
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
