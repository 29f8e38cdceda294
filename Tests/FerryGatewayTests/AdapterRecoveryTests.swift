import FerryGateway
import Testing

/// The adapter recovery ladder as a pure state machine, driven with an explicit clock (seconds).
@Suite struct AdapterRecoveryTests {
    static let settings = AdapterRecoverySettings(
        wedgedAfterSeconds: 300, minFailures: 3, adapterMissingSeconds: 60, verifySeconds: 120, cooldownSeconds: 3600)

    /// Fails a connect every 30 s from `from` to `to` and ticks every second; returns the first non-none action.
    static func failConnects(_ r: inout AdapterRecovery, from: Double, to: Double, due: Bool = true) -> (Double, AdapterRecovery.Action)? {
        var t = from
        while t <= to {
            if Int(t - from) % 30 == 0 { _ = r.connectFailed(now: t) }
            let action = r.tick(now: t, peripheralsDue: due)
            if action != .none { return (t, action) }
            t += 1
        }
        return nil
    }

    @Test func connectsFailingForTheThresholdPowerCyclesThenResetsThenCoolsDownWithoutExiting() {
        var r = AdapterRecovery(settings: Self.settings)
        let first = Self.failConnects(&r, from: 0, to: 1000)
        #expect(first?.0 == 300 && first?.1 == .perform(.powerCycle, because: .connectsFailing))
        #expect(r.tick(now: 301, peripheralsDue: true) == .none)  // performing: nothing else meanwhile
        _ = r.stepFinished(now: 305)
        let second = Self.failConnects(&r, from: 306, to: 1000)
        #expect(second?.0 == 425 && second?.1 == .perform(.hciReset, because: .connectsFailing))
        _ = r.stepFinished(now: 426)
        let third = Self.failConnects(&r, from: 427, to: 1000)
        // Peripherals that are all out of range look the same: no exit (that would restart-loop the service).
        #expect(third?.0 == 546 && third?.1 == .givingUp(until: 546 + 3600))
        #expect(Self.failConnects(&r, from: 547, to: 546 + 3599) == nil)
        // After the cooldown the ladder starts over from the power cycle.
        let again = Self.failConnects(&r, from: 546 + 3600, to: 10_000)
        #expect(again?.1 == .perform(.powerCycle, because: .connectsFailing))
    }

    @Test func aSuccessAfterAStepIsARecoveryAndASuccessBeforeTheThresholdResetsTheCount() {
        var r = AdapterRecovery(settings: Self.settings)
        #expect(Self.failConnects(&r, from: 0, to: 250) == nil)
        _ = r.connectSucceeded(now: 251)
        #expect(Self.failConnects(&r, from: 252, to: 540) == nil)  // counted from the failure after the success
        #expect(Self.failConnects(&r, from: 541, to: 560)?.1 == .perform(.powerCycle, because: .connectsFailing))
        _ = r.stepFinished(now: 561)
        #expect(r.connectSucceeded(now: 570) == .recovered(after: .powerCycle))
        #expect(r.state == .healthy(failingSince: nil, failures: 0))
    }

    @Test func tooFewFailuresOrNothingDueIsNotAWedge() {
        var r = AdapterRecovery(settings: Self.settings)
        _ = r.connectFailed(now: 0)
        _ = r.connectFailed(now: 1)
        #expect((0...2000).allSatisfy { r.tick(now: Double($0), peripheralsDue: true) == .none })
        var idle = AdapterRecovery(settings: Self.settings)
        #expect(Self.failConnects(&idle, from: 0, to: 2000, due: false) == nil)
        var off = AdapterRecovery(settings: AdapterRecoverySettings(enabled: false))
        #expect(Self.failConnects(&off, from: 0, to: 2000) == nil)
    }

    @Test func aWedgeSoonAfterARecoveryContinuesTheLadderInsteadOfPowerCyclingAgain() {
        var r = AdapterRecovery(settings: Self.settings)
        _ = Self.failConnects(&r, from: 0, to: 400)
        _ = r.stepFinished(now: 301)
        _ = r.connectSucceeded(now: 310)
        let next = Self.failConnects(&r, from: 311, to: 2000)
        #expect(next?.1 == .perform(.hciReset, because: .connectsFailing))
        // Long after: from the start again.
        var later = AdapterRecovery(settings: Self.settings)
        _ = Self.failConnects(&later, from: 0, to: 400)
        _ = later.stepFinished(now: 301)
        _ = later.connectSucceeded(now: 310)
        #expect(Self.failConnects(&later, from: 5000, to: 6000)?.1 == .perform(.powerCycle, because: .connectsFailing))
    }

    @Test func anAdapterThatStaysMissingEndsInExitAndWithoutHCIResetSkipsIt() {
        var r = AdapterRecovery(settings: Self.settings)
        _ = r.adapter(usable: false, now: 10)
        #expect(r.tick(now: 69, peripheralsDue: false) == .none)
        #expect(r.tick(now: 70, peripheralsDue: false) == .perform(.powerCycle, because: .adapterUnusable))
        _ = r.stepFinished(now: 71)
        #expect(r.tick(now: 190, peripheralsDue: false) == .none)
        #expect(r.tick(now: 191, peripheralsDue: false) == .perform(.hciReset, because: .adapterUnusable))
        _ = r.stepFinished(now: 192)
        #expect(r.tick(now: 312, peripheralsDue: false) == .perform(.exit, because: .adapterUnusable))

        var noReset = AdapterRecovery(settings: AdapterRecoverySettings(adapterMissingSeconds: 5, verifySeconds: 10, hciReset: false))
        _ = noReset.adapter(usable: false, now: 0)
        #expect(noReset.tick(now: 5, peripheralsDue: false) == .perform(.powerCycle, because: .adapterUnusable))
        _ = noReset.stepFinished(now: 6)
        #expect(noReset.tick(now: 16, peripheralsDue: false) == .perform(.exit, because: .adapterUnusable))
    }

    /// A controller that does not answer (the power-off refused, the HCI reset timed out) is strong evidence even
    /// while bluetoothd still calls it powered: the ladder goes on to exit.
    @Test func aStepTheControllerFailedMakesTheEvidenceStrong() {
        var r = AdapterRecovery(settings: Self.settings)
        #expect(Self.failConnects(&r, from: 0, to: 400)?.1 == .perform(.powerCycle, because: .connectsFailing))
        _ = r.stepFinished(now: 301, controllerFailed: true)
        #expect(r.tick(now: 421, peripheralsDue: true) == .perform(.hciReset, because: .controllerUnresponsive))
        _ = r.stepFinished(now: 422, controllerFailed: true)
        #expect(r.tick(now: 542, peripheralsDue: true) == .perform(.exit, because: .controllerUnresponsive))
        // The controller answered the next step (the reset healed it) but connects still fail: weak again, no exit.
        var answered = AdapterRecovery(settings: Self.settings)
        _ = Self.failConnects(&answered, from: 0, to: 400)
        _ = answered.stepFinished(now: 301, controllerFailed: true)
        #expect(answered.tick(now: 421, peripheralsDue: true) == .perform(.hciReset, because: .controllerUnresponsive))
        _ = answered.stepFinished(now: 422, controllerFailed: false)
        #expect(Self.failConnects(&answered, from: 423, to: 1000)?.1 == .givingUp(until: 542 + 3600))
        // A connect that works clears it.
        var healed = AdapterRecovery(settings: Self.settings)
        _ = Self.failConnects(&healed, from: 0, to: 400)
        _ = healed.stepFinished(now: 301, controllerFailed: true)
        #expect(healed.connectSucceeded(now: 310) == .recovered(after: .powerCycle))
        #expect(!healed.controllerFailed)
    }

    @Test func anAdapterThatComesBackAfterAStepIsNotEscalated() {
        var r = AdapterRecovery(settings: Self.settings)
        _ = r.adapter(usable: false, now: 0)
        #expect(r.tick(now: 60, peripheralsDue: true) == .perform(.powerCycle, because: .adapterUnusable))
        _ = r.stepFinished(now: 62)
        _ = r.adapter(usable: true, now: 65)
        // Nothing failed after the step (and nothing succeeded yet): back to watching, no next step.
        #expect((66...1000).allSatisfy { r.tick(now: Double($0), peripheralsDue: true) == .none })
        #expect(r.state == .healthy(failingSince: nil, failures: 0))
    }

    @Test func connectsStillFailingAfterTheStepWhileTheAdapterVanishedEscalateToExit() {
        var r = AdapterRecovery(settings: Self.settings)
        _ = Self.failConnects(&r, from: 0, to: 400)
        _ = r.stepFinished(now: 301)
        _ = r.adapter(usable: false, now: 302)
        #expect(r.tick(now: 421, peripheralsDue: true) == .perform(.hciReset, because: .adapterUnusable))
        _ = r.stepFinished(now: 422)
        #expect(r.tick(now: 542, peripheralsDue: true) == .perform(.exit, because: .adapterUnusable))
    }
}
