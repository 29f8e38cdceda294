import FerryBlueZ
import FerryDBus
import FerryGateway
import FerrySync
import FerryProtocol
import FerryStore
import Foundation
import Testing
import FerryTestBus
import FerryTestSupport
import FerryFakeBlueZ

/// The daemon's hooks into the metrics and the live view, with a real dbus-daemon and the fake org.bluez:
/// a session that cannot connect is counted under its typed outcome, the live view names the adapter while
/// the daemon runs and is gone once it stopped, and /healthz turns 200 once the daemon is ready.
@Suite(.serialized) struct DaemonMetricsTests {
    @Test func sessionsAreCountedByOutcomeAndTheLiveViewFollowsTheDaemon() async throws {
        let bus = try TestBus()
        var tree = FakeBlueZ.adapterOnly()
        var device = FakeBlueZ.deviceInterfaces(resolved: true)
        device[BlueZInterface.device]?["Paired"] = .bool(true)
        device[BlueZInterface.device]?["Bonded"] = .bool(true)
        tree[FakeBlueZ.devicePath] = device
        tree.merge(FakeBlueZ.gattObjects()) { $1 }
        let fake = try await FakeBlueZ.start(on: bus, tree: tree)
        defer { fake.stop() }
        fake.state.withLock {
            $0.connectScript = Array(
                repeating: DBusError(name: "org.bluez.Error.NotAvailable", message: "Operation is not available"),
                count: 50)
        }
        let dir = try TemporaryDirectory("metrics")
        defer { dir.remove() }
        var configuration = DaemonConfiguration()
        configuration.stateDir = dir.path("state")
        configuration.peripherals = [PeripheralPolicy(address: PeripheralAddress(FakeBlueZ.deviceAddress)!)]
        configuration.backoffBaseSeconds = 0.1
        let metrics = GatewayMetrics(maxConnections: configuration.maxConnections)
        let health = DaemonHealth()
        let daemon = try GatewayDaemon.onTestBus(
            bus, configuration: configuration, log: RecordingLog(), health: health, metrics: metrics)
        let running = Task { try await daemon.run() }
        defer { running.cancel() }
        let endpoint = MetricsEndpoint(metrics: metrics, health: health, databasePath: configuration.databasePath)
        let liveFile = LiveViewFile(databasePath: configuration.databasePath)

        func waitFor(_ what: String, _ condition: () -> Bool) async throws {
            let deadline = Date().addingTimeInterval(60)  // bounds a hang; under load 15 s ran out
            while !condition() {
                guard Date() < deadline else { throw PairingError("timed out waiting for \(what)") }
                try await Task.sleep(for: .milliseconds(50))
            }
        }
        let failed = MetricsRegistry.Labels(["outcome": "connect_failed"])
        try await waitFor("a failed session counted") {
            (metrics.snapshot.value(FerryMetric.sessions, labels: failed) ?? 0) >= 1
        }
        let totals = await daemon.totals
        #expect(totals.failed >= 1)
        #expect(metrics.snapshot.value(FerryMetric.sessions, labels: .init(["outcome": "caught_up"])) == 0)
        #expect(endpoint.respond(path: "/healthz") == .init(status: 200, body: "ok\n"))
        let scrape = endpoint.respond(path: "/metrics").body
        #expect(scrape.contains("\nferry_slots 3\n") && scrape.contains("\nferry_store_readable 1\n"))
        #expect(scrape.contains("\nferry_adapter_powered 1\n"))
        try await waitFor("the live view") { liveFile.readFresh(nowMillis: SystemWallClock().nowMillis())?.adapter == "hci0" }
        let view = try #require(liveFile.readFresh(nowMillis: SystemWallClock().nowMillis()))
        #expect(view.pid == getpid() && view.maxConnections == 3)
        #expect(view.slotsInUse == view.sessions.count)

        running.cancel()
        _ = await running.result
        #expect(!FileManager.default.fileExists(atPath: liveFile.path), "a stopped daemon leaves no live view")
    }

    /// `discovery_timeout_seconds` bounds how long one connect looks for a peripheral bluetoothd has not seen: the
    /// attempt fails after that long (not the default 15 s) and says so.
    @Test func aPeripheralNotInRangeFailsItsConnectAfterTheConfiguredDiscoveryTimeout() async throws {
        let bus = try TestBus()
        let fake = try await FakeBlueZ.start(on: bus, tree: FakeBlueZ.adapterOnly())
        defer { fake.stop() }
        let dir = try TemporaryDirectory("discovery")
        defer { dir.remove() }
        var configuration = DaemonConfiguration()
        configuration.stateDir = dir.path("state")
        configuration.requireBond = false
        configuration.peripherals = [PeripheralPolicy(address: PeripheralAddress(FakeBlueZ.deviceAddress)!)]
        configuration.discoveryTimeoutSeconds = 2
        let log = RecordingLog()
        let daemon = try GatewayDaemon.onTestBus(bus, configuration: configuration, log: log)
        let started = ContinuousClock.now
        let running = Task { try await daemon.run() }
        defer { running.cancel() }
        let expected = "connect failed: notFound: device \(FakeBlueZ.deviceAddress) not seen within 2 s of discovery"
        while !log.all.contains(where: { $0.contains(expected) }) && ContinuousClock.now - started < .seconds(60) {
            try await Task.sleep(for: .milliseconds(50))
        }
        let took = ContinuousClock.now - started
        #expect(log.all.contains { $0.contains(expected) }, "\(log.all.suffix(10))")
        #expect(took < .seconds(14), "the first attempt ended after \(took), as if the 15 s default applied")
        #expect(fake.calls.contains("Adapter1.StartDiscovery \(FakeBlueZ.adapterPath)"), "\(fake.calls)")
        running.cancel()
        _ = await running.result
    }
}
