import FerryCore
import FerryBlueZ
import FerryDBus
import FerryGateway
import FerrySync
import FerryProtocol
import FerryStore
import FoundationEssentials
import Glibc

enum SyncCommand {
    static let help = """
        Usage: ferry sync --address ADDR [--adapter hciN] --db PATH [--timeout S] [--json] [options]

        One sync with one peripheral, for technicians and tests: connect through BlueZ, run the session until
        the peripheral is caught up (every buffered event committed and acknowledged), send the final
        SYNC_ACK, disconnect, print a summary. Never acknowledges a frame that is not committed.

        Options:
          --address ADDR     the peripheral, AA:BB:CC:DD:EE:FF (discovered first if BlueZ does not know it)
          --adapter hciN     the Bluetooth adapter (default: the first one)
          --db PATH          the gateway store (created if missing)
          --timeout S        give up after S seconds (1-86400, default 120); what is committed stays committed
          --window N         frames the peripheral may send beyond the last ACK (default 2000: pipelined, batches
                             stay on the air while earlier ones commit and their ACKs travel)
          --ack-every N      commit + SYNC_ACK every N frames (default 20, or the window if smaller); at most
                             the window. An ACK never names a frame that is not committed.
          --notify MODE      acquire (AcquireNotify, falling back to StartNotify; default) | start (StartNotify)
          --disk-budget B    stop committing (so stop acknowledging: the peripheral keeps its events) once the
                             store and its WAL exceed B bytes; the result says so (default: no budget)
          --bus ADDRESS      D-Bus address of the bus bluetoothd is on (default: the system bus)
          --require-bond     refuse (exit 1, before connecting) unless BlueZ holds a bond with the peripheral, as
                             `ferry run` does by default; without it an unbonded peripheral is synced in clear,
                             and one whose Sync service needs encryption fails with a line saying to pair it
          --json             print one JSON object: {"address","result","frames_stored","duplicates","gaps",
                             "regressions","corrupt","crc_mismatches","stalls","epoch","cursor","notify_path","mtu",
                             "duration_seconds","discovery_needed","phases","phases_cpu"}; "phases" holds, in seconds since the
                             command started (null: not reached), when each step ended: "discovery" (0-ish when
                             BlueZ already knew the device), "connect", "services_resolved", "stream_info",
                             "subscribed", "first_data", "last_data", "caught_up", "final_ack" (dated by the commit it
                             acknowledges: the write follows at once), "disconnected";
                             "phases_cpu" the process's CPU seconds (user+system) at "start" (when the sync
                             began, after start-up) and at the same steps (no "last_data"; "final_ack" read
                             at the disconnection that follows it)
          --verbose          log connection steps on stderr

        Exit status: 0 caught up; 1 failed (adapter missing, device not found, not a Sync peripheral, not bonded,
        encryption needed but no bond, timeout, link lost before catching up; the message says which); 2 usage
        error.
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "sync",
            options: [
                "--address", "--adapter", "--db", "--timeout", "--window", "--ack-every", "--notify", "--bus",
                "--disk-budget",
            ],
            flags: ["--json", "--verbose", "--require-bond"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let address = try FerryCommandLine.address(try args.required("--address", command: "sync"), option: "--address")
        let dbPath = try args.required("--db", command: "sync")
        let timeout = try args.number("--timeout", default: 120, range: 1...86_400)
        let window = try args.integer("--window", UInt16.self, default: Frame.defaultWindow, range: 1...UInt16.max)
        let ackEvery = try args.integer(
            "--ack-every", Int.self, default: min(Frame.defaultAckEvery, Int(window)), range: 1...65_535)
        guard ackEvery <= Int(window) else {
            throw UsageError("--ack-every (\(ackEvery)) must be ≤ the window (\(window))")
        }
        let notify: GattNotifyMethod
        switch args.values["--notify"] ?? "acquire" {
        case "acquire": notify = .acquireNotify
        case "start": notify = .startNotify
        case let other: throw UsageError("--notify must be acquire or start, got '\(other)'")
        }
        let diskBudget: Int64? = args.values["--disk-budget"] == nil
            ? nil : try args.integer("--disk-budget", Int64.self, default: 0, range: 1...Int64.max)
        let adapterName = args.values["--adapter"]
        let bus = args.values["--bus"]
        let json = args.flags.contains("--json")
        let requireBond = args.flags.contains("--require-bond")
        let log: any LogSink = StderrLogSink(minimum: args.flags.contains("--verbose") ? .info : .warning)
        // Fails on a bad store before touching the radio; the session then takes this connection rather than
        // opening its own.
        let opened = try FerryCommandLine.openStore(dbPath, create: true)
        // One process per sync: the next one writes over this one's WAL file instead of growing a new one.
        opened.keepsWALOnClose = true
        let store = StoreHandoff(opened)

        var settings = SyncSession.Configuration()
        settings.window = window
        settings.ackBatch = ackEvery
        let configuration = settings
        let progress = ProgressLine.forStderr(json: json)
        defer { progress.clear() }
        let outcome = try AsyncBridge.run(cancelOnSignals: true) {
            try await sync(
                address: address, adapterName: adapterName, dbPath: dbPath, bus: bus, timeout: timeout,
                configuration: configuration, notify: notify, diskBudget: diskBudget, requireBond: requireBond, log: log,
                progress: progress, store: store)
        }
        progress.clear()
        let s = outcome.summary
        if json {
            output.out(
                JSON.object([
                    ("address", .string(address.string)), ("result", .string(outcome.result.description)),
                    ("frames_stored", .int(s.framesStored)), ("duplicates", .int(s.duplicates)),
                    ("gaps", .int(s.gapsRecorded)), ("regressions", .int(s.regressions)), ("corrupt", .int(s.corrupt)),
                    ("crc_mismatches", .int(outcome.decoder.crcMismatches)), ("stalls", .int(outcome.decoder.stalls)),
                    ("epoch", .string(String(s.epoch))), ("cursor", .string(String(s.cursor))),
                    ("notify_path", .string(outcome.notifyPath)), ("mtu", outcome.mtu.map { .int($0) } ?? .null),
                    ("duration_seconds", .double((outcome.seconds * 1000).rounded() / 1000)),
                    ("discovery_needed", .bool(outcome.discoveryNeeded)),
                    ("phases", .object(outcome.phases.map { ($0.0, $0.1.map { .double(($0 * 1000).rounded() / 1000) } ?? .null) })),
                    ("phases_cpu", .object(outcome.phasesCPU.map { ($0.0, $0.1.map { .double(($0 * 1000).rounded() / 1000) } ?? .null) })),
                ]).text)
        } else {
            output.out(
                "sync \(address): \(outcome.result); \(s.framesStored) frames stored, \(s.duplicates) duplicates, "
                    + "\(s.gapsRecorded) gaps, \(s.regressions) regressions, \(s.corrupt) corrupt; epoch \(s.epoch) "
                    + "cursor \(s.cursor); notify via \(outcome.notifyPath)"
                    + (outcome.mtu.map { " (MTU \($0))" } ?? "") + cFormat("; %.2f s", outcome.seconds))
        }
        guard outcome.result == .caughtUp else {
            throw CommandFailure("sync \(address) did not finish: \(outcome.result)")
        }
        return 0
    }

    struct Outcome: Sendable {
        var summary: SyncSummary
        /// Why bytes were discarded (CRC mismatch vs. a partial frame dropped when DATA went idle): tells a
        /// damaged stream from a stalled one.
        var decoder: FrameDecoder.Statistics
        var result: Result
        var notifyPath: String
        var mtu: UInt16?
        var seconds: Double
        /// BlueZ did not know the device: discovery ran before the connect.
        var discoveryNeeded = false
        /// (JSON key, seconds since the command started) for each step, in order.
        var phases: [(String, Double?)] = []
        /// (JSON key, the process's CPU seconds then): "start" when the sync began, then the phases' keys.
        var phasesCPU: [(String, Double?)] = []
    }

    /// How the sync ended, for the operator: the JSON's "result" and the summary line are its description, and
    /// only `.caughtUp` exits 0.
    enum Result: Sendable, Equatable, CustomStringConvertible {
        case caughtUp
        /// SIGINT or SIGTERM: committed and acknowledged what it had, then disconnected.
        case interrupted
        case timedOut(seconds: Int)
        /// The peripheral answered none of the SYNC_REQs.
        case noResponse
        case noProgress(seconds: Int)
        /// The store and its WAL reached --disk-budget: the session stopped taking frames.
        case overDiskBudget
        /// The link needed encryption and there was no usable bond: `LinkSecurity`'s sentence, with the end.
        case insecureLink(String)
        /// The session ended because bluetoothd exited or restarted under it.
        case bluetoothdRestarted(SessionEnd)
        case ended(SessionEnd)

        var description: String {
            switch self {
            case .caughtUp: "caught up"
            case .interrupted: "interrupted"
            case .timedOut(let seconds): "timeout after \(seconds) s"
            case .noResponse: "no response from the peripheral after 3 SYNC_REQs"
            case .noProgress(let seconds):
                "no progress: no new frame for \(seconds) s (committed frames are kept; run again)"
            case .overDiskBudget: "store over its disk budget"
            case .insecureLink(let sentence): sentence
            case .bluetoothdRestarted(let end):
                "\(end): bluetoothd exited or restarted during the sync (committed frames are kept; run again)"
            case .ended(let end): end.description
            }
        }
    }

    static func sync(
        address: PeripheralAddress, adapterName: String?, dbPath: String, bus: String?, timeout: Double,
        configuration: SyncSession.Configuration, notify: GattNotifyMethod, diskBudget: Int64?, requireBond: Bool,
        log: any LogSink, progress: ProgressLine = ProgressLine(enabled: false), store: StoreHandoff
    ) async throws -> Outcome {
        // Phase times on the session runner's clock, so the two halves line up.
        let phaseClock = SystemMonotonicClock()
        let origin = phaseClock.now()
        var setup: [(String, Double?)] = []
        var setupCPU: [(String, Double?)] = [("start", ProcessCPU.seconds())]
        func mark(_ name: String) {
            setup.append((name, phaseClock.now() - origin))
            setupCPU.append((name, ProcessCPU.seconds()))
        }
        let deadline = origin + timeout
        func remaining() -> Duration { max(.milliseconds(100), phaseClock.remaining(until: deadline)) }
        func seconds() -> Double { phaseClock.seconds(since: origin) }

        progress.update("\(address): connecting", force: true)
        let client = try await BlueZAccess.client(bus: bus)
        let adapter = try await BlueZAccess.poweredAdapter(client, named: adapterName)
        if requireBond {
            let known = await client.knownDevice(address: address.string, on: adapter)
            guard let known, await known.isBonded() else {
                throw CommandFailure(
                    "\(address) is not bonded with this gateway (--require-bond): nothing synced; "
                        + "pair it first with `ferry pair --address \(address)`")
            }
        }
        // Pairing prompts bluetoothd sends while we touch the Sync characteristics (a peripheral demanding
        // encryption) are refused at once: pairing is `ferry pair`'s job, and with no agent at all such a
        // call would hang until its D-Bus timeout.
        // No unregistering needed: bluetoothd drops an agent when its owner's bus connection closes (at exit).
        _ = try? await BlueZAgent.register(
            client: client, path: "/ferry/sync_agent", policy: .rejectAll, makeDefault: false,
            log: { log.log(.debug, $0) })
        var settings = SessionWorker.Settings(
            address: address, databasePath: dbPath, configuration: configuration, diskBudgetBytes: diskBudget,
            requireBond: requireBond, waitTimeout: min(remaining(), .seconds(30)),
            connectTimeout: .seconds(35), resolveTimeout: .seconds(30))
        settings.preferredNotify = notify
        settings.connectorLogLevel = .info
        settings.openedStore = store
        settings.deadline = deadline
        // No discovery when BlueZ already has the device object: it only costs time (and radio).
        let discoveryNeeded = await client.knownDevice(address: address.string, on: adapter) == nil
        // bluetoothd may take its time to start a discovery, but not beyond --timeout.
        let startTimeout = min(remaining(), max(BlueZDiscovery.defaultStartTimeout, settings.waitTimeout))
        do {
            if discoveryNeeded {
                progress.update("\(address): discovering", force: true)
                _ = try await client.discover(
                    address: address.string, on: adapter, timeout: settings.waitTimeout, startTimeout: startTimeout)
            }
        } catch let error as BlueZError where error.kind == .unknownObject || error.kind == .notFound {
            throw CommandFailure("device \(address) not found on \(adapter.name): \(error)")
        } catch let error as BlueZError where error.kind == .timeout {
            // Waiting for the device ends in .notFound; a timeout is bluetoothd not answering the discovery start.
            throw CommandFailure(
                "discovery on \(adapter.name) did not start (bluetoothd gave no answer): no answer to the discovery start "
                    + "within \(startTimeout.wholeSecondsRoundedUp) s: \(error)")
        } catch {
            throw CommandFailure("cannot discover \(address) on \(adapter.name): \(error)")
        }
        mark("discovery")
        // bluetoothd restarting mid-sync looks like a plain link loss from the session's side; the cache's
        // generation (bumped on every NameOwnerChanged rebuild) lets the summary say what really happened.
        let bluezGeneration = await client.objects.generation
        let bluezOwner = await client.objects.serviceOwnerName
        let worker = SessionWorker(settings: settings, client: client, adapter: adapter, sink: log, clock: phaseClock)
        let link: SessionWorker.Session
        do {
            link = try await worker.open { step in
                switch step {
                case .connected:
                    mark("connect")
                    log.log(.info, "connected to \(address)")
                case .resolving:
                    progress.update("\(address): connected, resolving the Sync service", force: true)
                case .servicesResolved:
                    mark("services_resolved")
                }
            }
        } catch {
            switch error {
            case .connect(let error as BlueZError)
            where error.kind == .timeout || error.kind == .unknownObject || error.kind == .notFound:
                throw CommandFailure("device \(address) not found on \(adapter.name): \(error)")
            case .connect(let error):
                throw CommandFailure("cannot connect to \(address): \(error)")
            case .bondMissingAfterConnect:
                throw CommandFailure(
                    "\(address) is not bonded with this gateway any more (checked after connecting, --require-bond): "
                        + "nothing synced; re-pair it explicitly with `ferry pair --address \(address)`")
            case .notSyncPeripheral(let missing):
                throw CommandFailure("\(address) is not a Sync peripheral (\(missing))")
            case .servicesUnresolved(let error):
                throw CommandFailure("services of \(address) did not resolve: \(error)")
            case .cannotStart(let error):
                throw error
            }
        }
        let runner = link.runner
        let transport = link.transport
        let events = link.events
        // The overall timeout and Ctrl-C both end the session the graceful way: commit, ACK, disconnect.
        let stopper = Task {
            try? await Task.sleep(for: remaining())
            events.yield(.stop)
        }
        let report = await withTaskCancellationHandler {
            await worker.run(link) { runner in
                guard progress.enabled else { return }  // runs per notification: no text built for nothing
                let s = runner.summary
                progress.update(
                    "\(address): syncing \(s.cursor)" + (runner.machine.knownHead.map { " of ~\($0)" } ?? "")
                        + " (\(s.framesStored) frames stored)")
            }
        } onCancel: {
            events.yield(.stop)
        }
        stopper.cancel()
        let ended = runner.summary.end ?? .linkLost
        let result: Result
        switch runner.summary.end {
        case .disconnected(.caughtUp): result = .caughtUp
        case .disconnected(.shutdown): result = Task.isCancelled ? .interrupted : .timedOut(seconds: Int(timeout))
        case .disconnected(.noResponse): result = .noResponse
        case .disconnected(.noProgress): result = .noProgress(seconds: Int(configuration.noProgressTimeout))
        default:
            // The DATA socket's end of file can beat the bus's NameOwnerChanged: ask the bus itself, after a
            // moment for it to notice a dead bluetoothd (seen in the test bed: ferry exited 1.8 s after a
            // SIGKILL, before the object cache had heard of it).
            try? await Task.sleep(for: .milliseconds(300))
            let ownerNow = try? await client.connection.nameOwner(BlueZInterface.service)
            let bluezRestarted = await client.objects.generation != bluezGeneration || ownerNow != bluezOwner
            let bluezGone = await !client.objects.isServiceAvailable || ownerNow == nil
            if runner.summary.backpressure {
                result = .overDiskBudget
            } else if let security = report.securityProblem {
                result = .insecureLink(security)
            } else if bluezRestarted || bluezGone {
                result = .bluetoothdRestarted(ended)
            } else {
                result = .ended(ended)
            }
        }
        let p = runner.phases
        let session: [(String, Double?)] = [
            ("stream_info", p.streamInfo), ("subscribed", p.subscribed), ("first_data", p.firstData),
            ("last_data", p.lastData), ("caught_up", p.caughtUp), ("final_ack", p.finalAck),
            ("disconnected", p.disconnected),
        ].map { ($0.0, $0.1.map { $0 - origin }) }
        let c = runner.phasesCPU
        let sessionCPU: [(String, Double?)] = [
            ("stream_info", c.streamInfo), ("subscribed", c.subscribed), ("first_data", c.firstData),
            ("caught_up", c.caughtUp), ("final_ack", c.finalAck), ("disconnected", c.disconnected),
        ]
        return Outcome(
            summary: runner.summary, decoder: runner.machine.decoder.statistics, result: result,
            notifyPath: transport.notifyMethod?.rawValue ?? "none", mtu: transport.mtu, seconds: seconds(),
            discoveryNeeded: discoveryNeeded, phases: setup + session, phasesCPU: setupCPU + sessionCPU)
    }
}
