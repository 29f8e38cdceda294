import FerryCore

#if canImport(Glibc)
    import Glibc
#endif

/// Random identifiers for outbox events and uplink batches: version-4 UUIDs in lowercase text, the form
/// `UUID().uuidString.lowercased()` gave. Foundation's UUID() opens, reads and closes /dev/urandom for each
/// one (seen with strace -c on `ferry ingest`: 3 syscalls per commit, ~5 % of its CPU). Here the kernel's
/// random bytes are taken 256 at a time (one getentropy, the most it gives in one call) and handed out 16 per
/// identifier: a sync session commits once per ACK cadence, and each commit makes one.
public enum RandomID {
    public static func uuidV4() -> String {
        let (high, low) = pool.withLock { $0.next() }
        return uuidV4(high: high, low: low)
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
