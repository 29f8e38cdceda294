import FerrySync

/// Runs one whole session of a `SyncSessionRunner` against a `SimulatedTransport`, deterministically.
///
/// Notifications on the air are delivered one at a time (the clock moves `notificationInterval` per
/// notification, like a connection interval). When nothing is on the air the clock jumps to the earliest of
/// the runner's deadline, the peripheral's next live event and the stop time, and that event happens. The
/// step cap turns a state machine that never finishes into a reported outcome instead of a hung test.
///
/// Like `LiveSessionDriver`, a session without a deadline WAITS: it is not over. When nothing could ever
/// happen again (no deadline, nothing on the air, no live event, no stop time) the live daemon would hold the
/// slot forever, so the outcome is `.hung` — a failure for the caller to see, never a quiet end.
public enum SessionDriver {
    public struct Limits: Sendable {
        public var maxSteps = 10_000_000
        /// Simulated seconds per delivered notification.
        public var notificationInterval = 0.001
        /// At this simulated time the runner is stopped gracefully (for sessions that stay connected).
        public var stopAt: Double?

        public init(maxSteps: Int = 10_000_000, notificationInterval: Double = 0.001, stopAt: Double? = nil) {
            self.maxSteps = maxSteps
            self.notificationInterval = notificationInterval
            self.stopAt = stopAt
        }
    }

    public enum Ending: Equatable, Sendable {
        /// The runner finished (it disconnected, or stopped).
        case finished
        /// The peripheral dropped the link; the runner was told.
        case linkLost
        /// `controlHook` crashed the gateway; the runner was abandoned mid-session.
        case crashed
        case stepCapReached
        /// Nothing on the air, no deadline, no live event, no stop time: the live driver would wait forever
        /// and the session would hold its slot (what the field saw with a stalled peripheral).
        case hung
    }

    public struct Outcome: Sendable, Equatable {
        public var ending: Ending
        public var steps = 0
        public var notificationsDelivered = 0
        public var endedAt: Double = 0
    }

    public static func run(
        runner: SyncSessionRunner, transport: SimulatedTransport, clock: ManualClock, limits: Limits = Limits()
    ) async -> Outcome {
        var outcome = Outcome(ending: .finished)
        var stopped = false
        await runner.start()
        while true {
            outcome.endedAt = clock.now()
            if transport.crashed {
                outcome.ending = .crashed
                return outcome
            }
            if runner.finished {
                outcome.ending = .finished
                return outcome
            }
            outcome.steps += 1
            if outcome.steps > limits.maxSteps {
                outcome.ending = .stepCapReached
                return outcome
            }
            switch transport.nextDelivery() {
            case .notification(let bytes):
                clock.advance(by: limits.notificationInterval)
                outcome.notificationsDelivered += 1
                await runner.receive(bytes)
                continue
            case .linkLost:
                await runner.linkLost()
                outcome.ending = transport.crashed ? .crashed : .linkLost
                outcome.endedAt = clock.now()
                return outcome
            case .idle:
                break
            }
            let stopTime = stopped ? nil : limits.stopAt
            let candidates = [runner.nextDeadline, transport.nextLiveEventAt, stopTime].compactMap { $0 }
            guard let next = candidates.min() else {
                outcome.ending = .hung
                return outcome
            }
            clock.advance(to: next)
            let now = clock.now()
            if let stopTime, now >= stopTime {
                stopped = true
                await runner.stop()
                continue
            }
            if let live = transport.nextLiveEventAt, now >= live {
                transport.liveEventDue(now: now)
            }
            if let deadline = runner.nextDeadline, now >= deadline {
                await runner.timerFired()
            }
        }
    }
}

extension SessionDriver {
    /// One session's result in `syncUntilCaughtUp`.
    public struct SessionResult: Sendable {
        public var outcome: Outcome
        public var summary: SyncSummary
    }

    /// Sessions (a fresh transport and runner each, `backoff` simulated seconds apart) until one ends caught
    /// up with the store's cursor at the peripheral's head, or `maxSessions` ran. For demos and benchmarks:
    /// the stop criterion uses the simulator's ground truth, which a real gateway does not have.
    public static func syncUntilCaughtUp(
        _ peripheral: SimulatedPeripheral, clock: ManualClock, limits: Limits = Limits(), maxSessions: Int = 1_000,
        backoff: Double = 5, makeRunner: (SimulatedTransport) -> SyncSessionRunner
    ) async -> [SessionResult] {
        var results: [SessionResult] = []
        for _ in 0..<maxSessions {
            let transport = SimulatedTransport(connectingTo: peripheral, now: clock.now())
            let runner = makeRunner(transport)
            let outcome = await run(runner: runner, transport: transport, clock: clock, limits: limits)
            results.append(SessionResult(outcome: outcome, summary: runner.summary))
            if outcome.ending == .stepCapReached || outcome.ending == .hung { break }
            if runner.summary.end == .disconnected(.caughtUp) && runner.summary.cursor == peripheral.head { break }
            clock.advance(by: backoff)
        }
        return results
    }
}
