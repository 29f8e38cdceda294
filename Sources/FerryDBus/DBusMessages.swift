// Plain-Swift views of D-Bus messages. They are what crosses from the connection's thread to callers:
// all libdbus pointers stay behind on that thread.

/// A signal received from the bus.
public struct DBusSignal: Sendable {
    /// Unique bus name of the emitter (":1.42"); signals are always stamped with the unique name.
    public var sender: String
    public var path: String
    public var interface: String
    public var member: String
    public var arguments: [DBusValue]
    /// Position of this message in the connection's receive order. Replies carry the same counter, so a
    /// consumer can tell whether a signal was sent before or after a reply it also holds (used by the
    /// BlueZ object cache to drop signals already reflected in a GetManagedObjects snapshot).
    public var receiveIndex: UInt64

    public init(
        sender: String, path: String, interface: String, member: String, arguments: [DBusValue],
        receiveIndex: UInt64 = 0
    ) {
        self.sender = sender
        self.path = path
        self.interface = interface
        self.member = member
        self.arguments = arguments
        self.receiveIndex = receiveIndex
    }
}

/// A successful method return.
public struct DBusReply: Sendable {
    public var sender: String
    public var arguments: [DBusValue]
    public var receiveIndex: UInt64

    /// The signature of the whole body, e.g. "hq" for AcquireNotify.
    public var signature: String { arguments.map(\.signature).joined() }

    public init(sender: String, arguments: [DBusValue], receiveIndex: UInt64 = 0) {
        self.sender = sender
        self.arguments = arguments
        self.receiveIndex = receiveIndex
    }
}

/// A method call addressed to an object this connection exported.
public struct DBusMethodCall: Sendable {
    public var sender: String
    public var path: String
    /// Empty when the caller did not name an interface (allowed by D-Bus for method calls).
    public var interface: String
    public var member: String
    public var arguments: [DBusValue]
    /// True when the caller asked for no reply; the handler's result is then dropped.
    public var noReplyExpected: Bool
    /// The caller's serial for this message. Each call is handled in a task of its own, so handlers may run in
    /// any order; one sender's serials give the order it sent them in.
    public var serial: UInt32

    public var signature: String { arguments.map(\.signature).joined() }
}

/// What an exported object answers.
public enum DBusMethodResult: Sendable {
    case reply([DBusValue])
    case error(DBusError)

    /// Shorthand for the standard "no such method" answer.
    public static func unknownMethod(_ call: DBusMethodCall) -> DBusMethodResult {
        .error(
            DBusError(
                name: DBusError.Name.unknownMethod,
                message: "No method \(call.interface).\(call.member) with signature \"\(call.signature)\" on \(call.path)"))
    }
}

/// Handler for calls to an exported object. Runs as its own task, so it may await (e.g. an Agent1 that
/// waits for a passkey) without blocking the connection.
public typealias DBusMethodHandler = @Sendable (DBusMethodCall) async -> DBusMethodResult

/// A message to send, before it is marshalled on the connection thread.
struct OutgoingMessage: Sendable {
    enum Kind: Sendable {
        case methodCall(destination: String?, interface: String?, member: String)
        case signal(interface: String, member: String)
        case methodReturn(replySerial: UInt32, destination: String?)
        case error(name: String, message: String, replySerial: UInt32, destination: String?)
    }

    var kind: Kind
    var path: String
    var arguments: [DBusValue]
    var noReplyExpected = false

    var containsUnixFD: Bool { arguments.contains { $0.containsUnixFD } }
}

extension DBusValue {
    var containsUnixFD: Bool {
        switch self {
        case .unixFD: return true
        case .array(let element, let values):
            return Self.mayHoldUnixFD(element) && values.contains { $0.containsUnixFD }
        case .dict(_, let valueSignature, let entries):
            return Self.mayHoldUnixFD(valueSignature) && entries.contains { $0.value.containsUnixFD }
        case .structure(let fields): return fields.contains { $0.containsUnixFD }
        case .variant(let inner): return inner.containsUnixFD
        default: return false
        }
    }

    /// Whether values of this signature can carry an fd (`h`, or a variant). Byte by byte: it runs for every
    /// outgoing message (each SYNC_ACK), and String.contains with Foundation loaded is a locale-aware search.
    private static func mayHoldUnixFD(_ signature: String) -> Bool {
        signature.utf8.contains { $0 == UInt8(ascii: "h") || $0 == UInt8(ascii: "v") }
    }
}
