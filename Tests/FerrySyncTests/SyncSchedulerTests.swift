import FerrySync
import FerryProtocol
import Testing

/// The daemon's slot policy (SyncScheduler): pure, driven with explicit times.
@Suite struct DaemonSchedulerTests {
    let a = PeripheralAddress("C0:FF:EE:00:00:01")!
    let b = PeripheralAddress("C0:FF:EE:00:00:02")!
    let c = PeripheralAddress("C0:FF:EE:00:00:03")!
    let d = PeripheralAddress("C0:FF:EE:00:00:04")!

    func scheduler(slots: Int = 3, interval: Double = 60) -> SyncScheduler {
        var config = SyncScheduler.Configuration()
        config.maxConnections = slots
        config.syncInterval = interval
        config.backoffBase = 2
        config.backoffCap = 30
        return SyncScheduler(configuration: config)
    }

    /// Issue 12: stay_connected_default with >= max_connections paired peripherals starved the rest.
    @Test func stayConnectedSessionsLeaveOneSlotForTheOthers() {
        // 3 slots, 5 stay-connected paired peripherals: 2 may stay connected, the others rotate through the third.
        #expect(SyncScheduler.grantsStayConnected(activeStayConnected: 0, maxConnections: 3, candidates: 5))
        #expect(SyncScheduler.grantsStayConnected(activeStayConnected: 1, maxConnections: 3, candidates: 5))
        #expect(!SyncScheduler.grantsStayConnected(activeStayConnected: 2, maxConnections: 3, candidates: 5))
        // One slot, two peripherals: a stay-connected session would hold it forever.
        #expect(!SyncScheduler.grantsStayConnected(activeStayConnected: 0, maxConnections: 1, candidates: 2))
        // Everybody fits: every slot may stay connected.
        #expect(SyncScheduler.grantsStayConnected(activeStayConnected: 2, maxConnections: 3, candidates: 3))
        #expect(SyncScheduler.grantsStayConnected(activeStayConnected: 0, maxConnections: 1, candidates: 1))
    }

    @Test func neverSyncedPeripheralsAreDueAtOnceButOnlyAsManyAsThereAreSlots() {
        var s = scheduler(slots: 2)
        s.setCandidates([a, b, c])
        #expect(s.due(now: 0) == [a, b])
        s.started(a, now: 0)
        #expect(s.due(now: 0) == [b])
        s.started(b, now: 0)
        #expect(s.due(now: 0).isEmpty)
        #expect(s.activeCount == 2)
    }

    @Test func aCaughtUpPeripheralWaitsForTheSyncInterval() {
        var s = scheduler(interval: 60)
        s.setCandidates([a])
        s.started(a, now: 0)
        s.finished(a, outcome: .caughtUp, now: 10)
        #expect(s.due(now: 69.9).isEmpty)
        #expect(s.nextWakeup(now: 11) == 70)
        #expect(s.due(now: 70) == [a])
    }

    @Test func largestKnownBacklogGoesFirstThenOldestSync() {
        var s = scheduler(slots: 1, interval: 60)
        s.setCandidates([a, b, c])
        for p in [a, b, c] { s.started(p, now: 0) }
        s.finished(a, outcome: .interrupted(backlog: 10), now: 1)
        s.finished(b, outcome: .interrupted(backlog: 500), now: 2)
        s.finished(c, outcome: .caughtUp, now: 3)
        // After the short pause that follows an interruption, b (500 behind) goes before a (10 behind).
        #expect(s.due(now: 100) == [b])
        s.started(b, now: 100)
        s.finished(b, outcome: .caughtUp, now: 101)
        #expect(s.due(now: 102) == [a])
        // With no backlog anywhere, the peripheral synced longest ago goes first.
        s.started(a, now: 102)
        s.finished(a, outcome: .caughtUp, now: 103)
        #expect(s.due(now: 200) == [c])
    }

    @Test func aNewPeripheralGoesBeforeOnesWithABacklog() {
        var s = scheduler(slots: 1)
        s.setCandidates([a])
        s.started(a, now: 0)
        s.finished(a, outcome: .interrupted(backlog: 9999), now: 1)
        s.setCandidates([a, d])
        #expect(s.due(now: 10) == [d])
    }

    @Test func failuresBackOffExponentiallyCappedAndACatchUpClearsIt() {
        var s = scheduler(interval: 0)
        s.setCandidates([a])
        var t = 0.0
        var waits: [Double] = []
        for _ in 0..<6 {
            s.started(a, now: t)
            s.finished(a, outcome: .failed, now: t)
            let notBefore = s.peripherals[a]!.notBefore
            waits.append(notBefore - t)
            #expect(s.due(now: notBefore - 0.01).isEmpty)
            #expect(s.due(now: notBefore) == [a])
            t = notBefore
        }
        #expect(waits == [2, 4, 8, 16, 30, 30])
        s.started(a, now: t)
        s.finished(a, outcome: .caughtUp, now: t)
        #expect(s.peripherals[a]!.consecutiveFailures == 0)
        #expect(s.due(now: t) == [a])  // interval 0: due again right away
    }

    @Test func jitterScalesTheBackoff() {
        var config = SyncScheduler.Configuration()
        config.backoffBase = 4
        let s = SyncScheduler(configuration: config, jitter: { 0.5 })
        #expect(s.backoff(afterFailures: 1) == 2)
        #expect(s.backoff(afterFailures: 3) == 8)
    }

    @Test func aPeripheralInASessionIsNeverStartedTwice() {
        var s = scheduler(slots: 3, interval: 0)
        s.setCandidates([a])
        s.started(a, now: 0)
        #expect(s.due(now: 1000).isEmpty)
    }

    @Test func removedFromTheAllowlistIsForgottenButARunningSessionKeepsItsSlotUntilItEnds() {
        var s = scheduler(slots: 2)
        s.setCandidates([a, b])
        s.started(a, now: 0)
        s.setCandidates([b])
        #expect(s.peripherals[a] != nil)  // still in a session
        #expect(s.activeCount == 1)
        s.finished(a, outcome: .caughtUp, now: 1)
        s.setCandidates([b])
        #expect(s.peripherals[a] == nil)
        #expect(s.due(now: 2) == [b])
    }

    @Test func aFailedPeripheralIsRetriedAfterItsBackoffNotAfterTheSyncInterval() {
        var s = scheduler(interval: 600)
        s.setCandidates([a])
        s.started(a, now: 0)
        s.finished(a, outcome: .caughtUp, now: 1)
        s.started(a, now: 601)
        s.finished(a, outcome: .failed, now: 602)
        #expect(s.due(now: 603.9).isEmpty)
        #expect(s.due(now: 604) == [a])  // 2 s backoff, not 600 s
        s.started(a, now: 604)
        s.finished(a, outcome: .interrupted(backlog: nil), now: 605)
        #expect(s.due(now: 607) == [a])  // unknown backlog: after the short pause
    }

    @Test func nextWakeupIsTheEarliestBackoffOrIntervalEnd() {
        var s = scheduler(interval: 60)
        s.setCandidates([a, b])
        s.started(a, now: 0)
        s.started(b, now: 0)
        #expect(s.nextWakeup(now: 0) == nil)  // everyone busy
        s.finished(a, outcome: .caughtUp, now: 5)
        s.finished(b, outcome: .failed, now: 6)
        #expect(s.nextWakeup(now: 6) == 8)  // b's 2 s backoff ends before a's interval
    }
}
