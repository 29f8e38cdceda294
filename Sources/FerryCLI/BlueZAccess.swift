import FerryBlueZ
import FerryDBus
import FerryGateway

/// Reaching bluetoothd and an adapter, with the errors every radio command prints the same way.
enum BlueZAccess {
    static func client(bus: String?) async throws -> BlueZClient {
        do {
            let connection = try await DBusConnection.connect(
                to: bus.map { .address($0) } ?? .system, defaultCallTimeout: .seconds(25))
            return try await BlueZClient(connection: connection, discoveryServiceUUIDs: [SyncProfile.serviceUUID])
        } catch {
            throw CommandFailure("cannot reach bluetoothd on \(bus ?? "the system bus"): \(error)")
        }
    }

    /// The adapter, powered. `adapterName` nil: the first one.
    static func poweredAdapter(_ client: BlueZClient, named adapterName: String?) async throws -> BlueZAdapter {
        let adapter: BlueZAdapter
        do { adapter = try await client.adapter(named: adapterName) } catch {
            throw CommandFailure("adapter missing: \(error)")
        }
        guard await adapter.isPowered() else {
            throw CommandFailure("adapter \(adapter.name) is powered off (bluetoothctl power on)")
        }
        return adapter
    }
}
