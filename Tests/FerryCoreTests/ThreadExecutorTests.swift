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

    /// The loop's coarse clock is CLOCK_MONOTONIC as of the last tick: never ahead of it (a deadline read from it
    /// is never early) and not far behind.
    @Test func theCoarseClockIsTheMonotonicOneAFewMillisecondsBehindAtMost() {
        for _ in 0..<100 {
            let coarse = coarseMonotonicNanoseconds()
            let fine = monotonicNanoseconds()
            #expect(coarse <= fine)
            #expect(fine - coarse < 50_000_000, "\(fine - coarse) ns behind")
        }
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

    // MARK: - A watched descriptor

    /// Both ends of a SOCK_SEQPACKET pair (what AcquireNotify hands over), closed when it goes away.
    /// Close-on-exec, as libdbus receives descriptors: a process another test spawns meanwhile would otherwise keep
    /// the peer end open, and closing ours would not be the end of file the test waits for.
    final class SocketPair: @unchecked Sendable {
        let ours: Int32
        private(set) var peer: Int32
        init() throws {
            var fds: [Int32] = [-1, -1]
            guard socketpair(AF_UNIX, Int32(SOCK_SEQPACKET.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0, &fds) == 0 else {
                throw POSIXError(.init(rawValue: errno) ?? .EIO)
            }
            ours = fds[0]
            peer = fds[1]
        }
        func send(_ bytes: [UInt8]) { _ = bytes.withUnsafeBytes { Glibc.send(peer, $0.baseAddress, $0.count, 0) } }
        func closePeer() {
            _ = close(peer)
            peer = -1
        }
        /// One non-blocking read of ours: the message, [] at end of file, nil when nothing waits.
        func receive() -> [UInt8]? {
            var buffer = [UInt8](repeating: 0, count: 256)
            let n = buffer.withUnsafeMutableBytes { recv(ours, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
            return n >= 0 ? Array(buffer[0..<n]) : nil
        }
        deinit {
            _ = close(ours)
            if peer >= 0 { _ = close(peer) }
        }
    }

    /// What a watch's handler read, and on which thread.
    final class Reads: @unchecked Sendable {
        private let lock = NSLock()
        private var messages: [[UInt8]] = []
        private var offThread = 0
        private var ended = false
        func record(_ message: [UInt8]?, onThread: Bool) {
            lock.withLock {
                if let message { messages.append(message) } else { ended = true }
                if !onThread { offThread += 1 }
            }
        }
        var all: [[UInt8]] { lock.withLock { messages } }
        var sawEnd: Bool { lock.withLock { ended } }
        var callsOffThread: Int { lock.withLock { offThread } }
    }

    /// A handler that drains the socket and stops watching at end of file.
    static func draining(_ pair: SocketPair, into reads: Reads, thread: ThreadExecutor) -> @Sendable () -> Bool {
        {
            while let message = pair.receive() {
                if message.isEmpty {
                    reads.record(nil, onThread: thread.isCurrent)
                    return false
                }
                reads.record(message, onThread: thread.isCurrent)
            }
            return true
        }
    }

    /// A thread watching a fresh socket pair with a draining handler; the watch's token (nil: refused).
    static func watching() throws -> (ThreadExecutor, SocketPair, Reads, token: UInt64?) {
        let thread = ThreadExecutor(name: "test-watch")
        let pair = try SocketPair()
        let reads = Reads()
        return (thread, pair, reads, thread.watch(pair.ours, draining(pair, into: reads, thread: thread)))
    }

    static func waitUntil(_ seconds: Double = 5, _ condition: () -> Bool) async throws {
        let end = ContinuousClock.now + .seconds(seconds)
        while !condition() && ContinuousClock.now < end { try await Task.sleep(for: .milliseconds(5)) }
    }

    /// A live session's notification socket is read by the session's thread while it has nothing else to do, in
    /// the order sent; at end of file the handler ends the watch.
    @Test func aWatchedDescriptorIsReadOnTheThreadInOrderUntilItsEnd() async throws {
        let (thread, pair, reads, token) = try Self.watching()
        defer { thread.stop() }
        #expect(token != nil)
        for i in 0..<50 { pair.send([UInt8(i), 0xAA]) }
        try await Self.waitUntil { reads.all.count == 50 }
        #expect(reads.all == (0..<50).map { [UInt8($0), 0xAA] })
        pair.closePeer()
        try await Self.waitUntil { reads.sawEnd }
        #expect(reads.sawEnd)
        #expect(reads.callsOffThread == 0)
        // Jobs still run after the watch ended by itself.
        #expect(await Task(executorPreference: thread) { thread.isCurrent }.value)
    }

    /// The thread sleeps in poll() while watching: a job, a timer and the descriptor each wake it.
    @Test func jobsAndTheTimerStillWakeAThreadThatWatches() async throws {
        let (thread, pair, reads, _) = try Self.watching()
        defer { thread.stop() }
        try await Task.sleep(for: .milliseconds(50))  // asleep in poll()
        for _ in 0..<20 {
            #expect(await Task(executorPreference: thread) { thread.isCurrent }.value)
        }
        let firings = Firings()
        let start = ContinuousClock.now
        thread.setTimer(after: 0.1) { firings.record("due", onThread: thread.isCurrent) }
        try await Self.waitUntil { !firings.all.isEmpty }
        #expect(firings.all.map(\.label) == ["due"])
        #expect(firings.all.allSatisfy { $0.onThread })
        if let first = firings.all.first { #expect(first.at - start >= .milliseconds(100)) }
        pair.send([1])
        try await Self.waitUntil { reads.all.count == 1 }
        #expect(reads.all == [[1]])
    }

    /// A thread kept busy by jobs still reads its watched descriptor (within some 10 ms), instead of leaving the
    /// peer's messages in the kernel until the queue runs dry.
    @Test func aBusyThreadStillReadsItsWatchedDescriptor() async throws {
        let (thread, pair, reads, _) = try Self.watching()
        defer { thread.stop() }
        let sent = await withTaskExecutorPreference(thread) { () -> Bool in
            pair.send([7])
            let end = ContinuousClock.now + .seconds(3)
            // Each yield queues this task again on the thread: there is always a job when it looks for work.
            while ContinuousClock.now < end && reads.all.isEmpty { await Task.yield() }
            return true
        }
        #expect(sent)
        #expect(reads.all == [[7]])
        #expect(reads.callsOffThread == 0)
    }

    /// Ending a watch: its clean-up runs on the thread after any read in progress, and nothing is read after it;
    /// once the thread has ended, the clean-up runs at once where it was asked for.
    @Test func endingAWatchRunsItsCleanUpOnTheThreadAndStopsTheReads() async throws {
        let (thread, pair, reads, watchToken) = try Self.watching()
        let token = try #require(watchToken)
        pair.send([1])
        try await Self.waitUntil { reads.all.count == 1 }
        let cleanUp = Firings()
        thread.endWatch(token) { cleanUp.record("end", onThread: thread.isCurrent) }
        try await Self.waitUntil { !cleanUp.all.isEmpty }
        #expect(cleanUp.all.map(\.label) == ["end"])
        #expect(cleanUp.all.allSatisfy { $0.onThread })
        pair.send([2])
        try await Task.sleep(for: .milliseconds(200))
        #expect(reads.all == [[1]], "read after the watch ended")
        #expect(pair.receive() == [2], "the message stays for whoever reads the socket next")

        thread.stop()
        try await Task.sleep(for: .milliseconds(200))  // the thread finds nothing left and ends
        let afterEnd = Firings()
        #expect(thread.watch(pair.ours, Self.draining(pair, into: reads, thread: thread)) == nil)
        thread.endWatch(token) { afterEnd.record("inline", onThread: thread.isCurrent) }
        #expect(afterEnd.all.map(\.label) == ["inline"])
    }
}
