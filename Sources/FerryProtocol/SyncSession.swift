/// The gateway side of one sync session with one peripheral (PROTOCOL §4), as a pure value type.
///
/// Following swift-nio's state machines: the owner (a BlueZ connection, the in-process simulator, a test)
/// calls one `mutating func` per event and executes the returned `SyncAction`s in order. The machine does
/// no I/O and reads no clock: every event carries `now` (monotonic seconds) and the owner arms a timer for
/// `nextDeadline`.
///
/// Invariants the machine guarantees (and tests check):
/// - A `.sendSyncAck(seq)` only ever follows `commitFinished(cursor: seq)` — or names the cursor the owner
///   loaded from the store. Nothing uncommitted is acknowledged (the durability rule).
/// - Frames reach `.commit` in strictly increasing, contiguous seq order; a gap is only ever committed as an
///   explicit `gap` range in the same batch as the cursor move.
/// - At most one commit is outstanding at a time.
public struct SyncSession: Sendable {
    public struct Configuration: Sendable, Equatable {
        /// Window requested in SYNC_REQ: how many frames may be sent beyond the last ACK. Larger than
        /// `ackBatch` (pipelined): frames keep arriving past the batch being committed and acknowledged.
        public var window: UInt16 = Frame.defaultWindow
        /// Commit + SYNC_ACK every this many staged frames (the ACK batch, or ACK cadence). A window below it
        /// works but every batch then ends on the idle timeout (the peripheral stops at the window first).
        public var ackBatch: Int = Frame.defaultAckEvery
        /// DATA silence after which a partial window is committed, a stalled partial frame dropped, and a
        /// gap's drain considered over.
        public var idleTimeout: Double = 0.25
        /// Silence after SYNC_REQ (or an ACK) while behind before the request is re-sent. For peripherals
        /// without STREAM_INFO the same silence means "caught up".
        public var responseTimeout: Double = 2.0
        /// SYNC_REQ attempts without an answer before giving up on the connection.
        public var maxRequestAttempts: Int = 3
        public var maxPayloadLength: Int = FrameDecoder.defaultMaxPayloadLength
        /// A grouped commit (several cadences that piled up behind a slow commit) stops adding cadences before its
        /// frames' payloads pass this many bytes: the commit becomes one outbox event, which should fit one uplink
        /// batch (an event above the batch limit still goes, alone, in a batch of its own). One cadence is always
        /// committed whatever its size.
        public var maxGroupPayloadBytes: Int = Configuration.defaultMaxGroupPayloadBytes
        /// 256 KiB: also the store's default uplink batch limit (`ClaimLimits.maxPayloadBytes`), so that one
        /// grouped commit fits one batch.
        public static let defaultMaxGroupPayloadBytes = 256 * 1024
        /// After catching up: stay subscribed for live events (true) or disconnect to free the slot (false).
        public var stayConnected: Bool = false
        /// Liveness bound: while the session expects more (not caught up, a gap being resolved...), it ends
        /// with `.noProgress` when no NEW frame has been committed for this long, whatever else arrives.
        /// Duplicates, noise and stale replays keep a link busy without moving the cursor; this bound is what
        /// frees the slot from such a peripheral.
        public var noProgressTimeout: Double = 30
        /// Sync-and-release sessions end with `.maxDurationReached` this long after `connected` (nil: no
        /// limit). A peripheral with a huge backlog, or one that trickles just enough to count as progress,
        /// must not keep a slot the others need. Not applied to stay-connected sessions (holding the link is
        /// their purpose).
        public var maxSessionDuration: Double?

        public init() {}
    }

    public enum DisconnectReason: Sendable, Equatable {
        case caughtUp
        /// No DATA after `maxRequestAttempts` SYNC_REQs while the peripheral has frames we lack.
        case noResponse
        /// STREAM_INFO showed a different epoch mid-session: the peripheral was wiped; start a new session.
        case epochChanged
        case streamInfoUnreadable(String)
        case storeFailed
        case shutdown
        /// No new frame committed for `noProgressTimeout` while more was expected (a stalled or replaying
        /// peripheral, noise, or a gap that never resolves).
        case noProgress
        /// A sync-and-release session reached `maxSessionDuration`; what is committed was acknowledged.
        case maxDurationReached

        /// The reason without its detail ("streamInfoUnreadable"): what `peripheral_sync_state.last_result`
        /// holds. Spelled out per case so a renamed case cannot silently change a stored value.
        public var kind: String {
            switch self {
            case .caughtUp: "caughtUp"
            case .noResponse: "noResponse"
            case .epochChanged: "epochChanged"
            case .streamInfoUnreadable: "streamInfoUnreadable"
            case .storeFailed: "storeFailed"
            case .shutdown: "shutdown"
            case .noProgress: "noProgress"
            case .maxDurationReached: "maxDurationReached"
            }
        }
    }

    /// The state machine's counters, for summaries and logs.
    public struct Statistics: Sendable, Equatable {
        public var dataFrames = 0
        public var staged = 0
        public var committedFrames = 0
        public var duplicates = 0
        public var gapsDetected = 0
        public var gapsRecorded = 0
        public var droppedWhileDraining = 0
        /// DATA frames that arrived while this session already held a whole window of unacknowledged frames
        /// (staged or being committed): a peripheral sending past the window. Dropped, and fetched again through
        /// the gap rule, so that what a session holds stays bounded by its window.
        public var pastWindow = 0
        /// SYNC_REQ / SYNC_ACK frames arriving on DATA: not for us.
        public var unexpectedFrames = 0
        public var syncRequests = 0
        public var acks = 0
        public var commits = 0
        public var regressions = 0
        public init() {}
    }

    private enum Phase: Sendable, Equatable {
        case notStarted
        case awaitingStreamInfo
        case awaitingCursor
        /// Normal flow: DATA frames are classified and staged.
        case streaming
        /// A gap was seen: drop DATA until the stream has been idle (the rest of the old window is in flight).
        case draining
        /// After draining: waiting for the re-read STREAM_INFO.
        case awaitingGapInfo
        /// Disconnect requested or seen; only commit completions are still processed.
        case closed
    }

    /// What to do when the outstanding commit finishes.
    private enum AfterCommit: Sendable, Equatable {
        case nothing
        /// Continue gap resolution: re-read STREAM_INFO or re-send SYNC_REQ.
        case resolveGap
        /// A gap from STREAM_INFO was recorded: ask for the replay from the new cursor.
        case requestFromCursor
        case disconnect(DisconnectReason)
    }

    public let configuration: Configuration
    public private(set) var statistics = Statistics()
    public private(set) var decoder: FrameDecoder

    private var phase: Phase = .notStarted
    private var hasStreamInfo = false
    public private(set) var epoch: UInt64 = 0
    /// Highest seq the peripheral reported (STREAM_INFO head), if known.
    public private(set) var knownHead: UInt64?
    /// Highest seq durably committed (as the store reported it).
    public private(set) var committedCursor: UInt64 = 0
    /// Highest seq accepted so far (committed or staged).
    public private(set) var stagedCursor: UInt64 = 0
    private var staged: [Frame] = []
    /// A gap to commit in front of `staged` (decided by the first DATA after a re-request).
    private var stagedGap: ClosedRange<UInt64>?
    private var commitInFlight: CommitBatch?
    /// Consecutive re-requested replays whose first DATA skipped past the cursor again.
    private var replaysSkippingGap = 0
    private var afterCommit: AfterCommit = .nothing
    /// Set after a gap re-request: the first DATA decides whether the loss was in transit or is real.
    private var awaitingReplayDecision = false
    /// When DATA bytes last arrived (or a SYNC_REQ went out): the reference for every idle decision.
    private var lastDataAt: Double = 0
    /// The link went idle with nothing buffered but the start of one frame (`handleIdle`): kept for its rest
    /// until DATA has been silent for the response timeout. Cleared by the next bytes.
    private var keptPartialFrame = false
    /// When the last SYNC_REQ or SYNC_ACK went out while more DATA was expected (nil: not waiting).
    private var waitingSince: Double?
    private var requestAttempts = 0
    /// STREAM_INFO's oldest retained seq, from the latest read.
    private var lastInfoOldest: UInt64 = 0
    public private(set) var isCaughtUp = false
    /// The seq named by this session's latest SYNC_ACK (nil: none sent yet).
    private var lastAcknowledged: UInt64?
    /// Set once the owner stops the session (shutdown) or a liveness bound ends it: no more frames are taken.
    private var stopping = false
    /// When the last new frame was committed, or when the session last had no reason to expect one (the
    /// reference for `noProgressTimeout`).
    private var lastProgressAt: Double = 0
    /// `connected`'s time: the reference for `maxSessionDuration`.
    private var startedAt: Double = 0

    public init(configuration: Configuration = Configuration()) {
        self.configuration = configuration
        self.decoder = FrameDecoder(maxPayloadLength: configuration.maxPayloadLength)
    }

    public var isClosed: Bool { phase == .closed && commitInFlight == nil }

    // MARK: - Events

    /// The link is up and services are resolved. `hasStreamInfo`: the Sync service has STREAM_INFO.
    public mutating func connected(hasStreamInfo: Bool, now: Double) -> [SyncAction] {
        precondition(phase == .notStarted, "connected twice")
        self.hasStreamInfo = hasStreamInfo
        startedAt = now
        lastProgressAt = now
        if hasStreamInfo {
            phase = .awaitingStreamInfo
            return [.readStreamInfo]
        }
        phase = .awaitingCursor
        epoch = 0
        return [.loadCursor(epoch: 0)]
    }

    /// STREAM_INFO was read (at the start, or after a gap). Raw bytes: parsing is part of the rules.
    public mutating func streamInfoRead(_ bytes: [UInt8], now: Double) -> [SyncAction] {
        let info: StreamInfo
        do {
            info = try StreamInfo(bytes: bytes)
        } catch {
            return close(.streamInfoUnreadable(error.description))
        }
        switch phase {
        case .awaitingStreamInfo:
            epoch = info.epoch
            knownHead = info.head
            lastInfoOldest = info.oldest
            phase = .awaitingCursor
            return [.loadCursor(epoch: info.epoch)]
        case .awaitingGapInfo:
            return resolveGap(with: info, now: now)
        default:
            return []
        }
    }

    /// STREAM_INFO could not be read (a D-Bus or ATT error).
    public mutating func streamInfoFailed(_ message: String, now: Double) -> [SyncAction] {
        guard phase == .awaitingStreamInfo || phase == .awaitingGapInfo else { return [] }
        return close(.streamInfoUnreadable(message))
    }

    /// The store's committed cursor for the stream (after `.loadCursor`, or after `.recordRegression`
    /// rebased the stream).
    public mutating func cursorLoaded(_ cursor: UInt64, now: Double) -> [SyncAction] {
        guard phase == .awaitingCursor else { return [] }
        lastProgressAt = now
        committedCursor = cursor
        stagedCursor = cursor
        phase = .streaming
        var actions: [SyncAction] = []
        if let head = knownHead, head < cursor {
            // Same epoch, yet the peripheral's counter is below what we already stored: a regression.
            // Do not drop what follows as "duplicates": the owner records it and rebases the stream.
            statistics.regressions += 1
            phase = .awaitingCursor
            knownHead = head
            return [.recordRegression(epoch: epoch, cursor: cursor, head: head)]
        }
        actions.append(.subscribe)
        if let gap = missingBeforeOldest() {
            // The peripheral already lost events we never received: record the gap first, then ask from it.
            return actions + commitGap(gap, then: .requestFromCursor)
        }
        if cursor > 0 {
            // Acknowledge the stored cursor first: frames the last session committed without an ACK (its
            // link dropped) are still counted against the peripheral's window, and a peripheral that
            // measures the window from its last ACK would otherwise never send past it. The cursor came
            // from the store, so this names nothing uncommitted.
            actions += acknowledge(cursor, now: now)
        }
        actions += sendRequest(now: now)
        if let head = knownHead, head <= cursor {
            // Nothing to replay: the final SYNC_ACK (from caughtUpActions) names what is already stored.
            waitingSince = nil
            isCaughtUp = true
            actions += caughtUpActions()
        }
        return actions
    }

    /// A chunk of the DATA byte stream (one notification, or one read from the AcquireNotify fd).
    public mutating func bytesReceived(_ bytes: [UInt8], now: Double) -> [SyncAction] {
        guard phase != .closed, phase != .notStarted, !stopping else { return [] }
        noteTime(now)
        // Idle means no BYTES: a big frame on a small-MTU link spans many notifications and may take longer
        // than the idle timeout; keying idle on whole frames would "resolve a stall" in the middle of it.
        if !bytes.isEmpty {
            lastDataAt = now
            keptPartialFrame = false
        }
        var actions: [SyncAction] = []
        var frames: [Frame] = []
        decoder.feed(bytes) { frames.append($0) }
        for frame in frames {
            actions += handle(frame, now: now)
        }
        return actions
    }

    /// The owner's commit of `batch` finished; `cursor` is the store's cursor after it.
    public mutating func commitFinished(cursor: UInt64, now: Double) -> [SyncAction] {
        guard let batch = commitInFlight else { return [] }
        noteTime(now)
        commitInFlight = nil
        // Idle means the LINK was quiet while we could read it. The owner commits on the thread that reads, so a
        // commit longer than idleTimeout (an SD card's fsync, another connection's checkpoint) would otherwise
        // end with an idle that never happened: a frame split across notifications is then dropped as a stall
        // while its rest is on its way, and the frames behind it cost a re-request.
        lastDataAt = max(lastDataAt, now)
        if cursor > committedCursor { lastProgressAt = now }
        committedCursor = cursor
        statistics.commits += 1
        statistics.committedFrames += batch.frames.count
        if batch.gap != nil { statistics.gapsRecorded += 1 }
        var actions: [SyncAction] = []
        // No ACK when a gap re-request follows: an ACK opens the peripheral's window, and the old replay's
        // next frames would then arrive after our SYNC_REQ and look like "the replay skipped again" — a
        // GAP over events the peripheral still has (the SYNC_REQ carries the committed cursor anyway).
        let reRequestFollows = afterCommit == .resolveGap || afterCommit == .requestFromCursor
        if batch.acknowledge && phase != .closed && !reRequestFollows {
            // A grouped batch is acknowledged at each of its cadence boundaries, as if committed one cadence
            // at a time: the peripheral sees the same ACKs, only sooner. Never above what the store reported.
            for boundary in cadenceBoundaries(of: batch) where boundary < cursor {
                actions += acknowledge(boundary, now: now)
            }
            actions += acknowledge(cursor, now: now)
        }
        let mustFlush = phase != .streaming || afterCommit != .nothing || stopping || replayComplete
        if !staged.isEmpty && (staged.count >= configuration.ackBatch || mustFlush) {
            actions += commitStaged(acknowledge: phase != .closed && !reRequestFollows, grouping: !mustFlush)
            return actions
        }
        let next = afterCommit
        afterCommit = .nothing
        // The link is gone: a pending gap resolution or re-request must not touch it.
        if phase == .closed { return actions }
        switch next {
        case .nothing:
            if phase == .streaming { actions += checkCaughtUp(now: now) }
        case .resolveGap:
            actions += startGapResolution(now: now)
        case .requestFromCursor:
            phase = .streaming
            if let head = knownHead, committedCursor >= head {
                actions += checkCaughtUp(now: now)
            } else {
                // SYNC_REQ first, THEN the ACK of the recorded gap: a peripheral that measures its window
                // from the last ACK cannot send past a gap longer than the window without it, and once the
                // SYNC_REQ has reset its replay the opened window cannot release old-replay frames.
                actions += sendRequest(now: now)
                actions += acknowledge(committedCursor, now: now)
            }
        case .disconnect(let reason):
            actions += close(reason)
        }
        return actions
    }

    /// The commit failed (disk full, I/O error). Nothing was acknowledged; the peripheral keeps the frames.
    public mutating func commitFailed(now: Double) -> [SyncAction] {
        commitInFlight = nil
        staged.removeAll()
        stagedGap = nil
        return close(.storeFailed)
    }

    /// The owner's timer reached `nextDeadline` (or any later time).
    public mutating func timerFired(now: Double) -> [SyncAction] {
        guard phase != .closed, phase != .notStarted else { return [] }
        noteTime(now)
        if !stopping, let deadline = livenessDeadline, now >= deadline.at {
            return end(deadline.reason, now: now)
        }
        var actions: [SyncAction] = []
        if now >= lastDataAt + configuration.idleTimeout {
            actions += handleIdle(now: now)
        }
        if let since = waitingSince, now >= since + configuration.responseTimeout, phase == .streaming,
            commitInFlight == nil, staged.isEmpty, decoder.bufferedByteCount == 0
        {
            actions += handleResponseTimeout(now: now)
        }
        return actions
    }

    /// The link dropped. What is staged is committed WITHOUT an ACK (the peripheral replays it next time,
    /// and the cursor check drops the duplicates).
    public mutating func disconnected(now: Double) -> [SyncAction] {
        guard phase != .closed else { return [] }
        phase = .closed
        waitingSince = nil
        if commitInFlight == nil && !staged.isEmpty {
            return commitStaged(acknowledge: false)
        }
        return []
    }

    /// Graceful stop (SIGTERM): take no more frames, commit and acknowledge what is staged, then disconnect.
    public mutating func stop(now: Double) -> [SyncAction] {
        end(.shutdown, now: now)
    }

    /// Ends the session in order: take no more frames, commit and acknowledge what is staged, send a final
    /// SYNC_ACK of the committed cursor if this session has not acknowledged it yet (PROTOCOL §4 step 7), then
    /// disconnect with `reason`.
    private mutating func end(_ reason: DisconnectReason, now: Double) -> [SyncAction] {
        guard phase != .closed else { return [] }
        stopping = true
        waitingSince = nil
        if commitInFlight != nil {
            afterCommit = .disconnect(reason)
            return []
        }
        if !staged.isEmpty {
            afterCommit = .disconnect(reason)
            return commitStaged(acknowledge: true)
        }
        var actions: [SyncAction] = []
        if cursorKnown && lastAcknowledged != committedCursor && committedCursor > 0 && reason != .shutdown {
            // A shutdown keeps its old shape (ACKs follow commits only); a liveness end tells the peripheral
            // where to resume even when this session committed nothing it acknowledged.
            statistics.acks += 1
            lastAcknowledged = committedCursor
            actions.append(.sendSyncAck(committedCursor))
        }
        return actions + close(reason)
    }

    /// The stored cursor was loaded (the phases before that have nothing to acknowledge).
    private var cursorKnown: Bool {
        switch phase {
        case .streaming, .draining, .awaitingGapInfo: return true
        case .notStarted, .awaitingStreamInfo, .awaitingCursor, .closed: return false
        }
    }

    /// Whether the session is waiting for frames it should get (so the no-progress clock runs). A caught-up
    /// stay-connected session waits for live events that may never come: that is not a stall.
    private var progressExpected: Bool {
        !isCaughtUp || hasMoreExpected || phase != .streaming
    }

    /// Called at every event: while no progress is expected, the no-progress clock stands at `now`, so it
    /// measures from the moment the session started expecting frames again.
    private mutating func noteTime(_ now: Double) {
        if !progressExpected { lastProgressAt = max(lastProgressAt, now) }
    }

    /// The earliest liveness bound and what ending there is called (nil: none applies).
    private var livenessDeadline: (at: Double, reason: DisconnectReason)? {
        var best: (at: Double, reason: DisconnectReason)?
        if progressExpected {
            best = (lastProgressAt + configuration.noProgressTimeout, .noProgress)
        }
        if !configuration.stayConnected, let limit = configuration.maxSessionDuration {
            let at = startedAt + limit
            if best == nil || at < best!.at { best = (at, .maxDurationReached) }
        }
        return best
    }

    /// When the owner must call `timerFired` next, if at all.
    public var nextDeadline: Double? {
        guard phase != .closed, phase != .notStarted else { return nil }
        var deadlines: [Double] = []
        // Once ending (stopping), a liveness bound has nothing left to do: only the commit's answer matters.
        if !stopping, let liveness = livenessDeadline { deadlines.append(liveness.at) }
        // Only deadlines whose handler would act: a past deadline that changes nothing (e.g. idle while a
        // commit is in flight) would make an owner that re-arms its timer spin until the commit finishes.
        let idleWouldAct =
            (decoder.bufferedByteCount > 0 && !keptPartialFrame) || (commitInFlight == nil && !staged.isEmpty)
            || (phase == .draining && afterCommit != .resolveGap)
        if idleWouldAct {
            deadlines.append(lastDataAt + configuration.idleTimeout)
        }
        if keptPartialFrame {
            deadlines.append(lastDataAt + configuration.responseTimeout)
        }
        if let since = waitingSince, phase == .streaming, commitInFlight == nil, staged.isEmpty,
            decoder.bufferedByteCount == 0
        {
            deadlines.append(since + configuration.responseTimeout)
        }
        return deadlines.min()
    }

    // MARK: - Rules

    private mutating func handle(_ frame: Frame, now: Double) -> [SyncAction] {
        guard frame.type == .data else {
            statistics.unexpectedFrames += 1
            return []
        }
        statistics.dataFrames += 1
        lastDataAt = now
        switch phase {
        case .streaming:
            break
        case .draining, .awaitingGapInfo, .awaitingStreamInfo, .awaitingCursor:
            // The rest of an old replay (or notifications before our SYNC_REQ): not trusted for ordering.
            statistics.droppedWhileDraining += 1
            return []
        case .notStarted, .closed:
            return []
        }
        if commitInFlight != nil && afterCommit != .nothing {
            // A gap resolution is pending behind the commit: frames now are the old window's tail.
            statistics.droppedWhileDraining += 1
            return []
        }
        switch SequenceVerdict.classify(seq: frame.seq, cursor: stagedCursor) {
        case .duplicate:
            statistics.duplicates += 1
            return []
        case .next:
            // Only a frame that moves the stream on answers the request: a duplicate, a stale replay or a
            // frame dropped while draining must not reset the response timer or the attempt count, or a
            // peripheral that answers every SYNC_REQ with one old frame would hold the session forever.
            waitingSince = nil
            requestAttempts = 0
            awaitingReplayDecision = false
            replaysSkippingGap = 0
            return stage(frame)
        case .gap(let first, let last):
            statistics.gapsDetected += 1
            if awaitingReplayDecision {
                awaitingReplayDecision = false
                replaysSkippingGap += 1
                if replaysSkippingGap >= configuration.maxRequestAttempts {
                    // Replay after replay skips it: those events are gone. Record the gap and accept.
                    replaysSkippingGap = 0
                    stagedGap = first...last
                    waitingSince = nil
                    requestAttempts = 0
                    return stage(frame)
                }
                // One skipped replay is not proof: the replay's first notification can be lost in transit
                // too, and recording a GAP here would ACK past events the peripheral still holds (it then
                // deletes them). Drain and re-request; with STREAM_INFO the re-read `oldest` decides.
            }
            phase = .draining
            return []
        }
    }

    private mutating func stage(_ frame: Frame) -> [SyncAction] {
        // Every frame held here is past our last SYNC_ACK (a commit's frames are acknowledged after it), and a
        // peripheral may send at most `window` frames past the last ACK it received, which is never later than
        // ours: a conforming peripheral cannot fill more than the window. One that does loses the excess (the
        // next frame is then a gap, drained and re-requested) instead of growing this session's memory.
        if staged.count + (commitInFlight?.frames.count ?? 0) >= max(1, Int(configuration.window)) {
            statistics.pastWindow += 1
            return []
        }
        staged.append(frame)
        stagedCursor = frame.seq
        statistics.staged += 1
        if (staged.count >= configuration.ackBatch || replayComplete) && commitInFlight == nil {
            return commitStaged(acknowledge: true)
        }
        return []
    }

    /// The replay has delivered STREAM_INFO's head: the partial batch is committed and acknowledged at once
    /// instead of after the idle timeout (nothing more is coming; waiting would only hold the link). Not once
    /// caught up: live events past the head keep being batched by count and idle.
    private var replayComplete: Bool {
        guard !isCaughtUp, let head = knownHead else { return false }
        return stagedCursor >= head
    }

    /// Frames per commit and ACK (`ackBatch`; at least 1 whatever a caller configured).
    private var cadence: Int { max(1, configuration.ackBatch) }

    /// `grouping`: several cadences' worth are staged because frames kept arriving while the last commit ran
    /// (the store is slower than the air): commit whole cadences, up to one window's worth, in one transaction
    /// instead of one transaction each. What a transaction costs (locks, WAL frames, fsync) is per commit, not
    /// per frame, so a gateway that falls behind catches up instead of falling further behind. The window bounds
    /// the transaction even when a peripheral sends past it, and so does `maxGroupPayloadBytes`. Not for a gap
    /// (its batch is special) nor when flushing.
    private mutating func commitStaged(acknowledge: Bool, grouping: Bool = false) -> [SyncAction] {
        precondition(commitInFlight == nil)
        let cadence = self.cadence
        let groupable = min(staged.count, max(Int(configuration.window), cadence))
        var count = min(staged.count, cadence)
        if grouping && stagedGap == nil && groupable >= 2 * cadence {
            var bytes = staged[..<count].reduce(0) { $0 + $1.payload.count }
            while count + cadence <= groupable {
                let next = staged[count..<(count + cadence)].reduce(0) { $0 + $1.payload.count }
                guard bytes + next <= configuration.maxGroupPayloadBytes else { break }
                bytes += next
                count += cadence
            }
        }
        let frames = Array(staged.prefix(count))
        staged.removeFirst(count)
        let gap = stagedGap
        stagedGap = nil
        let newCursor = frames.last?.seq ?? gap?.upperBound ?? committedCursor
        let batch = CommitBatch(
            expectedCursor: committedCursor, gap: gap, frames: frames, newCursor: newCursor,
            acknowledge: acknowledge)
        commitInFlight = batch
        return [.commit(batch)]
    }

    private mutating func commitGap(_ gap: ClosedRange<UInt64>, then next: AfterCommit) -> [SyncAction] {
        precondition(staged.isEmpty && commitInFlight == nil)
        stagedGap = gap
        stagedCursor = gap.upperBound
        afterCommit = next
        // The SYNC_REQ that follows names the new cursor; an ACK before it would only open the old window.
        return commitStaged(acknowledge: false)
    }

    /// The seqs at which a batch of more than one cadence crosses a cadence boundary, its last frame excluded.
    private func cadenceBoundaries(of batch: CommitBatch) -> [UInt64] {
        guard batch.gap == nil, batch.frames.count > cadence else { return [] }
        return stride(from: cadence - 1, to: batch.frames.count - 1, by: cadence).map { batch.frames[$0].seq }
    }

    private mutating func acknowledge(_ cursor: UInt64, now: Double) -> [SyncAction] {
        statistics.acks += 1
        lastAcknowledged = cursor
        waitingSince = hasMoreExpected ? now : nil
        return [.sendSyncAck(cursor)]
    }

    /// Whether more DATA is expected from the replay (as opposed to live events that may never come).
    private var hasMoreExpected: Bool {
        guard let head = knownHead else { return !isCaughtUp }
        return stagedCursor < head
    }

    private mutating func sendRequest(now: Double) -> [SyncAction] {
        statistics.syncRequests += 1
        requestAttempts += 1
        waitingSince = now
        lastDataAt = now
        return [.sendSyncRequest(lastCommitted: committedCursor, window: configuration.window)]
    }

    private mutating func handleIdle(now: Double) -> [SyncAction] {
        var actions: [SyncAction] = []
        keptPartialFrame = false
        if decoder.bufferedByteCount > 0 {
            if phase == .streaming, now < lastDataAt + configuration.responseTimeout, holdsOnlyAPartialFrame {
                // The start of a frame and nothing behind it: over a slow link its rest is still on the way (a
                // link can pause for a second and stay up), and dropping it would cost a re-request. Nothing
                // waits behind it, so keeping it delays no frame; the response timeout bounds the wait.
                keptPartialFrame = true
            } else {
                var frames: [Frame] = []
                decoder.resolveStall { frames.append($0) }
                for frame in frames { actions += handle(frame, now: lastDataAt) }
            }
        }
        switch phase {
        case .draining:
            if commitInFlight != nil {
                afterCommit = .resolveGap
            } else if !staged.isEmpty {
                afterCommit = .resolveGap
                actions += commitStaged(acknowledge: false)
            } else {
                actions += startGapResolution(now: now)
            }
        case .streaming:
            if commitInFlight == nil && !staged.isEmpty {
                actions += commitStaged(acknowledge: true)
            }
        default:
            break
        }
        return actions
    }

    /// Whether the buffered bytes hold no complete frame however they are resolved: only the start of one frame
    /// (a damaged length field holding back the frames behind it is the other case: resolve that at once).
    /// Tried on a copy of the decoder; at most once per idle tick.
    private var holdsOnlyAPartialFrame: Bool {
        var trial = decoder
        var found = false
        trial.resolveStall { _ in found = true }
        return !found
    }

    private mutating func startGapResolution(now: Double) -> [SyncAction] {
        if hasStreamInfo {
            phase = .awaitingGapInfo
            return [.readStreamInfo]
        }
        // No STREAM_INFO: re-ask; the first DATA after it decides (§4 step 5).
        phase = .streaming
        awaitingReplayDecision = true
        requestAttempts = 0
        return sendRequest(now: now)
    }

    private mutating func resolveGap(with info: StreamInfo, now: Double) -> [SyncAction] {
        if info.epoch != epoch {
            return close(.epochChanged)
        }
        knownHead = info.head
        lastInfoOldest = info.oldest
        if info.head < committedCursor {
            statistics.regressions += 1
            phase = .awaitingCursor
            return [.recordRegression(epoch: epoch, cursor: committedCursor, head: info.head)]
        }
        if let gap = missingBeforeOldest() {
            phase = .streaming
            return commitGap(gap, then: .requestFromCursor)
        }
        phase = .streaming
        // STREAM_INFO just said the peripheral still holds cursor+1: a replay that skips it again is a
        // transit loss or the old replay's tail (seen on real BlueZ: 2,087 events lost to false GAPs with
        // window 2000), never proof. Drain and re-read; only `oldest > cursor+1` records a GAP.
        awaitingReplayDecision = false
        requestAttempts = 0
        return sendRequest(now: now)
    }

    /// With STREAM_INFO: the events the peripheral no longer holds but we never received.
    private func missingBeforeOldest() -> ClosedRange<UInt64>? {
        guard hasStreamInfo, let head = knownHead, head > stagedCursor else { return nil }
        // We only get here with info read this session; `oldest == 0` means nothing is retained.
        let oldest = lastInfoOldest
        if oldest == 0 { return (stagedCursor + 1)...head }
        if oldest > stagedCursor + 1 { return (stagedCursor + 1)...(oldest - 1) }
        return nil
    }


    private mutating func handleResponseTimeout(now: Double) -> [SyncAction] {
        guard hasMoreExpected else {
            waitingSince = nil
            return checkCaughtUp(now: now)
        }
        if !hasStreamInfo {
            // Without STREAM_INFO silence is the only signal that the peripheral has nothing more.
            waitingSince = nil
            isCaughtUp = true
            return caughtUpActions()
        }
        if requestAttempts >= configuration.maxRequestAttempts {
            return close(.noResponse)
        }
        return sendRequest(now: now)
    }

    private mutating func checkCaughtUp(now: Double) -> [SyncAction] {
        guard !isCaughtUp, commitInFlight == nil, staged.isEmpty else { return [] }
        if let head = knownHead {
            guard committedCursor >= head else { return [] }
            isCaughtUp = true
            return caughtUpActions()
        }
        return []
    }

    private mutating func caughtUpActions() -> [SyncAction] {
        var actions: [SyncAction] = []
        // PROTOCOL §4 step 7: a final SYNC_ACK. Needed when this session acknowledged nothing yet (the last
        // session's frames were committed without ACK when its link dropped; no STREAM_INFO; a gap commit).
        if lastAcknowledged != committedCursor {
            statistics.acks += 1
            lastAcknowledged = committedCursor
            actions.append(.sendSyncAck(committedCursor))
        }
        actions.append(.caughtUp(cursor: committedCursor))
        if !configuration.stayConnected {
            actions += close(.caughtUp)
        }
        return actions
    }

    private mutating func close(_ reason: DisconnectReason) -> [SyncAction] {
        waitingSince = nil
        if phase == .closed { return [] }
        phase = .closed
        var actions: [SyncAction] = []
        if commitInFlight == nil && !staged.isEmpty {
            actions += commitStaged(acknowledge: false)
        }
        actions.append(.disconnect(reason))
        return actions
    }
}

/// One window's worth of durable work: ONE transaction moves the cursor from `expectedCursor` to
/// `newCursor`, inserting `frames` and, in front of them, the `gap` record if any.
public struct CommitBatch: Sendable, Equatable {
    /// The cursor the machine believes is stored; the store re-checks it inside the transaction.
    public var expectedCursor: UInt64
    /// Seqs recorded as lost (a GAP outbox event), all below the first frame.
    public var gap: ClosedRange<UInt64>?
    /// Contiguous DATA frames, strictly increasing.
    public var frames: [Frame]
    public var newCursor: UInt64
    /// Whether a SYNC_ACK follows the commit (false when the link is gone).
    public var acknowledge: Bool

    public init(
        expectedCursor: UInt64, gap: ClosedRange<UInt64>?, frames: [Frame], newCursor: UInt64, acknowledge: Bool
    ) {
        self.expectedCursor = expectedCursor
        self.gap = gap
        self.frames = frames
        self.newCursor = newCursor
        self.acknowledge = acknowledge
    }
}

public enum SyncAction: Sendable, Equatable {
    /// Read STREAM_INFO; answer with `streamInfoRead` or `streamInfoFailed`.
    case readStreamInfo
    /// Look up the stored cursor of (peripheral, epoch); answer with `cursorLoaded`.
    case loadCursor(epoch: UInt64)
    /// Subscribe to DATA (AcquireNotify, falling back to StartNotify) before the SYNC_REQ goes out.
    case subscribe
    case sendSyncRequest(lastCommitted: UInt64, window: UInt16)
    case sendSyncAck(UInt64)
    /// Commit in ONE transaction; answer with `commitFinished(cursor:)` or `commitFailed`.
    case commit(CommitBatch)
    /// Record a REGRESSION for the stream and rebase it (see the store); answer with `cursorLoaded`.
    case recordRegression(epoch: UInt64, cursor: UInt64, head: UInt64)
    /// Informational: everything the peripheral had is committed and acknowledged.
    case caughtUp(cursor: UInt64)
    case disconnect(SyncSession.DisconnectReason)
}

extension SyncSession.DisconnectReason: CustomStringConvertible {
    /// Log text: the kind, with the detail quoted (`streamInfoUnreadable("...")`), as log readers know it.
    public var description: String {
        switch self {
        case .streamInfoUnreadable(let detail): "\(kind)(\(String(reflecting: detail)))"
        default: kind
        }
    }
}
