/// Versioned schema migrations, tracked with `PRAGMA user_version`. The pending ones run in one transaction,
/// which also reads the version (concurrent first opens); a database newer than this binary is refused rather
/// than guessed at.
///
/// Table and column names are a contract: operators query the file directly (PROTOCOL §5).
enum Schema {
    /// `rewritesDefinitions`: the migration edits a table's stored definition through `writable_schema` instead
    /// of DDL, so `migrate` bumps `schema_version` in the same transaction: every connection, this one included,
    /// then reads the new definition before its next statement.
    static let migrations: [(version: Int64, sql: String, rewritesDefinitions: Bool)] = [
        (
            1,
            """
            CREATE TABLE stream_cursors (
                peripheral   TEXT    NOT NULL,
                epoch        TEXT    NOT NULL,              -- UInt64 as decimal text: the stream's key epoch
                device_epoch TEXT    NOT NULL,              -- the epoch the peripheral reports (differs after a rebase)
                cursor       INTEGER NOT NULL DEFAULT 0,    -- highest seq durably committed
                active       INTEGER NOT NULL DEFAULT 1,    -- 0 once a counter regression rebased the stream
                created_at   INTEGER NOT NULL,              -- unix milliseconds
                updated_at   INTEGER NOT NULL,
                PRIMARY KEY (peripheral, epoch)
            );
            CREATE UNIQUE INDEX idx_stream_cursors_active
                ON stream_cursors (peripheral, device_epoch) WHERE active = 1;

            CREATE TABLE staged_frames (
                peripheral  TEXT    NOT NULL,
                epoch       TEXT    NOT NULL,
                seq         INTEGER NOT NULL,               -- UInt64 bit pattern (negative only above 2^63)
                payload     BLOB    NOT NULL,
                received_at INTEGER NOT NULL,               -- unix milliseconds
                outbox_id   TEXT    NOT NULL,               -- the FRAMES outbox event that carries it upstream
                PRIMARY KEY (peripheral, epoch, seq)
            ) WITHOUT ROWID;

            CREATE TABLE outbox_events (
                id            TEXT    PRIMARY KEY NOT NULL,
                event_type    TEXT    NOT NULL CHECK (event_type IN ('FRAMES', 'GAP', 'REGRESSION')),
                payload       TEXT    NOT NULL,             -- JSON (FRAMES: the range; frames live in staged_frames)
                status        TEXT    NOT NULL CHECK (status IN ('PENDING', 'IN_FLIGHT', 'COMPLETED', 'FAILED')),
                retry_count   INTEGER NOT NULL DEFAULT 0,
                next_retry_at INTEGER NOT NULL,             -- unix milliseconds
                created_at    INTEGER NOT NULL,             -- unix milliseconds
                peripheral    TEXT    NOT NULL,
                epoch         TEXT    NOT NULL,
                first_seq     INTEGER,
                last_seq      INTEGER,
                frame_count   INTEGER NOT NULL DEFAULT 0,
                payload_bytes INTEGER NOT NULL DEFAULT 0,   -- sum of the frames' payload sizes (batch sizing)
                batch_id      TEXT,                         -- Idempotency-Key of the claim that carries it
                claimed_at    INTEGER,
                completed_at  INTEGER,
                last_error    TEXT
            );
            CREATE INDEX idx_outbox_queue ON outbox_events (status, next_retry_at);
            CREATE INDEX idx_outbox_batch ON outbox_events (batch_id) WHERE batch_id IS NOT NULL;
            """,
            false
        ),
        (
            2,
            """
            -- Peripherals the operator paired with this gateway (`ferry pair`): the production allowlist.
            CREATE TABLE trusted_peripherals (
                address        TEXT    PRIMARY KEY NOT NULL,  -- identity address, as BlueZ reports it once bonded
                address_type   TEXT    NOT NULL CHECK (address_type IN ('public', 'random')),
                name           TEXT,
                pairing_method TEXT    NOT NULL,              -- just-works | passkey | numeric-comparison | existing-bond
                paired_at      INTEGER NOT NULL               -- unix milliseconds
            );

            -- How each peripheral's last session ended (ferry run / ferry sync), for `ferry peripherals`.
            CREATE TABLE peripheral_sync_state (
                peripheral   TEXT    PRIMARY KEY NOT NULL,
                last_sync_at INTEGER NOT NULL,                -- unix milliseconds
                last_result  TEXT    NOT NULL,                -- caughtUp | shutdown | linkLost | ... or a refusal
                epoch        TEXT,                            -- the stream's store epoch (decimal text)
                head         INTEGER                          -- STREAM_INFO head last seen, if any
            );
            """,
            false
        ),
        (
            3,
            """
            -- The uplink (issue 11). The `gateway` field a batch was first sent with: a resend is byte-identical
            -- whatever the host name or --gateway-id became since (a backend answers 422 to the same
            -- Idempotency-Key with another body).
            ALTER TABLE outbox_events ADD COLUMN batch_gateway TEXT;

            -- One forwarder per store: the row's owner may claim batches until expires_at. A second forwarder
            -- refuses while the owner lives; IN_FLIGHT rows go back to PENDING only when their owner is gone.
            -- The owner also records the uplink's state for `ferry status`.
            CREATE TABLE uplink_forwarder (
                id          INTEGER PRIMARY KEY CHECK (id = 1),
                owner       TEXT    NOT NULL,     -- random id of one forwarder instance
                pid         INTEGER NOT NULL,
                boot_id     TEXT    NOT NULL,     -- /proc/sys/kernel/random/boot_id: a pid means nothing after a reboot
                expires_at  INTEGER NOT NULL,     -- unix milliseconds; renewed while it runs
                state       TEXT    NOT NULL DEFAULT 'online',  -- online | offline | paused
                state_since INTEGER,              -- unix milliseconds
                detail      TEXT                  -- why offline or paused
            );
            """,
            false
        ),
        (
            4,
            """
            -- outbox_events' two CHECKs, the same rules spelled as comparisons: SQLite 3.40 evaluates an IN list of
            -- three or more constants by building a temporary b-tree, and did so twice for every outbox row a
            -- commit inserts (a sixth of a commit's instructions). Only the table's stored definition changes, no
            -- row: SQLite's documented way to change a CHECK
            -- (https://sqlite.org/lang_altertable.html#otheralter).
            PRAGMA writable_schema = ON;
            UPDATE sqlite_master SET sql = replace(replace(sql,
                    'CHECK (event_type IN (''FRAMES'', ''GAP'', ''REGRESSION''))',
                    'CHECK (event_type = ''FRAMES'' OR event_type = ''GAP'' OR event_type = ''REGRESSION'')'),
                    'CHECK (status IN (''PENDING'', ''IN_FLIGHT'', ''COMPLETED'', ''FAILED''))',
                    'CHECK (status = ''PENDING'' OR status = ''IN_FLIGHT'' OR status = ''COMPLETED'' OR status = ''FAILED'')')
                WHERE type = 'table' AND name = 'outbox_events';
            PRAGMA writable_schema = OFF;
            """,
            true
        ),
    ]

    static var latestVersion: Int64 { migrations.last!.version }

    /// Applies one migration inside the caller's transaction and records its version: the one way a store gets
    /// it (`GatewayStore.migrate`, and tests building a store as an older Ferry left it).
    static func apply(_ migration: (version: Int64, sql: String, rewritesDefinitions: Bool), to database: Database) throws {
        try database.execute(migration.sql)
        if migration.rewritesDefinitions {
            let schemaVersion = try database.integer("PRAGMA schema_version") ?? 0
            try database.execute("PRAGMA schema_version = \(schemaVersion + 1)")
        }
        try database.execute("PRAGMA user_version = \(migration.version)")
    }
}

public enum StoreError: Error, CustomStringConvertible, Sendable {
    case sqlite(SQLiteError)
    /// The file is a database written by a newer Ferry.
    case schemaTooNew(found: Int64, supported: Int64)
    /// The file is not a SQLite database, or is damaged.
    case notADatabase(path: String, detail: String)
    /// A commit found a stored cursor that does not continue into the batch (another writer, or a bug).
    case cursorMismatch(stored: UInt64, batchStartsAt: UInt64)
    case unknownOutboxEvent(String)
    /// A column holds a value this ferry never writes (a damaged or hand-edited row).
    case unexpectedValue(column: String, value: String)
    /// A read-only open found an older schema: a writing command has to migrate it first.
    case needsMigration(path: String, found: Int64, supported: Int64)
    /// `PRAGMA quick_check` found damage (daemon start).
    case damaged(path: String, problems: [String])

    public var description: String {
        switch self {
        case .sqlite(let e): e.description
        case .schemaTooNew(let found, let supported):
            "database schema version \(found) is newer than this ferry supports (\(supported)); upgrade ferry"
        case .notADatabase(let path, let detail): "\(path) is not a usable Ferry database: \(detail)"
        case .cursorMismatch(let stored, let start):
            "stored cursor \(stored) does not continue into a batch starting at \(start); nothing was written"
        case .unknownOutboxEvent(let id): "no outbox event with id \(id)"
        case .unexpectedValue(let column, let value): "unexpected value in \(column): \(String(reflecting: value))"
        case .needsMigration(let path, let found, let supported):
            "\(path) has schema version \(found), this ferry uses \(supported); read-only commands do not migrate: "
                + "run `ferry run` (or ferry ingest/sync/forward) once to migrate it"
        case .damaged(let path, let problems):
            "\(path) is damaged (quick_check: \(problems.first ?? "?")"
                + (problems.count > 1 ? "; and \(problems.count - 1) more" : "") + "); next step: move the file "
                + "aside (keep it: `sqlite3 FILE .recover` may salvage undelivered rows) and start ferry again, which "
                + "creates a fresh store; peripherals still hold every event they were not acknowledged for"
        }
    }
}
