import FerryCore
import FerryStore

enum OutboxCommand {
    static let help = """
        Usage: ferry outbox list [--status S] --db PATH [--json] [--limit N]
               ferry outbox retry (--id ID | --all-failed) --db PATH

        list   outbox events oldest first; S is PENDING, IN_FLIGHT, COMPLETED or FAILED. --json prints an array
               of {"id","type","status","peripheral","epoch","first_seq","last_seq","frames","retry_count",
               "next_retry_at","created_at","batch_id","last_error"} (seqs as strings, times in unix ms).
               Read-only: never migrates or writes the store.
        retry  sends FAILED events again: back to PENDING with a fresh retry budget and a new batch (a new
               Idempotency-Key, since the backend may have cached the failed answer under the old one).
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        guard let sub = arguments.first else { throw UsageError("missing 'list' or 'retry' (ferry outbox)") }
        let rest = Array(arguments.dropFirst())
        switch sub {
        case "list": return try list(rest, output: output)
        case "retry": return try retry(rest, output: output)
        default: throw UsageError("unknown outbox command '\(sub)'; expected list or retry")
        }
    }

    private static func list(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "outbox list", options: ["--db", "--status", "--limit"], flags: ["--json"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let dbPath = try args.required("--db", command: "outbox list")
        var status: OutboxStatus?
        if let text = args.values["--status"] {
            guard let s = OutboxStatus(rawValue: text.uppercased()) else {
                throw UsageError("--status must be PENDING, IN_FLIGHT, COMPLETED or FAILED, got '\(text)'")
            }
            status = s
        }
        let limit = try args.integer("--limit", Int.self, default: 1000, range: 1...10_000_000)
        let store = try FerryCommandLine.openStore(dbPath, create: false, readOnly: true)
        let events: [OutboxEvent]
        do { events = try store.outboxEvents(status: status, limit: limit) } catch {
            throw CommandFailure("database \(dbPath): \(error)")
        }
        if args.flags.contains("--json") {
            output.out(
                JSON.array(
                    events.map { e in
                        .object([
                            ("id", .string(e.id)), ("type", .string(e.type.rawValue)), ("status", .string(e.status.rawValue)),
                            ("peripheral", .string(e.peripheral)), ("epoch", .string(e.epoch)),
                            ("first_seq", e.firstSeq.map { .string(String($0)) } ?? .null),
                            ("last_seq", e.lastSeq.map { .string(String($0)) } ?? .null),
                            ("frames", .int(e.frameCount)), ("retry_count", .int(e.retryCount)),
                            ("next_retry_at", .int(e.nextRetryAt)), ("created_at", .int(e.createdAt)),
                            ("batch_id", e.batchID.map { .string($0) } ?? .null),
                            ("last_error", e.lastError.map { .string($0) } ?? .null),
                        ])
                    }
                ).text)
            return 0
        }
        if events.isEmpty { output.out("no outbox events" + (status.map { " with status \($0.rawValue)" } ?? "")) }
        for e in events {
            let range = e.firstSeq.map { f in "seq \(f)...\(e.lastSeq ?? f)" } ?? ""
            var line = "\(e.id)  \(e.status.rawValue)  \(e.type.rawValue)  \(e.peripheral)/\(e.epoch)  \(range)"
            if e.frameCount > 0 { line += "  \(e.frameCount) frames" }
            if e.retryCount > 0 { line += "  retries \(e.retryCount)" }
            if let error = e.lastError { line += "  last error: \(error)" }
            output.out(line)
        }
        return 0
    }

    private static func retry(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "outbox retry", options: ["--db", "--id"], flags: ["--all-failed"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let dbPath = try args.required("--db", command: "outbox retry")
        let id = args.values["--id"]
        guard (id != nil) != args.flags.contains("--all-failed") else {
            throw UsageError("give exactly one of --id ID or --all-failed (ferry outbox retry)")
        }
        let store = try FerryCommandLine.openStore(dbPath, create: false)
        let count: Int
        do { count = try store.retryFailed(id: id, now: SystemWallClock().nowMillis()) } catch let e as StoreError {
            if case .unknownOutboxEvent = e { throw CommandFailure(e.description) }
            throw CommandFailure("database \(dbPath): \(e)")
        }
        if let id, count == 0 {
            throw CommandFailure("outbox event \(id) is not FAILED; only FAILED events are retried")
        }
        output.out("\(count) FAILED event\(count == 1 ? "" : "s") back to PENDING")
        return 0
    }
}
