import FerryStore
import FerryTestBus
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// The built `ferry` executable as a real subprocess: stdin input, exit statuses through `exit()`, and a
/// SIGKILL in the middle of an ingest followed by recovery.
@Suite struct BinaryTests {
    /// `swift build`/`swift test` put the executable next to the test bundle.
    static func executable() throws -> URL {
        let testBinary = URL(fileURLWithPath: "/proc/self/exe").resolvingSymlinksInPath()
        let candidate = testBinary.deletingLastPathComponent().appendingPathComponent("ferry")
        try #require(
            FileManager.default.isExecutableFile(atPath: candidate.path),
            "no ferry executable at \(candidate.path): run 'swift build' before 'swift test --skip-build'")
        return candidate
    }

    struct Finished: Sendable {
        var status: Int32
        var signaled: Bool
        var stdout: String
        var stderr: String
    }

    /// Waited for on a thread of its own: a test holding a cooperative-pool thread while a subprocess runs starves
    /// the suites that answer from the pool (the fake org.bluez), see `blocking`.
    static func run(_ arguments: [String], stdin: [UInt8]? = nil) async throws -> Finished {
        let executable = try executable()
        return try await blocking { try runWaiting(executable, arguments, stdin: stdin) }
    }

    private static func runWaiting(_ executable: URL, _ arguments: [String], stdin: [UInt8]?) throws -> Finished {
        let process = Process()
        process.executableURL = executable
        process.arguments = arguments
        let input = Pipe()
        let output = Pipe()
        let errors = Pipe()
        process.standardInput = stdin == nil ? FileHandle.nullDevice : input
        process.standardOutput = output
        process.standardError = errors
        try process.run()
        if let stdin {
            try input.fileHandleForWriting.write(contentsOf: Data(stdin))
            try input.fileHandleForWriting.close()
        }
        // Outputs are a few lines: reading to EOF before waiting cannot fill a pipe and deadlock.
        let out = String(decoding: output.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        let err = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        return Finished(
            status: process.terminationStatus, signaled: process.terminationReason == .uncaughtSignal, stdout: out,
            stderr: err)
    }

    /// libcurl is loaded at the uplink's first request, not at every start: linked, it brought ~30 libraries the
    /// dynamic loader relocated before any command ran (half of ferry's start-up instructions). libdbus, SQLite and
    /// zlib are linked from their static archives: the shared libdbus brings libsystemd and its compression and
    /// crypto libraries, and each shared library is one more to find, map and relocate.
    @Test func startingLoadsNoCurlOrItsTLSStackOrSystemd() async throws {
        let executable = try Self.executable()
        let listed = try await blocking { () throws -> String in
            let process = Process()
            process.executableURL = executable
            process.arguments = ["--version"]
            // The dynamic loader lists every library it would load, then exits (what ldd does).
            process.environment = ["LD_TRACE_LOADED_OBJECTS": "1"]
            let output = Pipe()
            process.standardOutput = output
            try process.run()
            let listed = String(decoding: output.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            process.waitUntilExit()
            return listed
        }
        #expect(listed.contains("libc.so"), "the listing is the loader's: \(listed)")
        #expect(!listed.contains("libcurl"), "\(listed)")
        #expect(!listed.contains("libssl") && !listed.contains("libgnutls"), "\(listed)")
        #expect(!listed.contains("libdbus") && !listed.contains("libsystemd") && !listed.contains("libgcrypt"), "\(listed)")
        #expect(!listed.contains("libsqlite3") && !listed.contains("libz.so"), "\(listed)")
    }

    /// A process opted out of transparent huge pages says so in its status (Linux 5.0+): the first touch of each
    /// thread's stack would otherwise cost a zeroed 2 MiB page where the kernel's setting is "always".
    @Test func theProcessOptsOutOfTransparentHugePages() async throws {
        let line = try await Self.whileIngestRuns(read: "status") { status in
            status.split(separator: "\n").first(where: { $0.hasPrefix("THP_enabled:") }).map(String.init)
        }
        let reported = try #require(line, "no THP_enabled line in /proc/PID/status (a kernel before 5.0?)")
        #expect(reported.split(separator: "\t").last == "0", "\(reported)")
    }

    /// Ferry links FoundationEssentials, not Foundation: full Foundation brings CoreFoundation and ICU (37 MB of
    /// data, tens of thousands of relocations at every start). A debug build links Swift's libraries as shared
    /// objects, so an `import Foundation` slipping back into Sources shows in the process's mappings.
    @Test func theProcessDoesNotLoadFoundationOrICU() async throws {
        let libraries = try await Self.whileIngestRuns(read: "maps") { maps -> [String]? in
            let paths = Set(maps.split(separator: "\n").compactMap { $0.split(separator: " ").last.map(String.init) })
            return paths.contains(where: { $0.hasSuffix(".so") || $0.contains(".so.") }) ? Array(paths) : nil
        }
        let mapped = try #require(libraries, "no shared objects in /proc/PID/maps")
        for forbidden in ["libFoundation.so", "libFoundationInternationalization.so", "lib_FoundationICU.so"] {
            #expect(
                !mapped.contains(where: { $0.hasSuffix("/" + forbidden) }),
                "ferry maps \(forbidden) (no import left? objects from before it was removed keep linking it until rebuilt)")
        }
    }

    /// Runs `ferry ingest` on an open standard input and applies `extract` to /proc/PID/`file` of the running
    /// ferry until it returns a value (10 s at most).
    private static func whileIngestRuns<T: Sendable>(
        read file: String, _ extract: @escaping @Sendable (String) -> T?
    ) async throws -> T? {
        let dir = try TemporaryDirectory()
        let executable = try Self.executable()
        let db = dir.file("ferry.sqlite")
        return try await blocking { () throws -> T? in
            let process = Process()
            process.executableURL = executable
            // Waits on its standard input, which stays open until the file is read.
            process.arguments = ["ingest", "--db", db, "--peripheral", peripheral, "-"]
            let input = Pipe()
            process.standardInput = input
            process.standardOutput = FileHandle.nullDevice
            process.standardError = FileHandle.nullDevice
            try process.run()
            defer {
                try? input.fileHandleForWriting.close()
                process.waitUntilExit()
            }
            let deadline = Date().addingTimeInterval(10)
            while Date() < deadline {
                // Read once ferry runs (it has created the store), not in the child before its exec.
                guard FileManager.default.fileExists(atPath: db) else {
                    usleep(10_000)
                    continue
                }
                let text = (try? String(contentsOfFile: "/proc/\(process.processIdentifier)/\(file)", encoding: .utf8)) ?? ""
                if let value = extract(text) { return value }
                usleep(10_000)
            }
            return nil
        }
    }

    @Test func ingestReadsStandardInputAndPrintsJSONToStandardOutput() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let bytes = Wire.capture(1...25) + [0xA5, 0x00, 0x13] + Wire.capture(26...30) + Array(Wire.dataFrame(31).prefix(5))
        let result = try await Self.run(["ingest", "--db", db, "--peripheral", peripheral, "--json", "-"], stdin: bytes)
        #expect(result.status == 0)
        #expect(result.stdout == #"{"frames":30,"stored":30,"duplicates":0,"gaps":0,"corrupt":2,"cursor":"30"}"# + "\n")
        #expect(result.stderr == "ferry: warning: 5 bytes of an incomplete frame at the end of - were not stored\n")
        #expect(try StoreProbe(db).seqs() == Array(1...30))
    }

    @Test func exitStatusesOfTheBinary() async throws {
        let dir = try TemporaryDirectory()
        let usage = try await Self.run(["ingest", "--db", dir.file("x.sqlite"), "--peripheral", "nope", "-"])
        #expect(usage.status == 2)
        #expect(usage.stdout.isEmpty)
        #expect(usage.stderr.hasPrefix("ferry: --peripheral 'nope'"))
        #expect(usage.stderr.filter { $0 == "\n" }.count == 1)

        let failure = try await Self.run(["status", "--db", dir.file("missing.sqlite")])
        #expect(failure.status == 1)
        #expect(failure.stderr == "ferry: no database at \(dir.file("missing.sqlite"))\n")

        let help = try await Self.run(["ingest", "--help"])
        #expect(help.status == 0)
        #expect(help.stdout.hasPrefix("Usage: ferry ingest"))
        #expect(try dir.entries().isEmpty)
    }

    /// kill -9 a `ferry ingest` while it is committing windows, then reopen: the file is intact, the cursor is
    /// exactly the last stored seq, the frames are exactly 1...cursor, and a second ingest carries on from it.
    @Test func killedMidIngestLosesNothingCommitted() async throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let total: UInt64 = 50_000  // far more than gets committed before the kill
        let capture = try dir.write(Wire.capture(1...total, payloadSize: 16), to: "big.bin")

        let process = Process()
        process.executableURL = try Self.executable()
        process.arguments = ["ingest", "--db", db, "--peripheral", peripheral, "--json", capture]
        process.standardInput = FileHandle.nullDevice
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()

        // Watch the cursor from a second, read-only connection (WAL readers never block the writer), on a thread
        // of its own: the kill must land while the ingest runs, whatever the cooperative pool is busy with.
        let seen = try await blocking { () -> UInt64 in
            var seen: UInt64 = 0
            let deadline = Date().addingTimeInterval(30)
            while seen < 400 && process.isRunning && Date() < deadline {
                if let probe = try? StoreProbe(db), let cursor = try? probe.cursor() { seen = cursor }
                usleep(1_000)
            }
            kill(process.processIdentifier, SIGKILL)
            process.waitUntilExit()
            return seen
        }
        #expect(process.terminationReason == .uncaughtSignal, "ingest finished before it could be killed")
        #expect(seen >= 400)

        let store = try GatewayStore(path: db)
        #expect(try store.database.text("PRAGMA integrity_check") == "ok")
        let probe = try StoreProbe(db)
        let cursor = try #require(try probe.cursor())
        #expect(cursor >= seen && cursor < total, "cursor \(cursor): the kill did not land mid-ingest")
        #expect(cursor % 20 == 0, "only whole 20-frame windows commit")
        #expect(try probe.seqs() == Array(1...cursor))
        #expect(try probe.sumOfFrameCounts() == Int64(cursor))
        #expect(try probe.count("SELECT count(*) FROM outbox_events WHERE event_type != 'FRAMES'") == 0)

        // Carry on from the recovered file (a short capture keeps the test fast: 50 new frames, 3 commits).
        let more = try dir.write(Wire.capture(1...(cursor + 50), payloadSize: 16), to: "more.bin")
        let rest = try ferry("ingest", "--db", db, "--peripheral", peripheral, "--json", more).json()
        #expect(rest["stored"] as? Int == 50)
        #expect(rest["duplicates"] as? Int == Int(cursor))
        #expect(rest["cursor"] as? String == String(cursor + 50))
        #expect(try StoreProbe(db).seqs() == Array(1...(cursor + 50)))
    }
}
