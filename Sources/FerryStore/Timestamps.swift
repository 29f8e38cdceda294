import FerryCore

/// Wall-clock time for records (received_at, created_at). Injected so tests control it.
public protocol WallClock: Sendable {
    /// Milliseconds since the Unix epoch.
    func nowMillis() -> Int64
}

#if canImport(Glibc)
    import Glibc
#endif

public struct SystemWallClock: WallClock {
    public init() {}
    public func nowMillis() -> Int64 {
        var ts = timespec()
        clock_gettime(CLOCK_REALTIME, &ts)
        return Int64(ts.tv_sec) * 1000 + Int64(ts.tv_nsec) / 1_000_000
    }
}

public enum Timestamp {
    /// RFC 3339 UTC with milliseconds ("2026-11-30T15:00:00.123Z"), computed without locale or time zone
    /// databases so the same instant always yields the same bytes (a retried upload body must be identical).
    public static func iso8601(millis: Int64) -> String {
        CivilTime.rfc3339(millisecondsSince1970: millis)
    }

    /// Seconds from `earlier` to `later` (Unix milliseconds), negative if `later` is earlier. In Double: a
    /// timestamp read from the store or a file is whatever it holds, and their Int64 difference could overflow.
    public static func seconds(from earlier: Int64, to later: Int64) -> Double {
        (Double(later) - Double(earlier)) / 1000
    }
}
