import FerryCore
import FerryProtocol
import FerryStore
import FerrySync
import Foundation
import Testing

/// A live session driven with its store's thread as executor: every commit (and so every sqlite3 call of the
/// session) runs on that thread, not on the cooperative pool, and the session still ends as it should.
@Suite struct SessionThreadTests {
    /// A link that accepts every write (pure logic: the events are fed by the test).
    final class QuietLink: SyncTransport {
        var hasStreamInfo: Bool { false }
        func readStreamInfo() async throws -> [UInt8] { throw TransportError("no STREAM_INFO") }
        func subscribe() async throws {}
        func writeControl(_ bytes: [UInt8]) async throws {}
        func writeAck(_ bytes: [UInt8]) async throws {}
        func disconnect() async {}
    }

    /// Records, per commit, whether it ran on the session's thread.
    final class CommitThreads: SessionMetrics, @unchecked Sendable {
        let thread: ThreadExecutor
        private let lock = NSLock()
        private var onThread: [Bool] = []
        init(thread: ThreadExecutor) { self.thread = thread }
        func received(bytes: Int) {}
        func stored(frames: Int) {
            let current = thread.isCurrent
            lock.withLock { onThread.append(current) }
        }
        var commits: [Bool] { lock.withLock { onThread } }
    }

    /// A session thread and a runner over a new store in its own directory, the store opened on that thread.
    final class Bench {
        let directory: URL
        let thread: ThreadExecutor
        let runner: SyncSessionRunner

        init(_ name: String, configuration: SyncSession.Configuration, log: any LogSink = NullLogSink()) async throws {
            directory = FileManager.default.temporaryDirectory.appendingPathComponent("ferry-\(name)-\(UUID().uuidString)")
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
            let path = directory.appendingPathComponent("ferry.sqlite").path
            thread = ThreadExecutor(name: "test-session")
            let store = try await withTaskExecutorPreference(thread) { try GatewayStore(path: path) }
            runner = SyncSessionRunner(
                peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, store: store, transport: QuietLink(),
                configuration: configuration, log: log)
        }

        func close() {
            thread.stop()
            try? FileManager.default.removeItem(at: directory)
        }
    }

    @Test func commitsRunOnTheSessionsThread() async throws {
        var configuration = SyncSession.Configuration()
        configuration.window = 60
        configuration.ackBatch = 20
        let bench = try await Bench("thread", configuration: configuration)
        defer { bench.close() }
        let (thread, runner) = (bench.thread, bench.runner)
        let counters = CommitThreads(thread: thread)
        runner.metrics = counters
        let events = LinkEvents()
        // One window of 60 frames, ten per notification, then the link drops: all of it reaches the session before
        // its first commit runs, so 1-20 are committed, then 21-60 as one group.
        for first in stride(from: UInt64(1), through: 51, by: 10) {
            let bytes = (first..<(first + 10)).flatMap { Frame.data(seq: $0, payload: [UInt8($0 % 251)]).encoded() }
            events.yield(.bytes(bytes))
        }
        events.yield(.linkEnded)
        #expect(!thread.isCurrent)
        await LiveSessionDriver.run(runner: runner, events: events, thread: thread)
        #expect(runner.summary.framesStored == 60)
        #expect(runner.summary.end == .linkLost)
        #expect(counters.commits.count >= 2)
        #expect(counters.commits.allSatisfy { $0 }, "a commit ran off the session's thread: \(counters.commits)")
    }

    /// A peripheral that sends past the window: the session keeps one window, drops the rest, and says so when
    /// the session ends, here by losing its link (not only when it ends in order).
    @Test func framesPastTheWindowAreDroppedAndReportedWhenTheLinkDrops() async throws {
        var configuration = SyncSession.Configuration()
        configuration.window = 20
        configuration.ackBatch = 20
        let lines = SessionEndTests.Lines()
        let bench = try await Bench("past-window", configuration: configuration, log: lines)
        defer { bench.close() }
        let events = LinkEvents()
        events.yield(.bytes((1...50).flatMap { Frame.data(seq: $0, payload: [UInt8($0)]).encoded() }))
        events.yield(.linkEnded)
        await LiveSessionDriver.run(runner: bench.runner, events: events, thread: bench.thread)
        #expect(bench.runner.summary.framesStored == 20)
        #expect(bench.runner.summary.end == .linkLost)
        #expect(bench.runner.machine.statistics.pastWindow == 1)
        let warnings = lines.lines.withLock { $0 }.filter { $0.contains("past the window") }
        #expect(warnings == ["warning C0:FF:EE:00:00:01: the peripheral sent 1 frames past the window of 20: dropped and asked for again (it does not keep to the window)"])
    }

    /// The deadlines come from the thread's own timer: a partial window is committed and acknowledged when DATA
    /// goes quiet (idle timeout), and a peripheral without STREAM_INFO that stays silent after it is caught up
    /// (response timeout). Nothing else would end this session: no link loss, no stop.
    @Test func theThreadsTimerCommitsAPartialWindowAndEndsTheSession() async throws {
        var configuration = SyncSession.Configuration()
        configuration.idleTimeout = 0.1
        configuration.responseTimeout = 0.3
        let bench = try await Bench("timer", configuration: configuration)
        defer { bench.close() }
        let runner = bench.runner
        let events = LinkEvents()
        events.yield(.bytes((1...5).flatMap { Frame.data(seq: $0, payload: [UInt8($0)]).encoded() }))
        // Only if the timer never fires: ends the session the way that fails every expectation below.
        let guardrail = Task {
            try? await Task.sleep(for: .seconds(20))
            events.yield(.linkEnded)
        }
        defer { guardrail.cancel() }
        await LiveSessionDriver.run(runner: runner, events: events, thread: bench.thread)
        #expect(runner.summary.framesStored == 5)
        #expect(runner.acksSent.first == 5)
        #expect(runner.summary.end == .disconnected(.caughtUp))
    }
}
