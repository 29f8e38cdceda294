import FerryCore
import FerryProtocol
import FerryStore
import FoundationEssentials
import Glibc

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
    /// The store's forwarder lease lasts this long without renewal (renewed every quarter of it). A second
    /// forwarder on the same store refuses while the holder lives; IN_FLIGHT rows go back to PENDING only when
    /// their owner is gone. Longer than a request may take, so a slow request never outlives it.
    public var leaseSeconds: Double = 120
    /// COMPLETED events and their frames are pruned this long after delivery (PROTOCOL §6: 72 h).
    public var retentionSeconds: Double = 72 * 3600
    /// How often housekeeping (pruning, incremental vacuum) runs while idle.
    public var housekeepingIntervalSeconds: Double = 60
    /// Longest sleep when nothing is due and nobody signals `newEvents` (new events are committed by another
    /// process: `ferry forward` beside `ferry sync`).
    public var idlePollSeconds: Double = 1
    /// Signalled by whoever commits events in this process (the daemon's sessions, per commit). When set, an
    /// idle forwarder sleeps until it is signalled, a retry is due or the heartbeat below comes, instead of
    /// polling the store every `idlePollSeconds`: an idle daemon does no store reads.
    public var newEvents: Wakeup?
    /// The longest sleep of all, even through a long pause (Retry-After may say an hour): each wake is a
    /// heartbeat for the daemon's watchdog (which allows 120 s). With `newEvents`, also the idle sleep, and so
    /// the latency for events another process commits.
    public var heartbeatSeconds: Double = 15
    /// Called once per loop iteration (a batch settled or an idle poll) with the report so far: the daemon's
    /// watchdog heartbeat, `ferry forward`'s progress line.
    public var onProgress: (@Sendable (ForwardReport) -> Void)?

    public init(gatewayID: String) {
        self.gatewayID = gatewayID
    }
}

public enum ForwarderError: Error, Sendable, Equatable, CustomStringConvertible {
    /// Another live forwarder (`ferry run` or `ferry forward`) drains this store.
    case anotherForwarder(pid: Int64)
    /// This forwarder's lease expired and another forwarder took it: stop before posting beside it.
    case leaseLost

    public var description: String {
        switch self {
        case .anotherForwarder(let pid):
            return "another forwarder (pid \(pid): ferry run or ferry forward) is draining this store; stop it first"
        case .leaseLost: return "the store's forwarder lease was taken over by another forwarder"
        }
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
    /// Times the uplink as a whole went offline (two batches in a row failed temporarily).
    public var offlinePeriods = 0
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
    /// The store's connection is confined to this thread, with every method of the actor: a claim or an
    /// acknowledgement blocks in sqlite3 (an fsync per commit, up to 5 s in the busy handler, a prune), which
    /// must not hold a thread of the cooperative pool (see `ThreadExecutor`).
    private let thread: ThreadExecutor
    public nonisolated var unownedExecutor: UnownedSerialExecutor { thread.asUnownedSerialExecutor() }
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
    private var health: UplinkHealth
    /// Schedules run on a monotonic clock (milliseconds since the forwarder was made): a wall clock stepped
    /// by NTP must not stall or rush the uplink. The wall clock only stamps rows.
    private let clock = SystemMonotonicClock()
    private let origin: Double
    private let owner = UUID().uuidString.lowercased()
    private var lastRenewal: Int64 = 0
    private var lastWall: Int64 = 0
    private var lastMono: Int64 = 0
    private var recordedState = UplinkState.online
    public private(set) var report = ForwardReport()

    /// `tokenSource` is called before the first request and again after every 401/403 pause (the operator
    /// may have rewritten the token file). It must never log the token.
    public init(
        databasePath: String, poster: any BatchPosting, configuration: ForwarderConfiguration,
        tokenSource: @escaping @Sendable () throws -> BearerToken? = { nil }, log: any LogSink = NullLogSink(),
        wallClock: any WallClock = SystemWallClock()
    ) throws {
        store = try GatewayStore(path: databasePath, clock: wallClock)
        // Started only once the store opened: an init that throws runs no deinit to stop it.
        thread = ThreadExecutor(name: "ferry-uplink")
        self.poster = poster
        self.configuration = configuration
        self.tokenSource = tokenSource
        self.log = log
        self.wallClock = wallClock
        origin = clock.now()
        health = UplinkHealth(policy: configuration.policy)
    }

    deinit { thread.stop() }

    /// Whether the actor's methods run on its own thread (tests).
    public func runsOnItsOwnThread() -> Bool { thread.isCurrent }

    /// The uplink-wide state (online, suspect, offline), for tests and status.
    public var healthState: UplinkHealth.State { health.state }

    private func mono() -> Int64 {
        Int64((clock.seconds(since: origin) * 1000).rounded(.down))
    }

    /// Runs until cancelled, or with `untilEmpty` until no PENDING or IN_FLIGHT event remains (sleeping through
    /// backoff). Returns what it did; `failedInStore > 0` means some events are dead-lettered. Throws
    /// `ForwarderError.anotherForwarder` when another live forwarder holds the store's lease.
    public func run(untilEmpty: Bool) async throws -> ForwardReport {
        let ttl = UplinkHealth.millis(configuration.leaseSeconds)
        switch try store.acquireForwarderLease(
            owner: owner, pid: Int64(getpid()), bootID: Self.bootID, now: wallClock.nowMillis(), ttlMillis: ttl,
            isAlive: Self.isAlive)
        {
        case .heldBy(let holder):
            throw ForwarderError.anotherForwarder(pid: holder.pid)
        case .acquired:
            // The previous owner is gone (dead, on another boot, expired, or an ended instance in this
            // process): its IN_FLIGHT rows go back to PENDING, same batches, same keys.
            let released = try store.releaseInFlight(claimedBefore: nil)
            if released > 0 {
                log.log(.notice, "uplink: \(released) IN_FLIGHT events from an earlier run returned to PENDING (same batches)")
            }
        }
        lastRenewal = mono()
        // Steps of the wall clock while no forwarder ran cannot be measured: no wait may exceed what the
        // policy can produce.
        let policy = configuration.policy
        try store.clampPendingRetries(
            now: wallClock.nowMillis(),
            horizonMillis: UplinkHealth.millis(policy.maxRetryAfterSeconds + 2 * policy.maxDelaySeconds + 1))
        (lastWall, lastMono) = (wallClock.nowMillis(), mono())
        do {
            try await forward(untilEmpty: untilEmpty)
        } catch {
            try? store.releaseForwarderLease(owner: owner)
            throw error
        }
        try store.releaseForwarderLease(owner: owner)
        let counts = try store.outboxCounts()
        report.failedInStore = counts[.failed] ?? 0
        report.pendingInStore = (counts[.pending] ?? 0) + (counts[.inFlight] ?? 0)
        return report
    }

    private func forward(untilEmpty: Bool) async throws {
        try await withThrowingTaskGroup(of: (ClaimedBatch, UplinkAttempt, Int64).self) { group in
            var inFlight = 0
            while !Task.isCancelled {
                configuration.onProgress?(report)
                try keepLease()
                let now = mono()
                try housekeepingIfDue(now: now)  // also while batches are in flight: a busy uplink must still prune
                if now >= pausedUntil, tokenLoaded || reloadToken(now: now) {
                    // Online: up to max-in-flight; suspect or offline: one probe batch at a time.
                    while health.claimsAllowed(now: mono(), inFlight: inFlight, maxInFlight: configuration.maxInFlight) > 0,
                        !Task.isCancelled,
                        let batch = try store.claimBatch(
                            limits: configuration.limits, now: wallClock.nowMillis(), gateway: configuration.gatewayID)
                    {
                        let body = try encode(batch)
                        let token = self.token
                        let poster = self.poster
                        let sentAt = mono()
                        group.addTask {
                            (batch, await poster.post(body: body, idempotencyKey: batch.id, token: token), sentAt)
                        }
                        inFlight += 1
                    }
                }
                if inFlight > 0 {
                    guard let (batch, attempt, sentAt) = try await group.next() else { break }
                    inFlight -= 1
                    try settle(batch, attempt, sentAt: sentAt)
                    continue
                }
                if untilEmpty, try store.undeliveredCount() == 0 { break }
                try await sleepUntilDue(now: now)
            }
            group.cancelAll()
            // Batches still on the wire stay IN_FLIGHT; the next forwarder to take the lease resends them
            // under the same key, and the backend dedupes.
        }
    }

    /// Renews the lease every quarter of its length, and moves the store's retry times along with a wall-clock
    /// step (measured against the monotonic clock).
    private func keepLease() throws {
        let now = mono()
        let wall = wallClock.nowMillis()
        let step = (wall &- lastWall) &- (now &- lastMono)
        (lastWall, lastMono) = (wall, now)
        if abs(step) > 1000 {
            let moved = try store.shiftPendingRetries(byMillis: step, after: wall &- step)
            log.log(.warning, "uplink: the wall clock stepped \(step / 1000) s; \(moved) waiting events keep their remaining wait")
        }
        let ttl = UplinkHealth.millis(configuration.leaseSeconds)
        guard now &- lastRenewal >= ttl / 4 else { return }
        guard try store.renewForwarderLease(owner: owner, now: wall, ttlMillis: ttl) else {
            throw ForwarderError.leaseLost
        }
        lastRenewal = now
    }

    static let bootID: String = {
        var bytes: [UInt8] = []  // stays empty where the file cannot be read
        _ = readFile("/proc/sys/kernel/random/boot_id", limit: 64, into: &bytes)
        return String(decoding: bytes, as: UTF8.self).trimmingWhitespace()
    }()

    /// kill(pid, 0): ESRCH means gone; EPERM means alive under another user.
    static func isAlive(_ pid: Int64) -> Bool {
        guard pid > 0, pid <= Int64(Int32.max) else { return false }
        return kill(pid_t(pid), 0) == 0 || errno == EPERM
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
            let after = policy.pauseSeconds(consecutivePauses: consecutivePauses)
            consecutivePauses += 1
            report.pauses += 1
            pausedUntil = now + Int64(after * 1000)
            try? record(.paused, since: wallClock.nowMillis(), detail: "cannot use the token: \(error)")
            log.log(.error, "uplink: paused \(cFormat("%.0f", after)) s: cannot use the token: \(error)")
            return false
        }
    }

    private func sleepUntilDue(now: Int64) async throws {
        var wait = configuration.newEvents == nil ? configuration.idlePollSeconds : configuration.heartbeatSeconds
        if pausedUntil > now {
            wait = Double(pausedUntil - now) / 1000
        } else if health.resumeAt > now {
            wait = Double(health.resumeAt - now) / 1000
        } else if let due = try store.nextDueAt(), due > wallClock.nowMillis() {
            wait = min(wait, Double(due - wallClock.nowMillis()) / 1000)
        }
        // Wake at least every quarter lease to renew it, and at least every heartbeat.
        wait = min(wait, configuration.leaseSeconds / 4, configuration.heartbeatSeconds)
        let duration = Duration.milliseconds(Int64(max(0.005, wait) * 1000))
        if let newEvents = configuration.newEvents {
            await newEvents.wait(timeout: duration)
        } else {
            try? await Task.sleep(for: duration)
        }
    }

    /// Builds the §6 body from the claimed rows. Everything comes from stored, immutable data, so a retry of
    /// the same batch produces the same bytes.
    private func encode(_ batch: ClaimedBatch) throws -> [UInt8] {
        var events: [UplinkEvent] = []
        for event in batch.events {
            let epoch = UInt64(event.epoch) ?? 0
            let content: UplinkEvent.Content
            switch event.type {
            case .frames:
                let frames = try store.frames(for: event).map {
                    UplinkFrame(
                        seq: $0.seq, payload: $0.payload,
                        receivedAt: UplinkTimestamp(millisecondsSince1970: $0.receivedAt))
                }
                content = .frames(frames)
            case .gap:
                content = .gap(
                    firstSeq: event.firstSeq ?? 0, lastSeq: event.lastSeq ?? 0,
                    detectedAt: UplinkTimestamp(millisecondsSince1970: event.createdAt))
            case .regression:
                // The store wrote this payload in the transaction that rebased the stream; unreadable means a
                // damaged row: said so (the batch stays unsent) rather than reported upstream as zeros.
                guard case .regression(_, _, let cursor, let head, _, _)? = event.decodedPayload else {
                    throw StoreError.unexpectedValue(column: "outbox_events.payload (\(event.id))", value: event.payload)
                }
                content = .regression(
                    cursor: cursor, head: head, detectedAt: UplinkTimestamp(millisecondsSince1970: event.createdAt))
            }
            events.append(UplinkEvent(id: event.id, peripheral: event.peripheral, epoch: epoch, content: content))
        }
        // The gateway the batch was first sent with: a resend is byte-identical after a host rename.
        return UplinkBodyEncoder.encode(
            UplinkBatchBody(gateway: batch.gateway ?? configuration.gatewayID, batch: batch.id, events: events))
    }

    private func settle(_ batch: ClaimedBatch, _ attempt: UplinkAttempt, sentAt: Int64) throws {
        report.attempts += 1
        report.bytesSent += attempt.sentBodyBytes
        let retryCount = batch.events.map(\.retryCount).max() ?? 0
        if case .retry(let reason, let retryAfter) = attempt.outcome {
            return try settleTemporaryFailure(batch, reason: reason, retryAfter: retryAfter, sentAt: sentAt)
        }
        let disposition = configuration.policy.disposition(
            after: attempt.outcome, retryCount: retryCount, consecutivePauses: consecutivePauses, random: &random)
        let now = mono()
        let wall = wallClock.nowMillis()
        let frames = batch.events.reduce(0) { $0 + $1.frameCount }
        switch disposition {
        case .complete:
            consecutivePauses = 0
            try store.completeBatch(batch.id, now: wall)
            try apply(health.succeeded(batch: batch.id, now: now), now: now)
            try record(.online, since: wall, detail: nil)
            report.batchesDelivered += 1
            report.eventsDelivered += batch.events.count
            report.framesDelivered += frames
            log.log(.debug, "uplink: batch \(batch.id) delivered (\(batch.events.count) events, \(frames) frames)")
        case .retry:
            break  // a .retry outcome never gets here: settleTemporaryFailure took it
        case .pause(_, let reason) where pausedUntil > now:
            // A batch sent before the pause began got the same answer as the one that started it: that is the
            // same pause. Escalating again per batch would make the pause length depend on --max-in-flight
            // (four 401s in flight: 1+2+4+8 s → an 8 s first pause).
            report.pauses += 1
            tokenLoaded = false
            try store.retryBatch(
                batch.id, error: "\(reason)", nextRetryAt: wall &+ (pausedUntil &- now), countsAsRetry: false,
                maxRetries: Int(Int32.max))
            log.log(.info, "uplink: batch \(batch.id) \(reason) too; already paused")
        case .pause(let after, let reason):
            consecutivePauses += 1
            report.pauses += 1
            pausedUntil = max(pausedUntil, now &+ UplinkHealth.millis(after))
            tokenLoaded = false  // re-read credentials before the next attempt
            try store.retryBatch(
                batch.id, error: "\(reason)", nextRetryAt: wall &+ UplinkHealth.millis(after), countsAsRetry: false,
                maxRetries: Int(Int32.max))
            try record(.paused, since: wall, detail: "\(reason)")
            log.log(.warning, "uplink: paused \(cFormat("%.0f", after)) s: \(reason)")
        case .fail(let reason):
            consecutivePauses = 0
            try store.failBatch(batch.id, error: reason)
            report.eventsFailed += batch.events.count
            log.log(.error, "uplink: batch \(batch.id) FAILED (\(batch.events.count) events kept for audit): \(reason)")
        }
    }

    /// 408/429/5xx, timeouts and transport errors: never a charged retry while the uplink as a whole fails
    /// (UplinkHealth); the batch goes back to PENDING uncharged, and a 5xx is charged later only if another
    /// batch gets through meanwhile.
    private func settleTemporaryFailure(
        _ batch: ClaimedBatch, reason: UplinkRetryReason, retryAfter: Double?, sentAt: Int64
    ) throws {
        report.retries += 1
        consecutivePauses = 0  // an answer other than 401/403: the credentials were not the problem
        let now = mono()
        let wall = wallClock.nowMillis()
        let kind: UplinkHealth.Failure
        switch reason {
        case .status(let code) where code == 408 || code == 429: kind = .uplink
        case .status: kind = .chargeable
        case .timeout, .connection: kind = .uplink
        }
        let retryCount = batch.events.map(\.retryCount).max() ?? 0
        let action = health.failed(
            batch: batch.id, kind: kind, retryNumber: UplinkRetryPolicy.retryNumber(after: retryCount),
            retryAfter: retryAfter, sentAt: sentAt, now: now, random: &random)
        let due = action.retryAt ?? now
        try store.retryBatch(
            batch.id, error: "\(reason)", nextRetryAt: wall &+ (due &- now), countsAsRetry: false,
            maxRetries: Int(Int32.max))
        log.log(
            .info,
            "uplink: batch \(batch.id) \(reason)\(retryAfter.map { ", Retry-After \($0) s" } ?? ""); "
                + "again in \(cFormat("%.1f", Double(due - now) / 1000)) s")
        try apply(action, now: now, reason: reason)
    }

    private func apply(_ action: UplinkHealth.Action, now: Int64, reason: UplinkRetryReason? = nil) throws {
        for suspect in action.charge {
            let error = "retries exhausted: HTTP 5xx for this batch while other batches were accepted"
            let failed = try store.chargeRetry(suspect, maxRetries: configuration.policy.maxRetries, error: error)
            if failed > 0 {
                report.eventsFailed += failed
                log.log(.error, "uplink: batch \(suspect) FAILED (\(failed) events kept for audit): \(error)")
            }
        }
        switch action.transition {
        case nil:
            break
        case .wentOffline(let since, let nextProbeAt):
            report.offlinePeriods += 1
            try record(.offline, since: wallClock.nowMillis() &- (now &- since), detail: reason.map { "\($0)" })
            let backlog = try store.undeliveredCount()
            log.log(
                .warning,
                "uplink: offline (\(reason.map { "\($0)" } ?? "no answer")) for \(cFormat("%.1f", Double(now - since) / 1000)) s; "
                    + "\(backlog) events wait; probing with one batch at a time, next in "
                    + "\(cFormat("%.1f", Double(max(0, nextProbeAt - now)) / 1000)) s")
        case .backOnline(let offlineMillis):
            try store.makePendingDue(now: wallClock.nowMillis())
            let backlog = try store.undeliveredCount()
            log.log(
                .warning,
                "uplink: back online after \(cFormat("%.1f", Double(offlineMillis) / 1000)) s offline; "
                    + "backlog \(backlog) events")
        }
    }

    /// The uplink state `ferry status` shows; written on changes only.
    private func record(_ state: UplinkState, since: Int64, detail: String?) throws {
        guard state != recordedState else { return }
        recordedState = state
        try store.recordUplinkState(owner: owner, state: state, since: since, detail: detail)
    }

    /// No zombie sweep here: with the lease every IN_FLIGHT row belongs to this forwarder (an earlier owner's
    /// were released when the lease was taken), and releasing one still on the wire would post its key twice
    /// at once.
    private func housekeepingIfDue(now: Int64) throws {
        guard Double(now - lastHousekeeping) / 1000 >= configuration.housekeepingIntervalSeconds else { return }
        lastHousekeeping = now
        let wall = wallClock.nowMillis()
        let pruned = try store.pruneCompleted(before: wall - UplinkHealth.millis(configuration.retentionSeconds))
        if pruned.events > 0 {
            log.log(.info, "housekeeping: pruned \(pruned.events) delivered events and \(pruned.frames) frames")
            try store.incrementalVacuum()
        }
    }
}
