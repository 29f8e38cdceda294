import FerryGateway
import FerrySync
import FerryProtocol
import FerrySimulator
import FerryStore
import FerryTestSupport
import Foundation
import Testing

/// A link as bad as the real ones in shared notes, and worse: every fault knob on at once.
func hostileLink(drops: Bool = true) -> SimulatedPeripheral.Faults {
    var faults = SimulatedPeripheral.Faults()
    faults.bitFlipRate = 2e-5
    faults.dropNotification = drops ? 0.005 : 0
    faults.duplicateFrame = 0.01
    faults.disconnectPerNotification = 0.0005
    faults.ignoreRequest = 0.15
    faults.oversizeHeaderPerFrame = 0.002
    faults.unknownTypePerFrame = 0.002
    faults.noisePerFrame = 0.005
    return faults
}

@Suite("Faults")
struct FaultTests {
    @Test("12k events through every link fault, STREAM_INFO peripheral", arguments: [(UInt64(7), 20), (UInt64(8), 244)])
    func hostileWithStreamInfo(seed: UInt64, notificationSize: Int) async throws {
        let dir = try TemporaryDirectory("hostile")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.notificationSize = notificationSize
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, faults: hostileLink(),
            seed: seed)
        try peripheral.record(count: 12_000)
        let gateway = try Gateway(directory: dir)
        let sessions = try await gateway.syncUntilCaughtUp(peripheral)
        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 12_000)
        #expect(ledger.gapSeqs == 0, "nothing was lost by the peripheral, so no GAP may be recorded")
        #expect(peripheral.statistics.notificationsDropped > 0 && peripheral.statistics.bitsFlipped > 0)
        #expect(peripheral.statistics.junkInjected > 0 && peripheral.statistics.duplicatesSent > 0)
        #expect(peripheral.statistics.requestsIgnored > 0)
        peripheral.faults = .none
        let again = try await gateway.session(with: peripheral)
        #expect(again.caughtUp && again.summary.framesStored == 0, "a second sync transfers nothing: \(again)")
        print("hostile(\(seed), \(notificationSize)): \(sessions) sessions, \(peripheral.statistics)")
    }

    @Test("12k events through every link fault, peripheral without STREAM_INFO (epoch 0, idle fallback)")
    func hostileWithoutStreamInfo() async throws {
        let dir = try TemporaryDirectory("nostreaminfo")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.hasStreamInfo = false
        config.notificationSize = 64
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, faults: hostileLink(),
            seed: 11)
        try peripheral.record(count: 12_000)
        let gateway = try Gateway(directory: dir)
        let sessions = try await gateway.syncUntilCaughtUp(peripheral)
        let ledger = try expectConsistent(gateway, peripheral)
        #expect(ledger.storedEvents == 12_000)
        #expect(ledger.streams.count == 1 && ledger.streams[0].status.epoch == "0")
        print("no STREAM_INFO: \(sessions) sessions, gaps \(ledger.gapSeqs), \(peripheral.statistics)")
    }
}

@Test("a silent peripheral gets 3 SYNC_REQs, then the gateway disconnects; the next session catches up")
func silentPeripheral() async throws {
    let dir = try TemporaryDirectory("silent")
    defer { dir.remove() }
    var silent = SimulatedPeripheral.Faults()
    silent.ignoreRequest = 1
    let peripheral = try SimulatedPeripheral(directory: nil, faults: silent, seed: 95)
    try peripheral.record(count: 500)
    let gateway = try Gateway(directory: dir)
    let first = try await gateway.session(with: peripheral)
    #expect(first.summary.end == .disconnected(.noResponse))
    #expect(first.control.map(\.type) == [.syncRequest, .syncRequest, .syncRequest])
    #expect(peripheral.statistics.requestsIgnored == 3)
    peripheral.faults = .none
    try await gateway.syncUntilCaughtUp(peripheral)
    _ = try expectConsistent(gateway, peripheral)
}

@Test("a peripheral that stalls mid-sync with the link up (one stale duplicate per SYNC_REQ) is let go within the bound; the next session gets every event")
func stalledPeripheralFreesTheSlot() async throws {
    let dir = try TemporaryDirectory("stalled")
    defer { dir.remove() }
    var stall = SimulatedPeripheral.Faults()
    stall.stallAfterFrames = 300
    let peripheral = try SimulatedPeripheral(directory: nil, faults: stall, seed: 96)
    try peripheral.record(count: 1_500)
    let gateway = try Gateway(directory: dir)
    let startedAt = gateway.clock.now()
    let first = try await gateway.session(with: peripheral)
    // Ends (not hung, no step cap), without a link loss, well within the documented no-progress bound.
    #expect(first.outcome.ending == .finished, "\(first)")
    #expect(first.summary.end == .disconnected(.noResponse) || first.summary.end == .disconnected(.noProgress), "\(first)")
    #expect(first.outcome.endedAt - startedAt <= gateway.configuration.noProgressTimeout + 1, "\(first)")
    #expect(first.summary.cursor >= 280 && first.summary.cursor <= 300, "\(first)")
    #expect(peripheral.statistics.staleAnswers >= 2)
    // The later session (the stall was one firmware hiccup) completes every event.
    try await gateway.syncUntilCaughtUp(peripheral)
    let ledger = try expectConsistent(gateway, peripheral)
    #expect(ledger.storedEvents == 1_500)
}

@Test("the simulator's driver reports a session with nothing left to wait for as hung, like the live driver would hold it")
func driverReportsHungSessions() async throws {
    let dir = try TemporaryDirectory("hung")
    defer { dir.remove() }
    let peripheral = try SimulatedPeripheral(directory: nil, faults: .none, seed: 97)
    try peripheral.record(count: 30)
    let gateway = try Gateway(directory: dir)
    // Stay connected, caught up, no live events, no stop time: the live daemon would wait forever.
    gateway.configuration.stayConnected = true
    let record = try await gateway.session(with: peripheral)
    #expect(record.outcome.ending == .hung, "\(record)")
    #expect(record.summary.cursor == 30)
}

@Test("a link loss is recorded as the session's result (ferry peripherals must not show the previous one)")
func linkLossIsRecordedAsTheSessionsResult() async throws {
    let dir = try TemporaryDirectory("linklost")
    defer { dir.remove() }
    let peripheral = try SimulatedPeripheral(directory: nil, faults: .none, seed: 98)
    try peripheral.record(count: 100)
    let gateway = try Gateway(directory: dir)
    _ = try await gateway.session(with: peripheral)
    #expect(try gateway.store.syncState(gateway.address)?.lastResult == "caughtUp")
    try peripheral.record(count: 500)
    var dropping = SimulatedPeripheral.Faults()
    dropping.disconnectPerNotification = 0.5
    peripheral.faults = dropping
    let lost = try await gateway.session(with: peripheral)
    #expect(lost.outcome.ending == .linkLost && lost.summary.end == .linkLost, "\(lost)")
    #expect(try gateway.store.syncState(gateway.address)?.lastResult == "linkLost")
}

/// A second SQLite connection that holds the write lock until `release` (from any thread, one at a time).
private final class LockHolder: @unchecked Sendable {
    let store: GatewayStore
    init(path: String) throws { store = try GatewayStore(path: path) }
    func hold() throws { try store.database.execute("BEGIN IMMEDIATE") }
    func release() { try? store.database.execute("COMMIT") }
}

@Test("a commit that finds the store locked by another writer (a long prune) is retried, not the end of the session")
func busyStoreIsRetriedNotFatal() async throws {
    let dir = try TemporaryDirectory("busy")
    defer { dir.remove() }
    let peripheral = try SimulatedPeripheral(directory: nil, faults: .none, seed: 99)
    try peripheral.record(count: 100)
    let gateway = try Gateway(directory: dir)
    let holder = try LockHolder(path: gateway.dbPath)
    let transport = SimulatedTransport(connectingTo: peripheral, now: gateway.clock.now())
    let runner = SyncSessionRunner(
        peripheral: gateway.address, store: gateway.store, transport: transport, configuration: gateway.configuration,
        clock: gateway.clock)
    var locked = false
    transport.controlHook = { frame in
        // At the first SYNC_REQ the stream is open; the first commit then meets the lock, held ~6 s: longer
        // than one busy timeout (5 s), shorter than the retries.
        if frame.type == .syncRequest && !locked {
            locked = true
            try? holder.hold()
            Thread.detachNewThread {
                Thread.sleep(forTimeInterval: 6)
                holder.release()
            }
        }
        return .deliver
    }
    let outcome = await SessionDriver.run(runner: runner, transport: transport, clock: gateway.clock)
    #expect(locked)
    #expect(outcome.ending == .finished && runner.summary.end == .disconnected(.caughtUp), "\(runner.summary)")
    #expect(runner.summary.framesStored == 100)
}

@Test("each corrupt run is logged at debug with where it came from: damaged bytes in a notification, or a frame cut short by a lost one")
func corruptRunsAreLoggedWithTheirCause() async throws {
    let dir = try TemporaryDirectory("corruptlog")
    defer { dir.remove() }
    var config = SimulatedPeripheral.Configuration()
    config.notificationSize = 64  // frames span notifications: a lost one leaves a frame incomplete
    var faults = SimulatedPeripheral.Faults()
    faults.dropNotification = 0.05
    faults.bitFlipRate = 2e-5
    let peripheral = try SimulatedPeripheral(directory: nil, configuration: config, faults: faults, seed: 31)
    try peripheral.record(count: 3_000)
    let store = try GatewayStore(path: dir.path("gateway.sqlite"))
    let clock = ManualClock(start: 100)
    let transport = SimulatedTransport(connectingTo: peripheral, now: clock.now())
    let lines = StoragePressureTests.Lines()
    let runner = SyncSessionRunner(
        peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, store: store, transport: transport, clock: clock,
        log: lines)
    _ = await SessionDriver.run(runner: runner, transport: transport, clock: clock)
    let logged = lines.matching("corrupt run")
    #expect(runner.summary.corrupt > 0, "the faults produced corrupt runs: \(peripheral.statistics)")
    // One line per corrupt run, or per group of them judged at once ("corrupt runs 4-6").
    let counted = logged.map { line -> Int in
        guard let range = line.firstMatch(of: #/corrupt runs (\d+)-(\d+) /#) else { return 1 }
        return Int(range.2)! - Int(range.1)! + 1
    }.reduce(0, +)
    #expect(counted == runner.summary.corrupt, "every corrupt run accounted for: \(logged)")
    #expect(lines.lines.withLock { $0.filter { $0.1.contains("corrupt run") }.allSatisfy { $0.0 == LogLevel.debug } })
    #expect(logged.contains { $0.contains("on the idle timeout: a frame left incomplete") }, "a lost notification: \(logged.count) lines")
    #expect(logged.contains { $0.contains("notification(s) of") }, "damaged bytes inside a notification: \(logged)")
    #expect(logged.allSatisfy { $0.hasPrefix("C0:FF:EE:00:00:01: corrupt run") && $0.contains("bytes discarded so far") })
    // The re-requests the damage caused are on the debug log too (the duplicates that follow them).
    let requests = lines.matching(": SYNC_REQ ")
    #expect(requests.count == runner.machine.statistics.syncRequests && requests.count > 1)
    #expect(requests.first?.contains("SYNC_REQ 1 from 0, window") == true && requests.dropFirst().allSatisfy { $0.contains("re-request") })
}
