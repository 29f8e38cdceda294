import CSQLite
import FerryCore
import FoundationEssentials

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
        guard statvfs(directoryName(of: path), &info) == 0 else { return nil }
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
            store += fileSize(atPath: file) ?? 0
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
    /// 1. checkpoint the WAL (on a full disk this is what makes room for the deletes);
    /// 2. delete COMPLETED events with their frames, oldest first and regardless of their age, a small
    ///    transaction at a time (the WAL stays small), until the live pages fit `target`; `target` 0 (disk
    ///    full) deletes every COMPLETED event;
    /// 3. vacuum the freed pages incrementally and truncate the WAL again, so the file really shrinks.
    /// On a nearly full disk every step is small enough to fit: a delete that fails with SQLITE_FULL is retried
    /// with a quarter of the events, down to one, and the freed pages go back to the file system after every
    /// chunk (in vacuum steps that shrink the same way), so each step makes room for the next. `diskFull`: the last write still found no room.
    /// `keepWALSpace` (the disk is full): checkpoints restart the WAL instead of truncating it, so its blocks stay
    /// the store's for the next writes (the uplink's claims and acknowledgements, the deletes) rather than going
    /// back to a file system where another program that is filling the disk takes them at once.
    public func relieveStoragePressure(target: Int64, chunk: Int = 200, keepWALSpace: Bool = false) throws -> StorageRelief {
        var relief = StorageRelief(bytesBefore: try diskBytes(), bytesAfter: 0)
        /// Runs a step; false (and `diskFull`) on SQLITE_FULL, which is not an error here.
        func attempt(_ body: () throws -> Void) throws -> Bool {
            do {
                try body()
                relief.diskFull = false
                return true
            } catch StoreError.sqlite(let e) where e.isFull {
                relief.diskFull = true
            } catch let e as SQLiteError where e.isFull {
                relief.diskFull = true
            }
            return false
        }
        func checkpoint() throws -> Bool {
            try attempt { try checkpointWAL(truncating: !keepWALSpace) }
        }
        _ = try checkpoint()
        var size = chunk
        while try liveBytes() > target {
            var pruned = (events: 0, frames: 0)
            guard try attempt({ pruned = try pruneCompleted(before: Int64.max, chunk: size, maxEvents: size) }) else {
                if size == 1 { break }
                size = max(1, size / 4)
                continue
            }
            relief.eventsPruned += pruned.events
            relief.framesPruned += pruned.frames
            if pruned.events == 0 { break }
            // Give the freed pages back now, a megabyte at a time, folding the WAL in after each step: room for the
            // next chunk. Vacuuming moves pages through the WAL, which has to fit on the disk too: on a disk filled
            // to the last byte a megabyte of it does not, so a step that fails with SQLITE_FULL is retried with a
            // quarter of the pages, down to one (else the file never shrank; measured in the test bed's
            // sync_field d). Ends: every turn shrinks the free list, shrinks the step, or stops.
            var pages = 256
            while let left = try database.integer("PRAGMA freelist_count"), left > 0 {
                let vacuumed = try attempt { try incrementalVacuum(pages: pages) }
                _ = try checkpoint()
                if vacuumed {
                    guard let after = try database.integer("PRAGMA freelist_count"), after < left else { break }
                } else {
                    if pages == 1 { break }
                    pages = max(1, pages / 4)
                }
            }
        }
        relief.bytesAfter = try diskBytes()
        return relief
    }

    // MARK: reserve

    /// A file next to the store (`ferry.sqlite-reserve`) that holds back some space. When the store itself fills
    /// the disk, its WAL cannot be checkpointed (the main file has to grow first) and no delete can be written:
    /// SQLite needs room to free room. Giving the reserve back makes that room; it is put back once there is
    /// space again.
    public var reservePath: String { database.path + "-reserve" }

    /// The reserve's size for a budget: enough for a full WAL (~1000 pages) on real disks, an eighth of the
    /// budget on tiny ones.
    public static func reserveBytes(forBudget budget: Int64) -> Int64 { min(4 << 20, max(64 << 10, budget / 8)) }

    /// Makes sure the reserve exists with `bytes` (written, not sparse, so the blocks are really held). False
    /// when the file system has no room for it and the free-space floor.
    @discardableResult
    public func ensureReserve(bytes: Int64) -> Bool {
        if let size = fileSize(atPath: reservePath), size >= bytes { return true }
        guard let free = freeBytes(), free >= bytes + GatewayStore.freeSpaceFloorBytes else { return false }
        return writeFile(reservePath, [UInt8](repeating: 0, count: Int(bytes))) == nil
    }

    /// Gives the reserve back to the file system; true if there was one.
    @discardableResult
    public func releaseReserve() -> Bool {
        unlink(reservePath) == 0
    }

    /// `wal_checkpoint(TRUNCATE)`: copies the WAL into the main file and truncates it to zero bytes. Returns
    /// false when readers kept it from finishing (the next call catches up).
    @discardableResult
    public func checkpointTruncatingWAL() throws -> Bool { try checkpointWAL(truncating: true) }

    /// Copies the WAL into the main file; then TRUNCATE gives the WAL's blocks back to the file system, RESTART
    /// keeps them and makes the next writer start again at the WAL's beginning. Returns false when readers kept
    /// it from finishing (the next call catches up).
    @discardableResult
    public func checkpointWAL(truncating: Bool) throws -> Bool {
        try checkpoint(mode: truncating ? .truncate : .restart)
    }

    /// A PASSIVE checkpoint: copies what it can without waiting for or blocking anyone. On a full disk, run
    /// often, it keeps the WAL small (a writer starts again at its beginning once it is all copied), so the
    /// little room there is goes to the main file's growth instead of to a WAL that can no longer be copied.
    @discardableResult
    public func checkpointWALPassively() throws -> Bool { try checkpoint(mode: .passive) }

    private func checkpoint(mode: WALCheckpointMode) throws -> Bool {
        try !walCheckpoint(mode).busy
    }

    enum WALCheckpointMode: String {
        case passive = "PASSIVE"
        case restart = "RESTART"
        case truncate = "TRUNCATE"
    }

    /// `PRAGMA wal_checkpoint(mode)`'s row: blocked by a reader or writer (busy), frames in the WAL, frames copied.
    func walCheckpoint(_ mode: WALCheckpointMode) throws -> (busy: Bool, frames: Int64, copied: Int64) {
        try store {
            var result: (busy: Bool, frames: Int64, copied: Int64) = (false, 0, 0)
            try database.prepare("PRAGMA wal_checkpoint(\(mode.rawValue))").forEach { row in
                result = (row.int64(0) != 0, row.int64(1), row.int64(2))
            }
            return result
        }
    }
}
