// Whether the uplink as a whole works (issue 11). What the network did (refused, reset, timed out) or a
// backend-wide outage (408/429/5xx for everyone) must never use up a batch's retry budget: a gateway offline
// for days would otherwise dead-letter its whole backlog. Only a batch that fails with 5xx while other batches
// get through (a "poison" batch) is charged a retry, and only once that evidence exists.
// Pure: times (milliseconds, one clock) and the random source are passed in.

public struct UplinkHealth: Sendable {
    public enum State: Sendable, Equatable {
        /// Nothing failed since the last success (or nothing happened yet): up to max-in-flight batches at once.
        case online
        /// One temporary failure right after a success: this batch (poison) or the uplink? One batch at a time
        /// until another batch answers.
        case suspect(since: Int64)
        /// Temporary failures of two batches in a row: the uplink is down. One probe batch at a time, each
        /// after an exponential pause. `since` is the first failure, `enteredAt` the last escalation (an
        /// attempt sent before it is a straggler, not a probe).
        case offline(since: Int64, failedProbes: Int, enteredAt: Int64)
    }

    /// How a temporary failure may count.
    public enum Failure: Sendable, Equatable {
        /// 5xx or a status outside the HTTP grammar: the backend may be choking on this batch.
        case chargeable
        /// Transport error, timeout, 408, 429: about the path or the backend's load, never about one batch.
        case uplink
    }

    public enum Transition: Sendable, Equatable {
        case wentOffline(since: Int64, nextProbeAt: Int64)
        case backOnline(offlineMillis: Int64)
    }

    /// What the forwarder does after a settled attempt.
    public struct Action: Sendable, Equatable {
        /// Charge one retry to each of these batches (they failed with 5xx while this other batch got through).
        public var charge: [String] = []
        /// For a failure: the batch goes back to PENDING, uncharged, due at this instant.
        public var retryAt: Int64?
        /// Log it (one line going offline, one coming back), and after `backOnline` make parked batches due.
        public var transition: Transition?
    }

    public private(set) var state: State = .online
    /// No batch is claimed before this instant: an offline pause, or a `Retry-After` (it holds the whole uplink).
    public private(set) var resumeAt: Int64 = 0
    /// Batches whose last 5xx awaits a verdict: charged if another batch succeeds next, forgiven if the uplink
    /// turns out to be down.
    private var suspects: [String] = []
    private var pauseMillis: Int64 = 0
    public let policy: UplinkRetryPolicy

    public init(policy: UplinkRetryPolicy) {
        self.policy = policy
    }

    /// How many more batches may be claimed now.
    public func claimsAllowed(now: Int64, inFlight: Int, maxInFlight: Int) -> Int {
        guard now >= resumeAt else { return 0 }
        switch state {
        case .online: return max(0, maxInFlight - inFlight)
        case .suspect, .offline: return inFlight == 0 ? 1 : 0
        }
    }

    /// A 2xx for `batch`: full speed again.
    public mutating func succeeded(batch: String, now: Int64) -> Action {
        var action = Action()
        action.charge = suspects.filter { $0 != batch }
        suspects = []
        if case .offline(let since, _, _) = state {
            action.transition = .backOnline(offlineMillis: max(0, now - since))
        }
        state = .online
        pauseMillis = 0
        return action
    }

    /// A temporary failure of `batch`, whose attempt was sent at `sentAt`. `retryNumber` is the retry this
    /// would be if charged (the batch's retry count + 1): it sizes the batch's own backoff.
    public mutating func failed<R: RandomNumberGenerator>(
        batch: String, kind: Failure, retryNumber: Int, retryAfter: Double?, sentAt: Int64, now: Int64,
        random: inout R
    ) -> Action {
        var action = Action()
        resumeAt = max(resumeAt, now &+ Self.millis(policy.cappedRetryAfter(retryAfter)))
        switch state {
        case .online:
            // Not yet known whether it is this batch: back off this batch as if charged, so the next claim is
            // another batch, whose answer is the verdict.
            state = .suspect(since: now)
            if kind == .chargeable { suspects.append(batch) }
            let delay = policy.retryDelaySeconds(retryNumber: retryNumber, retryAfter: retryAfter, random: &random)
            action.retryAt = now &+ Self.millis(delay)
        case .suspect(let since):
            // A second batch failed too: the uplink is down; nobody is charged for it.
            suspects = []
            action.retryAt = escalate(now: now, random: &random)
            state = .offline(since: since, failedProbes: 1, enteredAt: now)
            action.transition = .wentOffline(since: since, nextProbeAt: resumeAt)
        case .offline(let since, let failedProbes, let enteredAt):
            // Only a probe escalates: 4 batches in flight when the link died are one failure, not four.
            if sentAt >= enteredAt {
                action.retryAt = escalate(now: now, random: &random)
                state = .offline(since: since, failedProbes: failedProbes + 1, enteredAt: now)
            } else {
                action.retryAt = max(resumeAt, now) &+ pauseMillis
            }
        }
        return action
    }

    /// Next pause of the whole uplink; a failed probe itself waits one pause longer, so the next probe is
    /// another batch (a batch the backend cannot take must not hide the others behind it).
    private mutating func escalate<R: RandomNumberGenerator>(now: Int64, random: inout R) -> Int64 {
        let failures: Int
        switch state {
        case .offline(_, let probes, _): failures = probes + 1
        default: failures = 1
        }
        pauseMillis = Self.millis(policy.offlinePauseSeconds(failures: failures, random: &random))
        resumeAt = max(resumeAt, now &+ pauseMillis)
        return resumeAt &+ pauseMillis
    }

    /// Seconds → milliseconds without a trap: the inputs are capped by the policy, but the policy is
    /// configurable.
    static func millis(_ seconds: Double) -> Int64 {
        guard seconds.isFinite, seconds > 0 else { return 0 }
        return Int64(min(seconds, 1e12) * 1000)
    }
}
