import FerryCore
import FerrySync

/// Decides whether the daemon is making progress, for systemd's watchdog. Pure: each part reports a heartbeat
/// with a `now` from the monotonic clock, and `verdict(now:)` says who, if anyone, is stale. The sender
/// (`SystemdNotifier`) only sends `WATCHDOG=1` on `.healthy`, so a part that hangs — the scheduling loop stuck
/// in an await, the D-Bus thread wedged, the forwarder stuck in a store call — stops the pings and systemd
/// restarts the process after `WatchdogSec=`.
///
/// A part is only judged once it has reported at least once (`expect` then `beat`): the forwarder does not exist
/// without an uplink endpoint, and the D-Bus probe only runs once a bus connection exists. A part that was
/// expected but never beat is judged from the moment it was expected.
public struct WatchdogMonitor: Sendable, Equatable {
    public enum Part: String, Sendable, CaseIterable, Comparable {
        /// The daemon's scheduling loop (a turn at least every 5 s, its heartbeat; its BlueZ calls time out after 25 s).
        case scheduler
        /// The D-Bus connection thread, proven alive by a round trip to the bus daemon.
        case dbus
        /// The outbox forwarder's loop (one iteration per batch or idle poll; a post times out on its own).
        case forwarder

        public static func < (a: Part, b: Part) -> Bool { a.rawValue < b.rawValue }
    }

    public enum Verdict: Sendable, Equatable {
        case healthy
        /// These parts have not reported within their limit.
        case stale([Part])
    }

    /// The longest silence tolerated per part, in seconds. Each is above the longest legitimate wait inside one
    /// iteration of that part (a 25 s D-Bus call timeout for the scheduler and the probe; the uplink's
    /// request timeout for the forwarder), so only a hang trips it.
    public var limits: [Part: Double]
    private var lastBeat: [Part: Double] = [:]

    public init(limits: [Part: Double] = [.scheduler: 60, .dbus: 60, .forwarder: 120]) {
        self.limits = limits
    }

    /// Start judging `part` from `now` (if it was not already).
    public mutating func expect(_ part: Part, now: Double) {
        if lastBeat[part] == nil { lastBeat[part] = now }
    }

    /// Stop judging `part` (the forwarder stops at shutdown; the bus is being reconnected).
    public mutating func forget(_ part: Part) {
        lastBeat[part] = nil
    }

    public mutating func beat(_ part: Part, now: Double) {
        lastBeat[part] = max(lastBeat[part] ?? now, now)
    }

    public func verdict(now: Double) -> Verdict {
        let stale = lastBeat.compactMap { part, at -> Part? in
            now - at > (limits[part] ?? 60) ? part : nil
        }
        return stale.isEmpty ? .healthy : .stale(stale.sorted())
    }
}

/// What the daemon tells its supervisor: heartbeats, readiness, a one-line status. Shared by the daemon's tasks
/// (they write) and the notifier thread (it reads), hence the lock.
public final class DaemonHealth: Sendable {
    public struct Snapshot: Sendable, Equatable {
        public var ready = false
        /// systemd's STATUS= line: what `systemctl status ferry` shows.
        public var status = "starting"

        public init(ready: Bool = false, status: String = "starting") {
            self.ready = ready
            self.status = status
        }
    }

    private let monitor: LockedValue<WatchdogMonitor>
    private let snapshot = LockedValue(Snapshot())
    public let clock: any MonotonicClock

    public init(monitor: WatchdogMonitor = WatchdogMonitor(), clock: any MonotonicClock = SystemMonotonicClock()) {
        self.monitor = LockedValue(monitor)
        self.clock = clock
    }

    public func beat(_ part: WatchdogMonitor.Part) {
        let now = clock.now()
        monitor.withLock { $0.beat(part, now: now) }
    }

    public func expect(_ part: WatchdogMonitor.Part) {
        let now = clock.now()
        monitor.withLock { $0.expect(part, now: now) }
    }

    public func forget(_ part: WatchdogMonitor.Part) {
        monitor.withLock { $0.forget(part) }
    }

    public func verdict() -> WatchdogMonitor.Verdict {
        let now = clock.now()
        return monitor.withLock { $0.verdict(now: now) }
    }

    public func markReady() { snapshot.withLock { $0.ready = true } }

    public func setStatus(_ status: String) { snapshot.withLock { $0.status = status } }

    public var current: Snapshot { snapshot.withLock { $0 } }
}
