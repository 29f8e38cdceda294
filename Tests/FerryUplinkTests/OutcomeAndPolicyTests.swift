import Foundation
import Testing

@testable import FerryUplink
import CCurl

/// A deterministic generator (SplitMix64) so jitter is testable.
struct SeededGenerator: RandomNumberGenerator {
    var state: UInt64
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}

/// Returns the same fraction every time: pins jitter to an exact point.
struct ConstantGenerator: RandomNumberGenerator {
    let value: UInt64
    mutating func next() -> UInt64 { value }
}

@Suite struct ResponseClassifierTests {
    static let now = 1_796_050_800.0

    func classify(_ status: Int, retryAfter: String? = nil) -> UplinkOutcome {
        UplinkResponseClassifier.classify(status: status, retryAfter: retryAfter, nowSecondsSince1970: Self.now)
    }

    @Test(arguments: [200, 201, 202, 204, 299])
    func twoHundredsComplete(status: Int) {
        #expect(classify(status) == .completed(status: status))
    }

    @Test(arguments: [408, 429, 500, 502, 503, 504, 599])
    func transientStatusesRetry(status: Int) {
        #expect(classify(status) == .retry(.status(status), retryAfterSeconds: nil))
    }

    @Test(arguments: [401, 403])
    func authStatusesPause(status: Int) {
        #expect(classify(status) == .pause(.unauthorized(status: status)))
    }

    @Test(arguments: [400, 404, 405, 409, 410, 413, 415, 422, 451, 499])
    func otherClientErrorsFail(status: Int) {
        #expect(classify(status) == .failed(status: status, detail: ""))
    }

    @Test func redirectsPause() {
        let outcome = UplinkResponseClassifier.classify(
            status: 308, retryAfter: nil, location: "https://x/", nowSecondsSince1970: Self.now)
        #expect(outcome == .pause(.redirect(status: 308, location: "https://x/")))
    }

    @Test func retryAfterSecondsAndDates() {
        #expect(classify(503, retryAfter: "120") == .retry(.status(503), retryAfterSeconds: 120))
        #expect(classify(429, retryAfter: " 0 ") == .retry(.status(429), retryAfterSeconds: 0))
        // 2026-11-30T15:00:00Z is `now`; 90 s later in all three HTTP-date forms.
        #expect(RetryAfter.seconds(from: "Mon, 30 Nov 2026 15:01:30 GMT", nowSecondsSince1970: Self.now) == 90)
        #expect(RetryAfter.seconds(from: "Monday, 30-Nov-26 15:01:30 GMT", nowSecondsSince1970: Self.now) == 90)
        #expect(RetryAfter.seconds(from: "Mon Nov 30 15:01:30 2026", nowSecondsSince1970: Self.now) == 90)
        // A date in the past means "now", not a negative wait.
        #expect(RetryAfter.seconds(from: "Sun, 06 Nov 1994 08:49:37 GMT", nowSecondsSince1970: Self.now) == 0)
        #expect(RetryAfter.seconds(from: "soon", nowSecondsSince1970: Self.now) == nil)
        #expect(RetryAfter.seconds(from: "-5", nowSecondsSince1970: Self.now) == nil)
        #expect(RetryAfter.seconds(from: "Mon, 31 Feb 2026 25:00:00 GMT", nowSecondsSince1970: Self.now) == nil)
        #expect(classify(503, retryAfter: "later") == .retry(.status(503), retryAfterSeconds: nil))
    }

    /// Issue 11: one response header must never crash the gateway (Swift traps on overflow).
    @Test(arguments: [
        "Sun Nov  6 08:49:37 999999999999", "Sun Nov  6 08:49:37 9223372036854775807",
        "Sun Nov  6 08:49:37 -9223372036854775808", "Sun, 06 Nov 99999 08:49:37 GMT",
        "Sunday, 06-Nov-999999999999 08:49:37 GMT", "Sun, 06 Nov 1994 99999999999999999999:49:37 GMT",
        "Sun, 06 Nov 1994 -1:49:37 GMT", "Sun Nov -6 08:49:37 1994", "-1", "-0", "+5", "1e9", "0x10", "",
        "   ", "\u{0}", "Sun,  GMT", "Sun, 06 Nov 1994 08:49 GMT",
    ])
    func hostileRetryAfterNeverTraps(header: String) {
        // Parses to nothing, or to a finite, non-negative wait.
        if let seconds = RetryAfter.seconds(from: header, nowSecondsSince1970: Self.now) {
            #expect(seconds >= 0 && !seconds.isNaN, "\(header) → \(seconds)")
        }
        _ = classify(503, retryAfter: header)
    }

    @Test func retryAfterExtremes() {
        #expect(RetryAfter.seconds(from: "Sun Nov  6 08:49:37 999999999999", nowSecondsSince1970: Self.now) == nil)
        #expect(RetryAfter.seconds(from: "Fri, 31 Dec 9999 23:59:59 GMT", nowSecondsSince1970: Self.now)! > 2.5e11)
        #expect(RetryAfter.seconds(from: "Thu, 01 Jan 0001 00:00:00 GMT", nowSecondsSince1970: Self.now) == 0)
        let huge = String(repeating: "9", count: 400)
        #expect(RetryAfter.seconds(from: huge, nowSecondsSince1970: Self.now)! > 1e300)
        // The policy caps what the parser lets through.
        #expect(UplinkRetryPolicy().cappedRetryAfter(.infinity) == 3600)
    }

    @Test func httpDateMatchesKnownEpochSeconds() {
        #expect(HTTPDate.secondsSince1970("Sun, 06 Nov 1994 08:49:37 GMT") == 784_111_777)
    }

    @Test func libcurlLoadsAtFirstUse() {
        #expect(ferry_curl_available() == 1, "libcurl.so.4 loads (dlopen) and has every function the poster calls")
        #expect(ferry_curl_global_init() == CURLE_OK)
        #expect(String(cString: ferry_curl_easy_strerror(CURLE_COULDNT_CONNECT)) == "Couldn't connect to server")
    }

    @Test func transportErrorsClassify() {
        #expect(UplinkTransportErrors.classify(code: CURLE_OPERATION_TIMEDOUT, message: "") == .retry(.timeout, retryAfterSeconds: nil))
        guard case .retry(.connection(let detail), nil) = UplinkTransportErrors.classify(code: CURLE_COULDNT_CONNECT, message: "")
        else {
            Issue.record("refused connection must retry")
            return
        }
        #expect(!detail.isEmpty, "libcurl's own text when there is no message")
        for code in [CURLE_PEER_FAILED_VERIFICATION, CURLE_SSL_CACERT_BADFILE, CURLE_SSL_CERTPROBLEM] {
            guard case .pause(.untrustedCertificate) = UplinkTransportErrors.classify(code: code, message: "x") else {
                Issue.record("certificate failure \(code) must pause")
                return
            }
        }
    }
}

@Suite struct RetryPolicyTests {
    let policy = UplinkRetryPolicy(
        baseDelaySeconds: 1, maxDelaySeconds: 60, maxRetries: 5, maxRetryAfterSeconds: 100,
        basePauseSeconds: 2, maxPauseSeconds: 30)
    let transient = UplinkOutcome.retry(.status(503), retryAfterSeconds: nil)

    @Test func ceilingsDoubleUpToTheCap() {
        #expect((1...8).map { policy.backoffCeilingSeconds(retryNumber: $0) } == [1, 2, 4, 8, 16, 32, 60, 60])
        #expect(policy.backoffCeilingSeconds(retryNumber: 10_000) == 60)
    }

    @Test func fullJitterStaysWithinZeroAndTheCeilingAndSpreads() {
        var random = SeededGenerator(state: 42)
        for retryCount in 0..<5 {
            var delays: [Double] = []
            for _ in 0..<500 {
                guard case .retry(let delay, let next) = policy.disposition(
                    after: transient, retryCount: retryCount, random: &random)
                else {
                    Issue.record("expected a retry")
                    return
                }
                #expect(next == retryCount + 1)
                delays.append(delay)
            }
            let ceiling = policy.backoffCeilingSeconds(retryNumber: retryCount + 1)
            #expect(delays.allSatisfy { $0 >= 0 && $0 <= ceiling })
            // Full jitter: the whole range is used, not just the top.
            #expect(delays.min()! < ceiling * 0.1)
            #expect(delays.max()! > ceiling * 0.9)
        }
    }

    /// `retry_count` is read from the store file: a damaged one may hold anything.
    @Test func anyStoredRetryCountGivesAValidNextNumber() {
        #expect(UplinkRetryPolicy.retryNumber(after: 0) == 1)
        #expect(UplinkRetryPolicy.retryNumber(after: 4) == 5)
        #expect(UplinkRetryPolicy.retryNumber(after: -7) == 1)
        #expect(UplinkRetryPolicy.retryNumber(after: .min) == 1)
        #expect(UplinkRetryPolicy.retryNumber(after: .max) == .max)
        var random = SeededGenerator(state: 7)
        guard case .fail(let reason) = policy.disposition(after: transient, retryCount: .max, random: &random) else {
            Issue.record("expected the retries to be exhausted")
            return
        }
        #expect(reason.hasPrefix("retries exhausted"))
        guard case .retry(_, let next) = policy.disposition(after: transient, retryCount: -3, random: &random) else {
            Issue.record("expected a first retry")
            return
        }
        #expect(next == 1)
    }

    @Test func retryAfterIsAFloorAndIsCapped() {
        var zero = ConstantGenerator(value: 0)
        let told = UplinkOutcome.retry(.status(429), retryAfterSeconds: 30)
        #expect(policy.disposition(after: told, retryCount: 0, random: &zero) == .retry(afterSeconds: 30, retryCount: 1))
        let tooLong = UplinkOutcome.retry(.status(503), retryAfterSeconds: 1e9)
        #expect(
            policy.disposition(after: tooLong, retryCount: 0, random: &zero) == .retry(afterSeconds: 100, retryCount: 1))
        var top = ConstantGenerator(value: .max)
        // A jittered delay above Retry-After wins: Retry-After is a minimum.
        let short = UplinkOutcome.retry(.status(503), retryAfterSeconds: 0.5)
        guard case .retry(let delay, _) = policy.disposition(after: short, retryCount: 3, random: &top) else {
            Issue.record("expected a retry")
            return
        }
        #expect(delay > 7 && delay < 8)
    }

    @Test func exhaustedRetriesFail() {
        var random = SeededGenerator(state: 1)
        guard case .retry = policy.disposition(after: transient, retryCount: 4, random: &random) else {
            Issue.record("the fifth retry is still allowed")
            return
        }
        guard case .fail(let reason) = policy.disposition(after: transient, retryCount: 5, random: &random) else {
            Issue.record("a sixth retry must not happen")
            return
        }
        #expect(reason.contains("retries exhausted"))
    }

    @Test func pausesDoNotBurnRetriesAndGrowToTheirCap() {
        var random = SeededGenerator(state: 1)
        let unauthorized = UplinkOutcome.pause(.unauthorized(status: 401))
        let pauses = (0..<6).map { count in
            policy.disposition(after: unauthorized, retryCount: 5, consecutivePauses: count, random: &random)
        }
        #expect(
            pauses.map { if case .pause(let after, _) = $0 { after } else { -1 } } == [2, 4, 8, 16, 30, 30])
    }

    @Test func completedAndFailedMapDirectly() {
        var random = SeededGenerator(state: 1)
        #expect(policy.disposition(after: .completed(status: 200), retryCount: 3, random: &random) == .complete)
        #expect(
            policy.disposition(after: .failed(status: 422, detail: "bad"), retryCount: 0, random: &random)
                == .fail(reason: "HTTP 422: bad"))
    }
}
