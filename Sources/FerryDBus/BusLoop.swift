internal import CDBus
import FerryCore
import FoundationEssentials

#if canImport(Glibc)
    import Glibc
#endif

// The connection thread. It alone touches the DBusConnection*: callers hand it commands through a
// mailbox and are woken through continuations. It sleeps in poll() on libdbus's own watch fds plus an
// eventfd that the mailbox signals, so an idle connection costs no CPU and a new command or an
// incoming message is handled immediately.

/// Log sink for long-lived components: the caller decides where lines go.
public typealias DBusLogSink = @Sendable (String) -> Void

/// Sole owner of one private `DBusConnection*`.
final class ConnectionHandle {
    let pointer: OpaquePointer

    init(adopting pointer: OpaquePointer) {
        self.pointer = pointer
    }

    deinit {
        // A private connection must be closed before its last reference is dropped.
        dbus_connection_close(pointer)
        dbus_connection_unref(pointer)
    }
}

/// One in-flight method call. Its continuation is resumed exactly once: by the reply, the deadline,
/// the connection closing, or task cancellation, whichever comes first.
final class PendingCall: Sendable {
    private struct State {
        var continuation: CheckedContinuation<DBusReply, any Error>?
        var outcome: Result<DBusReply, any Error>?
    }

    private let state = LockedValue(State())

    func install(_ continuation: CheckedContinuation<DBusReply, any Error>) {
        let early: Result<DBusReply, any Error>? = state.withLock { s in
            if let outcome = s.outcome { return outcome }
            s.continuation = continuation
            return nil
        }
        if let early { continuation.resume(with: early) }
    }

    /// First caller wins; later outcomes are dropped.
    func finish(_ result: Result<DBusReply, any Error>) {
        let continuation: CheckedContinuation<DBusReply, any Error>? = state.withLock { s in
            guard s.outcome == nil else { return nil }
            s.outcome = result
            let c = s.continuation
            s.continuation = nil
            return c
        }
        continuation?.resume(with: result)
    }
}

/// Commands from callers to the connection thread.
enum BusCommand: Sendable {
    case call(OutgoingMessage, timeout: Duration, PendingCall)
    /// Fire and forget (signals, replies to exported methods, RemoveMatch).
    case send(OutgoingMessage)
    case subscribe(id: UInt64, [DBusMatchRule], AsyncStream<DBusSignal>.Continuation)
    case unsubscribe(id: UInt64)
    case export(path: String, DBusMethodHandler, executor: (any TaskExecutor)?)
    case unexport(path: String)
    case close
}

/// The only state shared between callers and the connection thread.
final class BusMailbox: Sendable {
    private struct State {
        var commands: [BusCommand] = []
        var closed = false
    }

    private let state = LockedValue(State())
    /// eventfd: written by `post`, read by the loop. Owned here and closed in deinit.
    let wakeFD: Int32

    init() throws(DBusError) {
        let fd = ferry_wakeup_eventfd()
        guard fd >= 0 else { throw DBusError(name: DBusError.Name.failed, message: "eventfd failed: errno \(errno)") }
        wakeFD = fd
    }

    deinit { _ = Glibc.close(wakeFD) }

    /// Queues a command. Returns false once the connection is closed.
    @discardableResult
    func post(_ command: BusCommand) -> Bool {
        let accepted = state.withLock { s -> Bool in
            guard !s.closed else { return false }
            s.commands.append(command)
            return true
        }
        if accepted {
            var one: UInt64 = 1
            _ = withUnsafeBytes(of: &one) { Glibc.write(wakeFD, $0.baseAddress, 8) }
        }
        return accepted
    }

    func drain() -> [BusCommand] {
        state.withLock { s in
            let taken = s.commands
            s.commands.removeAll(keepingCapacity: true)
            return taken
        }
    }

    /// Marks the mailbox closed and returns what was still queued, so the loop can fail it.
    func closeAndDrain() -> [BusCommand] {
        state.withLock { s in
            s.closed = true
            let taken = s.commands
            s.commands = []
            return taken
        }
    }

    var isClosed: Bool { state.withLock { $0.closed } }

    func clearWakeup() {
        var value: UInt64 = 0
        _ = withUnsafeMutableBytes(of: &value) { Glibc.read(wakeFD, $0.baseAddress, 8) }
    }
}

/// Thread-confined loop state. Never leaves the connection thread.
final class BusLoop {
    private final class TimeoutEntry {
        let pointer: OpaquePointer
        /// A `clock` reading.
        var armedAt: Double
        init(pointer: OpaquePointer, armedAt: Double) {
            self.pointer = pointer
            self.armedAt = armedAt
        }
    }

    private struct CallEntry {
        enum Completion {
            case caller(PendingCall)
            /// Internal GetNameOwner lookup that feeds `owners`.
            case ownerLookup(name: String)
        }
        var completion: Completion
        /// A `clock` reading.
        var deadline: Double
    }

    private struct Subscription {
        var rules: [DBusMatchRule]
        var continuation: AsyncStream<DBusSignal>.Continuation
    }

    private let handle: ConnectionHandle
    private var connection: OpaquePointer { handle.pointer }
    private let mailbox: BusMailbox
    private let log: DBusLogSink?
    private let clock = SystemMonotonicClock()

    private var watches: [OpaquePointer] = []
    private var timeouts: [TimeoutEntry] = []
    private var calls: [UInt32: CallEntry] = [:]
    private var subscriptions: [UInt64: Subscription] = [:]
    private var exports: [String: (handler: DBusMethodHandler, executor: (any TaskExecutor)?)] = [:]
    /// Unique owners of the well-known names used as match-rule senders (e.g. org.bluez → ":1.7").
    private var owners: [String: String] = [:]
    private var trackedNames: Set<String> = []
    private var receiveCounter: UInt64 = 0
    private var running = true
    private var closeReason = "connection closed"

    init(handle: ConnectionHandle, mailbox: BusMailbox, log: DBusLogSink?) {
        self.handle = handle
        self.mailbox = mailbox
        self.log = log
    }

    // MARK: Run

    /// Installs the libdbus hooks and runs until closed or disconnected. `self` must outlive this call,
    /// which it does: the thread that calls `run` holds the only reference.
    func run() {
        let context = Unmanaged.passUnretained(self).toOpaque()
        dbus_connection_set_exit_on_disconnect(connection, 0)
        _ = dbus_connection_set_watch_functions(
            connection,
            { watch, data in
                guard let watch, let data else { return 0 }
                Unmanaged<BusLoop>.fromOpaque(data).takeUnretainedValue().watches.append(watch)
                return 1
            },
            { watch, data in
                guard let watch, let data else { return }
                Unmanaged<BusLoop>.fromOpaque(data).takeUnretainedValue().watches.removeAll { $0 == watch }
            },
            nil,  // toggles are picked up by re-reading dbus_watch_get_enabled before every poll
            context, nil)
        _ = dbus_connection_set_timeout_functions(
            connection,
            { timeout, data in
                guard let timeout, let data else { return 0 }
                let loop = Unmanaged<BusLoop>.fromOpaque(data).takeUnretainedValue()
                loop.timeouts.append(TimeoutEntry(pointer: timeout, armedAt: loop.clock.now()))
                return 1
            },
            { timeout, data in
                guard let timeout, let data else { return }
                Unmanaged<BusLoop>.fromOpaque(data).takeUnretainedValue().timeouts.removeAll { $0.pointer == timeout }
            },
            { timeout, data in
                guard let timeout, let data else { return }
                let loop = Unmanaged<BusLoop>.fromOpaque(data).takeUnretainedValue()
                for entry in loop.timeouts where entry.pointer == timeout { entry.armedAt = loop.clock.now() }
            },
            context, nil)
        _ = dbus_connection_add_filter(connection, Self.filter, context, nil)

        while running {
            for command in mailbox.drain() { handle(command) }
            dispatchAll()
            if !running { break }
            if dbus_connection_get_is_connected(connection) == 0 {
                closeReason = "bus connection lost"
                break
            }
            waitForEvents()
        }
        shutdown()
        // Unhook before the handle is released so libdbus never calls back into a dead loop.
        dbus_connection_remove_filter(connection, Self.filter, context)
        _ = dbus_connection_set_watch_functions(connection, nil, nil, nil, nil, nil)
        _ = dbus_connection_set_timeout_functions(connection, nil, nil, nil, nil, nil)
    }

    /// One function pointer for add and remove: libdbus identifies a filter by (function, data).
    private static let filter: DBusHandleMessageFunction = { _, message, data in
        guard let message, let data else { return DBUS_HANDLER_RESULT_NOT_YET_HANDLED }
        return Unmanaged<BusLoop>.fromOpaque(data).takeUnretainedValue().handleIncoming(message)
    }

    private func dispatchAll() {
        while dbus_connection_get_dispatch_status(connection) == DBUS_DISPATCH_DATA_REMAINS {
            _ = dbus_connection_dispatch(connection)
        }
    }

    /// Something in this loop has a deadline (a call awaiting its reply, an enabled libdbus timeout). Only then is
    /// the clock read: a session's notifications and signals wake this loop hundreds of times with nothing timed,
    /// and on a machine whose clock source has no vDSO every read is a system call.
    private var anythingTimed: Bool {
        !calls.isEmpty || timeouts.contains { dbus_timeout_get_enabled($0.pointer) != 0 }
    }

    private func waitForEvents() {
        var nextDeadline: Double? = calls.values.map(\.deadline).min()
        for entry in timeouts where dbus_timeout_get_enabled(entry.pointer) != 0 {
            let due = entry.armedAt + Self.seconds(entry)
            nextDeadline = nextDeadline.map { min($0, due) } ?? due
        }
        var timeoutMS: Int32 = -1
        if let nextDeadline {
            let remaining = nextDeadline - clock.now()
            timeoutMS = remaining <= 0 ? 0 : Int32(min(remaining * 1000, 60_000).rounded(.up))
        }

        var fds = [pollfd(fd: mailbox.wakeFD, events: Int16(POLLIN), revents: 0)]
        var polledWatches: [OpaquePointer] = []
        for watch in watches where dbus_watch_get_enabled(watch) != 0 {
            let flags = dbus_watch_get_flags(watch)
            var events: Int16 = 0
            if flags & DBUS_WATCH_READABLE.rawValue != 0 { events |= Int16(POLLIN) }
            if flags & DBUS_WATCH_WRITABLE.rawValue != 0 { events |= Int16(POLLOUT) }
            fds.append(pollfd(fd: dbus_watch_get_unix_fd(watch), events: events, revents: 0))
            polledWatches.append(watch)
        }

        let ready = poll(&fds, nfds_t(fds.count), timeoutMS)
        if ready < 0 && errno != EINTR {
            log?("dbus: poll failed, errno \(errno)")
        }
        if ready > 0 {
            if fds[0].revents != 0 { mailbox.clearWakeup() }
            for (index, watch) in polledWatches.enumerated() {
                let revents = fds[index + 1].revents
                guard revents != 0, watches.contains(watch) else { continue }  // may be removed meanwhile
                var flags: UInt32 = 0
                if revents & Int16(POLLIN) != 0 { flags |= DBUS_WATCH_READABLE.rawValue }
                if revents & Int16(POLLOUT) != 0 { flags |= DBUS_WATCH_WRITABLE.rawValue }
                if revents & Int16(POLLERR) != 0 { flags |= DBUS_WATCH_ERROR.rawValue }
                if revents & Int16(POLLHUP) != 0 { flags |= DBUS_WATCH_HANGUP.rawValue }
                _ = dbus_watch_handle(watch, flags)
            }
        }

        guard anythingTimed else { return }
        let after = clock.now()
        for entry in timeouts where dbus_timeout_get_enabled(entry.pointer) != 0 {
            if after - entry.armedAt >= Self.seconds(entry) {
                entry.armedAt = after
                _ = dbus_timeout_handle(entry.pointer)
            }
        }
        expireCalls(now: after)
    }

    /// A libdbus timeout's interval, in seconds.
    private static func seconds(_ entry: TimeoutEntry) -> Double {
        Double(dbus_timeout_get_interval(entry.pointer)) / 1000
    }

    private func expireCalls(now: Double) {
        let expired = calls.filter { $0.value.deadline <= now }
        for (serial, entry) in expired {
            calls[serial] = nil
            if case .caller(let pending) = entry.completion {
                pending.finish(
                    .failure(DBusError(name: DBusError.Name.noReply, message: "no reply within the call timeout")))
            }
        }
    }

    private func shutdown() {
        running = false
        let error = DBusError.disconnected(closeReason)
        for command in mailbox.closeAndDrain() {
            if case .call(_, _, let pending) = command { pending.finish(.failure(error)) }
            if case .subscribe(_, _, let continuation) = command { continuation.finish() }
        }
        for entry in calls.values {
            if case .caller(let pending) = entry.completion { pending.finish(.failure(error)) }
        }
        calls.removeAll()
        for subscription in subscriptions.values { subscription.continuation.finish() }
        subscriptions.removeAll()
        exports.removeAll()
        log?("dbus: \(closeReason)")
    }

    // MARK: Commands

    private func handle(_ command: BusCommand) {
        switch command {
        case .call(let outgoing, let timeout, let pending):
            do {
                let serial = try send(outgoing)
                calls[serial] = CallEntry(completion: .caller(pending), deadline: clock.deadline(after: timeout))
            } catch {
                pending.finish(.failure(error))
            }
        case .send(let outgoing):
            do { _ = try send(outgoing) } catch { log?("dbus: could not send \(outgoing.kind): \(error)") }
        case .subscribe(let id, let rules, let continuation):
            subscriptions[id] = Subscription(rules: rules, continuation: continuation)
            for rule in rules { if let sender = rule.sender { track(sender) } }
        case .unsubscribe(let id):
            subscriptions[id]?.continuation.finish()
            subscriptions[id] = nil
        case .export(let path, let handler, let executor):
            exports[path] = (handler, executor)
        case .unexport(let path):
            exports[path] = nil
        case .close:
            closeReason = "closed by its owner"
            running = false
        }
    }

    /// Marshals and queues one message; libdbus writes it when the socket is writable.
    private func send(_ outgoing: OutgoingMessage) throws(DBusError) -> UInt32 {
        if outgoing.containsUnixFD && dbus_connection_can_send_type(connection, FERRY_DBUS_TYPE_UNIX_FD) == 0 {
            throw DBusError(name: DBusError.Name.notSupported, message: "this connection cannot pass unix fds")
        }
        let message = try Marshal.build(outgoing)
        var serial: UInt32 = 0
        guard dbus_connection_send(connection, message.pointer, &serial) != 0 else {
            throw DBusError(name: DBusError.Name.noMemory, message: "dbus_connection_send failed")
        }
        return serial
    }

    /// Starts following the owner of a well-known name so local sender matching works: signals are
    /// stamped with the emitter's unique name, never the well-known one.
    private func track(_ name: String) {
        guard !name.hasPrefix(":"), name != "org.freedesktop.DBus", !trackedNames.contains(name) else { return }
        trackedNames.insert(name)
        // Order matters: the AddMatch is processed by the daemon before GetNameOwner, so no owner change
        // can fall between the answer and the first NameOwnerChanged we receive.
        let driver = "org.freedesktop.DBus"
        let addMatch = OutgoingMessage(
            kind: .methodCall(destination: driver, interface: driver, member: "AddMatch"),
            path: "/org/freedesktop/DBus",
            arguments: [.string(DBusMatchRule.nameOwnerChanged(name: name).ruleString)], noReplyExpected: true)
        let lookup = OutgoingMessage(
            kind: .methodCall(destination: driver, interface: driver, member: "GetNameOwner"),
            path: "/org/freedesktop/DBus", arguments: [.string(name)])
        do {
            _ = try send(addMatch)
            let serial = try send(lookup)
            calls[serial] = CallEntry(completion: .ownerLookup(name: name), deadline: clock.deadline(after: .seconds(25)))
        } catch {
            log?("dbus: cannot track owner of \(name): \(error)")
        }
    }

    // MARK: Incoming

    private func handleIncoming(_ message: OpaquePointer) -> DBusHandlerResult {
        receiveCounter += 1
        switch dbus_message_get_type(message) {
        case DBUS_MESSAGE_TYPE_METHOD_RETURN, DBUS_MESSAGE_TYPE_ERROR:
            return handleReply(message)
        case DBUS_MESSAGE_TYPE_SIGNAL:
            return handleSignal(message)
        case DBUS_MESSAGE_TYPE_METHOD_CALL:
            return handleMethodCall(message)
        default:
            return DBUS_HANDLER_RESULT_NOT_YET_HANDLED
        }
    }

    private func string(_ pointer: UnsafePointer<CChar>?) -> String {
        pointer.map { String(cString: $0) } ?? ""
    }

    private func handleReply(_ message: OpaquePointer) -> DBusHandlerResult {
        let serial = dbus_message_get_reply_serial(message)
        guard let entry = calls.removeValue(forKey: serial) else { return DBUS_HANDLER_RESULT_NOT_YET_HANDLED }
        let result: Result<DBusReply, any Error>
        do {
            let arguments = try Marshal.arguments(of: message)
            if dbus_message_get_type(message) == DBUS_MESSAGE_TYPE_ERROR {
                result = .failure(
                    DBusError(name: string(dbus_message_get_error_name(message)), message: arguments.first?.string ?? ""))
            } else {
                result = .success(
                    DBusReply(
                        sender: string(dbus_message_get_sender(message)), arguments: arguments,
                        receiveIndex: receiveCounter))
            }
        } catch {
            result = .failure(error)
        }
        switch entry.completion {
        case .caller(let pending):
            pending.finish(result)
        case .ownerLookup(let name):
            if case .success(let reply) = result, let owner = reply.arguments.first?.string {
                owners[name] = owner
            }
        }
        return DBUS_HANDLER_RESULT_HANDLED
    }

    private func handleSignal(_ message: OpaquePointer) -> DBusHandlerResult {
        let interface = string(dbus_message_get_interface(message))
        let member = string(dbus_message_get_member(message))
        let path = string(dbus_message_get_path(message))
        if interface == "org.freedesktop.DBus.Local" && member == "Disconnected" {
            closeReason = "bus connection lost"
            running = false
            return DBUS_HANDLER_RESULT_HANDLED
        }
        let arguments: [DBusValue]
        do {
            arguments = try Marshal.arguments(of: message)
        } catch {
            log?("dbus: undecodable signal \(interface).\(member) on \(path): \(error)")
            return DBUS_HANDLER_RESULT_NOT_YET_HANDLED
        }
        let signal = DBusSignal(
            sender: string(dbus_message_get_sender(message)), path: path, interface: interface, member: member,
            arguments: arguments, receiveIndex: receiveCounter)

        if signal.sender == "org.freedesktop.DBus", member == "NameOwnerChanged", arguments.count == 3,
            let name = arguments[0].string, trackedNames.contains(name), let newOwner = arguments[2].string
        {
            owners[name] = newOwner.isEmpty ? nil : newOwner
        }

        for subscription in subscriptions.values {
            let matched = subscription.rules.contains { rule in
                rule.matches(signal, senderOwner: rule.sender.flatMap { owners[$0] })
            }
            if matched { subscription.continuation.yield(signal) }
        }
        // Other filters (none today) may also want signals.
        return DBUS_HANDLER_RESULT_NOT_YET_HANDLED
    }

    private func handleMethodCall(_ message: OpaquePointer) -> DBusHandlerResult {
        let path = string(dbus_message_get_path(message))
        guard let (handler, executor) = exports[path] else {
            // libdbus answers UnknownMethod for calls no filter handled.
            return DBUS_HANDLER_RESULT_NOT_YET_HANDLED
        }
        let sender = string(dbus_message_get_sender(message))
        let serial = dbus_message_get_serial(message)
        let noReply = dbus_message_get_no_reply(message) != 0
        let replyDestination: String? = sender.isEmpty ? nil : sender
        let arguments: [DBusValue]
        do {
            arguments = try Marshal.arguments(of: message)
        } catch {
            if !noReply {
                _ = try? send(
                    OutgoingMessage(
                        kind: .error(
                            name: error.name, message: error.message, replySerial: serial,
                            destination: replyDestination), path: "/", arguments: []))
            }
            return DBUS_HANDLER_RESULT_HANDLED
        }
        let call = DBusMethodCall(
            sender: sender, path: path, interface: string(dbus_message_get_interface(message)),
            member: string(dbus_message_get_member(message)), arguments: arguments, noReplyExpected: noReply,
            serial: serial)
        let mailbox = self.mailbox
        // The handler may await; run it off this thread and post the answer back as a command.
        Task(executorPreference: executor) {
            let result = await handler(call)
            guard !noReply else { return }
            let kind: OutgoingMessage.Kind
            var replyArguments: [DBusValue] = []
            switch result {
            case .reply(let values):
                kind = .methodReturn(replySerial: serial, destination: replyDestination)
                replyArguments = values
            case .error(let error):
                kind = .error(
                    name: error.name, message: error.message, replySerial: serial, destination: replyDestination)
            }
            mailbox.post(.send(OutgoingMessage(kind: kind, path: "/", arguments: replyArguments)))
        }
        return DBUS_HANDLER_RESULT_HANDLED
    }
}
