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

/// A logger value in swift-log's shape: where lines go (`sink`), the lowest level passed on, and metadata
/// handed in by whoever creates a component (which peripheral, which session), so the component's own
/// messages carry the context without building it into every string. Rendered as the lines always were:
/// `C0:FF:EE:00:00:01: message` (log readers and the test bed match on that shape).
public struct Logger: Sendable {
    public struct Metadata: Sendable, Equatable {
        /// The peripheral's identity address: the line's prefix.
        public var peripheral: String?
        /// A session label, after the peripheral (`C0:…:01 [s3]: …`); nil renders nothing.
        public var session: String?
        public init(peripheral: String? = nil, session: String? = nil) {
            self.peripheral = peripheral
            self.session = session
        }
    }

    public let sink: any LogSink
    public var logLevel: LogLevel
    public var metadata: Metadata

    public init(sink: any LogSink = NullLogSink(), logLevel: LogLevel = .debug, metadata: Metadata = Metadata()) {
        self.sink = sink
        self.logLevel = logLevel
        self.metadata = metadata
    }

    /// The same logger with `peripheral` in its metadata.
    public func with(peripheral: String) -> Logger {
        var copy = self
        copy.metadata.peripheral = peripheral
        return copy
    }

    public func log(_ level: LogLevel, _ message: @autoclosure () -> String) {
        guard level >= logLevel else { return }
        sink.log(level, prefix + message())
    }

    public func debug(_ message: @autoclosure () -> String) { log(.debug, message()) }
    public func info(_ message: @autoclosure () -> String) { log(.info, message()) }
    public func notice(_ message: @autoclosure () -> String) { log(.notice, message()) }
    public func warning(_ message: @autoclosure () -> String) { log(.warning, message()) }
    public func error(_ message: @autoclosure () -> String) { log(.error, message()) }

    private var prefix: String {
        switch (metadata.peripheral, metadata.session) {
        case (nil, nil): ""
        case (let peripheral?, nil): peripheral + ": "
        case (nil, let session?): "[" + session + "]: "
        case (let peripheral?, let session?): peripheral + " [" + session + "]: "
        }
    }
}
