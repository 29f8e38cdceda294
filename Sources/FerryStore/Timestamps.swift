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
        let ms = Int(((millis % 1000) + 1000) % 1000)
        let seconds = (millis - Int64(ms)) / 1000
        var days = Int(seconds / 86_400)
        var rem = Int(seconds % 86_400)
        if rem < 0 {
            rem += 86_400
            days -= 1
        }
        // Civil-from-days (Howard Hinnant's algorithm).
        let z = days + 719_468
        let era = (z >= 0 ? z : z - 146_096) / 146_097
        let doe = z - era * 146_097
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100)
        let mp = (5 * doy + 2) / 153
        let day = doy - (153 * mp + 2) / 5 + 1
        let month = mp < 10 ? mp + 3 : mp - 9
        let year = yoe + era * 400 + (month <= 2 ? 1 : 0)
        func pad(_ v: Int, _ width: Int) -> String {
            let s = String(v)
            return String(repeating: "0", count: max(0, width - s.count)) + s
        }
        return "\(pad(year, 4))-\(pad(month, 2))-\(pad(day, 2))T\(pad(rem / 3600, 2)):\(pad(rem % 3600 / 60, 2)):"
            + "\(pad(rem % 60, 2)).\(pad(ms, 3))Z"
    }
}
