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

    @Test func aThreadRunsItsBodyOffTheCallersThreadUnderItsName() async throws {
        let caller = pthread_self()
        let seen = Mutex<(name: String?, other: Bool)?>(nil)
        let done = DispatchSemaphore(value: 0)
        // Longer than the kernel keeps: cut at 15 bytes, not refused.
        #expect(startThread(name: "ferry-test-thread-name") {
            seen.withLock { $0 = (Self.commOfCurrentThread(), pthread_equal(pthread_self(), caller) == 0) }
            done.signal()
        })
        #expect(done.wait(timeout: .now() + 10) == .success)
        let result = try #require(seen.withLock { $0 })
        #expect(result.name == "ferry-test-thre" && result.other)
    }

    @Test func aThreadTheSystemRefusesRunsNothingAndSaysSo() {
        let ran = Mutex(false)
        // A stack no system can map: pthread_create fails.
        #expect(startThread(name: "ferry-too-big", stackSize: 1 << 60) { ran.withLock { $0 = true } } == false)
        usleep(50_000)
        #expect(!ran.withLock { $0 })
    }

    @Test func workForItsOwnThreadStillRunsWhenNoThreadCanStart() async {
        #expect(await runOnOwnThread(name: "ferry-too-big", stackSize: 1 << 60) { 42 } == 42)
    }
}
