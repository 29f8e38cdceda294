import Foundation
import Testing

@testable import FerryStore
import FerryTestBus

#if canImport(Glibc)
    import Glibc
#endif

/// Issue 12 item 5, with real processes and real files: concurrent first opens and concurrent migrations of an
/// old store never fail; the commands that only look never migrate or write; a damaged store stops `ferry run`
/// at start with one line that names the next step.
@Suite(.serialized) struct StoreOpeningTests {
    /// A store as an older Ferry left it: the migrations up to `version`, exactly as `GatewayStore` applies them.
    static func makeStore(at path: String, version: Int64) throws {
        let db = try Database.open(path: path)
        try db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        try db.execute(GatewayStore.pragmas)
        for migration in Schema.migrations where migration.version <= version {
            try db.writeTransaction { try Schema.apply(migration, to: db) }
        }
    }

    /// Starts `ferry ingest` for two peripherals back to back, so both open the store at the same moment.
    static func twoIngestsAtOnce(db: String, capture: String) throws -> [BinaryTests.Finished] {
        let addresses = ["C0:FF:EE:00:00:0A", "C0:FF:EE:00:00:0B"]
        var running: [(Process, Pipe, Pipe)] = []
        for address in addresses {
            let process = Process()
            process.executableURL = try BinaryTests.executable()
            process.arguments = ["ingest", "--db", db, "--peripheral", address, "--json", capture]
            let out = Pipe()
            let err = Pipe()
            process.standardInput = FileHandle.nullDevice
            process.standardOutput = out
            process.standardError = err
            running.append((process, out, err))
        }
        for (process, _, _) in running { try process.run() }
        return running.map { process, out, err in
            let stdout = String(decoding: out.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            let stderr = String(decoding: err.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            process.waitUntilExit()
            return BinaryTests.Finished(
                status: process.terminationStatus, signaled: process.terminationReason == .uncaughtSignal,
                stdout: stdout, stderr: stderr)
        }
    }

    static func checkBothStored(_ db: String, results: [BinaryTests.Finished], round: String) throws {
        for result in results {
            #expect(result.status == 0 && result.stderr.isEmpty, "\(round): \(result.stderr)")
        }
        let store = try GatewayStore.openReadOnly(path: db)
        #expect(try store.database.integer("PRAGMA user_version") == Schema.latestVersion, "\(round)")
        #expect(try store.streams().map(\.cursor) == [5, 5], "\(round)")
    }

    @Test func twoProcessesCreatingANewStoreAtOnceFiftyTimes() async throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...5), to: "capture.bin")
        for round in 1...50 {
            let db = dir.file("new-\(round).sqlite")
            try Self.checkBothStored(db, results: try await blocking { try Self.twoIngestsAtOnce(db: db, capture: capture) }, round: "round \(round)")
        }
    }

    @Test(arguments: Array(1..<Schema.latestVersion))
    func twoProcessesMigratingAnOldStoreAtOnceFiftyTimes(version: Int64) async throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...5), to: "capture.bin")
        for round in 1...50 {
            let db = dir.file("v\(version)-\(round).sqlite")
            try Self.makeStore(at: db, version: version)
            try Self.checkBothStored(
                db, results: try await blocking { try Self.twoIngestsAtOnce(db: db, capture: capture) }, round: "v\(version) round \(round)")
        }
    }

    static func fileBytes(_ path: String) throws -> Data { try Data(contentsOf: URL(fileURLWithPath: path)) }

    @Test func lookingCommandsDoNotMigrateAnOldStore() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("old.sqlite")
        try Self.makeStore(at: db, version: Schema.latestVersion - 1)
        // Everything in the main file: the comparison below then covers every byte of the store.
        try Database.open(path: db).execute("PRAGMA wal_checkpoint(TRUNCATE)")
        let before = try Self.fileBytes(db)
        for command in [["status"], ["peripherals"], ["outbox", "list"]] {
            let result = try await BinaryTests.run(command + ["--db", db])
            #expect(result.status == 1, "\(command)")
            #expect(
                result.stderr == "ferry: \(db) has schema version \(Schema.latestVersion - 1), this ferry uses "
                    + "\(Schema.latestVersion); read-only commands do not migrate: run `ferry run` (or ferry "
                    + "ingest/sync/forward) once to migrate it\n", "\(command)")
        }
        #expect(try Self.fileBytes(db) == before)
        #expect(try Database.open(path: db, readOnly: true).integer("PRAGMA user_version") == Schema.latestVersion - 1)
    }

    @Test func lookingCommandsReadALatestStoreWithoutWritingIt() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("current.sqlite")
        let capture = try dir.write(Wire.capture(1...5), to: "capture.bin")
        #expect(try await BinaryTests.run(["ingest", "--db", db, "--peripheral", peripheral, capture]).status == 0)
        try Database.open(path: db).execute("PRAGMA wal_checkpoint(TRUNCATE)")
        let before = try Self.fileBytes(db)
        let status = try await BinaryTests.run(["status", "--db", db, "--json"])
        #expect(status.status == 0 && status.stdout.contains(#""cursor":"5""#), "\(status.stderr)")
        #expect(try await BinaryTests.run(["outbox", "list", "--db", db]).status == 0)
        #expect(try await BinaryTests.run(["peripherals", "--db", db]).status == 0)
        #expect(try Self.fileBytes(db) == before)
        // And a read-only handle refuses writes outright.
        let store = try GatewayStore.openReadOnly(path: db)
        let error = #expect(throws: SQLiteError.self) { try store.database.execute("DELETE FROM staged_frames") }
        #expect(error?.resultCode == .readonly)
    }

    @Test func lookingCommandsOnAMissingStoreSaySoAndCreateNothing() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("absent.sqlite")
        let result = try await BinaryTests.run(["status", "--db", db])
        #expect(result.status == 1)
        #expect(result.stderr == "ferry: no database at \(db)\n")
        #expect(try dir.entries().isEmpty)
    }

    /// A store damaged in the middle (a torn write on an SD card): `ferry run` refuses to start, in one line that
    /// names the file, the first problem and the next step, before it touches the radio (the bus is unreachable).
    @Test func runRefusesADamagedStoreWithTheNextStep() async throws {
        let dir = try TemporaryDirectory()
        let state = dir.file("state")
        try FileManager.default.createDirectory(atPath: state, withIntermediateDirectories: false, attributes: [.posixPermissions: 0o700])
        let db = state + "/ferry.sqlite"
        let capture = try dir.write(Wire.capture(1...3000, payloadSize: 100), to: "capture.bin")
        #expect(try await BinaryTests.run(["ingest", "--db", db, "--peripheral", peripheral, capture]).status == 0)
        try Database.open(path: db).execute("PRAGMA wal_checkpoint(TRUNCATE)")
        let pages = try Database.open(path: db).integer("PRAGMA page_count") ?? 0
        try #require(pages > 40)
        // Overwrite part of a b-tree page in the middle of the file.
        let handle = try #require(FileHandle(forUpdatingAtPath: db))
        try handle.seek(toOffset: UInt64(4096 * 20 + 100))
        try handle.write(contentsOf: Data(repeating: 0xDE, count: 800))
        try handle.close()
        let config = try dir.write(Array(#"{"state_dir": "\#(state)", "require_bond": false}"#.utf8), to: "ferry.json")

        let result = try await BinaryTests.run(["run", "--config", config, "--bus", "unix:path=\(dir.file("no-bus"))"])
        #expect(result.status == 1)
        let lines = result.stderr.split(separator: "\n")
        #expect(lines.count == 1, "\(result.stderr)")
        #expect(result.stderr.hasPrefix("ferry: \(db) is damaged (quick_check: "), "\(result.stderr)")
        #expect(result.stderr.contains("next step: move the file aside"))

        // The same file through the library: quick_check reports problems; a sound store reports none.
        #expect(!(try GatewayStore(path: db).quickCheck().isEmpty))
        #expect(try GatewayStore(path: dir.file("sound.sqlite")).quickCheck().isEmpty)
    }
}
