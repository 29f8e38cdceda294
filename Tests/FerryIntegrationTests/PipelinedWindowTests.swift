import FerryGateway
import FerrySync
import FerryProtocol
import FerrySimulator
import FerryStore
import FerryTestSupport
import Foundation
import Testing

/// The pipelined window (PROTOCOL "Window and ACK cadence"): the gateway asks for more frames than it
/// acknowledges at a time, so frames are on the air past the batch being committed. The durability rule is
/// checked at every SYNC_ACK by the `Gateway` helper (a second connection must already see the frames).
@Suite("Pipelined window")
struct PipelinedWindowTests {
    @Test("Default window 2000 / ACK every 20: one session, exactly once, frames on the air past the ACK")
    func defaultIsPipelined() async throws {
        let dir = try TemporaryDirectory("pipelined")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: dir.url.appendingPathComponent("device"), seed: 21)
        try peripheral.record(count: 3_000)
        let gateway = try Gateway(directory: dir)
        #expect(gateway.configuration.window == 2000 && gateway.configuration.ackBatch == 20)
        let sessions = try await gateway.syncUntilCaughtUp(peripheral)
        #expect(sessions == 1)
        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 3_000 && ledger.gapSeqs == 0)
        let record = try #require(gateway.sessions.first)
        #expect(record.control.first?.requestedWindow == 2000)
        // Pipelined: more than one ACK batch was on the air beyond the last ACK, never more than the window.
        #expect(peripheral.statistics.maxFramesBeyondAck > 20)
        #expect(peripheral.statistics.maxFramesBeyondAck <= 2000)
        // The cadence is unchanged: an ACK per 20 committed frames, each naming a committed cursor.
        #expect(record.acksSent.count == 3_000 / 20)
        #expect(record.acksSent.recent.allSatisfy { $0 % 20 == 0 })
    }

    @Test("A peripheral that honours only 20 (caps the requested 2000) still syncs everything")
    func peripheralCapsTheWindow() async throws {
        let dir = try TemporaryDirectory("capped")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.maxWindow = 20
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, seed: 22)
        try peripheral.record(count: 3_000)
        let gateway = try Gateway(directory: dir)
        let sessions = try await gateway.syncUntilCaughtUp(peripheral)
        #expect(sessions == 1)
        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 3_000 && ledger.gapSeqs == 0)
        #expect(peripheral.statistics.maxFramesBeyondAck == 20, "the cap held")
        #expect(gateway.sessions[0].control.first?.requestedWindow == 2000)
    }

    @Test("A peripheral that sends past the window: the excess is dropped and asked for again, nothing lost")
    func peripheralSendsPastTheWindow() async throws {
        let dir = try TemporaryDirectory("past-window")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.sendsPastWindow = 30
        // Notifications of ~100 frames: a whole one reaches the session before the commit it starts has run, as
        // frames pile up behind a slow commit on a real link.
        config.notificationSize = 4000
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, seed: 24)
        try peripheral.record(count: 600)
        let gateway = try Gateway(directory: dir)
        gateway.configuration.window = 40
        try await gateway.syncUntilCaughtUp(peripheral)
        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 600 && ledger.gapSeqs == 0)
        #expect(peripheral.statistics.maxFramesBeyondAck > 40, "the peripheral did send past the window")
        #expect(gateway.sessions.map(\.statistics.pastWindow).reduce(0, +) > 0)
    }

    @Test("A cap below the ACK cadence: every batch ends on the idle timeout, nothing is lost")
    func capBelowCadence() async throws {
        let dir = try TemporaryDirectory("capped-small")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.maxWindow = 7
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, seed: 23)
        try peripheral.record(count: 300)
        let gateway = try Gateway(directory: dir)
        try await gateway.syncUntilCaughtUp(peripheral)
        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 300 && ledger.gapSeqs == 0)
        #expect(peripheral.statistics.maxFramesBeyondAck <= 7)
    }

    @Test(
        "Frames in flight far past the ACK through every link fault: gap, drain, stall and idle rules hold",
        arguments: [(UInt16(40), 20, UInt64(31)), (UInt16(200), 20, UInt64(32)), (UInt16(60), 7, UInt64(33))])
    func hostilePipelined(window: UInt16, ackEvery: Int, seed: UInt64) async throws {
        let dir = try TemporaryDirectory("pipelined-hostile")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.notificationSize = 244
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, faults: hostileLink(),
            seed: seed)
        try peripheral.record(count: 6_000)
        let gateway = try Gateway(directory: dir)
        gateway.configuration.window = window
        gateway.configuration.ackBatch = ackEvery
        try await gateway.syncUntilCaughtUp(peripheral)
        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 6_000)
        #expect(ledger.gapSeqs == 0, "nothing was lost by the peripheral, so no GAP may be recorded")
        #expect(peripheral.statistics.notificationsDropped > 0)
        #expect(peripheral.statistics.maxFramesBeyondAck > ackEvery)
    }

    @Test("A backlog that is not a multiple of the cadence: the last partial batch commits at the head, not after idle")
    func partialBatchAtHead() async throws {
        let dir = try TemporaryDirectory("partial-head")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: dir.url.appendingPathComponent("device"), seed: 24)
        try peripheral.record(count: 207)
        let gateway = try Gateway(directory: dir)
        try await gateway.syncUntilCaughtUp(peripheral)
        let record = try #require(gateway.sessions.first)
        #expect(record.caughtUp)
        #expect(record.acksSent.last == 207)
        // ~40 notifications at 1 ms each: the session ends well inside the 0.25 s idle timeout instead of
        // waiting it out for the last 7 frames. (The driver's clock only moves per notification and deadline.)
        let startedAt = 1_000.0
        #expect(record.outcome.endedAt - startedAt < 0.2, "ended at +\(record.outcome.endedAt - startedAt) s")
        _ = try expectConsistent(gateway, peripheral)
    }
}
