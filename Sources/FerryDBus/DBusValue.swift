// A D-Bus value as plain Swift data, so marshalling is the only place that touches libdbus.
//
// Arrays and dicts carry their element signature because an EMPTY container still has a type on the
// wire ("as" vs "ao"): without it an empty array could not be encoded, and a decoded one could not be
// re-encoded identically.

/// One D-Bus value of any type BlueZ uses.
public indirect enum DBusValue: Sendable, Equatable, CustomStringConvertible {
    case byte(UInt8)
    case bool(Bool)
    case int16(Int16)
    case uint16(UInt16)
    case int32(Int32)
    case uint32(UInt32)
    case int64(Int64)
    case uint64(UInt64)
    case double(Double)
    case string(String)
    case objectPath(String)
    case signature(String)
    case unixFD(DBusUnixFD)
    /// `a<elementSignature>` where the element is not a dict entry.
    case array(elementSignature: String, [DBusValue])
    /// `a{<keySignature><valueSignature>}`; entries keep wire order (D-Bus allows duplicate keys).
    case dict(keySignature: String, valueSignature: String, [DBusDictEntry])
    /// `(...)`; D-Bus forbids empty structs, so this must hold at least one field.
    case structure([DBusValue])
    case variant(DBusValue)

    /// The complete D-Bus signature of this single value.
    public var signature: String {
        switch self {
        case .byte: return "y"
        case .bool: return "b"
        case .int16: return "n"
        case .uint16: return "q"
        case .int32: return "i"
        case .uint32: return "u"
        case .int64: return "x"
        case .uint64: return "t"
        case .double: return "d"
        case .string: return "s"
        case .objectPath: return "o"
        case .signature: return "g"
        case .unixFD: return "h"
        case .array(let element, _): return "a" + element
        case .dict(let key, let value, _): return "a{" + key + value + "}"
        case .structure(let fields): return "(" + fields.map(\.signature).joined() + ")"
        case .variant: return "v"
        }
    }

    public var description: String {
        switch self {
        case .byte(let v): return "byte \(v)"
        case .bool(let v): return "\(v)"
        case .int16(let v): return "int16 \(v)"
        case .uint16(let v): return "uint16 \(v)"
        case .int32(let v): return "int32 \(v)"
        case .uint32(let v): return "uint32 \(v)"
        case .int64(let v): return "int64 \(v)"
        case .uint64(let v): return "uint64 \(v)"
        case .double(let v): return "double \(v)"
        case .string(let v): return "\"\(v)\""
        case .objectPath(let v): return "path \(v)"
        case .signature(let v): return "signature \(v)"
        case .unixFD(let fd): return "fd \(fd.rawValue)"
        case .array(let element, let values):
            if element == "y" { return "bytes[\(values.count)]" }
            return "[" + values.map(\.description).joined(separator: ", ") + "]"
        case .dict(_, _, let entries):
            return "{" + entries.map { "\($0.key): \($0.value)" }.joined(separator: ", ") + "}"
        case .structure(let fields): return "(" + fields.map(\.description).joined(separator: ", ") + ")"
        case .variant(let inner): return "<\(inner)>"
        }
    }
}

/// One `{key value}` entry of a D-Bus dict.
public struct DBusDictEntry: Sendable, Equatable {
    public var key: DBusValue
    public var value: DBusValue
    public init(key: DBusValue, value: DBusValue) {
        self.key = key
        self.value = value
    }
}

// MARK: - Construction helpers for the shapes BlueZ uses.

extension DBusValue {
    /// `ay`.
    public static func bytes(_ bytes: some Sequence<UInt8>) -> DBusValue {
        .array(elementSignature: "y", bytes.map { .byte($0) })
    }

    /// `as`.
    public static func strings(_ strings: [String]) -> DBusValue {
        .array(elementSignature: "s", strings.map { .string($0) })
    }

    /// `a{sv}`: the options/properties dictionary BlueZ takes and returns everywhere.
    /// Keys are sorted so the encoding is deterministic.
    public static func properties(_ values: [String: DBusValue]) -> DBusValue {
        .dict(
            keySignature: "s", valueSignature: "v",
            values.sorted { $0.key < $1.key }.map {
                DBusDictEntry(key: .string($0.key), value: .variant($0.value))
            })
    }
}

// MARK: - Typed accessors. Each returns nil on a type mismatch instead of trapping, because the
// values come from another process that may not follow its documented API.

extension DBusValue {
    /// The value inside any number of variant wrappers.
    public var unwrapped: DBusValue {
        if case .variant(let inner) = self { return inner.unwrapped }
        return self
    }

    public var string: String? {
        if case .string(let v) = unwrapped { return v }
        return nil
    }

    public var objectPath: String? {
        if case .objectPath(let v) = unwrapped { return v }
        return nil
    }

    public var bool: Bool? {
        if case .bool(let v) = unwrapped { return v }
        return nil
    }

    public var uint8: UInt8? {
        if case .byte(let v) = unwrapped { return v }
        return nil
    }

    public var int16: Int16? {
        if case .int16(let v) = unwrapped { return v }
        return nil
    }

    public var uint16: UInt16? {
        if case .uint16(let v) = unwrapped { return v }
        return nil
    }

    public var int32: Int32? {
        if case .int32(let v) = unwrapped { return v }
        return nil
    }

    public var uint32: UInt32? {
        if case .uint32(let v) = unwrapped { return v }
        return nil
    }

    public var uint64: UInt64? {
        if case .uint64(let v) = unwrapped { return v }
        return nil
    }

    public var unixFD: DBusUnixFD? {
        if case .unixFD(let v) = unwrapped { return v }
        return nil
    }

    /// The elements of any non-dict array.
    public var arrayElements: [DBusValue]? {
        if case .array(_, let values) = unwrapped { return values }
        return nil
    }

    /// `ay` as bytes.
    public var bytes: [UInt8]? {
        guard case .array(let element, let values) = unwrapped, element == "y" else { return nil }
        var out = [UInt8]()
        out.reserveCapacity(values.count)
        for value in values {
            guard case .byte(let b) = value else { return nil }
            out.append(b)
        }
        return out
    }

    /// `as` / `ao` as strings.
    public var stringArray: [String]? {
        guard case .array(_, let values) = unwrapped else { return nil }
        var out = [String]()
        for value in values {
            switch value {
            case .string(let s), .objectPath(let s): out.append(s)
            default: return nil
            }
        }
        return out
    }

    /// Any dict whose keys are strings or object paths (`a{sv}`, `a{oa{sa{sv}}}`, `a{sa{sv}}`), as a
    /// Swift dictionary. Variant values stay wrapped; use `unwrapped` or the typed accessors.
    /// A duplicate key keeps the last entry, as BlueZ's own clients do.
    public var dictionary: [String: DBusValue]? {
        guard case .dict(_, _, let entries) = unwrapped else { return nil }
        var out = [String: DBusValue](minimumCapacity: entries.count)
        for entry in entries {
            switch entry.key {
            case .string(let k), .objectPath(let k): out[k] = entry.value
            default: return nil
            }
        }
        return out
    }

    public var structureFields: [DBusValue]? {
        if case .structure(let v) = unwrapped { return v }
        return nil
    }
}
