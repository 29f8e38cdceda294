import FerryCore

#if canImport(Glibc)
    import Glibc
#endif

/// Identifiers for outbox events (version-7 UUIDs: time then random) and uplink batches (version 4), in
/// lowercase text, the form `UUID().uuidString.lowercased()` gives. Foundation's UUID() opens, reads and
/// closes /dev/urandom for each one (seen with strace -c on `ferry ingest`: 3 syscalls per commit, ~5 % of its CPU). Here the kernel's
/// random bytes are taken 256 at a time (one getentropy, the most it gives in one call) and handed out 16 per
/// identifier: a sync session commits once per ACK cadence, and each commit makes one.
public enum RandomID {
    public static func uuidV4() -> String {
        let (high, low) = pool.withLock { $0.next() }
        return uuidV4(high: high, low: low)
    }

    /// A version-7 UUID (RFC 9562): the Unix time in milliseconds in the first 48 bits, then 74 random bits.
    /// Outbox event ids are the key of an index; ids that grow with time are added at its right-hand end, which
    /// stays in the page cache, where random ones land on a random leaf each (a page read from the card once the
    /// index outgrows the cache, as an outbox does after days offline). Unique either way: 74 random bits per
    /// millisecond, and a clock that steps back only costs the ordering.
    public static func uuidV7(unixMillis: Int64) -> String {
        let (high, low) = pool.withLock { $0.next() }
        return uuidV7(unixMillis: unixMillis, high: high, low: low)
    }

    private static let pool = LockedValue(EntropyPool())

    /// Random words from the kernel, refilled when used up. Identifiers need uniqueness, not secrecy, but the
    /// bits are the kernel's CSPRNG all the same.
    private struct EntropyPool {
        private var words = [UInt64](repeating: 0, count: 32)
        private var used = 32

        mutating func next() -> (UInt64, UInt64) {
            if used + 2 > words.count { refill() }
            defer { used += 2 }
            return (words[used], words[used + 1])
        }

        private mutating func refill() {
            let filled = words.withUnsafeMutableBytes { getentropy($0.baseAddress, $0.count) == 0 }
            if !filled {
                // Not expected on Linux ≥ 3.17; SystemRandomNumberGenerator traps rather than fail silently.
                var generator = SystemRandomNumberGenerator()
                for index in words.indices { words[index] = generator.next() }
            }
            used = 0
        }
    }

    /// The text of the version-4 UUID made from these 128 random bits (version and variant bits set). Pure.
    static func uuidV4(high: UInt64, low: UInt64) -> String {
        text(high: (high & ~0x0000_0000_0000_F000) | 0x0000_0000_0000_4000, low: low)  // version 4
    }

    /// The text of the version-7 UUID for this time (milliseconds since 1970, the low 48 bits of a value below
    /// zero or beyond the year 10889 taken as they are) and random bits: the time, version 7, 12 bits of `high`,
    /// the variant, 62 bits of `low`. Pure.
    static func uuidV7(unixMillis: Int64, high: UInt64, low: UInt64) -> String {
        let time = UInt64(bitPattern: unixMillis) & 0xFFFF_FFFF_FFFF
        return text(high: time << 16 | 0x7000 | (high & 0x0FFF), low: low)
    }

    /// The 8-4-4-4-12 hex text of 128 bits, with the RFC 9562 variant (binary 10) in the top bits of `low`.
    private static func text(high: UInt64, low: UInt64) -> String {
        let low = (low & ~0xC000_0000_0000_0000) | 0x8000_0000_0000_0000  // variant 10
        let digits: [UInt8] = Array("0123456789abcdef".utf8)
        var text: [UInt8] = []
        text.reserveCapacity(36)
        for (index, word) in [high, low].enumerated() {
            for nibble in 0..<16 {
                let position = index * 16 + nibble
                if position == 8 || position == 12 || position == 16 || position == 20 { text.append(UInt8(ascii: "-")) }
                text.append(digits[Int((word >> UInt64(60 - 4 * nibble)) & 0xF)])
            }
        }
        return String(decoding: text, as: UTF8.self)
    }
}
