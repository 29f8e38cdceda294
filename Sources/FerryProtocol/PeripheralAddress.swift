/// A Bluetooth device address in the canonical "AA:BB:CC:DD:EE:FF" form (upper case), as BlueZ prints it
/// and as the store keys streams. Validation lives here so every entry point rejects the same inputs.
public struct PeripheralAddress: Sendable, Hashable, Comparable, CustomStringConvertible {
    public let string: String

    public init?(_ text: String) {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        guard parts.count == 6,
            parts.allSatisfy({ $0.utf8.count == 2 && $0.utf8.allSatisfy(Self.isASCIIHexDigit) })
        else { return nil }
        string = parts.joined(separator: ":").uppercased()
    }

    private static func isASCIIHexDigit(_ c: UInt8) -> Bool {
        (c >= 0x30 && c <= 0x39) || (c >= 0x41 && c <= 0x46) || (c >= 0x61 && c <= 0x66)
    }

    public var description: String { string }
    public static func < (a: Self, b: Self) -> Bool { a.string < b.string }
}
