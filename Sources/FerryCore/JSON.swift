/// Ferry's one JSON writer. Hand-written on purpose: what it writes must stay byte-identical across Foundation
/// versions (an uplink retry resends the identical body under the same Idempotency-Key; scripts parse the
/// CLI's objects; the store keeps outbox payloads), and JSONEncoder's key order, number and escaping choices
/// are not a promise. Compact (no spaces), keys in the order given, strings escaped per RFC 8259 (`"`, `\`,
/// control characters; everything else verbatim UTF-8).
public struct JSONWriter: Sendable {
    public var bytes: [UInt8] = []

    public init() {}

    /// Text that is already JSON (punctuation, keys known to need no escaping, numbers).
    public mutating func raw(_ text: String) {
        bytes.append(contentsOf: text.utf8)
    }

    /// A 64-bit value as a quoted decimal string: JSON numbers lose precision above 2^53.
    public mutating func decimal(_ value: UInt64) {
        bytes.append(UInt8(ascii: "\""))
        bytes.append(contentsOf: String(value).utf8)
        bytes.append(UInt8(ascii: "\""))
    }

    public mutating func string(_ text: String) {
        bytes.append(UInt8(ascii: "\""))
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "\""): bytes.append(contentsOf: [0x5C, 0x22])
            case UInt8(ascii: "\\"): bytes.append(contentsOf: [0x5C, 0x5C])
            case 0x0A: bytes.append(contentsOf: [0x5C, UInt8(ascii: "n")])
            case 0x0D: bytes.append(contentsOf: [0x5C, UInt8(ascii: "r")])
            case 0x09: bytes.append(contentsOf: [0x5C, UInt8(ascii: "t")])
            case 0x00..<0x20:
                let hex: [UInt8] = Array("0123456789abcdef".utf8)
                bytes.append(contentsOf: [0x5C, UInt8(ascii: "u"), 0x30, 0x30, hex[Int(byte >> 4)], hex[Int(byte & 0xF)]])
            default: bytes.append(byte)
            }
        }
        bytes.append(UInt8(ascii: "\""))
    }

    /// A whole value.
    public mutating func value(_ json: JSON) {
        switch json {
        case .object(let pairs):
            raw("{")
            for (index, pair) in pairs.enumerated() {
                if index > 0 { raw(",") }
                string(pair.0)
                raw(":")
                value(pair.1)
            }
            raw("}")
        case .array(let items):
            raw("[")
            for (index, item) in items.enumerated() {
                if index > 0 { raw(",") }
                value(item)
            }
            raw("]")
        case .string(let s): string(s)
        case .integer(let i): raw(String(i))
        case .double(let d): raw(d.isFinite ? String(d) : "null")
        case .bool(let b): raw(b ? "true" : "false")
        case .null: raw("null")
        }
    }

    /// The bytes as text (they are valid UTF-8: only UTF-8 strings and ASCII went in).
    public var text: String { String(decoding: bytes, as: UTF8.self) }
}

/// A JSON value to write: the CLI's documented objects, the outbox payloads. Keys stay in the order given
/// (stable output for scripts and diffs).
public enum JSON: Sendable {
    indirect case object([(String, JSON)])
    case array([JSON])
    case string(String)
    /// Built with `int(_:)`, from any integer type.
    case integer(Int64)
    case double(Double)
    case bool(Bool)
    case null

    /// A whole number. 64 bits whatever the platform's `Int`: unix milliseconds, file sizes and pids come as
    /// `Int64` or `Int32`, and converting them to a 32-bit `Int` (an armhf build) would trap. Values past
    /// `Int64.max` (a `UInt64` cursor or epoch) are not numbers here: Ferry writes those as decimal strings.
    public static func int(_ value: some BinaryInteger) -> JSON { .integer(Int64(clamping: value)) }

    /// Compact JSON text.
    public var text: String {
        var writer = JSONWriter()
        writer.value(self)
        return writer.text
    }
}
