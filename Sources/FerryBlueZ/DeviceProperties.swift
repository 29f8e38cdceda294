import FerryDBus

/// Typed view of one org.bluez.Device1 property set (BlueZ's doc/org.bluez.Device.rst): the one place in
/// Ferry that spells those property names. Missing or mistyped values read as absent (bluetoothd's replies are
/// input like any other).
public struct DeviceProperties: Sendable, Equatable {
    /// The identity address once bonded with a peripheral that uses resolvable private addresses.
    public var address: String?
    /// "public" or "random".
    public var addressType: String?
    public var name: String?
    public var alias: String?
    public var rssi: Int?
    public var uuids: [String]
    public var paired: Bool
    /// Keys stored for reconnection (Device1.Bonded, BlueZ ≥ 5.64); older BlueZ only has Paired, which for an
    /// LE pairing with bonding means the same.
    public var bonded: Bool
    public var trusted: Bool
    public var connected: Bool
    public var servicesResolved: Bool

    public init(_ properties: BlueZProperties) {
        address = properties["Address"]?.string
        addressType = properties["AddressType"]?.string
        name = properties["Name"]?.string
        alias = properties["Alias"]?.string
        rssi = Self.int(properties["RSSI"])
        uuids = properties["UUIDs"]?.stringArray ?? []
        paired = properties["Paired"]?.bool ?? false
        bonded = properties["Bonded"]?.bool ?? paired
        trusted = properties["Trusted"]?.bool ?? false
        connected = properties["Connected"]?.bool ?? false
        servicesResolved = properties["ServicesResolved"]?.bool ?? false
    }

    /// Whether the device advertises (or offers) the service `uuid` (BlueZ reports UUIDs in lower case).
    public func offers(service uuid: String) -> Bool {
        uuids.contains { $0.lowercased() == uuid.lowercased() }
    }

    /// Device1 properties that change when an advertisement is received.
    public static let advertisementNames: Set<String> = [
        "RSSI", "TxPower", "ManufacturerData", "ServiceData", "UUIDs", "Name", "AdvertisingFlags",
    ]

    private static func int(_ value: DBusValue?) -> Int? {
        switch value {
        case .int16(let v): return Int(v)
        case .variant(let inner): return int(inner)
        default: return nil
        }
    }
}

extension BlueZObjects {
    /// The Device1 properties of `path`, typed; nil when there is no such device.
    public func device(_ path: String) -> DeviceProperties? {
        properties(path, BlueZInterface.device).map(DeviceProperties.init)
    }

    /// Every Device1 object under `adapterPath`, typed.
    public func devices(under adapterPath: String) -> [(path: String, properties: DeviceProperties)] {
        let prefix = adapterPath + "/"
        return all(implementing: BlueZInterface.device).filter { $0.path.hasPrefix(prefix) }
            .map { (path: $0.path, properties: DeviceProperties($0.properties)) }
    }
}
