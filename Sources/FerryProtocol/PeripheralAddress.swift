/// A Bluetooth device address in the canonical "AA:BB:CC:DD:EE:FF" form (upper case), as BlueZ prints it
/// and as the store keys streams. Validation lives here so every entry point rejects the same inputs.
public struct PeripheralAddress: Sendable, Hashable, Comparable, CustomStringConvertible {
    public let string: String

    /// Six colon-separated pairs of hex digits, either case. Read as bytes: the address comes from the command line
    /// or config at every start, and splitting by Character and `uppercased()` ran the Unicode segmentation and
    /// case-mapping code for 17 ASCII bytes (callgrind: 244 K instructions, 6 % of a `ferry ingest` start).
    public init?(_ text: String) {
        var bytes = Array(text.utf8)
        guard bytes.count == 17 else { return nil }
        for index in bytes.indices {
            if index % 3 == 2 {
                guard bytes[index] == UInt8(ascii: ":") else { return nil }
            } else {
                guard Self.isASCIIHexDigit(bytes[index]) else { return nil }
                if bytes[index] >= UInt8(ascii: "a") { bytes[index] -= 0x20 }  // a-f to A-F
            }
        }
        string = String(decoding: bytes, as: UTF8.self)
    }

    private static func isASCIIHexDigit(_ c: UInt8) -> Bool {
        (c >= 0x30 && c <= 0x39) || (c >= 0x41 && c <= 0x46) || (c >= 0x61 && c <= 0x66)
    }

    public var description: String { string }
    public static func < (a: Self, b: Self) -> Bool { a.string < b.string }
}
