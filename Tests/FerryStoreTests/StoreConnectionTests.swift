import FerryCore
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

    /// A store handed from the opener to its user is taken once, and used on the taker's thread: the connection
    /// has one owner at a time.
    @Test func aHandedOffStoreIsTakenOnceAndUsedOnTheTakersThread() async throws {
        let dir = try TemporaryDirectory()
        let handoff = StoreHandoff(try GatewayStore(path: dir.file("ferry.sqlite")))
        let thread = ThreadExecutor(name: "ferry-test-take")
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
}
