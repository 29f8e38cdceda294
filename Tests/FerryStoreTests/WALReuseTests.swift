import FerryCore
import FerryProtocol
import FerryStore
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// A one-shot writer's WAL file outlives its process without costing the next one a recovery: the next process
/// writes over the same file (it does not grow), reads back everything committed, and the store stays intact.
@Suite(.serialized) struct WALReuseTests {
    static func walSize(_ path: String) -> Int64? { fileSize(atPath: path + "-wal") }

    static func walInode(_ path: String) -> UInt64? {
        var info = stat()
        guard stat(path + "-wal", &info) == 0 else { return nil }
        return UInt64(info.st_ino)
    }

    /// Commits `windows` windows of 20 frames on a fresh connection that keeps its WAL on close.
    static func syncLikeProcess(_ path: String, windows: Int) throws {
        let store = try GatewayStore(path: path, clock: FixedClock())
        store.keepsWALOnClose = true
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        var cursor = stream.cursor
        for _ in 0..<windows {
            try store.commit(batch(from: cursor, dataFrames((cursor + 1)...(cursor + 20), payloadSize: 60)), to: stream.key)
            cursor += 20
        }
    }

    @Test func theNextProcessWritesOverTheKeptWALInsteadOfGrowingANewOne() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("reuse.sqlite")
        try Self.syncLikeProcess(path, windows: 40)
        let kept = try #require(Self.walSize(path), "the WAL file was deleted on close")
        let inode = try #require(Self.walInode(path))
        #expect(kept > 100 * 4096)
        for _ in 0..<3 {
            try Self.syncLikeProcess(path, windows: 40)
            // The same file, written over: it grows only when a process writes more frames than any before it.
            #expect(Self.walInode(path) == inode)
            #expect(try #require(Self.walSize(path)) <= kept + kept / 10)
        }
        // A read-only opener first (`ferry status` after a sync): it recovers the kept WAL itself.
        do {
            let readOnly = try GatewayStore.openReadOnly(path: path)
            #expect(try readOnly.count("SELECT count(*) FROM staged_frames") == 4 * 40 * 20)
        }
        let store = try GatewayStore(path: path, clock: FixedClock())
        // What the next open recovers from the kept WAL is the one rewinding frame, not the frames before it.
        var framesInWAL: Int64 = -1
        try store.database.prepare("PRAGMA wal_checkpoint(PASSIVE)").forEach { framesInWAL = $0.int64(1) }
        #expect(framesInWAL == 1)
        #expect(try store.count("SELECT count(*) FROM staged_frames") == 4 * 40 * 20)
        #expect(try store.database.text("PRAGMA integrity_check") == "ok")
    }

    @Test func withoutTheFlagTheLastCloseDeletesTheWALAsBefore() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("plain.sqlite")
        do {
            let store = try GatewayStore(path: path, clock: FixedClock())
            _ = try StorageReliefTests.fill(store, windows: 5)
        }
        #expect(Self.walSize(path) == nil)
    }

    @Test func aWALAnotherConnectionStillReadsFromIsNotKept() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("reader.sqlite")
        let writer = try GatewayStore(path: path, clock: FixedClock())
        _ = try StorageReliefTests.fill(writer, windows: 5)
        let reader = try GatewayStore(path: path, clock: FixedClock())
        try reader.database.execute("BEGIN")
        #expect(try reader.count("SELECT count(*) FROM staged_frames") == 100)
        _ = try StorageReliefTests.fill(writer, windows: 5)  // frames the reader's snapshot does not see
        #expect(writer.keepWALForNextOpen() == false)
        try reader.database.execute("COMMIT")
        #expect(try reader.count("SELECT count(*) FROM staged_frames") == 200)
    }

    @Test func aWALLargerThanTheLimitIsNotKept() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("large.sqlite")
        let store = try GatewayStore(path: path, clock: FixedClock())
        try store.database.execute("PRAGMA wal_autocheckpoint = 0")
        while (Self.walSize(path) ?? 0) <= 8 << 20 {
            _ = try StorageReliefTests.fill(store, windows: 50)
        }
        #expect(store.keepWALForNextOpen() == false)
    }

    @Test(.enabled(if: geteuid() == 0, "needs root to give the store to another user"))
    func aWALKeptByRootInTheServicesStoreBelongsToTheService() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("service.sqlite")
        do { _ = try StorageReliefTests.fill(try GatewayStore(path: path, clock: FixedClock()), windows: 1) }
        #expect(chown(path, 65534, 65534) == 0)  // the service user's store; root syncs into it
        try Self.syncLikeProcess(path, windows: 5)
        for file in [path + "-wal", path + "-shm"] {
            var info = stat()
            #expect(stat(file, &info) == 0 && info.st_uid == 65534 && info.st_gid == 65534, "\(file) kept for the service")
        }
    }
}
