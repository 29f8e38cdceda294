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
        let firstPostAt = LockedValue<ContinuousClock.Instant?>(nil)
        func post(body: [UInt8], idempotencyKey: String, token: BearerToken?) async -> UplinkAttempt {
            posted.withLock { $0 += 1 }
            firstPostAt.withLock { $0 = $0 ?? .now }
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

    /// A forwarder on `newEvents` with the given heartbeat (and a lease long enough not to wake it sooner), on a
    /// store of its own, running until the test lets go of it.
    final class Running {
        let directory: URL
        let store: GatewayStore
        let poster = Accepting()
        let wakeup = Wakeup()
        let turns = LockedValue(0)
        let firstTurnAt = LockedValue<ContinuousClock.Instant?>(nil)
        let ended = LockedValue<String?>(nil)
        let task: Task<Void, Never>

        /// Started, and past its first turn.
        static func started(heartbeatSeconds: Double) async throws -> Running {
            let running = try Running(heartbeatSeconds: heartbeatSeconds)
            try await running.firstTurnTaken()
            return running
        }

        private init(heartbeatSeconds: Double) throws {
            directory = try TestSupport.temporaryDirectory()
            let path = directory.appendingPathComponent("ferry.sqlite").path
            store = try GatewayStore(path: path)
            var configuration = ForwarderConfiguration(gatewayID: "test")
            configuration.newEvents = wakeup
            configuration.heartbeatSeconds = heartbeatSeconds
            configuration.leaseSeconds = max(120, heartbeatSeconds * 4)
            configuration.idlePollSeconds = 0.01  // must not be used while `newEvents` is set
            let (turns, firstTurnAt) = (self.turns, self.firstTurnAt)
            configuration.onProgress = { _ in
                turns.withLock { $0 += 1 }
                firstTurnAt.withLock { $0 = $0 ?? .now }
            }
            let forwarder = try OutboxForwarder(databasePath: path, poster: poster, configuration: configuration)
            let ended = self.ended
            task = Task {
                do {
                    _ = try await forwarder.run(untilEmpty: false)
                    ended.withLock { $0 = "returned" }
                } catch {
                    ended.withLock { $0 = "threw \(error)" }
                }
            }
        }

        deinit {
            task.cancel()
            try? FileManager.default.removeItem(at: directory)
        }

        /// Waits for the forwarder's first turn (it found nothing) and lets it go to sleep. The whole test run
        /// shares two cooperative threads on a 2-core machine, so starting may take a while: the bound is loose.
        private func firstTurnTaken() async throws {
            #expect(await ForwarderWakeTests.eventually(within: 120) { turns.withLock { $0 } >= 1 || ended.withLock { $0 } != nil })
            try #require(ended.withLock { $0 } == nil, "the forwarder ended: \(ended.withLock { $0 } ?? "")")
            try #require(turns.withLock { $0 } >= 1, "no turn of the forwarder within 120 s")
            // From its first progress report to its sleep the forwarder runs on its own thread: no waiting on the pool.
            try await Task.sleep(for: .milliseconds(300))
        }
    }

    // Only lower bounds on time, or a wake that can only be the signal: delays on a loaded machine make these
    // tests slower, never wrong.

    @Test func withoutASignalTheIdleForwarderWaitsForItsHeartbeatNotItsPollInterval() async throws {
        let forwarder = try await Running.started(heartbeatSeconds: 6)

        // Committed without a signal: nothing goes out before the heartbeat's turn (6 s after the first), although
        // idlePollSeconds is 10 ms. Measured on the forwarder's side, so a late test task cannot blur it.
        try Self.commit(forwarder.store, window: 0)
        #expect(await Self.eventually(within: 120) { forwarder.poster.posted.withLock { $0 } == 1 })
        let sinceFirstTurn = try #require(forwarder.poster.firstPostAt.withLock { $0 })
            - #require(forwarder.firstTurnAt.withLock { $0 })
        #expect(sinceFirstTurn >= .milliseconds(5900), "posted \(sinceFirstTurn) after the first turn")
        #expect(try await Self.eventually(within: 60) { try forwarder.store.undeliveredCount() == 0 })
    }

    @Test func aSignalSendsWhatWasJustCommitted() async throws {
        // The forwarder's next wake without a signal is an hour away: a post is the signal's doing.
        let forwarder = try await Running.started(heartbeatSeconds: 3600)

        try Self.commit(forwarder.store, window: 0)
        forwarder.wakeup.signal()
        #expect(await Self.eventually(within: 120) { forwarder.poster.posted.withLock { $0 } == 1 })
        #expect(try await Self.eventually(within: 60) { try forwarder.store.undeliveredCount() == 0 })
    }
}

/// The lease records the kernel's boot id, so that a pid left over from before a reboot is not taken for a
/// live forwarder.
@Suite struct ForwarderBootIDTests {
    @Test func bootIDIsTheKernelsTrimmed() throws {
        let kernel = try String(contentsOfFile: "/proc/sys/kernel/random/boot_id", encoding: .utf8)
        #expect(OutboxForwarder.bootID == kernel.trimmingCharacters(in: .whitespacesAndNewlines))
        #expect(OutboxForwarder.bootID.count == 36)
    }
}
