import CSQLite
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// What one round of storage relief found and did (issue 12: disk pressure that converges).
public struct StorageRelief: Sendable, Equatable {
    /// The store on disk (main file + WAL) before and after.
    public var bytesBefore: Int64
    public var bytesAfter: Int64
    /// Delivered (COMPLETED) events deleted to make room, with their frames.
    public var eventsPruned = 0
    public var framesPruned = 0
    /// A write of the relief itself failed with SQLITE_FULL: the file system had no room even for the deletes.
    public var diskFull = false
}

extension GatewayStore {
    /// Below this much free space on the store's file system the disk counts as full (the next window commit
    /// or WAL growth would fail with SQLITE_FULL), whatever the budget says.
    public static let freeSpaceFloorBytes: Int64 = 512 * 1024

    /// Bytes free for this process on the file system holding the store, nil when unknown.
    public func freeBytes() -> Int64? { GatewayStore.freeBytes(near: database.path) }

    static func freeBytes(near path: String) -> Int64? {
        var info = statvfs()
        let directory = (path as NSString).deletingLastPathComponent
        guard statvfs(directory.isEmpty ? "." : directory, &info) == 0 else { return nil }
        let (bytes, overflow) = Int64(info.f_bavail).multipliedReportingOverflow(by: Int64(info.f_frsize))
        return overflow ? Int64.max : bytes
    }

    /// The budget `ferry run` uses when the config sets none: half of what the store could grow to when the
    /// daemon starts (free space on its file system plus the store itself), at most 1 GiB, at least 1 MiB. Half
    /// leaves room for the WAL, logs and the rest of the system; 1 GiB holds millions of events.
    public static func defaultDiskBudget(forStoreAt path: String) -> Int64 {
        let gib: Int64 = 1 << 30
        var store: Int64 = 0
        for file in [path, path + "-wal"] {
            if let size = (try? FileManager.default.attributesOfItem(atPath: file))?[.size] as? NSNumber {
                store += size.int64Value
            }
        }
        guard let free = freeBytes(near: path) else { return gib }
        let half = free / 2 + store / 2
        return max(1 << 20, min(gib, half))
    }

    /// Bytes the store's live pages occupy (what the file shrinks to once free pages are vacuumed away).
    public func liveBytes() throws -> Int64 {
        try store {
            let pages = try database.integer("PRAGMA page_count") ?? 0
            let free = try database.integer("PRAGMA freelist_count") ?? 0
            let size = try database.integer("PRAGMA page_size") ?? 4096
            return (pages - free) * size
        }
    }

    /// Makes room, oldest delivered data first, never touching anything undelivered (PENDING, IN_FLIGHT,
    /// FAILED) — so it loses nothing the backend has not acknowledged:
    /// 1. checkpoint and truncate the WAL (on a full disk this is what frees room for the deletes);
    /// 2. delete COMPLETED events with their frames, oldest first and regardless of their age, a small
    ///    transaction at a time (the WAL stays small), until the live pages fit `target`; `target` 0 (disk
    ///    full) deletes every COMPLETED event;
    /// 3. vacuum the freed pages incrementally and truncate the WAL again, so the file really shrinks.
    /// SQLITE_FULL in any step is noted (`diskFull`) and the next step still runs.
    public func relieveStoragePressure(target: Int64, chunk: Int = 200) throws -> StorageRelief {
        var relief = StorageRelief(bytesBefore: try diskBytes(), bytesAfter: 0)
        func attempt(_ body: () throws -> Void) throws {
            do {
                try body()
            } catch StoreError.sqlite(let e) where e.isFull {
                relief.diskFull = true
            } catch let e as SQLiteError where e.isFull {
                relief.diskFull = true
            }
        }
        try attempt { try checkpointTruncatingWAL() }
        while try liveBytes() > target {
            var pruned = (events: 0, frames: 0)
            try attempt { pruned = try pruneCompleted(before: Int64.max, chunk: chunk, maxEvents: chunk) }
            relief.eventsPruned += pruned.events
            relief.framesPruned += pruned.frames
            if pruned.events == 0 { break }
            try attempt { try checkpointTruncatingWAL() }
        }
        if relief.eventsPruned > 0 {
            try attempt { try incrementalVacuum(pages: 0) }  // 0: the whole freelist
            try attempt { try checkpointTruncatingWAL() }
        }
        relief.bytesAfter = try diskBytes()
        return relief
    }

    /// `wal_checkpoint(TRUNCATE)`: copies the WAL into the main file and truncates it to zero bytes. Returns
    /// false when readers kept it from finishing (the next call catches up).
    @discardableResult
    public func checkpointTruncatingWAL() throws -> Bool {
        try store {
            var busy = false
            try database.prepare("PRAGMA wal_checkpoint(TRUNCATE)").forEach { row in busy = row.int64(0) != 0 }
            return !busy
        }
    }
}
