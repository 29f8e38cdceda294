import FerryBlueZ
import FerryCore
import FerryProtocol
import FerryStore
import FerrySync

/// One sync session with one peripheral over BlueZ, the one sequence both `ferry run` (a daemon slot) and
/// `ferry sync` use: connect (with the connector's retries) → under require_bond, a bond check → resolve the
/// Sync service → the bond check again → store + `BlueZSyncTransport` + `SyncSessionRunner` → the runner under
/// `LiveSessionDriver` → a `Report`.
///
/// What differs between the two commands is knobs (`Settings`), hooks (phase marks, progress, registering the
/// event queue with the daemon between `open` and `run`) and how each words a failure: `Failure` is typed so
/// each says it its own way (a log line and a scheduler outcome, or a one-line error and an exit status).
public struct SessionWorker: Sendable {
    /// Largest window for which the session's own thread reads the notification socket (between commits) rather
    /// than a reader thread that hands each notification over. While the thread commits, notifications wait in the
    /// socket, and bluetoothd drops what does not fit (its end of the pair is non-blocking; the default 208 KiB
    /// send buffer holds in the order of 160 full-MTU notifications, estimated from the kernel's ~1.3 KiB charge per
    /// message): everything a window lets the peripheral send unacknowledged must fit, even at one frame per
    /// notification. A larger (pipelined) window keeps the reader thread, which drains the socket into
    /// the session's 4 MiB queue while a commit runs.
    static let maxWindowReadOnSessionThread: UInt16 = 64

    public struct Settings: Sendable {
        public var address: PeripheralAddress
        public var databasePath: String
        public var configuration: SyncSession.Configuration
        public var diskBudgetBytes: Int64?
        public var requireBond: Bool
        public var preferredNotify: GattNotifyMethod = .acquireNotify
        public var retry = ConnectRetryPolicy()
        /// How long the connector waits for the device object and for a link to settle.
        public var waitTimeout: Duration
        public var connectTimeout: Duration
        public var resolveTimeout: Duration
        /// `ferry sync --timeout`, a reading of the worker's `clock`: the connect and the resolve are also bounded
        /// by what is left until it when they start (at least 100 ms). nil: their own timeouts only (the daemon).
        public var deadline: Double?
        /// Level of the connector's own lines (its retries): the daemon keeps them at debug, `ferry sync` shows them.
        public var connectorLogLevel: LogLevel = .debug
        /// Counts frames and bytes as the session goes (nil: nobody counts).
        public var metrics: (any SessionMetrics)?
        /// The store at `databasePath`, already opened by the caller (`ferry sync` opens it before touching the
        /// radio): the session takes it instead of opening its own. nil: the session opens the store.
        public var openedStore: StoreHandoff?

        public init(
            address: PeripheralAddress, databasePath: String, configuration: SyncSession.Configuration,
            diskBudgetBytes: Int64?, requireBond: Bool, waitTimeout: Duration, connectTimeout: Duration,
            resolveTimeout: Duration
        ) {
            self.address = address
            self.databasePath = databasePath
            self.configuration = configuration
            self.diskBudgetBytes = diskBudgetBytes
            self.requireBond = requireBond
            self.waitTimeout = waitTimeout
            self.connectTimeout = connectTimeout
            self.resolveTimeout = resolveTimeout
        }
    }

    /// Why a session never started. The device is disconnected again in every case past `.connect`.
    public enum Failure: Error {
        /// Device1.Connect (after the connector's retries) failed, or the task was cancelled meanwhile.
        case connect(any Error)
        /// require_bond: connected, but BlueZ holds no bond for the device (checked after the connect and again
        /// before the first GATT access). The Sync service was never touched.
        case bondMissingAfterConnect
        case notSyncPeripheral(ServiceMissing)
        case servicesUnresolved(any Error)
        /// The store or the transport could not be opened.
        case cannotStart(any Error)
    }

    /// Points of `open` a caller may mark (`ferry sync`'s phases and progress line).
    public enum Step: Sendable {
        /// Device1.Connect succeeded (the bond is not checked yet).
        case connected
        /// The bond check passed; the Sync service is being resolved.
        case resolving
        case servicesResolved
    }

    /// A connected, resolved Sync link with its runner, ready to `run`.
    public struct Session {
        public let runner: SyncSessionRunner
        public let transport: BlueZSyncTransport
        /// The runner's event queue: a caller stops the session by yielding `.stop` (the daemon registers it).
        public let events: LinkEvents
        /// The session's own thread: its store connection lives there, and `run` drives the session there, so
        /// a commit's fsync (or a busy wait on another writer) never holds a thread of the cooperative pool.
        let thread: ThreadExecutor
        /// From the start of `open` to the resolved service, on the worker's clock.
        public let connectSeconds: Double

        /// Gives up an opened session without running it (the daemon is stopping): the link is released.
        public func abandon() async {
            events.finish()
            await transport.disconnect()
            thread.stop()
        }
    }

    /// How the session ended, classified once for both commands.
    public struct Report: Sendable {
        public var summary: SyncSummary
        /// The peripheral's head when known (STREAM_INFO), and how far the cursor is behind it.
        public var knownHead: UInt64?
        public var backlog: UInt64?
        /// What the scheduler makes of it.
        public var outcome: SyncScheduler.Outcome
        /// A clear sentence when the session ended on a security refusal (bond or encryption), else nil.
        public var securityProblem: String?
        /// Seconds the session ran (after `open`), on the worker's clock.
        public var seconds: Double
    }

    public let settings: Settings
    public let client: BlueZClient
    public let adapter: BlueZAdapter
    public let sink: any LogSink
    public let clock: any MonotonicClock

    public init(
        settings: Settings, client: BlueZClient, adapter: BlueZAdapter, sink: any LogSink,
        clock: any MonotonicClock = SystemMonotonicClock()
    ) {
        self.settings = settings
        self.client = client
        self.adapter = adapter
        self.sink = sink
        self.clock = clock
    }

    /// Connects, checks the bond, resolves the Sync service and opens the store and the transport.
    public func open(step: (Step) -> Void = { _ in }) async throws(Failure) -> Session {
        let started = clock.now()
        let address = settings.address
        var connector = DeviceConnector(client: client, adapter: adapter, address: address.string) {
            [sink, level = settings.connectorLogLevel] in sink.log(level, $0)
        }
        connector.waitTimeout = settings.waitTimeout
        var retry = settings.retry
        let device: BlueZDevice
        do {
            device = try await connector.connect(policy: &retry, connectTimeout: bounded(settings.connectTimeout))
        } catch {
            throw .connect(error)
        }
        step(.connected)
        // The bond checked before connecting may be gone now (removed by someone, or a different device
        // answered at the address): a clear-link GATT access would make bluetoothd pair by itself.
        try await refuseUnbonded(device)
        step(.resolving)
        let service: BlueZGattService
        do {
            // A late-exported STREAM_INFO is waited for by BlueZSyncTransport.
            service = try await device.resolveService(
                uuid: SyncProfile.serviceUUID, characteristicUUIDs: [SyncProfile.dataUUID, SyncProfile.controlUUID],
                timeout: bounded(settings.resolveTimeout))
        } catch {
            try? await device.disconnect()
            if let missing = error as? ServiceMissing { throw .notSyncPeripheral(missing) }
            throw .servicesUnresolved(error)
        }
        try await refuseUnbonded(device)
        step(.servicesResolved)
        let connectSeconds = clock.now() - started
        let events = LinkEvents()
        let thread = ThreadExecutor(name: "ferry-session")
        let store: GatewayStore
        let transport: BlueZSyncTransport
        do {
            let path = settings.databasePath
            let opened = settings.openedStore
            store = try await withTaskExecutorPreference(thread) { try opened?.take() ?? GatewayStore(path: path) }
            transport = try await BlueZSyncTransport(
                device: device, service: service, events: events, preferredNotify: settings.preferredNotify,
                readingOn: settings.configuration.window <= Self.maxWindowReadOnSessionThread ? thread : nil,
                log: sink)
        } catch {
            thread.stop()
            events.finish()
            try? await device.disconnect()
            throw .cannotStart(error)
        }
        let runner = SyncSessionRunner(
            peripheral: address, store: store, transport: transport, configuration: settings.configuration,
            clock: clock, log: sink, diskBudgetBytes: settings.diskBudgetBytes)
        runner.metrics = settings.metrics
        return Session(
            runner: runner, transport: transport, events: events, thread: thread,
            connectSeconds: connectSeconds)
    }

    /// Runs the session to its end and classifies it. `afterEvent` runs between events (a progress display).
    public func run(_ session: Session, afterEvent: (SyncSessionRunner) -> Void = { _ in }) async -> Report {
        let runner = session.runner
        let sessionStart = clock.now()
        // Everything the session does between awaits (decoding, the state machine, the store's commit) runs on
        // the session's thread; the awaits themselves (D-Bus calls, the next notification) leave it free.
        await LiveSessionDriver.run(
            runner: runner, events: session.events, clock: clock,
            thread: session.thread, afterEvent: afterEvent)
        session.thread.stop()
        session.events.finish()
        let s = runner.summary
        let head = runner.machine.knownHead
        let backlog = head.map { $0 > s.cursor ? $0 - s.cursor : 0 }
        return Report(
            summary: s, knownHead: head, backlog: backlog, outcome: SyncScheduler.Outcome(s, backlog: backlog),
            securityProblem: LinkSecurity.encryptionProblem(after: s), seconds: clock.now() - sessionStart)
    }

    private func bounded(_ timeout: Duration) -> Duration {
        guard let deadline = settings.deadline else { return timeout }
        return min(timeout, max(.milliseconds(100), clock.remaining(until: deadline)))
    }

    /// Under require_bond: returns if BlueZ holds a bond for the connected `device`; otherwise disconnects it.
    private func refuseUnbonded(_ device: BlueZDevice) async throws(Failure) {
        guard settings.requireBond, !(await device.isBonded()) else { return }
        try? await device.disconnect()
        throw .bondMissingAfterConnect
    }
}
