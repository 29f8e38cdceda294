import FerryCore
import FerryProtocol
import FerryStore
import FerrySync
import Foundation
import Testing

/// A session records that its link was refused for want of security from the transport's verdict on the error,
/// never from the error's text.
@Suite struct SecurityRefusalTests {
    struct Refused: Error, CustomStringConvertible {
        var description: String { "refused" }
    }

    /// Fails the STREAM_INFO read or the subscription with `Refused`, and judges it as told.
    final class RefusingLink: SyncTransport {
        let failsStreamInfo: Bool
        let verdict: Bool
        init(failsStreamInfo: Bool, verdict: Bool) {
            self.failsStreamInfo = failsStreamInfo
            self.verdict = verdict
        }
        var hasStreamInfo: Bool { failsStreamInfo }
        func readStreamInfo() async throws -> [UInt8] { throw Refused() }
        func subscribe() async throws { if !failsStreamInfo { throw Refused() } }
        func writeControl(_ bytes: [UInt8]) async throws {}
        func writeAck(_ bytes: [UInt8]) async throws {}
        func disconnect() async {}
        func refusedForSecurity(_ error: any Error) -> Bool { verdict && error is Refused }
    }

    /// A link that fails like `RefusingLink` but keeps the protocol's default verdict.
    final class FailingLink: SyncTransport {
        var hasStreamInfo: Bool { true }
        func readStreamInfo() async throws -> [UInt8] { throw TransportError("ATT error: 0x05 (text only)") }
        func subscribe() async throws {}
        func writeControl(_ bytes: [UInt8]) async throws {}
        func writeAck(_ bytes: [UInt8]) async throws {}
        func disconnect() async {}
    }

    func session(over link: any SyncTransport) async throws -> SyncSummary {
        let directory = FileManager.default.temporaryDirectory
            .appendingPathComponent("ferry-refusal-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let thread = ThreadExecutor(name: "test-session")
        defer { thread.stop() }
        let path = directory.appendingPathComponent("ferry.sqlite").path
        let store = try await withTaskExecutorPreference(thread) { try GatewayStore(path: path) }
        let runner = SyncSessionRunner(
            peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, store: store, transport: link,
            configuration: SyncSession.Configuration(), log: NullLogSink())
        await LiveSessionDriver.run(runner: runner, events: LinkEvents(), thread: thread)
        #expect(runner.finished, "a refused start ends the session")
        return runner.summary
    }

    @Test func aRefusedStreamInfoReadIsRecordedAsSuch() async throws {
        let summary = try await session(over: RefusingLink(failsStreamInfo: true, verdict: true))
        #expect(summary.end == .disconnected(.streamInfoUnreadable("refused")))
        #expect(summary.refusedForSecurity)
    }

    @Test func aRefusedSubscriptionIsRecordedAsSuch() async throws {
        let summary = try await session(over: RefusingLink(failsStreamInfo: false, verdict: true))
        #expect(summary.end == .subscribeFailed("refused"))
        #expect(summary.refusedForSecurity)
    }

    @Test func otherFailuresAreNot() async throws {
        let judged = try await session(over: RefusingLink(failsStreamInfo: true, verdict: false))
        #expect(judged.end == .disconnected(.streamInfoUnreadable("refused")) && !judged.refusedForSecurity)
        // Text that reads like a refusal does not make one: only the transport's verdict does.
        let unjudged = try await session(over: FailingLink())
        #expect(unjudged.end == .disconnected(.streamInfoUnreadable("ATT error: 0x05 (text only)")))
        #expect(!unjudged.refusedForSecurity)
    }
}
