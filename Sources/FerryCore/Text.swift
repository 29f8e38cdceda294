#if canImport(Glibc)
    import Glibc
#endif

/// printf-style text for numbers ("%.1f", "%.0f s", "%g"): C's own formatter in the C locale, so the text is
/// the same on every machine whatever the operator's locale.
public func cFormat(_ format: String, _ arguments: any CVarArg...) -> String {
    let count = withVaList(arguments) { vsnprintf(nil, 0, format, $0) }
    guard count > 0 else { return "" }
    var buffer = [CChar](repeating: 0, count: Int(count) + 1)
    _ = withVaList(arguments) { vsnprintf(&buffer, buffer.count, format, $0) }
    return String(decoding: buffer[..<Int(count)].map { UInt8(bitPattern: $0) }, as: UTF8.self)
}

extension StringProtocol {
    /// Without the spaces, tabs and line ends at either end (config values, header fields, typed answers).
    public func trimmingWhitespace() -> String {
        guard let first = firstIndex(where: { !$0.isWhitespace }), let last = lastIndex(where: { !$0.isWhitespace })
        else { return "" }
        return String(self[first...last])
    }
}

/// A number as an operator writes it in a config file or on a command line: `10`, not `10.0`; a fraction in
/// the shortest form that reads back exactly (`0.05`). For the bounds and values in error messages.
public func plainNumber(_ value: Double) -> String {
    if value == value.rounded(), let whole = Int64(exactly: value) { return String(whole) }
    return String(value)
}
