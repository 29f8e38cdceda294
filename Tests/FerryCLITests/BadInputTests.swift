import FerryCLI
import FerryStore
import Foundation
import Testing

/// Bad input: a one-line error naming the problem, exit 2 for usage mistakes and 1 for everything else,
/// nothing on stdout, and no database file left behind when the input was the problem.
@Suite struct BadInputTests {
    private func expectFailure(
        _ result: CommandResult, status: Int32, mentioning needle: String, sourceLocation: SourceLocation = #_sourceLocation
    ) {
        #expect(result.status == status, sourceLocation: sourceLocation)
        #expect(result.stdout.isEmpty, sourceLocation: sourceLocation)
        #expect(result.stderr.count == 1, "expected one error line, got \(result.stderr)", sourceLocation: sourceLocation)
        let line = result.stderr.first ?? ""
        #expect(!line.contains("\n"), sourceLocation: sourceLocation)
        #expect(line.hasPrefix("ferry: "), sourceLocation: sourceLocation)
        #expect(line.contains(needle), "'\(line)' does not mention '\(needle)'", sourceLocation: sourceLocation)
    }

    @Test func forwardRetentionHoursMustBeANonNegativeNumber() throws {
        let dir = try TemporaryDirectory()
        for bad in ["-1", "72h", "100000"] {
            let result = ferry(
                "forward", "--db", dir.file("ferry.sqlite"), "--endpoint", "http://127.0.0.1:9/", "--retention-hours", bad)
            expectFailure(result, status: 2, mentioning: "--retention-hours")
        }
        #expect(try dir.entries().isEmpty)
    }

    /// The config file is read up to 1 MiB: an endless "file" ends in one line, not in a process filling memory.
    @Test func configFilesThatCannotBeAConfigAreRefusedInOneLine() throws {
        let dir = try TemporaryDirectory()
        expectFailure(ferry("run", "--config", "/dev/zero"), status: 2, mentioning: "larger than 1048576 bytes")
        let huge = try dir.write(Array(repeating: UInt8(ascii: " "), count: (1 << 20) + 1), to: "huge.json")
        expectFailure(ferry("run", "--config", huge), status: 2, mentioning: "larger than 1048576 bytes")
        expectFailure(ferry("run", "--config", dir.file("missing.json")), status: 2, mentioning: "No such file or directory")
        expectFailure(ferry("run", "--config", dir.path), status: 2, mentioning: "Is a directory")
        // At the limit it is read and parsed: the error is then about its content.
        let padded = try dir.write(Array(#"{"state_dir": 5}"#.utf8) + Array(repeating: UInt8(ascii: " "), count: (1 << 20) - 16), to: "padded.json")
        expectFailure(ferry("run", "--config", padded), status: 2, mentioning: "state_dir")
    }

    @Test func missingCaptureFile() throws {
        let dir = try TemporaryDirectory()
        let missing = dir.file("no-such-capture.bin")
        let result = ferry("ingest", "--db", dir.file("ferry.sqlite"), "--peripheral", peripheral, missing)
        expectFailure(result, status: 1, mentioning: missing)
        #expect(try dir.entries().isEmpty, "a bad input left files behind")
    }

    @Test func captureIsADirectory() throws {
        let dir = try TemporaryDirectory()
        try FileManager.default.createDirectory(atPath: dir.file("captures"), withIntermediateDirectories: false)
        let result = ferry("ingest", "--db", dir.file("ferry.sqlite"), "--peripheral", peripheral, dir.file("captures"))
        expectFailure(result, status: 1, mentioning: "directory")
        #expect(try dir.entries() == ["captures"])
    }

    @Test func databaseInAMissingDirectory() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...3), to: "c.bin")
        let db = dir.file("missing/ferry.sqlite")
        let result = ferry("ingest", "--db", db, "--peripheral", peripheral, capture)
        expectFailure(result, status: 1, mentioning: db)
        #expect(try dir.entries() == ["c.bin"])
    }

    @Test func databasePathIsADirectory() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...3), to: "c.bin")
        try FileManager.default.createDirectory(atPath: dir.file("db"), withIntermediateDirectories: false)
        let result = ferry("ingest", "--db", dir.file("db"), "--peripheral", peripheral, capture)
        expectFailure(result, status: 1, mentioning: dir.file("db"))
        #expect(try FileManager.default.contentsOfDirectory(atPath: dir.file("db")).isEmpty)
    }

    @Test func databaseIsATextFile() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...3), to: "c.bin")
        let db = dir.file("notes.sqlite")
        let text = String(repeating: "shopping list: milk, eggs, bread\n", count: 8)
        try text.write(toFile: db, atomically: false, encoding: .utf8)
        let result = ferry("ingest", "--db", db, "--peripheral", peripheral, capture)
        expectFailure(result, status: 1, mentioning: "not a usable Ferry database")
        #expect(try String(contentsOfFile: db, encoding: .utf8) == text)
        #expect(try dir.entries() == ["c.bin", "notes.sqlite"])

        let status = ferry("status", "--db", db)
        expectFailure(status, status: 1, mentioning: db)
        #expect(try String(contentsOfFile: db, encoding: .utf8) == text)
    }

    @Test func databaseWithDamagedPages() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...100), to: "c.bin")
        let db = dir.file("ferry.sqlite")
        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, capture).status == 0)
        #expect(!FileManager.default.fileExists(atPath: db + "-wal"), "the store was not closed cleanly")
        // Keep the header page, overwrite every other page: the tables' b-trees are garbage now.
        var bytes = try [UInt8](Data(contentsOf: URL(fileURLWithPath: db)))
        try #require(bytes.count > 4096)
        for index in 4096..<bytes.count { bytes[index] = index % 2 == 0 ? 0xDE : 0xAD }
        try Data(bytes).write(to: URL(fileURLWithPath: db))

        expectFailure(ferry("ingest", "--db", db, "--peripheral", peripheral, capture), status: 1, mentioning: "malformed")
        expectFailure(ferry("status", "--db", db, "--json"), status: 1, mentioning: "malformed")
    }

    @Test func databaseOfAnotherApplication() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...3), to: "c.bin")
        let db = dir.file("contacts.sqlite")
        do { try Database.open(path: db).execute("CREATE TABLE contacts (name TEXT)") }
        expectFailure(ferry("ingest", "--db", db, "--peripheral", peripheral, capture), status: 1, mentioning: "another application")
        expectFailure(ferry("status", "--db", db), status: 1, mentioning: "another application")
        #expect(try Database.open(path: db).integer("SELECT count(*) FROM sqlite_master") == 1)
    }

    @Test func databaseFromANewerFerry() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...3), to: "c.bin")
        let db = dir.file("ferry.sqlite")
        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, capture).status == 0)
        do {
            let sql = try Database.open(path: db)
            let version = try sql.integer("PRAGMA user_version") ?? 0
            try sql.execute("PRAGMA user_version = \(version + 1)")
        }
        expectFailure(ferry("ingest", "--db", db, "--peripheral", peripheral, capture), status: 1, mentioning: "newer")
        expectFailure(ferry("status", "--db", db), status: 1, mentioning: "upgrade ferry")
    }

    @Test(arguments: [
        ["--peripheral", "C0:FF:EE:00:00"],  // too short
        ["--peripheral", "C0:FF:EE:00:00:0G"],  // not hex
        ["--peripheral", "C0-FF-EE-00-00-01"],
        ["--peripheral", ""],
    ])
    func badPeripheralAddress(_ option: [String]) throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...3), to: "c.bin")
        let result = ferry(["ingest", "--db", dir.file("ferry.sqlite")] + option + [capture])
        #expect(result.status == 2)
        #expect(result.stderr.count == 1)
        #expect(result.stderr.first?.contains("--peripheral") == true)
        #expect(try dir.entries() == ["c.bin"])
    }

    @Test(arguments: [
        (["--bogus"], "--bogus"),
        (["--json=yes"], "--json"),
        (["--epoch", "twelve"], "--epoch"),
        (["--max-payload", "70000"], "--max-payload"),
        (["--epoch"], "--epoch"),  // option without its value
    ])
    func usageMistakesExitWith2(_ extra: [String], _ needle: String) throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...3), to: "c.bin")
        let result = ferry(["ingest", "--db", dir.file("ferry.sqlite"), "--peripheral", peripheral, capture] + extra)
        expectFailure(result, status: 2, mentioning: needle)
        #expect(try dir.entries() == ["c.bin"])
    }

    /// Seconds and hours become Durations and milliseconds, which have limits: a number past them is a usage
    /// error, not a trap (`--timeout 1e300` once crashed `ferry sync`).
    @Test(arguments: [
        ["sync", "--address", "AA:BB:CC:DD:EE:01", "--timeout"],
        ["pair", "--address", "AA:BB:CC:DD:EE:01", "--timeout"],
        ["scan", "--timeout"],
        ["run", "--sync-interval"],
    ])
    func secondsOutOfRangeAreUsageErrors(_ command: [String]) throws {
        let dir = try TemporaryDirectory()
        let option = command.last ?? ""
        var extra = ["--bus", "unix:path=\(dir.file("no-bus"))"]
        var files: [String] = []
        switch command[0] {
        case "sync", "pair": extra += ["--db", dir.file("ferry.sqlite")]
        case "run":
            let config = #"{"state_dir": "\#(dir.file("state"))"}"#
            extra += ["--config", try dir.write(Array(config.utf8), to: "ferry.json")]
            files = ["ferry.json"]
        default: break
        }
        for bad in ["1e300", "inf", "nan", "-1", "1e9", "ten"] {
            let result = ferry(Array(command.dropLast()) + extra + [option, bad])
            expectFailure(result, status: 2, mentioning: option)
        }
        #expect(try dir.entries() == Set(files), "a bad option left files behind")
    }

    @Test func missingRequiredArguments() throws {
        let dir = try TemporaryDirectory()
        let capture = try dir.write(Wire.capture(1...3), to: "c.bin")
        let db = dir.file("ferry.sqlite")
        expectFailure(ferry("ingest", "--peripheral", peripheral, capture), status: 2, mentioning: "--db")
        expectFailure(ferry("ingest", "--db", db, capture), status: 2, mentioning: "--peripheral")
        expectFailure(ferry("ingest", "--db", db, "--peripheral", peripheral), status: 2, mentioning: "FILE")
        expectFailure(ferry("ingest", "--db", db, "--peripheral", peripheral, capture, capture), status: 2, mentioning: "one")
        expectFailure(ferry("status"), status: 2, mentioning: "--db")
        expectFailure(ferry("status", "--db", db, "--verbose"), status: 2, mentioning: "--verbose")
        expectFailure(ferry("status", "--db", db, "extra"), status: 2, mentioning: "extra")
        expectFailure(ferry("frobnicate"), status: 2, mentioning: "frobnicate")
        #expect(ferry([]).status == 2)
        #expect(try dir.entries() == ["c.bin"])
    }

    @Test func statusOfAMissingDatabaseCreatesNothing() throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("absent.sqlite")
        expectFailure(ferry("status", "--db", db), status: 1, mentioning: db)
        expectFailure(ferry("status", "--db", db, "--json"), status: 1, mentioning: db)
        #expect(try dir.entries().isEmpty)
    }

    @Test(arguments: ["ingest", "status", "demo"])
    func helpOfEachCommandExitsZero(_ command: String) {
        for flag in ["--help", "-h"] {
            let result = ferry(command, flag)
            #expect(result.status == 0)
            #expect(result.stderr.isEmpty)
            #expect(result.stdout.first?.hasPrefix("Usage: ferry \(command)") == true)
        }
    }

    @Test func topLevelHelpAndVersion() {
        let help = ferry("--help")
        #expect(help.status == 0)
        #expect(help.stdout.first?.contains("ingest") == true)
        #expect(help.stdout.first?.contains("status") == true)
        let version = ferry("--version")
        #expect(version.status == 0)
        #expect(version.stdout == ["ferry \(FerryCommandLine.version)"])
    }
}
