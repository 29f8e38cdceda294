import FerryStore
import Foundation
import Testing

/// The thin SQLite layer: typed errors with code, message and SQL; the statement cache; transactions.
@Suite struct SQLiteLayerTests {
    @Test func syntaxErrorCarriesCodeMessageAndSQL() throws {
        let dir = try TemporaryDirectory()
        let db = try Database.open(path: dir.file("errors.sqlite"))
        let sql = "SELEC 1 FROM nowhere"
        let error = #expect(throws: SQLiteError.self) { try db.execute(sql) }
        #expect(error?.code == 1)  // SQLITE_ERROR
        #expect(error?.message.contains("syntax error") == true)
        #expect(error?.sql == sql)
        #expect(error?.description.contains(sql) == true)

        let prepareError = #expect(throws: SQLiteError.self) { _ = try db.prepare("SELECT * FROM missing_table") }
        #expect(prepareError?.message.contains("no such table: missing_table") == true)
        #expect(prepareError?.sql == "SELECT * FROM missing_table")
    }

    @Test func constraintViolationCarriesTheExtendedCode() throws {
        let dir = try TemporaryDirectory()
        let db = try Database.open(path: dir.file("constraint.sqlite"))
        try db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT NOT NULL)")
        let insert = "INSERT INTO t (k, v) VALUES (?, ?)"
        try db.cached(insert).run([.integer(1), .text("a")])
        let error = #expect(throws: SQLiteError.self) { try db.cached(insert).run([.integer(1), .text("b")]) }
        #expect(error?.resultCode == .constraint)
        #expect(error?.code == 1555)  // SQLITE_CONSTRAINT_PRIMARYKEY: extended codes are on
        #expect(error?.sql == insert)
        // The failed statement was reset: the cached one still works afterwards.
        try db.cached(insert).run([.integer(2), .text("c")])
        #expect(try db.integer("SELECT count(*) FROM t") == 2)
    }

    @Test func cachedStatementsAreReused() throws {
        let dir = try TemporaryDirectory()
        let db = try Database.open(path: dir.file("cache.sqlite"))
        let first = try db.cached("SELECT ?1 + 1")
        let second = try db.cached("SELECT ?1 + 1")
        #expect(first === second)
        #expect(try db.cached("SELECT ?1 + 2") !== first)
        #expect(try db.prepare("SELECT ?1 + 1") !== first)  // prepare() always makes a fresh one
        // Reuse resets bindings: a value bound on the previous use does not leak into the next.
        try first.bind([.integer(41)])
        #expect(try first.step())
        #expect(first.int64(0) == 42)
        let reused = try db.cached("SELECT ?1 + 1")
        #expect(try reused.step())
        #expect(reused.isNull(0))
    }

    @Test func sharedBindingsSurviveEachRowAndTextBindsInPlace() throws {
        let dir = try TemporaryDirectory()
        let db = try Database.open(path: dir.file("bound.sqlite"))
        try db.execute("CREATE TABLE t (k TEXT, seq INTEGER, v BLOB, note TEXT)")
        let insert = try db.cached("INSERT INTO t (k, seq, v, note) VALUES (?, ?, ?, ?)")
        // Column 1 and 4 bound once, 2 and 3 per row: what GatewayStore.commit does for a window's frames.
        try insert.bind([.text("périphérique ✓"), .null, .null, .text("")])
        for seq in 1...3 {
            try insert.bind(.integer(Int64(seq)), at: 2)
            try insert.bind(.blob(seq == 3 ? [] : [UInt8(seq), 0xFF]), at: 3)
            try insert.runBound()
        }
        var rows: [String] = []
        try db.prepare("SELECT k, seq, hex(v), typeof(v), note, typeof(note) FROM t ORDER BY seq").forEach { row in
            rows.append(
                "\(row.text(0))|\(row.int64(1))|\(row.text(2))|\(row.text(3))|\(row.text(4))|\(row.text(5))")
        }
        #expect(rows == [
            "périphérique ✓|1|01FF|blob||text",
            "périphérique ✓|2|02FF|blob||text",
            "périphérique ✓|3||blob||text",  // an empty blob and an empty text stay what they are, not NULL
        ])
        // A long, non-ASCII string that Swift keeps out of line binds byte for byte too.
        let long = String(repeating: "ü", count: 300)
        #expect(try db.text("SELECT ?1", [.text(long)]) == long)
        #expect(try db.integer("SELECT length(CAST(?1 AS BLOB))", [.text(long)]) == 600)
        // The next user of the cached statement starts from clean bindings.
        #expect(try db.cached("INSERT INTO t (k, seq, v, note) VALUES (?, ?, ?, ?)") === insert)
        try insert.runBound()
        #expect(try db.integer("SELECT count(*) FROM t WHERE k IS NULL AND seq IS NULL") == 1)
    }

    @Test func storeReusesItsCommitStatementsAcrossCommits() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("reuse.sqlite"), clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        // sqlite_stmt (SQLITE_ENABLE_STMTVTAB, on in Debian's libsqlite3) lists this connection's live statements.
        let live = "SELECT count(*) FROM sqlite_stmt"
        let isFrameInsert = "sql LIKE 'INSERT OR ROLLBACK INTO staged_frames%'"
        let frameInserts = "SELECT coalesce(sum(run), 0) FROM sqlite_stmt WHERE \(isFrameInsert)"
        try store.commit(batch(from: 0, dataFrames(1...20)), to: stream.key)
        let runsAfterFirst = try store.count(frameInserts)  // (also puts both probe queries in the cache)
        let afterFirst = try store.count(live)
        for window in 1..<10 {
            let first = UInt64(window * 20 + 1)
            try store.commit(batch(from: first - 1, dataFrames(first...(first + 19))), to: stream.key)
        }
        #expect(try store.count(live) == afterFirst, "commits prepared new statements instead of reusing them")
        // One statement, run once per 20-frame window: 9 runs for the 180 frames after the first window.
        #expect(try store.count("SELECT count(*) FROM sqlite_stmt WHERE \(isFrameInsert)") == 1)
        #expect(try store.count(frameInserts) - runsAfterFirst == 9)
        #expect(try store.count("SELECT count(*) FROM staged_frames") == 200)
    }

    @Test func writeTransactionRollsBackOnAThrownError() throws {
        struct Abort: Error {}
        let dir = try TemporaryDirectory()
        let db = try Database.open(path: dir.file("rollback.sqlite"))
        try db.execute("CREATE TABLE t (v INTEGER NOT NULL)")
        #expect(throws: Abort.self) {
            try db.writeTransaction {
                try db.cached("INSERT INTO t (v) VALUES (?)").run([.integer(1)])
                #expect(db.isInTransaction)
                throw Abort()
            }
        }
        #expect(!db.isInTransaction)
        #expect(try db.integer("SELECT count(*) FROM t") == 0)

        // A failing statement inside rolls back what came before it in the same transaction.
        #expect(throws: SQLiteError.self) {
            try db.writeTransaction {
                try db.cached("INSERT INTO t (v) VALUES (?)").run([.integer(2)])
                try db.cached("INSERT INTO t (v) VALUES (?)").run([.null])  // NOT NULL
            }
        }
        #expect(!db.isInTransaction)
        #expect(try db.integer("SELECT count(*) FROM t") == 0)

        let kept = try db.writeTransaction {
            try db.cached("INSERT INTO t (v) VALUES (?)").run([.integer(3)])
            return "committed"
        }
        #expect(kept == "committed")
        #expect(try db.integer("SELECT sum(v) FROM t") == 3)
    }

    @Test func valuesRoundTripIncludingEmptyBlobAndExtremeIntegers() throws {
        let dir = try TemporaryDirectory()
        let db = try Database.open(path: dir.file("values.sqlite"))
        try db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v)")
        let values: [SQLValue] = [
            .null, .integer(Int64.min), .integer(Int64.max), .text("héllo ✓"), .blob([]), .blob([0, 1, 255]),
        ]
        for (index, value) in values.enumerated() {
            try db.cached("INSERT INTO t (k, v) VALUES (?, ?)").run([.integer(Int64(index)), value])
        }
        var read: [SQLValue] = []
        var types: [String] = []
        try db.prepare("SELECT v, typeof(v) FROM t ORDER BY k").forEach {
            read.append($0.value(0))
            types.append($0.text(1))
        }
        #expect(types == ["null", "integer", "integer", "text", "blob", "blob"])
        #expect(read[0] == .null)
        #expect(read[1] == .integer(Int64.min))
        #expect(read[2] == .integer(Int64.max))
        #expect(read[3] == .text("héllo ✓"))
        #expect(read[4] == .blob([]))
        #expect(read[5] == .blob([0, 1, 255]))
    }

    @Test func releasingTheStoreClosesItsConnection() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("close.sqlite")
        weak var released: Database?
        do {
            let store = try GatewayStore(path: path, clock: FixedClock())
            let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
            try store.commit(batch(from: 0, dataFrames(1...20)), to: stream.key)
            #expect(FileManager.default.fileExists(atPath: path + "-wal"))
            released = store.database
        }
        #expect(released == nil, "the connection outlived its store (a reference cycle keeps it open)")
        // Closing the last connection checkpoints the WAL into the main file and removes it.
        #expect(!FileManager.default.fileExists(atPath: path + "-wal"))
        #expect(try GatewayStore(path: path, clock: FixedClock()).count("SELECT count(*) FROM staged_frames") == 20)
    }

    @Test func aPreparedStatementKeepsItsConnectionOpenUntilReleased() throws {
        let dir = try TemporaryDirectory()
        weak var released: Database?
        var statement: Statement?
        do {
            let db = try Database.open(path: dir.file("keepalive.sqlite"))
            _ = try db.integer("SELECT 1")  // something in the cache too
            statement = try db.prepare("SELECT 41 + 1")
            released = db
        }
        #expect(released != nil)
        #expect(try statement?.step() == true)
        #expect(statement?.int64(0) == 42)
        statement = nil
        #expect(released == nil)
    }

    @Test func openingInAMissingDirectoryFailsWithCantOpen() throws {
        let dir = try TemporaryDirectory()
        let error = #expect(throws: SQLiteError.self) { _ = try Database.open(path: dir.file("no/such/dir.sqlite")) }
        #expect(error?.resultCode == .cantopen)
    }
}
