internal import CDBus

// Conversion between DBusValue and libdbus messages. Used only on the connection thread.
//
// libdbus treats malformed input (an invalid object path, a string with NUL, a wrong signature) as a
// programming error and ABORTS the process by default. Everything that comes from Swift callers is
// therefore validated here first and turned into an InvalidArgs DBusError instead.

/// Sole owner of one `DBusMessage*` reference.
final class MessageHandle {
    let pointer: OpaquePointer

    /// Takes over one reference (e.g. from dbus_message_new_*).
    init(adopting pointer: OpaquePointer) {
        self.pointer = pointer
    }

    deinit { dbus_message_unref(pointer) }
}

enum Marshal {
    // MARK: Validation

    static func validatePath(_ path: String) throws(DBusError) {
        guard path.withCString({ dbus_validate_path($0, nil) }) != 0 else {
            throw .invalidArgs("invalid object path \"\(path)\"")
        }
    }

    static func validateInterface(_ name: String) throws(DBusError) {
        guard name.withCString({ dbus_validate_interface($0, nil) }) != 0 else {
            throw .invalidArgs("invalid interface name \"\(name)\"")
        }
    }

    static func validateMember(_ name: String) throws(DBusError) {
        guard name.withCString({ dbus_validate_member($0, nil) }) != 0 else {
            throw .invalidArgs("invalid member name \"\(name)\"")
        }
    }

    static func validateBusName(_ name: String) throws(DBusError) {
        guard name.withCString({ dbus_validate_bus_name($0, nil) }) != 0 else {
            throw .invalidArgs("invalid bus name \"\(name)\"")
        }
    }

    static func validateErrorName(_ name: String) throws(DBusError) {
        guard name.withCString({ dbus_validate_error_name($0, nil) }) != 0 else {
            throw .invalidArgs("invalid error name \"\(name)\"")
        }
    }

    static func isSingleCompleteType(_ signature: String) -> Bool {
        signature.withCString { dbus_signature_validate_single($0, nil) } != 0
    }

    private static func validateString(_ s: String) throws(DBusError) {
        // D-Bus strings are NUL-terminated on the wire; Swift strings may contain NUL.
        guard !s.utf8.contains(0), s.withCString({ dbus_validate_utf8($0, nil) }) != 0 else {
            throw .invalidArgs("string contains NUL or invalid UTF-8")
        }
    }

    /// Checks a value tree against the rules libdbus would otherwise abort on.
    static func validate(_ value: DBusValue) throws(DBusError) {
        switch value {
        case .string(let s): try validateString(s)
        case .objectPath(let p): try validatePath(p)
        case .signature(let g):
            guard !g.utf8.contains(0), g.withCString({ dbus_signature_validate($0, nil) }) != 0 else {
                throw .invalidArgs("invalid signature \"\(g)\"")
            }
        case .unixFD(let fd):
            guard fd.rawValue >= 0 else { throw .invalidArgs("unix fd was already taken or closed") }
        case .array(let element, let values):
            guard isSingleCompleteType(element), !element.hasPrefix("{") else {
                throw .invalidArgs("invalid array element signature \"\(element)\"")
            }
            for v in values {
                guard v.signature == element else {
                    throw .invalidArgs("array of \"\(element)\" holds a \"\(v.signature)\"")
                }
                try validate(v)
            }
        case .dict(let key, let valueSig, let entries):
            guard key.utf8.count == 1, let k = key.utf8.first,
                dbus_type_is_basic(Int32(k)) != 0,
                isSingleCompleteType(valueSig)
            else { throw .invalidArgs("invalid dict signature a{\(key)\(valueSig)}") }
            for entry in entries {
                guard entry.key.signature == key, entry.value.signature == valueSig else {
                    throw .invalidArgs(
                        "dict a{\(key)\(valueSig)} holds {\(entry.key.signature)\(entry.value.signature)}")
                }
                try validate(entry.key)
                try validate(entry.value)
            }
        case .structure(let fields):
            guard !fields.isEmpty else { throw .invalidArgs("D-Bus does not allow an empty struct") }
            for f in fields { try validate(f) }
        case .variant(let inner): try validate(inner)
        default: break
        }
    }

    // MARK: Building

    static func build(_ outgoing: OutgoingMessage) throws(DBusError) -> MessageHandle {
        try validatePath(outgoing.path)
        for argument in outgoing.arguments { try validate(argument) }

        let raw: OpaquePointer?
        switch outgoing.kind {
        case .methodCall(let destination, let interface, let member):
            if let destination { try validateBusName(destination) }
            if let interface { try validateInterface(interface) }
            try validateMember(member)
            raw = withOptionalCString(destination) { dest in
                withOptionalCString(interface) { iface in
                    outgoing.path.withCString { path in
                        member.withCString { dbus_message_new_method_call(dest, path, iface, $0) }
                    }
                }
            }
        case .signal(let interface, let member):
            try validateInterface(interface)
            try validateMember(member)
            raw = outgoing.path.withCString { path in
                interface.withCString { iface in member.withCString { dbus_message_new_signal(path, iface, $0) } }
            }
        case .methodReturn(let replySerial, let destination):
            if let destination { try validateBusName(destination) }
            raw = dbus_message_new(DBUS_MESSAGE_TYPE_METHOD_RETURN)
            if let raw {
                dbus_message_set_reply_serial(raw, replySerial)
                if let destination { _ = destination.withCString { dbus_message_set_destination(raw, $0) } }
            }
        case .error(let name, _, let replySerial, let destination):
            try validateErrorName(name)
            if let destination { try validateBusName(destination) }
            raw = dbus_message_new(DBUS_MESSAGE_TYPE_ERROR)
            if let raw {
                _ = name.withCString { dbus_message_set_error_name(raw, $0) }
                dbus_message_set_reply_serial(raw, replySerial)
                if let destination { _ = destination.withCString { dbus_message_set_destination(raw, $0) } }
            }
        }
        guard let raw else { throw DBusError(name: DBusError.Name.noMemory, message: "dbus_message_new failed") }
        let handle = MessageHandle(adopting: raw)
        if outgoing.noReplyExpected { dbus_message_set_no_reply(raw, 1) }

        var iter = DBusMessageIter()
        dbus_message_iter_init_append(raw, &iter)
        if case .error(_, let message, _, _) = outgoing.kind {
            try append(.string(String(message.filter { $0 != "\0" })), to: &iter)
        }
        for argument in outgoing.arguments { try append(argument, to: &iter) }
        return handle
    }

    private static func withOptionalCString<R>(_ s: String?, _ body: (UnsafePointer<CChar>?) -> R) -> R {
        guard let s else { return body(nil) }
        return s.withCString { body($0) }
    }

    private static func appendBasic<T: BitwiseCopyable>(
        _ type: Int32, _ value: T, to iter: inout DBusMessageIter
    ) throws(DBusError) {
        var copy = value
        let ok = withUnsafeBytes(of: &copy) { dbus_message_iter_append_basic(&iter, type, $0.baseAddress) }
        guard ok != 0 else { throw outOfMemory() }
    }

    private static func appendString(_ type: Int32, _ s: String, to iter: inout DBusMessageIter) throws(DBusError) {
        let ok = s.withCString { cString -> dbus_bool_t in
            var pointer: UnsafePointer<CChar>? = cString
            return dbus_message_iter_append_basic(&iter, type, &pointer)
        }
        guard ok != 0 else { throw outOfMemory() }
    }

    private static func outOfMemory() -> DBusError {
        DBusError(name: DBusError.Name.noMemory, message: "libdbus could not append an argument")
    }

    /// Appends one already-validated value.
    static func append(_ value: DBusValue, to iter: inout DBusMessageIter) throws(DBusError) {
        switch value {
        case .byte(let v): try appendBasic(FERRY_DBUS_TYPE_BYTE, v, to: &iter)
        case .bool(let v): try appendBasic(FERRY_DBUS_TYPE_BOOLEAN, dbus_bool_t(v ? 1 : 0), to: &iter)
        case .int16(let v): try appendBasic(FERRY_DBUS_TYPE_INT16, v, to: &iter)
        case .uint16(let v): try appendBasic(FERRY_DBUS_TYPE_UINT16, v, to: &iter)
        case .int32(let v): try appendBasic(FERRY_DBUS_TYPE_INT32, v, to: &iter)
        case .uint32(let v): try appendBasic(FERRY_DBUS_TYPE_UINT32, v, to: &iter)
        case .int64(let v): try appendBasic(FERRY_DBUS_TYPE_INT64, v, to: &iter)
        case .uint64(let v): try appendBasic(FERRY_DBUS_TYPE_UINT64, v, to: &iter)
        case .double(let v): try appendBasic(FERRY_DBUS_TYPE_DOUBLE, v, to: &iter)
        case .string(let s): try appendString(FERRY_DBUS_TYPE_STRING, s, to: &iter)
        case .objectPath(let s): try appendString(FERRY_DBUS_TYPE_OBJECT_PATH, s, to: &iter)
        case .signature(let s): try appendString(FERRY_DBUS_TYPE_SIGNATURE, s, to: &iter)
        case .unixFD(let fd):
            // libdbus dups the descriptor, so the caller's DBusUnixFD keeps ownership of its own copy.
            try appendBasic(FERRY_DBUS_TYPE_UNIX_FD, fd.rawValue, to: &iter)
        case .array(let element, let values):
            try container(FERRY_DBUS_TYPE_ARRAY, element, &iter) { (sub) throws(DBusError) in
                if element == "y" {
                    // Fixed-array fast path: GATT payloads are byte arrays.
                    let bytes = values.map { v -> UInt8 in
                        if case .byte(let b) = v { return b }
                        return 0
                    }
                    let ok = bytes.withUnsafeBufferPointer { buffer -> dbus_bool_t in
                        var base: UnsafePointer<UInt8>? = buffer.baseAddress
                        return dbus_message_iter_append_fixed_array(
                            &sub, FERRY_DBUS_TYPE_BYTE, &base, Int32(buffer.count))
                    }
                    guard ok != 0 else { throw outOfMemory() }
                } else {
                    for v in values { try append(v, to: &sub) }
                }
            }
        case .dict(let key, let valueSig, let entries):
            try container(FERRY_DBUS_TYPE_ARRAY, "{" + key + valueSig + "}", &iter) { (sub) throws(DBusError) in
                for entry in entries {
                    try container(FERRY_DBUS_TYPE_DICT_ENTRY, nil, &sub) { (pair) throws(DBusError) in
                        try append(entry.key, to: &pair)
                        try append(entry.value, to: &pair)
                    }
                }
            }
        case .structure(let fields):
            try container(FERRY_DBUS_TYPE_STRUCT, nil, &iter) { (sub) throws(DBusError) in
                for f in fields { try append(f, to: &sub) }
            }
        case .variant(let inner):
            try container(FERRY_DBUS_TYPE_VARIANT, inner.signature, &iter) { (sub) throws(DBusError) in
                try append(inner, to: &sub)
            }
        }
    }

    private static func container(
        _ type: Int32, _ signature: String?, _ iter: inout DBusMessageIter,
        _ body: (inout DBusMessageIter) throws(DBusError) -> Void
    ) throws(DBusError) {
        var sub = DBusMessageIter()
        let opened: dbus_bool_t
        if let signature {
            opened = signature.withCString { dbus_message_iter_open_container(&iter, type, $0, &sub) }
        } else {
            opened = dbus_message_iter_open_container(&iter, type, nil, &sub)
        }
        guard opened != 0 else { throw outOfMemory() }
        do {
            try body(&sub)
        } catch {
            dbus_message_iter_abandon_container(&iter, &sub)
            throw error
        }
        guard dbus_message_iter_close_container(&iter, &sub) != 0 else { throw outOfMemory() }
    }

    // MARK: Decoding

    /// All arguments of a received message.
    static func arguments(of message: OpaquePointer) throws(DBusError) -> [DBusValue] {
        var iter = DBusMessageIter()
        guard dbus_message_iter_init(message, &iter) != 0 else { return [] }
        var values: [DBusValue] = []
        while dbus_message_iter_get_arg_type(&iter) != FERRY_DBUS_TYPE_INVALID {
            values.append(try decode(&iter))
            dbus_message_iter_next(&iter)
        }
        return values
    }

    private static func basic<T: BitwiseCopyable>(_ iter: inout DBusMessageIter, _ zero: T) -> T {
        var value = zero
        withUnsafeMutableBytes(of: &value) { dbus_message_iter_get_basic(&iter, $0.baseAddress) }
        return value
    }

    private static func basicString(_ iter: inout DBusMessageIter) -> String {
        var pointer: UnsafePointer<CChar>? = nil
        dbus_message_iter_get_basic(&iter, &pointer)
        return pointer.map { String(cString: $0) } ?? ""
    }

    /// Signature of the argument the iterator points at.
    private static func currentSignature(_ iter: inout DBusMessageIter) -> String {
        guard let raw = dbus_message_iter_get_signature(&iter) else { return "" }
        defer { dbus_free(raw) }
        return String(cString: raw)
    }

    static func decode(_ iter: inout DBusMessageIter) throws(DBusError) -> DBusValue {
        let type = dbus_message_iter_get_arg_type(&iter)
        switch type {
        case FERRY_DBUS_TYPE_BYTE: return .byte(basic(&iter, UInt8(0)))
        case FERRY_DBUS_TYPE_BOOLEAN: return .bool(basic(&iter, dbus_bool_t(0)) != 0)
        case FERRY_DBUS_TYPE_INT16: return .int16(basic(&iter, Int16(0)))
        case FERRY_DBUS_TYPE_UINT16: return .uint16(basic(&iter, UInt16(0)))
        case FERRY_DBUS_TYPE_INT32: return .int32(basic(&iter, Int32(0)))
        case FERRY_DBUS_TYPE_UINT32: return .uint32(basic(&iter, UInt32(0)))
        case FERRY_DBUS_TYPE_INT64: return .int64(basic(&iter, Int64(0)))
        case FERRY_DBUS_TYPE_UINT64: return .uint64(basic(&iter, UInt64(0)))
        case FERRY_DBUS_TYPE_DOUBLE: return .double(basic(&iter, Double(0)))
        case FERRY_DBUS_TYPE_STRING: return .string(basicString(&iter))
        case FERRY_DBUS_TYPE_OBJECT_PATH: return .objectPath(basicString(&iter))
        case FERRY_DBUS_TYPE_SIGNATURE: return .signature(basicString(&iter))
        case FERRY_DBUS_TYPE_UNIX_FD:
            // libdbus hands out a fresh duplicate that the caller owns.
            let fd = basic(&iter, Int32(-1))
            guard fd >= 0 else { throw .invalidArgs("message carried an unusable unix fd") }
            return .unixFD(DBusUnixFD(adopting: fd))
        case FERRY_DBUS_TYPE_VARIANT:
            var sub = DBusMessageIter()
            dbus_message_iter_recurse(&iter, &sub)
            return .variant(try decode(&sub))
        case FERRY_DBUS_TYPE_STRUCT:
            var sub = DBusMessageIter()
            dbus_message_iter_recurse(&iter, &sub)
            var fields: [DBusValue] = []
            while dbus_message_iter_get_arg_type(&sub) != FERRY_DBUS_TYPE_INVALID {
                fields.append(try decode(&sub))
                dbus_message_iter_next(&sub)
            }
            return .structure(fields)
        case FERRY_DBUS_TYPE_ARRAY:
            // The full signature ("a{sv}", "ay") is read at this level because an empty array has no
            // element to inspect.
            let signature = currentSignature(&iter)
            let elementSignature = String(signature.dropFirst())
            let elementType = dbus_message_iter_get_element_type(&iter)
            var sub = DBusMessageIter()
            dbus_message_iter_recurse(&iter, &sub)
            if elementType == FERRY_DBUS_TYPE_DICT_ENTRY {
                let inner = elementSignature.dropFirst().dropLast()  // strip "{" "}"
                let keySignature = String(inner.prefix(1))
                let valueSignature = String(inner.dropFirst())
                var entries: [DBusDictEntry] = []
                while dbus_message_iter_get_arg_type(&sub) != FERRY_DBUS_TYPE_INVALID {
                    var pair = DBusMessageIter()
                    dbus_message_iter_recurse(&sub, &pair)
                    let key = try decode(&pair)
                    dbus_message_iter_next(&pair)
                    let value = try decode(&pair)
                    entries.append(DBusDictEntry(key: key, value: value))
                    dbus_message_iter_next(&sub)
                }
                return .dict(keySignature: keySignature, valueSignature: valueSignature, entries)
            }
            if elementType == FERRY_DBUS_TYPE_BYTE {
                var base: UnsafePointer<UInt8>? = nil
                var count: Int32 = 0
                dbus_message_iter_get_fixed_array(&sub, &base, &count)
                guard let base, count > 0 else { return .array(elementSignature: "y", []) }
                let buffer = UnsafeBufferPointer(start: base, count: Int(count))
                return .array(elementSignature: "y", buffer.map { .byte($0) })
            }
            var values: [DBusValue] = []
            while dbus_message_iter_get_arg_type(&sub) != FERRY_DBUS_TYPE_INVALID {
                values.append(try decode(&sub))
                dbus_message_iter_next(&sub)
            }
            return .array(elementSignature: elementSignature, values)
        default:
            throw .invalidArgs("unsupported D-Bus type code \(type)")
        }
    }
}
