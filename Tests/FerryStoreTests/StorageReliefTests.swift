import FerryProtocol
import FerryStore
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// Issue 12 item 3 on real SQLite files: making room deletes delivered events oldest first whatever their age,
/// never anything undelivered, and really shrinks the file; SQLITE_FULL on a really full file system (a small
/// tmpfs) loses nothing and recovers once space returns.
@Suite(.serialized) struct StorageReliefTests {
    static let payloadSize = 400

    /// Commits `windows` windows of 20 frames (400-byte payloads) to one stream; returns the stream key.
    @discardableResult
    static func fill(_ store: GatewayStore, windows: Int, peripheral: PeripheralAddress = testPeripheral) throws -> StreamKey {
        let stream = try store.openStream(peripheral: peripheral, deviceEpoch: 0)
        var cursor = stream.cursor
        for _ in 0..<windows {
            try store.commit(batch(from: cursor, dataFrames((cursor + 1)...(cursor + 20), payloadSize: payloadSize)), to: stream.key)
            cursor += 20
        }
        return stream.key
    }

    /// Delivers every event (claim + complete), completion times `start`, `start+1`, ... per batch.
    static func deliverAll(_ store: GatewayStore, start: Int64, eventsPerBatch: Int = 5) throws -> Int {
        var limits = ClaimLimits()
        limits.maxEvents = eventsPerBatch
        var delivered = 0
        var now = start
        while let claimed = try store.claimBatch(limits: limits, now: Int64.max / 2) {
            try store.completeBatch(claimed.id, now: now)
            delivered += claimed.events.count
            now += 1
        }
        return delivered
    }

    static func walBytes(_ store: GatewayStore) -> Int64 {
        ((try? FileManager.default.attributesOfItem(atPath: store.database.path + "-wal"))?[.size] as? NSNumber)?
            .int64Value ?? 0
    }

    @Test func reliefDeletesDeliveredEventsOldestFirstRegardlessOfAgeAndShrinksTheFile() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("relief.sqlite"), clock: FixedClock())
        let old = try Self.fill(store, windows: 40)
        // The first 30 windows delivered just now (far inside any retention), the rest undelivered.
        var limits = ClaimLimits()
        limits.maxEvents = 1
        for minute in 0..<30 {
            let claimed = try #require(try store.claimBatch(limits: limits, now: Int64.max / 2))
            try store.completeBatch(claimed.id, now: 1_796_000_000_000 + Int64(minute) * 60_000)
        }
        let failed = try #require(try store.claimBatch(limits: limits, now: Int64.max / 2))
        try store.failBatch(failed.id, error: "kept for audit")
        let before = try store.diskBytes()
        let target = try store.liveBytes() / 2

        let relief = try store.relieveStoragePressure(target: target)

        #expect(relief.bytesBefore == before)
        #expect(relief.eventsPruned > 0 && relief.eventsPruned <= 30)
        #expect(relief.framesPruned == relief.eventsPruned * 20)
        #expect(try store.liveBytes() <= target || relief.eventsPruned == 30)
        #expect(relief.bytesAfter < before, "the file must shrink: \(before) -> \(relief.bytesAfter)")
        #expect(relief.bytesAfter == (try store.diskBytes()))
        #expect(Self.walBytes(store) == 0, "WAL truncated")
        #expect(!relief.diskFull)
        // Oldest delivered first: what is left of the delivered ones is the newest, contiguous at the end.
        let left = try store.outboxEvents(status: .completed).compactMap(\.firstSeq).sorted()
        #expect(left.count == 30 - relief.eventsPruned)
        #expect(left.first.map { $0 == UInt64(relief.eventsPruned) * 20 + 1 } ?? true)
        // Nothing undelivered is touched: 9 PENDING + 1 FAILED windows and every one of their frames.
        #expect(try store.outboxEvents(status: .pending).count == 9)
        #expect(try store.outboxEvents(status: .failed).count == 1)
        let frames = try store.frames(of: old).map(\.seq)
        #expect(frames.count == 800 - relief.framesPruned)
        #expect(frames.last == 800)
        #expect(try store.quickCheck().isEmpty)
    }

    @Test func reliefWithNothingDeliveredDeletesNothing() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("pending.sqlite"), clock: FixedClock())
        let key = try Self.fill(store, windows: 10)
        let relief = try store.relieveStoragePressure(target: 0)
        #expect(relief.eventsPruned == 0)
        #expect(try store.frames(of: key).count == 200)
        #expect(try store.outboxEvents(status: .pending).count == 10)
    }

    static let canMountTmpfs: Bool = {
        guard getuid() == 0 else { return false }
        let probe = FileManager.default.temporaryDirectory.path + "/ferry-tmpfs-probe-" + UUID().uuidString
        guard (try? FileManager.default.createDirectory(atPath: probe, withIntermediateDirectories: false)) != nil
        else { return false }
        defer { try? FileManager.default.removeItem(atPath: probe) }
        guard mount("tmpfs", probe, "tmpfs", 0, "size=64k") == 0 else { return false }
        umount(probe)
        return true
    }()

    /// A 3 MiB tmpfs, unmounted when released.
    final class SmallFileSystem {
        let path: String
        init(size: String) throws {
            path = FileManager.default.temporaryDirectory.path + "/ferry-full-" + UUID().uuidString
            try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: false)
            guard mount("tmpfs", path, "tmpfs", 0, "size=\(size)") == 0 else {
                throw CocoaError(.fileWriteUnknown, userInfo: [NSLocalizedDescriptionKey: "mount tmpfs failed"])
            }
        }
        deinit {
            umount(path)
            try? FileManager.default.removeItem(atPath: path)
        }
    }

    /// Something else fills the disk (logs, another program): commits fail with SQLITE_FULL, nothing is lost,
    /// relief reports the disk full; once that space is freed, commits work again and relief can shrink the store.
    @Test(.enabled(if: canMountTmpfs, "needs root to mount a small tmpfs"))
    func diskFullLosesNothingAndRecoversWhenSpaceReturns() throws {
        let fs = try SmallFileSystem(size: "4m")
        let filler = fs.path + "/other-program.log"
        try Data(repeating: 0x2E, count: 3 * 1024 * 1024).write(to: URL(fileURLWithPath: filler))
        let store = try GatewayStore(path: fs.path + "/ferry.sqlite", clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        var cursor: UInt64 = 0
        var full: SQLiteError?
        for _ in 0..<1000 {
            do {
                try store.commit(batch(from: cursor, dataFrames((cursor + 1)...(cursor + 20), payloadSize: Self.payloadSize)), to: stream.key)
                cursor += 20
            } catch StoreError.sqlite(let e) where e.isFull {
                full = e
                break
            }
        }
        let error = try #require(full, "the file system never filled up")
        #expect(error.resultCode == .full)
        #expect(cursor >= 40)
        // Nothing lost: every committed window is there, the failed one left no trace, the file is sound.
        #expect(try store.cursor(of: stream.key) == cursor)
        #expect(try store.frames(of: stream.key).map(\.seq) == Array(1...cursor))
        #expect(try store.quickCheck().isEmpty)

        // Still full, nothing delivered: relief deletes nothing, and says the disk is full.
        let stuck = try store.relieveStoragePressure(target: 0)
        #expect(stuck.eventsPruned == 0)
        #expect(stuck.diskFull || (store.freeBytes() ?? 0) < GatewayStore.freeSpaceFloorBytes)
        #expect(try store.frames(of: stream.key).count == Int(cursor))

        // Space returns: commits work again, and once the uplink has delivered, relief shrinks the store.
        try FileManager.default.removeItem(atPath: filler)
        try store.commit(batch(from: cursor, dataFrames((cursor + 1)...(cursor + 20), payloadSize: Self.payloadSize)), to: stream.key)
        cursor += 20
        #expect(try store.cursor(of: stream.key) == cursor)
        #expect(try Self.deliverAll(store, start: 1_796_000_000_000) == Int(cursor / 20))
        let relief = try store.relieveStoragePressure(target: 0)
        #expect(!relief.diskFull)
        #expect(relief.eventsPruned == Int(cursor / 20))
        #expect(relief.bytesAfter < relief.bytesBefore / 4, "\(relief.bytesBefore) -> \(relief.bytesAfter)")
        #expect(try #require(store.freeBytes()) > GatewayStore.freeSpaceFloorBytes)
        #expect(try store.quickCheck().isEmpty)
    }
}
