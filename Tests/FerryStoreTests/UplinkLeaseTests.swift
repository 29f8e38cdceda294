import Testing

@testable import FerryStore

/// Issue 11: one forwarder per store, stable batch gateways, retry times that follow wall-clock steps.
@Suite struct UplinkLeaseTests {
    let t = FixedClock().millis
    func store(_ dir: TemporaryDirectory) throws -> GatewayStore {
        try GatewayStore(path: dir.file("ferry.sqlite"), clock: FixedClock())
    }

    @Test func aLiveHolderKeepsTheLeaseAGoneOneLosesIt() throws {
        let dir = try TemporaryDirectory()
        let store = try store(dir)
        let alive: (Int64) -> Bool = { $0 == 100 }
        #expect(
            try store.acquireForwarderLease(owner: "a", pid: 100, bootID: "b1", now: 0, ttlMillis: 1000, isAlive: alive)
                == .acquired(previousOwnerGone: true))
        // Another live process on the same boot: refused, whoever asks.
        guard
            case .heldBy(let holder) = try store.acquireForwarderLease(
                owner: "b", pid: 200, bootID: "b1", now: 10, ttlMillis: 1000, isAlive: alive)
        else {
            Issue.record("a live holder lost its lease")
            return
        }
        #expect(holder.pid == 100)
        #expect(try store.renewForwarderLease(owner: "a", now: 900, ttlMillis: 1000))
        // Expired (not renewed), dead pid, another boot, or the same process (an ended instance): taken over.
        #expect(
            try store.acquireForwarderLease(owner: "b", pid: 200, bootID: "b1", now: 2000, ttlMillis: 1000, isAlive: alive)
                == .acquired(previousOwnerGone: true))
        #expect(try !store.renewForwarderLease(owner: "a", now: 2001, ttlMillis: 1000), "the old owner must stop")
        #expect(
            try store.acquireForwarderLease(owner: "c", pid: 300, bootID: "b1", now: 2002, ttlMillis: 1000, isAlive: alive)
                == .acquired(previousOwnerGone: true), "pid 200 is dead")
        #expect(
            try store.acquireForwarderLease(owner: "d", pid: 100, bootID: "b2", now: 2003, ttlMillis: 1000, isAlive: { _ in true })
                == .acquired(previousOwnerGone: true), "another boot")
        #expect(
            try store.acquireForwarderLease(owner: "e", pid: 100, bootID: "b2", now: 2004, ttlMillis: 1000, isAlive: { _ in true })
                == .acquired(previousOwnerGone: true), "the same process: its earlier forwarder ended")
        try store.recordUplinkState(owner: "e", state: .offline, since: 2004, detail: "HTTP 503")
        #expect(
            try store.uplinkState(now: 2005)
                == UplinkStateRecord(running: true, pid: 100, state: .offline, since: 2004, detail: "HTTP 503"))
        try store.releaseForwarderLease(owner: "e")
        #expect(try store.uplinkState(now: 2005)?.running == false)
    }

    @Test func aBatchKeepsTheGatewayItWasFirstClaimedWith() throws {
        let dir = try TemporaryDirectory()
        let store = try store(dir)
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 1)
        _ = try store.commit(batch(from: 0, dataFrames(1...5)), to: stream.key)
        let first = try #require(try store.claimBatch(now: t, gateway: "gw-before"))
        #expect(first.gateway == "gw-before")
        _ = try store.retryBatch(first.id, error: "x", nextRetryAt: t, countsAsRetry: false, maxRetries: 10)
        let again = try #require(try store.claimBatch(now: t, gateway: "gw-after"))
        #expect(again.id == first.id && again.gateway == "gw-before")
        // An operator retry starts a new batch: it takes the current gateway.
        try store.failBatch(first.id, error: "422")
        try store.retryFailed(id: nil, now: t)
        #expect(try store.claimBatch(now: t, gateway: "gw-after")?.gateway == "gw-after")
    }

    @Test func retryTimesFollowAWallClockStepAndAreClamped() throws {
        let dir = try TemporaryDirectory()
        let store = try store(dir)
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 1)
        _ = try store.commit(batch(from: 0, dataFrames(1...5)), to: stream.key)
        let claimed = try #require(try store.claimBatch(now: t))
        _ = try store.retryBatch(claimed.id, error: "x", nextRetryAt: t + 5000, countsAsRetry: false, maxRetries: 10)
        // The clock stepped back a day: the 5 s left stay 5 s.
        let day: Int64 = 86_400_000
        #expect(try store.shiftPendingRetries(byMillis: -day, after: t) == 1)
        #expect(try store.nextDueAt() == t + 5000 - day)
        // A step nobody measured (no forwarder ran): clamped to the horizon.
        #expect(try store.clampPendingRetries(now: t - day, horizonMillis: 10_000) == 0)
        #expect(try store.clampPendingRetries(now: t - day - 60_000, horizonMillis: 10_000) == 1)
        #expect(try store.nextDueAt() == t - day - 50_000)
    }
}
