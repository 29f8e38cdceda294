import FerryBlueZ
import FerryCore
import FerryDBus
import FerryGateway
import FerrySync
import FerryProtocol
import FerryStore
import Foundation
import Testing
import FerryTestBus
import FerryFakeBlueZ
import FerryTestSupport

/// Collects log lines (the daemon and the pairing flow take a sink; they never build one).
final class RecordingLog: LogSink {
    let lines = LockedValue<[String]>([])
    func log(_ level: LogLevel, _ message: String) { lines.withLock { $0.append(message) } }
    var all: [String] { lines.withLock { $0 } }
}

/// The pairing flow and the bond policy against a real dbus-daemon with a fake org.bluez that plays
/// bluetoothd's side of the agent dialogue. (Real SMP against real bluetoothd: Tests/testbed/sync_pairing.py.)
@Suite(.serialized) struct PairingTests {
    let address = PeripheralAddress(FakeBlueZ.deviceAddress)!

    func syncPeripheralTree(paired: Bool = false) -> FakeBlueZ.Tree {
        var tree = FakeBlueZ.adapterOnly()
        var device = FakeBlueZ.deviceInterfaces(resolved: true)
        device[BlueZInterface.device]?["Paired"] = .bool(paired)
        device[BlueZInterface.device]?["Bonded"] = .bool(paired)
        device[BlueZInterface.device]?["AddressType"] = .string("random")
        device[BlueZInterface.device]?["Name"] = .string("ferry-sensor")
        tree[FakeBlueZ.devicePath] = device
        tree.merge(FakeBlueZ.gattObjects()) { $1 }
        return tree
    }

    func withPairing<T>(
        _ behaviour: FakeBlueZ.PairBehaviour, tree: FakeBlueZ.Tree? = nil,
        _ body: (FakeBlueZ, PeripheralPairing, GatewayStore) async throws -> T
    ) async throws -> T {
        let bus = try TestBus()
        let fake = try await FakeBlueZ.start(on: bus, tree: tree ?? syncPeripheralTree())
        defer { fake.stop() }
        fake.state.withLock { $0.pairing = behaviour }
        let client = try await BlueZClient(connection: try await bus.connect())
        let adapter = try await client.adapter(named: nil)
        let dir = try TemporaryDirectory("pairing")
        defer { dir.remove() }
        let store = try GatewayStore(path: dir.path("ferry.sqlite"))
        var pairing = PeripheralPairing(client: client, adapter: adapter, log: RecordingLog())
        pairing.pairTimeout = .seconds(10)
        return try await body(fake, pairing, store)
    }

    /// The PairingError's text, or "" if `body` did not throw one.
    func failureMessage(_ body: () async throws -> PeripheralPairing.Result) async -> String {
        do {
            _ = try await body()
            return ""
        } catch let error as PairingError {
            return error.description
        } catch {
            return "unexpected \(error)"
        }
    }

    @Test func justWorksBondsTrustsAndRecordsTheIdentityAddress() async throws {
        try await withPairing(.justWorks) { fake, pairing, store in
            let result = try await pairing.pair(address: address, passkey: nil, store: store)
            #expect(result.method == .justWorks)
            #expect(result.bonded)
            #expect(result.addressType == "random")
            #expect(fake.calls.contains("Device1.Pair \(FakeBlueZ.devicePath)"))
            #expect(fake.state.withLock { $0.tree[FakeBlueZ.devicePath]?[BlueZInterface.device]?["Trusted"] } == .bool(true))
            // The agent asked for NoInputNoOutput: Just Works is the only method without a number.
            #expect(fake.state.withLock { $0.agents.first?.capability } == "NoInputNoOutput")
            let trusted = try store.trustedPeripherals()
            #expect(trusted.map(\.address) == [address])
            #expect(trusted.first?.pairingMethod == .justWorks)
            #expect(trusted.first?.name == "ferry-sensor")
        }
    }

    @Test func theRightPasskeyPairsAndAWrongOneRecordsNothing() async throws {
        try await withPairing(.passkey(expected: 4_321)) { fake, pairing, store in
            let wrong = await #expect(throws: PairingError.self) {
                try await pairing.pair(address: address, passkey: 1_234, store: store)
            }
            #expect(wrong?.description.contains("authentication failed") == true)
            #expect(wrong?.description.contains("wrong passkey") == true)
            let remaining = try store.trustedPeripherals()
            #expect(remaining.isEmpty)
            #expect(fake.state.withLock { $0.agents.first?.capability } == "KeyboardDisplay")

            let result = try await pairing.pair(address: address, passkey: 4_321, store: store)
            #expect(result.method == .passkey)
            #expect(try store.trustedPeripheral(address)?.pairingMethod == .passkey)
        }
    }

    @Test func aPasskeyPeripheralWithoutANumberSaysWhatToDo() async throws {
        try await withPairing(.passkey(expected: 4_321)) { _, pairing, store in
            let message = await failureMessage { try await pairing.pair(address: address, passkey: nil, store: store) }
            #expect(message.contains("--passkey"), "\(message)")
            let remaining = try store.trustedPeripherals()
            #expect(remaining.isEmpty)
        }
    }

    @Test func numericComparisonAcceptsOnlyTheOperatorsNumber() async throws {
        try await withPairing(.numericComparison(shown: 777_777)) { _, pairing, store in
            await #expect(throws: PairingError.self) {
                try await pairing.pair(address: address, passkey: 123_456, store: store)
            }
            let remaining = try store.trustedPeripherals()
            #expect(remaining.isEmpty)
            let result = try await pairing.pair(address: address, passkey: 777_777, store: store)
            #expect(result.method == .numericComparison)
        }
    }

    @Test func theOperatorIsAskedForNumbersThatOnlyExistOncePairingHasBegun() async throws {
        // Passkey entry: the peripheral displays a fresh number; the operator types it when asked.
        try await withPairing(.passkey(expected: 31_337)) { fake, pairing, store in
            var asked = pairing
            asked.operatorPrompt = .init(enterPasskey: { 31_337 }, confirmNumber: { _ in false })
            let result = try await asked.pair(address: address, passkey: nil, store: store)
            #expect(result.method == .passkey)
            #expect(fake.state.withLock { $0.agents.first?.capability } == "KeyboardDisplay")
        }
        // Numeric comparison: the operator sees the number (with leading zeros) and says yes, or no.
        let shown = LockedValue<[String]>([])
        try await withPairing(.numericComparison(shown: 4_242)) { _, pairing, store in
            var refusing = pairing
            let record: @Sendable (String) async -> Bool = { number in
                shown.withLock { list in list.append(number) }
                return false
            }
            refusing.operatorPrompt = .init(enterPasskey: { nil }, confirmNumber: record)
            let message = await failureMessage { try await refusing.pair(address: address, passkey: nil, store: store) }
            #expect(message.contains("not confirmed"), "\(message)")
            var accepting = pairing
            accepting.operatorPrompt = .init(enterPasskey: { nil }, confirmNumber: { _ in true })
            let accepted = try await accepting.pair(address: address, passkey: nil, store: store)
            #expect(accepted.method == .numericComparison)
        }
        #expect(shown.withLock { $0 } == ["004242"])
    }

    @Test func aPeripheralWithoutTheSyncServiceIsNotTrustedAndItsBondIsRemoved() async throws {
        let tree = FakeBlueZ.batteryOnlyDevice()
        try await withPairing(.justWorks, tree: tree) { fake, pairing, store in
            let message = await failureMessage { try await pairing.pair(address: address, passkey: nil, store: store) }
            #expect(message.contains("not a Sync peripheral"), "\(message)")
            #expect(fake.calls.contains("Adapter1.RemoveDevice \(FakeBlueZ.adapterPath)"))
            let remaining = try store.trustedPeripherals()
            #expect(remaining.isEmpty)
        }
    }

    @Test func agentRejectsWhatItCannotAnswerWithBlueZErrorNames() async throws {
        let bus = try TestBus()
        let fake = try await FakeBlueZ.start(on: bus)
        defer { fake.stop() }
        let client = try await BlueZClient(connection: try await bus.connect())
        let seen = LockedValue<[BlueZAgentRequest]>([])
        let agent = try await BlueZAgent.register(
            client: client, capability: .keyboardDisplay,
            policy: .pairing(
                device: FakeBlueZ.devicePath, passkey: 42, observe: { request in seen.withLock { $0.append(request) } }))
        defer { Task { await agent.unregister() } }
        func ask(_ member: String, _ arguments: [DBusValue]) async throws -> DBusReply {
            try await fake.connection.call(
                destination: client.connection.uniqueName, path: "/ferry/agent", interface: "org.bluez.Agent1",
                member: member, arguments: arguments, timeout: .seconds(5))
        }
        let other = "/org/bluez/hci0/dev_66_66_66_66_66_66"
        #expect(try await ask("RequestPasskey", [.objectPath(FakeBlueZ.devicePath)]).arguments == [.uint32(42)])
        _ = try await ask("RequestConfirmation", [.objectPath(FakeBlueZ.devicePath), .uint32(42)])
        for (member, arguments) in [
            ("RequestConfirmation", [DBusValue.objectPath(FakeBlueZ.devicePath), .uint32(43)]),
            ("RequestPasskey", [.objectPath(other)]),
            ("RequestPinCode", [.objectPath(FakeBlueZ.devicePath)]),
            ("RequestAuthorization", [.objectPath(other)]),
        ] {
            let refused = await #expect(throws: DBusError.self) { try await ask(member, arguments) }
            #expect(refused?.name == "org.bluez.Error.Rejected", "\(member)")
        }
        _ = try await ask("DisplayPasskey", [.objectPath(FakeBlueZ.devicePath), .uint32(7), .uint16(0)])
        _ = try await ask("Cancel", [])
        let requests = seen.withLock { $0 }
        #expect(requests.contains(.displayPasskey(device: FakeBlueZ.devicePath, passkey: "000007")))
        #expect(requests.contains(.canceled))
        #expect(BlueZAgent.address(ofDevicePath: FakeBlueZ.devicePath) == FakeBlueZ.deviceAddress)
    }

    @Test func theDaemonNeverConnectsAnUnbondedPeripheralAndSaysWhy() async throws {
        let bus = try TestBus()
        let fake = try await FakeBlueZ.start(on: bus, tree: syncPeripheralTree(paired: false))
        defer { fake.stop() }
        let dir = try TemporaryDirectory("daemon")
        defer { dir.remove() }
        var configuration = DaemonConfiguration()
        configuration.stateDir = dir.path("state")
        configuration.peripherals = [PeripheralPolicy(address: address)]
        let log = RecordingLog()
        let daemon = try GatewayDaemon.onTestBus(bus, configuration: configuration, log: log)
        let running = Task { try await daemon.run() }
        defer { running.cancel() }

        func waitFor(_ what: String, seconds: Double = 10, _ condition: () -> Bool) async throws {
            let deadline = Date().addingTimeInterval(seconds)
            while !condition() {
                guard Date() < deadline else { throw PairingError("timed out waiting for \(what)") }
                try await Task.sleep(for: .milliseconds(50))
            }
        }
        try await waitFor("the refusal") { log.all.contains { $0.contains(address.string) && $0.contains("not bonded") } }
        try await Task.sleep(for: .milliseconds(800))  // several scheduling rounds
        #expect(!fake.calls.contains { $0.hasPrefix("Device1.Connect") })
        #expect(log.all.filter { $0.contains("not bonded") }.count == 1, "logged once, not every round")
        #expect(fake.state.withLock { $0.agents.map(\.path) } == ["/ferry/agent"])
        let state = try GatewayStore(path: configuration.databasePath).syncState(address)
        #expect(state?.lastResult == "refused: not bonded")

        // Once BlueZ holds a bond (ferry pair did it), the same daemon connects it.
        try fake.setProperty(FakeBlueZ.devicePath, BlueZInterface.device, "Paired", .bool(true))
        try fake.setProperty(FakeBlueZ.devicePath, BlueZInterface.device, "Bonded", .bool(true))
        try await waitFor("a connect") { fake.calls.contains { $0.hasPrefix("Device1.Connect") } }
        #expect(log.all.contains { $0.contains("bonded now") })
        running.cancel()
        _ = await running.result
    }
}
