/// Thresholds of adapter recovery (`adapter_recovery` in the config, docs/CONFIG.md).
public struct AdapterRecoverySettings: Sendable, Equatable {
    public var enabled: Bool
    /// Connects failing this long (with at least `minFailures` failures, no success, peripherals due) make the
    /// controller suspect.
    public var wedgedAfterSeconds: Double
    public var minFailures: Int
    /// The adapter object missing (bluetoothd running) or refusing to power on this long: the controller is
    /// unusable, whatever the connects say.
    public var adapterMissingSeconds: Double
    /// After a recovery step, how long a first successful connect may take before the next step.
    public var verifySeconds: Double
    /// A wedge that comes back within this long after a recovery continues the ladder where it stopped (the
    /// rate limit: no power cycle every few minutes), and a ladder that ran out waits this long before starting over.
    public var cooldownSeconds: Double
    /// False: the ladder skips the HCI reset (no CAP_NET_ADMIN granted).
    public var hciReset: Bool

    public init(
        enabled: Bool = true, wedgedAfterSeconds: Double = 300, minFailures: Int = 3, adapterMissingSeconds: Double = 60,
        verifySeconds: Double = 120, cooldownSeconds: Double = 3600, hciReset: Bool = true
    ) {
        self.enabled = enabled
        self.wedgedAfterSeconds = wedgedAfterSeconds
        self.minFailures = minFailures
        self.adapterMissingSeconds = adapterMissingSeconds
        self.verifySeconds = verifySeconds
        self.cooldownSeconds = cooldownSeconds
        self.hciReset = hciReset
    }
}

/// Detects a wedged controller and escalates: power cycle through BlueZ → HCI reset through the kernel → exit
/// non-zero (systemd restarts the process, which reloads bluetoothd's view). Pure state machine: the daemon
/// feeds it events with its clock's time and carries out the returned action.
///
/// Two kinds of evidence, because they deserve different endings:
/// - `connectsFailing`: every connect failed for `wedgedAfterSeconds` while peripherals were due. A wedged
///   controller looks like this, but so do peripherals that are all out of range; so this evidence climbs to
///   the HCI reset at most, then waits `cooldownSeconds` before starting over: it never restart-loops the
///   service over a flat battery.
/// - `adapterUnusable`: the adapter object vanished from bluetoothd, or it will not power on, for
///   `adapterMissingSeconds`. That is the controller (or its driver) for sure: the ladder ends in `exit`.
/// - `controllerUnresponsive`: the controller did not answer a recovery step (the power-off refused, the HCI
///   reset timed out) and connects still fail. As sure as the above, and ends the same way.
public struct AdapterRecovery: Sendable, Equatable {
    public enum Evidence: String, Sendable, Equatable {
        case connectsFailing = "connects_failing"
        case adapterUnusable = "adapter_unusable"
        case controllerUnresponsive = "controller_unresponsive"
    }

    public enum Step: String, Sendable, Equatable, CaseIterable {
        case powerCycle = "power_cycle"
        case hciReset = "hci_reset"
        case exit
    }

    public enum Action: Sendable, Equatable {
        case none
        /// Carry out `step`, then report `stepFinished`.
        case perform(Step, because: Evidence)
        /// Recovered: the step that was last performed helped (for the log and the metrics).
        case recovered(after: Step)
        /// The ladder ran out for weak evidence: wait for the cooldown (logged once).
        case givingUp(until: Double)
    }

    public enum State: Sendable, Equatable {
        /// Watching. `failingSince`: the first failure after the last success; `failures` since then.
        case healthy(failingSince: Double?, failures: Int)
        /// A step is being carried out.
        case performing(Step, evidence: Evidence)
        /// A step was done at `at`; waiting for a success until `at + verifySeconds`.
        case verifying(Step, evidence: Evidence, at: Double, failures: Int)
        /// Out of steps for weak evidence; nothing is tried before `until`.
        case coolingDown(until: Double)
    }

    public let settings: AdapterRecoverySettings
    public private(set) var state: State = .healthy(failingSince: nil, failures: 0)
    /// Since when the adapter is missing or unpowerable (nil: it is fine).
    public private(set) var adapterUnusableSince: Double?
    /// The last step performed and when it ended, for the escalation across episodes.
    public private(set) var lastStep: LastStep?
    /// The last step failed because of the controller itself (bluetoothd could not power it off or on, the
    /// kernel's HCI reset timed out): HCI errors, strong evidence like an unusable adapter. A later step the
    /// controller answered, or a successful connect, clears it (measured in the bed: a controller that refused
    /// the power-off answered the HCI reset and came back).
    public private(set) var controllerFailed = false
    public struct LastStep: Sendable, Equatable {
        public var step: Step
        public var at: Double
    }

    public init(settings: AdapterRecoverySettings) {
        self.settings = settings
    }

    /// For the live view (`ferry status`): "ok", "connects_failing", a step being performed ("power_cycle",
    /// "hci_reset", "exit"), "verifying_<step>", or "cooling_down".
    public var phase: String {
        switch state {
        case .healthy(_, let failures): failures > 0 ? "connects_failing" : "ok"
        case .performing(let step, _): step.rawValue
        case .verifying(let step, _, _, _): "verifying_" + step.rawValue
        case .coolingDown: "cooling_down"
        }
    }

    // MARK: Events

    /// A connect (or the session it started) succeeded: the controller works.
    public mutating func connectSucceeded(now: Double) -> Action {
        adapterUnusableSince = nil
        controllerFailed = false
        switch state {
        case .verifying(let step, _, _, _):
            state = .healthy(failingSince: nil, failures: 0)
            return .recovered(after: step)
        case .healthy, .coolingDown:
            state = .healthy(failingSince: nil, failures: 0)
            return .none
        case .performing:
            return .none
        }
    }

    /// A connect failed for a reason a controller could cause (the caller leaves out permanent refusals and
    /// peripherals the scheduler never expected to reach).
    public mutating func connectFailed(now: Double) -> Action {
        switch state {
        case .healthy(let since, let failures):
            state = .healthy(failingSince: since ?? now, failures: failures + 1)
        case .verifying(let step, let evidence, let at, let failures):
            state = .verifying(step, evidence: evidence, at: at, failures: failures + 1)
        case .performing, .coolingDown:
            break
        }
        return .none
    }

    /// The adapter object is present and powered (true) or missing / refusing to power on (false).
    public mutating func adapter(usable: Bool, now: Double) -> Action {
        if usable {
            adapterUnusableSince = nil
        } else if adapterUnusableSince == nil {
            adapterUnusableSince = now
        }
        return .none
    }

    /// The step handed out by `perform` is done. `controllerFailed`: it failed because the controller did not
    /// answer (not for want of a permission), which makes the evidence strong.
    public mutating func stepFinished(now: Double, controllerFailed failed: Bool = false) -> Action {
        guard case .performing(let step, let evidence) = state else { return .none }
        controllerFailed = failed
        lastStep = LastStep(step: step, at: now)
        state = .verifying(step, evidence: evidence, at: now, failures: 0)
        return .none
    }

    /// Called on each turn of the daemon's loop, and at `nextTick()` at the latest. `peripheralsDue`: some peripheral is due or being connected (without that,
    /// no connect is tried and silence proves nothing).
    public mutating func tick(now: Double, peripheralsDue: Bool) -> Action {
        guard settings.enabled else { return .none }
        let unusable = adapterUnusableSince.map { now - $0 >= settings.adapterMissingSeconds } ?? false
        switch state {
        case .performing:
            return .none
        case .coolingDown(let until):
            if unusable { return start(.adapterUnusable, now: now) }
            guard now >= until else { return .none }
            state = .healthy(failingSince: nil, failures: 0)
            lastStep = nil
            return .none
        case .healthy(let since, let failures):
            if unusable { return start(.adapterUnusable, now: now) }
            guard peripheralsDue, let since, failures >= settings.minFailures,
                now - since >= settings.wedgedAfterSeconds
            else { return .none }
            return start(.connectsFailing, now: now)
        case .verifying(let step, _, let at, let failures):
            guard now - at >= settings.verifySeconds else { return .none }
            let strong = unusable || controllerFailed
            let stillBad = strong || (peripheralsDue && failures > 0)
            guard stillBad else {
                // Nothing was due, so nothing proved the step wrong or right: watch afresh.
                state = .healthy(failingSince: nil, failures: 0)
                return .none
            }
            // Recomputed, not carried: a controller that answered the last step while connects still fail is the
            // weak case again (which never ends in exit).
            let nextEvidence: Evidence =
                unusable ? .adapterUnusable : controllerFailed ? .controllerUnresponsive : .connectsFailing
            return escalate(after: step, evidence: nextEvidence, now: now)
        }
    }

    /// The next time `tick` can act by time alone (nil: only an event can change anything): the daemon's loop
    /// sleeps until then instead of ticking every second. Derived from the same thresholds `tick` reads.
    public func nextTick() -> Double? {
        guard settings.enabled else { return nil }
        let unusableAt = adapterUnusableSince.map { $0 + settings.adapterMissingSeconds }
        let timed: Double?
        switch state {
        case .performing: return nil
        case .coolingDown(let until): timed = until
        case .healthy(let since, let failures):
            timed = failures >= settings.minFailures ? since.map { $0 + settings.wedgedAfterSeconds } : nil
        case .verifying(_, _, let at, _): timed = at + settings.verifySeconds
        }
        switch (timed, unusableAt) {
        case (let a?, let b?): return min(a, b)
        case (let a?, nil): return a
        case (nil, let b): return b
        }
    }

    // MARK: Ladder

    private func steps(for evidence: Evidence) -> [Step] {
        var steps: [Step] = [.powerCycle]
        if settings.hciReset { steps.append(.hciReset) }
        if evidence != .connectsFailing { steps.append(.exit) }
        return steps
    }

    /// A new episode: from the first step, or from the one after the last if that was within the cooldown.
    private mutating func start(_ evidence: Evidence, now: Double) -> Action {
        if let last = lastStep, now - last.at < settings.cooldownSeconds {
            return escalate(after: last.step, evidence: evidence, now: now)
        }
        return perform(steps(for: evidence)[0], evidence)
    }

    private mutating func escalate(after step: Step, evidence: Evidence, now: Double) -> Action {
        let ladder = steps(for: evidence)
        let next = ladder.firstIndex(of: step).map { $0 + 1 } ?? 0
        guard next < ladder.count else {
            let until = now + settings.cooldownSeconds
            state = .coolingDown(until: until)
            return .givingUp(until: until)
        }
        return perform(ladder[next], evidence)
    }

    private mutating func perform(_ step: Step, _ evidence: Evidence) -> Action {
        state = .performing(step, evidence: evidence)
        return .perform(step, because: evidence)
    }
}
