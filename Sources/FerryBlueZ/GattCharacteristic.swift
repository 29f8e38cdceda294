import FerryCore
import FerryDBus

/// How a write is acknowledged on the air: `request` waits for the peripheral's ATT response,
/// `command` is write-without-response (faster, no delivery proof).
public enum GattWriteType: String, Sendable {
    case request
    case command
}

/// How notifications reach us.
public enum GattNotifyMethod: String, Sendable {
    /// AcquireNotify: a socket with one notification per read; end-of-file on link loss.
    case acquireNotify
    /// StartNotify: each notification is a PropertiesChanged(Value) signal through the bus daemon.
    case startNotify
}

/// One notification event, handed to a `GattNotificationSink`.
public enum GattNotification: Sendable {
    /// The bytes of one notification.
    case value([UInt8])
    /// No more notifications: the link dropped, BlueZ closed the socket, or the subscription was stopped.
    case ended
}

/// Receives notifications where they are read (the AcquireNotify reader thread, or the StartNotify signal
/// task), in order, `.ended` last: for a consumer with its own queue, one hop less per notification than
/// reading `BlueZNotifications.values` in a task of its own and passing each value on.
public typealias GattNotificationSink = @Sendable (GattNotification) -> Void

/// One org.bluez.GattCharacteristic1 object.
public struct BlueZGattCharacteristic: BlueZObject {
    public static let interface = BlueZInterface.gattCharacteristic
    public let path: String
    public let cache: BlueZObjectCache

    public init(path: String, cache: BlueZObjectCache) {
        self.path = path
        self.cache = cache
    }

    public func uuid() async -> String? { await properties()?["UUID"]?.string?.lowercased() }
    /// e.g. ["notify"], ["write", "write-without-response"], ["read"].
    public func flags() async -> [String] { await properties()?["Flags"]?.stringArray ?? [] }
    /// ATT MTU as BlueZ reports it on the characteristic (BlueZ ≥ 5.62), if known.
    public func mtu() async -> UInt16? { await properties()?["MTU"]?.uint16 }

    public func readValue(offset: UInt16 = 0, timeout: Duration = .seconds(10)) async throws -> [UInt8] {
        let options: DBusValue = offset == 0 ? .properties([:]) : .properties(["offset": .uint16(offset)])
        let reply = try await call("ReadValue", [options], timeout: timeout)
        guard let bytes = reply.arguments.first?.bytes else {
            throw BlueZError.unexpectedReply("ReadValue returned \(reply.signature)")
        }
        return bytes
    }

    public func writeValue(_ bytes: [UInt8], type: GattWriteType, timeout: Duration = .seconds(10)) async throws {
        _ = try await call(
            "WriteValue", [.bytes(bytes), .properties(["type": .string(type.rawValue)])], timeout: timeout)
    }

    /// WriteValue with the NO_REPLY_EXPECTED flag: queued on the bus and forgotten. bluetoothd answers nothing
    /// (gdbus drops the reply of a no-reply call), so there is no reply to route, parse or wait for. Only for
    /// writes whose loss the caller covers otherwise; messages on one connection keep their order, so a later
    /// call still reaches bluetoothd after it. Throws only when the connection is closed.
    public func writeValueWithoutReply(_ bytes: [UInt8], type: GattWriteType) throws {
        try mappingErrorsSync {
            try connection.callNoReply(
                destination: service, path: path, interface: BlueZInterface.gattCharacteristic, member: "WriteValue",
                arguments: [.bytes(bytes), .properties(["type": .string(type.rawValue)])])
        }
    }

    /// AcquireNotify → (socket fd, MTU). Bound the call: bluetoothd 5.66 never answers it on a link
    /// whose pairing failed (and later crashes), so the timeout is part of the contract.
    public func acquireNotify(timeout: Duration = .seconds(5)) async throws -> (fd: DBusUnixFD, mtu: UInt16) {
        try await acquire("AcquireNotify", timeout: timeout)
    }

    /// AcquireWrite → (socket fd, MTU): each write() on the fd is one write-without-response.
    public func acquireWrite(timeout: Duration = .seconds(5)) async throws -> (fd: DBusUnixFD, mtu: UInt16) {
        try await acquire("AcquireWrite", timeout: timeout)
    }

    public func startNotify(timeout: Duration = .seconds(10)) async throws {
        _ = try await call("StartNotify", [], timeout: timeout)
    }

    public func stopNotify(timeout: Duration = .seconds(10)) async throws {
        _ = try await call("StopNotify", [], timeout: timeout)
    }

    /// Value updates of this characteristic as PropertiesChanged signals (the StartNotify path).
    /// Subscribe before StartNotify so the first notification is not missed.
    public func valueChanges() async throws -> AsyncStream<[UInt8]> {
        let signals = try await mappingErrors {
            try await connection.signals(
                matching: DBusMatchRule(
                    sender: service, path: path, interface: BlueZInterface.properties, member: "PropertiesChanged",
                    arg0: BlueZInterface.gattCharacteristic))
        }
        let (values, continuation) = AsyncStream<[UInt8]>.makeStream(bufferingPolicy: .unbounded)
        let forward = Task {
            for await signal in signals {
                if signal.arguments.count >= 2, let value = signal.arguments[1].dictionary?["Value"]?.bytes {
                    continuation.yield(value)
                }
            }
            continuation.finish()
        }
        continuation.onTermination = { _ in forward.cancel() }
        return values
    }

    /// Subscribes to notifications, preferring `method` and falling back to the other path:
    /// AcquireNotify → StartNotify when AcquireNotify is refused, unsupported, or does not answer.
    /// With `deliver`, notifications go to it (see `GattNotificationSink`) and the result's `values` is empty; with
    /// `readingOn` as well, an acquired socket is read by that thread (the session's, which `deliver` feeds) between
    /// its other work instead of by a thread of its own.
    public func subscribe(
        preferring method: GattNotifyMethod = .acquireNotify, acquireTimeout: Duration = .seconds(5),
        log: DBusLogSink? = nil, deliver: GattNotificationSink? = nil, readingOn thread: ThreadExecutor? = nil
    ) async throws -> BlueZNotifications {
        if method == .acquireNotify {
            do {
                let (fd, mtu) = try await acquireNotify(timeout: acquireTimeout)
                let reader =
                    if let deliver, let thread {
                        try NotificationSocketReader(fd: fd, mtu: Int(mtu), deliver: deliver, on: thread)
                    } else {
                        try NotificationSocketReader(fd: fd, mtu: Int(mtu), deliver: deliver)
                    }
                return BlueZNotifications(method: .acquireNotify, mtu: mtu, values: reader.values) {
                    reader.stop()
                }
            } catch let error as BlueZError where Self.shouldFallBack(from: error) {
                log?("bluez: AcquireNotify on \(path) failed (\(error)); falling back to StartNotify")
            }
        }
        // One subscription for values AND the events that end the link, so they stay in bus order: a
        // notification sent just before the disconnect is still delivered before the stream ends.
        let devicePath = await self.devicePath()
        let signals = try await mappingErrors {
            try await connection.signals(matching: [
                DBusMatchRule(
                    sender: service, path: path, interface: BlueZInterface.properties, member: "PropertiesChanged",
                    arg0: BlueZInterface.gattCharacteristic),
                DBusMatchRule(
                    sender: service, path: devicePath, interface: BlueZInterface.properties, member: "PropertiesChanged",
                    arg0: BlueZInterface.device),
                .interfacesRemoved(sender: service),
                .nameOwnerChanged(name: service),
            ])
        }
        do {
            try await startNotify()
        } catch let error as BlueZError where error.kind == .inProgress || error.kind == .alreadyExists {
            // Still notifying from a previous session of this client: the subscription is what we want.
            log?("bluez: StartNotify on \(path): \(error); already notifying")
        } catch let error as BlueZError where Self.isHeldAcquired(error) {
            throw BlueZError(
                kind: error.kind, name: error.name,
                message: "\(error.message): bluetoothd still holds \(path)'s notifications for an AcquireNotify whose "
                    + "link ended before it was answered; BlueZ releases them only when bluetoothd restarts "
                    + "(systemctl restart bluetooth) or the device's services are discovered again")
        }
        let mtu = await self.mtu()
        let characteristic = self
        let characteristicPath = path
        let (values, continuation) = AsyncStream<[UInt8]>.makeStream(bufferingPolicy: .unbounded)
        let forward = Task {
            for await signal in signals {
                switch Self.classify(signal, characteristicPath: characteristicPath, devicePath: devicePath) {
                case .value(let bytes):
                    if let deliver { deliver(.value(bytes)) } else { continuation.yield(bytes) }
                case .linkEnded:
                    if let deliver {
                        deliver(.ended)
                        return
                    }
                    continuation.finish()
                case .ignore: continue
                }
            }
            deliver?(.ended)
            continuation.finish()
        }
        if deliver == nil {
            continuation.onTermination = { _ in forward.cancel() }
        } else {
            continuation.finish()  // `values` stays empty: the sink has them
        }
        return BlueZNotifications(method: .startNotify, mtu: mtu, values: values) {
            try? await characteristic.stopNotify()
            forward.cancel()
            continuation.finish()
        }
    }

    enum NotifySignal: Equatable {
        case value([UInt8])
        case linkEnded
        case ignore
    }

    /// What one signal means for a StartNotify subscription: a value, or the end of the link
    /// (device disconnected, characteristic/device object removed, bluetoothd gone).
    static func classify(_ signal: DBusSignal, characteristicPath: String, devicePath: String) -> NotifySignal {
        let args = signal.arguments
        switch signal.member {
        case "PropertiesChanged":
            guard args.count >= 2, let changed = args[1].dictionary else { return .ignore }
            if signal.path == characteristicPath, let bytes = changed["Value"]?.bytes { return .value(bytes) }
            if signal.path == devicePath, changed["Connected"]?.bool == false { return .linkEnded }
            return .ignore
        case "InterfacesRemoved":
            guard let removed = args.first?.objectPath else { return .ignore }
            let gone = removed == characteristicPath || characteristicPath.hasPrefix(removed + "/")
            return gone ? .linkEnded : .ignore
        case "NameOwnerChanged":
            return .linkEnded  // bluetoothd vanished or was replaced: its notify sessions are gone
        default:
            return .ignore
        }
    }

    /// The device this characteristic belongs to: via the Service → Device properties, falling back
    /// to BlueZ's path layout (/org/bluez/hciN/dev_XX/serviceNNNN/charNNNN).
    func devicePath() async -> String {
        if let servicePath = await properties()?["Service"]?.objectPath,
            let device = await cache.properties(servicePath, BlueZInterface.gattService)?["Device"]?.objectPath
        {
            return device
        }
        return path.split(separator: "/").prefix(4).reduce("") { $0 + "/" + $1 }
    }

    /// bluetoothd's refusal of AcquireNotify and StartNotify while an earlier AcquireNotify holds the notifications.
    /// Its message is the only thing that tells it from other NotPermitted refusals. In bluetoothd 5.66 an
    /// AcquireNotify pending when the link ends is never answered nor released (gatt-client.c clears `notify_io`
    /// only when its socket hangs up, and none was made): for a bonded device, whose services outlive the link,
    /// every later subscription is refused this way.
    static func isHeldAcquired(_ error: BlueZError) -> Bool {
        error.kind == .notPermitted && error.message == "Notify acquired"
    }

    /// bluetoothd refuses a WriteValue because a client holds the characteristic's AcquireWrite socket
    /// (gatt-client.c: NotPermitted "Write acquired"); it gives nothing but this text to tell it apart.
    public static func isWriteAcquired(_ error: BlueZError) -> Bool {
        error.kind == .notPermitted && error.message == "Write acquired"
    }

    /// Errors after which StartNotify is worth trying. Others (device gone, bluetoothd gone) would fail
    /// the same way on the other path.
    static func shouldFallBack(from error: BlueZError) -> Bool {
        switch error.kind {
        case .notSupported, .notPermitted, .failed, .inProgress, .timeout, .notAuthorized, .other:
            return true
        default:
            return false
        }
    }

    private func acquire(_ member: String, timeout: Duration) async throws -> (fd: DBusUnixFD, mtu: UInt16) {
        let reply = try await call(member, [.properties([:])], timeout: timeout)
        guard reply.arguments.count == 2, let fd = reply.arguments[0].unixFD, let mtu = reply.arguments[1].uint16 else {
            throw BlueZError.unexpectedReply("\(member) returned \(reply.signature), expected hq")
        }
        return (fd, mtu)
    }

    private func call(_ member: String, _ arguments: [DBusValue], timeout: Duration) async throws -> DBusReply {
        try await mappingErrors {
            try await connection.call(
                destination: service, path: path, interface: BlueZInterface.gattCharacteristic, member: member,
                arguments: arguments, timeout: timeout)
        }
    }
}

/// An active notification subscription. `values` ends when the link drops (AcquireNotify: end of
/// file) or after `stop()`.
public final class BlueZNotifications: Sendable {
    public let method: GattNotifyMethod
    /// ATT MTU if known (always known on the AcquireNotify path).
    public let mtu: UInt16?
    public let values: AsyncStream<[UInt8]>
    private let stopAction: @Sendable () async -> Void

    init(method: GattNotifyMethod, mtu: UInt16?, values: AsyncStream<[UInt8]>, stop: @escaping @Sendable () async -> Void) {
        self.method = method
        self.mtu = mtu
        self.values = values
        self.stopAction = stop
    }

    /// Unsubscribes (closes the socket, or StopNotify).
    public func stop() async { await stopAction() }
}
