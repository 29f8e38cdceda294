import FerryCore
import FerryDBus

/// A one-way latch usable from @Sendable closures.
final class Flag: Sendable {
    private let value = LockedValue(false)
    func set() { value.withLock { $0 = true } }
    var isSet: Bool { value.withLock { $0 } }
}

/// A device resolved its services and the wanted one is not among them.
public struct ServiceMissing: Error, CustomStringConvertible, Sendable {
    public var serviceUUIDs: [String]
    public var description: String { "its services: \(serviceUUIDs.joined(separator: ", "))" }
}

/// One org.bluez.Device1 object.
public struct BlueZDevice: BlueZObject {
    public static let interface = BlueZInterface.device
    public let path: String
    public let cache: BlueZObjectCache

    public init(path: String, cache: BlueZObjectCache) {
        self.path = path
        self.cache = cache
    }

    /// Typed properties from the cache; nil when the device object does not exist.
    public func typedProperties() async -> DeviceProperties? { await properties().map(DeviceProperties.init) }

    public func address() async -> String? { await typedProperties()?.address }
    public func isConnected() async -> Bool { await typedProperties()?.connected ?? false }
    public func areServicesResolved() async -> Bool { await typedProperties()?.servicesResolved ?? false }

    /// Device1.Connect. BlueZ's own LE connect gives up after its internal timeout; our deadline is the
    /// outer bound in case bluetoothd never answers.
    public func connect(timeout: Duration = .seconds(35)) async throws {
        try await deviceCall("Connect", timeout: timeout)
    }

    public func disconnect(timeout: Duration = .seconds(10)) async throws {
        try await deviceCall("Disconnect", timeout: timeout)
    }

    /// "public" or "random" (Device1.AddressType). After bonding with a peripheral that uses resolvable private
    /// addresses, BlueZ reports its identity address in `Address`: key streams by that.
    public func addressType() async -> String? { await typedProperties()?.addressType }
    public func name() async -> String? {
        let properties = await typedProperties()
        return properties?.name ?? properties?.alias
    }
    public func isPaired() async -> Bool { await typedProperties()?.paired ?? false }
    /// Keys stored for reconnection (Device1.Bonded, BlueZ ≥ 5.64); older BlueZ only has Paired, which for an
    /// LE pairing with bonding means the same.
    public func isBonded() async -> Bool { Self.hasBond(await properties()) }

    /// The bond test on a Device1 property set (for cache waits as well as reads).
    public static func hasBond(_ properties: BlueZProperties?) -> Bool {
        properties.map { DeviceProperties($0).bonded } ?? false
    }
    public func isTrusted() async -> Bool { await typedProperties()?.trusted ?? false }

    /// Device1.Pair: the agent registered by this connection (or the default agent) answers bluetoothd's
    /// questions. AlreadyExists means it is paired already.
    public func pair(timeout: Duration = .seconds(60)) async throws {
        try await deviceCall("Pair", timeout: timeout)
    }

    public func cancelPairing(timeout: Duration = .seconds(5)) async throws {
        try await deviceCall("CancelPairing", timeout: timeout)
    }

    /// Device1.Trusted: bluetoothd then accepts the device's own connection and service requests without
    /// asking the agent.
    public func setTrusted(_ trusted: Bool, timeout: Duration = .seconds(10)) async throws {
        let connection = self.connection
        let service = self.service
        let path = self.path
        try await mappingErrors {
            try await connection.setProperty(
                destination: service, path: path, interface: BlueZInterface.device, name: "Trusted",
                value: .bool(trusted), timeout: timeout)
        }
    }

    /// Waits until the device is connected, ServicesResolved is true AND the GATT objects the caller
    /// needs are exported: BlueZ can report ServicesResolved before the characteristic objects appear
    /// on the bus, so waiting on the flag alone races.
    /// Fails early with `.notConnected` if the link drops, `.unknownObject` if the device vanishes.
    public func waitUntilServicesResolved(
        serviceUUID: String, characteristicUUIDs: [String], timeout: Duration = .seconds(30)
    ) async throws -> BlueZGattService {
        let devicePath = path
        let seenConnected = Flag()
        let outcome: Result<String, BlueZError> = try await cache.waitFor(timeout: timeout) { objects in
            guard let device = objects.properties(devicePath, BlueZInterface.device) else {
                return .failure(BlueZError(kind: .unknownObject, message: "device \(devicePath) vanished"))
            }
            // Connected may lag the Connect reply, so "not connected" is only terminal once we saw it
            // connected during this wait (the link dropped while services were resolving).
            if device["Connected"]?.bool == true { seenConnected.set() }
            if device["Connected"]?.bool == false && seenConnected.isSet {
                return .failure(BlueZError(kind: .notConnected, message: "link dropped before services resolved"))
            }
            guard device["ServicesResolved"]?.bool == true else { return nil }
            guard let service = GattLookup.service(in: objects, device: devicePath, uuid: serviceUUID) else {
                return nil
            }
            for uuid in characteristicUUIDs
            where GattLookup.characteristic(in: objects, service: service.path, uuid: uuid) == nil {
                return nil
            }
            return .success(service.path)
        }
        switch outcome {
        case .success(let servicePath): return BlueZGattService(path: servicePath, cache: cache)
        case .failure(let error): throw error
        }
    }

    /// Waits for ServicesResolved (up to `timeout`), then up to `exportGrace` for the service and its
    /// characteristics (BlueZ may export them a moment later). A device that resolved without the service
    /// throws `ServiceMissing` with the services it does have, so callers can say "not a Sync peripheral"
    /// within seconds instead of after a long timeout.
    public func resolveService(
        uuid: String, characteristicUUIDs: [String], timeout: Duration, exportGrace: Duration = .seconds(3)
    ) async throws -> BlueZGattService {
        do {
            let devicePath = path
            try await cache.waitUntil(timeout: timeout) {
                $0.properties(devicePath, BlueZInterface.device)?["ServicesResolved"]?.bool == true
            }
            return try await waitUntilServicesResolved(
                serviceUUID: uuid, characteristicUUIDs: characteristicUUIDs, timeout: exportGrace)
        } catch {
            let uuids = await gattServiceUUIDs()
            if !uuids.isEmpty && !uuids.contains(uuid.lowercased()) { throw ServiceMissing(serviceUUIDs: uuids) }
            throw error
        }
    }

    /// The GATT service with `uuid` under this device, if exported.
    public func gattService(uuid: String) async -> BlueZGattService? {
        let objects = await cache.snapshot
        guard let found = GattLookup.service(in: objects, device: path, uuid: uuid) else { return nil }
        return BlueZGattService(path: found.path, cache: cache)
    }

    /// All service UUIDs exported under this device (to tell "not a Sync peripheral" apart).
    public func gattServiceUUIDs() async -> [String] {
        await cache.snapshot.descendants(of: path, implementing: BlueZInterface.gattService)
            .compactMap { $0.properties["UUID"]?.string?.lowercased() }
    }

    private func deviceCall(_ member: String, timeout: Duration) async throws {
        _ = try await mappingErrors {
            try await connection.call(
                destination: service, path: path, interface: BlueZInterface.device, member: member, timeout: timeout)
        }
    }
}

/// Finds GATT objects in a cache snapshot. BlueZ nests them by path:
/// device/serviceXXXX/charYYYY, and each also names its parent in a property.
enum GattLookup {
    static func service(in objects: BlueZObjects, device: String, uuid: String) -> (path: String, properties: BlueZProperties)? {
        objects.descendants(of: device, implementing: BlueZInterface.gattService).first {
            $0.properties["UUID"]?.string?.lowercased() == uuid.lowercased()
                && ($0.properties["Device"]?.objectPath ?? device) == device
        }
    }

    static func characteristic(in objects: BlueZObjects, service: String, uuid: String) -> (path: String, properties: BlueZProperties)? {
        objects.descendants(of: service, implementing: BlueZInterface.gattCharacteristic).first {
            $0.properties["UUID"]?.string?.lowercased() == uuid.lowercased()
                && ($0.properties["Service"]?.objectPath ?? service) == service
        }
    }
}
