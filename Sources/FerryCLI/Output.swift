#if canImport(Glibc)
    import Glibc
#endif

/// Where a command writes: real stdout/stderr for the binary, buffers for in-process tests.
public protocol CommandOutput: AnyObject {
    func out(_ text: String)
    func err(_ text: String)
}

public final class StandardOutput: CommandOutput {
    public init() {}
    public func out(_ text: String) { Self.writeAll(1, text + "\n") }
    public func err(_ text: String) { Self.writeAll(2, text + "\n") }

    /// Unbuffered writes straight to the descriptor: lines reach a pipe (journald, a test) in order at once.
    static func writeAll(_ fd: Int32, _ text: String) {
        var bytes = Array(text.utf8)[...]
        while !bytes.isEmpty {
            let n = bytes.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            if n < 0 && errno == EINTR { continue }
            if n <= 0 { return }
            bytes = bytes.dropFirst(n)
        }
    }
}

public final class CapturedOutput: CommandOutput {
    public private(set) var stdout: [String] = []
    public private(set) var stderr: [String] = []
    public init() {}
    public func out(_ text: String) { stdout.append(text) }
    public func err(_ text: String) { stderr.append(text) }
}

/// Tiny JSON writer for the CLI's documented objects: keys stay in the order given (stable output for
/// scripts and diffs), strings are escaped.
enum JSON {
    indirect case object([(String, JSON)])
    case array([JSON])
    case string(String)
    case int(Int)
    case double(Double)
    case bool(Bool)
    case null

    var text: String {
        switch self {
        case .object(let pairs):
            return "{" + pairs.map { "\(JSON.quote($0.0)):\($0.1.text)" }.joined(separator: ",") + "}"
        case .array(let items): return "[" + items.map(\.text).joined(separator: ",") + "]"
        case .string(let s): return JSON.quote(s)
        case .int(let i): return String(i)
        case .double(let d): return d.isFinite ? String(d) : "null"
        case .bool(let b): return b ? "true" : "false"
        case .null: return "null"
        }
    }

    static func quote(_ s: String) -> String {
        var out = "\""
        for scalar in s.unicodeScalars {
            switch scalar {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case "\r": out += "\\r"
            case "\t": out += "\\t"
            case _ where scalar.value < 0x20:
                let hex = String(scalar.value, radix: 16)
                out += "\\u" + String(repeating: "0", count: 4 - hex.count) + hex
            default: out.unicodeScalars.append(scalar)
            }
        }
        return out + "\""
    }
}

/// A table cell: `s` left-aligned in `width` columns, and always at least one space after it.
func pad(_ s: String, _ width: Int) -> String {
    s.count >= width ? s + " " : s + String(repeating: " ", count: width - s.count)
}
