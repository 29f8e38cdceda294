import CSQLite
import FerryCore

/// Keeping the WAL file between processes.
///
/// SQLite deletes the WAL when the last connection closes, so every `ferry sync` process creates it again and
/// grows it to the autocheckpoint size (some 4 MB) page by page. On a Pi's SD card every commit that grows the
/// file also commits the file system's journal (the new size and blocks); in the test bed's tmpfs each new page
/// is allocated and zeroed: ~7 % of a window-20 session's data phase in a profile there.
///
/// Keeping the file (SQLITE_FCNTL_PERSIST_WAL) is only half of it: the next open's recovery reads every frame
/// that still checks out, and checkpoints them all again. So before closing, the WAL is rewound — the documented
/// reset: once a checkpoint has copied every frame and no reader uses the WAL, the next write transaction starts
/// again at the WAL's beginning with new salts — by one write that changes nothing (`user_version` set to its
/// own value). The file then holds that one frame followed by old frames whose salts no longer match, which
/// recovery stops at. The next process reads one frame and writes over the file's existing pages.
///
/// A WAL kept by `sudo ferry sync` in the service's store is still the service user's: SQLite running as root gives
/// the `-wal` and `-shm` files it creates the database file's owner.
extension GatewayStore {
    /// A WAL that grew beyond this (a long reader kept it from being rewound) is not kept: its space goes back to
    /// the file system. Twice the autocheckpoint size (1000 pages of 4 KiB).
    static let largestKeptWAL: Int64 = 8 << 20

    /// Rewinds the WAL and marks it to be kept when this connection closes. Does nothing (and the WAL is deleted
    /// as usual by the last close) when the WAL is missing or large, another connection holds the write lock or
    /// reads from the WAL, or anything fails: never waits for a lock. Returns whether the WAL will be kept.
    @discardableResult
    public func keepWALForNextOpen() -> Bool {
        guard let size = fileSize(atPath: database.path + "-wal"), size > 0, size <= Self.largestKeptWAL else {
            return false
        }
        database.setBusyTimeout(milliseconds: 0)
        defer { database.setBusyTimeout(milliseconds: Database.busyTimeoutMilliseconds) }
        do {
            let before = try walCheckpoint(.passive)
            guard !before.busy, before.copied == before.frames else { return false }
            try database.writeTransaction {
                let version = try database.integer("PRAGMA user_version") ?? 0
                try database.execute("PRAGMA user_version = \(version)")
            }
            // The write went to frame 1 only if the WAL was rewound; otherwise it was appended and recovery
            // would read (and copy again) every frame before it.
            let after = try walCheckpoint(.passive)
            guard !after.busy, after.frames == 1, after.copied == 1 else { return false }
            try database.setPersistentWAL(true)
            return true
        } catch {
            return false
        }
    }
}
