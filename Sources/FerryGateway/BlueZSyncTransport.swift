import FerryBlueZ
import FerryDBus
import FerryProtocol
import FerrySync

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
