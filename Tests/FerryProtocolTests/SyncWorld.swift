import Testing
@testable import FerryProtocol

/// A seeded, virtual-time world for SyncSession property tests: a tiny in-test owner that executes the
/// machine's actions against a fake store cursor, and a model peripheral with a persistent event log, a replay
/// window, and fault knobs. Everything is deterministic from `Config.seed`, so a failure replays exactly.
///
/// What the world checks while it runs (each violation is appended to `failures`):
/// - THE DURABILITY RULE: every `.sendSyncAck(n)` (and every SYNC_REQ's `lastCommitted`) is ≤ the store cursor
///   the owner last reported via `commitFinished` / `cursorLoaded`.
/// - Every commit starts at the stored cursor, its gap (if any) starts at cursor + 1, its frames are contiguous
///   after the gap, its payloads are the peripheral's bytes, and at most one commit is outstanding.
/// - After a timer fires, `nextDeadline` is in the future (an owner re-arming at a past deadline would spin).
/// - No action targets a link after the session reported it closed.
final class SyncWorld {
    struct Config: CustomStringConvertible {
        var seed: UInt64
        var events: UInt64 = 300
        var hasStreamInfo = true
        /// Events 1...initiallyLost are already gone from the peripheral before the first connection.
        var initiallyLost: UInt64 = 0
        var dropRate = 0.0
        var corruptRate = 0.0
        var duplicateRate = 0.0
        var noiseRate = 0.0
        /// Per sent frame: the peripheral's buffer overflows and it loses 1–5 unacknowledged events.
        var pruneRate = 0.0
        /// Per delivered frame: the link drops.
        var disconnectRate = 0.0
        /// Per SYNC_REQ: the peripheral ignores it.
        var silenceRate = 0.0
        /// New events appear while the first `liveFor` seconds last.
        var liveEvents: UInt64 = 0
        var liveFor = 5.0
        var maxCommitDelay = 0.02
        /// Peripherals may count a SYNC_REQ's seq as acknowledged (window measured from it), or not.
        var requestCountsAsAck = true
        var maxChunk = 64
        /// Keep transit faults off the first frame sent after each SYNC_REQ. The protocol's "the first DATA
        /// after the re-request decides" rule records a GAP when exactly that frame is lost in transit, so with
        /// this on, EVERY recorded gap must be a real loss on the peripheral.
        var protectFirstAfterRequest = true

        var description: String {
            "seed \(seed) events \(events) info \(hasStreamInfo) lost \(initiallyLost) drop \(dropRate) corrupt \(corruptRate) "
                + "dup \(duplicateRate) noise \(noiseRate) prune \(pruneRate) disc \(disconnectRate) silence \(silenceRate) "
                + "live \(liveEvents) reqAck \(requestCountsAsAck) chunk \(maxChunk) protect \(protectFirstAfterRequest)"
        }

        static func random(seed: UInt64) -> Config {
            var rng = SeededRNG(seed: seed ^ 0x5EED)
            var c = Config(seed: seed)
            c.events = UInt64.random(in: 1...400, using: &rng)
            c.hasStreamInfo = rng.chance(0.6)
            c.initiallyLost = rng.chance(0.2) ? UInt64.random(in: 1...c.events, using: &rng) : 0
            func rate(_ p: Double, _ max: Double) -> Double { rng.chance(p) ? Double.random(in: 0...max, using: &rng) : 0 }
            c.dropRate = rate(0.5, 0.08)
            c.corruptRate = rate(0.5, 0.08)
            c.duplicateRate = rate(0.3, 0.1)
            c.noiseRate = rate(0.3, 0.2)
            c.pruneRate = rate(0.25, 0.02)
            c.disconnectRate = rate(0.3, 0.01)
            c.silenceRate = rate(0.2, 0.3)
            c.liveEvents = rng.chance(0.3) ? UInt64.random(in: 1...100, using: &rng) : 0
            c.maxCommitDelay = [0.0, 0.005, 0.02, 0.3].randomElement(using: &rng)!
            c.requestCountsAsAck = rng.chance(0.5)
            c.maxChunk = [1, 20, 64, 244, 517].randomElement(using: &rng)!
            c.protectFirstAfterRequest = rng.chance(0.7)
            return c
        }
    }

    enum Event {
        case connect
        /// `completes`: the intact frame whose last byte is in this chunk, and how many SYNC_REQs the
        /// peripheral had processed on this link when it sent it.
        case deliver(link: Int, bytes: [UInt8], completes: (seq: UInt64, requestCount: Int)?)
        case peripheralGets(link: Int, frame: Frame)
        case peripheralSend(link: Int)
        case streamInfoReply(link: Int)
        case cursorReply(link: Int)
        case commitDone(CommitBatch)
        case liveEvent
    }

    let config: Config
    var sessionConfiguration = SyncSession.Configuration()
    var rng: SeededRNG
    var now = 0.0
    private var order = 0
    private var queue = EventHeap()

    // The owner's store.
    private(set) var storeCursor: UInt64 = 0
    private(set) var stored: [UInt64: [UInt8]] = [:]
    private(set) var gaps: [ClosedRange<UInt64>] = []
    private(set) var acks: [UInt64] = []
    private(set) var failures: [String] = []
    private var commitInFlight = false

    // The peripheral.
    let epoch: UInt64
    private(set) var pOldest: UInt64
    private(set) var pHead: UInt64
    private var pAckBase: UInt64 = 0
    private var pNext: UInt64 = 1
    private var pWindow: UInt64 = 0
    private var pActiveLink: Int?
    private var pSendScheduled = false
    private var pFirstAfterRequest = false
    private var lastDataDelivery = 0.0
    private var lastControlDelivery = 0.0
    /// Seqs the peripheral lost without them being stored: a GAP is legitimate only over these.
    private var genuinelyLost = Set<UInt64>()
    private var liveLeft: UInt64

    // The gateway side.
    private(set) var session: SyncSession?
    private var link = 0
    private var linkUp = false
    private var connectScheduled = false
    private(set) var sessionsStarted = 0
    private(set) var disconnectReasons: [SyncSession.DisconnectReason] = []
    private(set) var totals = SyncSession.Statistics()

    init(_ config: Config) {
        self.config = config
        rng = SeededRNG(seed: config.seed)
        epoch = config.hasStreamInfo ? rng.next() : 0
        pHead = config.events
        pOldest = config.initiallyLost + 1
        for s in stride(from: UInt64(1), through: config.initiallyLost, by: 1) { genuinelyLost.insert(s) }
        liveLeft = config.liveEvents
    }

    static func payload(_ seq: UInt64) -> [UInt8] {
        Array("event \(seq) ".utf8) + [UInt8](repeating: UInt8(truncatingIfNeeded: seq), count: Int(seq % 37))
    }

    /// When set, every event and action is logged here (for replaying a failing seed).
    var trace: [String]?
    private func log(_ line: @autoclosure () -> String) {
        if trace != nil { trace!.append(String(format: "%9.4f ", now) + line()) }
    }

    private func schedule(_ at: Double, _ event: Event) {
        order += 1
        queue.push(.init(at: at, order: order, event: event))
    }

    private func fail(_ message: String) {
        if failures.count < 20 { failures.append(String(format: "t=%.4f ", now) + message) }
    }

    /// Runs until everything the peripheral ever had is stored or recorded as a gap and the world is quiet.
    func run(maxVirtualSeconds: Double = 3600, maxSteps: Int = 3_000_000) {
        schedule(0, .connect)
        connectScheduled = true
        if liveLeft > 0 { schedule(0.05, .liveEvent) }
        var steps = 0
        var timerBlockedUntilEvent = false
        while steps < maxSteps, failures.isEmpty {
            steps += 1
            let next = queue.peek
            if !timerBlockedUntilEvent, let deadline = session?.nextDeadline, next == nil || deadline < next!.at {
                now = max(now, deadline)
                let firedAt = now
                log("timerFired")
                execute(session!.timerFired(now: now))
                if let again = session?.nextDeadline, again <= firedAt {
                    fail("nextDeadline \(again) is not after timerFired(now: \(firedAt)): an owner would spin")
                    timerBlockedUntilEvent = true
                }
                continue
            }
            guard next != nil else { break }
            let item = queue.pop()
            now = max(now, item.at)
            timerBlockedUntilEvent = false
            if case .deliver(_, let b, _) = item.event { log("deliver \(b.count)B link \(link) up \(linkUp)") } else { log("\(item.event)") }
            handle(item.event)
            if now > maxVirtualSeconds {
                fail("still not done after \(maxVirtualSeconds) virtual seconds")
                break
            }
        }
        if steps >= maxSteps { fail("step limit reached") }
    }

    private func handle(_ event: Event) {
        switch event {
        case .connect:
            connectScheduled = false
            requestsSent = 0
            requestsProcessed = 0
            link += 1
            linkUp = true
            sessionsStarted += 1
            var s = SyncSession(configuration: sessionConfiguration)
            let actions = s.connected(hasStreamInfo: config.hasStreamInfo, now: now)
            session = s
            execute(actions)
        case .deliver(let l, let bytes, let completes):
            guard linkUp, l == link else { return }
            // Rolled once per frame (on its last chunk), not per chunk: with 1-byte chunks a per-chunk rate
            // would model a link that never carries a whole window, where no session can make progress.
            if completes != nil && rng.chance(config.disconnectRate) {
                dropLink()
                return
            }
            if let c = completes, deliveredSinceRequest[c.seq] == nil { deliveredSinceRequest[c.seq] = c.requestCount }
            execute(session!.bytesReceived(bytes, now: now))
        case .peripheralGets(let l, let frame):
            guard linkUp, l == link else { return }
            peripheralReceives(frame, link: l)
        case .peripheralSend(let l):
            pSendScheduled = false
            guard linkUp, l == link, pActiveLink == l else { return }
            peripheralSendStep(link: l)
        case .streamInfoReply(let l):
            guard linkUp, l == link else { return }
            let retained = pOldest <= pHead
            let info = StreamInfo(epoch: epoch, oldest: retained ? pOldest : 0, head: pHead)
            execute(session!.streamInfoRead(info.encoded(), now: now))
        case .cursorReply(let l):
            guard linkUp, l == link else { return }
            execute(session!.cursorLoaded(storeCursor, now: now))
        case .commitDone(let batch):
            apply(batch)
            commitInFlight = false
            execute(session!.commitFinished(cursor: storeCursor, now: now))
            maybeReconnect()
        case .liveEvent:
            guard liveLeft > 0 else { return }
            liveLeft -= 1
            pHead += 1
            if let l = pActiveLink, linkUp, l == link { kickPeripheral(link: l) }
            if liveLeft > 0 { schedule(now + config.liveFor / Double(config.liveEvents), .liveEvent) }
            maybeReconnect()
        }
    }

    // MARK: The owner

    private func execute(_ actions: [SyncAction]) {
        for action in actions {
            log("  -> \(action)")
            switch action {
            case .readStreamInfo:
                if !linkUp { fail("readStreamInfo on a dead link") }
                schedule(now + 0.005, .streamInfoReply(link: link))
            case .loadCursor(let e):
                if e != epoch { fail("loadCursor(epoch: \(e)) but the peripheral's epoch is \(epoch)") }
                schedule(now + 0.001, .cursorReply(link: link))
            case .subscribe:
                break
            case .sendSyncRequest(let last, let window):
                if last > storeCursor { fail("SYNC_REQ(\(last)) names more than the store holds (\(storeCursor))") }
                if !linkUp { fail("SYNC_REQ on a dead link") }
                requestsSent += 1
                deliveredSinceRequest = [:]
                sendControl(.syncRequest(lastCommitted: last, window: window))
            case .sendSyncAck(let n):
                if n > storeCursor { fail("DURABILITY: SYNC_ACK(\(n)) but only \(storeCursor) is committed") }
                acks.append(n)
                if linkUp { sendControl(.syncAck(committed: n)) }
            case .commit(let batch):
                if commitInFlight { fail("a second commit while one is outstanding") }
                commitInFlight = true
                requestsAtCommit = requestsSent
                decisionRequestCount = batch.frames.first.flatMap { deliveredSinceRequest[$0.seq] }
                let delay = Double.random(in: 0...config.maxCommitDelay, using: &rng)
                schedule(now + delay, .commitDone(batch))
            case .recordRegression(let e, let c, let h):
                fail("unexpected regression \(e) \(c) \(h)")
            case .caughtUp:
                break
            case .disconnect(let reason):
                disconnectReasons.append(reason)
                linkUp = false
                pActiveLink = nil
                maybeReconnect()
            }
        }
        if let s = session { totals = s.statistics }
    }

    private func apply(_ batch: CommitBatch) {
        if batch.expectedCursor != storeCursor {
            fail("commit expects cursor \(batch.expectedCursor), store has \(storeCursor)")
            return
        }
        var next = storeCursor + 1
        if let gap = batch.gap {
            if gap.lowerBound != next { fail("gap \(gap) does not start at cursor + 1 = \(next)") }
            let notLost = gap.filter { !genuinelyLost.contains($0) }
            if !notLost.isEmpty {
                // The frame that decided "the replay skipped again" was sent before the peripheral had
                // processed our latest SYNC_REQ (a live event, or an ignored SYNC_REQ): the race that the
                // "first DATA after the re-request decides" rule (PROTOCOL §4.5) cannot see.
                if let d = decisionRequestCount, d < requestsAtCommit {
                    raceGaps.append(gap)
                } else if !config.protectFirstAfterRequest {
                    spuriousGaps.append(gap)
                } else {
                    fail("GAP \(gap) covers \(notLost.count) events the peripheral still had (first \(notLost[0]))")
                }
            }
            gaps.append(gap)
            next = gap.upperBound + 1
        }
        for frame in batch.frames {
            if frame.seq != next { fail("frame \(frame.seq) committed where \(next) was due") }
            if frame.payload != Self.payload(frame.seq) { fail("frame \(frame.seq) committed with damaged payload") }
            if stored[frame.seq] != nil { fail("frame \(frame.seq) committed twice") }
            stored[frame.seq] = frame.payload
            next = frame.seq + 1
        }
        let expected = next - 1
        if batch.newCursor != expected { fail("batch newCursor \(batch.newCursor), contents end at \(expected)") }
        storeCursor = batch.newCursor
    }

    /// Gaps over events the peripheral still had because the first frame after a re-request was lost in transit
    /// (only possible when `protectFirstAfterRequest` is off).
    private(set) var spuriousGaps: [ClosedRange<UInt64>] = []
    /// Gaps over events the peripheral still had, decided by a frame sent before the peripheral saw the re-request.
    private(set) var raceGaps: [ClosedRange<UInt64>] = []
    /// SYNC_REQs the gateway sent / the peripheral processed on the current link; per seq, the peripheral's
    /// count when it last sent that frame; the gateway's count when the outstanding commit was issued.
    private var requestsSent = 0
    private var requestsProcessed = 0
    /// Per seq, the first intact copy delivered since the gateway's latest SYNC_REQ: the peripheral's
    /// processed-request count when it sent that copy.
    private var deliveredSinceRequest: [UInt64: Int] = [:]
    private var requestsAtCommit = 0
    private var decisionRequestCount: Int?

    private func dropLink() {
        linkUp = false
        pActiveLink = nil
        execute(session!.disconnected(now: now))
        maybeReconnect()
    }

    private func maybeReconnect() {
        guard !linkUp, !commitInFlight, !connectScheduled else { return }
        guard liveLeft > 0 || storeCursor < expectedFinalCursor else { return }
        connectScheduled = true
        schedule(now + 0.5, .connect)
    }

    /// Control writes are separate ATT writes: each costs at least a connection interval.
    private func sendControl(_ frame: Frame) {
        let at = max(now + 0.01, lastControlDelivery + 0.0075)
        lastControlDelivery = at
        schedule(at, .peripheralGets(link: link, frame: frame))
    }

    // MARK: The peripheral

    private func peripheralReceives(_ frame: Frame, link l: Int) {
        switch frame.type {
        case .syncRequest:
            if rng.chance(config.silenceRate) { return }
            if frame.seq > storeCursor { fail("peripheral got SYNC_REQ(\(frame.seq)) above the store (\(storeCursor))") }
            if config.requestCountsAsAck {
                pAckBase = max(pAckBase, frame.seq)
                pOldest = max(pOldest, frame.seq + 1)
            }
            pNext = max(frame.seq + 1, pOldest)
            pWindow = UInt64(frame.requestedWindow ?? 0)
            pActiveLink = l
            pFirstAfterRequest = true
            requestsProcessed += 1
            kickPeripheral(link: l)
        case .syncAck:
            if frame.seq > storeCursor { fail("DURABILITY: peripheral deletes up to \(frame.seq), store has \(storeCursor)") }
            pAckBase = max(pAckBase, frame.seq)
            pOldest = max(pOldest, frame.seq + 1)
            if let a = pActiveLink, a == l { kickPeripheral(link: l) }
        case .data:
            fail("gateway sent DATA")
        }
    }

    private func kickPeripheral(link l: Int) {
        guard !pSendScheduled else { return }
        pSendScheduled = true
        schedule(now, .peripheralSend(link: l))
    }

    private func peripheralSendStep(link l: Int) {
        if rng.chance(config.pruneRate) {
            // Buffer overflow: the oldest unacknowledged events are gone for good.
            let k = UInt64.random(in: 1...5, using: &rng)
            let newOldest = min(pOldest + k, pHead + 1)
            for s in pOldest..<newOldest where s > storeCursor { genuinelyLost.insert(s) }
            pOldest = newOldest
        }
        pNext = max(pNext, pOldest)
        // The window counts from the last ack, or from just below the oldest retained event if that is higher.
        guard pNext <= pHead, pNext <= max(pAckBase, pOldest - 1) + pWindow else { return }
        let seq = pNext
        pNext += 1
        log("peripheral sends \(seq)")
        let protected = config.protectFirstAfterRequest && pFirstAfterRequest
        pFirstAfterRequest = false
        var bytes = Frame.data(seq: seq, payload: Self.payload(seq)).encoded()
        var intact = true
        if !protected && rng.chance(config.dropRate) {
            bytes = []
            intact = false
        } else if !protected && rng.chance(config.corruptRate) {
            let i = Int.random(in: 0..<bytes.count, using: &rng)
            bytes[i] ^= 1 << UInt8.random(in: 0...7, using: &rng)
            intact = false
        }
        if !protected && rng.chance(config.noiseRate) {
            bytes = rng.bytes(Int.random(in: 1...12, using: &rng)) + bytes
        }
        var chunks = randomChunks(bytes, maxChunk: config.maxChunk, using: &rng).map {
            (bytes: $0, completes: Optional<(seq: UInt64, requestCount: Int)>.none)
        }
        if intact && !chunks.isEmpty { chunks[chunks.count - 1].completes = (seq, requestsProcessed) }
        if rng.chance(config.duplicateRate) {
            chunks.append((Frame.data(seq: seq, payload: Self.payload(seq)).encoded(), (seq, requestsProcessed)))
        }
        for chunk in chunks {
            let at = max(now + Double.random(in: 0.005...0.015, using: &rng), lastDataDelivery)
            lastDataDelivery = at
            schedule(at, .deliver(link: l, bytes: chunk.bytes, completes: chunk.completes))
        }
        pSendScheduled = true
        schedule(now + 0.002, .peripheralSend(link: l))
    }

    // MARK: End-of-run checks

    /// Where the store's cursor must end. Without STREAM_INFO a loss at the very end of the log is invisible
    /// (nothing after it ever arrives to reveal the gap): the cursor ends at the newest event not lost.
    var expectedFinalCursor: UInt64 {
        if config.hasStreamInfo { return pHead }
        var last = pHead
        while last > storeCursor && genuinelyLost.contains(last) { last -= 1 }
        return last
    }

    /// Every seq 1...cursor is stored exactly once as a frame or inside exactly one gap; the cursor is final.
    func coverageProblems() -> [String] {
        var problems: [String] = []
        if storeCursor != expectedFinalCursor {
            problems.append("store cursor \(storeCursor) != expected \(expectedFinalCursor) (head \(pHead))")
        }
        var covered = [UInt64: Int]()
        for s in stored.keys { covered[s, default: 0] += 1 }
        for g in gaps { for s in g { covered[s, default: 0] += 1 } }
        for s in stride(from: UInt64(1), through: storeCursor, by: 1) where covered[s] != 1 {
            problems.append("seq \(s) covered \(covered[s] ?? 0) times")
            if problems.count > 5 { break }
        }
        let lostButNotGap = genuinelyLost.filter { s in
            s <= expectedFinalCursor && stored[s] == nil && !gaps.contains { $0.contains(s) }
        }
        if !lostButNotGap.isEmpty { problems.append("lost events not recorded as GAP: \(lostButNotGap.sorted().prefix(5))") }
        return problems
    }
}

/// Binary min-heap of scheduled events ordered by (time, insertion order): FIFO among equal times.
struct EventHeap {
    struct Item {
        var at: Double
        var order: Int
        var event: SyncWorld.Event
        func before(_ other: Item) -> Bool { (at, order) < (other.at, other.order) }
    }
    private var items: [Item] = []

    var peek: Item? { items.first }

    mutating func push(_ item: Item) {
        items.append(item)
        var i = items.count - 1
        while i > 0 {
            let parent = (i - 1) / 2
            guard items[i].before(items[parent]) else { break }
            items.swapAt(i, parent)
            i = parent
        }
    }

    mutating func pop() -> Item {
        let top = items[0]
        let last = items.removeLast()
        if !items.isEmpty {
            items[0] = last
            var i = 0
            while true {
                let l = 2 * i + 1, r = l + 1
                var m = i
                if l < items.count && items[l].before(items[m]) { m = l }
                if r < items.count && items[r].before(items[m]) { m = r }
                if m == i { break }
                items.swapAt(i, m)
                i = m
            }
        }
        return top
    }
}
