import FerryGateway
import FerrySync
import FerryProtocol
import FerrySimulator
import FerryStore
import FerryTestSupport
import Foundation
import Synchronization
import Testing

/// A wall clock for the store that moves a millisecond per reading, so rows get distinct, ordered times.
final class SteppingWallClock: WallClock {
    private let next = Mutex(Int64(1_800_000_000_000))
    func nowMillis() -> Int64 { next.withLock { $0 += 1; return $0 } }
}

/// One session's record, for assertions and failure messages.
struct SessionRecord: CustomStringConvertible {
    var outcome: SessionDriver.Outcome
    var summary: SyncSummary
    /// The state machine's counters at the session's end.
    var statistics: SyncSession.Statistics
    var acksSent: AcknowledgementLog
    /// CONTROL frames that reached the peripheral.
    var control: [Frame]
    /// CONTROL frames the gateway tried to write (including the one a crash swallowed).
    var attemptedControl: [Frame]
    /// The ACK that was about to be written when the process "crashed".
    var crashedBeforeAck: UInt64?

    var caughtUp: Bool { outcome.ending == .finished && summary.end == .disconnected(.caughtUp) }

    var description: String {
        "\(outcome.ending) after \(outcome.steps) steps, \(outcome.notificationsDelivered) notifications, "
            + "stored \(summary.framesStored), cursor \(summary.cursor), end \(summary.end.map { "\($0)" } ?? "-")"
    }
}

/// The gateway side of an integration test: a real SQLite file, a runner per session, a manual clock, and
/// a SECOND connection to the same file that checks, at the instant every SYNC_ACK is written, that the
/// acknowledged seq is already committed (visible to another connection means it is in the WAL on disk).
final class Gateway {
    let directory: TemporaryDirectory
    let address = PeripheralAddress("C0:FF:EE:00:00:01")!
    let clock = ManualClock(start: 1_000)
    let wallClock = SteppingWallClock()
    var configuration = SyncSession.Configuration()
    var limits = SessionDriver.Limits()
    private(set) var dbPath: String
    private(set) var store: GatewayStore
    private var observer: GatewayStore
    private(set) var acksChecked = 0
    private(set) var uncommittedAcks: [String] = []
    private(set) var sessions: [SessionRecord] = []
    private(set) var crashes = 0

    init(directory: TemporaryDirectory) throws {
        self.directory = directory
        dbPath = directory.path("gateway.sqlite")
        store = try GatewayStore(path: dbPath, clock: wallClock)
        observer = try GatewayStore(path: dbPath, clock: wallClock)
    }

    /// One session against `peripheral`. `crashBeforeAck` is asked before each SYNC_ACK: true makes the
    /// gateway process die right there, after the commit and before the ACK reaches the peripheral.
    @discardableResult
    func session(
        with peripheral: SimulatedPeripheral, crashBeforeAck: ((UInt64) -> Bool)? = nil
    ) async throws -> SessionRecord {
        let transport = SimulatedTransport(connectingTo: peripheral, now: clock.now())
        let runner = SyncSessionRunner(
            peripheral: address, store: store, transport: transport, configuration: configuration, clock: clock)
        var crashedHere: UInt64?
        let crashCopy = directory.path("crash-\(crashes).sqlite")
        var attempted: [Frame] = []
        transport.controlHook = { [unowned self, unowned runner] frame in
            attempted.append(frame)
            guard frame.type == .syncAck else { return .deliver }
            self.checkCommitted(ack: frame.seq, stream: runner.stream?.key)
            guard let crashBeforeAck, crashBeforeAck(frame.seq) else { return .deliver }
            // Snapshot the files at the instant of the crash: later work of the abandoned runner must not
            // reach the database the "restarted process" opens.
            crashedHere = frame.seq
            self.snapshotDatabase(to: crashCopy)
            return .crash
        }
        let outcome = await SessionDriver.run(runner: runner, transport: transport, clock: clock, limits: limits)
        let record = SessionRecord(
            outcome: outcome, summary: runner.summary, statistics: runner.machine.statistics, acksSent: runner.acksSent,
            control: transport.controlFramesWritten, attemptedControl: attempted, crashedBeforeAck: crashedHere)
        sessions.append(record)
        if crashedHere != nil {
            crashes += 1
            try restart(from: crashCopy)
        }
        return record
    }

    /// Sessions until one ends caught up (or `maxSessions`); returns how many ran.
    @discardableResult
    func syncUntilCaughtUp(
        _ peripheral: SimulatedPeripheral, maxSessions: Int = 400, crashBeforeAck: ((UInt64) -> Bool)? = nil
    ) async throws -> Int {
        for n in 1...maxSessions {
            let record = try await session(with: peripheral, crashBeforeAck: crashBeforeAck)
            if record.outcome.ending == .stepCapReached || record.outcome.ending == .hung {
                // A hung session is one the live daemon would never end: its slot would be gone for good.
                Issue.record("\(record.outcome.ending): \(record)")
                return n
            }
            // Without STREAM_INFO a silent peripheral (an ignored SYNC_REQ) looks caught up: the gateway
            // reconnects later. The test keeps going until the ground truth agrees.
            if record.caughtUp && record.summary.cursor == peripheral.head { return n }
            clock.advance(by: 5)  // back-off before reconnecting
        }
        Issue.record("not caught up after \(maxSessions) sessions; last: \(sessions.last.map { "\($0)" } ?? "-")")
        return maxSessions
    }

    private func checkCommitted(ack: UInt64, stream: StreamKey?) {
        acksChecked += 1
        guard let stream else {
            uncommittedAcks.append("SYNC_ACK(\(ack)) before any stream was open")
            return
        }
        do {
            // Straight from the cursor table: streams() counts frames, which would make this check O(n²).
            let cursor = try observer.database.integer(
                "SELECT cursor FROM stream_cursors WHERE peripheral = ? AND epoch = ?",
                [.text(stream.peripheral.string), .text(String(stream.epoch))]
            ).map { UInt64(bitPattern: $0) } ?? 0
            if ack > cursor {
                uncommittedAcks.append("SYNC_ACK(\(ack)) while another connection saw cursor \(cursor)")
            }
        } catch {
            uncommittedAcks.append("cannot read the cursor: \(error)")
        }
    }

    /// Copies the database and its WAL as they are on disk now (no checkpoint, no close): what a process
    /// killed at this instant leaves behind.
    private func snapshotDatabase(to path: String) {
        let fm = FileManager.default
        for suffix in ["", "-wal"] {
            try? fm.removeItem(atPath: path + suffix)
            if fm.fileExists(atPath: dbPath + suffix) {
                do {
                    try fm.copyItem(atPath: dbPath + suffix, toPath: path + suffix)
                } catch {
                    uncommittedAcks.append("cannot snapshot \(dbPath + suffix): \(error)")
                }
            }
        }
    }

    /// The process restarts on the crash snapshot: new store objects, WAL recovery by SQLite.
    private func restart(from path: String) throws {
        store = try GatewayStore(path: path, clock: wallClock)
        observer = try GatewayStore(path: path, clock: wallClock)
        dbPath = path
    }

    /// Every GAP outbox event of the peripheral: (store epoch, first, last).
    func gapRecords() throws -> [(epoch: String, range: ClosedRange<UInt64>)] {
        var gaps: [(String, ClosedRange<UInt64>)] = []
        try store.database.cached(
            "SELECT epoch, first_seq, last_seq FROM outbox_events WHERE event_type = 'GAP' AND peripheral = ? "
                + "ORDER BY created_at"
        ).forEach([.text(address.string)]) { row in
            gaps.append((row.text(0), UInt64(bitPattern: row.int64(1))...UInt64(bitPattern: row.int64(2))))
        }
        return gaps
    }

    func outboxCount(type: OutboxEventType) throws -> Int {
        Int(try store.database.integer("SELECT count(*) FROM outbox_events WHERE event_type = ?", [.text(type.rawValue)]) ?? 0)
    }

    var totalFramesStored: Int { sessions.reduce(0) { $0 + $1.summary.framesStored } }
}

/// Compares the gateway's store with the peripheral's ground truth (every event it ever generated).
struct Ledger {
    struct StreamContents {
        var status: GatewayStore.StreamStatus
        var generation: Int?
        var frames: [(seq: UInt64, payload: [UInt8])]
    }

    var streams: [StreamContents] = []
    /// problems found; empty means the store is exactly right.
    var problems: [String] = []
    var storedEvents = 0
    var lostAndMissing = 0
    var lostButStored = 0
    var gapSeqs = 0

    init(gateway: Gateway, peripheral: SimulatedPeripheral) throws {
        let generations = peripheral.generations
        var stored: [[Int]] = generations.map { Array(repeating: 0, count: $0.payloads.count) }
        for status in try gateway.store.streams() where status.peripheral == gateway.address.string {
            let key = StreamKey(peripheral: gateway.address, epoch: UInt64(status.epoch)!)
            let frames = try gateway.store.frames(of: key)
            var generation: Int?
            for frame in frames {
                guard let id = SimulatedPeripheral.identity(of: frame.payload), id.seq == frame.seq,
                    id.generation < generations.count,
                    generations[id.generation].payload(of: frame.seq) == frame.payload
                else {
                    problems.append("stream \(status.epoch) holds seq \(frame.seq) that the peripheral never sent")
                    continue
                }
                if let g = generation, g != id.generation {
                    problems.append("stream \(status.epoch) mixes generations \(g) and \(id.generation)")
                }
                generation = id.generation
                let reported = peripheral.configuration.hasStreamInfo ? generations[id.generation].epoch : 0
                if status.deviceEpoch != String(reported) {
                    problems.append("stream \(status.epoch) has device epoch \(status.deviceEpoch), event says \(reported)")
                }
                stored[id.generation][Int(frame.seq - generations[id.generation].firstSeq)] += 1
            }
            streams.append(StreamContents(status: status, generation: generation, frames: frames))
        }
        // Exactly once: every event the peripheral still had (or that was acknowledged) is stored once;
        // events the peripheral itself lost are stored at most once.
        for generation in generations {
            for (i, count) in stored[generation.index].enumerated() {
                let seq = generation.firstSeq + UInt64(i)
                if count > 1 { problems.append("gen \(generation.index) seq \(seq) stored \(count) times") }
                if generation.isLost(seq) {
                    if count == 0 { lostAndMissing += 1 } else { lostButStored += 1 }
                } else if count != 1 {
                    problems.append("gen \(generation.index) seq \(seq) (not lost by the peripheral) stored \(count) times")
                }
                storedEvents += min(count, 1)
            }
        }
        // Gaps: recorded only for events the peripheral really lost and the gateway never stored; and every
        // such event below a stored one is covered by a gap (a hole is never silent).
        var covered: [Set<UInt64>] = generations.map { _ in [] }
        for gap in try gateway.gapRecords() {
            guard let stream = streams.first(where: { $0.status.epoch == gap.epoch }), let g = stream.generation else {
                problems.append("GAP \(gap.range) on stream \(gap.epoch) that holds no frames")
                continue
            }
            for seq in gap.range {
                gapSeqs += 1
                covered[g].insert(seq)
                let index = seq >= generations[g].firstSeq ? Int(seq - generations[g].firstSeq) : -1
                if index < 0 || index >= stored[g].count {
                    problems.append("GAP names gen \(g) seq \(seq) that was never generated")
                } else if !generations[g].isLost(seq) {
                    problems.append("GAP names gen \(g) seq \(seq) that the peripheral never lost (transit loss)")
                } else if stored[g][index] > 0 {
                    problems.append("GAP names gen \(g) seq \(seq) that is stored")
                }
            }
        }
        for generation in generations {
            let counts = stored[generation.index]
            guard let lastStored = counts.lastIndex(where: { $0 > 0 }) else { continue }
            for i in 0..<lastStored where counts[i] == 0 {
                let seq = generation.firstSeq + UInt64(i)
                if !covered[generation.index].contains(seq) {
                    problems.append("gen \(generation.index) seq \(seq) missing without a GAP record")
                }
            }
        }
    }

    /// The active stream of the peripheral's current generation.
    func activeStream(for peripheral: SimulatedPeripheral) -> StreamContents? {
        streams.last { $0.status.active && $0.status.deviceEpoch == String(peripheral.reportedEpoch) }
    }
}

/// Asserts everything an integration test always expects, with the details in the failure message.
func expectConsistent(
    _ gateway: Gateway, _ peripheral: SimulatedPeripheral, caughtUp: Bool = true,
    sourceLocation: SourceLocation = #_sourceLocation
) throws -> Ledger {
    let ledger = try Ledger(gateway: gateway, peripheral: peripheral)
    #expect(ledger.problems.isEmpty, "\(ledger.problems.prefix(10))", sourceLocation: sourceLocation)
    #expect(gateway.uncommittedAcks.isEmpty, "\(gateway.uncommittedAcks.prefix(5))", sourceLocation: sourceLocation)
    #expect(gateway.acksChecked > 0, "no SYNC_ACK was ever checked", sourceLocation: sourceLocation)
    #expect(
        peripheral.violations.isEmpty, "\(peripheral.violations.prefix(5))", sourceLocation: sourceLocation)
    if caughtUp {
        let active = ledger.activeStream(for: peripheral)
        #expect(active?.status.cursor == peripheral.head, "cursor \(active.map { "\($0.status.cursor)" } ?? "none") vs head \(peripheral.head)", sourceLocation: sourceLocation)
        // Everything caught up is acknowledged: the peripheral retains nothing.
        #expect(peripheral.retainedCount == 0, "peripheral still retains \(peripheral.retainedCount)", sourceLocation: sourceLocation)
    }
    return ledger
}

func soakEnabled() -> Bool { ProcessInfo.processInfo.environment["FERRY_SOAK"] == "1" }
