import FerryGateway
import FerrySync
import FerryProtocol
import FerrySimulator
import FerryStore
import FerryTestSupport
import Foundation
import Testing

@Suite("Peripheral lifecycle: losses, wipes, regressions, crashes, live events")
struct LifecycleTests {
    @Test("events the peripheral evicted become exactly the GAP records", arguments: [true, false])
    func evictionsBecomeGaps(hasStreamInfo: Bool) async throws {
        let dir = try TemporaryDirectory("evict")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.hasStreamInfo = hasStreamInfo
        config.capacity = 1_000
        var faults = hostileLink()
        faults.disconnectPerNotification = 0
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, faults: faults, seed: 21)
        let gateway = try Gateway(directory: dir)
        try peripheral.record(count: 4_000)  // 1...3000 evicted before the gateway ever connects
        try await gateway.syncUntilCaughtUp(peripheral)
        try peripheral.record(count: 2_500)  // 4001...5500 evicted
        try await gateway.syncUntilCaughtUp(peripheral)
        try peripheral.record(count: 700)  // nothing evicted
        try await gateway.syncUntilCaughtUp(peripheral)

        let ledger = try expectConsistent(gateway, peripheral)
        #expect(peripheral.statistics.evicted == 4_500)
        #expect(ledger.gapSeqs == 4_500, "every evicted event is in a GAP record, nothing else is")
        #expect(ledger.lostAndMissing == 4_500)
        #expect(ledger.storedEvents == 7_200 - 4_500)
        #expect(try gateway.gapRecords().map(\.range) == [1...3_000, 4_001...5_500])
    }

    @Test("a wiped peripheral (new epoch) starts a new stream; the old stream's rows are kept")
    func epochResetStartsANewStream() async throws {
        let dir = try TemporaryDirectory("epoch")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: dir.url.appendingPathComponent("device"), seed: 31)
        let gateway = try Gateway(directory: dir)
        try peripheral.record(count: 5_000)
        try await gateway.syncUntilCaughtUp(peripheral)
        let oldEpoch = peripheral.epoch
        try peripheral.record(count: 2_000)  // never synced: lost in the wipe, and nobody can know
        try peripheral.resetEpoch()
        try peripheral.record(count: 3_000)
        try await gateway.syncUntilCaughtUp(peripheral)

        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.streams.count == 2)
        let old = try #require(ledger.streams.first { $0.status.deviceEpoch == String(oldEpoch) })
        #expect(old.frames.count == 5_000 && old.status.cursor == 5_000)
        let new = try #require(ledger.activeStream(for: peripheral))
        #expect(new.status.epoch == String(peripheral.epoch) && new.frames.count == 3_000)
        #expect(ledger.lostAndMissing == 2_000 && ledger.gapSeqs == 0)
    }

    @Test("a counter regression is recorded, the stream is rebased, and the old rows are kept")
    func regressionIsRecordedAndRebased() async throws {
        let dir = try TemporaryDirectory("regress")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: dir.url.appendingPathComponent("device"), seed: 41)
        let gateway = try Gateway(directory: dir)
        try peripheral.record(count: 3_000)
        try await gateway.syncUntilCaughtUp(peripheral)
        try peripheral.regressCounter()
        try peripheral.record(count: 1_000)
        try await gateway.syncUntilCaughtUp(peripheral)

        let ledger = try expectConsistent(gateway, peripheral)
        #expect(try gateway.outboxCount(type: .regression) == 1)
        #expect(gateway.sessions.last?.summary.regressions == 1)
        #expect(ledger.streams.count == 2)
        let old = try #require(ledger.streams.first)
        #expect(!old.status.active && old.frames.count == 3_000 && old.status.cursor == 3_000)
        let new = try #require(ledger.activeStream(for: peripheral))
        // Same device epoch, a fresh store epoch: seq 1...1000 again without colliding with the old rows.
        #expect(new.status.deviceEpoch == String(peripheral.epoch) && new.status.epoch != new.status.deviceEpoch)
        #expect(new.frames.count == 1_000 && new.status.cursor == 1_000)
        let regression = try gateway.store.database.text(
            "SELECT payload FROM outbox_events WHERE event_type = 'REGRESSION'") ?? ""
        #expect(regression.contains(#""cursor":"3000","head":"1000""#), "\(regression)")
    }

    @Test("crash between commit and ACK, again and again: reopen the files, nothing lost, nothing twice")
    func crashBetweenCommitAndAck() async throws {
        let dir = try TemporaryDirectory("crash")
        defer { dir.remove() }
        var faults = hostileLink()
        faults.disconnectPerNotification = 0.0002
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), faults: faults, seed: 51)
        try peripheral.record(count: 10_000)
        let gateway = try Gateway(directory: dir)
        var random = SeededGenerator(seed: 52)
        try await gateway.syncUntilCaughtUp(peripheral, maxSessions: 200) { _ in random.chance(0.02) }

        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 10_000 && ledger.gapSeqs == 0)
        #expect(gateway.crashes >= 5, "the test must actually crash the gateway")
        // After each crash the committed-but-unacknowledged frames are not asked for again: the restarted
        // gateway's first CONTROL write names the cursor committed before the crash, above what the
        // peripheral saw acknowledged.
        for (i, session) in gateway.sessions.enumerated() {
            guard let ack = session.crashedBeforeAck, i + 1 < gateway.sessions.count else { continue }
            let first = gateway.sessions[i + 1].attemptedControl.first
            #expect(first?.seq == ack, "after a crash before SYNC_ACK(\(ack)) the restarted gateway wrote \(String(describing: first))")
        }
    }

    @Test("live events while staying connected, stopped gracefully, then a catch-up session")
    func liveEventsWhileConnected() async throws {
        let dir = try TemporaryDirectory("live")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.liveEventInterval = 0.005
        var faults = hostileLink()
        faults.disconnectPerNotification = 0
        faults.ignoreRequest = 0
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, faults: faults, seed: 61)
        try peripheral.record(count: 2_000)
        let gateway = try Gateway(directory: dir)
        gateway.configuration.stayConnected = true
        gateway.limits.stopAt = gateway.clock.now() + 40
        let live = try await gateway.session(with: peripheral)
        #expect(live.outcome.ending == .finished && live.summary.end == .disconnected(.shutdown))
        #expect(peripheral.head > 2_000 + 5_000, "live events were generated while connected")
        #expect(live.summary.cursor > 2_000 + 4_000, "and stored while connected")

        gateway.configuration.stayConnected = false
        try await gateway.syncUntilCaughtUp(peripheral)
        _ = try expectConsistent(gateway, peripheral)
    }
}
