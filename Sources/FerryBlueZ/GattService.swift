/// One org.bluez.GattService1 object under a device.
public struct BlueZGattService: BlueZObject {
    public static let interface = BlueZInterface.gattService
    public let path: String
    public let cache: BlueZObjectCache

    public init(path: String, cache: BlueZObjectCache) {
        self.path = path
        self.cache = cache
    }

    public func uuid() async -> String? { await properties()?["UUID"]?.string?.lowercased() }

    /// The characteristic with `uuid` in this service, if exported.
    public func characteristic(uuid: String) async -> BlueZGattCharacteristic? {
        let objects = await cache.snapshot
        guard let found = GattLookup.characteristic(in: objects, service: path, uuid: uuid) else { return nil }
        return BlueZGattCharacteristic(path: found.path, cache: cache)
    }

    /// Like `characteristic(uuid:)` but throws `.notFound`.
    public func requireCharacteristic(uuid: String) async throws -> BlueZGattCharacteristic {
        guard let found = await characteristic(uuid: uuid) else {
            throw BlueZError.notFound("characteristic \(uuid) not under \(path)")
        }
        return found
    }
}
