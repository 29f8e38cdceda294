import FerryCore
import FerryProtocol
import FerryStore
import FoundationEssentials
import Glibc
import FerrySync

/// Whether the daemon may start sessions, given the store's space (issue 12: disk pressure that converges).
/// Pure: the storage watch tells it what it measured, and asks it when to measure next.
///
/// Open, it measures every `routineInterval` (a stat and three pragmas), or at once when a session was
/// refused for space. Over the budget or on a full disk it closes: no session starts, so the radio is not
/// churned by sessions that cannot commit, and every later check (which first makes room) comes after the
/// scheduler's exponential backoff — one backoff formula in the daemon. The first check that finds room
/// opens it again.
public struct StorageGate: Sendable, Equatable {
    public enum Pressure: Sendable, Equatable {
        case overBudget(used: Int64, budget: Int64)
        /// SQLITE_FULL, or less than `GatewayStore.freeSpaceFloorBytes` free on the store's file system.
        case diskFull(free: Int64?)
    }

    public enum State: Sendable, Equatable {
        case open
        case closed(Pressure, checks: Int, nextCheck: Double)
    }

    /// What changed: the watch logs `closed` and `reopened` (one line each way), `stillClosed` at debug level.
    public enum Transition: Sendable, Equatable {
        case closed(Pressure, retryIn: Double)
        case stillClosed(Pressure, retryIn: Double)
        case reopened(used: Int64)
    }

    public private(set) var state: State = .open
    public let routineInterval: Double
    private var nextRoutineCheck: Double = 0

    public init(routineInterval: Double = 5) {
        self.routineInterval = routineInterval
    }

    public var sessionsAllowed: Bool { state == .open }

    /// When `isCheckDue` turns true by time alone (the watch sleeps until then unless nudged).
    public var nextCheckAt: Double {
        switch state {
        case .open: nextRoutineCheck
        case .closed(_, _, let next): next
        }
    }

    /// A nudge (a session refused for space) makes an open gate check now; a closed one keeps its backoff, since
    /// no session it let start can be the cause.
    public func isCheckDue(now: Double, nudged: Bool) -> Bool {
        switch state {
        case .open: nudged || now >= nextRoutineCheck
        case .closed(_, _, let next): now >= next
        }
    }

    /// The uplink delivered events while the gate is closed: delivered events are what can be pruned, so the
    /// next check comes within `within` seconds instead of at the end of a backoff that grew while the uplink
    /// was offline (up to the scheduler's cap: minutes of idle radio after the backlog had already gone out).
    public mutating func delivered(now: Double, within: Double = 2) {
        guard case .closed(let pressure, let checks, let next) = state, next > now + within else { return }
        state = .closed(pressure, checks: checks, nextCheck: now + within)
    }

    /// `pressure` after the watch made what room it could (nil: under budget with free space). `backoff(n)` is
    /// the wait after the n-th consecutive check that found pressure.
    public mutating func measured(
        _ pressure: Pressure?, used: Int64, now: Double, backoff: (Int) -> Double
    ) -> Transition? {
        switch (state, pressure) {
        case (.open, nil):
            nextRoutineCheck = now + routineInterval
            return nil
        case (.open, let pressure?):
            let wait = backoff(1)
            state = .closed(pressure, checks: 1, nextCheck: now + wait)
            return .closed(pressure, retryIn: wait)
        case (.closed(_, let checks, _), let pressure?):
            let wait = backoff(checks + 1)
            state = .closed(pressure, checks: checks + 1, nextCheck: now + wait)
            return .stillClosed(pressure, retryIn: wait)
        case (.closed, nil):
            state = .open
            nextRoutineCheck = now + routineInterval
            return .reopened(used: used)
        }
    }
}

/// Shared between the daemon (reads `sessionsAllowed`, nudges when a session was refused for space) and its
/// storage watch task (writes them). Both sleep until something is due: a nudge wakes the watch, and the gate
/// opening wakes the daemon (`opened`), so neither polls the other.
final class StorageSignals: Sendable {
    enum Nudge: Sendable, Equatable {
        case overBudget
        case diskFull
    }

    private let allowed = LockedValue(true)
    private let pending = LockedValue<Nudge?>(nil)
    private let deliveredSinceCheck = LockedValue(false)
    /// Signalled by `nudge`: the watch's wake-up.
    let nudged = Wakeup()
    /// Signalled when sessions become allowed again: the daemon's wake-up.
    private let opened: Wakeup?

    init(opened: Wakeup? = nil) {
        self.opened = opened
    }

    var sessionsAllowed: Bool { allowed.withLock { $0 } }
    func setSessionsAllowed(_ value: Bool) {
        let reopened = allowed.withLock { current -> Bool in
            defer { current = value }
            return value && !current
        }
        if reopened { opened?.signal() }
    }

    /// A session was refused for space: no new session until the watch has checked (it sets the answer).
    func nudge(_ nudge: Nudge) {
        allowed.withLock { $0 = false }
        pending.withLock { if $0 != .diskFull { $0 = nudge } }
        nudged.signal()
    }

    /// A disk-full nudge the watch could not act on yet (its gate is closed and not due): kept for the next
    /// check, which must know that a write failed (that is when the reserve goes back).
    func keep(_ nudge: Nudge) {
        pending.withLock { if $0 != .diskFull { $0 = nudge } }
    }

    /// The uplink delivered events (the watch may have something to prune now).
    func delivered() {
        deliveredSinceCheck.withLock { $0 = true }
        // Only a closed gate acts on it (its next check comes sooner): wake the watch then, not for every batch.
        if !sessionsAllowed { nudged.signal() }
    }

    func takeDelivered() -> Bool {
        deliveredSinceCheck.withLock { value in
            defer { value = false }
            return value
        }
    }

    func takeNudge() -> Nudge? {
        pending.withLock { value in
            defer { value = nil }
            return value
        }
    }
}

/// The daemon's storage housekeeping, on its own connection and task so that a long prune on a slow SD card
/// never holds up the scheduling loop or a session's commit for long (each prune step is a short
/// transaction). Delivered-event retention is the forwarder's (`retention_hours`); this makes room when the
/// budget or the disk demands it.
struct StorageWatch: Sendable {
    let databasePath: String
    let budget: Int64
    let signals: StorageSignals
    let log: any LogSink
    let clock: any MonotonicClock
    /// The scheduler's backoff after n consecutive failures.
    let backoff: @Sendable (Int) -> Double

    /// Sleeps until the gate's next check is due or a session nudges it (`StorageSignals.nudged`); no polling.
    func run() async {
        var gate = StorageGate()
        // Its own connection on its own thread: a prune or checkpoint on a slow SD card blocks in sqlite3 for
        // seconds, which must not hold a thread of the cooperative pool (StoreConnection).
        var store: StoreConnection?
        var lastError = ""
        while !Task.isCancelled {
            var retryAt: Double?
            do {
                let opened: StoreConnection
                if let store { opened = store } else { opened = try await StoreConnection.open(path: databasePath, threadName: "ferry-storage") }
                store = opened
                let now = clock.now()
                let before = gate
                gate = try await opened.read { [self] in
                    var gate = before
                    try tick(now: now, gate: &gate, store: $0)
                    return gate
                }
                lastError = ""
            } catch {
                // A check that cannot run (file locked past the busy timeout, I/O error) changes nothing;
                // it is retried 5 s later, and logged once until it works again.
                let text = "\(error)"
                if text != lastError { log.log(.warning, "storage: cannot check the store: \(text)") }
                lastError = text
                store = nil
                retryAt = clock.now() + 5
            }
            let now = clock.now()
            var next = retryAt ?? gate.nextCheckAt
            // Closed on a full disk, `tick` folds the WAL in as the uplink's claims and acknowledgements come:
            // those are not signalled here, so that state keeps the half-second cadence it was measured with.
            if case .closed(.diskFull, _, _) = gate.state { next = min(next, now + 0.5) }
            await signals.nudged.wait(timeout: .seconds(max(0, next - now)) + .milliseconds(1))
        }
    }

    /// One turn of the watch: if a check is due (or a session was refused for space), measure, make room, and
    /// set whether sessions may start. Returns whether a check ran.
    @discardableResult
    func tick(now: Double, gate: inout StorageGate, store: GatewayStore) throws -> Bool {
        let nudge = signals.takeNudge()
        if signals.takeDelivered() { gate.delivered(now: now) }
        guard gate.isCheckDue(now: now, nudged: nudge != nil) else {
            // A nudge the closed gate does not act on must not leave sessions blocked by it.
            if nudge != nil { signals.setSessionsAllowed(gate.sessionsAllowed) }
            if nudge == .diskFull { signals.keep(.diskFull) }
            // Between checks on a full disk the uplink's claims and acknowledgements are the way out; folding
            // the WAL in as they come keeps it from eating the room the main file needs (measured: two batches
            // grew the WAL by the whole 128 KiB reserve, and then no checkpoint fit).
            if case .closed(.diskFull, _, _) = gate.state { _ = try? store.checkpointWALPassively() }
            return false
        }
        let (pressure, used) = try measure(
            store, sawDiskFull: nudge == .diskFull, wantHeadroom: nudge != nil || !gate.sessionsAllowed)
        if let transition = gate.measured(pressure, used: used, now: now, backoff: backoff) {
            report(transition)
        }
        signals.setSessionsAllowed(gate.sessionsAllowed)
        return true
    }

    /// Measures, and when short of room makes what room it can before judging. Hysteresis: once short of room
    /// (`wantHeadroom`: the gate is closed, or a session was just refused), sessions resume only with 10% of
    /// the budget free again, so that they run for a while instead of reconnecting for every window (the WAL
    /// alone swings by megabytes between checkpoints).
    func measure(_ store: GatewayStore, sawDiskFull: Bool, wantHeadroom: Bool) throws -> (StorageGate.Pressure?, Int64) {
        let floor = GatewayStore.freeSpaceFloorBytes
        let headroom = budget / 10 * 9
        let reserve = GatewayStore.reserveBytes(forBudget: budget)
        let used = try store.diskBytes()
        let lowOnSpace = sawDiskFull || (store.freeBytes().map { $0 < floor } ?? false)
        // The reserve goes back only when a write of ours failed for room (a session's commit, the uplink's
        // claim): given back at a mere low reading, it is taken by whatever is filling the disk before SQLite
        // can use it (seen in the test bed: a file growing to ENOSPC took it, and the uplink could never again
        // write a claim, so nothing was delivered and nothing could be pruned).
        if sawDiskFull, store.releaseReserve() {
            log.log(
                .notice,
                "storage: disk full: gave back the \(reserve)-byte reserve (\(store.reservePath)) so that SQLite can "
                    + "checkpoint its WAL and delete delivered events")
        }
        // No room to put the reserve back counts as a full disk too: make room for it first.
        let short = lowOnSpace || !store.ensureReserve(bytes: reserve)
        guard short || used > (wantHeadroom ? headroom : budget) else { return (nil, used) }
        let relief = try store.relieveStoragePressure(target: short ? 0 : headroom, keepWALSpace: lowOnSpace)
        if relief.eventsPruned > 0 {
            log.log(
                .notice,
                "storage: pruned \(relief.eventsPruned) delivered events (\(relief.framesPruned) frames), oldest "
                    + "first, to make room: store \(relief.bytesBefore) -> \(relief.bytesAfter) bytes")
        }
        // Sessions resume only with the reserve back in place (and the floor free), so that the next full disk
        // can be recovered from in the same way.
        let reserved = store.ensureReserve(bytes: reserve)
        var free = store.freeBytes()
        var after = relief.bytesAfter
        // The WAL kept its blocks while the disk was full; if pruning gave the disk room again, they count
        // against the budget for nothing (measured: a 69 KiB store with a 1.8 MiB WAL stayed "over budget" until
        // the next check, minutes later on the backoff).
        if lowOnSpace, reserved, let room = free, room >= floor + reserve {
            _ = try? store.checkpointWAL(truncating: true)
            after = try store.diskBytes()
            free = store.freeBytes()
        }
        if relief.diskFull || !reserved || (free.map { $0 < floor } ?? false) {
            return (.diskFull(free: free), after)
        }
        if after > headroom { return (.overBudget(used: after, budget: budget), after) }
        return (nil, after)
    }

    private func report(_ transition: StorageGate.Transition) {
        func why(_ pressure: StorageGate.Pressure) -> String {
            switch pressure {
            case .overBudget(let used, let budget):
                "the store uses \(used) bytes of its budget of \(budget) (new sessions wait for it to drop below 90%)"
            case .diskFull(let free):
                "the disk is full (\(free.map { "\($0) bytes free" } ?? "free space unknown"), SQLite needs room)"
            }
        }
        switch transition {
        case .closed(let pressure, let wait):
            log.log(
                .warning,
                "storage: \(why(pressure)) and nothing delivered is left to prune: no new sessions (peripherals "
                    + "keep their events) until the uplink drains or space is freed; checking again in "
                    + cFormat("%.0f s, then less and less often", wait))
        case .stillClosed(let pressure, let wait):
            log.log(.debug, "storage: still short of room (\(why(pressure))); next check in " + cFormat("%.0f s", wait))
        case .reopened(let used):
            log.log(.notice, "storage: room again (store \(used) bytes, budget \(budget)): sessions resume")
        }
    }
}
