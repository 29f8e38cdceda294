import FerryGateway
import FerrySync
import FerryProtocol
import FerrySimulator
import FerryStore
import FerryTestSupport
import Foundation
import Testing

@Suite("Whole sync sessions: engine + SQLite file + simulated peripheral")
struct SessionTests {
    @Test("10k-event backlog over a clean link: one session, exactly once, cursor == head; a second sync moves nothing")
    func cleanBacklog() async throws {
        let dir = try TemporaryDirectory("clean")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: dir.url.appendingPathComponent("device"), seed: 1)
        try peripheral.record(count: 10_000)
        let gateway = try Gateway(directory: dir)

        let sessions = try await gateway.syncUntilCaughtUp(peripheral)
        #expect(sessions == 1)
        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 10_000)
        #expect(ledger.gapSeqs == 0)
        #expect(gateway.sessions[0].acksSent.count >= 10_000 / 20)

        let outboxBefore = try gateway.outboxCount(type: .frames)
        let again = try await gateway.session(with: peripheral)
        #expect(again.caughtUp)
        #expect(again.summary.framesStored == 0)
        #expect(try gateway.outboxCount(type: .frames) == outboxBefore)
        _ = try expectConsistent(gateway, peripheral)
    }

    @Test("A session records how it ended (what ferry peripherals shows): result, store epoch, head")
    func sessionEndIsRecorded() async throws {
        let dir = try TemporaryDirectory("session-end")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: dir.url.appendingPathComponent("device"), seed: 2)
        try peripheral.record(count: 50)
        let gateway = try Gateway(directory: dir)
        #expect(try gateway.store.syncState(gateway.address) == nil)
        try await gateway.syncUntilCaughtUp(peripheral)
        let state = try #require(try gateway.store.syncState(gateway.address))
        #expect(state.lastResult == "caughtUp")
        #expect(state.head == 50)
        #expect(state.epoch != nil)
        #expect(state.epoch == (try gateway.store.activeCursor(gateway.address)?.epoch))
    }
}

@Test("SessionDriver.syncUntilCaughtUp (the CLI/benchmark helper) reaches the head through faults")
func driverHelperCatchesUp() async throws {
    let dir = try TemporaryDirectory("helper")
    defer { dir.remove() }
    let peripheral = try SimulatedPeripheral(directory: nil, faults: hostileLink(), seed: 91)
    try peripheral.record(count: 3_000)
    let store = try GatewayStore(path: dir.path("g.sqlite"))
    let clock = ManualClock()
    let address = PeripheralAddress("C0:FF:EE:00:00:02")!
    let results = await SessionDriver.syncUntilCaughtUp(peripheral, clock: clock) { transport in
        SyncSessionRunner(peripheral: address, store: store, transport: transport, clock: clock)
    }
    #expect(results.last?.summary.end == .disconnected(.caughtUp))
    #expect(results.reduce(0) { $0 + $1.summary.framesStored } == 3_000)
    #expect(try store.frames(of: StreamKey(peripheral: address, epoch: peripheral.epoch)).count == 3_000)
    #expect(peripheral.violations.isEmpty)
}
