import FerryCore
import FerryProtocol

/// Decides which peripheral gets one of the gateway's few connection slots next. Pure: the daemon tells it
/// what happened (seen, started, finished) with a `now` from an injected monotonic clock, and asks it what
/// to start. No I/O, so the policy is unit-tested without a radio.
///
/// Policy (why in brackets):
/// - A peripheral is *due* when it is not in a session, not backing off, and either it was never synced
///   since the daemon started, its last session did not catch up (failed, or ended early with a backlog), or
///   `syncInterval` has passed since its last session ended [backlog grows while we are away; age bounds how
///   stale the backend can get].
/// - Among due peripherals: never synced first, then the largest known backlog (STREAM_INFO head − cursor),
///   then the oldest last sync [drain the fullest buffer first: it is the one closest to overflowing on the
///   peripheral].
/// - A failure (connect refused, link lost before catching up, no response) backs that peripheral off
///   exponentially, capped; a successful catch-up clears the backoff [one bad peripheral must not hog a slot
///   or spin the radio].
/// - A "stay connected" peripheral keeps its slot for as long as its session lasts [live events]; slots are
///   shared, so `maxConnections` must exceed the number of stay-connected peripherals or the others starve.
public struct SyncScheduler: Sendable {
    public struct Configuration: Sendable, Equatable {
        /// Concurrent sessions at most (a Pi's controller handles a few LE links well).
        public var maxConnections = 3
        /// Re-sync a caught-up peripheral after this many seconds.
        public var syncInterval: Double = 60
        /// First backoff after a failure, doubled per consecutive failure up to `backoffCap`.
        public var backoffBase: Double = 2
        public var backoffCap: Double = 300
        public init() {}
    }

    public enum Outcome: Sendable, Equatable {
        /// The session caught up (cursor == head).
        case caughtUp
        /// It ended before catching up but without a fault of the peripheral (daemon stopping, backpressure):
        /// `backlog` is what is left when known.
        case interrupted(backlog: UInt64?)
        /// Connect failed, link lost, no response: back off.
        case failed

        /// How a session that ran ends for the scheduler (the daemon's mapping; the simulations use it too).
        /// `backlog`: what the peripheral still holds beyond the cursor, when known.
        public init(_ summary: SyncSummary, backlog: UInt64?) {
            switch summary.end {
            case .disconnected(.caughtUp): self = .caughtUp
            // Ended to share the slot, not for a fault of the peripheral: back soon, by backlog priority.
            case .disconnected(.shutdown), .disconnected(.maxDurationReached): self = .interrupted(backlog: backlog)
            case _ where summary.backpressure: self = .interrupted(backlog: backlog)
            default: self = .failed
            }
        }
    }

    public struct PeripheralState: Sendable, Equatable {
        public var address: PeripheralAddress
        public var inSession = false
        /// Monotonic time the last session ended (nil: not synced since the daemon started).
        public var lastSessionEnd: Double?
        /// head − cursor as of the last session's end; nil when unknown.
        public var backlog: UInt64?
        /// The last session did not catch up (failed, or interrupted with a backlog or an unknown one): due
        /// again as soon as its backoff ends, not only after `syncInterval`.
        public var needsSync = true
        public var consecutiveFailures = 0
        /// Not started before this time (backoff).
        public var notBefore: Double = 0
    }

    public let configuration: Configuration
    public private(set) var peripherals: [PeripheralAddress: PeripheralState] = [:]
    /// Scales each backoff (full jitter in production: `Double.random(in: 0.5...1)`; 1 in tests).
    private let jitter: @Sendable () -> Double

    public init(configuration: Configuration = Configuration(), jitter: @escaping @Sendable () -> Double = { 1 }) {
        self.configuration = configuration
        self.jitter = jitter
    }

    public var activeCount: Int { peripherals.values.filter(\.inSession).count }

    /// The set of peripherals the daemon may sync (the allowlist, or what discovery found in lab mode).
    /// Known ones keep their history; removed ones are forgotten unless in a session (it runs to its end).
    public mutating func setCandidates(_ addresses: Set<PeripheralAddress>) {
        for address in addresses where peripherals[address] == nil {
            peripherals[address] = PeripheralState(address: address)
        }
        for (address, state) in peripherals where !addresses.contains(address) && !state.inSession {
            peripherals[address] = nil
        }
    }

    public mutating func addCandidate(_ address: PeripheralAddress) {
        if peripherals[address] == nil { peripherals[address] = PeripheralState(address: address) }
    }

    public func isDue(_ state: PeripheralState, now: Double) -> Bool {
        guard !state.inSession, now >= state.notBefore else { return false }
        guard let last = state.lastSessionEnd, !state.needsSync else { return true }
        return now - last >= configuration.syncInterval
    }

    /// The peripherals to start now, best first, at most the free slots. Does not mark them started.
    public func due(now: Double) -> [PeripheralAddress] {
        let free = configuration.maxConnections - activeCount
        guard free > 0 else { return [] }
        let ready = peripherals.values.filter { isDue($0, now: now) }
        return ready.sorted(by: Self.higherPriority).prefix(free).map(\.address)
    }

    static func higherPriority(_ a: PeripheralState, _ b: PeripheralState) -> Bool {
        switch (a.lastSessionEnd, b.lastSessionEnd) {
        case (nil, nil): return a.address < b.address
        case (nil, _): return true
        case (_, nil): return false
        case (let x?, let y?):
            let (ba, bb) = (a.backlog ?? 0, b.backlog ?? 0)
            if ba != bb { return ba > bb }
            if x != y { return x < y }
            return a.address < b.address
        }
    }

    public mutating func started(_ address: PeripheralAddress, now: Double) {
        addCandidate(address)
        peripherals[address]?.inSession = true
    }

    public mutating func finished(_ address: PeripheralAddress, outcome: Outcome, now: Double) {
        guard var state = peripherals[address] else { return }
        state.inSession = false
        state.lastSessionEnd = now
        switch outcome {
        case .caughtUp:
            state.backlog = 0
            state.needsSync = false
            state.consecutiveFailures = 0
            state.notBefore = now
        case .interrupted(let backlog):
            state.backlog = backlog
            state.needsSync = backlog != 0
            state.consecutiveFailures = 0
            // A short pause: an interrupted session (e.g. backpressure) must not be restarted in a tight loop.
            state.notBefore = now + configuration.backoffBase
        case .failed:
            state.needsSync = true
            state.consecutiveFailures += 1
            state.notBefore = now + backoff(afterFailures: state.consecutiveFailures)
        }
        peripherals[address] = state
    }

    /// Whether a stay-connected peripheral may keep its slot this session. A stay-connected session holds a
    /// slot for as long as its link lasts, so with `stay_connected_default` and at least `maxConnections`
    /// paired peripherals the others would never get one. Rule: when the candidates do not all fit into the
    /// slots, stay-connected sessions use at most `maxConnections - 1` of them; a stay-connected peripheral
    /// beyond that is synced the sync-and-release way this time (it drains and frees the slot), so every
    /// peripheral still gets synced through the remaining slot and live mode goes to as many as fit.
    public static func grantsStayConnected(activeStayConnected: Int, maxConnections: Int, candidates: Int) -> Bool {
        candidates <= maxConnections || activeStayConnected + 1 < maxConnections
    }

    /// Seconds to wait after `failures` consecutive failures (before jitter).
    public func backoff(afterFailures failures: Int) -> Double {
        Backoff.ceiling(
            base: configuration.backoffBase, cap: configuration.backoffCap, doublings: failures - 1, maxDoublings: 30)
            * jitter()
    }

    /// When the daemon should ask `due` again at the latest (nil: nothing can become due by time alone).
    public func nextWakeup(now: Double) -> Double? {
        var earliest: Double?
        for state in peripherals.values where !state.inSession {
            var at = state.notBefore
            if let last = state.lastSessionEnd, !state.needsSync {
                at = max(at, last + configuration.syncInterval)
            }
            earliest = min(earliest ?? at, at)
        }
        return earliest.map { max($0, now) }
    }
}
