import FerryProtocol
import FerryStore
import Testing

/// The pairing registry (schema v2): trusted_peripherals and peripheral_sync_state on real SQLite files.
@Suite struct TrustedPeripheralsTests {
    let other = PeripheralAddress("C0:FF:EE:00:00:02")!

    func trusted(_ address: PeripheralAddress, method: PairingMethod = .justWorks, at millis: Int64 = 1_000) -> TrustedPeripheral {
        TrustedPeripheral(address: address, addressType: "random", name: "sensor", pairingMethod: method, pairedAt: millis)
    }

    @Test func trustListRepairAndForget() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("ferry.sqlite"), clock: FixedClock())
        #expect(try store.trustedPeripherals().isEmpty)
        try store.trust(trusted(other))
        try store.trust(trusted(testPeripheral))
        #expect(try store.trustedPeripherals().map(\.address) == [testPeripheral, other])  // ordered by address
        // Pairing again replaces the record (new method, new time) instead of failing or duplicating it.
        try store.trust(trusted(testPeripheral, method: .passkey, at: 2_000))
        #expect(try store.trustedPeripheral(testPeripheral)?.pairingMethod == .passkey)
        #expect(try store.trustedPeripheral(testPeripheral)?.pairedAt == 2_000)
        #expect(try store.trustedPeripherals().count == 2)
        #expect(try store.forget(testPeripheral) == true)
        #expect(try store.forget(testPeripheral) == false)
        #expect(try store.trustedPeripherals().map(\.address) == [other])
    }

    @Test func forgettingAPeripheralKeepsItsFramesAndOutbox() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("ferry.sqlite"), clock: FixedClock())
        try store.trust(trusted(testPeripheral))
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 9)
        _ = try store.commit(batch(from: 0, dataFrames(1...20)), to: stream.key)
        try store.forget(testPeripheral)
        #expect(try store.frames(of: stream.key).count == 20)
        #expect(try store.outboxCounts()[.pending] == 1)
        #expect(try store.activeCursor(testPeripheral).map { [$0.epoch, $0.cursor] } == [9, 20])
    }

    @Test func syncStateKeepsTheLastKnownHeadWhenASessionDidNotSeeOne() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("ferry.sqlite"), clock: FixedClock())
        #expect(try store.syncState(testPeripheral) == nil)
        try store.recordSyncState(
            PeripheralSyncState(peripheral: testPeripheral, lastSyncAt: 10, lastResult: "caughtUp", epoch: 9, head: 500))
        try store.recordSyncState(
            PeripheralSyncState(peripheral: testPeripheral, lastSyncAt: 20, lastResult: "refused: not bonded", epoch: nil, head: nil))
        let state = try store.syncState(testPeripheral)
        #expect(state?.lastSyncAt == 20)
        #expect(state?.lastResult == "refused: not bonded")
        #expect(state?.epoch == 9)
        #expect(state?.head == 500)
        // Heads above 2^63 survive the INTEGER bit-pattern round trip.
        try store.recordSyncState(
            PeripheralSyncState(peripheral: other, lastSyncAt: 1, lastResult: "caughtUp", epoch: 1, head: UInt64.max - 1))
        #expect(try store.syncState(other)?.head == UInt64.max - 1)
    }

    @Test func aVersion1StoreIsMigratedWithItsDataIntact() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("ferry.sqlite")
        do {
            // Make a version-1 file the way a previous Ferry left it: v1 tables, data, user_version 1.
            let store = try GatewayStore(path: path, clock: FixedClock())
            let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 3)
            _ = try store.commit(batch(from: 0, dataFrames(1...5)), to: stream.key)
            try store.database.execute(
                "DROP TABLE trusted_peripherals; DROP TABLE peripheral_sync_state; "
                    + "ALTER TABLE outbox_events DROP COLUMN batch_gateway; DROP TABLE uplink_forwarder; "
                    + "PRAGMA user_version = 1;")
        }
        let reopened = try GatewayStore(path: path, clock: FixedClock())
        #expect(try reopened.database.integer("PRAGMA user_version") == 4)
        #expect(try reopened.activeCursor(testPeripheral)?.cursor == 5)
        try reopened.trust(trusted(testPeripheral))
        #expect(try reopened.trustedPeripherals().count == 1)
    }

    @Test func theAddressTypeIsConstrained() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("ferry.sqlite"), clock: FixedClock())
        var bad = trusted(testPeripheral)
        bad.addressType = "resolvable"
        #expect(throws: StoreError.self) { try store.trust(bad) }
    }
}
