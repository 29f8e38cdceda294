import FerryCore
import FerryProtocol
import FerryStore

/// The link to one peripheral's Sync service, as the session runner needs it. Implemented over BlueZ
/// (FerryBlueZ) and by the in-process simulator (tests, demo, benchmarks).
public protocol SyncTransport: AnyObject {
    var hasStreamInfo: Bool { get }
    func readStreamInfo() async throws -> [UInt8]
    /// Subscribe to DATA. Called again after a stream rebase: must be idempotent.
    func subscribe() async throws
    /// A SYNC_REQ to CONTROL, reliably (write with response).
    func writeControl(_ bytes: [UInt8]) async throws
    /// A SYNC_ACK to CONTROL. May be unreliable (write-without-response): a lost ACK is covered by the next
    /// one, and a peripheral left waiting by the stall rule's SYNC_REQ.
    func writeAck(_ bytes: [UInt8]) async throws
    func disconnect() async
    /// Whether `error`, thrown by this transport, is the peripheral refusing for want of security (the link needs
    /// encryption and there is no usable bond): the transport knows its stack's errors, the session does not.
    func refusedForSecurity(_ error: any Error) -> Bool
}

extension SyncTransport {
    public func refusedForSecurity(_ error: any Error) -> Bool { false }
}

/// Where a session's counters go as they happen (the daemon's metrics; nothing in `ferry sync` and tests).
public protocol SessionMetrics: Sendable {
    /// Bytes just received on DATA (per notification).
    func received(bytes: Int)
    /// Frames just committed (per commit).
    func stored(frames: Int)
}

/// A transport failure the runner reports (the session ends; committed data is safe).
public struct TransportError: Error, CustomStringConvertible, Sendable {
    public var description: String
    public init(_ description: String) { self.description = description }
}

/// Summary of one session, for the CLI and logs.
public struct SyncSummary: Sendable, Equatable {
    public var peripheral: String
    public var epoch: UInt64 = 0
    public var cursor: UInt64 = 0
    public var framesStored = 0
    public var duplicates = 0
    public var gapsRecorded = 0
    public var regressions = 0
    public var corrupt = 0
    /// Bytes received on DATA (whole notifications, noise included): the metrics' bytes counter.
    public var bytesReceived = 0
    /// How the session ended (nil while it runs). Decide on this, never on its text.
    public var end: SessionEnd?
    /// The store was over its disk budget: nothing more was committed or acknowledged (backpressure).
    public var backpressure = false
    /// The backpressure came from SQLITE_FULL: the file system itself had no room for the window.
    public var diskFull = false
    /// Reading STREAM_INFO or subscribing to DATA was refused for want of security (the transport's verdict on
    /// its error): the session ended on that refusal.
    public var refusedForSecurity = false
}

/// When each step of a session completed, on the runner's monotonic clock (nil: not reached). `ferry sync
/// --json` reports them with the connect steps before the session; the daemon logs them at debug level.
public struct SessionPhases: Sendable, Equatable {
    /// STREAM_INFO read at the start (nil without STREAM_INFO).
    public var streamInfo: Double?
    /// DATA subscribed (the first time: a stream rebase subscribes again).
    public var subscribed: Double?
    /// The first DATA bytes arrived.
    public var firstData: Double?
    /// The last DATA bytes arrived (so far).
    public var lastData: Double?
    /// Everything the peripheral had is committed (the state machine's `caughtUp`).
    public var caughtUp: Double?
    /// The latest SYNC_ACK written: at the end of a session, the final one.
    public var finalAck: Double?
    /// The link was released (disconnect returned, or the link was lost).
    public var disconnected: Double?
    public init() {}
}

/// How a session ended, typed (the scheduler, `ferry sync` and `peripheral_sync_state` decide on it).
/// `description` is log text only ("caughtUp", `streamInfoUnreadable("...")`, "subscribe failed: ...",
/// "link lost"), the words log readers and the test bed know.
public enum SessionEnd: Sendable, Equatable, CustomStringConvertible {
    /// The state machine disconnected, for this reason.
    case disconnected(SyncSession.DisconnectReason)
    /// The link dropped under the session (peripheral, radio, bluetoothd).
    case linkLost
    /// DATA could not be subscribed: the session never started.
    case subscribeFailed(String)

    /// What `peripheral_sync_state.last_result` records (a kind, not a message).
    public var result: SyncResult {
        switch self {
        case .disconnected(let reason): .disconnected(reason)
        case .linkLost: .linkLost
        case .subscribeFailed: .subscribeFailed
        }
    }

    public var description: String {
        switch self {
        case .disconnected(let reason): reason.description
        case .subscribeFailed(let message): "subscribe failed: \(message)"
        case .linkLost: "link lost"
        }
    }
}

/// The SYNC_ACKs one session wrote: how many, the first and the highest, and the most recent ones. Only the
/// last `recentLimit` are kept, so a session that stays connected for days holds a fixed few kilobytes.
public struct AcknowledgementLog: Sendable, Equatable {
    public static let recentLimit = 256
    public private(set) var count = 0
    public private(set) var first: UInt64?
    public private(set) var highest: UInt64?
    /// The last `recentLimit` ACKs, oldest first.
    public private(set) var recent: [UInt64] = []

    public init() {}

    public var last: UInt64? { recent.last }

    public mutating func record(_ seq: UInt64) {
        count += 1
        if first == nil { first = seq }
        highest = max(highest ?? seq, seq)
        if recent.count == Self.recentLimit { recent.removeFirst() }
        recent.append(seq)
    }
}

/// Executes a `SyncSession`'s actions against a transport and the store. One task owns a runner: events
/// (bytes, timer, link loss) are handed to it one at a time.
///
/// The durability rule is enforced twice: by the machine (it only acknowledges cursors the store reported)
/// and here, as a last line of defence: an ACK above the last committed cursor is never written.
public final class SyncSessionRunner {
    public private(set) var machine: SyncSession
    public private(set) var stream: StreamHandle?
    public private(set) var summary: SyncSummary
    public private(set) var finished = false
    /// Highest cursor the store confirmed in this session (or loaded at its start).
    public private(set) var lastCommittedCursor: UInt64 = 0
    /// The SYNC_ACKs written, bounded: a stay-connected session lasts days.
    public private(set) var acksSent = AcknowledgementLog()
    public private(set) var phases = SessionPhases()
    /// The process's CPU seconds (`ProcessCPU`) at the same marks (`lastData` stays nil: it moves with every
    /// notification, and a getrusage per notification is not worth it; `finalAck` is read at the disconnection).
    public private(set) var phasesCPU = SessionPhases()
    /// Set by an action that ends the session early: the actions queued behind it are dropped.
    private var dropQueuedActions = false

    private let peripheral: PeripheralAddress
    private let store: GatewayStore
    private let transport: any SyncTransport
    private let clock: any MonotonicClock
    /// Every line names the peripheral (metadata), not each message.
    private let log: Logger
    private let diskBudgetBytes: Int64?
    /// The daemon's metrics, counted as frames commit and bytes arrive (not at the session's end: a
    /// stay-connected session may last for days).
    public var metrics: (any SessionMetrics)?

    /// `diskBudgetBytes`: when the store file (with its WAL) is larger, the runner stops committing and so stops
    /// acknowledging: the peripheral keeps its events until the uplink has drained and pruned the store.
    public init(
        peripheral: PeripheralAddress, store: GatewayStore, transport: any SyncTransport,
        configuration: SyncSession.Configuration = .init(), clock: any MonotonicClock = SystemMonotonicClock(),
        log: any LogSink = NullLogSink(), diskBudgetBytes: Int64? = nil
    ) {
        self.diskBudgetBytes = diskBudgetBytes
        self.peripheral = peripheral
        self.store = store
        self.transport = transport
        self.clock = clock
        self.log = Logger(sink: log).with(peripheral: peripheral.string)
        machine = SyncSession(configuration: configuration)
        summary = SyncSummary(peripheral: peripheral.string)
    }

    public var nextDeadline: Double? { machine.nextDeadline }

    /// The runner's latest clock reading: every event reads the clock once (`readClock`), and what its actions
    /// do at once (a SYNC_ACK after a commit) is dated by that reading instead of one more.
    private var lastClockReading = 0.0

    private func readClock() -> Double {
        lastClockReading = clock.now()
        return lastClockReading
    }

    /// Records the first time `phase` is reached (or every time, `again`), with the process's CPU then. `again`
    /// phases (every SYNC_ACK moves `finalAck`) take the time of the event that led to them: a clock read per
    /// ACK is a system call where the clock source has no vDSO.
    private func reached(_ phase: WritableKeyPath<SessionPhases, Double?>, again: Bool = false) {
        guard again || phases[keyPath: phase] == nil else { return }
        phases[keyPath: phase] = again ? lastClockReading : readClock()
        // A phase reached `again` (every SYNC_ACK moves `finalAck`) would cost a getrusage per ACK: its CPU is
        // read at the disconnection, which follows the final ACK at once.
        if !again { phasesCPU[keyPath: phase] = ProcessCPU.seconds() }
        if phase == \SessionPhases.disconnected, phases.finalAck != nil { phasesCPU.finalAck = phasesCPU.disconnected }
    }

    /// When `start()` ran (the reference of the phases' debug line).
    public private(set) var startedAt: Double?

    public func start() async {
        let now = readClock()
        startedAt = now
        await execute(machine.connected(hasStreamInfo: transport.hasStreamInfo, now: now))
    }

    public func receive(_ bytes: [UInt8]) async {
        await receive(CollectionOfOne(bytes))
    }

    /// Chunks that arrived together, in order: all of them reach the state machine before any action runs, so
    /// frames that piled up behind a slow commit are staged and then committed as one group (the machine
    /// expects frames to arrive while a commit is outstanding; executing a commit at once made every one
    /// of them wait for a commit of its own).
    public func receive(_ chunks: some Collection<[UInt8]>) async {
        let now = readClock()
        let quietBefore = phases.lastData.map { now - $0 }
        var actions: [SyncAction] = []
        var bytesIn = 0
        for bytes in chunks {
            bytesIn += bytes.count
            summary.bytesReceived &+= bytes.count
            metrics?.received(bytes: bytes.count)
            if !bytes.isEmpty {
                reached(\.firstData)
                phases.lastData = now
            }
            actions += machine.bytesReceived(bytes, now: now)
        }
        await execute(actions, source: .notifications(count: chunks.count, bytes: bytesIn, quietBefore: quietBefore))
    }

    public func timerFired() async {
        let now = readClock()
        await execute(machine.timerFired(now: now), source: .idleTimeout(quietFor: phases.lastData.map { now - $0 }))
    }

    /// The link dropped (the transport saw EOF or a Disconnected signal).
    public func linkLost() async {
        reached(\.disconnected)
        await execute(machine.disconnected(now: readClock()))
        if summary.end == nil {
            // Recorded like any other end: `ferry peripherals` must not keep showing the previous session's.
            summary.end = .linkLost
            recordSessionEnd()
        }
        finished = true
    }

    /// The link's queue dropped `chunks` notifications: more than `budget` bytes of DATA were waiting for a session
    /// blocked meanwhile. Nothing is lost (nothing dropped was acknowledged): the decoder sees a gap in the stream
    /// and the session asks for those frames again.
    public func queueDroppedData(chunks: Int, budget: Int) {
        log.log(
            .warning,
            "dropped \(chunks) DATA notification(s): more than \(budget) bytes were queued while the session was "
                + "blocked (a slow commit); they will be asked for again")
    }

    /// Graceful shutdown: commit and acknowledge what is staged, then disconnect.
    public func stop() async {
        await execute(machine.stop(now: readClock()))
    }

    private func execute(_ initial: [SyncAction], source: ByteSource = .sessionEvent) async {
        var queue = initial[...]
        while let action = queue.popFirst() {
            let more = await perform(action)
            if dropQueuedActions {
                queue.removeAll()
                dropQueuedActions = false
            }
            if !more.isEmpty { queue = ArraySlice(Array(queue) + more) }
        }
        logCorruptRuns(source)
        updateSummary()
    }

    /// What handed the decoder the bytes it found corrupt: the debug log's account of each corrupt run.
    private enum ByteSource {
        /// Damaged bytes inside notifications; `quietBefore`: seconds since the data before them.
        case notifications(count: Int, bytes: Int, quietBefore: Double?)
        /// A frame left incomplete when the link went quiet: its rest never came (a notification lost on the way).
        case idleTimeout(quietFor: Double?)
        /// A commit, link loss or stop that let the decoder judge what it held.
        case sessionEvent
    }

    /// Corrupt runs already logged.
    private var corruptRunsLogged = 0

    /// One debug line per new corrupt run: where it came from and how quiet the link had been, so an operator
    /// can tell a damaged link from notifications lost on the way.
    private func logCorruptRuns(_ source: ByteSource) {
        let runs = machine.decoder.statistics.corruptRuns
        guard runs > corruptRunsLogged else { return }
        defer { corruptRunsLogged = runs }
        let ms = Self.milliseconds
        let cause =
            switch source {
            case .notifications(let count, let bytes, let quiet):
                "in \(count) notification(s) of \(bytes) bytes (\(ms(quiet)) after the data before them)"
            case .idleTimeout(let quiet): "on the idle timeout: a frame left incomplete, the link quiet for \(ms(quiet))"
            case .sessionEvent: "when the session flushed its buffer"
            }
        let first = corruptRunsLogged + 1
        log.log(
            .debug,
            "corrupt run\(runs > first ? "s \(first)-\(runs)" : " \(runs)") \(cause); "
                + "\(machine.decoder.statistics.discardedBytes) bytes discarded so far, cursor \(lastCommittedCursor)")
    }

    /// Reads the clock only where an event needs the time: in some test beds a clock read is a system call
    /// (a guest without a vDSO clock source), and SYNC_ACKs and commits are the most frequent actions.
    private func perform(_ action: SyncAction) async -> [SyncAction] {
        switch action {
        case .readStreamInfo:
            do {
                let bytes = try await transport.readStreamInfo()
                reached(\.streamInfo)
                return machine.streamInfoRead(bytes, now: readClock())
            } catch {
                let actions = machine.streamInfoFailed("\(error)", now: readClock())
                // Only a failure that ends the session is what it ended on (one the machine ignores is not).
                let ends = actions.contains { if case .disconnect = $0 { true } else { false } }
                if ends && transport.refusedForSecurity(error) { summary.refusedForSecurity = true }
                return actions
            }
        case .loadCursor(let epoch):
            do {
                let handle = try store.openStream(peripheral: peripheral, deviceEpoch: epoch)
                stream = handle
                lastCommittedCursor = handle.cursor
                return machine.cursorLoaded(handle.cursor, now: readClock())
            } catch {
                log.log(.error, "cannot open stream: \(error)")
                return machine.commitFailed(now: readClock())
            }
        case .recordRegression(_, let cursor, let head):
            guard let current = stream else { return [] }
            do {
                let rebased = try store.recordRegression(stream: current, cursor: cursor, head: head)
                log.log(
                    .warning,
                    "sequence regression on epoch \(current.deviceEpoch): head \(head) < cursor \(cursor); "
                        + "recorded, new events go to store epoch \(rebased.key.epoch)")
                stream = rebased
                lastCommittedCursor = 0
                return machine.cursorLoaded(0, now: readClock())
            } catch {
                log.log(.error, "cannot record regression: \(error)")
                return machine.commitFailed(now: readClock())
            }
        case .subscribe:
            do {
                try await transport.subscribe()
                reached(\.subscribed)
                return []
            } catch {
                // Without DATA the session cannot run (e.g. BlueZ still holds a dead process's AcquireNotify:
                // "Notify acquired"). End it now — the SYNC_REQ queued behind this must not go out — and let
                // the caller back off and retry.
                log.log(.warning, "subscribe failed: \(error)")
                summary.end = .subscribeFailed("\(error)")
                if transport.refusedForSecurity(error) { summary.refusedForSecurity = true }
                recordSessionEnd()
                dropQueuedActions = true
                let flush = machine.disconnected(now: readClock())
                await transport.disconnect()
                reached(\.disconnected)
                finished = true
                return flush
            }
        case .sendSyncRequest(let last, let window):
            // Every request after the first is a re-request (a stall, a gap, no answer): what duplicates follow.
            let request = machine.statistics.syncRequests
            log.log(
                .debug,
                "SYNC_REQ \(request) from \(last), window \(window)"
                    + (request > 1 ? " (re-request; \(machine.statistics.duplicates) duplicates so far)" : ""))
            do {
                try await transport.writeControl(Frame.syncRequest(lastCommitted: last, window: window).encoded())
            } catch {
                log.log(.warning, "SYNC_REQ write failed: \(error)")
                // The response timeout re-sends it; a dead link shows up as a disconnect.
            }
            return []
        case .sendSyncAck(let seq):
            guard seq <= lastCommittedCursor else {
                log.log(.error, "refusing SYNC_ACK(\(seq)) above committed cursor \(lastCommittedCursor)")
                return []
            }
            do {
                try await transport.writeAck(Frame.syncAck(committed: seq).encoded())
                acksSent.record(seq)
                reached(\.finalAck, again: true)
            } catch {
                log.log(.warning, "SYNC_ACK write failed: \(error)")
            }
            return []
        case .commit(let batch):
            guard let current = stream else { return machine.commitFailed(now: readClock()) }
            if let budget = diskBudgetBytes, let used = try? store.diskBytes(), used > budget {
                summary.backpressure = true
                log.log(
                    .warning,
                    "store uses \(used) bytes, over its budget of \(budget): not committing or "
                        + "acknowledging; the peripheral keeps its events (backpressure)")
                return machine.commitFailed(now: readClock())
            }
            do {
                let outcome = try commitRetryingWhileBusy(batch, to: current.key)
                lastCommittedCursor = outcome.cursor
                summary.framesStored += outcome.framesInserted
                metrics?.stored(frames: outcome.framesInserted)
                if let gap = outcome.gapRecorded {
                    log.log(.warning, "gap \(gap.lowerBound)...\(gap.upperBound) recorded (events lost)")
                }
                return machine.commitFinished(cursor: outcome.cursor, now: readClock())
            } catch StoreError.sqlite(let e) where e.isFull {
                // Same as over budget: nothing acknowledged, so nothing lost; the daemon pauses sessions until
                // the storage watch has made room.
                summary.backpressure = true
                summary.diskFull = true
                log.log(
                    .error,
                    "disk full (SQLITE_FULL): window not committed, nothing acknowledged; the "
                        + "peripheral keeps its events (backpressure)")
                return machine.commitFailed(now: readClock())
            } catch {
                log.log(.error, "commit failed, nothing acknowledged: \(error)")
                return machine.commitFailed(now: readClock())
            }
        case .caughtUp(let cursor):
            reached(\.caughtUp)
            log.log(.debug, "caught up at \(cursor)")
            return []
        case .disconnect(let reason):
            summary.end = .disconnected(reason)
            switch reason {
            case .noProgress:
                log.log(
                    .warning,
                    "no new frame committed for \(machine.configuration.noProgressTimeout) s while more "
                        + "was expected (\(machine.statistics.duplicates) duplicates, "
                        + "\(machine.decoder.statistics.corruptRuns) corrupt runs so far): ending the session to free the slot")
            case .maxDurationReached:
                log.log(
                    .notice,
                    "session reached its maximum length of "
                        + "\(machine.configuration.maxSessionDuration ?? 0) s: releasing the slot, the rest follows next session")
            default: break
            }
            recordSessionEnd()
            await transport.disconnect()
            reached(\.disconnected)
            finished = true
            logPhases()
            return []
        }
    }

    /// Seconds as whole milliseconds for the debug lines ("1234ms"); "-" when unknown or not a finite number.
    private static func milliseconds(_ seconds: Double?) -> String {
        guard let seconds, seconds.isFinite, abs(seconds) < 1e12 else { return "-" }
        return String(Int((seconds * 1000).rounded())) + "ms"
    }

    /// The phase times at debug level, relative to the session's start (`start()`): where a session's link
    /// time goes (setup, data, teardown).
    private func logPhases() {
        let p = phases
        let c = phasesCPU
        func at(_ t: Double?) -> String { Self.milliseconds(t.flatMap { t in startedAt.map { t - $0 } }) }
        let cpu = Self.milliseconds
        log.log(
            .debug,
            "session phases: stream_info \(at(p.streamInfo)) subscribed \(at(p.subscribed)) first_data "
                + "\(at(p.firstData)) last_data \(at(p.lastData)) caught_up \(at(p.caughtUp)) final_ack "
                + "\(at(p.finalAck)) disconnected \(at(p.disconnected)); process CPU at first_data \(cpu(c.firstData)) "
                + "caught_up \(cpu(c.caughtUp)) disconnected \(cpu(c.disconnected))")
    }

    /// Extra attempts of a commit that found the store locked by another writer. Each attempt waits out
    /// SQLite's busy timeout (5 s), so together they stay inside the default no-progress bound (30 s).
    static let busyRetries = 3

    /// `store.commit`, tried again while another connection holds the write lock (a long prune or vacuum on a
    /// slow SD card outlasts one busy timeout): ending the session for it would drop a healthy link. The
    /// commit is one transaction and idempotent (frames at or below the stored cursor are skipped), so a
    /// retry cannot store anything twice.
    private func commitRetryingWhileBusy(_ batch: CommitBatch, to key: StreamKey) throws -> CommitOutcome {
        var attempt = 0
        while true {
            do {
                return try store.commit(batch, to: key)
            } catch StoreError.sqlite(let error) where error.isBusy && attempt < Self.busyRetries {
                attempt += 1
                log.log(
                    .warning,
                    "store locked by another writer (\(error.message)); retrying the commit "
                        + "(\(attempt)/\(Self.busyRetries)), nothing acknowledged meanwhile")
            }
        }
    }

    /// How the session ended, for `ferry peripherals`. Information for operators, outside the commit
    /// transaction: losing it in a crash loses nothing the protocol relies on.
    private func recordSessionEnd() {
        // Every end passes here once (caught up, link lost, subscribe failed...): the place to say it.
        if machine.statistics.pastWindow > 0 {
            log.log(
                .warning,
                "the peripheral sent \(machine.statistics.pastWindow) frames past the window of "
                    + "\(machine.configuration.window): dropped and asked for again (it does not keep to the window)")
        }
        let result = summary.backpressure ? .backpressure : (summary.end ?? .linkLost).result
        do {
            try store.recordSessionEnd(peripheral: peripheral, result: result, epoch: stream?.key.epoch, head: machine.knownHead)
        } catch {
            log.log(.warning, "cannot record how the session ended: \(error)")
        }
    }

    private func updateSummary() {
        let s = machine.statistics
        summary.epoch = stream?.key.epoch ?? 0
        summary.cursor = lastCommittedCursor
        summary.duplicates = s.duplicates
        summary.gapsRecorded = s.gapsRecorded
        summary.regressions = s.regressions
        summary.corrupt = machine.decoder.statistics.corruptRuns
    }
}
