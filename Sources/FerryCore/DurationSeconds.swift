extension Duration {
    /// The duration in seconds, for arithmetic with the `Double` seconds of clocks and configuration, and for
    /// messages.
    public var inSeconds: Double {
        Double(components.seconds) + Double(components.attoseconds) / 1e18
    }

    /// Whole seconds, rounded up, for one-line messages ("within 5 s"): a bound of 4.6 s reads as the user's 5.
    public var wholeSecondsRoundedUp: Int {
        Int(inSeconds.rounded(.up))
    }
}
