import FerryCore
import FerryProtocol
import FoundationEssentials
import Glibc

/// An in-process Sync peripheral (PROTOCOL §1–4) with a persistent event store, a misbehaving radio, and
/// a referee's notebook.
///
/// - Events get a strictly increasing seq (first = 1) in the current *generation*: a generation starts
///   when the store is created, wiped (new random epoch) or when the counter regresses (same epoch, seq
///   restarts low). Every event ever generated is kept in `generations` as the ground truth tests compare
///   the gateway's store against; the *retained* events are a contiguous seq range `oldest...head` of the
///   current generation.
/// - State lives in an append-only journal under `directory`: a new `SimulatedPeripheral` on the same
///   directory is the same device after a reboot.
/// - While linked it answers SYNC_REQ by replaying retained events, never more than `window` frames beyond
///   the last ACK, deletes on SYNC_ACK, and packs frames into notifications of `notificationSize` bytes
///   (a frame may span notifications, a notification may carry several frames).
/// - Faults (`faults`) come from a seeded generator: the same seed gives the same run.
/// - It checks the gateway: every CONTROL write that breaks the protocol is a `Violation`.
public final class SimulatedPeripheral {
    public struct Configuration: Sendable, Equatable {
        /// Whether the Sync service exposes STREAM_INFO. Without it the gateway sees epoch 0.
        public var hasStreamInfo = true
        /// Bytes per DATA notification (ATT MTU − 3): 20 for the default MTU, 244 or 514 after an exchange.
        public var notificationSize = 244
        /// Retained-event limit: recording past it evicts the oldest retained event, which is then lost
        /// unless the gateway already had it. nil: unbounded.
        public var capacity: Int?
        /// Payload length of generated events; at least `SimulatedPeripheral.identityLength`.
        public var payloadSize: ClosedRange<Int> = 16...40
        /// While linked, a new (live) event every this many simulated seconds. nil: no live events.
        public var liveEventInterval: Double?
        /// A firmware that honours at most this window whatever the SYNC_REQ asks (a fixed buffer of
        /// unacknowledged frames). nil: the requested window.
        public var maxWindow: Int?
        /// A rogue (or buggy) firmware that sends this many frames past the window it was given.
        public var sendsPastWindow = 0
        /// false: an acknowledged payload is released (`Generation.forgotten`), so a long replay (benchmarks)
        /// holds only what is unacknowledged. Tests keep them all, as the ground truth they check against.
        public var keepsAcknowledgedPayloads = true
        /// Where the window of a SYNC_REQ(n) counts from: firmwares differ, and a gateway must cope with each.
        public var requestWindow = RequestWindow.fromRequest

        public init() {}
    }

    /// How a peripheral reads SYNC_REQ(n)'s `n` (PROTOCOL §4 lets it count the window from n; some firmware
    /// counts from its last SYNC_ACK only, some treat the request as an acknowledgement and delete up to n).
    public enum RequestWindow: Sendable, Equatable {
        /// The window counts from n (nothing is deleted).
        case fromRequest
        /// The window counts from the last SYNC_ACK: after a re-request above it, fewer frames come.
        case fromLastAck
        /// n is acknowledged: events up to it are deleted and the window counts from it.
        case acknowledges
    }

    /// Fault knobs. Rates are probabilities per notification, per frame or per byte as named.
    public struct Faults: Sendable, Equatable {
        /// Per byte on the air: flip one random bit.
        public var bitFlipRate = 0.0
        /// Per notification: lost on the air.
        public var dropNotification = 0.0
        /// Per DATA frame: sent twice in a row.
        public var duplicateFrame = 0.0
        /// Per notification: the peripheral drops the link just before sending it; everything still queued
        /// is lost with it.
        public var disconnectPerNotification = 0.0
        /// Per notification: the device wipes its store (new epoch) and reboots, dropping the link.
        public var epochResetPerNotification = 0.0
        /// Per notification: the counter restarts at 1 on the same epoch (a firmware bug), dropping the link.
        public var regressionPerNotification = 0.0
        /// Per SYNC_REQ: ignored (no answer at all).
        public var ignoreRequest = 0.0
        /// Per DATA frame: a header announcing a payload above any sane cap is sent in front of it.
        public var oversizeHeaderPerFrame = 0.0
        /// Per DATA frame: a valid frame of an unknown type (0x7E) is sent in front of it.
        public var unknownTypePerFrame = 0.0
        /// Per DATA frame: 1–8 random bytes are sent in front of it.
        public var noisePerFrame = 0.0
        /// Once per peripheral: after this many DATA frames on one link the firmware stalls with the link up —
        /// nothing new is sent, and each SYNC_REQ is answered with one stale duplicate (the requested cursor's
        /// own frame). The field fault of issue 12. nil: never.
        public var stallAfterFrames: Int?
        /// Per DATA frame about to go on the air: the device's buffer overflows and its 1–5 oldest retained
        /// events are evicted (lost unless the gateway already has them): losses in the middle of a replay.
        public var evictPerFrame = 0.0
        /// The first DATA frame after each answered SYNC_REQ goes on the air clean (no junk before it, its
        /// notifications neither dropped nor flipped). PROTOCOL §4.5 decides "the replay skipped again" on that
        /// frame, so a transit loss of exactly it is recorded as a GAP; with this on, every GAP a gateway records
        /// must be a real loss on the device (`Generation.lost`), which property tests can then demand.
        public var spareFirstFrameAfterRequest = false

        public init() {}
        public static let none = Faults()
    }

    public enum GenerationCause: UInt8, Sendable {
        case created = 0
        case epochReset = 1
        case counterRegression = 2
    }

    /// Every event one incarnation of the counter produced, and what became of it.
    public struct Generation: Sendable {
        public let index: Int
        public let epoch: UInt64
        public let cause: GenerationCause
        public let firstSeq: UInt64
        /// Payloads of `firstSeq + forgotten`, `firstSeq + forgotten + 1`, ...
        public internal(set) var payloads: [[UInt8]] = []
        /// How many payloads from `firstSeq` on were released once acknowledged (0 unless
        /// `Configuration.keepsAcknowledgedPayloads` is false).
        public internal(set) var forgotten = 0
        /// Highest SYNC_ACK received in this generation.
        public internal(set) var acknowledgedUpTo: UInt64 = 0
        /// Highest seq ever put on the air in this generation.
        public internal(set) var highestSent: UInt64 = 0
        /// Seqs removed from the store without an ACK covering them (evicted, wiped, regressed away). The
        /// gateway may still hold some of them: committed, but the ACK never arrived.
        public internal(set) var lost: [ClosedRange<UInt64>] = []

        /// Highest seq assigned (firstSeq − 1 if none).
        public var head: UInt64 { firstSeq - 1 + UInt64(forgotten + payloads.count) }
        public var seqs: ClosedRange<UInt64>? { head < firstSeq ? nil : firstSeq...head }

        public func payload(of seq: UInt64) -> [UInt8]? {
            guard seq >= firstSeq + UInt64(forgotten), seq <= head else { return nil }
            return payloads[Int(seq - firstSeq) - forgotten]
        }

        public func isLost(_ seq: UInt64) -> Bool {
            lost.contains { $0.contains(seq) }
        }
    }

    /// A CONTROL write that breaks PROTOCOL §2–4.
    public struct Violation: Sendable, CustomStringConvertible {
        public enum Kind: String, Sendable {
            /// Not exactly one well-formed SYNC_REQ (2-byte window > 0) or SYNC_ACK (empty payload).
            case malformedControl
            /// SYNC_ACK above every seq ever sent or lost: acknowledges something the gateway cannot have.
            case ackAboveSent
            /// SYNC_ACK below an earlier one: the gateway forgot what it had durably committed.
            case ackBelowAcknowledged
            /// SYNC_REQ for a seq above head, although STREAM_INFO told the gateway the head.
            case requestBeyondHead
            /// SYNC_REQ below an earlier ACK: the gateway lost committed data.
            case requestBelowAcknowledged
        }

        public var kind: Kind
        public var detail: String
        public var description: String { "\(kind.rawValue): \(detail)" }
    }

    public struct Statistics: Sendable, Equatable {
        public var eventsRecorded = 0
        public var framesSent = 0
        public var notificationsSent = 0
        public var notificationsDropped = 0
        public var bitsFlipped = 0
        public var duplicatesSent = 0
        public var junkInjected = 0
        /// Links the peripheral dropped (fault, wipe, regression).
        public var linksDropped = 0
        public var requestsReceived = 0
        public var requestsIgnored = 0
        public var acksReceived = 0
        public var evicted = 0
        /// Writes a gateway could not have known were stale (no STREAM_INFO after a wipe or regression).
        public var staleControl = 0
        /// SYNC_REQs answered by a stalled link with one stale duplicate.
        public var staleAnswers = 0
        /// Most DATA frames ever on the air beyond the last ACK (or SYNC_REQ) of a link: above the ACK cadence
        /// only when the gateway pipelines (window > cadence) and the peripheral lets it.
        public var maxFramesBeyondAck = 0
    }

    /// Bytes at the start of every generated payload: generation (UInt32 BE) and seq (UInt64 BE), so a
    /// stored frame names the event it claims to be.
    public static let identityLength = 12

    public let configuration: Configuration
    public var faults: Faults
    public private(set) var generations: [Generation] = []
    public private(set) var statistics = Statistics()
    public private(set) var violations: [Violation] = []
    /// Oldest retained seq of the current generation; above `head` when nothing is retained.
    public private(set) var firstRetained: UInt64 = 1

    private var random: SeededGenerator
    private let journal: Journal?
    private var link: Link?
    private var nextLinkID = 1
    /// `faults.stallAfterFrames` fired already (it is a once-per-peripheral fault).
    private var stallUsed = false
    private var bytesUntilBitFlip: Int

    /// Opens the device whose journal is in `directory` (created if absent), or an unjournalled one for
    /// `directory == nil`. A new device draws its epoch from `seed`.
    public init(
        directory: URL?, configuration: Configuration = Configuration(), faults: Faults = .none, seed: UInt64
    ) throws(SimulatorError) {
        precondition(configuration.payloadSize.lowerBound >= Self.identityLength, "payload too short for identity")
        precondition(configuration.notificationSize > 0, "notifications carry at least one byte")
        self.configuration = configuration
        self.faults = faults
        random = SeededGenerator(seed: seed)
        bytesUntilBitFlip = 0
        if let directory {
            let journal = try Journal(directory: directory)
            self.journal = journal
            for record in try journal.load() { apply(record) }
        } else {
            journal = nil
        }
        bytesUntilBitFlip = random.bytesUntilNextHit(rate: faults.bitFlipRate)
        if generations.isEmpty {
            try commit(.generation(cause: .created, epoch: freshEpoch(), firstSeq: 1))
        }
    }

    // MARK: - The device's own state

    public var current: Generation { generations[generations.count - 1] }
    public var epoch: UInt64 { current.epoch }
    public var head: UInt64 { current.head }
    public var retainedCount: Int { firstRetained > head ? 0 : Int(head - firstRetained + 1) }

    /// What STREAM_INFO reads now.
    public var streamInfo: StreamInfo {
        StreamInfo(epoch: current.epoch, oldest: retainedCount == 0 ? 0 : firstRetained, head: head)
    }

    /// The epoch the gateway sees: 0 without STREAM_INFO.
    public var reportedEpoch: UInt64 { configuration.hasStreamInfo ? current.epoch : 0 }

    /// Records `count` new events (offline backlog, or live while linked: they are sent if the window allows).
    public func record(count: Int) throws(SimulatorError) {
        for _ in 0..<count {
            try recordOne()
        }
        pump()
    }

    /// The device's storage is wiped: new random epoch, seq restarts at 1, unacknowledged events are lost.
    /// A wipe is a reboot, so the link drops.
    public func resetEpoch() throws(SimulatorError) {
        try commit(.generation(cause: .epochReset, epoch: freshEpoch(), firstSeq: 1))
        dropLink()
    }

    /// Same epoch, but the counter restarts at `restartAt` (a firmware bug that lost its counter). Retained
    /// events are lost with it; the link drops (the firmware rebooted).
    public func regressCounter(restartAt: UInt64 = 1) throws(SimulatorError) {
        precondition(restartAt >= 1, "seq starts at 1")
        try commit(.generation(cause: .counterRegression, epoch: current.epoch, firstSeq: restartAt))
        dropLink()
    }

    // MARK: - The link (used by SimulatedTransport)

    /// A central connects; any previous link is replaced. Returns the link's id.
    func connect(now: Double) -> Int {
        let id = nextLinkID
        nextLinkID += 1
        link = Link(id: id, liveEventAt: configuration.liveEventInterval.map { now + $0 })
        return id
    }

    func isLinked(_ id: Int) -> Bool { link?.id == id }

    func disconnect(_ id: Int) {
        if link?.id == id { link = nil }
    }

    func subscribe(_ id: Int) {
        guard let link, link.id == id else { return }
        link.subscribed = true
        pump()
    }

    func nextLiveEventAt(_ id: Int) -> Double? {
        guard let link, link.id == id else { return nil }
        return link.liveEventAt
    }

    /// A live event falls due at `now`.
    func liveEventDue(_ id: Int, now: Double) {
        guard let link, link.id == id, let at = link.liveEventAt, let interval = configuration.liveEventInterval
        else { return }
        guard now >= at else { return }
        link.liveEventAt = at + interval
        mustSucceed { () throws(SimulatorError) in try recordOne() }
        pump()
    }

    enum Delivery {
        /// `requestsAnswered`: how many SYNC_REQs the device had answered on this link when it put these bytes
        /// on the air (fewer than the gateway sent: the bytes belong to an older replay).
        case notification([UInt8], requestsAnswered: Int)
        case linkLost
        case idle
    }

    /// The next notification on the air for link `id`, after the link's faults have had their say.
    func nextNotification(_ id: Int) -> Delivery {
        while true {
            guard let link, link.id == id else { return .linkLost }
            guard let (bytes, requestsAnswered, spared) = link.popNotification() else { return .idle }
            if random.chance(faults.disconnectPerNotification) {
                dropLink()
                return .linkLost
            }
            if random.chance(faults.epochResetPerNotification) {
                mustSucceed { () throws(SimulatorError) in try resetEpoch() }
                return .linkLost
            }
            if random.chance(faults.regressionPerNotification) {
                mustSucceed { () throws(SimulatorError) in try regressCounter() }
                return .linkLost
            }
            if !spared && random.chance(faults.dropNotification) {
                statistics.notificationsDropped += 1
                continue
            }
            statistics.notificationsSent += 1
            var air = bytes
            if !spared { flipBits(&air) }
            return .notification(air, requestsAnswered: requestsAnswered)
        }
    }

    /// One CONTROL write from the gateway on link `id`.
    func controlWritten(_ bytes: [UInt8], link id: Int) {
        guard let link, link.id == id else { return }
        guard let frame = Self.parseControl(bytes) else {
            violations.append(Violation(kind: .malformedControl, detail: hex(bytes)))
            return
        }
        // After a wipe or regression the gateway cannot know without STREAM_INFO: not its fault.
        let gatewayCanKnow = configuration.hasStreamInfo || current.cause == .created
        switch frame.type {
        case .syncRequest:
            statistics.requestsReceived += 1
            let window = frame.requestedWindow ?? 0
            if frame.seq > head || frame.seq < current.acknowledgedUpTo {
                if !gatewayCanKnow {
                    statistics.staleControl += 1
                } else if frame.seq > head {
                    violations.append(
                        Violation(kind: .requestBeyondHead, detail: "SYNC_REQ(\(frame.seq)) but head is \(head)"))
                } else {
                    violations.append(
                        Violation(
                            kind: .requestBelowAcknowledged,
                            detail: "SYNC_REQ(\(frame.seq)) after SYNC_ACK(\(current.acknowledgedUpTo))"))
                }
            }
            if random.chance(faults.ignoreRequest) {
                statistics.requestsIgnored += 1
                return
            }
            if link.stalled {
                if let payload = current.payload(of: frame.seq) {
                    statistics.staleAnswers += 1
                    link.queue(Frame.data(seq: frame.seq, payload: payload).encoded())
                }
                return
            }
            link.streaming = true
            link.window = min(Int(window), configuration.maxWindow ?? Int.max)
            switch configuration.requestWindow {
            case .fromRequest:
                link.ackBase = frame.seq
            case .fromLastAck:
                link.ackBase = current.acknowledgedUpTo
            case .acknowledges:
                link.ackBase = frame.seq
                if frame.seq > current.acknowledgedUpTo && frame.seq <= head {
                    mustSucceed { () throws(SimulatorError) in try commit(.ack(frame.seq)) }
                }
            }
            link.nextSeq = frame.seq &+ 1
            link.requestsAnswered += 1
            link.spareNextFrame = faults.spareFirstFrameAfterRequest
            // Notifications already queued stay on the air: PROTOCOL §4's "rest of the old window is still
            // in flight" after a re-request is exactly what a gateway must survive.
            pump()
        case .syncAck:
            statistics.acksReceived += 1
            let ceiling = max(current.highestSent, current.lost.last?.upperBound ?? 0)
            if frame.seq > ceiling || frame.seq < current.acknowledgedUpTo {
                if !gatewayCanKnow {
                    statistics.staleControl += 1
                    return
                } else if frame.seq > ceiling {
                    violations.append(
                        Violation(
                            kind: .ackAboveSent,
                            detail: "SYNC_ACK(\(frame.seq)) but nothing above \(ceiling) was sent or lost"))
                    return
                } else {
                    violations.append(
                        Violation(
                            kind: .ackBelowAcknowledged,
                            detail: "SYNC_ACK(\(frame.seq)) after SYNC_ACK(\(current.acknowledgedUpTo))"))
                }
            }
            if frame.seq > current.acknowledgedUpTo {
                mustSucceed { () throws(SimulatorError) in try commit(.ack(frame.seq)) }
            }
            link.ackBase = max(link.ackBase, frame.seq)
            link.nextSeq = max(link.nextSeq, frame.seq &+ 1)
            pump()
        case .data:
            violations.append(Violation(kind: .malformedControl, detail: "DATA frame written to CONTROL"))
        }
    }

    /// One frame, exactly, well-formed for its type; nil otherwise.
    static func parseControl(_ bytes: [UInt8]) -> Frame? {
        var decoder = FrameDecoder()
        var frames: [Frame] = []
        decoder.feed(bytes) { frames.append($0) }
        guard frames.count == 1, let frame = frames.first, frame.encoded() == bytes else { return nil }
        switch frame.type {
        case .syncRequest:
            guard let window = frame.requestedWindow, window > 0 else { return nil }
        case .syncAck:
            guard frame.payload.isEmpty else { return nil }
        case .data:
            break
        }
        return frame
    }

    // MARK: - Captures

    /// The bytes a subscribed central would receive for a replay of every retained event from the oldest,
    /// as one DATA stream with `faults`' frame-level junk and air-level drops and bit flips (the
    /// link-dropping faults do not apply to a capture). For `ferry ingest` demos and benchmarks.
    public func captureBytes(faults captureFaults: Faults) -> [UInt8] {
        let saved = faults
        faults = captureFaults
        defer { faults = saved }
        var capture: [UInt8] = []
        guard retainedCount > 0 else { return capture }
        var burst: [UInt8] = []
        for seq in firstRetained...head {
            appendDataFrame(seq: seq, to: &burst)
        }
        var offset = 0
        while offset < burst.count {
            let end = min(offset + configuration.notificationSize, burst.count)
            if random.chance(faults.dropNotification) {
                statistics.notificationsDropped += 1
            } else {
                var chunk = Array(burst[offset..<end])
                flipBits(&chunk)
                capture += chunk
            }
            offset = end
        }
        return capture
    }

    /// Writes `captureBytes(faults:)` to `path`.
    public func writeCapture(to path: String, faults captureFaults: Faults) throws(SimulatorError) {
        let bytes = captureBytes(faults: captureFaults)
        if let code = writeFile(path, bytes) {
            throw .io("cannot write capture \(path): \(errnoDescription(code))")
        }
    }

    // MARK: - Internals

    private func freshEpoch() -> UInt64 {
        var epoch: UInt64
        repeat { epoch = random.next() } while epoch == 0 || generations.contains { $0.epoch == epoch }
        return epoch
    }

    private func recordOne() throws(SimulatorError) {
        if let capacity = configuration.capacity, retainedCount >= capacity {
            try commit(.evict(1))
        }
        let size = Int.random(in: configuration.payloadSize, using: &random)
        var payload: [UInt8] = []
        payload.reserveCapacity(size)
        let generation = UInt32(truncatingIfNeeded: current.index)
        let seq = head + 1
        for shift in stride(from: 24, through: 0, by: -8) { payload.append(UInt8(truncatingIfNeeded: generation >> shift)) }
        for shift in stride(from: 56, through: 0, by: -8) { payload.append(UInt8(truncatingIfNeeded: seq >> shift)) }
        while payload.count < size { payload.append(UInt8.random(in: 0...255, using: &random)) }
        try commit(.event(payload))
    }

    /// The (generation, seq) a generated payload names, if it is one.
    public static func identity(of payload: [UInt8]) -> (generation: Int, seq: UInt64)? {
        guard payload.count >= identityLength else { return nil }
        var generation: UInt32 = 0
        var seq: UInt64 = 0
        for i in 0..<4 { generation = generation << 8 | UInt32(payload[i]) }
        for i in 4..<12 { seq = seq << 8 | UInt64(payload[i]) }
        return (Int(generation), seq)
    }

    /// Sends what the window allows on the current link.
    private func pump() {
        guard let link, link.subscribed, link.streaming, !link.stalled else { return }
        var burst: [UInt8] = []
        var spared: Range<Int>?
        var highest: UInt64 = 0
        while link.nextSeq <= head {
            if link.nextSeq < firstRetained {
                link.nextSeq = firstRetained  // evicted meanwhile: the replay continues at the oldest
                continue
            }
            let base = max(link.ackBase, firstRetained - 1)
            guard link.nextSeq - base <= UInt64(link.window + configuration.sendsPastWindow) else { break }
            if random.chance(faults.evictPerFrame) {
                let count = UInt32.random(in: 1...5, using: &random)
                mustSucceed { () throws(SimulatorError) in try commit(.evict(count)) }
                continue  // the window and the next seq are looked at again
            }
            if link.spareNextFrame {
                link.spareNextFrame = false
                let start = burst.count
                appendDataFrame(seq: link.nextSeq, to: &burst, clean: true)
                spared = start..<burst.count
            } else {
                appendDataFrame(seq: link.nextSeq, to: &burst)
            }
            statistics.maxFramesBeyondAck = max(statistics.maxFramesBeyondAck, Int(link.nextSeq - base))
            highest = link.nextSeq
            link.nextSeq += 1
            link.framesSent += 1
            if let stallAfter = faults.stallAfterFrames, !stallUsed, link.framesSent >= stallAfter {
                stallUsed = true
                link.stalled = true
                break
            }
        }
        guard !burst.isEmpty else { return }
        if highest > current.highestSent {
            mustSucceed { () throws(SimulatorError) in try commit(.sent(highest)) }
        }
        var offset = 0
        while offset < burst.count {
            let end = min(offset + configuration.notificationSize, burst.count)
            link.queue(Array(burst[offset..<end]), spared: spared?.overlaps(offset..<end) ?? false)
            offset = end
        }
    }

    /// `clean`: no junk in front of the frame (`Faults.spareFirstFrameAfterRequest`).
    private func appendDataFrame(seq: UInt64, to bytes: inout [UInt8], clean: Bool = false) {
        if !clean { appendJunk(to: &bytes) }
        let frame = Frame.data(seq: seq, payload: current.payloads[Int(seq - current.firstSeq) - current.forgotten]).encoded()
        bytes += frame
        statistics.framesSent += 1
        if random.chance(faults.duplicateFrame) {
            bytes += frame
            statistics.duplicatesSent += 1
        }
    }

    private func appendJunk(to bytes: inout [UInt8]) {
        if random.chance(faults.noisePerFrame) {
            let count = Int.random(in: 1...8, using: &random)
            for _ in 0..<count { bytes.append(UInt8.random(in: 0...255, using: &random)) }
            statistics.junkInjected += 1
        }
        if random.chance(faults.oversizeHeaderPerFrame) {
            // A DATA header whose length no gateway should buffer for: the decoder must drop one byte and go on.
            bytes += [Frame.magic, FrameType.data.rawValue]
            for _ in 0..<8 { bytes.append(UInt8.random(in: 0...255, using: &random)) }
            let length = UInt16.random(in: 0x1001...0xFFFF, using: &random)
            bytes += [UInt8(length >> 8), UInt8(length & 0xFF)]
            statistics.junkInjected += 1
        }
        if random.chance(faults.unknownTypePerFrame) {
            var unknown: [UInt8] = [Frame.magic, 0x7E]
            for _ in 0..<8 { unknown.append(UInt8.random(in: 0...255, using: &random)) }
            unknown += [0, 4, 1, 2, 3, 4]
            let crc = CRC16.checksum(unknown)
            unknown += [UInt8(crc >> 8), UInt8(crc & 0xFF)]
            bytes += unknown
            statistics.junkInjected += 1
        }
    }

    private func flipBits(_ bytes: inout [UInt8]) {
        var position = 0
        while bytesUntilBitFlip < bytes.count - position {
            position += bytesUntilBitFlip
            bytes[position] ^= 1 << UInt8.random(in: 0...7, using: &random)
            statistics.bitsFlipped += 1
            position += 1
            bytesUntilBitFlip = random.bytesUntilNextHit(rate: faults.bitFlipRate)
        }
        if bytesUntilBitFlip != Int.max { bytesUntilBitFlip -= bytes.count - position }
    }

    private func dropLink() {
        if link != nil { statistics.linksDropped += 1 }
        link = nil
    }

    /// Journals `record` and applies it: the journal is written before the state changes, as flash would be.
    private func commit(_ record: JournalRecord) throws(SimulatorError) {
        try journal?.append(record)
        apply(record)
    }

    /// The only place state changes, both live and when replaying the journal.
    private func apply(_ record: JournalRecord) {
        switch record {
        case .generation(let cause, let epoch, let firstSeq):
            if !generations.isEmpty && retainedCount > 0 {
                markLost(firstRetained...head)
            }
            generations.append(Generation(index: generations.count, epoch: epoch, cause: cause, firstSeq: firstSeq))
            firstRetained = firstSeq
        case .event(let payload):
            generations[generations.count - 1].payloads.append(payload)
            statistics.eventsRecorded += 1
        case .ack(let seq):
            generations[generations.count - 1].acknowledgedUpTo = max(current.acknowledgedUpTo, seq)
            if seq >= firstRetained {
                firstRetained = min(seq, head) + 1
            }
            if !configuration.keepsAcknowledgedPayloads {
                let index = generations.count - 1
                let release = Int(firstRetained - generations[index].firstSeq) - generations[index].forgotten
                if release > 0 {
                    generations[index].payloads.removeFirst(release)
                    generations[index].forgotten += release
                }
            }
        case .evict(let count):
            let evicted = min(UInt64(count), UInt64(retainedCount))
            guard evicted > 0 else { return }
            markLost(firstRetained...(firstRetained + evicted - 1))
            firstRetained += evicted
            statistics.evicted += Int(evicted)
        case .sent(let seq):
            generations[generations.count - 1].highestSent = max(current.highestSent, seq)
        }
    }

    private func markLost(_ range: ClosedRange<UInt64>) {
        let index = generations.count - 1
        if let last = generations[index].lost.last, last.upperBound &+ 1 == range.lowerBound {
            generations[index].lost[generations[index].lost.count - 1] = last.lowerBound...range.upperBound
        } else {
            generations[index].lost.append(range)
        }
    }

    /// Journal writes on the link path cannot be reported to the gateway (it is the device's flash, not the
    /// protocol): a test machine that cannot write its temp directory stops loudly.
    private func mustSucceed(_ body: () throws(SimulatorError) -> Void) {
        do {
            try body()
        } catch {
            preconditionFailure("simulated peripheral: \(error)")
        }
    }

    private func hex(_ bytes: [UInt8]) -> String {
        bytes.map { String($0, radix: 16).count == 1 ? "0" + String($0, radix: 16) : String($0, radix: 16) }
            .joined()
    }
}

/// Per-connection state of the peripheral: the replay position and the notifications on the air.
final class Link {
    let id: Int
    var subscribed = false
    /// A SYNC_REQ has been received on this link (nothing is sent before).
    var streaming = false
    var window = Int(Frame.defaultWindow)
    /// Last ACK (or the SYNC_REQ's seq): the window counts frames beyond it.
    var ackBase: UInt64 = 0
    var nextSeq: UInt64 = 1
    var liveEventAt: Double?
    /// DATA frames put on the air on this link.
    var framesSent = 0
    /// `Faults.stallAfterFrames` hit on this link: nothing new is sent any more.
    var stalled = false
    /// SYNC_REQs answered on this link (not ignored, not stalled).
    var requestsAnswered = 0
    /// `Faults.spareFirstFrameAfterRequest`: the next DATA frame goes on the air clean.
    var spareNextFrame = false
    private var notifications: [(bytes: [UInt8], requestsAnswered: Int, spared: Bool)] = []
    private var nextIndex = 0

    init(id: Int, liveEventAt: Double?) {
        self.id = id
        self.liveEventAt = liveEventAt
    }

    /// `spared`: carries a byte of a frame `Faults.spareFirstFrameAfterRequest` keeps clean.
    func queue(_ bytes: [UInt8], spared: Bool = false) {
        notifications.append((bytes, requestsAnswered, spared))
    }

    func popNotification() -> (bytes: [UInt8], requestsAnswered: Int, spared: Bool)? {
        guard nextIndex < notifications.count else {
            notifications.removeAll(keepingCapacity: true)
            nextIndex = 0
            return nil
        }
        let bytes = notifications[nextIndex]
        nextIndex += 1
        return bytes
    }
}
