import Dispatch
import FerryCore
import FerryDBus
import FerryGateway
import FerrySync
import FerryProtocol
import FerryUplink
import FoundationEssentials

#if canImport(Glibc)
    import Glibc
#endif

enum RunCommand {
    static let help = """
        Usage: ferry run --config FILE [overrides]

        The gateway daemon: keeps the allowed peripherals (the config's allowlist plus those paired with
        `ferry pair`; by default only ones BlueZ holds a bond for, so only over encrypted links) synced through a few BLE connection slots (backlog
        and age decide who goes next; failures back off per peripheral), stores every validated frame, and
        forwards the outbox to the backend alongside. Runs until SIGTERM/SIGINT: then it takes no more frames,
        commits what is staged, acknowledges only what is committed, disconnects and exits within a few
        seconds. SIGHUP re-reads the config file's allowlist. See docs/CONFIG.md for every key.

        Overrides (win over the file):
          --state-dir DIR          the store goes to DIR/ferry.sqlite (DIR is created 0700)
          --adapter hciN           the Bluetooth adapter (default: the first)
          --peripherals A,B,...    replace the allowlist (sync and release)
          --allow-any              lab mode: sync any peripheral advertising the Sync service
          --allow-unbonded         lab mode: also sync peripherals BlueZ holds no bond for (require_bond false)
          --max-connections N      concurrent sessions (default 3)
          --sync-interval S        re-sync a caught-up peripheral after S seconds (0-86400, default 60)
          --window N               SYNC_REQ window: frames the peripheral may send past the last ACK (default 2000)
          --ack-every N            commit + SYNC_ACK every N frames, at most the window (default 20)
          --endpoint URL           uplink endpoint; without one, store only
          --token-file F           uplink bearer token file (chmod 600)
          --gateway-id ID          the uplink's "gateway" field (default: the host name)
          --log-level L            debug | info | notice | warning | error (default info)
          --bus ADDRESS            D-Bus address of bluetoothd's bus (default: the system bus)

        Under systemd (Type=notify): READY=1 once the store is open and the adapter found, STATUS= with the
        slots in use and the backlog, and WATCHDOG=1 only while the scheduling loop, the D-Bus connection and
        the forwarder all make progress (WatchdogSec= then restarts a hung daemon).
        With "metrics_listen": "127.0.0.1:9464" in the config: Prometheus metrics at /metrics and a health check
        at /healthz (200 only while ready and every part makes progress), see docs/CONFIG.md. Either way the
        daemon keeps its live view (slots, sessions) in STATE_DIR/ferry-live.json for `ferry status`.
        Logs: one line per event on stderr ("ferry[level]: ..."; with syslog priority prefixes under systemd).
        Exit status: 0 stopped by a signal; 1 failure; 2 config or usage error (the message names the key).
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "run",
            options: [
                "--config", "--state-dir", "--adapter", "--peripherals", "--max-connections", "--sync-interval",
                "--window", "--ack-every", "--endpoint", "--token-file", "--gateway-id", "--log-level", "--bus",
            ],
            flags: ["--allow-any", "--allow-unbonded"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let configPath = try args.required("--config", command: "run")
        let configuration = try load(configPath, overrides: args)
        do {
            try configuration.validate()
            try StateDirectory.prepare(configuration.stateDir)
        } catch let error as ConfigError {
            throw UsageError(error.description)
        }
        // The store, its WAL and journal hold every payload: owner-only whatever the caller's umask.
        umask(0o077)
        let log = DaemonLogSink.forEnvironment(minimum: configuration.logLevel)
        if let tokenFile = configuration.uplink.tokenFile {
            do { _ = try TokenFile(path: tokenFile).read() } catch { throw CommandFailure("uplink.token_file: \(error)") }
        }
        let bus = args.values["--bus"]
        let supervision = Supervision.make(configuration, log: log)
        // /healthz judges the same heartbeats as systemd's watchdog: one DaemonHealth for both.
        let health = supervision?.health
            ?? (configuration.metricsListen != nil ? DaemonHealth(monitor: Supervision.monitor(configuration)) : nil)
        let metrics = try MetricsService.start(configuration, health: health, log: log)
        defer { metrics?.server.stop() }
        let daemon = GatewayDaemon(
            configuration: configuration, log: log,
            connectBus: {
                try await DBusConnection.connect(to: bus.map { .address($0) } ?? .system, defaultCallTimeout: .seconds(25))
            }, health: health, metrics: metrics?.metrics)
        supervision?.start()
        defer { supervision?.stop() }

        // SIGHUP: reload the allowlist from the same file with the same overrides; a bad file keeps the old one.
        signal(SIGHUP, SIG_IGN)
        let hangup = DispatchSource.makeSignalSource(signal: SIGHUP, queue: .global())
        hangup.setEventHandler {
            do {
                let fresh = try load(configPath, overrides: args)
                try fresh.validate()
                Task { await daemon.reload(fresh) }
            } catch {
                log.log(.error, "reload: \(error); keeping the current allowlist")
            }
        }
        hangup.resume()
        defer { hangup.cancel() }
        do {
            try AsyncBridge.run(cancelOnSignals: true) { try await daemon.run() }
        } catch {
            throw CommandFailure("\(error)")
        }
        return 0
    }

    /// The file, then the flags on top. Errors name the key (or flag) and the problem.
    static func load(_ path: String, overrides args: ParsedArguments) throws -> DaemonConfiguration {
        // Bounded: --config /dev/zero (or any huge file) must end in an error, not fill the memory.
        var bytes: [UInt8] = []
        if let code = readFile(path, limit: DaemonConfiguration.maximumFileBytes + 1, into: &bytes) {
            throw UsageError("cannot read config file \(path): \(errnoDescription(code))")
        }
        guard bytes.count <= DaemonConfiguration.maximumFileBytes else {
            throw UsageError("config file \(path) is larger than \(DaemonConfiguration.maximumFileBytes) bytes")
        }
        let data = Data(bytes)
        var c: DaemonConfiguration
        do { c = try DaemonConfiguration.parse(data) } catch let error as ConfigError {
            throw UsageError("\(path): \(error.description)")
        }
        if let v = args.values["--state-dir"] {
            guard v.hasPrefix("/") else { throw UsageError("--state-dir must be an absolute path, got '\(v)'") }
            c.stateDir = v
        }
        if let v = args.values["--adapter"] { c.adapter = v }
        if let v = args.values["--peripherals"] {
            c.peripherals = try v.split(separator: ",").map {
                PeripheralPolicy(address: try FerryCommandLine.address(String($0), option: "--peripherals"))
            }
        }
        if args.flags.contains("--allow-any") { c.allowAnySyncPeripheral = true }
        if args.flags.contains("--allow-unbonded") { c.requireBond = false }
        if args.values["--max-connections"] != nil {
            c.maxConnections = try args.integer("--max-connections", Int.self, default: 3, range: 1...10)
        }
        if args.values["--sync-interval"] != nil {
            c.syncIntervalSeconds = try args.number("--sync-interval", default: 60, range: 0...86_400)  // as in the config
        }
        if args.values["--window"] != nil {
            c.window = try args.integer("--window", UInt16.self, default: Frame.defaultWindow, range: 1...UInt16.max)
        }
        if args.values["--ack-every"] != nil {
            c.ackEvery = try args.integer("--ack-every", Int.self, default: Frame.defaultAckEvery, range: 1...65_535)
        }
        if let ack = c.ackEvery, ack > Int(c.window) {
            throw UsageError("--ack-every (\(ack)) must be ≤ the window (\(c.window))")
        }
        if let v = args.values["--endpoint"] {
            guard let url = URL(string: v), let scheme = url.scheme, ["http", "https"].contains(scheme) else {
                throw UsageError("--endpoint must be an http(s) URL, got '\(v)'")
            }
            c.uplink.endpoint = v
        }
        if let v = args.values["--token-file"] { c.uplink.tokenFile = v }
        if let v = args.values["--gateway-id"] { c.uplink.gatewayID = v }
        if let v = args.values["--log-level"] {
            guard let level = LogLevel(name: v) else {
                throw UsageError("--log-level must be debug, info, notice, warning or error, got '\(v)'")
            }
            c.logLevel = level
        }
        return c
    }
}

/// One line per event on stderr. Under systemd (JOURNAL_STREAM set) each line starts with its syslog
/// priority ("<4>"), which journald turns into the entry's PRIORITY; elsewhere "ferry[level]: ".
struct DaemonLogSink: LogSink {
    let minimum: LogLevel
    let priorityPrefix: Bool

    /// Syslog priority prefixes when stderr goes to journald (systemd sets JOURNAL_STREAM), plain lines otherwise.
    static func forEnvironment(minimum: LogLevel) -> DaemonLogSink {
        DaemonLogSink(minimum: minimum, priorityPrefix: ProcessInfo.processInfo.environment["JOURNAL_STREAM"] != nil)
    }

    func log(_ level: LogLevel, _ message: String) {
        guard level >= minimum else { return }
        let line: String
        if priorityPrefix {
            let priority: Int
            switch level {
            case .debug: priority = 7
            case .info: priority = 6
            case .notice: priority = 5
            case .warning: priority = 4
            case .error: priority = 3
            }
            line = "<\(priority)>\(level): \(message)\n"
        } else {
            line = "ferry[\(level)]: \(message)\n"
        }
        ProgressLine.eraseForLogLine()
        StandardOutput.writeAll(2, line)
    }
}

/// systemd supervision for `ferry run` when `$NOTIFY_SOCKET` is set: the daemon's health plus the thread
/// that reports it. The watchdog limits follow the config: the forwarder may legitimately wait for one request
/// as long as `uplink.timeout_seconds`.
struct Supervision {
    let health: DaemonHealth
    let thread: SystemdSupervision

    static func make(_ configuration: DaemonConfiguration, log: any LogSink) -> Supervision? {
        let notifier = SystemdNotifier.fromEnvironment()
        guard notifier.isActive else { return nil }
        let health = DaemonHealth(monitor: monitor(configuration))
        return Supervision(health: health, thread: SystemdSupervision(notifier: notifier, health: health, log: log))
    }

    static func monitor(_ configuration: DaemonConfiguration) -> WatchdogMonitor {
        var monitor = WatchdogMonitor()
        monitor.limits[.forwarder] = max(120, Double(configuration.uplink.timeoutSeconds) * 2 + 30)
        return monitor
    }

    func start() { thread.start() }
    func stop() { thread.stop() }
}

/// The metrics endpoint for `ferry run` when `metrics_listen` is set: the registry the daemon updates and the
/// HTTP server that renders it. A port that cannot be opened fails the start (exit 1) rather than running
/// unobserved when the operator asked to observe.
struct MetricsService {
    let metrics: GatewayMetrics
    let server: MetricsHTTPServer

    static func start(_ configuration: DaemonConfiguration, health: DaemonHealth?, log: any LogSink) throws -> MetricsService? {
        guard let address = configuration.metricsListen, let health else { return nil }
        let metrics = GatewayMetrics(maxConnections: configuration.maxConnections)
        let endpoint = MetricsEndpoint(metrics: metrics, health: health, databasePath: configuration.databasePath)
        let server: MetricsHTTPServer
        do {
            server = try MetricsHTTPServer(address: address) { endpoint.respond(path: $0) }
        } catch {
            throw CommandFailure("\(error)")
        }
        if !address.isLoopback {
            log.log(
                .warning,
                "metrics_listen \(address) is not a loopback address: anyone who can reach it reads the peripherals' "
                    + "addresses, backlogs and the uplink state (no authentication); firewall it or use 127.0.0.1")
        }
        log.log(.notice, "metrics: http://\(address)/metrics and /healthz")
        server.start()
        return MetricsService(metrics: metrics, server: server)
    }
}
