import FerryCore
import FerryGateway
import FerrySync
import FerryStore
import FerryUplink

#if canImport(Glibc)
    import Glibc
#endif

enum StatusCommand {
    static let help = """
        Usage: ferry status --db PATH [--json]

        Per stream: peripheral, epoch, cursor (last committed seq) and frames staged; outbox event counts per
        status (PENDING, IN_FLIGHT, COMPLETED, FAILED), the age of the oldest PENDING event, and the store's size
        on disk (compare with the gateway's disk budget: over it, peripherals are not acknowledged), and the
        uplink as its forwarder (ferry run or ferry forward) last recorded it: online, offline since T (the
        backend unreachable or failing; nothing is used up while offline), paused for credentials since T
        (401/403 or an unusable token file), or no forwarder running; with the backlog (PENDING + IN_FLIGHT).
        When `ferry run` is running on this store, also its live view (from ferry-live.json beside the store,
        which the daemon rewrites at least every 10 s): the adapter (and adapter recovery's phase when it is
        not ok: connects_failing, power_cycle, hci_reset, verifying_<step>, cooling_down), slots in use and the current sessions
        (connecting, syncing, or live when it stays connected) with how long each has held its slot.
        Opens the store read-only: never migrates or writes it (an older store is reported, not migrated).

        --json prints {"streams":[{"peripheral","epoch","device_epoch","cursor","frames_staged","active"}],
                       "outbox":{"PENDING","IN_FLIGHT","COMPLETED","FAILED"},"oldest_pending_age_seconds",
                       "disk_bytes","uplink":{"state","since","detail","pid","backlog"},
                       "daemon":{"running","pid","adapter","adapter_recovery","slots_in_use","max_connections",
                                 "sessions":[{"peripheral","phase","seconds"}]}}
        (daemon: only "running": false when no ferry run is running on this store).
        (uplink.state: online | offline | paused | not running; since: RFC 3339 or null).
        (epoch and cursor as decimal strings; device_epoch differs from epoch after a counter regression).
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(arguments, command: "status", options: ["--db"], flags: ["--json"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let dbPath = try args.required("--db", command: "status")
        let store = try FerryCommandLine.openStore(dbPath, create: false, readOnly: true)
        let streams: [GatewayStore.StreamStatus]
        let counts: [OutboxStatus: Int]
        let oldest: Int64?
        let diskBytes: Int64
        let uplink: UplinkStateRecord?
        let now = SystemWallClock().nowMillis()
        do {
            uplink = try store.uplinkState(now: now)
            diskBytes = try store.diskBytes()
            streams = try store.streams()
            counts = try store.outboxCounts()
            oldest = try store.oldestPendingCreatedAt()
        } catch {
            throw CommandFailure("database \(dbPath): \(error)")
        }
        let age = oldest.map { max(0, Timestamp.seconds(from: $0, to: now)) }
        let backlog = (counts[.pending] ?? 0) + (counts[.inFlight] ?? 0)
        // A forwarder that stopped (or died: its lease expired) is "not running", whatever it recorded last.
        let running = uplink?.running == true
        // nil: no forwarder running.
        let uplinkState: UplinkState? = running ? (uplink?.state ?? .online) : nil
        let state = uplinkState?.rawValue ?? "not running"
        let since = running ? uplink?.since.map { UplinkTimestamp(millisecondsSince1970: $0).rfc3339 } : nil
        let detail = running && uplinkState != .online ? uplink?.detail : nil
        let statuses: [OutboxStatus] = [.pending, .inFlight, .completed, .failed]
        let live = liveView(nextTo: dbPath, now: now)
        if args.flags.contains("--json") {
            output.out(
                JSON.object([
                    (
                        "streams",
                        .array(
                            streams.map {
                                .object([
                                    ("peripheral", .string($0.peripheral)), ("epoch", .string($0.epoch)),
                                    ("device_epoch", .string($0.deviceEpoch)), ("cursor", .string(String($0.cursor))),
                                    ("frames_staged", .int($0.framesStaged)), ("active", .bool($0.active)),
                                ])
                            })
                    ),
                    ("outbox", .object(statuses.map { ($0.rawValue, .int(counts[$0] ?? 0)) })),
                    ("oldest_pending_age_seconds", age.map { .double(($0 * 1000).rounded() / 1000) } ?? .null),
                    ("disk_bytes", .int(diskBytes)),
                    (
                        "uplink",
                        .object([
                            ("state", .string(state)), ("since", since.map { .string($0) } ?? .null),
                            ("detail", detail.map { .string($0) } ?? .null),
                            ("pid", running ? .int(uplink?.pid ?? 0) : .null), ("backlog", .int(backlog)),
                        ])
                    ),
                    ("daemon", daemonJSON(live)),
                ]).text)
            return 0
        }
        if streams.isEmpty {
            output.out("no streams yet")
        } else {
            output.out(pad("PERIPHERAL", 18) + pad("EPOCH", 22) + pad("CURSOR", 22) + "FRAMES STAGED")
            for s in streams {
                let note = s.active ? "" : "  (superseded: counter regression)"
                output.out(pad(s.peripheral, 18) + pad(s.epoch, 22) + pad(String(s.cursor), 22) + "\(s.framesStaged)\(note)")
            }
        }
        output.out("outbox: " + statuses.map { "\($0.rawValue) \(counts[$0] ?? 0)" }.joined(separator: ", "))
        if let age {
            output.out("oldest PENDING event: \(Int(age.rounded())) s old")
        }
        output.out("store: \(diskBytes) bytes on disk (with WAL)")
        switch uplinkState {
        case nil:
            output.out("uplink: no forwarder running; backlog \(backlog) events")
        case .offline?:
            output.out("uplink: offline since \(since ?? "?") (\(detail ?? "no answer")); backlog \(backlog) events")
        case .paused?:
            output.out("uplink: paused for credentials since \(since ?? "?") (\(detail ?? "?")); backlog \(backlog) events")
        default:
            output.out("uplink: \(state) (forwarder pid \(uplink?.pid ?? 0)); backlog \(backlog) events")
        }
        output.out(daemonLine(live))
        for session in live?.sessions ?? [] {
            // The live view's file is the daemon's, but a damaged one must not trap the conversion to Int.
            let seconds = Int(Duration.secondsClamped(session.seconds).inSeconds.rounded())
            output.out("  \(session.peripheral): \(session.phase) for \(seconds) s")
        }
        return 0
    }

    /// The running daemon's live view, or nil when none runs on this store (no file, a stale one, or its
    /// process gone: a SIGKILLed daemon leaves the file behind).
    static func liveView(nextTo dbPath: String, now: Int64) -> LiveView? {
        guard let view = LiveViewFile(databasePath: dbPath).readFresh(nowMillis: now) else { return nil }
        // EPERM: the process exists but belongs to another user (the ferry service user).
        guard view.pid > 0, kill(view.pid, 0) == 0 || errno == EPERM else { return nil }
        return view
    }

    static func daemonLine(_ view: LiveView?) -> String {
        guard let view else { return "daemon: not running on this store" }
        let recovery = view.adapterRecovery.flatMap { $0 == "ok" ? nil : " (adapter recovery: \($0))" } ?? ""
        return "daemon: running (pid \(view.pid)), adapter \(view.adapter ?? "not found yet")\(recovery), "
            + "\(view.slotsInUse) of \(view.maxConnections) slots in use"
    }

    static func daemonJSON(_ view: LiveView?) -> JSON {
        guard let view else { return .object([("running", .bool(false))]) }
        return .object([
            ("running", .bool(true)), ("pid", .int(view.pid)), ("adapter", view.adapter.map { .string($0) } ?? .null),
            ("adapter_recovery", view.adapterRecovery.map { .string($0) } ?? .null),
            ("slots_in_use", .int(view.slotsInUse)), ("max_connections", .int(view.maxConnections)),
            (
                "sessions",
                .array(
                    view.sessions.map {
                        .object([
                            ("peripheral", .string($0.peripheral)), ("phase", .string($0.phase)),
                            ("seconds", .double($0.seconds)),
                        ])
                    })
            ),
        ])
    }
}
