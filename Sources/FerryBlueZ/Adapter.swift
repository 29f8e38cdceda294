import FerryDBus

/// One org.bluez.Adapter1 object (e.g. /org/bluez/hci0).
public struct BlueZAdapter: BlueZObject {
    public static let interface = BlueZInterface.adapter
    public let path: String
    public let cache: BlueZObjectCache

    public init(path: String, cache: BlueZObjectCache) {
        self.path = path
        self.cache = cache
    }

    /// "hci0" for /org/bluez/hci0.
    public var name: String { String(path.split(separator: "/").last ?? "") }

    public func isPowered() async -> Bool {
        await properties()?["Powered"]?.bool ?? false
    }

    public func setPowered(_ on: Bool, timeout: Duration = .seconds(10)) async throws {
        try await mappingErrors {
            try await connection.setProperty(
                destination: service, path: path, interface: BlueZInterface.adapter, name: "Powered", value: .bool(on),
                timeout: timeout)
        }
    }

    /// Object path BlueZ uses for a device address on this adapter ("C0:FF:EE:00:00:01" → .../dev_C0_FF_EE_00_00_01).
    public func devicePath(forAddress address: String) -> String {
        path + "/dev_" + address.uppercased().replacingColons()
    }

    /// LE-only discovery narrowed to the given service UUIDs.
    public func setDiscoveryFilter(serviceUUIDs: [String], timeout: Duration = .seconds(10)) async throws {
        let filter = DBusValue.properties([
            "Transport": .string("le"),
            "UUIDs": .strings(serviceUUIDs),
            // Keep RSSI/advertisement updates coming for devices already seen.
            "DuplicateData": .bool(false),
        ])
        try await adapterCall("SetDiscoveryFilter", [filter], timeout: timeout)
    }

    /// Raw StartDiscovery: prefer `BlueZDiscovery`, which shares one discovery session among users.
    public func startDiscovery(timeout: Duration = .seconds(10)) async throws {
        try await adapterCall("StartDiscovery", [], timeout: timeout)
    }

    public func stopDiscovery(timeout: Duration = .seconds(10)) async throws {
        try await adapterCall("StopDiscovery", [], timeout: timeout)
    }

    /// Forgets a device (drops its cached state and bond). Used to clear stale state after InProgress.
    public func removeDevice(_ devicePath: String, timeout: Duration = .seconds(10)) async throws {
        try await adapterCall("RemoveDevice", [.objectPath(devicePath)], timeout: timeout)
    }

    private func adapterCall(_ member: String, _ arguments: [DBusValue], timeout: Duration) async throws {
        _ = try await mappingErrors {
            try await connection.call(
                destination: service, path: path, interface: BlueZInterface.adapter, member: member,
                arguments: arguments, timeout: timeout)
        }
    }
}

extension String {
    fileprivate func replacingColons() -> String {
        String(map { $0 == ":" ? "_" : $0 })
    }
}
