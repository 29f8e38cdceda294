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
}
