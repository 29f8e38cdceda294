import FerryBlueZ
import FerryCore
import FerryDBus
import FerryProtocol
import FerryStore
import FerryUplink
import FoundationEssentials
import Glibc
import FerrySync

/// The long-running gateway (`ferry run`): keeps the allowed peripherals synced through a few connection
/// slots, and forwards the outbox alongside.
///
/// Shape: one scheduling loop (this actor) decides who gets a slot (`SyncScheduler`, pure); each slot runs one
/// session task (`SessionWorker`, the sequence `ferry sync` uses too: connect → `SyncSessionRunner` over
/// `BlueZSyncTransport` → summary); the `OutboxForwarder` runs in its own task. Every session opens its own
/// connection to the store file: SQLite serialises the writers (WAL, busy timeout), and the store, not memory,
/// is the only queue.
///
/// Shutdown (task cancellation, i.e. SIGTERM/SIGINT): every running session gets `.stop` — it takes no more
/// frames, commits what is staged, acknowledges only what is committed and disconnects. Sessions still
/// connecting are cancelled. The daemon waits at most `shutdownGraceSeconds` for them; whatever is
/// uncommitted then is simply not acknowledged and the peripheral replays it next time.
public actor GatewayDaemon {
    private var configuration: DaemonConfiguration
    private let log: any LogSink
    private let clock: any MonotonicClock
    private let connectBus: @Sendable () async throws -> DBusConnection
    /// Heartbeats, readiness and the status line for systemd (`SystemdSupervision`); see Watchdog.swift.
    private let health: DaemonHealth?
    /// The metrics registry served at `metrics_listen` (GatewayMetrics.swift); nil when the endpoint is off.
    private let metrics: GatewayMetrics?
    /// `ferry status`'s view of this process (slots, sessions), rewritten on change and every 10 s.
    private let liveViewFile: LiveViewFile
    private var liveViewWritten: (view: LiveView, at: Double)?
    private var liveViewFailedAt: Double?
    private var scheduler: SyncScheduler
    private var sessions: [PeripheralAddress: ActiveSession] = [:]
    /// Shutdown's waiters, resumed when the last session has finished (or at the grace deadline).
    private var drainWaiters: [CheckedContinuation<Void, Never>] = []
    private var stopping = false
    /// Peripherals paired with `ferry pair` (the store's trusted_peripherals), re-read every few seconds so a
    /// pairing done while the daemon runs is picked up without a reload.
    private var trusted: Set<PeripheralAddress> = []
    private var trustedReadAt = -Double.infinity
    /// The daemon's own connection to the store (trusted peripherals, refusals), on its own thread: sqlite3
    /// calls block and must not hold a thread of the cooperative pool (StoreConnection).
    private var registry: StoreConnection?
    /// Storage pressure (issue 12): the watch task closes this gate while the store is over budget or the disk
    /// is full; `effectiveDiskBudget` is the config's or the default (`GatewayStore.defaultDiskBudget`).
    private let storageSignals: StorageSignals
    /// Wakes the scheduling loop when something it acts on changed (see `schedulingLoop`).
    private let wakeup = Wakeup()
    /// Wakes the outbox forwarder when a session committed frames (the forwarder sleeps otherwise).
    private let outboxWakeup = Wakeup()
    private var effectiveDiskBudget: Int64?
    /// Why a candidate is not being synced (not bonded...), so each refusal is logged once, not every loop.
    private var refusals: [PeripheralAddress: BondRefusal] = [:]
    /// Wedged-controller detection and its ladder (AdapterRecovery.swift); carried out by `recover`.
    private var recovery: AdapterRecovery
    /// The ladder's last step ran out: `run()` throws this after the graceful stop, so the process exits
    /// non-zero and systemd restarts it.
    private var unrecoverable: AdapterUnrecoverable?
    /// Totals since start, for the exit summary.
    public private(set) var totals = Totals()

    public struct Totals: Sendable, Equatable {
        public var sessions = 0
        public var caughtUp = 0
        public var failed = 0
        public var framesStored = 0
        public var gaps = 0
        public var regressions = 0
    }

    struct ActiveSession {
        let task: Task<Void, Never>
        /// The session stays connected for live events (holds its slot while the link lasts).
        var staysConnected = false
        /// Set once the session has a live link; `.stop` goes there.
        var control: LinkEvents?
        /// Monotonic time the slot was taken (the live view's session age).
        var startedAt: Double = 0
    }

    /// `connectBus` defaults to the system bus (tests and the test bed pass another address).
    public init(
        configuration: DaemonConfiguration, log: any LogSink, clock: any MonotonicClock = SystemMonotonicClock(),
        connectBus: @escaping @Sendable () async throws -> DBusConnection = {
            try await DBusConnection.connect(to: .system, defaultCallTimeout: .seconds(25))
        },
        health: DaemonHealth? = nil, metrics: GatewayMetrics? = nil
    ) {
        self.health = health
        self.metrics = metrics
        liveViewFile = LiveViewFile(databasePath: configuration.databasePath)
        self.configuration = configuration
        self.log = log
        self.clock = clock
        self.connectBus = connectBus
        scheduler = SyncScheduler(
            configuration: configuration.schedulerConfiguration, jitter: { Double.random(in: 0.5...1) })
        recovery = AdapterRecovery(settings: configuration.adapterRecovery)
        storageSignals = StorageSignals(opened: wakeup)
    }

    /// SIGHUP: take the new allowlist and lab-mode switch. Sessions with peripherals no longer allowed are
    /// stopped gracefully. Other keys need a restart (logged).
    public func reload(_ new: DaemonConfiguration) {
        var kept = new
        kept.peripherals = configuration.peripherals
        kept.allowAnySyncPeripheral = configuration.allowAnySyncPeripheral
        kept.stayConnectedDefault = configuration.stayConnectedDefault
        kept.requireBond = configuration.requireBond
        if kept != configuration {
            log.log(.warning, "reload: only the allowlist (peripherals, allow_any_sync_peripheral, stay_connected_default, require_bond) is reloaded; restart for the other changes")
        }
        configuration.peripherals = new.peripherals
        configuration.allowAnySyncPeripheral = new.allowAnySyncPeripheral
        configuration.stayConnectedDefault = new.stayConnectedDefault
        configuration.requireBond = new.requireBond
        refusals = [:]
        log.log(
            .notice,
            "reload: \(new.peripherals.count) allowed peripherals"
                + (new.allowAnySyncPeripheral ? ", lab mode (any Sync peripheral)" : "")
                + (new.requireBond ? ", bonded only" : ", unbonded allowed (lab)"))
        for (address, session) in sessions where configuration.policy(for: address, trusted: trusted) == nil {
            log(for: address).log(.notice, "no longer allowed, stopping its session")
            session.control?.yield(.stop)
        }
        wakeup.signal()  // newly allowed peripherals are due now
    }

    /// Runs until the calling task is cancelled; then shuts down gracefully and returns.
    public func run() async throws {
        let dbPath = configuration.databasePath
        let registry = try await StoreConnection.open(path: dbPath, create: true)  // create/migrate once, before any radio work
        self.registry = registry
        try await registry.read { try $0.verifyIntegrity() }  // quick_check: a damaged store stops the start with the next step
        let storageWatch = startStorageWatch(databasePath: dbPath)
        await refreshTrusted(force: true)
        let forwarder = try startForwarder(databasePath: dbPath)
        log.log(
            .notice,
            "ferry run: store \(dbPath), \(configuration.maxConnections) slots, "
                + (configuration.allowAnySyncPeripheral
                    ? "lab mode (any Sync peripheral)" : "allowlist of \(configuration.peripherals.count)")
                + " + \(trusted.count) paired, "
                + (configuration.requireBond ? "bonded peripherals only" : "unbonded peripherals allowed (lab)")
                + (configuration.uplink.endpoint.map { ", uplink \($0)" } ?? ", store only (no uplink endpoint)"))
        if configuration.peripherals.isEmpty && trusted.isEmpty && !configuration.allowAnySyncPeripheral {
            log.log(
                .warning,
                "nothing to sync yet: no peripheral is listed in the config or paired (ferry pair --address ADDR "
                    + "--db \(dbPath)); paired ones are picked up while running")
        }
        await withTaskCancellationHandler {
            await schedulingLoop()
        } onCancel: {
            Task { await self.beginStop() }
        }
        await shutdown(forwarder: forwarder)
        liveViewFile.remove()  // no daemon, no live view: `ferry status` says it is not running
        storageWatch.cancel()
        await storageWatch.value
        if let unrecoverable { throw unrecoverable }
    }

    private func beginStop() {
        guard !stopping else { return }
        stopping = true
        wakeup.signal()
        log.log(.notice, "stopping: committing and acknowledging what is staged in \(sessions.count) sessions")
        for session in sessions.values {
            if let control = session.control {
                control.yield(.stop)
            } else {
                session.task.cancel()  // still connecting: nothing staged yet
            }
        }
    }

    private func shutdown(forwarder: Task<Void, Never>?) async {
        beginStop()
        await waitForSessionsToFinish(within: configuration.shutdownGraceSeconds)
        if !sessions.isEmpty {
            log.log(
                .warning,
                "stop: \(sessions.count) sessions did not finish within \(configuration.shutdownGraceSeconds) s; "
                    + "their uncommitted frames were not acknowledged and will be replayed")
            for session in sessions.values { session.task.cancel() }
        }
        health?.forget(.forwarder)
        forwarder?.cancel()
        await forwarder?.value
        let t = totals
        log.log(
            .notice,
            "stopped: \(t.sessions) sessions (\(t.caughtUp) caught up, \(t.failed) failed), \(t.framesStored) frames "
                + "stored, \(t.gaps) gaps, \(t.regressions) regressions")
    }

    // MARK: scheduling

    /// The longest the loop sleeps with nothing due: each turn is the scheduler's watchdog heartbeat (a loop
    /// stuck in an await stops beating, so the pings stop), and re-reads the trusted peripherals (a `ferry pair`
    /// in another process sends no event), the live view (10 s) and the bus probe (10 s).
    static let heartbeatSeconds: Double = 5

    /// One turn reconciles everything (bus, adapter, candidates, due sessions, recovery, status) and then sleeps
    /// until the earliest of: the scheduler's `nextWakeup`, adapter recovery's `nextTick`, a power-on retry, the
    /// heartbeat — or until woken by an event (`wakeup`): a session attached or ended, a relevant BlueZ change
    /// (adapter, bond, a Sync peripheral appearing, bluetoothd restarting), a reload, the storage gate opening,
    /// a stop. No polling: with nothing due the daemon sleeps.
    private func schedulingLoop() async {
        var client: BlueZClient?
        var adapter: BlueZAdapter?
        var discoveryLease: DiscoveryLease?
        var agent: BlueZAgent?
        var lastWarning = ""
        var lastPowerAttempt = -Double.infinity
        func warnOnce(_ message: String) {
            if message != lastWarning { log.log(.warning, message) }
            lastWarning = message
        }
        var lastBusProbe = -Double.infinity
        await withDiscardingTaskGroup { group in
            while !stopping && !Task.isCancelled {
                let now = clock.now()
                var powerRetryAt: Double?
                health?.beat(.scheduler)
                if let client, now - lastBusProbe >= 10 {
                    lastBusProbe = now
                    probeBus(client)
                }
                if client == nil {
                    do {
                        let connected = try await BlueZClient(
                            connection: try await connectBus(), discoveryServiceUUIDs: [SyncProfile.serviceUUID],
                            log: { [log] in log.log(.debug, $0) })
                        client = connected
                        // BlueZ changes the loop acts on wake it; the rest (RSSI, advertising data) does not.
                        let events = await connected.objects.events(where: Self.wakesTheLoop)
                        let wakeup = self.wakeup
                        group.addTask {
                            for await _ in events { wakeup.signal() }
                        }
                        agent = await registerAgent(connected)
                    } catch let error as BlueZError {
                        // The bus answered; bluetoothd (or its reply) did not.
                        warnOnce("cannot read bluetoothd's objects: \(error); retrying")
                    } catch {
                        warnOnce("cannot reach the D-Bus system bus: \(error); retrying")
                    }
                }
                if let client, adapter == nil {
                    do {
                        adapter = try await client.adapter(named: configuration.adapter)
                        log.log(.info, "using adapter \(adapter!.name)")
                        health?.markReady()  // the store is open (run() opened it first) and the adapter is found
                        lastWarning = ""
                    } catch {
                        warnOnce("waiting for a Bluetooth adapter: \(error)")
                    }
                }
                if let client, let adapter {
                    let powered = await adapter.isPowered()
                    metrics?.adapter(powered: powered)
                    if !powered {
                        if await client.objects.isServiceAvailable {
                            if now - lastPowerAttempt > 10 {
                                lastPowerAttempt = now
                                log.log(.notice, "adapter \(adapter.name) is powered off: powering it on")
                                do { try await adapter.setPowered(true) } catch {
                                    log.log(.warning, "cannot power on \(adapter.name): \(error)")
                                }
                            }
                            powerRetryAt = lastPowerAttempt + 10.001
                        }
                    } else {
                        // Lab mode keeps discovery running so new Sync peripherals show up; BlueZDiscovery restarts
                        // it by itself after a bluetoothd restart. The allowlist mode discovers per connect only.
                        if configuration.allowAnySyncPeripheral && discoveryLease == nil {
                            discoveryLease = try? await client.discovery(on: adapter).acquire()
                        } else if !configuration.allowAnySyncPeripheral, let lease = discoveryLease {
                            await lease.release()
                            discoveryLease = nil
                        }
                        await refreshTrusted(force: false)
                        await refreshCandidates(client: client, adapter: adapter)
                        for address in storageSignals.sessionsAllowed ? scheduler.due(now: now) : [] {
                            guard let policy = configuration.policy(for: address, trusted: trusted) else { continue }
                            if let refusal = await bondRefusal(address, client: client, adapter: adapter) {
                                await refuse(address, refusal)
                                continue
                            }
                            if refusals.removeValue(forKey: address) != nil {
                                log(for: address).log(.notice, "bonded now; syncing it")
                            }
                            start(policy, client: client, adapter: adapter)
                        }
                    }
                }
                if adapter == nil { metrics?.adapter(powered: false) }
                if let client, await client.objects.isServiceAvailable {
                    // Only while bluetoothd is there: its absence is not the controller's fault (BlueZClient waits).
                    let usable: Bool
                    if let adapter { usable = await adapter.isPowered() } else { usable = false }
                    _ = recovery.adapter(usable: usable, now: now)
                    // The adapter object vanished (controller gone from the kernel, bluetoothd dropped it): look it
                    // up afresh next time, a power cycle or reset may bring it back under the same name.
                    if let current = adapter, await client.objects.properties(current.path, BlueZInterface.adapter) == nil {
                        adapter = nil
                    }
                }
                let action = recovery.tick(now: now, peripheralsDue: !scheduler.peripherals.isEmpty)
                await recover(action, client: client, adapter: adapter, adapterName: adapter?.name ?? configuration.adapter)
                publishStatus(adapter: adapter?.name)
                publishLiveView(adapter: adapter?.name)

                // Due times in the past are what the turn could not act on (no free slot, storage gate closed, bond
                // missing, adapter off): each of those ends with an event, so they must not spin the loop.
                let after = clock.now()
                var next = after + Self.heartbeatSeconds
                for due in [scheduler.nextWakeup(now: after), recovery.nextTick(), powerRetryAt] {
                    if let due, due > after { next = min(next, due) }
                }
                if client == nil { next = min(next, after + 1) }  // the bus is not there yet: retry every second
                // 1 ms late rather than early: a turn just before a due time would act on nothing and turn again.
                await wakeup.wait(timeout: .seconds(next - after) + .milliseconds(1))
            }
            group.cancelAll()
        }
        await discoveryLease?.release()
        await agent?.unregister()
    }

    /// Whether a BlueZ change can change what the loop does: the adapter (appeared, gone, powered), bluetoothd
    /// (restarted), a device's bond, or a Sync peripheral appearing (lab mode). Discovery's RSSI and advertising
    /// updates, many per second, do not wake it.
    static func wakesTheLoop(_ event: BlueZObjectEvent) -> Bool {
        switch event {
        case .serviceAppeared, .serviceVanished:
            return true
        case .interfacesAdded(_, let interfaces):
            if interfaces[BlueZInterface.adapter] != nil { return true }
            guard let device = interfaces[BlueZInterface.device] else { return false }
            return device["Bonded"]?.bool == true || device["Paired"]?.bool == true
                || (device["UUIDs"]?.stringArray ?? []).contains { $0.lowercased() == SyncProfile.serviceUUID }
        case .interfacesRemoved(_, let interfaces):
            return interfaces.contains(BlueZInterface.adapter)
        case .propertiesChanged(_, let interface, let changed, let invalidated):
            let keys = Set(changed.keys).union(invalidated)
            switch interface {
            case BlueZInterface.adapter: return keys.contains("Powered")
            case BlueZInterface.device: return !keys.isDisjoint(with: ["Bonded", "Paired", "UUIDs"])
            default: return false
            }
        }
    }

    // MARK: adapter recovery

    /// Carries out what AdapterRecovery asked for, logging and counting every step.
    private func recover(_ action: AdapterRecovery.Action, client: BlueZClient?, adapter: BlueZAdapter?, adapterName: String?) async {
        switch action {
        case .none:
            break
        case .recovered(let step):
            metrics?.adapterRecovered()
            metrics?.adapter(wedged: false)
            log.log(.notice, "adapter recovery: connects work again after the \(String(step.rawValue.map { $0 == "_" ? " " : $0 }))")
        case .givingUp(let until):
            metrics?.adapter(wedged: true)
            log.log(
                .warning,
                "adapter recovery: connects still fail after a power cycle and an HCI reset; the peripherals may all "
                    + "be out of range or off. Not restarting for that; trying again in "
                    + "\(Int((until - clock.now()).rounded())) s")
        case .perform(let step, let evidence):
            metrics?.adapter(wedged: true)
            metrics?.adapterRecoveryStep(step)
            let name = adapterName ?? "hci0"
            var controllerFailed = false
            let why =
                switch evidence {
                case .adapterUnusable:
                    "adapter \(name) missing or not powered for \(Int(configuration.adapterRecovery.adapterMissingSeconds)) s"
                case .controllerUnresponsive: "\(name) did not answer the last recovery step and connects still fail"
                case .connectsFailing: "every connect failed for \(Int(configuration.adapterRecovery.wedgedAfterSeconds)) s"
                }
            switch step {
            case .powerCycle:
                log.log(.warning, "adapter recovery: \(why): power cycling \(name) through bluetoothd")
                if let adapter {
                    controllerFailed = await !powerCycle(adapter)
                } else {
                    log.log(.warning, "adapter recovery: \(name) is not on bluetoothd's bus: nothing to power cycle")
                }
            case .hciReset:
                log.log(
                    .warning,
                    "adapter recovery: \(why): resetting \(name) through the kernel (HCI reset: down, then up)")
                await quiesceForKernelReset(name)
                let failure = await Self.kernelSwitch(.down, adapterName: name)
                if let failure {
                    log.log(.warning, "adapter recovery: \(failure)")
                    controllerFailed = !failure.isPermission
                    // Not down (no CAP_NET_ADMIN): bluetoothd's power cycle is what is left to try.
                    if let adapter, !(await powerCycle(adapter)) { controllerFailed = true }
                } else {
                    log.log(.notice, "adapter recovery: \(name) taken down through the kernel")
                    try? await Task.sleep(for: .seconds(1))
                    // Powering on sends HCI_Reset first, then the configuration of a boot; through bluetoothd so
                    // that it rebuilds its own view too, through the kernel when bluetoothd cannot.
                    if !(await powerOn(adapter, name: name)) { controllerFailed = true }
                }
            case .exit:
                log.log(
                    .error,
                    "adapter recovery: \(why) after a power cycle"
                        + (configuration.adapterRecovery.hciReset ? " and an HCI reset" : "")
                        + ": exiting non-zero so the service manager restarts ferry")
                unrecoverable = AdapterUnrecoverable(adapter: name)
                beginStop()
            }
            _ = recovery.stepFinished(now: clock.now(), controllerFailed: controllerFailed)
        }
    }

    /// Waits (bounded by the connect timeout) for the sessions in flight to end before the kernel takes the
    /// controller down; the loop starts no new ones meanwhile. Connection attempts pending in the kernel when
    /// it drops a controller's links can crash it (measured in the test bed, Debian 12's 6.1 kernel: an oops in
    /// hci_chan_del as bluetoothd released the socket of a pending LE connect, taking bluetoothd down with it).
    private func quiesceForKernelReset(_ name: String) async {
        guard !sessions.isEmpty else { return }
        log.log(.info, "adapter recovery: waiting for the sessions in flight (\(sessions.count)) to end before resetting \(name)")
        await waitForSessionsToFinish(within: configuration.connectTimeoutSeconds + 10)
        if !sessions.isEmpty {
            log.log(.warning, "adapter recovery: sessions still running (\(sessions.count)); resetting \(name) anyway")
        }
    }

    /// HCIDEVDOWN / HCIDEVUP off the actor: the ioctl blocks while the kernel switches the controller.
    private static func kernelSwitch(_ operation: HCIDevice.Operation, adapterName: String) async -> HCIDevice.Failure? {
        await runOnOwnThread(name: "ferry-hci-\(operation.rawValue)") { () -> HCIDevice.Failure? in
            do throws(HCIDevice.Failure) { try HCIDevice.set(operation, adapterName: adapterName) } catch { return error }
            return nil
        }
    }

    /// Powers the controller on after the kernel took it down: through bluetoothd, or with the kernel's own
    /// HCIDEVUP when bluetoothd has no adapter object or refuses. True when it came up.
    private func powerOn(_ adapter: BlueZAdapter?, name: String) async -> Bool {
        if let adapter {
            do {
                try await adapter.setPowered(true)
                log.log(.notice, "adapter recovery: \(name) powered on again")
                return true
            } catch {
                log.log(.warning, "adapter recovery: powering \(name) on through bluetoothd failed: \(error)")
            }
        }
        if let failure = await Self.kernelSwitch(.up, adapterName: name) {
            log.log(.warning, "adapter recovery: \(failure)")
            return false
        }
        log.log(.notice, "adapter recovery: \(name) brought up through the kernel")
        return true
    }

    /// Powered off, 1 s, on. The power-on is tried even when the power-off failed: a wedged controller may
    /// refuse the first (measured in the test bed: "Authentication Failed" after the kernel's command timeouts)
    /// and still be brought back by the HCI_Reset the kernel sends when powering on.
    /// True when both halves worked.
    private func powerCycle(_ adapter: BlueZAdapter) async -> Bool {
        var ok = true
        do {
            try await adapter.setPowered(false)
        } catch {
            ok = false
            log.log(.warning, "adapter recovery: powering \(adapter.name) off failed: \(error)")
        }
        try? await Task.sleep(nanoseconds: 1_000_000_000)
        do {
            try await adapter.setPowered(true)
            log.log(.notice, "adapter recovery: \(adapter.name) powered " + (ok ? "off and on again" : "on"))
        } catch {
            ok = false
            log.log(.warning, "adapter recovery: powering \(adapter.name) on failed: \(error)")
        }
        return ok
    }

    // MARK: supervision

    /// A round trip to the bus daemon through the connection thread: its reply is the D-Bus part's heartbeat
    /// (an idle connection thread sleeps in poll(), so only a request proves it still turns). Not awaited by
    /// the loop, so a wedged bus shows up as a stale `dbus` part rather than a stuck scheduler.
    private func probeBus(_ client: BlueZClient) {
        guard let health else { return }
        health.expect(.dbus)
        let connection = client.connection
        Task {
            if (try? await connection.call(
                destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                member: "GetId", timeout: .seconds(20))) != nil
            {
                health.beat(.dbus)
            }
        }
    }

    /// systemd's STATUS= line: slots in use and the known peripheral backlog (as of each one's last session).
    private func publishStatus(adapter: String?) {
        guard let health else { return }
        guard let adapter else {
            health.setStatus("waiting for a Bluetooth adapter" + (configuration.adapter.map { " (\($0))" } ?? ""))
            return
        }
        let states = scheduler.peripherals.values
        let backlog = states.reduce(UInt64(0)) { $0 &+ ($1.backlog ?? 0) }
        let behind = states.filter { ($0.backlog ?? 0) > 0 }.count
        health.setStatus(
            "\(sessions.count) of \(configuration.maxConnections) slots in use, \(states.count) peripherals, "
                + "backlog \(backlog) frames" + (behind > 0 ? " on \(behind)" : "") + ", adapter \(adapter)")
    }

    /// The live view for `ferry status` (GatewayMetrics.swift): rewritten when slots or sessions change and
    /// at least every 10 s (so a reader can tell a running daemon from a file left behind). A small file
    /// written in place of the old one; a failure is logged once and the daemon carries on.
    private func publishLiveView(adapter: String?) {
        let now = clock.now()
        let view = LiveView(
            pid: getpid(), updatedAt: 0, adapter: adapter, slotsInUse: sessions.count,
            maxConnections: configuration.maxConnections,
            sessions: sessions.sorted { $0.key.string < $1.key.string }.map { address, session in
                LiveView.Session(
                    peripheral: address.string,
                    phase: session.control == nil ? "connecting" : (session.staysConnected ? "live" : "syncing"),
                    seconds: 0)
            }, adapterRecovery: recovery.phase)
        if let written = liveViewWritten, written.view == view, now - written.at < 10 { return }
        var stamped = view
        stamped.updatedAt = SystemWallClock().nowMillis()
        for (i, address) in sessions.keys.sorted(by: { $0.string < $1.string }).enumerated() {
            stamped.sessions[i].seconds = ((now - (sessions[address]?.startedAt ?? now)) * 10).rounded() / 10
        }
        do {
            try liveViewFile.write(stamped)
            liveViewWritten = (view, now)
        } catch {
            if liveViewWritten != nil || now - (liveViewFailedAt ?? -.infinity) > 3600 {
                log.log(.warning, "cannot write the live view \(liveViewFile.path): \(error)")
                liveViewFailedAt = now
            }
            liveViewWritten = nil
        }
    }

    private func refreshCandidates(client: BlueZClient, adapter: BlueZAdapter) async {
        var candidates = Set(configuration.peripherals.map(\.address)).union(trusted)
        if configuration.allowAnySyncPeripheral {
            for device in await client.objects.snapshot.devices(under: adapter.path) {
                guard device.properties.offers(service: SyncProfile.serviceUUID),
                    let text = device.properties.address, let address = PeripheralAddress(text)
                else { continue }
                if scheduler.peripherals[address] == nil { log(for: address).log(.info, "discovered (lab mode)") }
                candidates.insert(address)
            }
        }
        scheduler.setCandidates(candidates)
    }

    // MARK: link security

    /// The store's trusted peripherals, re-read at most every 5 s (or now, with `force`).
    private func refreshTrusted(force: Bool) async {
        let now = clock.now()
        guard force || now - trustedReadAt >= 5, let registry else { return }
        trustedReadAt = now
        do {
            let fresh = Set(try await registry.read { try $0.trustedPeripherals().map(\.address) })
            for address in fresh.subtracting(trusted) where !force {
                log(for: address).log(.notice, "paired (trusted peripherals); will sync it")
            }
            for address in trusted.subtracting(fresh) {
                log(for: address).log(.notice, "unpaired (removed from trusted peripherals)")
                if configuration.policy(for: address, trusted: fresh) == nil { sessions[address]?.control?.yield(.stop) }
            }
            trusted = fresh
        } catch {
            log.log(.error, "cannot read trusted peripherals: \(error)")
        }
    }

    /// Why `address` must not be connected under the bond policy, or nil. Checked before connecting: a
    /// clear-link access to a Sync characteristic that needs encryption makes bluetoothd pair by itself (Just
    /// Works bonds silently), so the gateway, not BlueZ, has to say no. Bonded devices are loaded by
    /// bluetoothd at start, so the check needs no radio.
    private func bondRefusal(_ address: PeripheralAddress, client: BlueZClient, adapter: BlueZAdapter) async -> BondRefusal? {
        guard configuration.requireBond else { return nil }
        let device = await client.knownDevice(address: address.string, on: adapter)
        if let device, await device.isBonded() { return nil }
        return bondMissing(address)
    }

    /// Why a peripheral BlueZ holds no key for is refused (before connecting, or found after connecting).
    private func bondMissing(_ address: PeripheralAddress) -> BondRefusal {
        trusted.contains(address) ? .bondLost(address) : .notBonded(address)
    }

    /// The daemon's log with `address` in its metadata (lines read "ADDRESS: message").
    private func log(for address: PeripheralAddress) -> Logger { Logger(sink: log).with(peripheral: address.string) }

    private func refuse(_ address: PeripheralAddress, _ why: BondRefusal) async {
        guard refusals[address] != why else { return }
        refusals[address] = why
        log(for: address).log(.warning, "\(why)")
        let result = why.result
        _ = try? await registry?.read { try $0.recordSessionEnd(peripheral: address, result: result, epoch: nil, head: nil) }
    }

    /// The daemon's Agent1: refuses every request. Pairing is an explicit operator action (`ferry pair`); an
    /// agent must still exist, or pairing bluetoothd starts by itself would hang its caller until timeout.
    private func registerAgent(_ client: BlueZClient) async -> BlueZAgent? {
        let log = self.log
        let policy = BlueZAgentPolicy(
            authorize: { _ in false },
            observe: { request in
                switch request {
                case .passkeyRequested(let device), .confirmationRequested(let device, _),
                    .authorizationRequested(let device):
                    log.log(
                        .warning,
                        "\(BlueZAgent.address(ofDevicePath: device)): bluetoothd asked to pair: refused (pairing is "
                            + "an explicit operator action: ferry pair)")
                default: break
                }
            })
        do {
            return try await BlueZAgent.register(
                client: client, path: "/ferry/agent", capability: .noInputNoOutput, policy: policy, makeDefault: true,
                log: { log.log(.debug, $0) })
        } catch {
            log.log(.warning, "cannot register the pairing agent: \(error) (pairing requests will time out)")
            return nil
        }
    }

    private func start(_ requested: PeripheralPolicy, client: BlueZClient, adapter: BlueZAdapter) {
        let policy = slotFairPolicy(requested)
        scheduler.started(policy.address, now: clock.now())
        totals.sessions += 1
        let settings = SessionSettings(
            policy: policy, configuration: configuration.sessionConfiguration, databasePath: configuration.databasePath,
            connectTimeout: configuration.connectTimeoutSeconds, discoveryTimeout: configuration.discoveryTimeoutSeconds,
            diskBudgetBytes: effectiveDiskBudget,
            requireBond: configuration.requireBond, counters: SessionCounters(metrics: metrics, outbox: outboxWakeup))
        let log = self.log
        let clock = self.clock
        let task = Task {
            let result = await SlotSession(settings: settings, client: client, adapter: adapter, sink: log, clock: clock)
                .run(register: { events in await self.attach(policy.address, events) })
            await self.finished(policy.address, result)
        }
        sessions[policy.address] = ActiveSession(
            task: task, staysConnected: policy.stayConnected, control: nil, startedAt: clock.now())
        metrics?.slotsInUse(sessions.count)
    }

    /// `policy`, or its sync-and-release form when a stay-connected session now would leave the sync-and-release
    /// peripherals without a slot (`SyncScheduler.grantsStayConnected`).
    private func slotFairPolicy(_ policy: PeripheralPolicy) -> PeripheralPolicy {
        guard policy.stayConnected else { return policy }
        let granted = SyncScheduler.grantsStayConnected(
            activeStayConnected: sessions.values.filter(\.staysConnected).count,
            maxConnections: configuration.maxConnections, candidates: scheduler.peripherals.count)
        if granted { return policy }
        log.log(
            .info,
            "\(policy.address): stay_connected, but the other stay-connected sessions already hold all but one of "
                + "\(configuration.maxConnections) slots: syncing it and releasing the slot this time")
        var released = policy
        released.stayConnected = false
        return released
    }

    /// A session got its link: from now on a stop is delivered as `.stop`. Returns false if the daemon is
    /// stopping (the session then disconnects without starting).
    private func attach(_ address: PeripheralAddress, _ events: LinkEvents) -> Bool {
        sessions[address]?.control = events
        wakeup.signal()  // the live view's phase changed
        return !stopping && configuration.policy(for: address, trusted: trusted) != nil
    }

    /// Returns when every session has finished, or after `seconds`. Woken by `finished`, not by polling.
    private func waitForSessionsToFinish(within seconds: Double) async {
        guard !sessions.isEmpty else { return }
        // The deadline's timer is an unstructured task: this runs in the cancelled task (SIGTERM cancels
        // `run`), where a sleep of its own would return at once.
        let deadline = Task { [weak self] in
            try? await Task.sleep(for: .seconds(max(0, seconds)))
            await self?.resumeDrainWaiters()
        }
        await withCheckedContinuation { drainWaiters.append($0) }
        deadline.cancel()
    }

    private func resumeDrainWaiters() {
        let waiting = drainWaiters
        drainWaiters = []
        for waiter in waiting { waiter.resume() }
    }

    private func finished(_ address: PeripheralAddress, _ result: SessionResult) async {
        sessions[address] = nil
        wakeup.signal()  // a slot is free, and the scheduler's due times moved
        if sessions.isEmpty { resumeDrainWaiters() }
        if result.connectSeconds != nil || result.summary != nil {
            let action = recovery.connectSucceeded(now: clock.now())
            if action != .none { Task { await self.recover(action, client: nil, adapter: nil, adapterName: nil) } }
        } else if result.connectFailed {
            _ = recovery.connectFailed(now: clock.now())
        }
        metrics?.sessionEnded(result)
        metrics?.slotsInUse(sessions.count)
        scheduler.finished(address, outcome: result.outcome, now: clock.now())
        switch result.outcome {
        case .caughtUp: totals.caughtUp += 1
        case .failed: totals.failed += 1
        case .interrupted: break
        }
        if let s = result.summary {
            if s.backpressure { storageSignals.nudge(s.diskFull ? .diskFull : .overBudget) }
            totals.framesStored += s.framesStored
            totals.gaps += s.gapsRecorded
            totals.regressions += s.regressions
        }
        if case .failed = result.outcome, let state = scheduler.peripherals[address] {
            let wait = max(0, state.notBefore - clock.now())
            log(for: address).log(
                .info,
                "backing off \(cFormat("%.1f", wait)) s after \(state.consecutiveFailures) "
                    + "consecutive failures")
        }
        if result.bondMissingAfterConnect {
            // Refused and reported, never re-paired: pairing is the operator's act (ferry pair).
            await refuse(address, bondMissing(address))
        }
    }

    /// The storage watch (StoragePressure.swift) with the configured budget, or the default one logged.
    private func startStorageWatch(databasePath: String) -> Task<Void, Never> {
        let budget = configuration.diskBudgetBytes ?? GatewayStore.defaultDiskBudget(forStoreAt: databasePath)
        effectiveDiskBudget = budget
        metrics?.diskBudget(budget)
        log.log(
            .info,
            "storage: disk budget \(budget) bytes"
                + (configuration.diskBudgetBytes == nil
                    ? " (default: half the room the store had at start, at most 1 GiB; set disk_budget_bytes)" : "")
                + ", delivered events kept \(cFormat("%g", configuration.retentionHours)) h")
        let scheduler = self.scheduler
        let watch = StorageWatch(
            databasePath: databasePath, budget: budget, signals: storageSignals, log: log, clock: clock,
            backoff: { scheduler.backoff(afterFailures: $0) })
        return Task { await watch.run() }
    }

    static func isDiskFull(_ error: any Error) -> Bool {
        switch error {
        case StoreError.sqlite(let e): e.isFull
        case let e as SQLiteError: e.isFull
        default: false
        }
    }

    private func startForwarder(databasePath: String) throws -> Task<Void, Never>? {
        let uplink = configuration.uplink
        guard let endpointText = uplink.endpoint, let endpoint = URL(string: endpointText) else { return nil }
        var forwarding = ForwarderConfiguration(gatewayID: uplink.gatewayID ?? ProcessInfo.processInfo.hostName)
        forwarding.maxInFlight = uplink.maxInFlight
        forwarding.limits.maxEvents = uplink.batchEvents
        forwarding.policy.maxRetries = uplink.maxRetries
        forwarding.retentionSeconds = configuration.retentionHours * 3600
        forwarding.leaseSeconds = max(120, 4 * Double(uplink.timeoutSeconds))  // outlives any one request
        forwarding.newEvents = outboxWakeup
        var http = UplinkHTTPConfiguration(
            endpoint: endpoint, requestTimeoutSeconds: uplink.timeoutSeconds,
            compression: .whenAdvertised(minimumBytes: 1024), maximumConnections: uplink.maxInFlight)
        (http.caFile, http.clientCertificateFile, http.clientKeyFile) = (uplink.caFile, uplink.clientCert, uplink.clientKey)
        let poster = try UplinkHTTPPoster(configuration: http)
        let tokenFile = uplink.tokenFile.map { TokenFile(path: $0) }
        let log = self.log
        health?.expect(.forwarder)
        let health = self.health
        let storageSignals = self.storageSignals
        let clock = self.clock
        let eventsDelivered = LockedValue(0)
        forwarding.onProgress = { report in
            health?.beat(.forwarder)
            // A new count (each forwarder run counts from 0): something went out that storage pressure may prune.
            if eventsDelivered.withLock({ last in defer { last = report.eventsDelivered }; return last != report.eventsDelivered }),
                report.eventsDelivered > 0
            {
                storageSignals.delivered()
            }
        }
        return Task {
            // The forwarder only ends on a store error; it is restarted so a transient error (disk full,
            // locked file) does not silently stop the uplink for the rest of the daemon's life.
            var lastError = ""
            while !Task.isCancelled {
                let started = clock.now()
                do {
                    let forwarder = try OutboxForwarder(
                        databasePath: databasePath, poster: poster, configuration: forwarding,
                        tokenSource: { try tokenFile?.read() }, log: log)
                    _ = try await forwarder.run(untilEmpty: false)
                } catch {
                    if Task.isCancelled { break }
                    // No room for a claim or an acknowledgement: the storage watch makes room (its reserve, the
                    // WAL's own blocks), or nothing would ever be delivered and so nothing could be pruned.
                    if Self.isDiskFull(error) { storageSignals.nudge(.diskFull) }
                    // Said once per cause while it keeps failing at once: another forwarder holding the store's
                    // lease may do so for hours.
                    if clock.seconds(since: started) > 60 { lastError = "" }
                    if "\(error)" != lastError { log.log(.error, "uplink: stopped on \(error); retrying every 5 s") }
                    lastError = "\(error)"
                }
                health?.beat(.forwarder)  // restarting after an error is progress, not a hang
                try? await Task.sleep(nanoseconds: 5_000_000_000)
            }
        }
    }
}

/// What a session task needs; a value so the task does not reach back into the daemon for it.
struct SessionSettings: Sendable {
    var policy: PeripheralPolicy
    var configuration: SyncSession.Configuration
    var databasePath: String
    var connectTimeout: Double
    /// How long one connect looks for a peripheral BlueZ does not know, or waits for the adapter or bluetoothd.
    var discoveryTimeout: Double
    var diskBudgetBytes: Int64?
    var requireBond = true
    /// Counts frames and bytes as the session goes, and wakes the forwarder per commit.
    var counters: SessionCounters
}

/// What a daemon session reports as it goes: frames and bytes to the metrics (when on), and each commit to the
/// outbox forwarder, which sleeps until there is something new to send.
struct SessionCounters: SessionMetrics {
    var metrics: GatewayMetrics?
    var outbox: Wakeup

    func received(bytes: Int) { metrics?.received(bytes: bytes) }

    func stored(frames: Int) {
        metrics?.stored(frames: frames)
        outbox.signal()  // a commit may carry a gap event without frames
    }
}

struct SessionResult: Sendable {
    var outcome: SyncScheduler.Outcome
    var summary: SyncSummary?
    /// require_bond: the device was connected but BlueZ held no key for it (checked after the connect and
    /// again before the first GATT access). The session never touched the Sync service.
    var bondMissingAfterConnect = false
    /// Seconds from the start to a resolved Sync service, when the connect got that far (metrics).
    var connectSeconds: Double?
    /// Device1.Connect (with its discovery) failed: adapter recovery's evidence.
    var connectFailed = false
}

/// Adapter recovery ran out of steps with the adapter unusable: the daemon stopped so the service manager
/// restarts it (exit status 1).
public struct AdapterUnrecoverable: Error, CustomStringConvertible, Sendable {
    public var adapter: String
    public var description: String {
        "adapter \(adapter) unusable after a power cycle and an HCI reset; exiting so the service manager restarts ferry"
    }
}

/// One slot's work: the shared `SessionWorker` with the daemon's knobs, its failures and its end told as log
/// lines and a scheduler outcome. Everything it logs names the peripheral.
struct SlotSession: Sendable {
    let settings: SessionSettings
    let client: BlueZClient
    let adapter: BlueZAdapter
    /// The daemon's sink; `log` adds the peripheral to every line.
    let sink: any LogSink
    let clock: any MonotonicClock

    var address: PeripheralAddress { settings.policy.address }
    var log: Logger { Logger(sink: sink).with(peripheral: address.string) }

    func run(register: @Sendable (LinkEvents) async -> Bool) async -> SessionResult {
        var configuration = settings.configuration
        configuration.stayConnected = settings.policy.stayConnected
        var worker = SessionWorker.Settings(
            address: address, databasePath: settings.databasePath, configuration: configuration,
            diskBudgetBytes: settings.diskBudgetBytes, requireBond: settings.requireBond,
            waitTimeout: .secondsClamped(settings.discoveryTimeout),
            connectTimeout: .secondsClamped(settings.connectTimeout), resolveTimeout: .seconds(20))
        // The daemon's own scheduler backs off between sessions; inside one attempt keep retries short so a
        // dead peripheral does not hold a slot for minutes.
        worker.retry.configuration.maxTransientAttempts = 2
        worker.retry.configuration.maxResourceAttempts = 1
        worker.metrics = settings.counters
        let sessionWorker = SessionWorker(settings: worker, client: client, adapter: adapter, sink: sink, clock: clock)
        let session: SessionWorker.Session
        do {
            session = try await sessionWorker.open()
        } catch {
            switch error {
            case .connect(let error):
                if !Task.isCancelled { log.log(.warning, "connect failed: \(error)") }
                return Task.isCancelled
                    ? SessionResult(outcome: .interrupted(backlog: nil))
                    : SessionResult(outcome: .failed, connectFailed: true)
            case .bondMissingAfterConnect:
                log.log(.warning, "connected, but BlueZ holds no bond for it: disconnecting before any GATT access")
                return SessionResult(outcome: .failed, bondMissingAfterConnect: true)
            case .notSyncPeripheral(let missing):
                log.log(.warning, "not a Sync peripheral (\(missing))")
                return SessionResult(outcome: .failed)
            case .servicesUnresolved(let error):
                log.log(.warning, "services did not resolve: \(error)")
                return SessionResult(outcome: .failed)
            case .cannotStart(let error):
                log.log(.error, "cannot start a session: \(error)")
                return SessionResult(outcome: .failed)
            }
        }
        guard await register(session.events) else {
            await session.abandon()
            return SessionResult(outcome: .interrupted(backlog: nil))
        }
        log.log(
            .info,
            "connected in \(cFormat("%.2f", session.connectSeconds)) s"
                + (settings.policy.stayConnected ? " (stays connected for live events)" : ""))
        let report = await sessionWorker.run(session)
        let s = report.summary
        let rate = report.seconds > 0 ? Double(s.framesStored) / report.seconds : 0
        if let security = report.securityProblem {
            log.log(.warning, "\(security)")
        }
        log.log(
            report.outcome == .failed ? .warning : .notice,
            "sync \(s.end ?? .linkLost): \(s.framesStored) frames stored in "
                + cFormat("%.2f s (%.0f frames/s)", report.seconds, rate) + ", epoch \(s.epoch) cursor \(s.cursor)"
                + (report.knownHead.map { " head \($0)" } ?? "") + ", \(s.duplicates) duplicates, \(s.gapsRecorded) gaps, "
                + "\(s.regressions) regressions, \(s.corrupt) corrupt"
                + (s.backpressure ? "; store over its disk budget (backpressure)" : "")
                + " [via \(session.transport.notifyMethod?.rawValue ?? "none")]")
        return SessionResult(outcome: report.outcome, summary: s, connectSeconds: session.connectSeconds)
    }
}

/// State directory rules: created 0700; an existing one readable or writable by others is refused (the store
/// holds every event payload and the uplink's idempotency keys).
public enum StateDirectory {
    public static func prepare(_ path: String) throws {
        var info = stat()
        if stat(path, &info) != 0 {
            guard errno == ENOENT else { throw ConfigError(key: "state_dir", problem: "\(path): \(errnoDescription(errno))") }
            if let code = createDirectories(path, mode: 0o700) {
                throw ConfigError(key: "state_dir", problem: "cannot create \(path): \(errnoDescription(code))")
            }
            _ = chmod(path, 0o700)  // the umask may have narrowed it; never widened
            return
        }
        guard (info.st_mode & S_IFMT) == S_IFDIR else {
            throw ConfigError(key: "state_dir", problem: "\(path) exists and is not a directory")
        }
        if info.st_mode & 0o007 != 0 {
            throw ConfigError(
                key: "state_dir",
                problem: "\(path) is accessible by other users (mode \(String(info.st_mode & 0o777, radix: 8))); "
                    + "chmod 700 it: the store holds every event payload")
        }
    }
}

/// Why the daemon does not sync a peripheral under require_bond. Logged once per change (`description`) and
/// recorded as its `peripheral_sync_state.last_result`.
enum BondRefusal: Equatable, CustomStringConvertible {
    /// Paired with this gateway (trusted), but BlueZ holds no key for it any more.
    case bondLost(PeripheralAddress)
    /// Never paired with this gateway.
    case notBonded(PeripheralAddress)

    var result: SyncResult {
        switch self {
        case .bondLost: .refusedBondLost
        case .notBonded: .refusedNotBonded
        }
    }

    var description: String {
        switch self {
        case .bondLost(let address):
            "bond lost: paired with this gateway, but BlueZ holds no key for it any more; not syncing it "
                + "(require_bond). Re-pair explicitly: ferry unpair \(address), clear the bond on the peripheral, "
                + "ferry pair --address \(address)"
        case .notBonded(let address):
            "not bonded with this gateway: not syncing it (require_bond is on; pair it with "
                + "`ferry pair --address \(address)`, or set require_bond false in a lab)"
        }
    }
}
