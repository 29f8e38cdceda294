import CSQLite
import FerryCore
import FerryProtocol
import FoundationEssentials
import Glibc

/// A stream's key in the store: (peripheral identity address, epoch). After a counter regression the
/// store epoch differs from the epoch the peripheral reports (see `recordRegression`).
public struct StreamKey: Sendable, Hashable, CustomStringConvertible {
    public var peripheral: PeripheralAddress
    public var epoch: UInt64

    public init(peripheral: PeripheralAddress, epoch: UInt64) {
        self.peripheral = peripheral
        self.epoch = epoch
    }

    public var description: String { "\(peripheral)/\(epoch)" }
}

/// The open stream for a peripheral's reported epoch: where its frames go and what is committed.
public struct StreamHandle: Sendable, Equatable {
    public var key: StreamKey
    public var deviceEpoch: UInt64
    public var cursor: UInt64
}

/// What one window commit did.
public struct CommitOutcome: Sendable, Equatable {
    /// The stored cursor after the transaction.
    public var cursor: UInt64
    public var framesInserted: Int
    /// Frames of the batch already at or below the stored cursor (replayed after a crash before the ACK).
    public var framesAlreadyStored: Int
    public var gapRecorded: ClosedRange<UInt64>?
}

/// The gateway's one SQLite file: staged frames, the transactional outbox and the stream cursors.
/// One owner; not thread-safe (wrap it in an actor or keep it on one thread).
public final class GatewayStore {
    public let database: Database
    let clock: any WallClock
    /// Set by one-shot writers (`ferry sync`): on release, leave the WAL file for the next process to write over
    /// (`keepWALForNextOpen`). Off by default: the daemon's connections close while others stay open.
    public var keepsWALOnClose = false

    public static let pragmas = """
        PRAGMA journal_mode = WAL;
        PRAGMA synchronous = FULL;
        PRAGMA foreign_keys = ON;
        """

    private init(opened database: Database, clock: any WallClock) {
        self.database = database
        self.clock = clock
    }

    deinit {
        if keepsWALOnClose { keepWALForNextOpen() }
    }

    /// Opens or creates the store and migrates it to the latest schema. `create: false` refuses a missing file.
    /// Safe against other processes opening the same file at the same time (see `migrate`).
    public convenience init(path: String, clock: any WallClock = SystemWallClock(), create: Bool = true) throws {
        let db: Database
        do {
            db = try Database.open(path: path, create: create)
        } catch let e as SQLiteError {
            throw StoreError.sqlite(e)
        }
        do {
            // Version 0 with tables is another application's file (Ferry's first migration sets the version
            // in the same transaction as its tables): refuse it before WAL or migrations change it. Read in one
            // snapshot, so that a concurrent first open committing in between is not mistaken for a stranger.
            let (version, tables) = try GatewayStore.versionAndTableCount(db)
            if version == 0, tables > 0 { throw GatewayStore.foreignFile(path) }
            // Must precede the first table: only then does the file get incremental auto-vacuum.
            if version == 0 { try db.execute("PRAGMA auto_vacuum = INCREMENTAL") }
            try GatewayStore.retryingWhileBusy { try db.execute(GatewayStore.pragmas) }
            // A store already at this binary's version needs no write lock to find that out again (versions only
            // go up): every `ferry sync` opens the store, possibly while the daemon is committing to it.
            if version != Schema.latestVersion { try GatewayStore.migrate(db, path: path) }
        } catch let e as SQLiteError where e.resultCode == .corrupt {
            throw StoreError.damaged(path: path, problems: [e.message])
        } catch let e as SQLiteError where e.resultCode == .notadb {
            throw StoreError.notADatabase(path: path, detail: e.message)
        } catch let e as SQLiteError {
            throw StoreError.sqlite(e)
        }
        self.init(opened: db, clock: clock)
    }

    /// Switching a new file to WAL takes an exclusive lock that SQLite does not wait for through the busy
    /// handler: a second process opening the same new store at that moment got SQLITE_BUSY at once (seen
    /// under load in StoreOpeningTests). Retried for up to 5 s, like any other busy wait on the store.
    static func retryingWhileBusy(_ body: () throws -> Void) throws {
        let clock = SystemMonotonicClock()
        let deadline = clock.now() + 5
        while true {
            do {
                return try body()
            } catch let e as SQLiteError where e.primaryCode == SQLITE_BUSY && clock.now() < deadline {
                usleep(20_000)
            }
        }
    }

    /// Opens an existing store for reading only (`ferry status`, `peripherals`, `outbox list`): no migration,
    /// no pragma that writes, no file created. A store that is missing, foreign, older or newer than this
    /// binary's schema is refused with a reason (`StoreError.needsMigration` names the way forward).
    public static func openReadOnly(path: String, clock: any WallClock = SystemWallClock()) throws -> GatewayStore {
        let db: Database
        do {
            db = try Database.open(path: path, readOnly: true, create: false)
        } catch let e as SQLiteError {
            throw StoreError.sqlite(e)
        }
        do {
            let (version, tables) = try versionAndTableCount(db)
            if version == 0, tables > 0 { throw foreignFile(path) }
            if version > Schema.latestVersion {
                throw StoreError.schemaTooNew(found: version, supported: Schema.latestVersion)
            }
            if version < Schema.latestVersion {
                throw StoreError.needsMigration(path: path, found: version, supported: Schema.latestVersion)
            }
        } catch let e as SQLiteError where e.resultCode == .notadb || e.resultCode == .corrupt {
            throw StoreError.notADatabase(path: path, detail: e.message)
        } catch let e as SQLiteError {
            throw StoreError.sqlite(e)
        }
        return GatewayStore(opened: db, clock: clock)
    }

    private static func versionAndTableCount(_ db: Database) throws -> (version: Int64, tables: Int64) {
        try db.execute("BEGIN")
        defer { try? db.execute("COMMIT") }
        let version = try db.integer("PRAGMA user_version") ?? 0
        // Only a version-0 file is asked for its tables (a stranger's file, or a new one).
        let tables = version == 0 ? try db.integer("SELECT count(*) FROM sqlite_master") ?? 0 : 0
        return (version, tables)
    }

    private static func foreignFile(_ path: String) -> StoreError {
        .notADatabase(path: path, detail: "it holds another application's tables (schema version 0), not Ferry's")
    }

    /// Reads `user_version` INSIDE its BEGIN IMMEDIATE: with two processes opening a new or old store at once,
    /// the second waits for the first's write lock and then sees the version the first committed, instead of
    /// re-running a migration it read as pending before the lock (issue 12). Every pending migration goes in
    /// that one transaction: a new file is created with one commit (one WAL write and fsync, not one per
    /// version), and a failing migration leaves the file as it was.
    private static func migrate(_ database: Database, path: String) throws {
        try database.writeTransaction {
            let current = try database.integer("PRAGMA user_version") ?? 0
            guard current <= Schema.latestVersion else {
                throw StoreError.schemaTooNew(found: current, supported: Schema.latestVersion)
            }
            if current == 0, try database.integer("SELECT count(*) FROM sqlite_master") ?? 0 > 0 {
                throw foreignFile(path)
            }
            for migration in Schema.migrations where migration.version > current {
                try Schema.apply(migration, to: database)
            }
        }
    }

    /// `PRAGMA quick_check` (the daemon runs it at start): the problems SQLite reports, empty when the file is
    /// sound. Checks every page and index entry without the cross-checks of integrity_check, so it stays
    /// fast enough for a start-up on an SD card.
    public func quickCheck(maxProblems: Int = 10) throws -> [String] {
        do {
            return try quickCheckRows(maxProblems: maxProblems)
        } catch StoreError.sqlite(let e) where e.resultCode == .corrupt || e.resultCode == .notadb {
            return [e.message]  // damage bad enough to stop the check itself
        }
    }

    /// Throws `StoreError.damaged` (its description names the next step) when `quickCheck` finds a problem.
    public func verifyIntegrity() throws {
        let problems = try quickCheck()
        if !problems.isEmpty { throw StoreError.damaged(path: database.path, problems: problems) }
    }

    private func quickCheckRows(maxProblems: Int) throws -> [String] {
        try store {
            var problems: [String] = []
            try database.prepare("PRAGMA quick_check(\(maxProblems))").forEach { row in
                // One row may hold several newline-separated problems under a "*** in database main ***" header.
                for line in row.text(0).split(separator: "\n") where line != "ok" && !line.hasPrefix("*** in database") {
                    problems.append(String(line))
                }
            }
            return problems
        }
    }

    /// Runs `body`, turning SQLite failures into `StoreError`.
    func store<T>(_ body: () throws -> T) throws -> T {
        do {
            return try body()
        } catch let e as SQLiteError {
            throw StoreError.sqlite(e)
        }
    }

    // MARK: - Streams

    /// The active stream for the epoch a peripheral reports, created (cursor 0) if new. A new epoch is a new
    /// stream; the rows of older epochs are kept.
    public func openStream(peripheral: PeripheralAddress, deviceEpoch: UInt64) throws -> StreamHandle {
        try store {
            try database.writeTransaction {
                if let existing = try activeStream(peripheral: peripheral, deviceEpoch: deviceEpoch) {
                    return existing
                }
                let now = clock.nowMillis()
                try database.cached(
                    """
                    INSERT INTO stream_cursors (peripheral, epoch, device_epoch, cursor, active, created_at, updated_at)
                    VALUES (?, ?, ?, 0, 1, ?, ?)
                    """
                ).run([
                    .text(peripheral.string), .text(String(deviceEpoch)), .text(String(deviceEpoch)),
                    .integer(now), .integer(now),
                ])
                return StreamHandle(
                    key: StreamKey(peripheral: peripheral, epoch: deviceEpoch), deviceEpoch: deviceEpoch, cursor: 0)
            }
        }
    }

    private func activeStream(peripheral: PeripheralAddress, deviceEpoch: UInt64) throws -> StreamHandle? {
        let statement = try database.cached(
            "SELECT epoch, cursor FROM stream_cursors WHERE peripheral = ? AND device_epoch = ? AND active = 1")
        var handle: StreamHandle?
        try statement.forEach([.text(peripheral.string), .text(String(deviceEpoch))]) { row in
            handle = StreamHandle(
                key: StreamKey(peripheral: peripheral, epoch: UInt64(row.text(0)) ?? 0), deviceEpoch: deviceEpoch,
                cursor: UInt64(bitPattern: row.int64(1)))
        }
        return handle
    }

    private func storedCursor(_ key: StreamKey) throws -> UInt64? {
        try database.integer(
            "SELECT cursor FROM stream_cursors WHERE peripheral = ? AND epoch = ?",
            [.text(key.peripheral.string), .text(String(key.epoch))]
        ).map { UInt64(bitPattern: $0) }
    }

    /// ONE transaction: the batch's frames, their FRAMES outbox event, the GAP event if any, and the cursor
    /// move. The cursor is re-read inside the transaction: frames at or below it were committed before (a
    /// replay after a crash between commit and ACK) and are skipped, so nothing is stored twice.
    @discardableResult
    public func commit(_ batch: CommitBatch, to key: StreamKey, receivedAt: Int64? = nil) throws -> CommitOutcome {
        let now = receivedAt ?? clock.nowMillis()
        return try store {
            try database.writeTransaction {
                guard let stored = try storedCursor(key) else {
                    throw StoreError.cursorMismatch(stored: 0, batchStartsAt: batch.gap?.lowerBound ?? 0)
                }
                var gap = batch.gap
                if let g = gap {
                    gap = g.upperBound <= stored ? nil : max(g.lowerBound, stored + 1)...g.upperBound
                }
                let fresh = batch.frames.filter { $0.seq > stored }
                let alreadyStored = batch.frames.count - fresh.count
                var expected = stored
                if let gap {
                    guard gap.lowerBound == expected + 1 else {
                        throw StoreError.cursorMismatch(stored: stored, batchStartsAt: gap.lowerBound)
                    }
                    expected = gap.upperBound
                }
                for frame in fresh {
                    guard frame.type == .data, frame.seq == expected + 1 else {
                        throw StoreError.cursorMismatch(stored: stored, batchStartsAt: frame.seq)
                    }
                    expected = frame.seq
                }
                if expected == stored {
                    return CommitOutcome(cursor: stored, framesInserted: 0, framesAlreadyStored: alreadyStored,
                        gapRecorded: nil)
                }
                let peripheral = key.peripheral.string
                let epoch = String(key.epoch)
                if let gap {
                    try insertOutboxEvent(
                        .gap(
                            peripheral: peripheral, epoch: epoch, firstSeq: gap.lowerBound, lastSeq: gap.upperBound,
                            detectedAt: Timestamp.iso8601(millis: now)),
                        key: key, first: gap.lowerBound, last: gap.upperBound, frameCount: 0, now: now)
                }
                if let first = fresh.first, let last = fresh.last {
                    let eventID = try insertOutboxEvent(
                        .frames(
                            peripheral: peripheral, epoch: epoch, firstSeq: first.seq, lastSeq: last.seq,
                            count: fresh.count),
                        key: key, first: first.seq, last: last.seq,
                        frameCount: fresh.count, payloadBytes: fresh.reduce(0) { $0 + $1.payload.count }, now: now)
                    // One statement per window, not per frame: a statement's own overhead (start, halt, reset)
                    // cost a quarter of the commit. The columns every row shares are parameters 1-4.
                    // OR ROLLBACK here and on the cursor's UPDATE: a conflict (only a store edited by hand has a
                    // row there, the seqs were checked above against the cursor read in this transaction) ends the
                    // whole transaction, as the throw would anyway. With the default ABORT, SQLite keeps a
                    // statement journal to undo just that statement: a copy of every page it touches, 2 % of an
                    // ingest's instructions.
                    let shared: [SQLValue] = [.text(peripheral), .text(epoch), .integer(now), .text(eventID)]
                    var rest = fresh[...]
                    while !rest.isEmpty {
                        let rows = rest.prefix(GatewayStore.framesPerInsert)
                        rest = rest.dropFirst(rows.count)
                        let insert = try frameInsert(rows: rows.count)
                        try insert.bind(shared)
                        for (row, frame) in rows.enumerated() {
                            try insert.bind(.integer(Int64(bitPattern: frame.seq)), at: Int32(5 + 2 * row))
                            try insert.bind(.blob(frame.payload), at: Int32(6 + 2 * row))
                        }
                        try insert.runBound()
                    }
                }
                try database.cached(
                    "UPDATE OR ROLLBACK stream_cursors SET cursor = ?, updated_at = ? "
                        + "WHERE peripheral = ? AND epoch = ?"
                ).run([.integer(Int64(bitPattern: expected)), .integer(now), .text(peripheral), .text(epoch)])
                return CommitOutcome(
                    cursor: expected, framesInserted: fresh.count, framesAlreadyStored: alreadyStored,
                    gapRecorded: gap)
            }
        }
    }

    /// Most frames one INSERT carries; a window (20 by default) is one statement.
    static let framesPerInsert = 32

    /// The INSERT of n frame rows (1 ≤ n ≤ `framesPerInsert`) sharing peripheral (?1), epoch (?2), received_at (?3)
    /// and outbox_id (?4); row i's seq and payload are ?(5+2i) and ?(6+2i).
    static func insertFramesSQL(rows: Int) -> String {
        "INSERT OR ROLLBACK INTO staged_frames (peripheral, epoch, seq, payload, received_at, outbox_id) VALUES "
            + (0..<rows).map { "(?1, ?2, ?\(5 + 2 * $0), ?\(6 + 2 * $0), ?3, ?4)" }.joined(separator: ", ")
    }

    /// `insertFramesSQL(rows:)` prepared, per row count, on first use: a table of every text built up front cost
    /// 1.8 M instructions at each start-up (callgrind), and finding the statement by its text hashed and compared
    /// a kilobyte of SQL per commit.
    private var frameInserts: [Int: Statement] = [:]

    private func frameInsert(rows: Int) throws -> Statement {
        if let statement = frameInserts[rows] {
            statement.reset()
            return statement
        }
        let statement = try database.cached(Self.insertFramesSQL(rows: rows))
        frameInserts[rows] = statement
        return statement
    }

    @discardableResult
    private func insertOutboxEvent(
        _ payload: OutboxPayload, key: StreamKey, first: UInt64?, last: UInt64?, frameCount: Int,
        payloadBytes: Int = 0, now: Int64
    ) throws -> String {
        let id = RandomID.uuidV7(unixMillis: now)
        try database.cached(
            """
            INSERT INTO outbox_events (id, event_type, payload, status, retry_count, next_retry_at, created_at,
                                       peripheral, epoch, first_seq, last_seq, frame_count, payload_bytes)
            VALUES (?, ?, ?, 'PENDING', 0, ?, ?, ?, ?, ?, ?, ?, ?)
            """
        ).run([
            .text(id), .text(payload.type.rawValue), .text(payload.json), .integer(now), .integer(now), .text(key.peripheral.string),
            .text(String(key.epoch)), first.map { .integer(Int64(bitPattern: $0)) } ?? .null,
            last.map { .integer(Int64(bitPattern: $0)) } ?? .null, .integer(Int64(frameCount)),
            .integer(Int64(payloadBytes)),
        ])
        return id
    }

    /// A counter regression (same epoch, head below our cursor): ONE transaction records a REGRESSION outbox
    /// event for the old stream and rebases the peripheral onto a fresh store epoch with cursor 0, so the
    /// events it sends from now on are kept under a new, unique (peripheral, epoch, seq) instead of being
    /// dropped as "duplicates" of different, older events. The old stream's rows are kept.
    public func recordRegression(
        stream: StreamHandle, cursor: UInt64, head: UInt64
    ) throws -> StreamHandle {
        try store {
            try database.writeTransaction {
                let now = clock.nowMillis()
                var newEpoch: UInt64
                repeat {
                    newEpoch = UInt64.random(in: 1...UInt64.max)
                } while try storedCursor(StreamKey(peripheral: stream.key.peripheral, epoch: newEpoch)) != nil
                let peripheral = stream.key.peripheral.string
                try insertOutboxEvent(
                    .regression(
                        peripheral: peripheral, epoch: String(stream.key.epoch), cursor: cursor, head: head,
                        newEpoch: newEpoch, detectedAt: Timestamp.iso8601(millis: now)),
                    key: stream.key, first: nil, last: nil, frameCount: 0, now: now)
                try database.cached(
                    "UPDATE stream_cursors SET active = 0, updated_at = ? WHERE peripheral = ? AND epoch = ?"
                ).run([.integer(now), .text(peripheral), .text(String(stream.key.epoch))])
                try database.cached(
                    """
                    INSERT INTO stream_cursors (peripheral, epoch, device_epoch, cursor, active, created_at, updated_at)
                    VALUES (?, ?, ?, 0, 1, ?, ?)
                    """
                ).run([
                    .text(peripheral), .text(String(newEpoch)), .text(String(stream.deviceEpoch)), .integer(now),
                    .integer(now),
                ])
                return StreamHandle(
                    key: StreamKey(peripheral: stream.key.peripheral, epoch: newEpoch), deviceEpoch: stream.deviceEpoch,
                    cursor: 0)
            }
        }
    }

    // MARK: - Reading

    public struct StreamStatus: Sendable, Equatable {
        public var peripheral: String
        public var epoch: String
        public var deviceEpoch: String
        public var cursor: UInt64
        public var active: Bool
        public var framesStaged: Int
        public var updatedAt: Int64
    }

    public func streams() throws -> [StreamStatus] {
        try store {
            var result: [StreamStatus] = []
            let statement = try database.cached(
                """
                SELECT c.peripheral, c.epoch, c.device_epoch, c.cursor, c.active, c.updated_at,
                       (SELECT count(*) FROM staged_frames f WHERE f.peripheral = c.peripheral AND f.epoch = c.epoch)
                FROM stream_cursors c ORDER BY c.peripheral, c.created_at
                """)
            try statement.forEach { row in
                result.append(
                    StreamStatus(
                        peripheral: row.text(0), epoch: row.text(1), deviceEpoch: row.text(2),
                        cursor: UInt64(bitPattern: row.int64(3)), active: row.int64(4) != 0,
                        framesStaged: Int(row.int64(6)), updatedAt: row.int64(5)))
            }
            return result
        }
    }

    /// Outbox event counts by status (every status present, zero if none).
    public func outboxCounts() throws -> [OutboxStatus: Int] {
        try store {
            var counts = Dictionary(uniqueKeysWithValues: OutboxStatus.allCases.map { ($0, 0) })
            try database.cached("SELECT status, count(*) FROM outbox_events GROUP BY status").forEach { row in
                let text = row.text(0)
                guard let status = OutboxStatus(rawValue: text) else {
                    throw StoreError.unexpectedValue(column: "outbox_events.status", value: text)
                }
                counts[status] = Int(row.int64(1))
            }
            return counts
        }
    }

    public func oldestPendingCreatedAt() throws -> Int64? {
        try store { try database.integer("SELECT min(created_at) FROM outbox_events WHERE status = 'PENDING'") }
    }

    /// Frames of a stream in seq order (tests and audits; not for hot paths).
    public func frames(of key: StreamKey) throws -> [(seq: UInt64, payload: [UInt8])] {
        try store {
            var result: [(UInt64, [UInt8])] = []
            // seq is stored as the UInt64 bit pattern: seqs above 2^63 are negative integers, so plain
            // `ORDER BY seq` would put them first. `seq < 0` first sorts the two halves into unsigned order.
            try database.cached(
                "SELECT seq, payload FROM staged_frames WHERE peripheral = ? AND epoch = ? ORDER BY seq < 0, seq"
            ).forEach([.text(key.peripheral.string), .text(String(key.epoch))]) { row in
                result.append((UInt64(bitPattern: row.int64(0)), row.blob(1)))
            }
            return result
        }
    }
}
