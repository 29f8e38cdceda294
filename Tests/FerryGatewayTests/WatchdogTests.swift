import FerryGateway
import FerrySync
import FerrySimulator
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// The watchdog's judgement (pure, on a test clock) and the notify environment. The datagram itself and
/// `ferry run` under a notify socket: FerryDBusTests/SystemdNotifyTests.
@Suite struct WatchdogTests {
    @Test func healthyOnlyWhileEveryExpectedPartBeatsWithinItsLimit() {
        var monitor = WatchdogMonitor(limits: [.scheduler: 10, .dbus: 20, .forwarder: 30])
        #expect(monitor.verdict(now: 1000) == .healthy)  // nothing expected yet
        monitor.beat(.scheduler, now: 0)
        monitor.expect(.dbus, now: 0)
        #expect(monitor.verdict(now: 10) == .healthy)
        #expect(monitor.verdict(now: 10.5) == .stale([.scheduler]))
        monitor.beat(.scheduler, now: 10.5)
        #expect(monitor.verdict(now: 20.5) == .stale([.dbus]))  // expected at 0, never beat
        monitor.beat(.dbus, now: 20.5)
        monitor.beat(.scheduler, now: 20.5)
        monitor.expect(.forwarder, now: 20.5)
        #expect(monitor.verdict(now: 20.6) == .healthy)
        #expect(monitor.verdict(now: 51) == .stale([.dbus, .forwarder, .scheduler]))
        monitor.forget(.forwarder)
        #expect(monitor.verdict(now: 51) == .stale([.dbus, .scheduler]))
    }

    @Test func expectDoesNotResetAPartThatAlreadyBeatAndBeatsNeverGoBackInTime() {
        var monitor = WatchdogMonitor(limits: [.scheduler: 10])
        monitor.beat(.scheduler, now: 100)
        monitor.expect(.scheduler, now: 200)  // a late expect must not hide a stall since 100
        #expect(monitor.verdict(now: 111) == .stale([.scheduler]))
        monitor.beat(.scheduler, now: 150)
        monitor.beat(.scheduler, now: 120)  // out of order (two tasks): keeps the newer one
        #expect(monitor.verdict(now: 159) == .healthy)
    }

    @Test func daemonHealthUsesItsClock() {
        let clock = ManualClock()
        let health = DaemonHealth(monitor: WatchdogMonitor(limits: [.scheduler: 5]), clock: clock)
        health.beat(.scheduler)
        clock.advance(by: 5)
        #expect(health.verdict() == .healthy)
        clock.advance(by: 0.1)
        #expect(health.verdict() == .stale([.scheduler]))
        #expect(health.current == DaemonHealth.Snapshot(ready: false, status: "starting"))
        health.markReady()
        health.setStatus("1 of 3 slots in use")
        #expect(health.current == DaemonHealth.Snapshot(ready: true, status: "1 of 3 slots in use"))
    }

    @Test func environmentParsingHonoursWatchdogPidAndIgnoresJunk() {
        typealias Setup = SystemdNotifier.Setup
        let full = Setup(environment: ["NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000"], pid: 42)
        #expect(full.socket == "/run/systemd/notify" && full.watchdogSeconds == 30)
        #expect(Setup(environment: ["NOTIFY_SOCKET": "@abstract"], pid: 1).socket == "@abstract")
        #expect(Setup(environment: ["NOTIFY_SOCKET": "relative"], pid: 1).socket == nil)
        #expect(Setup(environment: ["NOTIFY_SOCKET": "@"], pid: 1).socket == nil)
        #expect(Setup(environment: ["NOTIFY_SOCKET": "/" + String(repeating: "x", count: 200)], pid: 1).socket == nil)
        #expect(Setup(environment: [:], pid: 1).socket == nil)
        let mine = ["WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "42"]
        #expect(Setup(environment: mine, pid: 42).watchdogSeconds == 2)
        #expect(Setup(environment: mine, pid: 43).watchdogSeconds == nil)  // meant for another process
        #expect(Setup(environment: ["WATCHDOG_USEC": "0"], pid: 1).watchdogSeconds == nil)
        #expect(Setup(environment: ["WATCHDOG_USEC": "-5"], pid: 1).watchdogSeconds == nil)
        #expect(SystemdNotifier(setup: Setup(environment: [:], pid: 1)).send("READY=1") == false)
    }
}
