import FerryDBus
import FerryFakeBlueZ
import FerryGateway
import FerryProtocol
import FerryTestBus
import Foundation
import Testing

extension GatewayDaemon {
    /// A daemon whose "system bus" is `bus` (where the fake org.bluez answers), its state directory prepared.
    static func onTestBus(
        _ bus: TestBus, configuration: DaemonConfiguration, log: any LogSink, health: DaemonHealth? = nil,
        metrics: GatewayMetrics? = nil
    ) throws -> GatewayDaemon {
        try StateDirectory.prepare(configuration.stateDir)
        let busAddress = bus.address
        return GatewayDaemon(
            configuration: configuration, log: log,
            connectBus: { try await DBusConnection.connect(to: .address(busAddress), defaultCallTimeout: .seconds(5)) },
            health: health, metrics: metrics)
    }
}

/// The fake org.bluez spells the Sync profile's UUIDs itself (it serves FerryBlueZTests, which do not link
/// FerryGateway): they must be the ones the gateway looks for, or every gateway test against it proves nothing.
@Test func fakeBlueZServesTheSyncProfile() {
    #expect(FakeBlueZ.serviceUUID == SyncProfile.serviceUUID)
    #expect(FakeBlueZ.dataUUID == SyncProfile.dataUUID)
    #expect(FakeBlueZ.controlUUID == SyncProfile.controlUUID)
    #expect(FakeBlueZ.streamInfoUUID == SyncProfile.streamInfoUUID)
}
