// What the forwarder does after an outcome: exponential backoff with full jitter,
// Retry-After honoured, a bounded number of retries, pauses that do not count.
// Pure: the random source and the retry count are passed in.

import FerryCore

/// What to do with the batch's events after one attempt.
public enum UplinkDisposition: Sendable, Hashable {
    /// Mark the events COMPLETED.
    case complete
    /// Back to PENDING with `retryCount` and `next_retry_at = now + delaySeconds`; same batch.
    case retry(afterSeconds: Double, retryCount: Int)
    /// Mark the events FAILED (dead letter).
    case fail(reason: String)
    /// Stop the uplink for `afterSeconds`, re-read credentials, then try the same batch
    /// again. `retryCount` is unchanged.
    case pause(afterSeconds: Double, reason: UplinkPauseReason)
}

public struct UplinkRetryPolicy: Sendable, Hashable {
    /// First backoff ceiling; attempt n (1-based) waits a uniform random time in
    /// [0, min(maxDelay, baseDelay * 2^(n-1))] ("full jitter": retries of many gateways spread out).
    public var baseDelaySeconds: Double
    public var maxDelaySeconds: Double
    /// Retries after the first attempt before the batch is FAILED.
    public var maxRetries: Int
    /// A `Retry-After` longer than this is cut to it: a broken server must not park the uplink for days.
    public var maxRetryAfterSeconds: Double
    /// Pause length after the n-th consecutive pause: min(maxPause, basePause * 2^(n-1)), no jitter
    /// (a pause waits for a human or a rewritten token file, not for a recovering server).
    public var basePauseSeconds: Double
    public var maxPauseSeconds: Double

    public init(
        baseDelaySeconds: Double = 0.5, maxDelaySeconds: Double = 300, maxRetries: Int = 12,
        maxRetryAfterSeconds: Double = 3600, basePauseSeconds: Double = 1, maxPauseSeconds: Double = 60
    ) {
        self.baseDelaySeconds = baseDelaySeconds
        self.maxDelaySeconds = maxDelaySeconds
        self.maxRetries = maxRetries
        self.maxRetryAfterSeconds = maxRetryAfterSeconds
        self.basePauseSeconds = basePauseSeconds
        self.maxPauseSeconds = maxPauseSeconds
    }

    /// The number of the retry that follows `retryCount` retries (1-based). `retryCount` comes from the store
    /// file: whatever it holds, the next number is at least 1 and never overflows.
    public static func retryNumber(after retryCount: Int) -> Int {
        retryCount < 0 ? 1 : retryCount == Int.max ? Int.max : retryCount + 1
    }

    /// The backoff ceiling before the `retryNumber`-th retry (1-based).
    public func backoffCeilingSeconds(retryNumber: Int) -> Double {
        Backoff.ceiling(base: baseDelaySeconds, cap: maxDelaySeconds, doublings: retryNumber - 1)
    }

    /// The pause after `consecutivePauses` pauses in a row (0-based): no jitter.
    public func pauseSeconds(consecutivePauses: Int) -> Double {
        Backoff.ceiling(base: basePauseSeconds, cap: maxPauseSeconds, doublings: consecutivePauses)
    }

    /// Decides what happens after `outcome`, given how many retries the batch already had
    /// (`retryCount`, the store's `retry_count`) and how many pauses in a row preceded this one.
    public func disposition<R: RandomNumberGenerator>(
        after outcome: UplinkOutcome, retryCount: Int, consecutivePauses: Int = 0, random: inout R
    ) -> UplinkDisposition {
        switch outcome {
        case .completed:
            return .complete
        case .failed(let status, let detail):
            return .fail(reason: detail.isEmpty ? "HTTP \(status)" : "HTTP \(status): \(detail)")
        case .pause(let reason):
            return .pause(afterSeconds: pauseSeconds(consecutivePauses: consecutivePauses), reason: reason)
        case .retry(let reason, let retryAfter):
            let next = Self.retryNumber(after: retryCount)
            if next > maxRetries {
                return .fail(reason: "retries exhausted after \(next) attempts; last: \(reason)")
            }
            return .retry(afterSeconds: retryDelaySeconds(retryNumber: next, retryAfter: retryAfter, random: &random), retryCount: next)
        }
    }

    /// The wait before a batch's `retryNumber`-th retry (1-based): full jitter under the backoff ceiling, with
    /// the server's `Retry-After` (capped) as a floor — the jitter still spreads gateways that were all told
    /// the same instant.
    public func retryDelaySeconds<R: RandomNumberGenerator>(
        retryNumber: Int, retryAfter: Double?, random: inout R
    ) -> Double {
        let jittered = backoffCeilingSeconds(retryNumber: retryNumber) * Self.unitFraction(&random)
        return max(jittered, cappedRetryAfter(retryAfter))
    }

    /// How long the whole uplink waits before its next probe after `failures` failed probes in a row (1-based):
    /// the same ceiling as a batch's retry of that number, with "equal jitter" — at least half the ceiling, so
    /// an offline gateway does not hammer a dead endpoint, and random in the other half, so gateways that
    /// lost the same backend do not come back in lock-step.
    public func offlinePauseSeconds<R: RandomNumberGenerator>(failures: Int, random: inout R) -> Double {
        let ceiling = backoffCeilingSeconds(retryNumber: failures)
        return ceiling / 2 + ceiling / 2 * Self.unitFraction(&random)
    }

    /// A `Retry-After` cut to `maxRetryAfterSeconds`; 0 when absent (or NaN, which the parser never returns).
    public func cappedRetryAfter(_ seconds: Double?) -> Double {
        guard let seconds, seconds > 0 else { return 0 }
        return min(seconds, maxRetryAfterSeconds)
    }

    /// 53 random bits → a fraction in [0, 1). Not Double.random(in:using:): its rejection sampling may ask for
    /// more values, and a generator injected by a test (or a broken one) would make it spin.
    private static func unitFraction<R: RandomNumberGenerator>(_ random: inout R) -> Double {
        Double(random.next() >> 11) * 0x1p-53
    }
}
