import FerryCore
import Foundation
import Testing

/// An executor with a thread of its own (a sync session's, a store connection's, a test's fake side): jobs run
/// there, its one timer fires there, and work handed to it after it ended still runs.
@Suite struct ThreadExecutorTests {
    /// A session task prefers its session's thread; a task that outlives the thread (a cancelled timer waking to
    /// end) must still run — elsewhere — instead of being lost in a queue nobody serves.
    @Test func aTaskPreferringAThreadThatHasEndedStillRuns() async throws {
        let thread = ThreadExecutor(name: "ferry-test-end")
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

    /// What a timer's action saw: which thread ran it, and when.
    final class Firings: @unchecked Sendable {
        private let lock = NSLock()
        private var fired: [(label: String, onThread: Bool, at: ContinuousClock.Instant)] = []
        func record(_ label: String, onThread: Bool) { lock.withLock { fired.append((label, onThread, .now)) } }
        var all: [(label: String, onThread: Bool, at: ContinuousClock.Instant)] { lock.withLock { fired } }
    }

    @Test func theTimerFiresOnTheThreadAfterItsDelayAndOnlyTheLatestOne() async throws {
        let thread = ThreadExecutor(name: "test-timer")
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
        let thread = ThreadExecutor(name: "test-timer")
        defer { thread.stop() }
        let firings = Firings()
        thread.setTimer(after: 0.1) { firings.record("cancelled", onThread: true) }
        thread.setTimer(after: nil)
        try await Task.sleep(for: .milliseconds(500))
        #expect(firings.all.isEmpty)
    }

    /// A thread kept busy by jobs (a flood of notifications) still runs a timer that came due meanwhile.
    @Test func aDueTimerFiresWhileJobsKeepComing() async throws {
        let thread = ThreadExecutor(name: "test-timer")
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
        let thread = ThreadExecutor(name: "test-timer")
        defer { thread.stop() }
        let firings = Firings()
        thread.setTimer(after: .nan) { firings.record("nan", onThread: true) }
        thread.setTimer(after: .infinity) { firings.record("infinity", onThread: true) }
        try await Task.sleep(for: .milliseconds(200))
        #expect(firings.all.isEmpty)
    }
}
