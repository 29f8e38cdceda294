import FerryProtocol
import FerrySimulator
import FerryStore
import FerryTestSupport
import Foundation
import Synchronization
import Testing

@testable import FerryGateway
@testable import FerrySync

#if canImport(Glibc)
    import Glibc
#endif

/// Issue 12 item 3: disk pressure converges without churning the radio. The daemon's storage gate, its storage
/// watch (real SQLite file) and its scheduler, composed exactly as `GatewayDaemon.schedulingLoop` composes them
/// (`signals.sessionsAllowed ? scheduler.due(now:) : []`), with real `SyncSessionRunner` sessions against
/// simulated peripherals, over simulated hours.
@Suite struct StoragePressureTests {
    final class Lines: LogSink {
        let lines = Mutex<[(LogLevel, String)]>([])
        func log(_ level: LogLevel, _ message: String) { lines.withLock { $0.append((level, message)) } }
        func matching(_ text: String) -> [String] { lines.withLock { $0.filter { $0.1.contains(text) }.map(\.1) } }
    }

    static func scheduler() -> SyncScheduler {
        var configuration = SyncScheduler.Configuration()
        configuration.maxConnections = 3
        configuration.syncInterval = 60
        configuration.backoffBase = 2
        configuration.backoffCap = 300
        return SyncScheduler(configuration: configuration)
    }

    @Test func gateClosesBacksOffOnTheSchedulersScheduleAndReopens() {
        let scheduler = Self.scheduler()
        var gate = StorageGate(routineInterval: 5)
        let over = StorageGate.Pressure.overBudget(used: 2_000, budget: 1_000)
        #expect(gate.sessionsAllowed)
        #expect(gate.isCheckDue(now: 0, nudged: false))
        #expect(gate.measured(nil, used: 500, now: 0, backoff: scheduler.backoff(afterFailures:)) == nil)
        #expect(!gate.isCheckDue(now: 4.9, nudged: false))
        #expect(gate.isCheckDue(now: 1, nudged: true))
        #expect(gate.isCheckDue(now: 5, nudged: false))

        #expect(gate.measured(over, used: 2_000, now: 10, backoff: scheduler.backoff(afterFailures:)) == .closed(over, retryIn: 2))
        #expect(!gate.sessionsAllowed)
        #expect(!gate.isCheckDue(now: 11.9, nudged: true), "a nudge does not shorten the backoff of a closed gate")
        var t = 12.0
        var waits: [Double] = []
        for _ in 0..<9 {
            #expect(gate.isCheckDue(now: t, nudged: false))
            guard case .stillClosed(_, let wait) = gate.measured(over, used: 2_000, now: t, backoff: scheduler.backoff(afterFailures:))
            else {
                Issue.record("expected stillClosed")
                return
            }
            waits.append(wait)
            t += wait
        }
        #expect(waits == [4, 8, 16, 32, 64, 128, 256, 300, 300])
        // The uplink delivers meanwhile: the next check comes within 2 s, not at the end of the 300 s backoff.
        gate.delivered(now: t - 290)
        #expect(gate.isCheckDue(now: t - 288, nudged: false))
        #expect(!gate.isCheckDue(now: t - 288.5, nudged: false))
        gate.delivered(now: t - 289)  // never later than already due
        #expect(gate.isCheckDue(now: t - 288, nudged: false))
        #expect(gate.measured(nil, used: 900, now: t, backoff: scheduler.backoff(afterFailures:)) == .reopened(used: 900))
        #expect(gate.sessionsAllowed)
        #expect(!gate.isCheckDue(now: t + 4, nudged: false))
    }

    struct Run {
        var connectionsBeforeDrain = 0
        var connectionsAfterDrain = 0
        var checksWhileClosedBeforeDrain = 0
        var reopenedAt: Double?
        var log = Lines()
        var heads: [UInt64] = []
        var stored: [Int] = []
        var undeliveredBeforeDrainKept = true
    }

    /// Two peripherals with a backlog, the uplink offline for the first half hour (nothing delivered, so
    /// nothing can be pruned), then delivering every 10 s. `gated: false` is the old daemon (no gate).
    static func simulate(gated: Bool) async throws -> Run {
        let dir = try TemporaryDirectory("pressure")
        defer { dir.remove() }
        let path = dir.path("ferry.sqlite")
        let store = try GatewayStore(path: path)
        let uplink = try GatewayStore(path: path)
        let watchStore = try GatewayStore(path: path)
        // Older undelivered events of a third peripheral: ~800 KB.
        let old = try store.openStream(peripheral: PeripheralAddress("C0:FF:EE:00:00:99")!, deviceEpoch: 0)
        for w in 0..<100 {
            let first = UInt64(w * 20 + 1)
            let frames = (first...(first + 19)).map { Frame.data(seq: $0, payload: [UInt8](repeating: 7, count: 400)) }
            try store.commit(
                CommitBatch(expectedCursor: first - 1, gap: nil, frames: frames, newCursor: first + 19, acknowledge: true),
                to: old.key)
        }
        try store.checkpointTruncatingWAL()
        let budget = try store.diskBytes() + 150_000
        let addresses = [PeripheralAddress("C0:FF:EE:00:00:01")!, PeripheralAddress("C0:FF:EE:00:00:02")!]
        var peripherals: [PeripheralAddress: SimulatedPeripheral] = [:]
        for (i, address) in addresses.enumerated() {
            let peripheral = try SimulatedPeripheral(directory: nil, seed: UInt64(40 + i))
            try peripheral.record(count: 6_000)
            peripherals[address] = peripheral
        }

        var run = Run()
        let signals = StorageSignals()
        var scheduler = Self.scheduler()
        scheduler.setCandidates(Set(addresses))
        let backoffScheduler = scheduler
        let clock = ManualClock(start: 0)
        let watch = StorageWatch(
            databasePath: path, budget: budget, signals: signals, log: run.log, clock: clock,
            backoff: { backoffScheduler.backoff(afterFailures: $0) })
        var gate = StorageGate()
        let drainAt = 1800.0
        var t = 0.0
        while t < 7200 {
            clock.advance(to: t)
            let checked = try watch.tick(now: t, gate: &gate, store: watchStore)
            if checked, t < drainAt, !gate.sessionsAllowed { run.checksWhileClosedBeforeDrain += 1 }
            if run.reopenedAt == nil, t >= drainAt, gate.sessionsAllowed { run.reopenedAt = t }
            if t >= drainAt, t.truncatingRemainder(dividingBy: 10) == 0 {
                var limits = ClaimLimits()
                limits.maxEvents = 500
                while let batch = try uplink.claimBatch(limits: limits, now: Int64.max / 2) {
                    try uplink.completeBatch(batch.id, now: 1_800_000_000_000 + Int64(t * 1000))
                }
            }
            // The daemon's line: no new session while the gate is closed.
            for address in (!gated || signals.sessionsAllowed) ? scheduler.due(now: t) : [] {
                if t < drainAt { run.connectionsBeforeDrain += 1 } else { run.connectionsAfterDrain += 1 }
                scheduler.started(address, now: t)
                let sessionClock = ManualClock(start: t)
                let transport = SimulatedTransport(connectingTo: peripherals[address]!, now: t)
                let runner = SyncSessionRunner(
                    peripheral: address, store: store, transport: transport, clock: sessionClock,
                    diskBudgetBytes: budget)
                _ = await SessionDriver.run(runner: runner, transport: transport, clock: sessionClock)
                let s = runner.summary
                // GatewayDaemon's outcome mapping and nudge.
                let outcome = SyncScheduler.Outcome(s, backlog: nil)
                if s.backpressure { signals.nudge(s.diskFull ? .diskFull : .overBudget) }
                scheduler.finished(address, outcome: outcome, now: t)
            }
            if t == drainAt - 0.5 {
                run.undeliveredBeforeDrainKept = try store.frames(of: old.key).count == 2000
            }
            t += 0.5
        }
        for address in addresses {
            run.heads.append(peripherals[address]!.head)
            let stream = try store.openStream(peripheral: address, deviceEpoch: peripherals[address]!.epoch)
            run.stored.append(Int(stream.cursor))
        }
        return run
    }

    @Test func noConnectionChurnWhileOverBudgetThenEverythingArrivesOnceTheUplinkDrains() async throws {
        let run = try await Self.simulate(gated: true)
        // Before: the two first sessions that ran into the budget (and their nudge closed the gate).
        #expect(run.connectionsBeforeDrain <= 4, "connections while over budget: \(run.connectionsBeforeDrain)")
        // Re-checks on the backoff schedule (2, 4, ... 300 s), not every 2 s.
        #expect(run.checksWhileClosedBeforeDrain <= 16, "\(run.checksWhileClosedBeforeDrain) checks")
        #expect(run.undeliveredBeforeDrainKept, "an undelivered event was pruned")
        // One line entering, one leaving (the gate may close again later while the uplink catches up, but the
        // first half hour is one episode).
        let entered = run.log.matching("no new sessions")
        let left = run.log.matching("): sessions resume")
        #expect(entered.count >= 1 && left.count == entered.count, "\(entered) / \(left)")
        let reopened = try #require(run.reopenedAt, "the gate never reopened")
        #expect(reopened <= 1800 + 300 + 10)
        #expect(run.connectionsAfterDrain > 0)
        // Converged: every event of both peripherals stored, nothing lost.
        #expect(run.stored == run.heads.map { Int($0) }, "stored \(run.stored) of \(run.heads)")
    }

    /// The same half hour without the gate (the daemon before issue 12): a session every backoff_base.
    @Test func withoutTheGateTheRadioChurns() async throws {
        let run = try await Self.simulate(gated: false)
        #expect(run.connectionsBeforeDrain >= 500, "\(run.connectionsBeforeDrain)")
    }

    static let isRoot = getuid() == 0

    /// Another program fills the disk mid-session: the commit fails with SQLITE_FULL, the session ends as
    /// backpressure (nothing acknowledged that is not committed, so the peripheral keeps the rest), the watch
    /// sees the disk full; once the space is freed the watch lets sessions run and the next one catches up.
    @Test(.enabled(if: isRoot, "needs root to mount a small tmpfs"))
    func sqliteFullInASessionLosesNothingAndRecoversWhenSpaceReturns() async throws {
        let disk = try SmallDisk("ferry-full", size: "16m")
        defer { disk.remove() }
        let mountPoint = disk.path
        let path = mountPoint + "/ferry.sqlite"
        let store = try GatewayStore(path: path)
        let filler = mountPoint + "/other-program.log"
        let room = 150 * 1024
        let free = try #require(store.freeBytes())
        try Data(repeating: 0x2E, count: Int(free) - room).write(to: URL(fileURLWithPath: filler))

        let address = PeripheralAddress("C0:FF:EE:00:00:01")!
        let peripheral = try SimulatedPeripheral(directory: nil, seed: 77)
        try peripheral.record(count: 6_000)
        let log = Lines()
        func session() async -> SyncSessionRunner {
            let clock = ManualClock(start: 0)
            let transport = SimulatedTransport(connectingTo: peripheral, now: 0)
            let runner = SyncSessionRunner(peripheral: address, store: store, transport: transport, clock: clock, log: log)
            _ = await SessionDriver.run(runner: runner, transport: transport, clock: clock)
            return runner
        }
        let first = await session()
        #expect(first.summary.backpressure && first.summary.diskFull, "\(first.summary)")
        #expect(log.matching("disk full (SQLITE_FULL)").count == 1)
        let stream = try store.openStream(peripheral: address, deviceEpoch: peripheral.epoch)
        #expect(stream.cursor > 0 && stream.cursor < peripheral.head, "cursor \(stream.cursor)")
        #expect((first.acksSent.highest ?? 0) <= stream.cursor, "acknowledged beyond what is committed")
        #expect(peripheral.retainedCount >= Int(peripheral.head - stream.cursor), "the peripheral dropped uncommitted events")
        #expect(try store.frames(of: stream.key).map(\.seq) == Array(1...stream.cursor))
        #expect(try store.quickCheck().isEmpty)

        // The daemon nudges its watch: the disk is full, nothing delivered to prune: the gate closes.
        let signals = StorageSignals()
        let watch = StorageWatch(
            databasePath: path, budget: 1 << 30, signals: signals, log: log, clock: ManualClock(start: 0),
            backoff: { Self.scheduler().backoff(afterFailures: $0) })
        var gate = StorageGate()
        signals.nudge(.diskFull)
        #expect(!signals.sessionsAllowed)
        #expect(try watch.tick(now: 0, gate: &gate, store: try GatewayStore(path: path)))
        #expect(!signals.sessionsAllowed)
        #expect(log.matching("the disk is full").count == 1)

        // Space returns: the next check on the backoff schedule opens the gate; the next session catches up.
        try FileManager.default.removeItem(atPath: filler)
        #expect(try watch.tick(now: 2, gate: &gate, store: try GatewayStore(path: path)))
        #expect(signals.sessionsAllowed)
        #expect(log.matching("): sessions resume").count == 1)
        let second = await session()
        #expect(second.summary.end == .disconnected(.caughtUp), "\(second.summary)")
        #expect(try store.openStream(peripheral: address, deviceEpoch: peripheral.epoch).cursor == peripheral.head)
        #expect(try store.frames(of: stream.key).count == Int(peripheral.head))
    }

    /// The store itself fills a small disk (a budget larger than the disk): the WAL then cannot be checkpointed
    /// (the main file must grow first) and no delete can be written. The watch gives back its reserve, which
    /// lets SQLite checkpoint; once the uplink has delivered, the delivered events are deleted, the reserve is
    /// put back and sessions resume. Nothing undelivered is lost on the way.
    @Test(.enabled(if: isRoot, "needs root to mount a small tmpfs"))
    func aStoreThatFilledTheDiskItselfRecoversThroughTheReserve() throws {
        let disk = try SmallDisk("ferry-self-full", size: "10m")
        defer { disk.remove() }
        let mountPoint = disk.path
        let path = mountPoint + "/ferry.sqlite"
        let store = try GatewayStore(path: path)
        let uplink = try GatewayStore(path: path)
        let log = Lines()
        let signals = StorageSignals()
        let watch = StorageWatch(
            databasePath: path, budget: 1 << 30, signals: signals, log: log, clock: ManualClock(start: 0),
            backoff: { Self.scheduler().backoff(afterFailures: $0) })
        var gate = StorageGate()
        let watchStore = try GatewayStore(path: path)
        #expect(try watch.tick(now: 0, gate: &gate, store: watchStore))
        #expect(FileManager.default.fileExists(atPath: store.reservePath), "the reserve is made at the first check")

        let stream = try store.openStream(peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, deviceEpoch: 0)
        var cursor: UInt64 = 0
        func commitUntilFull() throws -> Bool {
            for _ in 0..<10_000 {
                let frames = ((cursor + 1)...(cursor + 20)).map { Frame.data(seq: $0, payload: [UInt8](repeating: 3, count: 400)) }
                do {
                    try store.commit(
                        CommitBatch(expectedCursor: cursor, gap: nil, frames: frames, newCursor: cursor + 20, acknowledge: true),
                        to: stream.key)
                    cursor += 20
                } catch StoreError.sqlite(let e) where e.isFull {
                    return true
                }
            }
            return false
        }
        try #require(try commitUntilFull())
        // Stuck without the reserve: the WAL cannot be folded back into the main file.
        #expect(throws: StoreError.self) { try uplink.checkpointTruncatingWAL() }

        // Sessions hit SQLITE_FULL and the daemon nudges; each time the watch gives the reserve back, which lets
        // SQLite checkpoint (the WAL's room returns), and puts it back while it fits. Sessions fill the disk
        // again until the reserve no longer fits: then the gate stays closed. Nothing is lost on the way.
        var t = 0.0
        var rounds = 0
        repeat {
            rounds += 1
            t += 1
            signals.nudge(.diskFull)
            #expect(try watch.tick(now: t, gate: &gate, store: watchStore))
            #expect(try store.frames(of: stream.key).count == Int(cursor), "nothing lost")
            #expect(try store.quickCheck().isEmpty)
            if signals.sessionsAllowed { #expect(try commitUntilFull()) }
        } while signals.sessionsAllowed && rounds < 20
        #expect(!signals.sessionsAllowed, "the gate never stayed closed")
        #expect(log.matching("gave back the").count >= 1)
        #expect(log.matching("no new sessions").count == 1)

        // The uplink delivers (its writes fit now); the watch's next checks delete what was delivered, put the
        // reserve back and let sessions run again.
        var limits = ClaimLimits()
        limits.maxEvents = 100
        while let batch = try uplink.claimBatch(limits: limits, now: Int64.max / 2) {
            try uplink.completeBatch(batch.id, now: 1_800_000_000_000)
        }
        for _ in 0..<20 where !signals.sessionsAllowed {
            t += 300
            try watch.tick(now: t, gate: &gate, store: watchStore)
        }
        #expect(signals.sessionsAllowed, "\(log.lines.withLock { $0.map(\.1).filter { !$0.contains("gave back") } })")
        #expect(FileManager.default.fileExists(atPath: store.reservePath), "the reserve is back")
        #expect(log.matching("): sessions resume").count == 1)
        let frames = ((cursor + 1)...(cursor + 20)).map { Frame.data(seq: $0, payload: [UInt8](repeating: 3, count: 400)) }
        try store.commit(
            CommitBatch(expectedCursor: cursor, gap: nil, frames: frames, newCursor: cursor + 20, acknowledge: true),
            to: stream.key)
        #expect(try store.quickCheck().isEmpty)
    }

    /// Over budget with the uplink offline, and then another program fills the disk to the last byte: the only
    /// way out is delivery (then the delivered events can be pruned), and delivery needs a write (the claim).
    /// The reserve must still be the store's when that write fails: a low reading alone does not give it back
    /// (the program filling the disk would take it), the uplink's SQLITE_FULL does, and the WAL keeps its
    /// blocks. Then every event is delivered, pruned, and sessions resume. Nothing undelivered is lost.
    @Test(.enabled(if: isRoot, "needs root to mount a small tmpfs"))
    func aDiskFilledByAnotherProgramWhileOfflineRecoversThroughDelivery() throws {
        let disk = try SmallDisk("ferry-other-full", size: "12m")
        defer { disk.remove() }
        let mountPoint = disk.path
        let path = mountPoint + "/ferry.sqlite"
        let store = try GatewayStore(path: path)
        let uplink = try GatewayStore(path: path)
        let stream = try store.openStream(peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, deviceEpoch: 0)
        var cursor: UInt64 = 0
        while try store.liveBytes() < 3 << 20 {
            let frames = ((cursor + 1)...(cursor + 20)).map { Frame.data(seq: $0, payload: [UInt8](repeating: 5, count: 400)) }
            try store.commit(
                CommitBatch(expectedCursor: cursor, gap: nil, frames: frames, newCursor: cursor + 20, acknowledge: true),
                to: stream.key)
            cursor += 20
        }
        let log = Lines()
        let signals = StorageSignals()
        let watch = StorageWatch(
            databasePath: path, budget: 1 << 20, signals: signals, log: log, clock: ManualClock(start: 0),
            backoff: { Self.scheduler().backoff(afterFailures: $0) })
        let watchStore = try GatewayStore(path: path)
        var gate = StorageGate()
        #expect(try watch.tick(now: 0, gate: &gate, store: watchStore))
        #expect(!signals.sessionsAllowed, "over budget with nothing delivered: closed")
        #expect(FileManager.default.fileExists(atPath: store.reservePath))

        // Another program writes until ENOSPC; the watch's next check reads a full disk; the program writes on.
        _ = FileManager.default.createFile(atPath: mountPoint + "/other.log", contents: nil)
        let filler = try FileHandle(forWritingTo: URL(fileURLWithPath: mountPoint + "/other.log"))
        func fill() {
            for size in [65536, 4096, 512] {
                while (try? filler.write(contentsOf: Data(count: size))) != nil {}
            }
        }
        fill()
        var t = 1_000.0
        #expect(try watch.tick(now: t, gate: &gate, store: watchStore))
        fill()
        #expect(FileManager.default.fileExists(atPath: store.reservePath), "given back at a mere reading: the filler took it")

        // The uplink's claim finds no room; the daemon nudges the watch, which gives the reserve back now.
        var limits = ClaimLimits()
        limits.maxEvents = 50
        var delivered = 0
        var nudges = 0
        for _ in 0..<200 {
            do {
                guard let batch = try uplink.claimBatch(limits: limits, now: Int64.max / 2) else { break }
                try uplink.completeBatch(batch.id, now: 1_800_000_000_000)
                delivered += 1
                try watch.tick(now: t, gate: &gate, store: watchStore)  // the watch's turn between checks
            } catch StoreError.sqlite(let e) where e.isFull {
                nudges += 1
                signals.nudge(.diskFull)
                t += 1_000
                try watch.tick(now: t, gate: &gate, store: watchStore)
            }
        }
        #expect(nudges >= 1, "the filled disk never refused a claim: the test did not reproduce the case")
        #expect(log.matching("gave back the").count >= 1)
        let left = try uplink.outboxCounts()
        #expect(left[.pending, default: 0] == 0 && left[.inFlight, default: 0] == 0, "undelivered left: \(left), \(delivered) batches delivered")

        // Delivered: the watch prunes, the store shrinks, the reserve fits again, sessions resume.
        for _ in 0..<20 where !signals.sessionsAllowed {
            t += 1_000
            try watch.tick(now: t, gate: &gate, store: watchStore)
        }
        #expect(signals.sessionsAllowed, "\(log.lines.withLock { $0.map(\.1) })")
        #expect(log.matching("): sessions resume").count == 1)
        #expect(try store.quickCheck().isEmpty)
        try? filler.close()
    }
}

/// A tmpfs of its own for a test that fills a disk (root only); `remove()` unmounts it.
struct SmallDisk {
    let path: String

    init(_ name: String, size: String) throws {
        path = FileManager.default.temporaryDirectory.path + "/\(name)-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: false)
        try #require(mount("tmpfs", path, "tmpfs", 0, "size=\(size)") == 0, "mount tmpfs")
    }

    func remove() {
        umount(path)
        try? FileManager.default.removeItem(atPath: path)
    }
}
