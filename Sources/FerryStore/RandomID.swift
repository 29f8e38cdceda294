#if canImport(Glibc)
    import Glibc
#endif

/// Random identifiers for outbox events and uplink batches: version-4 UUIDs in lowercase text, the form
/// `UUID().uuidString.lowercased()` gave. Foundation's UUID() opens, reads and closes /dev/urandom for each
/// one (seen with strace -c on `ferry ingest`: 3 syscalls per commit, ~5 % of its CPU), and a commit makes one
/// per window; here it is one getrandom() for all 16 bytes (getentropy), no file.
public enum RandomID {
    public static func uuidV4() -> String {
        var words: (UInt64, UInt64) = (0, 0)
        let filled = withUnsafeMutableBytes(of: &words) { getentropy($0.baseAddress, $0.count) == 0 }
        if !filled {
            // Not expected on Linux ≥ 3.17; SystemRandomNumberGenerator traps rather than fail silently.
            var generator = SystemRandomNumberGenerator()
            words = (generator.next(), generator.next())
        }
        return uuidV4(high: words.0, low: words.1)
    }

    /// The text of the version-4 UUID made from these 128 random bits (version and variant bits set). Pure.
    static func uuidV4(high: UInt64, low: UInt64) -> String {
        let high = (high & ~0x0000_0000_0000_F000) | 0x0000_0000_0000_4000  // version 4
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
