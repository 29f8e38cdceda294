import FoundationEssentials
import Glibc

/// SplitMix64: a tiny, fast, seedable generator. Every fault the simulator injects and every payload it
/// invents comes from one of these, so a failing run is reproduced by its seed alone.
public struct SeededGenerator: RandomNumberGenerator, Sendable {
    private var state: UInt64

    public init(seed: UInt64) {
        state = seed
    }

    public mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }

    /// A uniform double in [0, 1).
    public mutating func unit() -> Double {
        Double(next() >> 11) * 0x1p-53
    }

    /// True with probability `probability`. A zero probability consumes no randomness, so switching a
    /// fault off does not reshuffle the rest of a seeded run.
    public mutating func chance(_ probability: Double) -> Bool {
        guard probability > 0 else { return false }
        return unit() < probability
    }

    /// How many bytes pass before the next hit of a per-byte process with probability `rate` (geometric
    /// distribution): bit flips at 1e-4 per byte then cost one draw per flip, not one per byte.
    public mutating func bytesUntilNextHit(rate: Double) -> Int {
        guard rate > 0 else { return Int.max }
        guard rate < 1 else { return 0 }
        let u = max(unit(), 0x1p-60)
        let gap = log(u) / log1p(-rate)
        return gap >= Double(Int.max / 2) ? Int.max / 2 : Int(gap)
    }
}
