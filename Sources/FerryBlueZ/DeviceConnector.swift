import FerryDBus
import FerryCore

/// Drives Device1.Connect through `ConnectRetryPolicy`: it executes the recovery the policy picks
/// (backoff, disconnect/remove on stale state, rediscovery, waiting for the adapter or bluetoothd).
///
/// The device is found by its `Address` property (the identity address once bonded; the object path of a
/// peripheral first seen on a resolvable private address names that address instead), never by a path built
/// from the address. A bonded (or paired) device is never removed: its keys are the operator's, and
/// removing them would let bluetoothd Just-Works-pair with whatever answers at that address next.
public struct DeviceConnector: Sendable {
    public let client: BlueZClient
    public let adapter: BlueZAdapter
    public let address: String
    /// How long to rediscover a vanished device, or to wait for the adapter / bluetoothd.
    public var waitTimeout: Duration = .seconds(30)
    private let sleep: @Sendable (Duration) async throws -> Void
    private let clock: any MonotonicClock
    private let log: DBusLogSink?

    public init(
        client: BlueZClient, adapter: BlueZAdapter, address: String, log: DBusLogSink? = nil,
        sleep: @escaping @Sendable (Duration) async throws -> Void = { try await Task.sleep(for: $0) },
        clock: any MonotonicClock = SystemMonotonicClock()
    ) {
        self.client = client
        self.adapter = adapter
        self.address = address
        self.log = log
        self.sleep = sleep
        self.clock = clock
    }

    /// Connects, recovering as the policy says. Returns the connected device; throws the last error
    /// (with the policy's reason) when the policy gives up.
    public func connect(policy: inout ConnectRetryPolicy, connectTimeout: Duration = .seconds(35)) async throws
        -> BlueZDevice
    {
        var device = try await client.discover(address: address, on: adapter, timeout: waitTimeout)
        while true {
            try Task.checkCancellation()
            let failure: BlueZError
            do {
                try await connectUnlessRemoved(device, timeout: connectTimeout)
                policy.reset()
                return device
            } catch let error as BlueZError {
                failure = error
            }
            // Read just before the decision: the policy never chooses RemoveDevice for a bonded device.
            let bonded = await Self.holdsKeys(device)
            let recovery = policy.next(after: failure, now: clock.now(), bonded: bonded)
            log?("bluez: connect \(address) failed: \(failure) → \(recovery)")
            switch recovery {
            case .proceed:
                policy.reset()
                return device
            case .retry(let delay):
                try await sleep(delay)
            case .resetDeviceThenRetry(let remove, let delay):
                do { try await device.disconnect() } catch { log?("bluez: disconnect \(address): \(error)") }
                // Checked again at the last moment: a pairing may have completed since the decision.
                let bondedNow = remove ? await Self.holdsKeys(device) : false
                let removing = remove && !bondedNow
                if remove && !removing { log?("bluez: \(address) is bonded: not removing it (its keys are the operator's)") }
                if removing {
                    do { try await adapter.removeDevice(device.path) } catch { log?("bluez: remove \(address): \(error)") }
                }
                try await sleep(delay)
                if removing { device = try await client.discover(address: address, on: adapter, timeout: waitTimeout) }
            case .rediscoverThenRetry(let delay):
                try await sleep(delay)
                device = try await client.discover(address: address, on: adapter, timeout: waitTimeout)
            case .waitForAdapter, .waitForBluetoothd:
                let adapterPath = adapter.path
                do {
                    try await client.objects.waitUntil(timeout: waitTimeout) {
                        $0.properties(adapterPath, BlueZInterface.adapter)?["Powered"]?.bool == true
                    }
                } catch let error as BlueZError where error.kind == .timeout {
                    throw BlueZError(
                        kind: failure.kind, name: failure.name,
                        message: "adapter \(adapter.name) not available within \(waitTimeout): \(failure.message)")
                }
                if await device.properties() == nil {
                    device = try await client.discover(address: address, on: adapter, timeout: waitTimeout)
                }
            case .giveUp(let reason):
                throw BlueZError(kind: failure.kind, name: failure.name, message: reason)
            }
        }
    }

    /// Device1.Connect, given up as soon as bluetoothd drops the device object. A device only heard by discovery
    /// is temporary: when the last discovery session on the adapter ends (another client's too), bluetoothd
    /// 5.66 removes it, even with a Connect pending, and that Connect then never gets a reply. Waiting for the
    /// call's timeout would hold the caller for its whole wait; the removal is answered like any vanished
    /// device instead (`unknownObject`: rediscover, then connect again).
    private func connectUnlessRemoved(_ device: BlueZDevice, timeout: Duration) async throws {
        enum Outcome: Sendable { case connected, removed, watchEnded }
        let path = device.path
        let objects = client.objects
        let present: @Sendable (BlueZObjects) -> Bool = { $0.properties(path, BlueZInterface.device) != nil }
        guard present(await objects.snapshot) else {
            try await device.connect(timeout: timeout)
            return
        }
        try await withThrowingTaskGroup(of: Outcome.self) { group in
            group.addTask {
                try await device.connect(timeout: timeout)
                return .connected
            }
            group.addTask {
                do {
                    try await objects.waitUntil(timeout: timeout) { !present($0) }
                    return .removed
                } catch let error as BlueZError where error.kind == .timeout {
                    return .watchEnded  // the Connect call's own timeout decides
                }
            }
            defer { group.cancelAll() }
            while let outcome = try await group.next() {
                switch outcome {
                case .connected: return
                case .removed:
                    throw BlueZError(
                        kind: .unknownObject, name: "org.freedesktop.DBus.Error.UnknownObject",
                        message: "bluetoothd removed \(path) while connecting (a temporary device whose discovery ended)")
                case .watchEnded: continue
                }
            }
        }
    }

    /// Paired or Bonded: BlueZ holds keys for the device (or is about to).
    static func holdsKeys(_ device: BlueZDevice) async -> Bool {
        let properties = await device.properties()
        return BlueZDevice.hasBond(properties) || properties?["Paired"]?.bool == true
    }
}
