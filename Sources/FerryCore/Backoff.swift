/// Ferry's one exponential backoff formula: `min(cap, base * 2^doublings)`. Callers choose the jitter
/// (connect retries: equal jitter; uplink retries: full jitter; pauses: none), never the formula.
public enum Backoff {
    /// The ceiling after `doublings` doublings (clamped to `0...maxDoublings`, at most 62 so 2^n stays exact
    /// and finite).
    public static func ceiling(base: Double, cap: Double, doublings: Int, maxDoublings: Int = 62) -> Double {
        let n = max(0, min(doublings, maxDoublings, 62))
        return min(cap, base * Double(UInt64(1) << UInt64(n)))
    }

    /// The same on `Duration` (exact arithmetic). At most 30 doublings: a Duration counts attoseconds in 128
    /// bits, and a long base times 2^62 would overflow it.
    public static func ceiling(base: Duration, cap: Duration, doublings: Int, maxDoublings: Int = 30) -> Duration {
        let n = max(0, min(doublings, maxDoublings, 30))
        return min(cap, base * (1 << n))
    }
}
