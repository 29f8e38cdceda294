import FerryCore
@testable import FerryGateway
import FerrySimulator
import Testing

/// What lets the daemon sleep instead of polling: the wake-up its loops wait on, and the due times of the pure
/// state machines it sleeps until (adapter recovery's `nextTick`, the storage gate's `nextCheckAt`; the
/// scheduler's `nextWakeup` is SyncSchedulerTests').
@Suite struct DaemonWakeupTests {
    @Test func aSignalWakesTheWaiterAndAPendingOneIsNotLost() async {
        let wakeup = Wakeup()
        wakeup.signal()
        #expect(await wakeup.wait(timeout: .seconds(30)), "a signal before the wait is kept")
        let start = ContinuousClock.now
        #expect(await !wakeup.wait(timeout: .milliseconds(50)), "consumed: the next wait times out")
        #expect(ContinuousClock.now - start >= .milliseconds(50))
        let signaller = Task {
            try? await Task.sleep(for: .milliseconds(50))
            wakeup.signal()
        }
        let waited = ContinuousClock.now
        #expect(await wakeup.wait(timeout: .seconds(60)))
        #expect(ContinuousClock.now - waited < .seconds(30), "woken by the signal, not the timeout")
        await signaller.value
        wakeup.signal()
        wakeup.signal()
        #expect(await wakeup.wait(timeout: nil))
        #expect(await !wakeup.wait(timeout: .zero), "signals coalesce")
    }

    @Test func aCancelledWaitReturns() async {
        let wakeup = Wakeup()
        let waiter = Task { await wakeup.wait(timeout: nil) }
        try? await Task.sleep(for: .milliseconds(20))
        waiter.cancel()
        #expect(await waiter.value == false)
    }

    /// Nothing adapter recovery decides by time alone can happen before `nextTick()`: the daemon may sleep until
    /// then. Checked over random event sequences, ticking at random times before the due time.
    @Test func adapterRecoveryDoesNothingBeforeItsNextTick() {
        var random = SeededGenerator(seed: 13)
        for hciReset in [true, false] {
            let settings = AdapterRecoverySettings(
                wedgedAfterSeconds: 300, minFailures: 3, adapterMissingSeconds: 60, verifySeconds: 120,
                cooldownSeconds: 3600, hciReset: hciReset)
            var r = AdapterRecovery(settings: settings)
            var now = 0.0
            for _ in 0..<20_000 {
                now += Double.random(in: 0...40, using: &random)
                let due = Bool.random(using: &random)
                switch Int.random(in: 0..<10, using: &random) {
                case 0...3: _ = r.connectFailed(now: now)
                case 4: _ = r.connectSucceeded(now: now)
                case 5: _ = r.adapter(usable: Bool.random(using: &random), now: now)
                case 6: _ = r.stepFinished(now: now, controllerFailed: Bool.random(using: &random))
                default: _ = r.tick(now: now, peripheralsDue: due)
                }
                if case .performing = r.state { continue }  // the daemon finishes the step first
                let next = r.nextTick()
                let limit = next ?? now + 10_000
                guard limit > now else { continue }  // due already: the daemon's turn ticks it now
                var probe = r
                let at = Double.random(in: now..<limit, using: &random)
                #expect(probe.tick(now: at, peripheralsDue: due) == .none, "\(r.state) at \(at), next \(String(describing: next))")
                #expect(probe == r, "tick changed \(r.state) at \(at) before its next tick \(String(describing: next))")
            }
        }
    }

    @Test func adapterRecoveryIsDueWhenItsThresholdsAre() {
        let settings = AdapterRecoverySettings(
            wedgedAfterSeconds: 300, minFailures: 3, adapterMissingSeconds: 60, verifySeconds: 120, cooldownSeconds: 3600)
        var r = AdapterRecovery(settings: settings)
        #expect(r.nextTick() == nil, "healthy, nothing failing: only an event can change that")
        _ = r.connectFailed(now: 10)
        _ = r.connectFailed(now: 20)
        #expect(r.nextTick() == nil, "below min_failures")
        _ = r.connectFailed(now: 30)
        #expect(r.nextTick() == 310)
        #expect(r.tick(now: 310, peripheralsDue: true) == .perform(.powerCycle, because: .connectsFailing))
        #expect(r.nextTick() == nil, "performing: the step's end is an event")
        _ = r.stepFinished(now: 315)
        #expect(r.nextTick() == 435)
        _ = r.adapter(usable: false, now: 320)
        #expect(r.nextTick() == 380, "the adapter missing for adapter_missing_seconds comes first")
        var off = AdapterRecovery(settings: AdapterRecoverySettings(enabled: false))
        _ = off.adapter(usable: false, now: 0)
        #expect(off.nextTick() == nil)
    }

    @Test func theStorageGateIsDueAtItsNextCheck() {
        var gate = StorageGate(routineInterval: 5)
        #expect(gate.nextCheckAt == 0 && gate.isCheckDue(now: 0, nudged: false))
        _ = gate.measured(nil, used: 1, now: 100, backoff: { _ in 30 })
        #expect(gate.nextCheckAt == 105)
        #expect(!gate.isCheckDue(now: 104.9, nudged: false) && gate.isCheckDue(now: 105, nudged: false))
        _ = gate.measured(.overBudget(used: 2, budget: 1), used: 2, now: 110, backoff: { _ in 30 })
        #expect(gate.nextCheckAt == 140)
        #expect(!gate.isCheckDue(now: 139.9, nudged: true) && gate.isCheckDue(now: 140, nudged: false))
    }
}
