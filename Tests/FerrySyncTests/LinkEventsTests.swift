import FerryCore
import FerryProtocol
import FerryStore
import FerrySync
import Foundation
import Testing

/// The queue between a live link and its session loop, and what taking events in batches buys: frames that
/// piled up behind a commit are committed together.
@Suite struct LinkEventsTests {
    private func describe(_ batch: [LinkEvent]?) -> [String]? {
        batch?.map { event in
            switch event {
            case .bytes(let chunk): "bytes\(chunk)"
            case .linkEnded: "linkEnded"
            case .tick: "tick"
            case .stop: "stop"
            }
        }
    }

    @Test func queuedEventsComeAsOneBatchInOrder() async {
        let events = LinkEvents()
        events.yield(.bytes([1]))
        events.yield(.tick)
        events.yield(.bytes([2]))
        #expect(describe(await events.next()) == ["bytes[1]", "tick", "bytes[2]"])
        events.yield(.stop)
        #expect(describe(await events.next()) == ["stop"])
    }

    @Test func aWaitingLoopIsWokenByAnEventFromAnotherThread() async {
        let events = LinkEvents()
        let producer = Thread {
            usleep(50_000)
            events.yield(.bytes([7]))
        }
        producer.start()
        #expect(describe(await events.next()) == ["bytes[7]"])
    }

    @Test func finishDeliversWhatIsQueuedThenEnds() async {
        let events = LinkEvents()
        events.yield(.bytes([1]))
        events.finish()
        events.yield(.bytes([2]))  // after finish: dropped
        #expect(describe(await events.next()) == ["bytes[1]"])
        #expect(await events.next() == nil)
        #expect(await events.next() == nil)
    }

    /// A loop waiting for events is woken, with nil, by `finish()` and by its task's cancellation.
    @Test(arguments: ["finish", "cancel"])
    func aWaitingLoopIsEndedBy(_ ending: String) async {
        let events = LinkEvents()
        let waiting = Task { await events.next() }
        try? await Task.sleep(for: .milliseconds(50))
        if ending == "finish" { events.finish() } else { waiting.cancel() }
        #expect(await waiting.value == nil)
    }

    /// A session with window 100 and an ACK every 20, its store in a directory of its own (`remove()`), and six
    /// notifications of ten frames each (seq 1...60) for it.
    struct QueuedSession {
        let directory: URL
        let runner: SyncSessionRunner
        let notifications: [[UInt8]]

        init(log: any LogSink = NullLogSink()) throws {
            directory = FileManager.default.temporaryDirectory.appendingPathComponent("ferry-queued-\(UUID().uuidString)")
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
            let store = try GatewayStore(path: directory.appendingPathComponent("ferry.sqlite").path)
            var configuration = SyncSession.Configuration()
            configuration.window = 100
            configuration.ackBatch = 20
            runner = SyncSessionRunner(
                peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, store: store,
                transport: SessionThreadTests.QuietLink(), configuration: configuration, log: log)
            notifications = stride(from: UInt64(1), through: 51, by: 10).map { first in
                (first..<(first + 10)).flatMap { Frame.data(seq: $0, payload: [UInt8($0)]).encoded() }
            }
        }

        func remove() { try? FileManager.default.removeItem(at: directory) }
    }

    /// DATA waiting for a blocked loop is bounded: a chunk past the byte budget is dropped and counted; events
    /// that are not DATA always get through, and the budget is free again once the loop took the queue.
    @Test func dataPastTheByteBudgetIsDroppedAndCounted() async {
        let events = LinkEvents(byteBudget: 10)
        events.yield(.bytes([1, 1, 1, 1]))
        events.yield(.bytes([2, 2, 2, 2]))
        events.yield(.bytes([3, 3, 3, 3]))  // 12 bytes: over
        events.yield(.bytes([4, 4]))  // exactly 10: fits
        events.yield(.tick)
        events.yield(.linkEnded)
        #expect(events.droppedChunks == 1)
        #expect(describe(await events.next()) == ["bytes[1, 1, 1, 1]", "bytes[2, 2, 2, 2]", "bytes[4, 4]", "tick", "linkEnded"])
        events.yield(.bytes([5, 5, 5, 5, 5, 5, 5, 5, 5, 5]))
        #expect(events.droppedChunks == 1)
        #expect(describe(await events.next()) == ["bytes[5, 5, 5, 5, 5, 5, 5, 5, 5, 5]"])
    }

    /// A session whose queue overflowed while it was blocked stores what fit, acknowledges nothing past it, and
    /// says what was dropped.
    @Test func aSessionWhoseQueueOverflowedSaysSoAndAcknowledgesOnlyWhatItStored() async throws {
        let lines = SessionEndTests.Lines()
        let session = try QueuedSession(log: lines)
        defer { session.remove() }
        let runner = session.runner
        // Room for three of the six notifications: the loop has not run yet, as if blocked in a commit.
        let events = LinkEvents(byteBudget: session.notifications[0].count * 3)
        for notification in session.notifications { events.yield(.bytes(notification)) }
        events.yield(.linkEnded)
        #expect(events.droppedChunks == 3)
        let thread = ThreadExecutor(name: "test-session")
        defer { thread.stop() }
        await LiveSessionDriver.run(runner: runner, events: events, thread: thread)
        #expect(runner.summary.framesStored == 30)
        #expect(runner.acksSent.recent.allSatisfy { $0 <= 30 })
        #expect(runner.summary.end == .linkLost)
        let warnings = lines.lines.withLock { $0 }.filter { $0.hasPrefix("warning") && $0.contains("dropped 3 DATA") }
        #expect(warnings.count == 1)
    }

    /// The size of each commit, in order.
    final class CommitSizes: SessionMetrics, @unchecked Sendable {
        private let lock = NSLock()
        private var sizes: [Int] = []
        func received(bytes: Int) {}
        func stored(frames: Int) { lock.withLock { sizes.append(frames) } }
        var commits: [Int] { lock.withLock { sizes } }
    }

    /// Six notifications of ten frames arrive while the loop is busy (here: before it runs). With window 100
    /// and an ACK every 20, the first cadence is committed as soon as it is complete, and the 40 frames that
    /// arrived behind it in one transaction: two commits, not three, and the peripheral still sees an ACK
    /// at every cadence boundary.
    @Test func framesQueuedBehindACommitAreCommittedAsOneGroup() async throws {
        let session = try QueuedSession()
        defer { session.remove() }
        let runner = session.runner
        let commits = CommitSizes()
        runner.metrics = commits
        let events = LinkEvents()
        for notification in session.notifications { events.yield(.bytes(notification)) }
        events.yield(.linkEnded)
        let thread = ThreadExecutor(name: "test-session")
        defer { thread.stop() }
        await LiveSessionDriver.run(runner: runner, events: events, thread: thread)
        #expect(runner.summary.framesStored == 60)
        #expect(commits.commits == [20, 40])
        #expect(runner.acksSent.recent == [20, 40, 60])
        #expect(runner.summary.end == .linkLost)
    }
}
