import Foundation
import FerryStore
import Testing

@testable import FerryUplink

/// The forwarder's SQLite connection and every method of the actor run on a thread of its own, not on the
/// cooperative pool (a claim or an acknowledgement blocks in sqlite3 for an fsync, or seconds when busy).
@Suite struct ForwarderThreadTests {
    struct NeverCalled: BatchPosting {
        func post(body: [UInt8], idempotencyKey: String, token: BearerToken?) async -> UplinkAttempt {
            Issue.record("nothing to send, yet the forwarder posted")
            return UplinkAttempt(
                outcome: .completed(status: 200), status: 200, sentBodyBytes: 0, compressed: false, elapsedSeconds: 0,
                responseSnippet: "")
        }
    }

    @Test func theForwarderRunsOnItsOwnThreadAndAnEmptyOutboxEndsAtOnce() async throws {
        let directory = try TestSupport.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: directory) }
        let path = directory.appendingPathComponent("ferry.sqlite").path
        _ = try GatewayStore(path: path)
        let forwarder = try OutboxForwarder(
            databasePath: path, poster: NeverCalled(), configuration: ForwarderConfiguration(gatewayID: "test"))
        #expect(await forwarder.runsOnItsOwnThread())
        let report = try await forwarder.run(untilEmpty: true)
        #expect(report.failedInStore == 0)
        #expect(await forwarder.runsOnItsOwnThread())
    }
}
