import FerryCore
import Foundation
import Testing

/// The waiting loops' timeouts run on one deadline thread: in deadline order, not before their delay, never
/// once cancelled; and a `Wakeup` wait ends on its timeout through it.
@Suite struct DeadlineThreadTests {
    final class Runs: @unchecked Sendable {
        private let lock = NSLock()
        private var labels: [(String, String, ContinuousClock.Instant)] = []
        func record(_ label: String) {
            let thread = (try? String(contentsOfFile: "/proc/thread-self/comm", encoding: .utf8))?
                .trimmingCharacters(in: .whitespacesAndNewlines) ?? ""
            lock.withLock { labels.append((label, thread, .now)) }
        }
        var all: [(label: String, thread: String, at: ContinuousClock.Instant)] { lock.withLock { labels } }
    }

    @Test func actionsRunInDeadlineOrderAfterTheirDelayAndACancelledOneNever() async throws {
        let runs = Runs()
        let start = ContinuousClock.now
        DeadlineThread.shared.schedule(after: .milliseconds(150)) { runs.record("third") }
        DeadlineThread.shared.schedule(after: .milliseconds(50)) { runs.record("first") }
        let cancelled = DeadlineThread.shared.schedule(after: .milliseconds(80)) { runs.record("cancelled") }
        DeadlineThread.shared.schedule(after: .milliseconds(100)) { runs.record("second") }
        DeadlineThread.shared.cancel(cancelled)
        try await Task.sleep(for: .milliseconds(500))
        let all = runs.all
        #expect(all.map(\.label) == ["first", "second", "third"])
        #expect(all.allSatisfy { $0.thread == "ferry-deadlines" })
        if all.count == 3 {
            #expect(all[0].at - start >= .milliseconds(50))
            #expect(all[1].at - start >= .milliseconds(100))
            #expect(all[2].at - start >= .milliseconds(150))
        }
    }

    /// A delay that is not usable (negative) runs at once rather than trapping or never.
    @Test func aNegativeDelayRunsAtOnce() async throws {
        let runs = Runs()
        DeadlineThread.shared.schedule(after: .seconds(-5)) { runs.record("now") }
        try await Task.sleep(for: .milliseconds(200))
        #expect(runs.all.map(\.label) == ["now"])
    }

    /// A wait's timeout ends it (false) no earlier than asked; a wait ended by a signal leaves no timeout behind
    /// to cut the next wait short. Lower bounds only, and timeouts long enough that a loaded machine's delays
    /// cannot reorder them.
    @Test func aWakeupTimesOutThroughTheDeadlineThread() async throws {
        let wakeup = Wakeup()
        let start = ContinuousClock.now
        #expect(await !wakeup.wait(timeout: .milliseconds(80)))
        #expect(ContinuousClock.now - start >= .milliseconds(80))
        // Wait A (timeout 1 s) is ended by a signal; wait B (timeout 2 s) starts at once. A's timeout, were it
        // still scheduled, would end B about 1 s early.
        let a = Task { await wakeup.wait(timeout: .seconds(1)) }
        try await Task.sleep(for: .milliseconds(50))
        wakeup.signal()
        #expect(await a.value)
        let b = ContinuousClock.now
        #expect(await !wakeup.wait(timeout: .seconds(2)))
        #expect(ContinuousClock.now - b >= .seconds(2))
    }
}
