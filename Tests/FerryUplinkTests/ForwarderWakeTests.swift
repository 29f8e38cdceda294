import FerryCore
import FerryProtocol
import FerryStore
import Foundation
import Testing

@testable import FerryUplink

/// With `newEvents`, an idle forwarder sleeps until it is signalled (the daemon signals per commit) instead of
/// polling the store every second; a signal makes it send what was just committed without waiting for its
/// heartbeat.
@Suite struct ForwarderWakeTests {
    /// Accepts every batch and remembers how many frames arrived.
    final class Accepting: BatchPosting, Sendable {
        let posted = LockedValue(0)
        func post(body: [UInt8], idempotencyKey: String, token: BearerToken?) async -> UplinkAttempt {
            posted.withLock { $0 += 1 }
            return UplinkAttempt(
                outcome: .completed(status: 200), status: 200, sentBodyBytes: body.count, compressed: false,
                elapsedSeconds: 0, responseSnippet: "")
        }
    }

    static func commit(_ store: GatewayStore, window: UInt64) throws {
        let stream = try store.openStream(peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, deviceEpoch: 7)
        let first = window * 20 + 1
        let frames = (first...(first + 19)).map { Frame.data(seq: $0, payload: [1, 2, 3]) }
        try store.commit(
            CommitBatch(expectedCursor: first - 1, gap: nil, frames: frames, newCursor: first + 19, acknowledge: true),
            to: stream.key)
    }

    /// Polls `condition` every 10 ms until it holds or `seconds` pass.
    static func eventually(within seconds: Double, _ condition: () throws -> Bool) async rethrows -> Bool {
        let deadline = ContinuousClock.now + .milliseconds(Int64(seconds * 1000))
        while ContinuousClock.now < deadline {
            if try condition() { return true }
            try? await Task.sleep(for: .milliseconds(10))
        }
        return try condition()
    }

    @Test func aSignalSendsWhatWasJustCommittedAndWithoutOneTheIdleForwarderWaitsForItsHeartbeat() async throws {
        let directory = try TestSupport.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: directory) }
        let path = directory.appendingPathComponent("ferry.sqlite").path
        let store = try GatewayStore(path: path)
        let poster = Accepting()
        let wakeup = Wakeup()
        var configuration = ForwarderConfiguration(gatewayID: "test")
        configuration.newEvents = wakeup
        configuration.heartbeatSeconds = 6
        configuration.idlePollSeconds = 0.01  // must not be used while `newEvents` is set
        let turns = LockedValue(0)
        configuration.onProgress = { _ in turns.withLock { $0 += 1 } }
        let forwarder = try OutboxForwarder(databasePath: path, poster: poster, configuration: configuration)
        let ended = LockedValue<String?>(nil)
        let running = Task {
            do {
                _ = try await forwarder.run(untilEmpty: false)
                ended.withLock { $0 = "returned" }
            } catch {
                ended.withLock { $0 = "threw \(error)" }
            }
        }
        defer { running.cancel() }
        // The forwarder's first turn found nothing and went to sleep (a loaded machine may take a while to start it).
        #expect(await Self.eventually(within: 20) { turns.withLock { $0 } >= 1 || ended.withLock { $0 } != nil })
        try #require(ended.withLock { $0 } == nil, "the forwarder ended: \(ended.withLock { $0 } ?? "")")
        try #require(turns.withLock { $0 } >= 1, "no turn of the forwarder within 20 s")
        try await Task.sleep(for: .milliseconds(300))

        // Committed without a signal: nothing goes out before the heartbeat (6 s), although idlePollSeconds is 10 ms.
        try Self.commit(store, window: 0)
        try await Task.sleep(for: .seconds(1.5))
        #expect(poster.posted.withLock { $0 } == 0)
        #expect(await Self.eventually(within: 20) { poster.posted.withLock { $0 } == 1 })

        // Committed and signalled: sent long before the next heartbeat.
        try await Task.sleep(for: .milliseconds(300))
        try Self.commit(store, window: 1)
        let signalled = ContinuousClock.now
        wakeup.signal()
        #expect(await Self.eventually(within: 10) { poster.posted.withLock { $0 } == 2 })
        #expect(ContinuousClock.now - signalled < .seconds(4))  // the heartbeat would take ~6 s
        #expect(try await Self.eventually(within: 10) { try store.undeliveredCount() == 0 })  // settled after the post
    }
}
