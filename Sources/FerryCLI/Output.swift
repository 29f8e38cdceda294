import FerryCore

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
        FerryCore.writeAll(fd, Array(text.utf8))
    }
}

public final class CapturedOutput: CommandOutput {
    public private(set) var stdout: [String] = []
    public private(set) var stderr: [String] = []
    public init() {}
    public func out(_ text: String) { stdout.append(text) }
    public func err(_ text: String) { stderr.append(text) }
}

/// A table cell: `s` left-aligned in `width` columns, and always at least one space after it.
func pad(_ s: String, _ width: Int) -> String {
    s.count >= width ? s + " " : s + String(repeating: " ", count: width - s.count)
}
