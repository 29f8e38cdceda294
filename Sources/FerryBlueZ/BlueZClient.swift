import FerryCore
import FerryDBus

/// Entry point: one bus connection, one object cache, one shared discovery per adapter.
public final class BlueZClient: Sendable {
    public let connection: DBusConnection
    public let objects: BlueZObjectCache
    private let log: DBusLogSink?
    private let discoveries = LockedValue<[String: BlueZDiscovery]>([:])
    /// The service UUIDs discovery asks BlueZ to filter on (empty: every LE device).
    public let discoveryServiceUUIDs: [String]

    /// Uses an existing connection (tests pass one to a private bus) and starts the object cache.
    public init(
        connection: DBusConnection, serviceName: String = BlueZInterface.service, discoveryServiceUUIDs: [String] = [],
        log: DBusLogSink? = nil
    ) async throws {
        self.connection = connection
        self.log = log
        self.discoveryServiceUUIDs = discoveryServiceUUIDs
        objects = BlueZObjectCache(connection: connection, serviceName: serviceName, log: log)
        try await objects.start()
    }

    /// Connects to the system bus.
    public static func system(discoveryServiceUUIDs: [String] = [], log: DBusLogSink? = nil) async throws -> BlueZClient {
        let connection = try await mappingErrors { try await DBusConnection.connect(to: .system, log: log) }
        return try await BlueZClient(connection: connection, discoveryServiceUUIDs: discoveryServiceUUIDs, log: log)
    }

    /// All adapters, sorted by path (hci0 first).
    public func adapters() async -> [BlueZAdapter] {
        await objects.snapshot.all(implementing: BlueZInterface.adapter).map { BlueZAdapter(path: $0.path, cache: objects) }
    }

    /// The adapter called `name` ("hci0"), or the first one if `name` is nil.
    public func adapter(named name: String? = nil) async throws -> BlueZAdapter {
        let all = await adapters()
        if let name {
            guard let found = all.first(where: { $0.name == name }) else {
                throw BlueZError.notFound("no Bluetooth adapter \(name) (have: \(all.map(\.name).joined(separator: ", ")))")
            }
            return found
        }
        guard let first = all.first else {
            let running = await objects.isServiceAvailable
            throw BlueZError.notFound(running ? "no Bluetooth adapter" : "bluetoothd is not running")
        }
        return first
    }

    /// The device object at the path BlueZ builds from `address` (it exists only once discovery has seen it).
    /// Only right for a device first seen under that very address: a peripheral first seen on a resolvable
    /// private address keeps that address in its path after bonding. Ferry's commands and daemon use
    /// `knownDevice` / `discover`, which go by the `Address` property.
    public func device(address: String, on adapter: BlueZAdapter) -> BlueZDevice {
        BlueZDevice(path: adapter.devicePath(forAddress: address), cache: objects)
    }

    /// The device BlueZ knows under `address` on `adapter`, by its Address property: after bonding with a
    /// peripheral that used a resolvable private address, the object path still names the address it was
    /// first seen with while Address is the identity address. Falls back to the path-derived device.
    public func knownDevice(address: String, on adapter: BlueZAdapter) async -> BlueZDevice? {
        guard let path = Self.devicePath(address: address, adapter: adapter, in: await objects.snapshot) else {
            return nil
        }
        return BlueZDevice(path: path, cache: objects)
    }

    /// The single shared discovery of `adapter`, filtered on `discoveryServiceUUIDs`.
    public func discovery(on adapter: BlueZAdapter) -> BlueZDiscovery {
        discoveries.withLock { all in
            if let existing = all[adapter.path] { return existing }
            let created = BlueZDiscovery(adapter: adapter, serviceUUIDs: discoveryServiceUUIDs, log: log)
            all[adapter.path] = created
            return created
        }
    }

    /// The path of the device whose `Address` is `address` (identity address once bonded), else the path
    /// built from the address if that object exists. The one lookup rule for every device access.
    static func devicePath(address: String, adapter: BlueZAdapter, in objects: BlueZObjects) -> String? {
        let prefix = adapter.path + "/"
        let wanted = address.uppercased()
        for device in objects.all(implementing: BlueZInterface.device)
        where device.path.hasPrefix(prefix) && device.properties["Address"]?.string?.uppercased() == wanted {
            return device.path
        }
        let byPath = adapter.devicePath(forAddress: address)
        return objects.properties(byPath, BlueZInterface.device) == nil ? nil : byPath
    }

    /// How long discovery waits on bluetoothd's signals before reading its tree (see `discover`).
    public static let discoveryWindow: Duration = .seconds(5)

    /// Runs discovery until a device with `address` (its `Address` property, or the path built from it)
    /// appears on `adapter`. Returns the device at its actual object path.
    ///
    /// In windows: bluetoothd creates a device object as soon as it hears it, but announces it only when its
    /// main loop is idle, which a flood of advertising reports can postpone past any timeout (measured in the
    /// test bed: 7–20 s, sometimes longer than the whole discovery). So each window that ends without the
    /// device asks for bluetoothd's tree (`BlueZDiscovery.catchUp`), which sees it however late the signals are.
    ///
    /// `startTimeout`: how long bluetoothd may take to start the discovery. By default the whole wait, and at
    /// least `BlueZDiscovery.defaultStartTimeout`: a busy controller answers late, and a late start is still a
    /// start. A caller with a hard deadline of its own (`ferry sync --timeout`) passes what is left of it.
    public func discover(
        address: String, on adapter: BlueZAdapter, timeout: Duration, startTimeout: Duration? = nil,
        window: Duration = discoveryWindow
    ) async throws -> BlueZDevice {
        if let known = await knownDevice(address: address, on: adapter) { return known }
        let discovery = discovery(on: adapter)
        let clock = SystemMonotonicClock()
        let deadline = clock.deadline(after: timeout)
        let lease = try await discovery.acquire(
            startTimeout: startTimeout ?? max(BlueZDiscovery.defaultStartTimeout, timeout))
        let probe: @Sendable (BlueZObjects) -> String? = { Self.devicePath(address: address, adapter: adapter, in: $0) }
        do {
            while true {
                do {
                    let found = try await objects.waitFor(timeout: min(window, clock.remaining(until: deadline)), probe)
                    await lease.release()
                    return BlueZDevice(path: found, cache: objects)
                } catch let error as BlueZError where error.kind == .timeout {
                    await discovery.catchUp(within: min(window, max(.milliseconds(500), clock.remaining(until: deadline))))
                    if let found = probe(await objects.snapshot) {
                        await lease.release()
                        return BlueZDevice(path: found, cache: objects)
                    }
                    // Not in bluetoothd's tree either: perhaps nothing scans although bluetoothd says it does.
                    await discovery.kickIfStale()
                    guard clock.now() < deadline else { break }
                }
            }
        } catch {
            await lease.release()
            throw error
        }
        await lease.release()
        // Whole seconds: "19.68951243 seconds" (Duration's description) reads like noise in a one-line error.
        throw BlueZError.notFound("device \(address) not seen within \(timeout.wholeSecondsRoundedUp) s of discovery")
    }
}
