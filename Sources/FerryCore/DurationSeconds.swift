extension Duration {
    /// The duration in seconds, for arithmetic with the `Double` seconds of clocks and configuration, and for
    /// messages.
    /// From the 128-bit attosecond count: `components.seconds` is an Int64 and traps on a Duration beyond it.
    public var inSeconds: Double {
        Double(attoseconds) / 1e18
    }

    /// Whole seconds, rounded up, for one-line messages ("within 5 s"): a bound of 4.6 s reads as the user's 5.
    /// Clamped to Int's range: a Duration can hold more seconds than an Int, and the conversion would trap.
    public var wholeSecondsRoundedUp: Int {
        let seconds = inSeconds.rounded(.up)
        if seconds >= Double(Int.max) { return Int.max }
        if seconds <= Double(Int.min) { return Int.min }
        return Int(seconds)
    }

    /// The longest wait Ferry computes (some 31 700 years): where a timeout or interval from outside is converted,
    /// larger values (and infinity) become this instead of trapping, as `Duration.seconds(_: Double)` does past
    /// its range.
    public static let longestWait = Duration.seconds(1_000_000_000_000)

    /// `seconds` as a Duration, clamped to 0...`longestWait` (NaN: 0).
    public static func secondsClamped(_ seconds: Double) -> Duration {
        guard seconds > 0 else { return .zero }
        return seconds >= longestWait.inSeconds ? longestWait : .seconds(seconds)
    }
}
