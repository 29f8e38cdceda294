import Testing

@testable import FerryUplink

/// The uplink-wide state machine (issue 11): an outage is never charged to a batch; a 5xx is charged only when
/// another batch gets through next.
@Suite struct UplinkHealthTests {
    let policy = UplinkRetryPolicy(baseDelaySeconds: 1, maxDelaySeconds: 8, maxRetries: 2)

    @Test func outageIsNeverChargedAndOneProbeAtATime() {
        var random = ConstantGenerator(value: .max)  // fraction ≈ 1: the top of every jitter range
        var health = UplinkHealth(policy: policy)
        #expect(health.claimsAllowed(now: 0, inFlight: 0, maxInFlight: 4) == 4)
        // Four batches in flight when the link dies.
        var a = health.failed(batch: "A", kind: .uplink, retryNumber: 1, retryAfter: nil, sentAt: 0, now: 10, random: &random)
        #expect(health.state == .suspect(since: 10))
        #expect(a.charge.isEmpty && a.transition == nil)
        #expect(health.claimsAllowed(now: 10, inFlight: 3, maxInFlight: 4) == 0)
        a = health.failed(batch: "B", kind: .chargeable, retryNumber: 1, retryAfter: nil, sentAt: 0, now: 20, random: &random)
        guard case .wentOffline(let since, let probeAt) = a.transition else {
            Issue.record("no offline transition: \(a)")
            return
        }
        #expect(since == 10)
        // First offline pause: ceiling 1 s, equal jitter → [0.5, 1) s.
        #expect(probeAt >= 20 + 500 && probeAt <= 20 + 1000)
        #expect((a.retryAt ?? 0) > probeAt, "a failed probe waits longer than the next probe")
        // Stragglers (sent before going offline) do not escalate.
        let before = health.resumeAt
        _ = health.failed(batch: "C", kind: .uplink, retryNumber: 1, retryAfter: nil, sentAt: 0, now: 30, random: &random)
        _ = health.failed(batch: "D", kind: .uplink, retryNumber: 1, retryAfter: nil, sentAt: 0, now: 31, random: &random)
        #expect(health.resumeAt == before)
        #expect(health.claimsAllowed(now: before - 1, inFlight: 0, maxInFlight: 4) == 0)
        #expect(health.claimsAllowed(now: before, inFlight: 0, maxInFlight: 4) == 1)
        #expect(health.claimsAllowed(now: before, inFlight: 1, maxInFlight: 4) == 0)
        // Failed probes escalate up to the cap (8 s).
        var now = before
        for _ in 0..<10 {
            let action = health.failed(
                batch: "P", kind: .chargeable, retryNumber: 1, retryAfter: nil, sentAt: now, now: now, random: &random)
            #expect(action.charge.isEmpty)
            #expect(health.resumeAt - now <= 8000)
            now = health.resumeAt
        }
        #expect(health.resumeAt - now <= 8000)
        guard case .offline(_, let probes, _) = health.state else {
            Issue.record("not offline: \(health.state)")
            return
        }
        #expect(probes == 11)
        // Back: full speed, nobody charged (B's 5xx was part of the outage), one back-online transition.
        let back = health.succeeded(batch: "Q", now: now + 5)
        #expect(back.charge.isEmpty)
        #expect(back.transition == .backOnline(offlineMillis: now + 5 - 10))
        #expect(health.state == .online)
        #expect(health.claimsAllowed(now: now + 5, inFlight: 0, maxInFlight: 4) == 4)
    }

    @Test func fiveHundredBetweenSuccessesIsCharged() {
        var random = ConstantGenerator(value: .max)  // fraction ≈ 1: the top of every jitter range
        var health = UplinkHealth(policy: policy)
        _ = health.succeeded(batch: "A", now: 0)
        let failed = health.failed(
            batch: "P", kind: .chargeable, retryNumber: 1, retryAfter: nil, sentAt: 0, now: 10, random: &random)
        #expect(failed.charge.isEmpty, "no verdict yet")
        #expect((failed.retryAt ?? 0) > 10, "the suspect backs off so the next claim is another batch")
        #expect(health.claimsAllowed(now: 10, inFlight: 0, maxInFlight: 4) == 1)
        let next = health.succeeded(batch: "B", now: 20)
        #expect(next.charge == ["P"])
        #expect(next.transition == nil, "a poison batch is not an outage: no log lines")
        #expect(health.state == .online)
    }

    @Test func uplinkKindsAndOwnRecoveryAreNotCharged() {
        var random = ConstantGenerator(value: .max)  // fraction ≈ 1: the top of every jitter range
        var health = UplinkHealth(policy: policy)
        _ = health.failed(batch: "T", kind: .uplink, retryNumber: 1, retryAfter: nil, sentAt: 0, now: 10, random: &random)
        #expect(health.succeeded(batch: "B", now: 20).charge.isEmpty, "a timeout/429/transport error is never charged")
        _ = health.failed(batch: "P", kind: .chargeable, retryNumber: 1, retryAfter: nil, sentAt: 20, now: 30, random: &random)
        #expect(health.succeeded(batch: "P", now: 40).charge.isEmpty, "the batch itself got through")
    }

    @Test func retryAfterHoldsTheWholeUplinkCapped() {
        var random = ConstantGenerator(value: .max)  // fraction ≈ 1: the top of every jitter range
        var health = UplinkHealth(policy: UplinkRetryPolicy(maxRetryAfterSeconds: 100))
        _ = health.failed(batch: "A", kind: .uplink, retryNumber: 1, retryAfter: 30, sentAt: 0, now: 1000, random: &random)
        #expect(health.resumeAt == 31_000)
        #expect(health.claimsAllowed(now: 30_999, inFlight: 0, maxInFlight: 4) == 0)
        _ = health.succeeded(batch: "B", now: 2000)
        #expect(health.claimsAllowed(now: 2000, inFlight: 0, maxInFlight: 4) == 0, "a success does not cancel it")
        _ = health.failed(
            batch: "A", kind: .uplink, retryNumber: 1, retryAfter: .greatestFiniteMagnitude, sentAt: 0, now: 3000,
            random: &random)
        #expect(health.resumeAt == 103_000)
        _ = health.failed(
            batch: "A", kind: .uplink, retryNumber: 1, retryAfter: -.infinity, sentAt: 0, now: 3000, random: &random)
        #expect(health.resumeAt == 103_000)
    }

    @Test func offlinePauseUsesTheRetryCeilingWithEqualJitter() {
        var low = ConstantGenerator(value: 0)
        var high = ConstantGenerator(value: .max)
        for n in 1...12 {
            let ceiling = policy.backoffCeilingSeconds(retryNumber: n)
            #expect(policy.offlinePauseSeconds(failures: n, random: &low) == ceiling / 2)
            let top = policy.offlinePauseSeconds(failures: n, random: &high)
            #expect(top <= ceiling && top > ceiling * 0.99)
        }
        #expect(UplinkHealth.millis(.infinity) == 0 && UplinkHealth.millis(-1) == 0 && UplinkHealth.millis(.nan) == 0)
        #expect(UplinkHealth.millis(1e300) == 1_000_000_000_000_000)
    }
}
