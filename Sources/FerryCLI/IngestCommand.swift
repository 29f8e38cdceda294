import FerryCore
import FerryGateway
import FerrySync
import FerryProtocol
import FerryStore

#if canImport(Glibc)
    import Glibc
#endif

enum IngestCommand {
    static let help = """
        Usage: ferry ingest --db PATH --peripheral ADDR [--epoch N] [--max-payload N] [--json] FILE|-

        Feeds a raw captured DATA byte stream (FILE, or - for stdin) through the frame decoder and the sync
        session's sequencing rules into the store at PATH (created if missing):
          - frames at or below the stored cursor are duplicates and dropped;
          - a jump in seq is recorded as a GAP outbox event (there is no peripheral to re-ask);
          - frames are committed in 20-frame windows, each with its outbox event and the cursor move;
          - valid non-DATA frames and unknown types are skipped; damaged bytes are dropped one at a time;
          - a partial frame at the end of the dump is reported and not stored.

        Options:
          --db PATH          SQLite store (created if missing)
          --peripheral ADDR  the peripheral's identity address, AA:BB:CC:DD:EE:FF
          --epoch N          the stream's epoch (STREAM_INFO), default 0
          --max-payload N    largest payload accepted, default 4096; larger length headers are noise
          --json             print one JSON object:
                             {"frames","stored","duplicates","gaps","corrupt","cursor"} (cursor is a string)
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "ingest", options: ["--db", "--peripheral", "--epoch", "--max-payload"],
            flags: ["--json"])
        let dbPath = try args.required("--db", command: "ingest")
        let peripheral = try FerryCommandLine.address(
            try args.required("--peripheral", command: "ingest"), option: "--peripheral")
        let epoch = try args.integer("--epoch", UInt64.self, default: 0)
        let maxPayload = try args.integer("--max-payload", Int.self, default: 4096, range: 0...65535)
        guard args.positionals.count == 1 else {
            throw UsageError(
                args.positionals.isEmpty
                    ? "missing capture FILE (or - for stdin) (ferry ingest)"
                    : "expected one capture FILE, got \(args.positionals.count)")
        }
        let source = args.positionals[0]

        // Open the input before the database: a bad input must not leave a fresh empty store behind.
        let fd: Int32 = source == "-" ? 0 : open(source, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else {
            throw CommandFailure("cannot read capture \(source): \(errnoDescription(errno))")
        }
        defer { if fd != 0 { close(fd) } }
        var info = stat()
        if fstat(fd, &info) == 0 && (info.st_mode & S_IFMT) == S_IFDIR {
            throw CommandFailure("cannot read capture \(source): it is a directory")
        }

        let store = try FerryCommandLine.openStore(dbPath, create: true)
        let ingestor: DumpIngestor
        do {
            ingestor = try DumpIngestor(
                store: store, peripheral: peripheral, epoch: epoch, maxPayloadLength: maxPayload)
        } catch {
            throw CommandFailure("database \(dbPath): \(error)")
        }
        var buffer = [UInt8](repeating: 0, count: 1 << 16)
        while true {
            let count = buffer.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
            if count < 0 {
                if errno == EINTR { continue }
                throw CommandFailure("reading \(source): \(errnoDescription(errno)) (windows committed so far are kept)")
            }
            if count == 0 { break }
            do {
                try buffer.withUnsafeBytes { try ingestor.feed(UnsafeRawBufferPointer(rebasing: $0[0..<count])) }
            } catch {
                throw CommandFailure("database \(dbPath): \(error) (windows committed so far are kept)")
            }
        }
        let report: DumpIngestReport
        do {
            report = try ingestor.finish()
        } catch {
            throw CommandFailure("database \(dbPath): \(error) (windows committed so far are kept)")
        }
        if args.flags.contains("--json") {
            output.out(
                JSON.object([
                    ("frames", .int(report.frames)), ("stored", .int(report.stored)),
                    ("duplicates", .int(report.duplicates)), ("gaps", .int(report.gaps)),
                    ("corrupt", .int(report.corrupt)), ("cursor", .string(String(report.cursor))),
                ]).text)
        } else {
            output.out(
                "ingested \(source) for \(peripheral) epoch \(report.epoch): \(report.frames) frames, "
                    + "\(report.stored) stored, \(report.duplicates) duplicates, \(report.gaps) gaps, "
                    + "\(report.corrupt) corrupt, cursor \(report.cursor)")
            if report.skipped > 0 { output.out("skipped \(report.skipped) non-DATA frames") }
        }
        if report.trailingPartialBytes > 0 {
            output.err("ferry: warning: \(report.trailingPartialBytes) bytes of an incomplete frame at the end of \(source) were not stored")
        }
        return 0
    }
}
