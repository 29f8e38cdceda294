import FerryDBus

/// BlueZ D-Bus names.
public enum BlueZInterface {
    public static let service = "org.bluez"
    public static let adapter = "org.bluez.Adapter1"
    public static let device = "org.bluez.Device1"
    public static let gattService = "org.bluez.GattService1"
    public static let gattCharacteristic = "org.bluez.GattCharacteristic1"
    public static let objectManager = "org.freedesktop.DBus.ObjectManager"
    public static let properties = "org.freedesktop.DBus.Properties"
}

/// What every typed BlueZ object shares (one type per org.bluez interface, as in bluer): its object path, the
/// cache its properties are read from, and the bus its methods are called on.
public protocol BlueZObject: Sendable {
    /// The org.bluez interface the type stands for (`BlueZInterface`).
    static var interface: String { get }
    var path: String { get }
    var cache: BlueZObjectCache { get }
    init(path: String, cache: BlueZObjectCache)
}

extension BlueZObject {
    var connection: DBusConnection { cache.connection }
    var service: String { cache.serviceName }

    /// Properties from the cache; nil when the object does not exist (never seen, or removed: a device gone, an
    /// adapter unplugged, bluetoothd stopped).
    public func properties() async -> BlueZProperties? {
        await cache.properties(path, Self.interface)
    }
}
