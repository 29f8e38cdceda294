import FerryProtocol
import FerryStore
import Foundation

/// Sends one batch body; `UplinkHTTPPoster` in production, anything Sendable in tests.
public protocol BatchPosting: Sendable {
    func post(body: [UInt8], idempotencyKey: String, token: BearerToken?) async -> UplinkAttempt
}

extension UplinkHTTPPoster: BatchPosting {}

public struct ForwarderConfiguration: Sendable {
    /// The `gateway` field of every body.
    public var gatewayID: String
    public var limits = ClaimLimits()
    /// Batches on the wire at once. Order upstream is not a promise; the backend dedupes by key and frame.
    public var maxInFlight = 4
    public var policy = UplinkRetryPolicy()
    /// IN_FLIGHT rows claimed longer ago than this are zombies (a forwarder that died) and go back to PENDING.
    public var lockTimeoutSeconds: Double = 300
    /// COMPLETED events and their frames are pruned this long after delivery (PROTOCOL §6: 72 h).
    public var retentionSeconds: Double = 72 * 3600
    /// How often housekeeping (zombies, pruning, incremental vacuum) runs while idle.
    public var housekeepingIntervalSeconds: Double = 60
    /// Longest sleep when nothing is due (new events are committed by another process).
    public var idlePollSeconds: Double = 1
    /// Called once per loop iteration (a batch settled or an idle poll) with the report so far: the daemon's
    /// watchdog heartbeat, `ferry forward`'s progress line.
    public var onProgress: (@Sendable (ForwardReport) -> Void)?

    public init(gatewayID: String) {
        self.gatewayID = gatewayID
    }
}

/// What a forwarder run did.
public struct ForwardReport: Sendable, Equatable {
    public var batchesDelivered = 0
    public var eventsDelivered = 0
    public var framesDelivered = 0
    public var attempts = 0
    public var retries = 0
    public var pauses = 0
    public var eventsFailed = 0
    public var bytesSent = 0
    /// Events still FAILED in the store when the run ended (this run's or older ones).
    public var failedInStore = 0
    public var pendingInStore = 0
    public init() {}
}

/// Drains the outbox to the backend (PROTOCOL §6). Owns its own connection to the store file, so it can run
/// beside a syncing session (SQLite WAL: readers never block the writer; each claim is one short write
/// transaction).
public actor OutboxForwarder {
    private let store: GatewayStore
    private let poster: any BatchPosting
    private let configuration: ForwarderConfiguration
    private let tokenSource: (@Sendable () throws -> BearerToken?)
    private let log: any LogSink
    private let wallClock: any WallClock
    private var token: BearerToken?
    private var tokenLoaded = false
    private var consecutivePauses = 0
    private var pausedUntil: Int64 = 0
    private var random = SystemRandomNumberGenerator()
    private var lastHousekeeping: Int64 = 0
    public private(set) var report = ForwardReport()

    /// `tokenSource` is called before the first request and again after every 401/403 pause (the operator
    /// may have rewritten the token file). It must never log the token.
    public init(
        databasePath: String, poster: any BatchPosting, configuration: ForwarderConfiguration,
        tokenSource: @escaping @Sendable () throws -> BearerToken? = { nil }, log: any LogSink = NullLogSink(),
        wallClock: any WallClock = SystemWallClock()
    ) throws {
        store = try GatewayStore(path: databasePath, clock: wallClock)
        self.poster = poster
        self.configuration = configuration
        self.tokenSource = tokenSource
        self.log = log
        self.wallClock = wallClock
    }

    /// Runs until cancelled, or with `untilEmpty` until no PENDING or IN_FLIGHT event remains (sleeping through
    /// backoff). Returns what it did; `failedInStore > 0` means some events are dead-lettered.
    public func run(untilEmpty: Bool) async throws -> ForwardReport {
        let released = try store.releaseInFlight(claimedBefore: nil)
        if released > 0 {
            log.log(.notice, "uplink: \(released) IN_FLIGHT events from an earlier run returned to PENDING (same batches)")
        }
        try await withThrowingTaskGroup(of: (ClaimedBatch, UplinkAttempt, Int).self) { group in
            var inFlight = 0
            while !Task.isCancelled {
                configuration.onProgress?(report)
                let now = wallClock.nowMillis()
                if now >= pausedUntil, tokenLoaded || reloadToken(now: now) {
                    while inFlight < configuration.maxInFlight, !Task.isCancelled,
                        let batch = try store.claimBatch(limits: configuration.limits, now: wallClock.nowMillis())
                    {
                        let body = try encode(batch)
                        let token = self.token
                        let poster = self.poster
                        group.addTask {
                            (batch, await poster.post(body: body, idempotencyKey: batch.id, token: token), body.count)
                        }
                        inFlight += 1
                    }
                }
                if inFlight > 0 {
                    guard let (batch, attempt, _) = try await group.next() else { break }
                    inFlight -= 1
                    try settle(batch, attempt)
                    continue
                }
                if untilEmpty, try store.undeliveredCount() == 0 { break }
                try housekeepingIfDue(now: now)
                try await sleepUntilDue(now: now)
            }
            group.cancelAll()
            // Batches still on the wire stay IN_FLIGHT; the next run (or the zombie sweep) resends them under
            // the same key, and the backend dedupes.
        }
        let counts = try store.outboxCounts()
        report.failedInStore = counts["FAILED"] ?? 0
        report.pendingInStore = (counts["PENDING"] ?? 0) + (counts["IN_FLIGHT"] ?? 0)
        return report
    }

    /// (Re-)reads the credentials. A token file that cannot be used right now (an operator rewriting it: mode
    /// 0644 before the chmod, empty before the write) must not end a forwarder that is paused waiting for
    /// exactly that operator: log why (never the token) and stay paused on the same growing schedule as a
    /// 401. Returns whether a token source answered.
    private func reloadToken(now: Int64) -> Bool {
        do {
            token = try tokenSource()
            tokenLoaded = true
            return true
        } catch {
            let policy = configuration.policy
            let after = min(policy.maxPauseSeconds, policy.basePauseSeconds * pow(2, Double(min(consecutivePauses, 62))))
            consecutivePauses += 1
            report.pauses += 1
            pausedUntil = now + Int64(after * 1000)
            log.log(.error, "uplink: paused \(String(format: "%.0f", after)) s: cannot use the token: \(error)")
            return false
        }
    }

    private func sleepUntilDue(now: Int64) async throws {
        var wait = configuration.idlePollSeconds
        if pausedUntil > now {
            wait = Double(pausedUntil - now) / 1000
        } else if let due = try store.nextDueAt(), due > now {
            wait = min(wait, Double(due - now) / 1000)
        }
        // At most 15 s at a time even through a long pause (Retry-After may say an hour): each wake is a
        // heartbeat for the daemon's watchdog, and a pause still ends on time.
        try? await Task.sleep(nanoseconds: UInt64(min(15, max(0.005, wait)) * 1e9))
    }

    /// Builds the §6 body from the claimed rows. Everything comes from stored, immutable data, so a retry of
    /// the same batch produces the same bytes.
    private func encode(_ batch: ClaimedBatch) throws -> [UInt8] {
        var events: [UplinkEvent] = []
        for event in batch.events {
            let epoch = UInt64(event.epoch) ?? 0
            let content: UplinkEvent.Content
            switch event.type {
            case "FRAMES":
                let frames = try store.frames(for: event).map {
                    UplinkFrame(
                        seq: $0.seq, payload: $0.payload,
                        receivedAt: UplinkTimestamp(millisecondsSince1970: $0.receivedAt))
                }
                content = .frames(frames)
            case "GAP":
                content = .gap(
                    firstSeq: event.firstSeq ?? 0, lastSeq: event.lastSeq ?? 0,
                    detectedAt: UplinkTimestamp(millisecondsSince1970: event.createdAt))
            default:
                let fields = Self.stringFields(of: event.payload)
                content = .regression(
                    cursor: UInt64(fields["cursor"] ?? "") ?? 0, head: UInt64(fields["head"] ?? "") ?? 0,
                    detectedAt: UplinkTimestamp(millisecondsSince1970: event.createdAt))
            }
            events.append(UplinkEvent(id: event.id, peripheral: event.peripheral, epoch: epoch, content: content))
        }
        return UplinkBodyEncoder.encode(UplinkBatchBody(gateway: configuration.gatewayID, batch: batch.id, events: events))
    }

    private static func stringFields(of json: String) -> [String: String] {
        guard let object = try? JSONSerialization.jsonObject(with: Data(json.utf8)) as? [String: Any] else { return [:] }
        return object.compactMapValues { $0 as? String }
    }

    private func settle(_ batch: ClaimedBatch, _ attempt: UplinkAttempt) throws {
        report.attempts += 1
        report.bytesSent += attempt.sentBodyBytes
        let retryCount = batch.events.map(\.retryCount).max() ?? 0
        let disposition = configuration.policy.disposition(
            after: attempt.outcome, retryCount: retryCount, consecutivePauses: consecutivePauses, random: &random)
        let now = wallClock.nowMillis()
        let frames = batch.events.reduce(0) { $0 + $1.frameCount }
        switch disposition {
        case .complete:
            consecutivePauses = 0
            try store.completeBatch(batch.id, now: now)
            report.batchesDelivered += 1
            report.eventsDelivered += batch.events.count
            report.framesDelivered += frames
            log.log(.debug, "uplink: batch \(batch.id) delivered (\(batch.events.count) events, \(frames) frames)")
        case .retry(let after, _):
            consecutivePauses = 0
            report.retries += 1
            try store.retryBatch(
                batch.id, error: "\(attempt.outcome)", nextRetryAt: now + Int64(after * 1000), countsAsRetry: true,
                maxRetries: Int(Int32.max))
            log.log(.info, "uplink: batch \(batch.id) \(attempt.outcome); retry in \(String(format: "%.1f", after)) s")
        case .pause(_, let reason) where pausedUntil > now:
            // A batch sent before the pause began got the same answer as the one that started it: that is the
            // same pause. Escalating again per batch would make the pause length depend on --max-in-flight
            // (four 401s in flight: 1+2+4+8 s → an 8 s first pause).
            report.pauses += 1
            tokenLoaded = false
            try store.retryBatch(
                batch.id, error: "\(reason)", nextRetryAt: pausedUntil, countsAsRetry: false, maxRetries: Int(Int32.max))
            log.log(.info, "uplink: batch \(batch.id) \(reason) too; already paused")
        case .pause(let after, let reason):
            consecutivePauses += 1
            report.pauses += 1
            pausedUntil = max(pausedUntil, now + Int64(after * 1000))
            tokenLoaded = false  // re-read credentials before the next attempt
            try store.retryBatch(
                batch.id, error: "\(reason)", nextRetryAt: now + Int64(after * 1000), countsAsRetry: false,
                maxRetries: Int(Int32.max))
            log.log(.warning, "uplink: paused \(String(format: "%.0f", after)) s: \(reason)")
        case .fail(let reason):
            consecutivePauses = 0
            try store.failBatch(batch.id, error: reason)
            report.eventsFailed += batch.events.count
            log.log(.error, "uplink: batch \(batch.id) FAILED (\(batch.events.count) events kept for audit): \(reason)")
        }
    }

    private func housekeepingIfDue(now: Int64) throws {
        guard Double(now - lastHousekeeping) / 1000 >= configuration.housekeepingIntervalSeconds else { return }
        lastHousekeeping = now
        let zombies = try store.releaseInFlight(claimedBefore: now - Int64(configuration.lockTimeoutSeconds * 1000))
        if zombies > 0 { log.log(.warning, "uplink: \(zombies) zombie IN_FLIGHT events returned to PENDING") }
        let pruned = try store.pruneCompleted(before: now - Int64(configuration.retentionSeconds * 1000))
        if pruned.events > 0 {
            log.log(.info, "housekeeping: pruned \(pruned.events) delivered events and \(pruned.frames) frames")
            try store.incrementalVacuum()
        }
    }
}
