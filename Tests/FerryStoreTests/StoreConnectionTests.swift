import FerryProtocol
import FerryStore
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// A store confined to its own thread (GRDB's serial queue per connection): every call runs there, never on the
/// cooperative pool, one at a time, and errors come back to the caller.
@Suite struct StoreConnectionTests {
    /// The calling thread's name, as the kernel knows it.
    static func threadName() -> String {
        ((try? String(contentsOfFile: "/proc/thread-self/comm", encoding: .utf8)) ?? "")
            .trimmingCharacters(in: .whitespacesAndNewlines)
    }

    /// A session task prefers its session's thread; a task that outlives the thread (a cancelled timer waking to
    /// end) must still run — elsewhere — instead of being lost in a queue nobody serves.
    @Test func aTaskPreferringAThreadThatHasEndedStillRuns() async throws {
        let thread = DatabaseThread(name: "ferry-test-end")
        let onThread = await Task(executorPreference: thread) { thread.isCurrent }.value
        #expect(onThread)
        thread.stop()
        try await Task.sleep(for: .milliseconds(200))  // the thread finds nothing left and ends
        let ran = await withTaskGroup(of: Bool.self) { group in
            group.addTask { await Task(executorPreference: thread) { true }.value }
            group.addTask {
                try? await Task.sleep(for: .seconds(20))
                return false
            }
            let first = await group.next() ?? false
            group.cancelAll()
            return first
        }
        #expect(ran, "a job enqueued after the thread ended was never run")
    }

    /// A store handed from the opener to its user is taken once, and used on the taker's thread: the connection
    /// has one owner at a time.
    @Test func aHandedOffStoreIsTakenOnceAndUsedOnTheTakersThread() async throws {
        let dir = try TemporaryDirectory()
        let handoff = StoreHandoff(try GatewayStore(path: dir.file("ferry.sqlite")))
        let thread = DatabaseThread(name: "ferry-test-take")
        defer { thread.stop() }
        let (taken, name) = try await withTaskExecutorPreference(thread) {
            () async throws -> (Bool, String) in
            guard let store = handoff.take() else { return (false, "") }
            _ = try store.outboxCounts()
            return (true, Self.threadName())
        }
        #expect(taken)
        #expect(name == "ferry-test-take")
        #expect(handoff.take() == nil)
    }

    @Test func callsRunOnTheConnectionsOwnThreadOneAtATime() async throws {
        let dir = try TemporaryDirectory()
        let connection = try await StoreConnection.open(path: dir.file("ferry.sqlite"), threadName: "ferry-test-db")
        #expect(!connection.runsOnItsOwnThread, "the test itself runs on the pool")
        let names = try await connection.read { _ in Self.threadName() }
        #expect(names == "ferry-test-db")
        // Concurrent callers are serialised by the actor: every commit of a stream sees the cursor of the one
        // before (a race would surface as StoreError.cursorMismatch).
        let key = try await connection.read { try $0.openStream(peripheral: testPeripheral, deviceEpoch: 7).key }
        try await withThrowingTaskGroup(of: Bool.self) { group in
            for _ in 0..<8 {
                group.addTask {
                    try await connection.read { store in
                        let cursor = try store.openStream(peripheral: testPeripheral, deviceEpoch: 7).cursor
                        let frames = dataFrames((cursor + 1)...(cursor + 5))
                        _ = try store.commit(
                            CommitBatch(expectedCursor: cursor, gap: nil, frames: frames, newCursor: cursor + 5, acknowledge: true),
                            to: key)
                        return connection.runsOnItsOwnThread
                    }
                }
            }
            for try await onItsThread in group { #expect(onItsThread) }
        }
        #expect(try await connection.read { try $0.openStream(peripheral: testPeripheral, deviceEpoch: 7).cursor } == 40)
        struct Refused: Error {}
        await #expect(throws: Refused.self) { try await connection.read { _ in throw Refused() } }
    }

    /// What a timer's action saw: which thread ran it, and when.
    final class Firings: @unchecked Sendable {
        private let lock = NSLock()
        private var fired: [(label: String, onThread: Bool, at: ContinuousClock.Instant)] = []
        func record(_ label: String, onThread: Bool) { lock.withLock { fired.append((label, onThread, .now)) } }
        var all: [(label: String, onThread: Bool, at: ContinuousClock.Instant)] { lock.withLock { fired } }
    }

    @Test func theTimerFiresOnTheThreadAfterItsDelayAndOnlyTheLatestOne() async throws {
        let thread = DatabaseThread(name: "test-timer")
        defer { thread.stop() }
        let firings = Firings()
        let start = ContinuousClock.now
        thread.setTimer(after: 5) { firings.record("replaced", onThread: thread.isCurrent) }
        thread.setTimer(after: 0.2) { firings.record("latest", onThread: thread.isCurrent) }
        try await Task.sleep(for: .seconds(1))
        let all = firings.all
        #expect(all.map(\.label) == ["latest"])
        #expect(all.allSatisfy { $0.onThread })
        if let first = all.first { #expect(first.at - start >= .milliseconds(200)) }
    }

    @Test func aCancelledTimerNeverFires() async throws {
        let thread = DatabaseThread(name: "test-timer")
        defer { thread.stop() }
        let firings = Firings()
        thread.setTimer(after: 0.1) { firings.record("cancelled", onThread: true) }
        thread.setTimer(after: nil)
        try await Task.sleep(for: .milliseconds(500))
        #expect(firings.all.isEmpty)
    }

    /// A thread kept busy by jobs (a flood of notifications) still runs a timer that came due meanwhile.
    @Test func aDueTimerFiresWhileJobsKeepComing() async throws {
        let thread = DatabaseThread(name: "test-timer")
        defer { thread.stop() }
        let firings = Firings()
        thread.setTimer(after: 0.05) { firings.record("due", onThread: thread.isCurrent) }
        await withTaskExecutorPreference(thread) {
            let end = ContinuousClock.now + .milliseconds(400)
            // Each yield queues this task again on the thread: there is always a job when it looks for work.
            while ContinuousClock.now < end && firings.all.isEmpty {
                await Task.yield()
            }
        }
        #expect(firings.all.map(\.label) == ["due"])
        #expect(firings.all.allSatisfy { $0.onThread })
    }

    /// A delay that is not a number, or absurdly far, waits "forever" instead of trapping in the conversion.
    @Test func anUnusableDelayNeitherTrapsNorFires() async throws {
        let thread = DatabaseThread(name: "test-timer")
        defer { thread.stop() }
        let firings = Firings()
        thread.setTimer(after: .nan) { firings.record("nan", onThread: true) }
        thread.setTimer(after: .infinity) { firings.record("infinity", onThread: true) }
        try await Task.sleep(for: .milliseconds(200))
        #expect(firings.all.isEmpty)
    }
}
