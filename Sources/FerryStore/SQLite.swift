import CSQLite

/// Every failure of the SQLite layer: the result code, SQLite's message, and the SQL that failed.
public struct SQLiteError: Error, CustomStringConvertible, Sendable {
    public let code: Int32
    public let message: String
    public let sql: String?

    public init(code: Int32, message: String, sql: String? = nil) {
        self.code = code
        self.message = message
        self.sql = sql
    }

    /// The primary result code (extended codes carry detail in the upper bits).
    public var primaryCode: Int32 { code & 0xFF }
    /// The primary result code, typed (nil for a code this enum does not name).
    public var resultCode: SQLiteResultCode? { SQLiteResultCode(rawValue: primaryCode) }
    public var isBusy: Bool { resultCode == .busy || resultCode == .locked }
    public var isFull: Bool { resultCode == .full }

    public var description: String {
        var text = "SQLite error \(code): \(message)"
        if let sql { text += " (in: \(sql.split(separator: "\n").joined(separator: " ")))" }
        return text
    }
}

/// SQLite's primary result codes (https://sqlite.org/rescode.html), as GRDB types them: callers match
/// `catch let e as SQLiteError where e.resultCode == .corrupt`, or `case .busy = error` through `~=`.
public enum SQLiteResultCode: Int32, Sendable, CaseIterable {
    case error = 1, `internal`, perm, abort, busy, locked, nomem, readonly, interrupt, ioerr, corrupt, notfound, full
    case cantopen, `protocol`, empty, schema, toobig, constraint, mismatch, misuse, nolfs, auth, format, range, notadb
    case notice, warning

    /// `case .busy = error` / `switch error { case .full: ... }`: the error's primary code is this one.
    public static func ~= (pattern: SQLiteResultCode, error: SQLiteError) -> Bool { error.resultCode == pattern }
}

/// A value bound to or read from a statement.
public enum SQLValue: Sendable, Equatable {
    case null
    case integer(Int64)
    case text(String)
    case blob([UInt8])
}

/// One SQLite connection. The only owner of its `sqlite3*`; closed in `deinit`. Not thread-safe by design:
/// exactly one component (an actor, a thread) owns a `Database`.
public final class Database {
    let handle: OpaquePointer
    public let path: String
    private var statementCache: [String: Statement] = [:]

    /// Process-wide SQLite settings, applied once before the first connection opens (sqlite3_config refuses them
    /// afterwards, harmlessly).
    private static let processConfigured: Bool = ferry_sqlite3_disable_memory_statistics() == SQLITE_OK

    private init(handle: OpaquePointer, path: String) {
        self.handle = handle
        self.path = path
    }

    /// How long a statement waits for another connection's lock before SQLITE_BUSY, from `open` on.
    public static let busyTimeoutMilliseconds: Int32 = 5_000

    /// Opens (and by default creates) the database file. The handle is closed again if anything fails.
    public static func open(path: String, readOnly: Bool = false, create: Bool = true) throws -> Database {
        _ = processConfigured
        var raw: OpaquePointer?
        var flags = SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_EXRESCODE
        flags |= readOnly ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE
        if create && !readOnly { flags |= SQLITE_OPEN_CREATE }
        let rc = sqlite3_open_v2(path, &raw, flags, nil)
        guard rc == SQLITE_OK, let raw else {
            let message = raw.map { String(cString: sqlite3_errmsg($0)) } ?? String(cString: sqlite3_errstr(rc))
            sqlite3_close_v2(raw)
            throw SQLiteError(code: rc, message: message)
        }
        let db = Database(handle: raw, path: path)  // from here on deinit closes it
        sqlite3_busy_timeout(raw, busyTimeoutMilliseconds)
        return db
    }

    deinit {
        statementCache.removeAll()  // finalize cached statements before the connection
        sqlite3_close_v2(handle)
    }

    func error(_ code: Int32, sql: String?) -> SQLiteError {
        SQLiteError(code: code, message: String(cString: sqlite3_errmsg(handle)), sql: sql)
    }

    /// Runs one or more statements without results (schema, pragmas, BEGIN/COMMIT).
    public func execute(_ sql: String) throws {
        let rc = sqlite3_exec(handle, sql, nil, nil, nil)
        guard rc == SQLITE_OK else { throw error(rc, sql: sql) }
    }

    /// A fresh statement, finalized when released.
    public func prepare(_ sql: String) throws -> Statement {
        try makeStatement(sql, ownedByCache: false)
    }

    private func makeStatement(_ sql: String, ownedByCache: Bool) throws -> Statement {
        var raw: OpaquePointer?
        let rc = sqlite3_prepare_v3(handle, sql, -1, UInt32(SQLITE_PREPARE_PERSISTENT), &raw, nil)
        guard rc == SQLITE_OK, let raw else { throw error(rc, sql: sql) }
        return Statement(handle: raw, database: self, sql: sql, ownedByCache: ownedByCache)
    }

    /// A statement prepared once per connection and reused (reset, bindings cleared) on every call.
    /// The connection owns it: use it while the connection lives, do not keep it beyond that.
    public func cached(_ sql: String) throws -> Statement {
        if let statement = statementCache[sql] {
            statement.reset()
            return statement
        }
        let statement = try makeStatement(sql, ownedByCache: true)
        statementCache[sql] = statement
        return statement
    }

    /// How long a statement waits for another connection's lock before failing with SQLITE_BUSY.
    public func setBusyTimeout(milliseconds: Int32) {
        sqlite3_busy_timeout(handle, milliseconds)
    }

    /// SQLITE_FCNTL_PERSIST_WAL: whether the last connection to close keeps the WAL file instead of deleting it.
    public func setPersistentWAL(_ persistent: Bool) throws {
        var value: Int32 = persistent ? 1 : 0
        let rc = sqlite3_file_control(handle, "main", SQLITE_FCNTL_PERSIST_WAL, &value)
        guard rc == SQLITE_OK else { throw error(rc, sql: nil) }
    }

    public var changes: Int { Int(sqlite3_changes(handle)) }
    public var isInTransaction: Bool { sqlite3_get_autocommit(handle) == 0 }

    /// Runs `body` inside BEGIN IMMEDIATE … COMMIT (the write lock is taken up front, so the cursor read inside
    /// cannot go stale before the write); rolls back if `body` or the COMMIT throws.
    public func writeTransaction<T>(_ body: () throws -> T) throws -> T {
        // Prepared once: a sync session runs one of these per ACK, and sqlite3_exec would parse both every time.
        try cached("BEGIN IMMEDIATE").run()
        do {
            let result = try body()
            try cached("COMMIT").run()
            return result
        } catch {
            if isInTransaction { try? execute("ROLLBACK") }
            throw error
        }
    }

    /// The single value of a one-row, one-column query (nil for no row or NULL).
    public func scalar(_ sql: String, _ values: [SQLValue] = []) throws -> SQLValue? {
        let statement = try cached(sql)
        try statement.bind(values)
        guard try statement.step() else { return nil }
        let value = statement.value(0)
        statement.reset()
        return value == .null ? nil : value
    }

    public func integer(_ sql: String, _ values: [SQLValue] = []) throws -> Int64? {
        if case .integer(let v) = try scalar(sql, values) { return v }
        return nil
    }

    public func text(_ sql: String, _ values: [SQLValue] = []) throws -> String? {
        switch try scalar(sql, values) {
        case .text(let v): return v
        case .integer(let v): return String(v)
        default: return nil
        }
    }
}

/// One prepared statement; finalized in `deinit`.
public final class Statement {
    let handle: OpaquePointer
    /// A statement from `prepare()` keeps its connection alive as long as it lives (sqlite3_close_v2 would
    /// otherwise leave a zombie). A cached statement must not: the connection owns it and finalizes it in its
    /// deinit, and a strong reference back would be a cycle that never closes the connection.
    private let retainedDatabase: Database?
    private weak var cachingDatabase: Database?
    public let sql: String

    init(handle: OpaquePointer, database: Database, sql: String, ownedByCache: Bool) {
        self.handle = handle
        retainedDatabase = ownedByCache ? nil : database
        cachingDatabase = ownedByCache ? database : nil
        self.sql = sql
    }

    private func error(_ code: Int32) -> SQLiteError {
        if let database = retainedDatabase ?? cachingDatabase { return database.error(code, sql: sql) }
        return SQLiteError(code: code, message: String(cString: sqlite3_errstr(code)), sql: sql)
    }

    deinit { sqlite3_finalize(handle) }

    func reset() {
        sqlite3_reset(handle)
        sqlite3_clear_bindings(handle)
    }

    private static let transient = unsafeBitCast(-1, to: sqlite3_destructor_type.self)

    /// Binds `values` to parameters 1, 2, … in order.
    public func bind(_ values: [SQLValue]) throws {
        for (offset, value) in values.enumerated() {
            try bind(value, at: Int32(offset + 1))
        }
    }

    /// Binds one parameter (1-based). Bindings outlive `sqlite3_reset`, so a loop over rows can bind the columns
    /// they share once and only the ones that change per row (`runBound`).
    public func bind(_ value: SQLValue, at index: Int32) throws {
        let rc: Int32
        switch value {
        case .null: rc = sqlite3_bind_null(handle, index)
        case .integer(let v): rc = sqlite3_bind_int64(handle, index, v)
        case .text(var v):
            // withUTF8 reads a native string in place; passing the String itself would copy it into a fresh
            // C array first.
            rc = v.withUTF8 { utf8 in
                utf8.withMemoryRebound(to: CChar.self) { text in
                    // A nil pointer would bind NULL, not the empty text.
                    guard let start = text.baseAddress else {
                        return sqlite3_bind_text(handle, index, "", 0, Statement.transient)
                    }
                    return sqlite3_bind_text(handle, index, start, Int32(text.count), Statement.transient)
                }
            }
        case .blob(let v):
            rc = v.withUnsafeBytes { p in
                // A zero-length blob must still bind as a blob, not NULL: pass a non-nil pointer.
                sqlite3_bind_blob(handle, index, p.baseAddress ?? UnsafeRawPointer(bitPattern: 1), Int32(v.count),
                    Statement.transient)
            }
        }
        guard rc == SQLITE_OK else { throw error(rc) }
    }

    /// Advances; true when a row is available, false when done.
    public func step() throws -> Bool {
        let rc = sqlite3_step(handle)
        switch rc {
        case SQLITE_ROW: return true
        case SQLITE_DONE: return false
        default:
            let failure = error(rc)
            sqlite3_reset(handle)
            throw failure
        }
    }

    /// Binds, runs to completion, resets.
    public func run(_ values: [SQLValue] = []) throws {
        try bind(values)
        try runBound()
    }

    /// Runs to completion with the parameters bound so far, resets, and keeps the bindings.
    public func runBound() throws {
        while try step() {}
        sqlite3_reset(handle)
    }

    /// Binds and calls `row` for every result row, then resets.
    public func forEach(_ values: [SQLValue] = [], _ row: (Statement) throws -> Void) throws {
        try bind(values)
        defer { sqlite3_reset(handle) }
        while try step() { try row(self) }
    }

    public func value(_ column: Int32) -> SQLValue {
        switch sqlite3_column_type(handle, column) {
        case SQLITE_NULL: return .null
        case SQLITE_INTEGER: return .integer(sqlite3_column_int64(handle, column))
        case SQLITE_BLOB: return .blob(blob(column))
        default: return .text(text(column))
        }
    }

    public func int64(_ column: Int32) -> Int64 { sqlite3_column_int64(handle, column) }
    public func isNull(_ column: Int32) -> Bool { sqlite3_column_type(handle, column) == SQLITE_NULL }

    public func text(_ column: Int32) -> String {
        guard let p = sqlite3_column_text(handle, column) else { return "" }
        return String(cString: p)
    }

    public func optionalText(_ column: Int32) -> String? { isNull(column) ? nil : text(column) }

    public func blob(_ column: Int32) -> [UInt8] {
        let count = Int(sqlite3_column_bytes(handle, column))
        guard count > 0, let p = sqlite3_column_blob(handle, column) else { return [] }
        return [UInt8](UnsafeRawBufferPointer(start: p, count: count))
    }
}
