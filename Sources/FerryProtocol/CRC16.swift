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
