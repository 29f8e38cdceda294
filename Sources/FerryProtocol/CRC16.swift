/// CRC-16/IBM-3740 (also called CRC-16/CCITT-FALSE): poly 0x1021, init 0xFFFF, no reflection, xorout 0.
/// Check value of ASCII "123456789" is 0x29B1. A frame's CRC covers its header and payload (PROTOCOL §2).
public enum CRC16 {
    public static let initial: UInt16 = 0xFFFF

    /// Byte-at-a-time lookup table, built once. Stored as a tuple-free array; the hot loop takes a raw pointer.
    static let table: [UInt16] = (0..<256).map { byte -> UInt16 in
        var crc = UInt16(byte) << 8
        for _ in 0..<8 {
            crc = (crc & 0x8000) != 0 ? (crc << 1) ^ 0x1021 : crc << 1
        }
        return crc
    }

    /// Continues a CRC over `bytes`, starting from `crc`.
    public static func update(_ crc: UInt16, _ bytes: UnsafeRawBufferPointer) -> UInt16 {
        table.withUnsafeBufferPointer { t in update(crc, bytes, table: t) }
    }

    @inline(__always)
    static func update(_ crc: UInt16, _ bytes: UnsafeRawBufferPointer, table t: UnsafeBufferPointer<UInt16>)
        -> UInt16
    {
        var crc = crc
        for byte in bytes {
            crc = (crc << 8) ^ t[Int(UInt8(truncatingIfNeeded: crc >> 8) ^ byte)]
        }
        return crc
    }

    public static func checksum(_ bytes: UnsafeRawBufferPointer) -> UInt16 {
        update(initial, bytes)
    }

    public static func checksum<C: Collection>(_ bytes: C) -> UInt16 where C.Element == UInt8 {
        if let fast = bytes.withContiguousStorageIfAvailable({ checksum(UnsafeRawBufferPointer($0)) }) {
            return fast
        }
        let copy = Array(bytes)
        return copy.withUnsafeBytes { checksum($0) }
    }
}

// Combining CRCs of overlapping spans (used by the decoder to judge many candidate frames over the same bytes
// in O(1) each). The register of this non-reflected CRC is a polynomial mod P = x^16 + 0x1021, and feeding a
// byte is linear: state' = state·x^8 + byte·x^16 (mod P). So with prefix states P(k) of a stream run from 0,
// the CRC from `initial` over bytes [a, b) is  shift(initial ^ P(a), b - a) ^ P(b),  shift(s, n) = s·x^(8n).
extension CRC16 {
    /// x^(8n) mod P for every span a frame's CRC can cover (header + a 16-bit length), built once (128 KiB).
    static let zeroBytePowers: [UInt16] = {
        let t = table
        var powers = [UInt16](repeating: 0, count: Frame.headerLength + Int(UInt16.max) + 1)
        var value: UInt16 = 1
        for n in powers.indices {
            powers[n] = value
            value = (value << 8) ^ t[Int(value >> 8)]  // one zero byte: ·x^8 mod P
        }
        return powers
    }()

    /// a·b mod P (carry-less), most significant bit of `a` first; branch-free.
    @inline(__always)
    static func multiply(_ a: UInt16, _ b: UInt16) -> UInt16 {
        var r: UInt16 = 0
        var a = a
        for _ in 0..<16 {
            r = (r << 1) ^ (0x1021 & (0 &- (r >> 15)))
            r ^= b & (0 &- (a >> 15))
            a <<= 1
        }
        return r
    }
}
