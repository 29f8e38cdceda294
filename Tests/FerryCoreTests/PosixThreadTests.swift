import FerryCore
import Foundation
import Synchronization
import Testing

#if canImport(Glibc)
    import Glibc
#endif

@Suite struct PosixThreadTests {
    static func commOfCurrentThread() -> String? {
        (try? String(contentsOfFile: "/proc/thread-self/comm", encoding: .utf8))?
            .trimmingCharacters(in: .whitespacesAndNewlines)
    }

    // Waits by continuation and Task.sleep, never by blocking: a blocked thread of the cooperative pool (two on
    // this machine) stalls every test running alongside.
    @Test func aThreadRunsItsBodyOffTheCallersThreadUnderItsName() async throws {
        let caller = pthread_self()
        let (started, seen) = await withCheckedContinuation {
            (continuation: CheckedContinuation<(Bool, (name: String?, other: Bool)?), Never>) in
            // Longer than the kernel keeps: cut at 15 bytes, not refused.
            let started = startThread(name: "ferry-test-thread-name") {
                continuation.resume(returning: (true, (Self.commOfCurrentThread(), pthread_equal(pthread_self(), caller) == 0)))
            }
            if !started { continuation.resume(returning: (false, nil)) }  // the body never runs then
        }
        #expect(started)
        let result = try #require(seen)
        #expect(result.name == "ferry-test-thre" && result.other)
    }

    @Test func aThreadTheSystemRefusesRunsNothingAndSaysSo() async throws {
        let ran = Mutex(false)
        // A stack no system can map: pthread_create fails.
        #expect(startThread(name: "ferry-too-big", stackSize: 1 << 60) { ran.withLock { $0 = true } } == false)
        try await Task.sleep(for: .milliseconds(50))
        #expect(!ran.withLock { $0 })
    }

    @Test func workForItsOwnThreadStillRunsWhenNoThreadCanStart() async {
        #expect(await runOnOwnThread(name: "ferry-too-big", stackSize: 1 << 60) { 42 } == 42)
    }
}
