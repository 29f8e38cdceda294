// The poster against the real reference backend process on loopback.

import Foundation
import Testing

@testable import FerryUplink

#if canImport(FoundationNetworking)
    import FoundationNetworking
#endif

@Suite(.serialized) struct HTTPPosterTests {
    static let token = BearerToken("right-token-123")!

    func poster(
        _ backend: ReferenceBackend, compression: UplinkCompression = .never, timeout: Int = 10
    ) throws -> UplinkHTTPPoster {
        try UplinkHTTPPoster(
            configuration: UplinkHTTPConfiguration(
                endpoint: backend.endpoint, requestTimeoutSeconds: timeout, compression: compression))
    }

    func post(_ poster: UplinkHTTPPoster, batch: String, firstSeq: UInt64 = 1, token: BearerToken? = token) async
        -> UplinkAttempt
    {
        let body = UplinkBodyEncoder.encode(FrameBatches.twentyFrames(batch: batch, firstSeq: firstSeq))
        return await poster.post(body: body, idempotencyKey: batch, token: token)
    }

    @Test func successCompletesAndStoresEveryFrame() async throws {
        let backend = try ReferenceBackend(arguments: ["--token", "right-token-123"])
        defer { backend.stop() }
        let attempt = await post(try poster(backend), batch: "b-1")
        #expect(attempt.outcome == .completed(status: 200))
        #expect(attempt.compressed == false)
        #expect(try backend.stat("distinct_natural_keys") == 20)
    }

    @Test func sequentialPostsReuseOneKeptAliveConnection() async throws {
        let backend = try ReferenceBackend()
        defer { backend.stop() }
        let client = try poster(backend)
        for index in 0..<10 {
            let attempt = await post(client, batch: "b-\(index)", firstSeq: UInt64(index * 20 + 1))
            #expect(attempt.outcome == .completed(status: 200))
        }
        #expect(try backend.stat("connections_accepted") == 1)
    }

    @Test func forced422Fails() async throws {
        let backend = try ReferenceBackend(arguments: ["--reject-status", "422", "--reject-rate", "1.0"])
        defer { backend.stop() }
        let attempt = await post(try poster(backend), batch: "b-1")
        guard case .failed(422, let detail) = attempt.outcome else {
            Issue.record("expected failed(422), got \(attempt.outcome)")
            return
        }
        #expect(detail.contains("injected_rejection"))
        #expect(try backend.stat("distinct_natural_keys") == 0)
    }

    @Test func wrongTokenPausesThenTheRightTokenDelivers() async throws {
        let backend = try ReferenceBackend(arguments: ["--token", "right-token-123"])
        defer { backend.stop() }
        let client = try poster(backend)
        let wrong = BearerToken("wrong-token-456")!
        let refused = await post(client, batch: "b-1", token: wrong)
        #expect(refused.outcome == .pause(.unauthorized(status: 401)))
        #expect(!refused.responseSnippet.contains("wrong-token-456"))
        #expect(!refused.outcome.description.contains("wrong-token-456"))
        let missing = await post(client, batch: "b-1", token: nil)
        #expect(missing.outcome == .pause(.unauthorized(status: 401)))
        let accepted = await post(client, batch: "b-1")
        #expect(accepted.outcome == .completed(status: 200))
        #expect(try backend.stat("distinct_natural_keys") == 20)
    }

    @Test func serviceUnavailableCarriesRetryAfterAndThePolicyHonoursIt() async throws {
        let backend = try ReferenceBackend(arguments: [
            "--reject-status", "503", "--reject-rate", "1.0", "--retry-after", "7",
        ])
        defer { backend.stop() }
        let attempt = await post(try poster(backend), batch: "b-1")
        #expect(attempt.outcome == .retry(.status(503), retryAfterSeconds: 7))
        var random = SeededGenerator(state: 3)
        let policy = UplinkRetryPolicy(baseDelaySeconds: 0.1, maxDelaySeconds: 1)
        guard case .retry(let delay, 1) = policy.disposition(after: attempt.outcome, retryCount: 0, random: &random)
        else {
            Issue.record("expected a retry")
            return
        }
        #expect(delay >= 7)
    }

    @Test func lostResponseRetriesAndTheResendIsAReplay() async throws {
        let backend = try ReferenceBackend()
        defer { backend.stop() }
        let client = try poster(backend)
        try await backend.control(["lost_response_rate": 1.0])
        let lost = await post(client, batch: "b-1")
        guard case .retry(.connection, nil) = lost.outcome else {
            Issue.record("expected a connection-error retry, got \(lost.outcome)")
            return
        }
        #expect(try backend.stat("distinct_natural_keys") == 20)
        try await backend.control(["lost_response_rate": 0.0])
        let again = await post(client, batch: "b-1")
        #expect(again.outcome == .completed(status: 200))
        let stats = try backend.stats()
        #expect(stats["idempotent_replays"] as? Int == 1)
        #expect(stats["duplicates_rejected"] as? Int == 0)
        #expect(stats["distinct_natural_keys"] as? Int == 20)
    }

    @Test func slowBackendTimesOut() async throws {
        let backend = try ReferenceBackend(arguments: ["--slow-ms", "3000"])
        defer { backend.stop() }
        let attempt = await post(try poster(backend, timeout: 1), batch: "b-1")
        #expect(attempt.outcome == .retry(.timeout, retryAfterSeconds: nil))
        #expect(attempt.elapsedSeconds < 2.9)
    }

    @Test func refusedConnectionRetries() async throws {
        // A port that was just free: bind, learn it, close.
        let backend = try ReferenceBackend()
        let endpoint = backend.endpoint
        backend.stop()
        let client = try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: endpoint))
        let attempt = await client.post(body: Array("{}".utf8), idempotencyKey: "k", token: nil)
        guard case .retry(.connection, nil) = attempt.outcome else {
            Issue.record("expected a connection-error retry, got \(attempt.outcome)")
            return
        }
    }

    @Test func gzipStartsOnceTheBackendAdvertisesIt() async throws {
        let backend = try ReferenceBackend()
        defer { backend.stop() }
        let client = try poster(backend, compression: .whenAdvertised(minimumBytes: 256))
        #expect(!client.compressesLargeBodies)
        let first = await post(client, batch: "b-1")
        #expect(first.outcome == .completed(status: 200))
        #expect(!first.compressed)
        #expect(client.compressesLargeBodies)
        let second = await post(client, batch: "b-2", firstSeq: 21)
        #expect(second.outcome == .completed(status: 200))
        #expect(second.compressed)
        #expect(second.sentBodyBytes * 2 < first.sentBodyBytes)
        #expect(try backend.stat("distinct_natural_keys") == 40)
    }

    @Test func gzipRefusedWith415IsResentPlainly() async throws {
        let backend = try ReferenceBackend(arguments: ["--no-gzip"])
        defer { backend.stop() }
        let client = try poster(backend, compression: .always(minimumBytes: 1))
        let attempt = await post(client, batch: "b-1")
        #expect(attempt.outcome == .completed(status: 200))
        #expect(!attempt.compressed)
        #expect(try backend.stat("distinct_natural_keys") == 20)
    }

    @Test func rejectsEndpointsItCannotUse() {
        #expect(throws: UplinkHTTPError.self) {
            try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: URL(string: "ftp://x/")!))
        }
        #expect(throws: UplinkHTTPError.self) {
            try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: URL(string: "https://u:p@x/")!))
        }
        #expect(throws: UplinkHTTPError.self) {
            try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: URL(string: "http://example.com/")!))
        }
        #expect(throws: Never.self) {
            _ = try UplinkHTTPPoster(
                configuration: UplinkHTTPConfiguration(endpoint: URL(string: "http://example.com/")!, allowPlainHTTP: true))
            _ = try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: URL(string: "http://localhost:8080/")!))
            _ = try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: URL(string: "http://[::1]:8080/")!))
        }
        // A host NAME starting with "127." is a remote host: the token and frames would leave in clear.
        #expect(throws: UplinkHTTPError.self) {
            try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: URL(string: "http://127.evil.example/")!))
        }
        #expect(throws: Never.self) {
            _ = try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: URL(string: "http://127.3.2.1:80/")!))
        }
        #expect(throws: UplinkHTTPError.invalidTimeout(0)) {
            try UplinkHTTPPoster(
                configuration: UplinkHTTPConfiguration(endpoint: URL(string: "https://x/")!, requestTimeoutSeconds: 0))
        }
    }
}

@Suite struct LoopbackTests {
    @Test(arguments: ["localhost", "LOCALHOST", "127.0.0.1", "127.255.255.254", "127.1.2.3", "::1", "[::1]", "0:0:0:0:0:0:0:1"])
    func loopback(host: String) {
        #expect(UplinkEndpoint.isLoopback(host: host))
    }

    @Test(arguments: [
        "127.evil.example", "127.0.0.1.evil.example", "localhost.evil.example", "127.1", "127.0.0.256", "128.0.0.1",
        "::2", "::ffff:127.0.0.1", "[::1]x", "", "0.0.0.0", "10.0.0.1", "127.0.0.1 ", "evil-127.0.0.1",
    ])
    func notLoopback(host: String) {
        #expect(!UplinkEndpoint.isLoopback(host: host))
    }
}
