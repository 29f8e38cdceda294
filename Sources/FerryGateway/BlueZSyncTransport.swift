import FerryCore
import FerryBlueZ
import FerryDBus
import FerryProtocol
import FerrySync

#if canImport(Glibc)
    import Glibc
#endif

/// The Sync service of one connected peripheral, over BlueZ. Notifications are pushed into the driver's
/// event queue (`LinkEvents`) so bytes, link loss, timers and stop requests reach the session in one order.
public final class BlueZSyncTransport: SyncTransport {
    public let device: BlueZDevice
    public let service: BlueZGattService
    private let data: BlueZGattCharacteristic
    private let control: BlueZGattCharacteristic
    private let streamInfo: BlueZGattCharacteristic?
    private let events: LinkEvents
    private let preferredNotify: GattNotifyMethod
    /// The session's thread, which reads an acquired notification socket itself (nil: a reader thread does).
    private let readingThread: ThreadExecutor?
    private let log: any LogSink
    private var notifications: BlueZNotifications?
    public private(set) var notifyMethod: GattNotifyMethod?
    public private(set) var mtu: UInt16?
    /// How SYNC_ACKs go out (chosen while subscribing; nil before).
    public private(set) var ackWrite: AckWritePath?
    /// CONTROL's AcquireWrite socket (`.writeCommand` only): while held, each SYNC_ACK is one send() on it, no
    /// D-Bus message through dbus-daemon. Given back before every write with response (`releaseAckSocket`).
    private enum AckSocket {
        /// Not acquired yet in this session.
        case none
        case held(DBusUnixFD)
        /// Closed for a write with response; the next ACK acquires it again.
        case released
        /// AcquireWrite was refused or the socket failed: the rest of the session's ACKs go as WriteValue
        /// commands. `wasHeld`: this session held it before.
        case unavailable(wasHeld: Bool)

        /// bluetoothd may still believe we hold it: it sees a close in its own main loop, not at once.
        var mayLinger: Bool {
            switch self {
            case .held, .released, .unavailable(wasHeld: true): true
            case .none, .unavailable(wasHeld: false): false
            }
        }
    }
    private var ackSocket = AckSocket.none
    /// What is known of the last SYNC_ACK's delivery. `disconnect()` confirms an unconfirmed one before ending
    /// the link, and uses the kernel's Disconnect only after a confirmed one.
    private enum LastAck: Equatable {
        /// None written yet, or the last write with response failed.
        case none
        /// Written without response: its bytes, to write once more with one.
        case unconfirmed([UInt8])
        /// A write with response succeeded: it arrived.
        case confirmed
    }
    private var lastAck = LastAck.none
    /// How the last `disconnect()` ended the link.
    public private(set) var teardown: Teardown?

    /// How `disconnect()` took the link down.
    public enum Teardown: String, Sendable {
        /// The kernel's management Disconnect: immediate.
        case kernel
        /// Device1.Disconnect: bluetoothd's DISCONNECT_TIMER (2 s) first. Without CAP_NET_ADMIN, or when the
        /// kernel had no such link.
        case bluez
    }

    /// How a SYNC_ACK reaches the peripheral. A lost ACK costs nothing: the next one names a higher cursor,
    /// and a peripheral left waiting is re-asked by the stall rule (SYNC_REQ, which stays a write with
    /// response). So ACKs are written without response when CONTROL allows it.
    public enum AckWritePath: String, Sendable {
        /// Write-without-response: through CONTROL's AcquireWrite socket, or as a WriteValue command (a D-Bus
        /// call without reply) when the socket cannot be had.
        case writeCommand
        /// WriteValue type "request": CONTROL lacks write-without-response.
        case writeRequest
    }

    /// Finds the Sync characteristics under `service`. Throws `.notFound` if DATA or CONTROL is missing.
    public init(
        device: BlueZDevice, service: BlueZGattService, events: LinkEvents,
        preferredNotify: GattNotifyMethod = .acquireNotify, readingOn thread: ThreadExecutor? = nil, log: any LogSink
    ) async throws {
        self.device = device
        self.service = service
        self.events = events
        self.readingThread = thread
        self.preferredNotify = preferredNotify
        self.log = log
        data = try await service.requireCharacteristic(uuid: SyncProfile.dataUUID)
        control = try await service.requireCharacteristic(uuid: SyncProfile.controlUUID)
        var info = await service.characteristic(uuid: SyncProfile.streamInfoUUID)
        if info == nil {
            // STREAM_INFO is optional, but BlueZ can export it a moment after DATA and CONTROL. Seen in the test
            // bed: a session started without it ran as epoch 0, and the next one (with the real epoch) recorded
            // the events it had already stored as a GAP. Give it a short grace before deciding it is absent.
            _ = try? await device.waitUntilServicesResolved(
                serviceUUID: SyncProfile.serviceUUID,
                characteristicUUIDs: [SyncProfile.dataUUID, SyncProfile.controlUUID, SyncProfile.streamInfoUUID],
                timeout: .seconds(2))
            info = await service.characteristic(uuid: SyncProfile.streamInfoUUID)
        }
        streamInfo = info
        // With STREAM_INFO the session reads it first: subscribe meanwhile, on a bonded device's link only. Without
        // a bond, a peripheral that wants encryption refuses the read and the session ends with the AcquireNotify
        // still pending, and bluetoothd 5.66 keeps DATA's notifications "acquired" from then on: every later
        // session, after pairing too, failed with "Notify acquired" until bluetoothd restarted (test bed,
        // sync_pairing). There the subscription waits for a STREAM_INFO read that worked. Without STREAM_INFO the
        // session subscribes at once anyway.
        if info != nil, await device.isBonded() { prepareSubscription() }
    }

    public var hasStreamInfo: Bool { streamInfo != nil }

    public func refusedForSecurity(_ error: any Error) -> Bool { (error as? BlueZError)?.isSecurityRefusal ?? false }

    public func readStreamInfo() async throws -> [UInt8] {
        guard let streamInfo else { throw TransportError("the peripheral has no STREAM_INFO characteristic") }
        return try await streamInfo.readValue()
    }

    /// A DATA subscription with the ACK path chosen alongside it.
    private struct Subscription: Sendable {
        var notifications: BlueZNotifications
        var ackWrite: AckWritePath
    }

    /// Subscribing, started ahead of the session's `subscribe()` (see `prepareSubscription`).
    private var pending: Task<Subscription, any Error>?

    /// Starts subscribing now, so that it runs concurrently with the STREAM_INFO read instead of after it
    /// (one ATT round trip less of link time per session). Safe: a peripheral sends nothing before our
    /// SYNC_REQ, and DATA bytes that arrive before the session expects them are dropped by its rules.
    public func prepareSubscription() {
        guard pending == nil, notifications == nil else { return }
        let data = self.data
        let control = self.control
        let preferred = self.preferredNotify
        let log = self.log
        let events = self.events
        let thread = self.readingThread
        pending = Task {
            try await BlueZSyncTransport.open(
                data: data, control: control, preferring: preferred, readingOn: thread, log: log
            ) {
                // On the thread that reads the notifications (the session's own, given one), straight into the
                // session's queue (no task in between).
                // Anything read before the session's subscribe() returns waits in that queue, as it waited in
                // the subscription's own stream before.
                switch $0 {
                case .value(let chunk): events.yield(.bytes(chunk))
                case .ended: events.yield(.linkEnded)
                }
            }
        }
    }

    public func subscribe() async throws {
        guard notifications == nil else { return }  // already subscribed (a stream rebase asks again)
        prepareSubscription()
        guard let pending else { return }
        let subscription: Subscription
        do {
            subscription = try await pending.value
        } catch {
            self.pending = nil
            throw error
        }
        self.pending = nil
        ackWrite = subscription.ackWrite
        notifications = subscription.notifications
        notifyMethod = subscription.notifications.method
        mtu = subscription.notifications.mtu
    }

    public func writeControl(_ bytes: [UInt8]) async throws {
        // Write with response: a lost SYNC_REQ shows up as an error instead of silence.
        try await writeWithResponse(bytes, timeout: nil)
    }

    /// WriteValue with response, after giving back CONTROL's write socket: while a client holds it, bluetoothd
    /// refuses every WriteValue on CONTROL ("Write acquired"). It notices the closed socket in its own main
    /// loop, so the first attempts after the close may still be refused: they are retried for a moment.
    /// An ACK sent on the socket is not overtaken (bluetoothd takes no WriteValue until it has dropped the
    /// socket); one still queued at the close may be lost, and the next ACK covers it like any lost ACK.
    private func writeWithResponse(_ bytes: [UInt8], timeout: Duration?) async throws {
        releaseAckSocket()
        var attempt = 0
        while true {
            do {
                if let timeout {
                    try await control.writeValue(bytes, type: .request, timeout: timeout)
                } else {
                    try await control.writeValue(bytes, type: .request)
                }
                return
            } catch let error as BlueZError
                where ackSocket.mayLinger && BlueZGattCharacteristic.isWriteAcquired(error)
                    && attempt < Self.releaseRetries
            {
                attempt += 1
                try await Task.sleep(for: .milliseconds(10))
            }
        }
    }

    /// Attempts of a write with response while bluetoothd has not yet seen the write socket close (10 ms apart).
    static let releaseRetries = 100

    /// Closes CONTROL's write socket if held. The next ACK acquires it again.
    private func releaseAckSocket() {
        guard case .held(let socket) = ackSocket else { return }
        socket.close()
        ackSocket = .released
    }

    /// One SYNC_ACK on the acquired write socket (acquired first if needed); false when the socket cannot be had
    /// or failed, and the caller writes it through WriteValue instead.
    private func sendOnAckSocket(_ bytes: [UInt8]) async -> Bool {
        let socket: DBusUnixFD
        switch ackSocket {
        case .unavailable: return false
        case .held(let held): socket = held
        case .none, .released:
            do {
                socket = try await control.acquireWrite(timeout: .seconds(2)).fd
                ackSocket = .held(socket)
            } catch {
                ackSocket = .unavailable(wasHeld: ackSocket.mayLinger)
                log.log(.info, "AcquireWrite on CONTROL failed (\(error)): SYNC_ACKs go as WriteValue commands")
                return false
            }
        }
        // Never blocks the session: a full socket (bluetoothd not reading) loses this ACK like the air could.
        let sent = bytes.withUnsafeBytes {
            send(socket.rawValue, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT | MSG_NOSIGNAL))
        }
        if sent == bytes.count { return true }
        if sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) { return true }
        let failure = errno
        socket.close()
        ackSocket = .unavailable(wasHeld: true)
        log.log(.info, "SYNC_ACK on CONTROL's write socket failed (errno \(failure)): SYNC_ACKs go as WriteValue commands")
        return false
    }

    public func writeAck(_ bytes: [UInt8]) async throws {
        switch ackWrite {
        case .writeCommand:
            // Write-without-response gives no delivery proof anyway. On the acquired socket an ACK is one send():
            // no D-Bus message for the session, dbus-daemon and bluetoothd to build, route and parse. Without
            // it, a WriteValue command with NO_REPLY_EXPECTED: no reply message, and the session goes on with
            // the next notification at once. Either way it stays in order before any later SYNC_REQ.
            if await !sendOnAckSocket(bytes) {
                try control.writeValueWithoutReply(bytes, type: .command)
            }
            lastAck = .unconfirmed(bytes)
        case .writeRequest, nil:
            lastAck = .none
            try await control.writeValue(bytes, type: .request)
            lastAck = .confirmed
        }
    }

    /// The ACK path is read off CONTROL's flags alongside the subscription (two D-Bus calls in flight at once).
    private static func open(
        data: BlueZGattCharacteristic, control: BlueZGattCharacteristic, preferring method: GattNotifyMethod,
        readingOn thread: ThreadExecutor?, log: any LogSink, deliver: @escaping GattNotificationSink
    ) async throws -> Subscription {
        async let flags = control.flags()
        let notifications = try await data.subscribe(
            preferring: method, log: { log.log(.info, $0) }, deliver: deliver, readingOn: thread)
        let ackWrite: AckWritePath = await flags.contains("write-without-response") ? .writeCommand : .writeRequest
        return Subscription(notifications: notifications, ackWrite: ackWrite)
    }

    /// How a session's link is ended. The kernel's Disconnect only after a session that ended in order: its DATA
    /// subscription settled (none still pending) and its final SYNC_ACK confirmed. Cut while an AcquireNotify is
    /// pending, bluetoothd 5.66 never answers it and keeps DATA's notifications "acquired" for our connection
    /// (test bed: a session stopped by a reload mid-subscribe, and every later session of that peripheral failed
    /// with "Notify acquired"); an unconfirmed ACK may still sit in bluetoothd's queue. Device1.Disconnect then.
    public static func teardown(subscriptionSettled: Bool, finalAckConfirmed: Bool) -> Teardown {
        subscriptionSettled && finalAckConfirmed ? .kernel : .bluez
    }

    public func disconnect() async {
        let subscriptionSettled = pending == nil && notifications != nil
        if let pending {
            // Subscribed ahead but never taken (STREAM_INFO unreadable...): released when it completes, without
            // waiting here (on a link whose pairing failed bluetoothd answers AcquireNotify only at its timeout).
            self.pending = nil
            Task {
                if let unused = try? await pending.value { await unused.notifications.stop() }
            }
        }
        await notifications?.stop()
        notifications = nil
        releaseAckSocket()
        // The kernel's Disconnect does not wait for queued ATT writes: the last SYNC_ACK, sent without response,
        // is written again with one, so it is known to have arrived before the link ends (the same ACK twice is
        // a no-op for the peripheral). Unconfirmed, the link ends the slow way, which leaves bluetoothd's queue
        // its 2 s (seen in the test bed with three sessions at once: a confirmation that timed out, and the
        // final ACK lost with the link).
        if case .unconfirmed(let ack) = lastAck, await device.isConnected() {
            lastAck = .none
            do {
                try await writeWithResponse(ack, timeout: .seconds(3))
                lastAck = .confirmed
            } catch {
                log.log(.info, "the final SYNC_ACK was not confirmed (\(error)): ending the link through Device1.Disconnect")
            }
        }
        guard Self.teardown(subscriptionSettled: subscriptionSettled, finalAckConfirmed: lastAck == .confirmed) == .kernel else {
            await disconnectThroughBlueZ()
            return
        }
        switch await device.disconnectThroughKernel() {
        case .disconnected:
            teardown = .kernel
        case .failed(let errno, let status):
            log.log(
                .debug,
                "kernel disconnect of \(device.path) not done (errno \(errno), status \(status.map(String.init) ?? "-")): "
                    + "Device1.Disconnect")
            await disconnectThroughBlueZ()
        }
    }

    private func disconnectThroughBlueZ() async {
        teardown = .bluez
        do {
            try await device.disconnect()
        } catch {
            log.log(.info, "disconnect \(device.path): \(error)")
        }
    }
}
