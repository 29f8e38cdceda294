import FerryCLI
import FerryProtocol
import FerryStore
import Foundation
import Testing

/// `ferry pair | unpair | peripherals` without a radio: argument errors, the trusted list and its JSON, and
/// what happens when bluetoothd cannot be reached. (With real bluetoothd: Tests/testbed/sync_pairing.py.)
///
/// Commands that go to the bus run as the real binary: in-process they would block a thread of the test
/// runner's small cooperative pool on their async work (a deadlock on a 2-core machine).
@Suite struct PairingCommandTests {
    func binary(_ arguments: String...) async throws -> CommandResult {
        let finished = try await BinaryTests.run(arguments)
        func lines(_ text: String) -> [String] { text.split(separator: "\n").map(String.init) }
        return CommandResult(status: finished.status, stdout: lines(finished.stdout), stderr: lines(finished.stderr))
    }

    /// A bus address where nothing listens: bluetoothd "unreachable" in a bounded, immediate way.
    let deadBus = "unix:path=/nonexistent/ferry-test-bus"

    @Test func pairRejectsBadArgumentsBeforeTouchingAnything() throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        #expect(ferry("pair", "--db", db).status == 2)  // no --address
        #expect(ferry("pair", "--address", "nope", "--db", db).status == 2)
        let passkey = ferry("pair", "--address", peripheral, "--passkey", "1234567", "--db", db)
        #expect(passkey.status == 2)
        #expect(passkey.stderr.joined().contains("--passkey must be a whole number (0...999999)"))
        #expect(ferry("unpair", "--db", db).status == 2)  // no ADDR
        #expect(try dir.entries().isEmpty, "a usage error creates no store")
    }

    @Test func pairWithoutBluetoothdFailsWithOneLineAndRecordsNothing() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let result = try await binary("pair", "--address", peripheral, "--db", db, "--bus", deadBus, "--timeout", "10")
        #expect(result.status == 1)
        #expect(result.stderr.count == 1)
        #expect(result.stderr.first?.contains("cannot reach bluetoothd") == true)
        #expect(try GatewayStore(path: db).trustedPeripherals().isEmpty)
    }

    @Test func peripheralsListsTrustedOnesWithCursorBacklogAndUnknownBond() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let address = PeripheralAddress(peripheral)!
        do {
            let store = try GatewayStore(path: db)
            try store.trust(
                TrustedPeripheral(
                    address: address, addressType: "public", name: "tank-3", pairingMethod: .passkey,
                    pairedAt: 1_796_000_000_000))
            let stream = try store.openStream(peripheral: address, deviceEpoch: 7)
            let frames = (1...30).map { Frame.data(seq: UInt64($0), payload: [UInt8($0)]) }
            _ = try store.commit(
                CommitBatch(expectedCursor: 0, gap: nil, frames: frames, newCursor: 30, acknowledge: true), to: stream.key)
            try store.recordSyncState(
                PeripheralSyncState(peripheral: address, lastSyncAt: 1_796_000_100_000, lastResult: "shutdown", epoch: 7, head: 45))
        }
        let result = try await binary("peripherals", "--db", db, "--bus", deadBus, "--json")
        #expect(result.status == 0)
        let json = try result.json()
        let list = try #require(json["peripherals"] as? [[String: Any]])
        try #require(list.count == 1)
        let p = list[0]
        #expect(
            Set(p.keys) == [
                "address", "name", "address_type", "pairing_method", "paired_at", "bond", "last_sync_at", "last_result",
                "epoch", "cursor", "head", "backlog",
            ])
        #expect(p["address"] as? String == peripheral)
        #expect(p["bond"] as? String == "unknown")
        #expect(p["pairing_method"] as? String == "passkey")
        #expect(p["paired_at"] as? String == "2026-11-30T00:53:20.000Z")
        #expect(p["last_result"] as? String == "shutdown")
        #expect(p["epoch"] as? String == "7")
        #expect(p["cursor"] as? String == "30")
        #expect(p["head"] as? String == "45")
        #expect(p["backlog"] as? String == "15")

        let table = try await binary("peripherals", "--db", db, "--bus", deadBus)
        #expect(table.status == 0)
        #expect(table.stdout.count == 2)
        #expect(table.stdout[1].hasPrefix(peripheral))
        #expect(table.stdout[1].contains("unknown"))
        #expect(table.stderr.joined().contains("bond state unknown"))
    }

    @Test func peripheralsOnAnEmptyRegistrySaysHowToPair() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        _ = try GatewayStore(path: db)
        let result = try await binary("peripherals", "--db", db, "--bus", deadBus)
        #expect(result.status == 0)
        #expect(result.stdout.first?.contains("ferry pair --address") == true)
        #expect(try await binary("peripherals", "--db", dir.file("missing.sqlite")).status == 1)
    }

    @Test func unpairWithoutBluetoothdKeepsTheTrustRecord() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let address = PeripheralAddress(peripheral)!
        try GatewayStore(path: db).trust(
            TrustedPeripheral(address: address, addressType: "public", name: nil, pairingMethod: .justWorks, pairedAt: 1))
        let result = try await binary("unpair", peripheral, "--db", db, "--bus", deadBus)
        #expect(result.status == 1)
        #expect(result.stderr.first?.contains("cannot reach bluetoothd") == true)
        // BlueZ would still hold the bond: forgetting only one side would leave them out of step.
        #expect(try GatewayStore(path: db).trustedPeripherals().map(\.address) == [address])
    }

    @Test func helpListsTheNewCommands() {
        let usage = ferry("--help").stdout.joined(separator: "\n")
        for command in ["pair", "unpair", "peripherals"] {
            #expect(usage.contains("  \(command) "), "\(command) missing from ferry --help")
            #expect(ferry(command, "--help").status == 0)
        }
        #expect(ferry("sync", "--help").stdout.joined().contains("--require-bond"))
        #expect(ferry("run", "--help").stdout.joined().contains("--allow-unbonded"))
    }
}
