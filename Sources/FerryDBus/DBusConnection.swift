internal import CDBus
import FerryCore
import FoundationEssentials
import Glibc
import Synchronization

/// A private connection to a D-Bus bus, driven by its own thread.
///
/// Every method is safe to call from any task. Calls are always bounded by a timeout. Closing (or
/// dropping the last reference) fails in-flight calls with `org.freedesktop.DBus.Error.Disconnected`
/// and finishes every signal stream.
public final class DBusConnection: Sendable {
    /// This connection's unique bus name (":1.42").
    public let uniqueName: String
    /// Applied to calls that do not pass their own timeout.
    public let defaultCallTimeout: Duration
    private let mailbox: BusMailbox
    private let nextID = Atomic<UInt64>(1)

    private init(uniqueName: String, mailbox: BusMailbox, defaultCallTimeout: Duration) {
        self.uniqueName = uniqueName
        self.mailbox = mailbox
        self.defaultCallTimeout = defaultCallTimeout
    }

    deinit { mailbox.post(.close) }

    public enum Bus: Sendable {
        case system
        case session
        /// A bus at an explicit address, e.g. "unix:path=/tmp/x/bus" (tests use a private dbus-daemon).
        case address(String)
    }

    /// Opens and registers a private connection. Registration (Hello) is bounded by libdbus's own
    /// default timeout (25 s) because it happens before the event loop runs.
    public static func connect(
        to bus: Bus, defaultCallTimeout: Duration = .seconds(25), log: DBusLogSink? = nil
    ) async throws -> DBusConnection {
        let mailbox = try BusMailbox()
        let uniqueName: String = try await withCheckedThrowingContinuation { continuation in
            let started = startThread(name: "ferry-dbus") {
                var error = CDBus.DBusError()
                dbus_error_init(&error)
                defer { dbus_error_free(&error) }
                let raw: OpaquePointer?
                switch bus {
                case .system: raw = dbus_bus_get_private(DBUS_BUS_SYSTEM, &error)
                case .session: raw = dbus_bus_get_private(DBUS_BUS_SESSION, &error)
                case .address(let address):
                    raw = dbus_connection_open_private(address, &error)
                    if let raw, dbus_error_is_set(&error) == 0 {
                        if dbus_bus_register(raw, &error) == 0 {
                            dbus_connection_close(raw)
                            dbus_connection_unref(raw)
                            return resumeWithError(continuation, error, mailbox)
                        }
                    }
                }
                guard let raw else { return resumeWithError(continuation, error, mailbox) }
                let handle = ConnectionHandle(adopting: raw)
                dbus_connection_set_exit_on_disconnect(raw, 0)
                let name = dbus_bus_get_unique_name(raw).map { String(cString: $0) } ?? ""
                continuation.resume(returning: name)
                BusLoop(handle: handle, mailbox: mailbox, log: log).run()
            }
            if !started {
                _ = mailbox.closeAndDrain()
                continuation.resume(
                    throwing: DBusError(name: DBusError.Name.failed, message: "cannot start the connection's thread"))
            }
        }
        return DBusConnection(uniqueName: uniqueName, mailbox: mailbox, defaultCallTimeout: defaultCallTimeout)
    }

    private static func resumeWithError(
        _ continuation: CheckedContinuation<String, any Error>, _ error: CDBus.DBusError, _ mailbox: BusMailbox
    ) {
        _ = mailbox.closeAndDrain()
        let name = error.name.map { String(cString: $0) } ?? DBusError.Name.failed
        let message = error.message.map { String(cString: $0) } ?? "could not connect"
        continuation.resume(throwing: DBusError(name: name, message: message))
    }

    /// False once closed, or once the bus went away.
    public var isConnected: Bool { !mailbox.isClosed }

    /// Closes the connection. Idempotent.
    public func close() { mailbox.post(.close) }

    // MARK: Calls

    /// Calls a method and waits for its reply, at most `timeout` (default: `defaultCallTimeout`).
    /// Throws `DBusError` (the peer's error name verbatim; `org.freedesktop.DBus.Error.NoReply` on
    /// timeout) or `CancellationError`.
    public func call(
        destination: String?, path: String, interface: String?, member: String, arguments: [DBusValue] = [],
        timeout: Duration? = nil
    ) async throws -> DBusReply {
        let pending = PendingCall()
        let outgoing = OutgoingMessage(
            kind: .methodCall(destination: destination, interface: interface, member: member), path: path,
            arguments: arguments)
        return try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { continuation in
                pending.install(continuation)
                if !mailbox.post(.call(outgoing, timeout: timeout ?? defaultCallTimeout, pending)) {
                    pending.finish(.failure(DBusError.disconnected("connection is closed")))
                }
            }
        } onCancel: {
            pending.finish(.failure(CancellationError()))
        }
    }

    /// Sends a method call without waiting for (or asking for) a reply.
    public func callNoReply(
        destination: String?, path: String, interface: String?, member: String, arguments: [DBusValue] = []
    ) throws {
        try Marshal.validatePath(path)
        let outgoing = OutgoingMessage(
            kind: .methodCall(destination: destination, interface: interface, member: member), path: path,
            arguments: arguments, noReplyExpected: true)
        guard mailbox.post(.send(outgoing)) else { throw DBusError.disconnected("connection is closed") }
    }

    /// Emits a signal from this connection.
    public func emitSignal(path: String, interface: String, member: String, arguments: [DBusValue] = []) throws {
        try Marshal.validatePath(path)
        try Marshal.validateInterface(interface)
        try Marshal.validateMember(member)
        let outgoing = OutgoingMessage(
            kind: .signal(interface: interface, member: member), path: path, arguments: arguments)
        guard mailbox.post(.send(outgoing)) else { throw DBusError.disconnected("connection is closed") }
    }

    // MARK: Signals

    /// Subscribes to signals matching any of `rules`. When this returns, the bus daemon has accepted
    /// every rule, so a signal emitted after that point is delivered (no subscribe/emit race).
    /// The stream is unbounded (a signal is never dropped) and ends when the connection closes;
    /// ending it (or dropping it) removes the rules.
    public func signals(matching rules: [DBusMatchRule]) async throws -> AsyncStream<DBusSignal> {
        let id = nextID.wrappingAdd(1, ordering: .relaxed).oldValue
        let (stream, continuation) = AsyncStream<DBusSignal>.makeStream(bufferingPolicy: .unbounded)
        let mailbox = self.mailbox
        continuation.onTermination = { _ in
            mailbox.post(.unsubscribe(id: id))
            for rule in rules {
                mailbox.post(.send(Self.busDriverMessage("RemoveMatch", [.string(rule.ruleString)], noReply: true)))
            }
        }
        // Route locally first, so nothing the daemon sends after accepting the rule is missed.
        guard mailbox.post(.subscribe(id: id, rules, continuation)) else {
            continuation.finish()
            throw DBusError.disconnected("connection is closed")
        }
        do {
            for rule in rules {
                _ = try await call(
                    destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus",
                    interface: "org.freedesktop.DBus", member: "AddMatch", arguments: [.string(rule.ruleString)])
            }
        } catch {
            continuation.finish()
            throw error
        }
        return stream
    }

    public func signals(matching rule: DBusMatchRule) async throws -> AsyncStream<DBusSignal> {
        try await signals(matching: [rule])
    }

    static func busDriverMessage(_ member: String, _ arguments: [DBusValue], noReply: Bool) -> OutgoingMessage {
        OutgoingMessage(
            kind: .methodCall(destination: "org.freedesktop.DBus", interface: "org.freedesktop.DBus", member: member),
            path: "/org/freedesktop/DBus", arguments: arguments, noReplyExpected: noReply)
    }

    // MARK: Exported objects

    /// Answers method calls to `path` with `handler` (replacing any previous handler for it). Calls to
    /// paths nobody exported get libdbus's standard UnknownMethod error. Each call runs in a task of its own, on
    /// `executor` when one is given (an answer that must not wait for a busy cooperative pool), else on the pool.
    public func export(
        path: String, executor: (any TaskExecutor)? = nil, handler: @escaping DBusMethodHandler
    ) throws {
        try Marshal.validatePath(path)
        guard mailbox.post(.export(path: path, handler, executor: executor)) else {
            throw DBusError.disconnected("connection is closed")
        }
    }

    public func unexport(path: String) {
        mailbox.post(.unexport(path: path))
    }

    // MARK: Bus driver helpers

    /// Requests a well-known name; throws unless this connection became its primary owner.
    public func requestName(_ name: String, replaceExisting: Bool = false) async throws {
        try Marshal.validateBusName(name)
        // DBUS_NAME_FLAG_DO_NOT_QUEUE (4), optionally DBUS_NAME_FLAG_REPLACE_EXISTING (2).
        let flags: UInt32 = 4 | (replaceExisting ? 2 : 0)
        let reply = try await callBusDriver("RequestName", [.string(name), .uint32(flags)])
        guard reply.arguments.first?.uint32 == 1 else {  // DBUS_REQUEST_NAME_REPLY_PRIMARY_OWNER
            throw DBusError(
                name: DBusError.Name.failed,
                message: "could not own \(name) (reply \(reply.arguments.first?.description ?? "none"))")
        }
    }

    /// Unique owner of `name`; throws `org.freedesktop.DBus.Error.NameHasNoOwner` if nobody owns it.
    public func nameOwner(_ name: String) async throws -> String {
        let reply = try await callBusDriver("GetNameOwner", [.string(name)])
        guard let owner = reply.arguments.first?.string else {
            throw DBusError(name: DBusError.Name.failed, message: "GetNameOwner returned \(reply.signature)")
        }
        return owner
    }

    public func listNames() async throws -> [String] {
        try await callBusDriver("ListNames", []).arguments.first?.stringArray ?? []
    }

    private func callBusDriver(_ member: String, _ arguments: [DBusValue]) async throws -> DBusReply {
        try await call(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            member: member, arguments: arguments)
    }
}
