import FerryBlueZ
import FerryDBus
import FerryGateway
import FerryProtocol
import FerryStore
import Foundation
import Testing
import FerryTestBus
import FerryFakeBlueZ
import FerryTestSupport

/// The daemon carrying out adapter recovery against a real dbus-daemon and the fake org.bluez (the ladder's
/// logic itself: AdapterRecoveryTests). The HCI reset step is off here: it would reset a real controller of
/// the machine running the tests (the test bed covers it).
@Suite(.serialized) struct AdapterRecoveryDaemonTests {
    static func daemon(
        bus: TestBus, recovery: AdapterRecoverySettings, peripherals: [PeripheralPolicy] = [], log: RecordingLog
    ) throws -> (GatewayDaemon, GatewayMetrics, TemporaryDirectory) {
        let dir = try TemporaryDirectory("recovery")
        var configuration = DaemonConfiguration()
        configuration.stateDir = dir.path("state")
        configuration.peripherals = peripherals
        configuration.requireBond = false
        configuration.backoffBaseSeconds = 0.2
        configuration.backoffCapSeconds = 1
        configuration.adapterRecovery = recovery
        let metrics = GatewayMetrics(maxConnections: configuration.maxConnections)
        let daemon = try GatewayDaemon.onTestBus(bus, configuration: configuration, log: log, metrics: metrics)
        return (daemon, metrics, dir)
    }

    static func steps(_ metrics: GatewayMetrics, _ step: AdapterRecovery.Step) -> Double? {
        metrics.snapshot.value(FerryMetric.adapterRecoverySteps, labels: MetricsRegistry.Labels(["step": step.rawValue]))
    }

    @Test func anAdapterThatWillNotPowerOnIsPowerCycledThenTheDaemonStopsWithAnError() async throws {
        let bus = try TestBus()
        let fake = try await FakeBlueZ.start(on: bus, tree: FakeBlueZ.adapterOnly(powered: false))
        defer { fake.stop() }
        fake.state.withLock { $0.refusePowerOn = true }
        let log = RecordingLog()
        let (daemon, metrics, dir) = try Self.daemon(
            bus: bus, recovery: AdapterRecoverySettings(adapterMissingSeconds: 5, verifySeconds: 5, hciReset: false), log: log)
        defer { dir.remove() }
        let started = ContinuousClock.now
        let result = await Task { try await daemon.run() }.result
        let took = ContinuousClock.now - started
        guard case .failure(let error) = result else {
            Issue.record("the daemon should have stopped with an error")
            return
        }
        #expect(error is AdapterUnrecoverable, "\(error)")
        // 5 s unusable → power cycle → 5 s to verify → exit (no HCI reset configured).
        #expect(took >= .seconds(10) && took < .seconds(30), "\(took)")
        #expect(Self.steps(metrics, .powerCycle) == 1 && Self.steps(metrics, .exit) == 1 && Self.steps(metrics, .hciReset) == 0)
        #expect(metrics.snapshot.value(FerryMetric.adapterWedged) == 1)
        #expect(fake.calls.filter { $0 == "Properties.Set \(FakeBlueZ.adapterPath)" }.count >= 2)  // off, then on (refused)
        #expect(log.all.contains { $0.contains("adapter recovery: adapter hci0 missing or not powered for 5 s: power cycling hci0") })
        #expect(log.all.contains { $0.contains("exiting non-zero so the service manager restarts ferry") })
    }

    @Test func connectsThatFailUntilAPowerCycleAreRecoveredAndCounted() async throws {
        let bus = try TestBus()
        var tree = FakeBlueZ.adapterOnly()
        tree[FakeBlueZ.devicePath] = FakeBlueZ.deviceInterfaces(resolved: true)
        tree.merge(FakeBlueZ.gattObjects()) { $1 }
        let fake = try await FakeBlueZ.start(on: bus, tree: tree)
        defer { fake.stop() }
        let failure = DBusError(name: "org.bluez.Error.Failed", message: "le-connection-abort-by-local")
        fake.state.withLock { $0.connectScript = Array(repeating: failure, count: 10_000) }
        let log = RecordingLog()
        let (daemon, metrics, dir) = try Self.daemon(
            bus: bus, recovery: AdapterRecoverySettings(wedgedAfterSeconds: 10, minFailures: 3, verifySeconds: 20, hciReset: false),
            peripherals: [PeripheralPolicy(address: PeripheralAddress(FakeBlueZ.deviceAddress)!)], log: log)
        defer { dir.remove() }
        // The "controller" works again once it has been powered off: connects succeed from then on.
        let healer = Task {
            while !Task.isCancelled {
                if fake.calls.contains("Properties.Set \(FakeBlueZ.adapterPath)") {
                    fake.state.withLock { $0.connectScript = [] }
                    return
                }
                try? await Task.sleep(for: .milliseconds(50))
            }
        }
        defer { healer.cancel() }
        let running = Task { try await daemon.run() }
        defer { running.cancel() }
        let deadline = ContinuousClock.now + .seconds(40)
        while (metrics.snapshot.value(FerryMetric.adapterRecoveries) ?? 0) < 1 && ContinuousClock.now < deadline {
            try await Task.sleep(for: .milliseconds(100))
        }
        #expect(metrics.snapshot.value(FerryMetric.adapterRecoveries) == 1, "\(log.all.suffix(10))")
        #expect(Self.steps(metrics, .powerCycle) == 1 && Self.steps(metrics, .exit) == 0)
        #expect(metrics.snapshot.value(FerryMetric.adapterWedged) == 0)
        #expect(log.all.contains { $0.contains("adapter recovery: connects work again after the power cycle") })
        running.cancel()
        _ = await running.result
    }
}
