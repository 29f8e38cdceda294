import FerryCore
import FerryDBus
import FerryProtocol
import FerryStore
import FoundationEssentials
import FerrySync

#if canImport(Glibc)
    import Glibc
#endif

/// Ferry's metric names and what they mean (docs: Hardware/TROUBLESHOOTING.md, "Reading the metrics").
public enum FerryMetric {
    public static let sessions = "ferry_sessions_total"
    public static let framesStored = "ferry_frames_stored_total"
    public static let bytesReceived = "ferry_bytes_received_total"
    public static let gaps = "ferry_gaps_total"
    public static let regressions = "ferry_regressions_total"
    public static let connectSeconds = "ferry_connect_seconds"
    public static let slotsInUse = "ferry_slots_in_use"
    public static let slots = "ferry_slots"
    public static let backlog = "ferry_peripheral_backlog_frames"
    public static let lastSyncAge = "ferry_peripheral_last_sync_age_seconds"
    public static let outbox = "ferry_outbox_events"
    public static let oldestPending = "ferry_outbox_oldest_pending_age_seconds"
    public static let uplinkState = "ferry_uplink_state"
    public static let diskBytes = "ferry_store_disk_bytes"
    public static let diskBudget = "ferry_store_disk_budget_bytes"
    public static let storeReadable = "ferry_store_readable"
    public static let adapterPowered = "ferry_adapter_powered"
    public static let adapterRecoverySteps = "ferry_adapter_recovery_steps_total"
    public static let adapterRecoveries = "ferry_adapter_recoveries_total"
    public static let adapterWedged = "ferry_adapter_wedged"

    /// Connect latency buckets (seconds): a good link connects in well under a second, a busy or distant one
    /// in a few, and `connect_timeout_seconds` (35 by default) bounds the rest.
    public static let connectBuckets: [Double] = [0.25, 0.5, 1, 2, 5, 10, 20, 40]

    /// Peripherals listed per scrape at most: bounds the scrape's store reads and the series a scraper keeps.
    public static let maxPeripheralSeries = 256

    /// Every family, in the order they render. Counters labelled by outcome start at 0 for every outcome so a
    /// rate() sees the first one.
    public static func registry(maxConnections: Int) -> MetricsRegistry {
        var r = MetricsRegistry()
        r.declare(sessions, .counter, help: "Sessions ended since the daemon started, by how they ended.")
        for outcome in SessionOutcome.allCases { r.add(sessions, 0, labels: MetricsRegistry.Labels(["outcome": outcome.rawValue])) }
        r.declare(framesStored, .counter, help: "Frames committed to the store since the daemon started.")
        r.add(framesStored, 0)
        r.declare(bytesReceived, .counter, help: "Bytes received from peripherals on DATA since the daemon started.")
        r.add(bytesReceived, 0)
        r.declare(gaps, .counter, help: "Gaps recorded (frames the peripheral no longer had).")
        r.add(gaps, 0)
        r.declare(regressions, .counter, help: "Counter regressions seen (a peripheral's stream restarted lower).")
        r.add(regressions, 0)
        r.declare(
            connectSeconds, .histogram, help: "Time from starting a session to a resolved Sync service, in seconds.",
            buckets: connectBuckets)
        r.declare(adapterPowered, .gauge, help: "1 while the Bluetooth adapter is found and powered, else 0.")
        r.set(adapterPowered, 0)
        r.declare(
            adapterRecoverySteps, .counter,
            help: "Adapter recovery steps taken (power_cycle, hci_reset, exit) by the evidence that called for them.")
        for step in AdapterRecovery.Step.allCases {
            r.add(adapterRecoverySteps, 0, labels: MetricsRegistry.Labels(["step": step.rawValue]))
        }
        r.declare(adapterRecoveries, .counter, help: "Connects working again after an adapter recovery step, by the step.")
        r.add(adapterRecoveries, 0)
        r.declare(adapterWedged, .gauge, help: "1 while adapter recovery judges the controller wedged (a step is running or being verified, or cooling down), else 0.")
        r.set(adapterWedged, 0)
        r.declare(slotsInUse, .gauge, help: "Connection slots held by sessions (connecting or connected).")
        r.set(slotsInUse, 0)
        r.declare(slots, .gauge, help: "Connection slots configured (max_connections).")
        r.set(slots, Double(maxConnections))
        r.declare(backlog, .gauge, help: "Frames the peripheral had that the store had not, as of its last session.")
        r.declare(lastSyncAge, .gauge, help: "Seconds since the peripheral's last session ended.")
        r.declare(outbox, .gauge, help: "Outbox events by status.")
        r.declare(oldestPending, .gauge, help: "Age of the oldest PENDING outbox event in seconds (0 when none).")
        r.declare(uplinkState, .gauge, help: "1 for the uplink's current state, 0 for the others.")
        r.declare(diskBytes, .gauge, help: "Store size on disk with its WAL, in bytes.")
        r.declare(diskBudget, .gauge, help: "The store's disk budget in bytes (over it, nothing is acknowledged).")
        r.declare(storeReadable, .gauge, help: "1 if this scrape could read the store, else 0.")
        return r
    }
}

/// How a session ended, as the `outcome` label of `ferry_sessions_total`: derived from the typed results
/// (`SessionEnd`, the scheduler's outcome), never from log text.
public enum SessionOutcome: String, CaseIterable, Sendable {
    case caughtUp = "caught_up"
    case noResponse = "no_response"
    case epochChanged = "epoch_changed"
    case streamInfoUnreadable = "stream_info_unreadable"
    case storeFailed = "store_failed"
    case shutdown
    case noProgress = "no_progress"
    case maxDuration = "max_duration"
    case linkLost = "link_lost"
    case subscribeFailed = "subscribe_failed"
    /// The store was over its budget or the disk full: nothing more was committed.
    case backpressure
    /// The connect, the service resolution or the session setup failed: no sync ran.
    case connectFailed = "connect_failed"
    /// Connected, but BlueZ held no bond (require_bond): disconnected before any GATT access.
    case refusedUnbonded = "refused_unbonded"
    /// Cancelled before the sync began (the daemon stopping, the peripheral no longer allowed).
    case cancelled

    public init(end: SessionEnd, backpressure: Bool) {
        if backpressure {
            self = .backpressure
            return
        }
        switch end {
        case .disconnected(let reason):
            switch reason {
            case .caughtUp: self = .caughtUp
            case .noResponse: self = .noResponse
            case .epochChanged: self = .epochChanged
            case .streamInfoUnreadable: self = .streamInfoUnreadable
            case .storeFailed: self = .storeFailed
            case .shutdown: self = .shutdown
            case .noProgress: self = .noProgress
            case .maxDurationReached: self = .maxDuration
            }
        case .linkLost: self = .linkLost
        case .subscribeFailed: self = .subscribeFailed
        }
    }

    init(_ result: SessionResult) {
        if let summary = result.summary {
            self.init(end: summary.end ?? .linkLost, backpressure: summary.backpressure)
        } else if result.bondMissingAfterConnect {
            self = .refusedUnbonded
        } else if case .interrupted = result.outcome {
            self = .cancelled
        } else {
            self = .connectFailed
        }
    }
}

/// The daemon's live view for `ferry status`: what only the running process knows (slots, current sessions).
/// The daemon rewrites it in its state directory (`LiveViewFile`); `ferry status` reads it back.
public struct LiveView: Codable, Sendable, Equatable {
    public struct Session: Codable, Sendable, Equatable {
        public var peripheral: String
        /// "connecting" until the link is up and the session runs, then "syncing" (or "live" when it stays
        /// connected).
        public var phase: String
        /// Seconds since the slot was taken.
        public var seconds: Double
    }

    public var pid: Int32
    /// Wall clock of this write, Unix milliseconds: a reader treats an old file as a stopped daemon.
    public var updatedAt: Int64
    public var adapter: String?
    public var slotsInUse: Int
    public var maxConnections: Int
    public var sessions: [Session]
    /// Adapter recovery's phase (`AdapterRecovery.phase`); nil in files written before it existed.
    public var adapterRecovery: String?

    public init(
        pid: Int32, updatedAt: Int64, adapter: String?, slotsInUse: Int, maxConnections: Int, sessions: [Session],
        adapterRecovery: String? = nil
    ) {
        self.adapterRecovery = adapterRecovery
        self.pid = pid
        self.updatedAt = updatedAt
        self.adapter = adapter
        self.slotsInUse = slotsInUse
        self.maxConnections = maxConnections
        self.sessions = sessions
    }

    enum CodingKeys: String, CodingKey {
        case pid, adapter, sessions
        case updatedAt = "updated_at"
        case slotsInUse = "slots_in_use"
        case maxConnections = "max_connections"
        case adapterRecovery = "adapter_recovery"
    }

    /// The file's JSON, written through FerryCore's one writer: keys sorted, as the file always had them, and
    /// `adapter` left out when nil. Read back with JSONDecoder (`LiveViewFile.readFresh`).
    public var json: JSON {
        var pairs: [(String, JSON)] = []
        if let adapter { pairs.append(("adapter", .string(adapter))) }
        pairs += [
            ("max_connections", .int(maxConnections)), ("pid", .int(pid)),
            (
                "sessions",
                .array(
                    sessions.map {
                        .object([("peripheral", .string($0.peripheral)), ("phase", .string($0.phase)), ("seconds", .double($0.seconds))])
                    })
            ),
            ("slots_in_use", .int(slotsInUse)), ("updated_at", .int(updatedAt)),
        ]
        return .object(pairs)
    }
}

/// The metrics the daemon keeps in memory, shared by its tasks (they record) and the HTTP threads (they
/// render): a `MetricsRegistry` behind a lock. Updated where the daemon already records its totals.
public final class GatewayMetrics: SessionMetrics {
    private let registry: LockedValue<MetricsRegistry>

    public init(maxConnections: Int) {
        registry = LockedValue(FerryMetric.registry(maxConnections: maxConnections))
    }

    /// A copy to render (the scrape adds the store's gauges to it).
    public var snapshot: MetricsRegistry { registry.withLock { $0 } }

    func sessionEnded(_ result: SessionResult) {
        let outcome = SessionOutcome(result)
        registry.withLock { r in
            r.add(FerryMetric.sessions, labels: MetricsRegistry.Labels(["outcome": outcome.rawValue]))
            if let connect = result.connectSeconds { r.observe(FerryMetric.connectSeconds, connect) }
            if let s = result.summary {  // frames and bytes were counted as they came (`stored`, `received`)
                r.add(FerryMetric.gaps, Double(s.gapsRecorded))
                r.add(FerryMetric.regressions, Double(s.regressions))
            }
        }
    }

    /// Frames a session just committed (SyncSessionRunner, per commit).
    public func stored(frames: Int) {
        registry.withLock { $0.add(FerryMetric.framesStored, Double(frames)) }
    }

    /// Bytes a session just received on DATA (SyncSessionRunner, per notification).
    public func received(bytes: Int) {
        registry.withLock { $0.add(FerryMetric.bytesReceived, Double(bytes)) }
    }

    func adapter(powered: Bool) {
        registry.withLock { $0.set(FerryMetric.adapterPowered, powered ? 1 : 0) }
    }

    func adapterRecoveryStep(_ step: AdapterRecovery.Step) {
        registry.withLock { $0.add(FerryMetric.adapterRecoverySteps, labels: MetricsRegistry.Labels(["step": step.rawValue])) }
    }

    func adapterRecovered() {
        registry.withLock { $0.add(FerryMetric.adapterRecoveries) }
    }

    func adapter(wedged: Bool) {
        registry.withLock { $0.set(FerryMetric.adapterWedged, wedged ? 1 : 0) }
    }

    func slotsInUse(_ count: Int) {
        registry.withLock { $0.set(FerryMetric.slotsInUse, Double(count)) }
    }

    func diskBudget(_ bytes: Int64) {
        registry.withLock { $0.set(FerryMetric.diskBudget, Double(bytes)) }
    }
}

/// What a scrape reads from the store (read-only, bounded): the outbox, the uplink, the disk, and per
/// peripheral its backlog and last sync.
public struct StoreReadings: Sendable, Equatable {
    public struct Peripheral: Sendable, Equatable {
        public var address: String
        /// head − cursor as of the last session, when its head is known.
        public var backlog: UInt64?
        public var lastSyncAgeSeconds: Double?
    }

    public var outbox: [OutboxStatus: Int] = [:]
    public var oldestPendingAgeSeconds: Double?
    /// online | offline | paused | not running (as `ferry status` says it).
    public var uplinkState = "not running"
    public var diskBytes: Int64 = 0
    public var peripherals: [Peripheral] = []

    public init() {}

    public static let uplinkStates = ["online", "offline", "paused", "not running"]

    /// Reads through `store` (open it read-only). `now`: wall clock, Unix milliseconds.
    public static func read(from store: GatewayStore, now: Int64) throws -> StoreReadings {
        var r = StoreReadings()
        r.outbox = try store.outboxCounts()
        r.oldestPendingAgeSeconds = try store.oldestPendingCreatedAt().map { max(0, Timestamp.seconds(from: $0, to: now)) }
        let uplink = try store.uplinkState(now: now)
        r.uplinkState = uplink?.running == true ? (uplink?.state.rawValue ?? "online") : "not running"
        r.diskBytes = try store.diskBytes()
        var seen = Set<String>()
        for stream in try store.streams() where stream.active && seen.count < FerryMetric.maxPeripheralSeries {
            guard seen.insert(stream.peripheral).inserted, let address = PeripheralAddress(stream.peripheral) else {
                continue
            }
            let state = try store.syncState(address)
            let cursor = try store.activeCursor(address)?.cursor ?? stream.cursor
            r.peripherals.append(
                Peripheral(
                    address: stream.peripheral,
                    backlog: state?.head.map { $0 > cursor ? $0 - cursor : 0 },
                    lastSyncAgeSeconds: state.map { max(0, Timestamp.seconds(from: $0.lastSyncAt, to: now)) }))
        }
        return r
    }

    /// Sets the store's gauges in `registry` (a scrape's copy).
    public func apply(to registry: inout MetricsRegistry) {
        registry.set(FerryMetric.storeReadable, 1)
        let labels: [(OutboxStatus, String)] = [
            (.pending, "pending"), (.inFlight, "in_flight"), (.failed, "failed"), (.completed, "completed"),
        ]
        for (status, label) in labels {
            registry.set(FerryMetric.outbox, Double(outbox[status] ?? 0), labels: MetricsRegistry.Labels(["status": label]))
        }
        registry.set(FerryMetric.oldestPending, oldestPendingAgeSeconds ?? 0)
        for state in Self.uplinkStates {
            registry.set(
                FerryMetric.uplinkState, state == uplinkState ? 1 : 0,
                labels: MetricsRegistry.Labels(["state": state.replacingSpaces]))
        }
        registry.set(FerryMetric.diskBytes, Double(diskBytes))
        registry.clear(FerryMetric.backlog)
        registry.clear(FerryMetric.lastSyncAge)
        for p in peripherals {
            let labels = MetricsRegistry.Labels(["peripheral": p.address])
            if let backlog = p.backlog { registry.set(FerryMetric.backlog, Double(backlog), labels: labels) }
            if let age = p.lastSyncAgeSeconds { registry.set(FerryMetric.lastSyncAge, age, labels: labels) }
        }
    }
}

extension String {
    /// "not running" → "not_running": label values a PromQL user can type without quoting surprises.
    fileprivate var replacingSpaces: String { String(map { $0 == " " ? "_" : $0 }) }
}

/// `/healthz`: healthy only when the daemon is ready (store open, adapter found), every part that reports
/// heartbeats (scheduler loop, D-Bus, forwarder: `DaemonHealth`, the same judgement as systemd's watchdog)
/// made progress within its limit, and the store could be read just now.
public enum HealthCheck {
    public static func evaluate(
        ready: Bool, verdict: WatchdogMonitor.Verdict, storeProblem: String?
    ) -> (healthy: Bool, body: String) {
        var problems: [String] = []
        if !ready { problems.append("not ready (store not open or no adapter yet)") }
        if case .stale(let parts) = verdict {
            problems.append("no progress: " + parts.map(\.rawValue).joined(separator: ", "))
        }
        if let storeProblem { problems.append("store: \(storeProblem)") }
        return problems.isEmpty ? (true, "ok\n") : (false, problems.joined(separator: "\n") + "\n")
    }
}

/// The live view's file next to the store (`<state_dir>/ferry-live.json`, mode 0600 under the daemon's umask):
/// replaced atomically (write, then rename), so a reader sees the old or the new view, never half of one.
public struct LiveViewFile: Sendable {
    public let path: String
    /// A view not rewritten for this long is from a daemon that is gone (the daemon rewrites it every 10 s).
    public static let staleAfterSeconds: Double = 30

    public init(path: String) { self.path = path }

    /// The file beside the store at `databasePath`.
    public init(databasePath: String) {
        path = joiningPath(directoryName(of: databasePath), "ferry-live.json")
    }

    /// Without an fsync (Foundation's `Data.write` does one): the daemon rewrites the view every 10 s for as long
    /// as it runs, and a reader takes a missing, broken or old file for "not running", so durability buys nothing
    /// here but months of SD-card writes.
    public func write(_ view: LiveView) throws {
        let bytes = Array(view.json.text.utf8)
        let temporary = path + ".tmp"
        // A half-written file on a full disk would hold blocks the store needs to recover: writeFile removes it.
        if let failure = writeFile(temporary, bytes) { throw POSIXError(POSIXErrorCode(rawValue: failure) ?? .EIO) }
        guard rename(temporary, path) == 0 else {
            let failure = errno
            unlink(temporary)
            throw POSIXError(POSIXErrorCode(rawValue: failure) ?? .EIO)
        }
    }

    public func remove() { unlink(path) }

    /// The view if the file exists, parses, is bounded in size, and is fresh as of `nowMillis`; nil otherwise
    /// (no daemon, or one that died without removing it).
    public func readFresh(nowMillis: Int64) -> LiveView? {
        // The file is ours, but a reader still bounds what it takes in.
        var bytes: [UInt8] = []
        guard readFile(path, limit: 1 << 20, into: &bytes) == nil,
            let view = try? JSONDecoder().decode(LiveView.self, from: Data(bytes))
        else { return nil }
        let age = Timestamp.seconds(from: view.updatedAt, to: nowMillis)
        return age <= Self.staleAfterSeconds && age > -Self.staleAfterSeconds ? view : nil
    }
}
