import FerryBlueZ
import FerryDBus
import Testing

private func bluez(_ name: String, _ message: String = "") -> BlueZError {
    BlueZError(DBusError(name: name, message: message))
}

@Suite("BlueZ error mapping and connect decision logic")
struct ConnectPolicyTests {
    @Test(arguments: [
        ("org.bluez.Error.InProgress", BlueZErrorKind.inProgress),
        ("org.bluez.Error.Failed", .failed),
        ("org.bluez.Error.NotReady", .notReady),
        ("org.bluez.Error.NotPermitted", .notPermitted),
        ("org.bluez.Error.NotSupported", .notSupported),
        ("org.bluez.Error.AlreadyConnected", .alreadyConnected),
        ("org.bluez.Error.DoesNotExist", .doesNotExist),
        ("org.bluez.Error.InvalidArguments", .invalidArguments),
        ("org.bluez.Error.AuthenticationFailed", .authenticationFailed),
        ("org.bluez.Error.SomethingNew", .other),
        ("org.freedesktop.DBus.Error.NoReply", .timeout),
        ("org.freedesktop.DBus.Error.ServiceUnknown", .serviceUnknown),
        ("org.freedesktop.DBus.Error.Spawn.ChildExited", .serviceUnknown),
        ("org.freedesktop.DBus.Error.Spawn.ServiceNotFound", .serviceUnknown),
        ("org.freedesktop.systemd1.UnitMasked", .serviceUnknown),
        ("org.freedesktop.DBus.Error.UnknownObject", .unknownObject),
        ("org.freedesktop.DBus.Error.UnknownMethod", .unknownObject),
        ("org.freedesktop.DBus.Error.Disconnected", .disconnected),
    ])
    func errorNamesMapToKinds(name: String, kind: BlueZErrorKind) {
        #expect(bluez(name).kind == kind)
        #expect(bluez(name).name == name)
    }

    @Test(arguments: [
        ("org.bluez.Error.Failed", "le-connection-abort-by-local", ConnectFailureClass.transient),
        ("org.bluez.Error.Failed", "le-connection-abort-by-remote", .transient),
        ("org.bluez.Error.Failed", "Software caused connection abort", .transient),
        ("org.bluez.Error.Failed", "le-connection-timeout", .transient),
        ("org.freedesktop.DBus.Error.NoReply", "", .transient),
        ("org.bluez.Error.InProgress", "In Progress", .staleState),
        ("org.bluez.Error.Failed", "Operation already in progress", .staleState),
        ("org.bluez.Error.Failed", "Limited Resources", .resourcesExhausted),
        ("org.bluez.Error.Failed", "le-connection-concurrent-connection-limit", .resourcesExhausted),
        ("org.bluez.Error.DoesNotExist", "Does Not Exist", .deviceVanished),
        ("org.freedesktop.DBus.Error.UnknownObject", "Method \"Connect\" ... doesn't exist", .deviceVanished),
        ("org.bluez.Error.NotReady", "Resource Not Ready", .adapterUnavailable),
        ("org.bluez.Error.Failed", "le-connection-adapter-not-powered", .adapterUnavailable),
        ("org.freedesktop.DBus.Error.ServiceUnknown", "", .bluetoothdUnavailable),
        ("org.bluez.Error.AlreadyConnected", "", .alreadyConnected),
        ("org.bluez.Error.NotSupported", "", .permanent),
        ("org.bluez.Error.AuthenticationFailed", "", .permanent),
    ])
    func connectErrorsAreClassified(name: String, message: String, expected: ConnectFailureClass) {
        #expect(ConnectFailureClassifier.classify(bluez(name, message)) == expected)
    }

    @Test func transientFailuresBackOffExponentiallyWithEqualJitterThenGiveUp() {
        var policy = ConnectRetryPolicy(random: { 0.5 })  // fixed jitter: 3/4 of each step
        let abort = bluez("org.bluez.Error.Failed", "le-connection-abort-by-local")
        let t0 = 100.0
        let delays = (0..<6).map { i -> ConnectRecovery in policy.next(after: abort, now: t0 + Double(i)) }
        #expect(
            delays == [
                .retry(after: .milliseconds(375)), .retry(after: .milliseconds(750)), .retry(after: .milliseconds(1500)),
                .retry(after: .seconds(3)), .retry(after: .seconds(6)), .retry(after: .seconds(11.25)),  // capped at 15 s
            ])
        guard case .giveUp = policy.next(after: abort, now: t0 + 7) else {
            Issue.record("expected give-up after the transient budget")
            return
        }
    }

    @Test func jitterStaysWithinHalfAndFullStep() {
        var low = ConnectRetryPolicy(random: { 0 })
        var high = ConnectRetryPolicy(random: { 0.999_999_999 })
        let abort = bluez("org.bluez.Error.Failed", "le-connection-abort-by-local")
        #expect(low.next(after: abort, now: 100.0) == .retry(after: .milliseconds(250)))
        guard case .retry(let d) = high.next(after: abort, now: 100.0) else {
            Issue.record("expected retry")
            return
        }
        #expect(d < .milliseconds(500) && d > .milliseconds(499))
    }

    @Test func inProgressResetsOnceThenRemovesThenGivesUp() {
        var policy = ConnectRetryPolicy(random: { 0 })
        let inProgress = bluez("org.bluez.Error.InProgress", "In Progress")
        let now = 100.0
        #expect(policy.next(after: inProgress, now: now) == .resetDeviceThenRetry(remove: false, after: .milliseconds(250)))
        #expect(policy.next(after: inProgress, now: now) == .resetDeviceThenRetry(remove: true, after: .milliseconds(500)))
        guard case .giveUp = policy.next(after: inProgress, now: now) else {
            Issue.record("expected give-up")
            return
        }
    }

    /// Issue 12: the bond is the operator's. InProgress on a bonded device only ever disconnects, with the
    /// longer (resource) backoff, then gives up to the caller's backoff: never `remove: true`.
    @Test func inProgressOnABondedDeviceNeverRemovesIt() {
        var policy = ConnectRetryPolicy(random: { 0 })
        let inProgress = bluez("org.bluez.Error.InProgress", "In Progress")
        let busy = bluez("org.bluez.Error.Failed", "Device or resource busy")
        let now = 100.0
        #expect(policy.next(after: inProgress, now: now, bonded: true) == .resetDeviceThenRetry(remove: false, after: .milliseconds(2500)))
        #expect(policy.next(after: busy, now: now, bonded: true) == .resetDeviceThenRetry(remove: false, after: .seconds(5)))
        guard case .giveUp = policy.next(after: inProgress, now: now, bonded: true) else {
            Issue.record("expected give-up")
            return
        }
    }

    @Test func slotExhaustionBacksOffLongerThanTransientErrors() {
        var policy = ConnectRetryPolicy(random: { 0 })
        let limited = bluez("org.bluez.Error.Failed", "Limited Resources")
        #expect(policy.next(after: limited, now: 100.0) == .retry(after: .milliseconds(2500)))
        #expect(policy.next(after: limited, now: 100.0) == .retry(after: .seconds(5)))
        #expect(policy.attempts(of: .resourcesExhausted) == 2)
        #expect(policy.attempts(of: .transient) == 0)
    }

    @Test func adapterAndDaemonOutagesWaitInsteadOfBurningRetries() {
        var policy = ConnectRetryPolicy()
        for _ in 0..<20 {
            #expect(policy.next(after: bluez("org.bluez.Error.NotReady"), now: 100.0) == .waitForAdapter)
            #expect(
                policy.next(after: bluez("org.freedesktop.DBus.Error.ServiceUnknown"), now: 100.0) == .waitForBluetoothd)
        }
        #expect(policy.next(after: bluez("org.bluez.Error.AlreadyConnected"), now: 100.0) == .proceed)
    }

    @Test func vanishedDeviceIsRediscoveredAFewTimes() {
        var policy = ConnectRetryPolicy(random: { 0 })
        let gone = bluez("org.bluez.Error.DoesNotExist")
        #expect(policy.next(after: gone, now: 100.0) == .rediscoverThenRetry(after: .milliseconds(250)))
        #expect(policy.next(after: gone, now: 100.0) == .rediscoverThenRetry(after: .milliseconds(500)))
        guard case .giveUp = policy.next(after: gone, now: 100.0) else {
            Issue.record("expected give-up")
            return
        }
    }

    @Test func budgetRefillsAfterAQuietPeriodAndAfterSuccess() {
        var policy = ConnectRetryPolicy(random: { 0 })
        let abort = bluez("org.bluez.Error.Failed", "le-connection-abort-by-local")
        let t0 = 100.0
        _ = policy.next(after: abort, now: t0)
        _ = policy.next(after: abort, now: t0 + 1)
        #expect(policy.attempts(of: .transient) == 2)
        #expect(policy.next(after: abort, now: t0 + 400) == .retry(after: .milliseconds(250)))
        policy.reset()
        #expect(policy.attempts(of: .transient) == 0)
    }

    @Test func permanentErrorsGiveUpImmediately() {
        var policy = ConnectRetryPolicy()
        guard case .giveUp = policy.next(after: bluez("org.bluez.Error.NotSupported"), now: 100.0) else {
            Issue.record("expected give-up")
            return
        }
    }

    @Test func discoveryLedgerStartsOnFirstUserAndStopsOnLast() {
        var ledger = DiscoveryLedger()
        #expect(ledger.acquire() == .start)
        #expect(ledger.acquire() == .none)
        #expect(ledger.release() == .none)
        #expect(ledger.release() == .stop)
        #expect(ledger.release() == .none)  // unbalanced release is ignored
        #expect(ledger.users == 0)

        #expect(ledger.acquire() == .start)
        ledger.startFailed()
        #expect(ledger.acquire() == .start)  // the next user retries the start
        #expect(ledger.sessionDropped() == .start)  // bluetoothd restart or power-off: start again for the 2 users
        #expect(ledger.release() == .none)
        #expect(ledger.release() == .stop)
        #expect(ledger.sessionDropped() == .none)
    }

    @Test func discoveryIsRestartedWhenBluetoothdOrThePowerOnDroppedItsSession() {
        typealias Loss = BlueZDiscovery.SessionLoss
        let hci0 = "/org/bluez/hci0"
        let adapter = BlueZInterface.adapter
        #expect(Loss(.serviceAppeared, adapterPath: hci0) == .serviceRestarted)
        #expect(Loss(.propertiesChanged(path: hci0, interface: adapter, changed: ["Powered": .bool(true)], invalidated: []),
                     adapterPath: hci0) == .adapterPoweredOn)
        // Powering off ends the session too, but a start then fails: the power-on is when to start again.
        #expect(Loss(.propertiesChanged(path: hci0, interface: adapter, changed: ["Powered": .bool(false)], invalidated: []),
                     adapterPath: hci0) == nil)
        #expect(Loss(.propertiesChanged(path: "/org/bluez/hci1", interface: adapter, changed: ["Powered": .bool(true)],
                                        invalidated: []), adapterPath: hci0) == nil)
        #expect(Loss(.propertiesChanged(path: hci0, interface: adapter, changed: ["Discovering": .bool(false)], invalidated: []),
                     adapterPath: hci0) == nil)
        #expect(Loss(.serviceVanished, adapterPath: hci0) == nil)
    }
}
