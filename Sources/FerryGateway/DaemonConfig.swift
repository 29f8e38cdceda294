import FerryProtocol
import FerryCore
import FoundationEssentials
import Glibc
import FerrySync

/// A config file problem: names the key and what is wrong, in one line (the CLI exits 2 with it).
public struct ConfigError: Error, CustomStringConvertible, Sendable, Equatable {
    public var key: String
    public var problem: String
    public init(key: String, problem: String) {
        self.key = key
        self.problem = problem
    }
    public var description: String { key.isEmpty ? problem : "config key '\(key)': \(problem)" }
}

/// One peripheral the gateway may sync, and how.
public struct PeripheralPolicy: Sendable, Equatable {
    public var address: PeripheralAddress
    /// Stay subscribed after catching up (live events) instead of releasing the slot.
    public var stayConnected: Bool
    public init(address: PeripheralAddress, stayConnected: Bool = false) {
        self.address = address
        self.stayConnected = stayConnected
    }
}

public struct UplinkSettings: Sendable, Equatable {
    /// nil: store only (no forwarding).
    public var endpoint: String?
    public var tokenFile: String?
    public var gatewayID: String?
    public var maxInFlight = 4
    public var batchEvents = 50
    public var timeoutSeconds = 30
    public var maxRetries = 12
    /// PEM CA bundle for a private backend CA; client certificate and key for mutual TLS (docs/UPLINK.md §6).
    public var caFile: String?
    public var clientCert: String?
    public var clientKey: String?
    public init() {}
}

/// Everything `ferry run` reads from its JSON config file (docs/CONFIG.md lists every key and default).
public struct DaemonConfiguration: Sendable, Equatable {
    public var stateDir = "/var/lib/ferry"
    public var adapter: String?
    /// The allowlist (production default: only these are ever connected).
    public var peripherals: [PeripheralPolicy] = []
    /// Lab mode: connect to any peripheral advertising the Sync service.
    public var allowAnySyncPeripheral = false
    /// Policy for peripherals found in lab mode, and for trusted (paired) ones, that are not in `peripherals`.
    public var stayConnectedDefault = false
    /// Production default: only peripherals BlueZ holds a bond for are ever connected, so the Sync service is
    /// only used over an encrypted link. False: lab mode for peripherals without pairing.
    public var requireBond = true
    public var maxConnections = 3
    public var syncIntervalSeconds: Double = 60
    public var backoffBaseSeconds: Double = 2
    public var backoffCapSeconds: Double = 300
    /// SYNC_REQ window (`window`): pipelined by default, larger than the ACK cadence.
    public var window: UInt16 = Frame.defaultWindow
    /// Commit + SYNC_ACK every this many frames (`ack_every`); nil: `Frame.defaultAckEvery`, or the window if
    /// that is smaller (a config written before `ack_every` existed, with a small window, keeps working).
    public var ackEvery: Int?
    public var connectTimeoutSeconds: Double = 35
    /// How long one connect looks for a peripheral BlueZ does not know (discovery), or waits for the adapter or
    /// bluetoothd, before the attempt counts as failed: a peripheral out of range holds its slot this long.
    public var discoveryTimeoutSeconds: Double = 15
    public var diskBudgetBytes: Int64?
    /// Delivered (COMPLETED) events and their frames are deleted this long after delivery (storage pressure
    /// deletes them earlier, oldest first).
    public var retentionHours: Double = 72
    public var shutdownGraceSeconds: Double = 5
    /// A session that commits no new frame for this long while it expects more ends (the slot is freed).
    public var noProgressSeconds: Double = 30
    /// A sync-and-release session ends after this long (backlog left for the next one, others get the slot).
    public var maxSessionSeconds: Double = 600
    public var logLevel: LogLevel = .info
    public var uplink = UplinkSettings()
    /// The metrics/health HTTP endpoint (off when nil). Loopback unless the operator writes another address.
    public var metricsListen: ListenAddress?
    /// Detecting a wedged controller and the power cycle → HCI reset → exit ladder (`adapter_recovery`).
    public var adapterRecovery = AdapterRecoverySettings()

    public init() {}

    /// A config file is read up to this size (1 MiB: some 15,000 allowlisted peripherals); a larger one is refused.
    public static let maximumFileBytes = 1 << 20

    public var databasePath: String { joiningPath(stateDir, "ferry.sqlite") }

    /// How to sync `address`, or nil if it must not be synced: listed in the allowlist, or `trusted` (paired
    /// with `ferry pair`), or anything in lab mode. The bond requirement is checked separately, against BlueZ.
    public func policy(for address: PeripheralAddress, trusted: Set<PeripheralAddress> = []) -> PeripheralPolicy? {
        if let listed = peripherals.first(where: { $0.address == address }) { return listed }
        return allowAnySyncPeripheral || trusted.contains(address)
            ? PeripheralPolicy(address: address, stayConnected: stayConnectedDefault) : nil
    }

    public var schedulerConfiguration: SyncScheduler.Configuration {
        var c = SyncScheduler.Configuration()
        c.maxConnections = maxConnections
        c.syncInterval = syncIntervalSeconds
        c.backoffBase = backoffBaseSeconds
        c.backoffCap = backoffCapSeconds
        return c
    }

    /// The ACK cadence sessions use.
    public var effectiveAckEvery: Int { ackEvery ?? min(Frame.defaultAckEvery, Int(window)) }

    public var sessionConfiguration: SyncSession.Configuration {
        var c = SyncSession.Configuration()
        c.window = window
        c.ackBatch = effectiveAckEvery
        c.noProgressTimeout = noProgressSeconds
        c.maxSessionDuration = maxSessionSeconds
        return c
    }

    // MARK: parsing

    static let topLevelKeys: Set<String> = [
        "state_dir", "adapter", "peripherals", "allow_any_sync_peripheral", "stay_connected_default", "require_bond",
        "max_connections", "sync_interval_seconds", "backoff_base_seconds", "backoff_cap_seconds", "window",
        "ack_every", "connect_timeout_seconds", "discovery_timeout_seconds", "disk_budget_bytes", "retention_hours",
        "shutdown_grace_seconds", "log_level", "uplink", "no_progress_seconds", "max_session_seconds",
        "metrics_listen", "adapter_recovery",
    ]
    static let adapterRecoveryKeys: Set<String> = [
        "enabled", "wedged_after_seconds", "min_failures", "adapter_missing_seconds", "verify_seconds",
        "cooldown_seconds", "hci_reset",
    ]
    static let uplinkKeys: Set<String> = [
        "endpoint", "token_file", "gateway_id", "max_in_flight", "batch_events", "timeout_seconds", "max_retries",
        "ca_file", "client_cert", "client_key",
    ]

    /// Parses and validates a config file's bytes. Unknown keys are errors (a typo must not silently fall
    /// back to a default, least of all for the allowlist).
    public static func parse(_ data: Data) throws -> DaemonConfiguration {
        let root: JSONValue
        do {
            root = try JSONDecoder().decode(JSONValue.self, from: data)
        } catch let error as ConfigError {
            throw error
        } catch {
            throw ConfigError(key: "", problem: "not valid JSON: \(Self.describe(error))")
        }
        guard case .object(let object) = root else {
            throw ConfigError(key: "", problem: "the config must be a JSON object")
        }
        var c = DaemonConfiguration()
        for key in object.keys.sorted() where !topLevelKeys.contains(key) {
            throw ConfigError(key: key, problem: "unknown key (known: \(topLevelKeys.sorted().joined(separator: ", ")))")
        }
        let reader = Reader(object: object, prefix: "")
        if let v = try reader.string("state_dir") {
            guard v.hasPrefix("/") else { throw ConfigError(key: "state_dir", problem: "must be an absolute path, got '\(v)'") }
            c.stateDir = v
        }
        c.adapter = try reader.string("adapter")
        if let v = try reader.bool("allow_any_sync_peripheral") { c.allowAnySyncPeripheral = v }
        if let v = try reader.bool("stay_connected_default") { c.stayConnectedDefault = v }
        if let v = try reader.bool("require_bond") { c.requireBond = v }
        if let v = try reader.integer("max_connections", 1...10) { c.maxConnections = v }
        if let v = try reader.number("sync_interval_seconds", 0...86_400) { c.syncIntervalSeconds = v }
        if let v = try reader.number("backoff_base_seconds", 0.1...3600) { c.backoffBaseSeconds = v }
        if let v = try reader.number("backoff_cap_seconds", 1...86_400) { c.backoffCapSeconds = v }
        if let v = try reader.integer("window", 1...65_535) { c.window = UInt16(v) }
        if let v = try reader.integer("ack_every", 1...65_535) { c.ackEvery = v }
        if let v = try reader.number("connect_timeout_seconds", 1...600) { c.connectTimeoutSeconds = v }
        if let v = try reader.number("discovery_timeout_seconds", 2...600) { c.discoveryTimeoutSeconds = v }
        if let v = try reader.integer("disk_budget_bytes", 1_048_576...Int.max) { c.diskBudgetBytes = Int64(v) }
        if let v = try reader.number("retention_hours", 0...87_600) { c.retentionHours = v }
        if let v = try reader.number("shutdown_grace_seconds", 0.5...60) { c.shutdownGraceSeconds = v }
        if let v = try reader.number("no_progress_seconds", 5...3600) { c.noProgressSeconds = v }
        if let v = try reader.number("max_session_seconds", 10...86_400) { c.maxSessionSeconds = v }
        if let v = try reader.string("log_level") {
            guard let level = LogLevel(name: v) else {
                throw ConfigError(key: "log_level", problem: "must be debug, info, notice, warning or error, got '\(v)'")
            }
            c.logLevel = level
        }
        if let v = try reader.string("metrics_listen") {
            guard let address = ListenAddress(v) else {
                throw ConfigError(
                    key: "metrics_listen",
                    problem: "must be IP:port or [IPv6]:port with a port in 1...65535, e.g. \"127.0.0.1:9464\", got '\(v)'")
            }
            c.metricsListen = address
        }
        if let ack = c.ackEvery, ack > Int(c.window) {
            // The peripheral stops at the window: a larger cadence is never reached, every batch would end on
            // the idle timeout.
            throw ConfigError(key: "ack_every", problem: "must be ≤ window (\(c.window)), got \(ack)")
        }
        if c.backoffCapSeconds < c.backoffBaseSeconds {
            throw ConfigError(key: "backoff_cap_seconds", problem: "must be ≥ backoff_base_seconds")
        }
        c.peripherals = try parsePeripherals(object["peripherals"])
        if let uplink = object["uplink"], uplink != .null {
            guard case .object(let u) = uplink else { throw ConfigError(key: "uplink", problem: "must be an object") }
            for key in u.keys.sorted() where !uplinkKeys.contains(key) {
                throw ConfigError(
                    key: "uplink.\(key)", problem: "unknown key (known: \(uplinkKeys.sorted().joined(separator: ", ")))")
            }
            let r = Reader(object: u, prefix: "uplink.")
            if let v = try r.string("endpoint") {
                guard let url = URL(string: v), let scheme = url.scheme, ["http", "https"].contains(scheme), url.host != nil
                else { throw ConfigError(key: "uplink.endpoint", problem: "must be an http(s) URL, got '\(v)'") }
                c.uplink.endpoint = v
            }
            c.uplink.tokenFile = try r.string("token_file")
            c.uplink.gatewayID = try r.string("gateway_id")
            if let v = try r.integer("max_in_flight", 1...64) { c.uplink.maxInFlight = v }
            if let v = try r.integer("batch_events", 1...10_000) { c.uplink.batchEvents = v }
            if let v = try r.integer("timeout_seconds", 1...3600) { c.uplink.timeoutSeconds = v }
            if let v = try r.integer("max_retries", 0...1000) { c.uplink.maxRetries = v }
            c.uplink.caFile = try r.string("ca_file")
            c.uplink.clientCert = try r.string("client_cert")
            c.uplink.clientKey = try r.string("client_key")
        }
        if let recovery = object["adapter_recovery"], recovery != .null {
            guard case .object(let a) = recovery else {
                throw ConfigError(key: "adapter_recovery", problem: "must be an object")
            }
            for key in a.keys.sorted() where !adapterRecoveryKeys.contains(key) {
                throw ConfigError(
                    key: "adapter_recovery.\(key)",
                    problem: "unknown key (known: \(adapterRecoveryKeys.sorted().joined(separator: ", ")))")
            }
            let r = Reader(object: a, prefix: "adapter_recovery.")
            if let v = try r.bool("enabled") { c.adapterRecovery.enabled = v }
            if let v = try r.number("wedged_after_seconds", 10...86_400) { c.adapterRecovery.wedgedAfterSeconds = v }
            if let v = try r.integer("min_failures", 1...10_000) { c.adapterRecovery.minFailures = v }
            if let v = try r.number("adapter_missing_seconds", 5...86_400) { c.adapterRecovery.adapterMissingSeconds = v }
            if let v = try r.number("verify_seconds", 5...86_400) { c.adapterRecovery.verifySeconds = v }
            if let v = try r.number("cooldown_seconds", 60...604_800) { c.adapterRecovery.cooldownSeconds = v }
            if let v = try r.bool("hci_reset") { c.adapterRecovery.hciReset = v }
        }
        return c
    }

    /// Validates what only makes sense as a whole (after flags were applied too).
    public func validate() throws {
        // An empty allowlist is fine: peripherals paired with `ferry pair` (the store's trusted_peripherals)
        // are synced too. The daemon says at start when there is nothing to sync at all.
        let stay = peripherals.filter(\.stayConnected).count
        if stay >= maxConnections {
            throw ConfigError(
                key: "max_connections",
                problem: "\(maxConnections) slots but \(stay) stay_connected peripherals: the others would never get a slot")
        }
    }

    static func parsePeripherals(_ value: JSONValue?) throws -> [PeripheralPolicy] {
        guard let value, value != .null else { return [] }
        guard case .array(let items) = value else {
            throw ConfigError(key: "peripherals", problem: "must be an array of addresses or {\"address\", \"stay_connected\"}")
        }
        var result: [PeripheralPolicy] = []
        for (index, item) in items.enumerated() {
            let key = "peripherals[\(index)]"
            let policy: PeripheralPolicy
            switch item {
            case .string(let text):
                policy = PeripheralPolicy(address: try address(text, key: key))
            case .object(let o):
                for k in o.keys.sorted() where !["address", "stay_connected"].contains(k) {
                    throw ConfigError(key: "\(key).\(k)", problem: "unknown key (known: address, stay_connected)")
                }
                let r = Reader(object: o, prefix: "\(key).")
                guard let text = try r.string("address") else {
                    throw ConfigError(key: "\(key).address", problem: "missing")
                }
                policy = PeripheralPolicy(
                    address: try address(text, key: "\(key).address"), stayConnected: try r.bool("stay_connected") ?? false)
            default:
                throw ConfigError(key: key, problem: "must be an address string or an object with \"address\"")
            }
            if result.contains(where: { $0.address == policy.address }) {
                throw ConfigError(key: key, problem: "\(policy.address) is listed twice")
            }
            result.append(policy)
        }
        return result
    }

    static func address(_ text: String, key: String) throws -> PeripheralAddress {
        guard let a = PeripheralAddress(text) else {
            throw ConfigError(key: key, problem: "'\(text)' is not a Bluetooth address (expected AA:BB:CC:DD:EE:FF)")
        }
        return a
    }

    static func describe(_ error: any Error) -> String {
        if case DecodingError.dataCorrupted(let context) = error { return context.debugDescription }
        return "\(error)"
    }

    private struct Reader {
        let object: [String: JSONValue]
        let prefix: String

        func string(_ key: String) throws -> String? {
            switch object[key] {
            case nil, .null?: return nil
            case .string(let s)?:
                guard !s.isEmpty else { throw ConfigError(key: prefix + key, problem: "must not be empty") }
                return s
            case let other?: throw ConfigError(key: prefix + key, problem: "must be a string, got \(other.kind)")
            }
        }

        func bool(_ key: String) throws -> Bool? {
            switch object[key] {
            case nil, .null?: return nil
            case .bool(let b)?: return b
            case let other?: throw ConfigError(key: prefix + key, problem: "must be true or false, got \(other.kind)")
            }
        }

        func number(_ key: String, _ range: ClosedRange<Double>) throws -> Double? {
            switch object[key] {
            case nil, .null?: return nil
            case .number(let n)?:
                guard range.contains(n) else {
                    let bounds = "\(plainNumber(range.lowerBound))...\(plainNumber(range.upperBound))"
                    throw ConfigError(key: prefix + key, problem: "must be in \(bounds), got \(plainNumber(n))")
                }
                return n
            case let other?: throw ConfigError(key: prefix + key, problem: "must be a number, got \(other.kind)")
            }
        }

        func integer(_ key: String, _ range: ClosedRange<Int>) throws -> Int? {
            guard let n = try number(key, -Double.greatestFiniteMagnitude...Double.greatestFiniteMagnitude) else {
                return nil
            }
            guard n == n.rounded() else {
                throw ConfigError(key: prefix + key, problem: "must be a whole number, got \(plainNumber(n))")
            }
            guard let i = Int(exactly: n), range.contains(i) else {  // past Int: out of any key's range too
                let upper = range.upperBound == Int.max ? "" : "\(range.upperBound)"
                throw ConfigError(key: prefix + key, problem: "must be in \(range.lowerBound)...\(upper), got \(plainNumber(n))")
            }
            return i
        }
    }
}

/// A JSON value that keeps booleans and numbers apart (JSONSerialization on Linux does not).
enum JSONValue: Decodable, Equatable, Sendable {
    case null
    case bool(Bool)
    case number(Double)
    case string(String)
    case array([JSONValue])
    case object([String: JSONValue])

    init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        if container.decodeNil() {
            self = .null
            return
        }
        if let b = try? container.decode(Bool.self) {
            self = .bool(b)
            return
        }
        do {
            self = .number(try container.decode(Double.self))
            return
        } catch DecodingError.typeMismatch {
            // Not a number: one of the kinds below.
        } catch {
            // A number no Double holds (1e400): the decoder's own error names neither the key nor the problem.
            throw ConfigError(key: Self.keyPath(container.codingPath), problem: "the number is beyond ±1.8e308 (no setting takes it)")
        }
        if let s = try? container.decode(String.self) {
            self = .string(s)
            return
        }
        do {
            self = .array(try container.decode([JSONValue].self))
        } catch DecodingError.typeMismatch(_, let context) where context.codingPath.count == container.codingPath.count {
            // Not an array (a mismatch inside one, deeper in the path, is that element's own error).
            self = .object(try container.decode([String: JSONValue].self))
        }
    }

    /// `uplink.timeout_seconds`, `peripherals[1].address`: a decoding path as the config's error lines name keys.
    static func keyPath(_ path: [any CodingKey]) -> String {
        path.reduce(into: "") { text, key in
            if let index = key.intValue {
                text += "[\(index)]"
            } else {
                text += (text.isEmpty ? "" : ".") + key.stringValue
            }
        }
    }

    var kind: String {
        switch self {
        case .null: "null"
        case .bool(let b): "\(b)"
        case .number(let n): "the number \(n)"
        case .string(let s): "the string '\(s)'"
        case .array: "an array"
        case .object: "an object"
        }
    }
}
