import FerryGateway
import FerrySync
import FerryProtocol
import FerryStore
import FerryTestSupport
import Foundation
import Testing

/// `ferry run`'s config file: defaults, parsing, and errors that name the key.
@Suite struct DaemonConfigTests {
    func parse(_ json: String) throws -> DaemonConfiguration {
        try DaemonConfiguration.parse(Data(json.utf8))
    }

    func error(_ json: String) -> ConfigError? {
        do {
            let c = try parse(json)
            try c.validate()
            return nil
        } catch let e as ConfigError {
            return e
        } catch {
            return ConfigError(key: "?", problem: "\(error)")
        }
    }

    @Test func defaults() throws {
        let c = try parse("{}")
        #expect(c.stateDir == "/var/lib/ferry")
        #expect(c.databasePath == "/var/lib/ferry/ferry.sqlite")
        #expect(c.maxConnections == 3)
        #expect(c.allowAnySyncPeripheral == false)
        #expect(c.window == 2000 && c.ackEvery == nil && c.effectiveAckEvery == 20, "pipelined by default")
        #expect(c.sessionConfiguration.window == 2000 && c.sessionConfiguration.ackBatch == 20)
        #expect(c.noProgressSeconds == 30 && c.maxSessionSeconds == 600)
        #expect(c.syncIntervalSeconds == 60)
        #expect(c.logLevel == .info)
        #expect(c.uplink.endpoint == nil)
        #expect(c.peripherals.isEmpty)
        #expect(c.requireBond == true)  // production default: encrypted links only
    }

    /// Issue 12: retention is configurable; the budget defaults to half the room at start, at most 1 GiB.
    @Test func retentionHoursAndTheDefaultDiskBudget() throws {
        #expect(try parse("{}").retentionHours == 72)
        #expect(try parse("{}").diskBudgetBytes == nil)
        #expect(try parse(#"{"retention_hours": 0.5}"#).retentionHours == 0.5)
        #expect(try parse(#"{"retention_hours": 0}"#).retentionHours == 0)
        #expect(error(#"{"retention_hours": -1}"#)?.key == "retention_hours")
        #expect(error(#"{"retention_hours": "72h"}"#)?.key == "retention_hours")
        let dir = try TemporaryDirectory("budget")
        defer { dir.remove() }
        let budget = GatewayStore.defaultDiskBudget(forStoreAt: dir.path("ferry.sqlite"))
        let free = try #require(try GatewayStore(path: dir.path("probe.sqlite")).freeBytes())
        #expect(budget >= 1 << 20 && budget <= 1 << 30)
        #expect(budget <= max(1 << 20, free / 2 + 1 << 20))
    }

    /// Range errors print numbers the way the operator writes them and the docs list them (`10...86400`, not
    /// `10.0...86400.0`); a fraction stays a fraction.
    @Test func rangeErrorsPrintNumbersAsWritten() throws {
        let wedged = error(#"{"adapter_recovery": {"wedged_after_seconds": 1}}"#)
        #expect(wedged?.key == "adapter_recovery.wedged_after_seconds")
        #expect(wedged?.problem == "must be in 10...86400, got 1")
        #expect(error(#"{"backoff_base_seconds": 0.05}"#)?.problem == "must be in 0.1...3600, got 0.05")
        #expect(error(#"{"max_connections": 2.5}"#)?.problem == "must be a whole number, got 2.5")
        #expect(error(#"{"max_connections": 11}"#)?.problem == "must be in 1...10, got 11")
        #expect(error(#"{"max_connections": 1e19}"#)?.problem == "must be in 1...10, got 1e+19")  // past Int
    }

    /// One connect's discovery bound: 15 s unless set, a number of seconds in 2...600.
    @Test func discoveryTimeoutDefaultsTo15SecondsAndIsBounded() throws {
        #expect(try parse("{}").discoveryTimeoutSeconds == 15)
        #expect(try parse(#"{"discovery_timeout_seconds": 4.5}"#).discoveryTimeoutSeconds == 4.5)
        let tooShort = error(#"{"discovery_timeout_seconds": 1}"#)
        #expect(tooShort?.key == "discovery_timeout_seconds")
        #expect(tooShort?.problem == "must be in 2...600, got 1")
        #expect(error(#"{"discovery_timeout_seconds": "5"}"#)?.key == "discovery_timeout_seconds")
    }

    @Test func requireBondParsesAndIsABoolean() throws {
        #expect(try parse(#"{"require_bond": false}"#).requireBond == false)
        #expect(error(#"{"require_bond": "no"}"#)?.key == "require_bond")
    }

    @Test func pairedPeripheralsAreAllowedWithTheDefaultStayConnectedPolicy() throws {
        var c = try parse(#"{"peripherals": ["C0:FF:EE:00:00:01"]}"#)
        let paired = PeripheralAddress("C0:FF:EE:00:00:05")!
        let stranger = PeripheralAddress("C0:FF:EE:00:00:09")!
        #expect(c.policy(for: paired) == nil)
        #expect(c.policy(for: paired, trusted: [paired]) == PeripheralPolicy(address: paired))
        #expect(c.policy(for: stranger, trusted: [paired]) == nil)
        c.stayConnectedDefault = true
        #expect(c.policy(for: paired, trusted: [paired])?.stayConnected == true)
    }

    @Test func metricsListenIsOffByDefaultAndTakesAnIPLiteralWithAPort() throws {
        #expect(try parse("{}").metricsListen == nil)
        #expect(try parse(#"{"metrics_listen": null}"#).metricsListen == nil)
        #expect(try parse(#"{"metrics_listen": "127.0.0.1:9464"}"#).metricsListen == ListenAddress(host: "127.0.0.1", port: 9464))
        #expect(try parse(#"{"metrics_listen": "[::1]:9464"}"#).metricsListen?.isLoopback == true)
        #expect(error(#"{"metrics_listen": "localhost:9464"}"#)?.key == "metrics_listen")
        #expect(error(#"{"metrics_listen": 9464}"#)?.key == "metrics_listen")
        #expect(error(#"{"metrics_listen": "127.0.0.1"}"#)?.description.contains("127.0.0.1:9464") == true)
    }

    @Test func adapterRecoveryDefaultsAndKeys() throws {
        #expect(try parse("{}").adapterRecovery == AdapterRecoverySettings())
        let c = try parse(
            #"{"adapter_recovery": {"enabled": false, "wedged_after_seconds": 60, "min_failures": 2, "adapter_missing_seconds": 10, "verify_seconds": 30, "cooldown_seconds": 600, "hci_reset": false}}"#)
        #expect(c.adapterRecovery == AdapterRecoverySettings(
            enabled: false, wedgedAfterSeconds: 60, minFailures: 2, adapterMissingSeconds: 10, verifySeconds: 30,
            cooldownSeconds: 600, hciReset: false))
        #expect(error(#"{"adapter_recovery": {"wedged_after": 60}}"#)?.key == "adapter_recovery.wedged_after")
        #expect(error(#"{"adapter_recovery": {"verify_seconds": 1}}"#)?.key == "adapter_recovery.verify_seconds")
        #expect(error(#"{"adapter_recovery": true}"#)?.key == "adapter_recovery")
    }

    @Test func fullFile() throws {
        let c = try parse(
            """
            {"state_dir": "/srv/ferry", "adapter": "hci1", "max_connections": 4, "window": 40,
             "sync_interval_seconds": 30, "log_level": "notice", "disk_budget_bytes": 104857600,
             "no_progress_seconds": 12, "max_session_seconds": 120,
             "peripherals": ["c0:ff:ee:00:00:01", {"address": "C0:FF:EE:00:00:02", "stay_connected": true}],
             "uplink": {"endpoint": "https://example.invalid/ingest", "gateway_id": "pi-7", "max_in_flight": 2}}
            """)
        #expect(c.stateDir == "/srv/ferry")
        #expect(c.adapter == "hci1")
        #expect(c.maxConnections == 4)
        #expect(c.window == 40)
        #expect(c.logLevel == .notice)
        #expect(c.diskBudgetBytes == 104_857_600)
        #expect(c.peripherals.map(\.address.string) == ["C0:FF:EE:00:00:01", "C0:FF:EE:00:00:02"])
        #expect(c.peripherals.map(\.stayConnected) == [false, true])
        #expect(c.uplink.endpoint == "https://example.invalid/ingest")
        #expect(c.uplink.gatewayID == "pi-7")
        #expect(c.uplink.maxInFlight == 2)
        #expect(c.sessionConfiguration.window == 40)
        #expect(c.sessionConfiguration.noProgressTimeout == 12)
        #expect(c.sessionConfiguration.maxSessionDuration == 120)
        #expect(c.schedulerConfiguration.maxConnections == 4)
        try c.validate()
    }

    @Test func windowAndAckCadence() throws {
        let c = try parse(#"{"window": 100, "ack_every": 25}"#)
        #expect(c.sessionConfiguration.window == 100 && c.sessionConfiguration.ackBatch == 25)
        // A config from before ack_every with a window below 20: the cadence follows the window.
        let small = try parse(#"{"window": 8}"#)
        #expect(small.sessionConfiguration.window == 8 && small.sessionConfiguration.ackBatch == 8)
        // Stop-and-wait, as before the pipelined default.
        let stopAndWait = try parse(#"{"window": 20}"#)
        #expect(stopAndWait.sessionConfiguration.ackBatch == 20)
    }

    @Test func theAllowlistDecidesUnlessLabModeIsOn() throws {
        var c = try parse(#"{"peripherals": ["C0:FF:EE:00:00:01"]}"#)
        let listed = PeripheralAddress("C0:FF:EE:00:00:01")!
        let stranger = PeripheralAddress("C0:FF:EE:00:00:09")!
        #expect(c.policy(for: listed) != nil)
        #expect(c.policy(for: stranger) == nil)
        c.allowAnySyncPeripheral = true
        c.stayConnectedDefault = true
        #expect(c.policy(for: stranger) == PeripheralPolicy(address: stranger, stayConnected: true))
    }

    @Test func errorsNameTheKeyAndTheProblem() {
        let valid = #""peripherals": ["C0:FF:EE:00:00:01"]"#
        #expect(error(#"{"max_conections": 3}"#)?.key == "max_conections")
        #expect(error("{\(valid), \"max_connections\": \"3\"}")?.description
            == "config key 'max_connections': must be a number, got the string '3'")
        #expect(error("{\(valid), \"max_connections\": 0}")?.key == "max_connections")
        #expect(error("{\(valid), \"max_connections\": 2.5}")?.problem.contains("whole number") == true)
        #expect(error("{\(valid), \"window\": 70000}")?.key == "window")
        #expect(error("{\(valid), \"window\": 20, \"ack_every\": 21}")?.key == "ack_every")
        #expect(error("{\(valid), \"ack_every\": 0}")?.key == "ack_every")
        #expect(error("{\(valid), \"no_progress_seconds\": 1}")?.key == "no_progress_seconds")
        #expect(error("{\(valid), \"max_session_seconds\": 0}")?.key == "max_session_seconds")
        #expect(error("{\(valid), \"allow_any_sync_peripheral\": 1}")?.key == "allow_any_sync_peripheral")
        #expect(error("{\(valid), \"state_dir\": \"relative/dir\"}")?.key == "state_dir")
        #expect(error("{\(valid), \"log_level\": \"loud\"}")?.key == "log_level")
        #expect(error(#"{"peripherals": ["nope"]}"#)?.key == "peripherals[0]")
        #expect(error(#"{"peripherals": [{"adress": "C0:FF:EE:00:00:01"}]}"#)?.key == "peripherals[0].adress")
        #expect(error(#"{"peripherals": ["C0:FF:EE:00:00:01", "c0:ff:ee:00:00:01"]}"#)?.key == "peripherals[1]")
        #expect(error("{\(valid), \"uplink\": {\"endpoint\": \"ftp://x\"}}")?.key == "uplink.endpoint")
        #expect(error("{\(valid), \"uplink\": {\"token\": \"secret\"}}")?.key == "uplink.token")
        #expect(error("{\(valid), \"backoff_base_seconds\": 10, \"backoff_cap_seconds\": 5}")?.key == "backoff_cap_seconds")
        #expect(error("[1, 2]")?.problem == "the config must be a JSON object")
        #expect(error("{").map { $0.problem.hasPrefix("not valid JSON") } == true)
        // A number no Double holds is named by its key, not reported as the decoder's type mismatch.
        let huge = error(#"{"uplink": {"timeout_seconds": 1e400}}"#)
        #expect(huge == ConfigError(key: "uplink.timeout_seconds", problem: "the number is beyond ±1.8e308 (no setting takes it)"))
        #expect(error(#"{"peripherals": [{"address": -1e999}]}"#)?.key == "peripherals[0].address")
    }

    @Test func validationRefusesConfigsThatCouldNeverSyncAnything() {
        // An empty allowlist is valid: peripherals paired with `ferry pair` are synced too.
        #expect(error("{}") == nil)
        #expect(error(#"{"allow_any_sync_peripheral": true}"#) == nil)
        // Every slot held by a stay-connected peripheral would starve the others.
        #expect(
            error(
                #"{"max_connections": 1, "peripherals": [{"address": "C0:FF:EE:00:00:01", "stay_connected": true}]}"#)?
                .key == "max_connections")
    }

    @Test func stateDirectoryIsCreated0700AndAWorldReadableOneIsRefused() throws {
        let scratch = try TemporaryDirectory("state")
        defer { scratch.remove() }
        let base = scratch.url.path
        let fresh = base + "/a/state"
        try StateDirectory.prepare(fresh)
        let mode = try FileManager.default.attributesOfItem(atPath: fresh)[.posixPermissions] as? Int
        #expect(mode == 0o700)
        try StateDirectory.prepare(fresh)  // an existing 0700 directory is fine
        let open = base + "/open"
        try FileManager.default.createDirectory(atPath: open, withIntermediateDirectories: true)
        chmod(open, 0o755)
        #expect(throws: ConfigError.self) { try StateDirectory.prepare(open) }
        let file = base + "/file"
        _ = FileManager.default.createFile(atPath: file, contents: Data())
        #expect(throws: ConfigError.self) { try StateDirectory.prepare(file) }
    }
}
