import FerryProtocol
import FerrySimulator
import Foundation

/// A seeded, virtual-time world for SyncSession property tests: the simulator's peripheral (FerrySimulator:
/// its replay window, its faults, its ground truth of what it lost) on one side, and on the other a tiny owner
/// that executes the machine's actions against an in-memory store cursor with random commit delays. Everything
/// is deterministic from `Config.seed`, so a failure replays exactly.
///
/// What the world checks while it runs (each violation is appended to `failures`):
/// - THE DURABILITY RULE: every `.sendSyncAck(n)` (and every SYNC_REQ's `lastCommitted`) is ≤ the store cursor
///   the owner last reported via `commitFinished` / `cursorLoaded`; the peripheral's referee sees no violation.
/// - Every commit starts at the stored cursor, its gap (if any) starts at cursor + 1 and covers only events the
///   peripheral really lost, its frames are contiguous after the gap, its payloads are the peripheral's bytes,
///   and at most one commit is outstanding.
/// - After a timer fires, `nextDeadline` is in the future (an owner re-arming at a past deadline would spin).
/// - No action targets a link after the session reported it closed.
final class SessionWorld {
    struct Config: CustomStringConvertible {
        var seed: UInt64
        var events = 300
        var hasStreamInfo = true
        /// Events 1...initiallyLost are already gone from the peripheral before the first connection.
        var initiallyLost = 0
        /// Per frame on the air: lost / damaged (turned into the simulator's per-notification and per-byte rates).
        var dropRate = 0.0
        var corruptRate = 0.0
        var duplicateRate = 0.0
        var noiseRate = 0.0
        /// Per sent frame: the peripheral's buffer overflows and it loses 1–5 unacknowledged events.
        var pruneRate = 0.0
        /// Per frame on the air: the link drops.
        var disconnectRate = 0.0
        /// Per SYNC_REQ: the peripheral ignores it.
        var silenceRate = 0.0
        /// New events appear while the first `liveFor` seconds last.
        var liveEvents = 0
        var liveFor = 5.0
        var maxCommitDelay = 0.02
        var requestWindow = SimulatedPeripheral.RequestWindow.fromRequest
        /// Bytes per notification: 1 cuts every frame into single bytes, 517 packs many frames into one.
        var notificationSize = 64
        /// Keep transit faults off the first frame sent after each SYNC_REQ. The protocol's "the first DATA
        /// after the re-request decides" rule records a GAP when exactly that frame is lost in transit, so with
        /// this on, EVERY recorded gap must be a real loss on the peripheral.
        var protectFirstAfterRequest = true

        var description: String {
            "seed \(seed) events \(events) info \(hasStreamInfo) lost \(initiallyLost) drop \(dropRate) corrupt \(corruptRate) "
                + "dup \(duplicateRate) noise \(noiseRate) prune \(pruneRate) disc \(disconnectRate) silence \(silenceRate) "
                + "live \(liveEvents) request \(requestWindow) notification \(notificationSize) protect \(protectFirstAfterRequest)"
        }

        static func random(seed: UInt64) -> Config {
            var rng = SeededRNG(seed: seed ^ 0x5EED)
            var c = Config(seed: seed)
            c.events = Int.random(in: 1...400, using: &rng)
            c.hasStreamInfo = rng.chance(0.6)
            c.initiallyLost = rng.chance(0.2) ? Int.random(in: 1...c.events, using: &rng) : 0
            func rate(_ p: Double, _ max: Double) -> Double { rng.chance(p) ? Double.random(in: 0...max, using: &rng) : 0 }
            c.dropRate = rate(0.5, 0.08)
            c.corruptRate = rate(0.5, 0.08)
            c.duplicateRate = rate(0.3, 0.1)
            c.noiseRate = rate(0.3, 0.2)
            c.pruneRate = rate(0.25, 0.02)
            c.disconnectRate = rate(0.3, 0.01)
            c.silenceRate = rate(0.2, 0.3)
            c.liveEvents = rng.chance(0.3) ? Int.random(in: 1...100, using: &rng) : 0
            c.maxCommitDelay = [0.0, 0.005, 0.02, 0.3].randomElement(using: &rng)!
            c.requestWindow = [.fromRequest, .fromLastAck, .acknowledges].randomElement(using: &rng)!
            c.notificationSize = [1, 20, 64, 244, 517].randomElement(using: &rng)!
            c.protectFirstAfterRequest = rng.chance(0.7)
            return c
        }
    }

    enum Event {
        case connect
        /// A CONTROL write reaches the peripheral (ATT writes take a connection interval or more).
        case control(link: Int, bytes: [UInt8])
        case streamInfoReply(link: Int)
        case cursorReply(link: Int)
        case commitDone(CommitBatch)
        case liveEvent
    }

    /// Mean DATA frame on the air (payloads 16...40 bytes plus 14 of framing): per-frame rates become
    /// per-notification and per-byte ones over it.
    static let meanFrameBytes = 42.0
    /// The radio delivers one notification per tick while something is on the air, at about 32 kB/s whatever
    /// the notification size (a connection event carries several small notifications): 7.5 ms per 244 bytes.
    var notificationInterval: Double { 0.0075 * Double(config.notificationSize) / 244 }

    let config: Config
    let peripheral: SimulatedPeripheral
    var sessionConfiguration = SyncSession.Configuration()
    var rng: SeededRNG
    var now = 0.0
    private var order = 0
    private var queue = EventHeap<Event>()

    // The owner's store.
    private(set) var storeCursor: UInt64 = 0
    private(set) var stored: [UInt64: [UInt8]] = [:]
    private(set) var gaps: [ClosedRange<UInt64>] = []
    private(set) var acks: [UInt64] = []
    private(set) var failures: [String] = []
    private var commitInFlight = false

    // The gateway side.
    private(set) var session: SyncSession?
    private var transport: SimulatedTransport?
    private var link = 0
    private var linkUp = false
    private var connectScheduled = false
    /// When the radio next delivers a notification; nil while nothing can be on the air.
    private var radioTickAt: Double?
    private var lastControlDelivery = 0.0
    private var liveLeft: Int
    private(set) var sessionsStarted = 0
    private(set) var disconnectReasons: [SyncSession.DisconnectReason] = []
    private(set) var totals = SyncSession.Statistics()

    /// Gaps over events the peripheral still had because the first frame after a re-request was lost in transit
    /// (only possible when `protectFirstAfterRequest` is off).
    private(set) var spuriousGaps: [ClosedRange<UInt64>] = []
    /// Gaps over events the peripheral still had, decided by a frame sent before the peripheral saw the re-request.
    private(set) var raceGaps: [ClosedRange<UInt64>] = []
    /// SYNC_REQs the gateway sent on the current link; per seq, the first intact copy delivered since the latest
    /// SYNC_REQ and how many requests the peripheral had answered when it sent it; the gateway's count when the
    /// outstanding commit was issued, and the count of the frame that decided it.
    private var requestsSent = 0
    private var deliveredSinceRequest: [UInt64: Int] = [:]
    private var requestsAtCommit = 0
    private var decisionRequestCount: Int?
    /// Decodes what the radio delivers alongside the session, to know which frames each notification completes.
    private var observer = FrameDecoder()

    init(_ config: Config) throws {
        self.config = config
        rng = SeededRNG(seed: config.seed)
        var configuration = SimulatedPeripheral.Configuration()
        configuration.hasStreamInfo = config.hasStreamInfo
        configuration.notificationSize = config.notificationSize
        configuration.requestWindow = config.requestWindow
        // The first `initiallyLost` events are evicted by recording past the capacity (live events may evict
        // more: losses the world accounts for like any other).
        if config.initiallyLost > 0 { configuration.capacity = max(1, config.events - config.initiallyLost) }
        let perFrame = Double(config.notificationSize) / Self.meanFrameBytes
        func perNotification(_ rate: Double) -> Double { rate == 0 ? 0 : 1 - pow(1 - rate, perFrame) }
        var faults = SimulatedPeripheral.Faults()
        faults.dropNotification = perNotification(config.dropRate)
        faults.bitFlipRate = config.corruptRate == 0 ? 0 : 1 - pow(1 - config.corruptRate, 1 / Self.meanFrameBytes)
        faults.duplicateFrame = config.duplicateRate
        faults.noisePerFrame = config.noiseRate
        faults.evictPerFrame = config.pruneRate
        faults.disconnectPerNotification = perNotification(config.disconnectRate)
        faults.ignoreRequest = config.silenceRate
        faults.spareFirstFrameAfterRequest = config.protectFirstAfterRequest
        peripheral = try SimulatedPeripheral(directory: nil, configuration: configuration, faults: faults, seed: config.seed)
        try peripheral.record(count: config.events)
        liveLeft = config.liveEvents
    }

    /// The event log of the peripheral's one generation (these worlds never wipe or regress it).
    private var truth: SimulatedPeripheral.Generation { peripheral.current }
    var head: UInt64 { peripheral.head }

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

    /// Something may be on the air now: the radio delivers it from the next tick on.
    private func wakeRadio() {
        if linkUp && radioTickAt == nil { radioTickAt = now + notificationInterval }
    }

    /// Runs until everything the peripheral ever had is stored or recorded as a gap and the world is quiet.
    func run(maxVirtualSeconds: Double = 3600, maxSteps: Int = 3_000_000) async {
        schedule(0, .connect)
        connectScheduled = true
        if liveLeft > 0 { schedule(0.05, .liveEvent) }
        var steps = 0
        var timerBlockedUntilEvent = false
        while steps < maxSteps, failures.isEmpty {
            steps += 1
            let nextEvent = queue.peek?.at
            let external = [nextEvent, radioTickAt].compactMap { $0 }.min()
            if !timerBlockedUntilEvent, let deadline = session?.nextDeadline, external == nil || deadline < external! {
                now = max(now, deadline)
                let firedAt = now
                log("timerFired")
                await execute(session!.timerFired(now: now))
                if let again = session?.nextDeadline, again <= firedAt {
                    fail("nextDeadline \(again) is not after timerFired(now: \(firedAt)): an owner would spin")
                    timerBlockedUntilEvent = true
                }
                continue
            }
            guard let external else { break }
            timerBlockedUntilEvent = false
            if let tick = radioTickAt, nextEvent == nil || tick < nextEvent! {
                now = max(now, tick)
                await radioTick()
            } else {
                let item = queue.pop()
                now = max(now, item.at)
                log("\(item.event)")
                await handle(item.event)
            }
            if now > maxVirtualSeconds {
                fail("still not done after \(maxVirtualSeconds) virtual seconds (at \(external))")
                break
            }
        }
        if steps >= maxSteps { fail("step limit reached") }
        for violation in peripheral.violations.prefix(3) { fail("peripheral's referee: \(violation)") }
    }

    private func radioTick() async {
        radioTickAt = nil
        guard linkUp, let transport else { return }
        switch transport.nextDelivery() {
        case .notification(let bytes):
            log("deliver \(bytes.count)B link \(link)")
            let answered = transport.lastNotificationRequestsAnswered
            observer.feed(bytes) { frame in
                if frame.type == .data, deliveredSinceRequest[frame.seq] == nil { deliveredSinceRequest[frame.seq] = answered }
            }
            radioTickAt = now + notificationInterval
            await execute(session!.bytesReceived(bytes, now: now))
        case .idle:
            break
        case .linkLost:
            log("link lost")
            await dropLink()
        }
    }

    private func handle(_ event: Event) async {
        switch event {
        case .connect:
            connectScheduled = false
            requestsSent = 0
            link += 1
            linkUp = true
            sessionsStarted += 1
            observer = FrameDecoder()
            transport = SimulatedTransport(connectingTo: peripheral, now: now)
            var s = SyncSession(configuration: sessionConfiguration)
            let actions = s.connected(hasStreamInfo: config.hasStreamInfo, now: now)
            session = s
            await execute(actions)
        case .control(let l, let bytes):
            guard linkUp, l == link, let transport else { return }
            // The peripheral may have dropped the link meanwhile: the radio's next tick reports it.
            try? await transport.writeControl(bytes)
            wakeRadio()
        case .streamInfoReply(let l):
            guard linkUp, l == link else { return }
            await execute(session!.streamInfoRead(peripheral.streamInfo.encoded(), now: now))
        case .cursorReply(let l):
            guard linkUp, l == link else { return }
            await execute(session!.cursorLoaded(storeCursor, now: now))
        case .commitDone(let batch):
            apply(batch)
            commitInFlight = false
            await execute(session!.commitFinished(cursor: storeCursor, now: now))
            maybeReconnect()
        case .liveEvent:
            guard liveLeft > 0 else { return }
            liveLeft -= 1
            do { try peripheral.record(count: 1) } catch { fail("record: \(error)") }
            wakeRadio()
            if liveLeft > 0 { schedule(now + config.liveFor / Double(config.liveEvents), .liveEvent) }
            maybeReconnect()
        }
    }

    // MARK: The owner

    private func execute(_ actions: [SyncAction]) async {
        for action in actions {
            log("  -> \(action)")
            switch action {
            case .readStreamInfo:
                if !linkUp { fail("readStreamInfo on a dead link") }
                schedule(now + 0.005, .streamInfoReply(link: link))
            case .loadCursor(let e):
                if e != peripheral.reportedEpoch { fail("loadCursor(epoch: \(e)) but the peripheral reports \(peripheral.reportedEpoch)") }
                schedule(now + 0.001, .cursorReply(link: link))
            case .subscribe:
                if let transport, linkUp { try? await transport.subscribe() }
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
                radioTickAt = nil
                await transport?.disconnect()
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
            let notLost = gap.filter { !truth.isLost($0) }
            if !notLost.isEmpty {
                // The frame that decided "the replay skipped again" was sent before the peripheral had
                // answered our latest SYNC_REQ (a live event, an ignored SYNC_REQ, the old window still in
                // flight): the race that the "first DATA after the re-request decides" rule (PROTOCOL §4.5)
                // cannot see.
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
            if frame.payload != truth.payload(of: frame.seq) { fail("frame \(frame.seq) committed with damaged payload") }
            if stored[frame.seq] != nil { fail("frame \(frame.seq) committed twice") }
            stored[frame.seq] = frame.payload
            next = frame.seq + 1
        }
        let expected = next - 1
        if batch.newCursor != expected { fail("batch newCursor \(batch.newCursor), contents end at \(expected)") }
        storeCursor = batch.newCursor
    }

    private func dropLink() async {
        linkUp = false
        radioTickAt = nil
        await execute(session!.disconnected(now: now))
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
        schedule(at, .control(link: link, bytes: frame.encoded()))
    }

    // MARK: End-of-run checks

    /// Where the store's cursor must end. Without STREAM_INFO a loss at the very end of the log is invisible
    /// (nothing after it ever arrives to reveal the gap): the cursor ends at the newest event not lost.
    var expectedFinalCursor: UInt64 {
        if config.hasStreamInfo { return head }
        var last = head
        while last > storeCursor && truth.isLost(last) { last -= 1 }
        return last
    }

    /// Every seq 1...cursor is stored exactly once as a frame or inside exactly one gap; the cursor is final.
    func coverageProblems() -> [String] {
        var problems: [String] = []
        if storeCursor != expectedFinalCursor {
            problems.append("store cursor \(storeCursor) != expected \(expectedFinalCursor) (head \(head))")
        }
        var covered = [UInt64: Int]()
        for s in stored.keys { covered[s, default: 0] += 1 }
        for g in gaps { for s in g { covered[s, default: 0] += 1 } }
        for s in stride(from: UInt64(1), through: storeCursor, by: 1) where covered[s] != 1 {
            problems.append("seq \(s) covered \(covered[s] ?? 0) times")
            if problems.count > 5 { break }
        }
        let lostButNotGap = truth.lost.flatMap { $0 }.filter { s in
            s <= expectedFinalCursor && stored[s] == nil && !gaps.contains { $0.contains(s) }
        }
        if !lostButNotGap.isEmpty { problems.append("lost events not recorded as GAP: \(lostButNotGap.prefix(5))") }
        return problems
    }
}

/// Binary min-heap of scheduled events ordered by (time, insertion order): FIFO among equal times.
struct EventHeap<Event> {
    struct Item {
        var at: Double
        var order: Int
        var event: Event
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
