import FerryProtocol
import Foundation
import Testing

@testable import FerryStore

/// The file a fresh store creates: durability pragmas, the contract's table/column/index names (PROTOCOL §5),
/// and how migrations treat existing, newer and foreign files.
@Suite struct SchemaTests {
    @Test func freshFileIsWALFullSyncIncrementalVacuumAtLatestVersion() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("fresh.sqlite"), clock: FixedClock())
        let db = store.database
        #expect(try db.text("PRAGMA journal_mode") == "wal")
        #expect(try db.integer("PRAGMA synchronous") == 2)  // FULL
        #expect(try db.integer("PRAGMA auto_vacuum") == 2)  // INCREMENTAL: set before the first table
        #expect(try db.integer("PRAGMA foreign_keys") == 1)
        #expect(try db.integer("PRAGMA user_version") ?? 0 >= 1)
        #expect(try db.text("PRAGMA integrity_check") == "ok")
    }

    @Test func reopenedStoreKeepsTheDurabilitySettings() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("reopen.sqlite")
        _ = try GatewayStore(path: path, clock: FixedClock())
        // synchronous is per connection, not stored in the file: the store must set it again on every open.
        let reopened = try GatewayStore(path: path, clock: FixedClock())
        #expect(try reopened.database.integer("PRAGMA synchronous") == 2)
        #expect(try reopened.database.text("PRAGMA journal_mode") == "wal")  // persistent in the file
        #expect(try reopened.database.integer("PRAGMA auto_vacuum") == 2)
    }

    @Test func contractTablesColumnsAndQueueIndexExist() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("names.sqlite"), clock: FixedClock())
        func columns(_ table: String) throws -> [String] {
            var names: [String] = []
            try store.database.prepare("SELECT name FROM pragma_table_info(?)").forEach([.text(table)]) {
                names.append($0.text(0))
            }
            return names
        }
        let frames = try columns("staged_frames")
        for name in ["peripheral", "epoch", "seq", "payload", "received_at"] { #expect(frames.contains(name)) }
        var primaryKey: [String] = []
        try store.database.prepare("SELECT name FROM pragma_table_info('staged_frames') WHERE pk > 0 ORDER BY pk")
            .forEach { primaryKey.append($0.text(0)) }
        #expect(primaryKey == ["peripheral", "epoch", "seq"])

        let outbox = try columns("outbox_events")
        for name in ["id", "event_type", "payload", "status", "retry_count", "next_retry_at", "created_at"] {
            #expect(outbox.contains(name), "outbox_events lacks \(name)")
        }
        let cursors = try columns("stream_cursors")
        for name in ["peripheral", "epoch", "cursor"] { #expect(cursors.contains(name)) }

        var indexColumns: [String] = []
        try store.database.prepare("SELECT name FROM pragma_index_info('idx_outbox_queue') ORDER BY seqno").forEach {
            indexColumns.append($0.text(0))
        }
        #expect(indexColumns == ["status", "next_retry_at"])
        #expect(
            try store.database.text("SELECT tbl_name FROM sqlite_master WHERE type = 'index' AND name = 'idx_outbox_queue'")
                == "outbox_events")
    }

    @Test func outboxStatusIsLimitedToTheFourStatuses() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("check.sqlite"), clock: FixedClock())
        let insert = """
            INSERT INTO outbox_events (id, event_type, payload, status, next_retry_at, created_at, peripheral, epoch)
            VALUES (?, 'GAP', '{}', ?, 0, 0, 'C0:FF:EE:00:00:01', '0')
            """
        for (index, status) in ["PENDING", "IN_FLIGHT", "COMPLETED", "FAILED"].enumerated() {
            try store.database.prepare(insert).run([.text("ok-\(index)"), .text(status)])
        }
        let error = #expect(throws: SQLiteError.self) {
            try store.database.prepare(insert).run([.text("bad"), .text("DONE")])
        }
        #expect(error?.resultCode == .constraint)
        #expect(try store.count("SELECT count(*) FROM outbox_events") == 4)
    }

    @Test func reopeningDoesNotRerunMigrations() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("existing.sqlite")
        let version: Int64
        do {
            let store = try GatewayStore(path: path, clock: FixedClock())
            let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
            try store.commit(batch(from: 0, dataFrames(1...3)), to: stream.key)
            version = try store.database.integer("PRAGMA user_version") ?? 0
            // A marker a re-run migration would put back: drop an index the migration creates.
            try store.database.execute("DROP INDEX idx_outbox_batch")
        }
        let reopened = try GatewayStore(path: path, clock: FixedClock())
        #expect(try reopened.database.integer("PRAGMA user_version") == version)
        #expect(
            try reopened.count("SELECT count(*) FROM sqlite_master WHERE name = 'idx_outbox_batch'") == 0,
            "migration ran again on an existing database")
        #expect(try reopened.count("SELECT count(*) FROM staged_frames") == 3)
        #expect(try reopened.openStream(peripheral: testPeripheral, deviceEpoch: 0).cursor == 3)
    }

    /// A store as Ferry left it before schema 4: migrations 1-3 applied the way `GatewayStore` applies them.
    static func makeVersion3Store(at path: String) throws -> Database {
        let db = try Database.open(path: path)
        try db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        try db.execute(GatewayStore.pragmas)
        for migration in Schema.migrations where migration.version <= 3 {
            try db.writeTransaction { try Schema.apply(migration, to: db) }
        }
        return db
    }

    /// Migration 4 rewrites outbox_events' CHECKs in place (writable_schema): rows stay, the rules still hold,
    /// and inserting an outbox row no longer builds a temporary b-tree per IN list.
    @Test func version3StoreGetsTheComparisonChecksWithItsRowsIntact() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("v3.sqlite")
        func plan(_ db: Database) throws -> [String] {
            var opcodes: [String] = []
            try db.prepare(
                """
                EXPLAIN INSERT INTO outbox_events (id, event_type, payload, status, next_retry_at, created_at,
                                                   peripheral, epoch) VALUES ('x', 'GAP', '{}', 'PENDING', 0, 0, 'p', 'e')
                """
            ).forEach { opcodes.append($0.text(1)) }
            return opcodes
        }
        let schemaVersionBefore: Int64
        do {
            let db = try Self.makeVersion3Store(at: path)
            #expect(try plan(db).contains("OpenEphemeral"), "the v3 definition no longer shows what 4 removes")
            try db.execute(
                """
                INSERT INTO outbox_events (id, event_type, payload, status, next_retry_at, created_at, peripheral,
                                           epoch, batch_gateway) VALUES ('old', 'GAP', '{"v":3}', 'IN_FLIGHT', 5, 6, 'p', 'e', 'gw')
                """)
            schemaVersionBefore = try db.integer("PRAGMA schema_version") ?? 0
        }
        let store = try GatewayStore(path: path, clock: FixedClock())  // migrates 3 → latest
        let db = store.database
        #expect(
            try db.text("SELECT event_type || status || payload || next_retry_at || batch_gateway FROM outbox_events")
                == "GAPIN_FLIGHT{\"v\":3}5gw")
        #expect(try db.integer("PRAGMA user_version") == Schema.latestVersion)
        #expect(try db.integer("PRAGMA schema_version") ?? 0 > schemaVersionBefore)
        let definition = try db.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'outbox_events'") ?? ""
        #expect(definition.contains("CHECK (event_type = 'FRAMES' OR event_type = 'GAP' OR event_type = 'REGRESSION')"))
        #expect(definition.contains(
            "CHECK (status = 'PENDING' OR status = 'IN_FLIGHT' OR status = 'COMPLETED' OR status = 'FAILED')"))
        #expect(!definition.contains(" IN ("))
        #expect(definition.contains("batch_gateway"))  // migration 3's column is still there
        #expect(try !plan(db).contains("OpenEphemeral"))
        #expect(try db.text("PRAGMA integrity_check") == "ok")

        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        try store.commit(batch(from: 0, dataFrames(1...3)), to: stream.key)
        #expect(try store.count("SELECT count(*) FROM outbox_events") == 2)
        // The rules are the same rules: anything else is still refused, by the table itself.
        let insert = """
            INSERT INTO outbox_events (id, event_type, payload, status, next_retry_at, created_at, peripheral, epoch)
            VALUES (?, ?, '{}', ?, 0, 0, 'p', 'e')
            """
        let badType = #expect(throws: SQLiteError.self) {
            try db.cached(insert).run([.text("a"), .text("frames"), .text("PENDING")])
        }
        #expect(badType?.resultCode == .constraint)
        let badStatus = #expect(throws: SQLiteError.self) {
            try db.cached(insert).run([.text("b"), .text("GAP"), .text("DONE")])
        }
        #expect(badStatus?.resultCode == .constraint)
        try db.cached(insert).run([.text("c"), .text("REGRESSION"), .text("FAILED")])
    }

    @Test func aConnectionOpenDuringTheRewriteReadsTheNewDefinition() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("watcher.sqlite")
        _ = try Self.makeVersion3Store(at: path)
        // Another process's connection (ferry status, the uplink) that read the old definition first.
        let watcher = try Database.open(path: path)
        let bogus = "INSERT INTO outbox_events (id, event_type, payload, status, next_retry_at, created_at, peripheral, epoch) VALUES ('w', 'BOGUS', '{}', 'PENDING', 0, 0, 'p', 'e')"
        let before = #expect(throws: SQLiteError.self) { try watcher.execute(bogus) }
        #expect(before?.message.contains("IN (") == true)
        _ = try GatewayStore(path: path, clock: FixedClock())
        let after = #expect(throws: SQLiteError.self) { try watcher.execute(bogus) }
        #expect(after?.message.contains("event_type = 'FRAMES' OR") == true, "\(after?.message ?? "")")
    }

    @Test func newerSchemaIsRefusedAndLeftAlone() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("newer.sqlite")
        let current: Int64
        do {
            let store = try GatewayStore(path: path, clock: FixedClock())
            current = try store.database.integer("PRAGMA user_version") ?? 0
            try store.database.execute("PRAGMA user_version = \(current + 1)")
        }
        let error = #expect(throws: StoreError.self) { _ = try GatewayStore(path: path, clock: FixedClock()) }
        guard case .schemaTooNew(let found, let supported) = error else {
            Issue.record("expected schemaTooNew, got \(String(describing: error))")
            return
        }
        #expect(found == current + 1)
        #expect(supported == current)
        #expect(try Database.open(path: path).integer("PRAGMA user_version") == current + 1)
    }

    @Test func aTextFileIsNotADatabaseAndIsNotModified() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("notes.sqlite")
        let text = String(repeating: "this is a text file, not a database\n", count: 10)
        try text.write(toFile: path, atomically: false, encoding: .utf8)
        let error = #expect(throws: StoreError.self) { _ = try GatewayStore(path: path, clock: FixedClock()) }
        guard case .notADatabase(let reportedPath, _) = error else {
            Issue.record("expected notADatabase, got \(String(describing: error))")
            return
        }
        #expect(reportedPath == path)
        #expect(try String(contentsOfFile: path, encoding: .utf8) == text)
        #expect(!FileManager.default.fileExists(atPath: path + "-wal"))
    }

    /// A mistyped --db pointing at another application's SQLite file must not gain Ferry's tables, nor be
    /// switched to WAL (which would change how that application's file behaves).
    @Test func anotherApplicationsDatabaseIsRefusedAndLeftAlone() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("contacts.sqlite")
        do {
            let other = try Database.open(path: path)
            try other.execute("CREATE TABLE contacts (name TEXT); INSERT INTO contacts VALUES ('Ada')")
        }
        let error = #expect(throws: StoreError.self) { _ = try GatewayStore(path: path, clock: FixedClock()) }
        guard case .notADatabase(let reportedPath, let detail) = error else {
            Issue.record("expected notADatabase, got \(String(describing: error))")
            return
        }
        #expect(reportedPath == path)
        #expect(detail.contains("another application"))
        let other = try Database.open(path: path)
        #expect(try other.text("PRAGMA journal_mode") == "delete")
        #expect(try other.integer("SELECT count(*) FROM sqlite_master WHERE name = 'stream_cursors'") == 0)
        #expect(try other.text("SELECT name FROM contacts") == "Ada")
    }

    @Test func missingFileIsRefusedWhenCreationIsNotAllowed() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("absent.sqlite")
        let error = #expect(throws: StoreError.self) {
            _ = try GatewayStore(path: path, clock: FixedClock(), create: false)
        }
        guard case .sqlite(let sqlite) = error else {
            Issue.record("expected a SQLite open error, got \(String(describing: error))")
            return
        }
        #expect(sqlite.resultCode == .cantopen)
        #expect(!FileManager.default.fileExists(atPath: path))
    }
}

@Suite struct TimestampTests {
    /// Timestamps come from the store file: any two Int64 values give a difference, never an overflow trap.
    @Test func secondsBetweenAnyTwoTimestamps() {
        #expect(Timestamp.seconds(from: 1_000, to: 3_500) == 2.5)
        #expect(Timestamp.seconds(from: 3_500, to: 1_000) == -2.5)
        #expect(Timestamp.seconds(from: .min, to: .max) > 1.8e16)
        #expect(Timestamp.seconds(from: .max, to: .min) < -1.8e16)
    }
}
