import FerryBlueZ
import FerryDBus
import FerryProtocol

/// What the live driver's loop reacts to, in arrival order.
public enum LinkEvent: Sendable {
    /// A chunk of the DATA stream (one notification / one read of the AcquireNotify socket).
    case bytes([UInt8])
    /// The notification stream ended: link dropped, device or bluetoothd gone.
    case linkEnded
    /// A timer armed for the session's next deadline went off.
    case tick
    /// Stop requested (SIGTERM, --timeout): commit and acknowledge what is staged, then disconnect.
    case stop
}

/// The Sync service of one connected peripheral, over BlueZ. Notifications are pushed into the driver's
/// event stream so bytes, link loss, timers and stop requests reach the session in one order.
public final class BlueZSyncTransport: SyncTransport {
    public let device: BlueZDevice
    public let service: BlueZGattService
    private let data: BlueZGattCharacteristic
    private let control: BlueZGattCharacteristic
    private let streamInfo: BlueZGattCharacteristic?
    private let events: AsyncStream<LinkEvent>.Continuation
    private let preferredNotify: GattNotifyMethod
    private let log: any LogSink
    private var notifications: BlueZNotifications?
    private var forwarding: Task<Void, Never>?
    public private(set) var notifyMethod: GattNotifyMethod?
    public private(set) var mtu: UInt16?

    /// Finds the Sync characteristics under `service`. Throws `.notFound` if DATA or CONTROL is missing.
    public init(
        device: BlueZDevice, service: BlueZGattService, events: AsyncStream<LinkEvent>.Continuation,
        preferredNotify: GattNotifyMethod = .acquireNotify, log: any LogSink
    ) async throws {
        self.device = device
        self.service = service
        self.events = events
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
    }

    public var hasStreamInfo: Bool { streamInfo != nil }

    public func readStreamInfo() async throws -> [UInt8] {
        guard let streamInfo else { throw TransportError("the peripheral has no STREAM_INFO characteristic") }
        return try await streamInfo.readValue()
    }

    public func subscribe() async throws {
        guard notifications == nil else { return }  // already subscribed (a stream rebase asks again)
        let subscription = try await data.subscribe(preferring: preferredNotify) { [log] in log.log(.info, $0) }
        notifications = subscription
        notifyMethod = subscription.method
        mtu = subscription.mtu
        let events = self.events
        forwarding = Task {
            for await chunk in subscription.values {
                events.yield(.bytes(chunk))
            }
            events.yield(.linkEnded)
        }
    }

    public func writeControl(_ bytes: [UInt8]) async throws {
        // Write with response: a lost SYNC_REQ/SYNC_ACK shows up as an error instead of silence.
        try await control.writeValue(bytes, type: .request)
    }

    public func disconnect() async {
        await notifications?.stop()
        notifications = nil
        do {
            try await device.disconnect()
        } catch {
            log.log(.info, "disconnect \(device.path): \(error)")
        }
    }
}

/// Runs a session over a live link: one loop consumes `LinkEvent`s and hands them to the runner, arming a
/// timer for the runner's next deadline. Returns when the runner has finished.
public enum LiveSessionDriver {
    public static func run(
        runner: SyncSessionRunner, events: AsyncStream<LinkEvent>, continuation: AsyncStream<LinkEvent>.Continuation,
        clock: any MonotonicClock = SystemMonotonicClock(),
        afterEvent: (SyncSessionRunner) -> Void = { _ in }  // a progress display; runs in this task, between events
    ) async {
        await runner.start()
        // The session can end during start (STREAM_INFO unreadable, subscribe refused): then no event will
        // ever come, and waiting for one would hang the caller.
        if runner.finished { return }
        var timer: Task<Void, Never>?
        var armedFor: Double?
        func rearm() {
            guard let deadline = runner.nextDeadline else {
                timer?.cancel()
                timer = nil
                armedFor = nil
                return
            }
            if armedFor == deadline { return }
            timer?.cancel()
            armedFor = deadline
            let delay = max(0, deadline - clock.now())
            timer = Task {
                try? await Task.sleep(nanoseconds: UInt64(delay * 1e9) + 1_000_000)
                if !Task.isCancelled { continuation.yield(.tick) }
            }
        }
        rearm()
        for await event in events {
            if runner.finished { break }
            switch event {
            case .bytes(let chunk): await runner.receive(chunk)
            case .linkEnded: await runner.linkLost()
            case .tick:
                armedFor = nil
                await runner.timerFired()
            case .stop: await runner.stop()
            }
            afterEvent(runner)
            if runner.finished { break }
            rearm()
        }
        timer?.cancel()
    }
}
