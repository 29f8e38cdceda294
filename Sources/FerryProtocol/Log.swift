/// Where long-lived components send their log lines. Components accept a sink; they never build one
/// (the CLI decides: stderr, journald-friendly lines, JSON, or nothing in tests).
public enum LogLevel: Int, Sendable, Comparable, CustomStringConvertible {
    case debug = 0, info, notice, warning, error

    public static func < (a: Self, b: Self) -> Bool { a.rawValue < b.rawValue }

    public var description: String {
        switch self {
        case .debug: "debug"
        case .info: "info"
        case .notice: "notice"
        case .warning: "warning"
        case .error: "error"
        }
    }

    public init?(name: String) {
        switch name.lowercased() {
        case "debug": self = .debug
        case "info": self = .info
        case "notice": self = .notice
        case "warning", "warn": self = .warning
        case "error": self = .error
        default: return nil
        }
    }
}

public protocol LogSink: Sendable {
    func log(_ level: LogLevel, _ message: String)
}

/// Discards everything (tests, and commands whose output is their JSON).
public struct NullLogSink: LogSink {
    public init() {}
    public func log(_ level: LogLevel, _ message: String) {}
}
