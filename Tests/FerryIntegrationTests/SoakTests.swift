import FerryGateway
import FerrySync
import FerryProtocol
import FerrySimulator
import FerryStore
import FerryTestSupport
import Foundation
import Testing

@Suite("Everything at once")
struct SoakTests {
    /// Rounds of "the device records, the gateway syncs" with every fault on, including the device wiping
    /// itself or regressing its counter in the middle of a burst, and the gateway crashing before ACKs.
    func run(
        seed: UInt64, rounds: Int, eventsPerRound: Int, crashRate: Double, wipeRate: Double, capacity: Int?,
        live: Bool, minimumStored: Int = 0
    )
        async throws -> (Ledger, SimulatedPeripheral, Gateway, TemporaryDirectory)
    {
        let dir = try TemporaryDirectory("soak")
        var config = SimulatedPeripheral.Configuration()
        config.notificationSize = [20, 64, 244, 514][Int(seed % 4)]
        config.capacity = capacity
        config.liveEventInterval = live ? 0.02 : nil
        var faults = hostileLink()
        faults.epochResetPerNotification = wipeRate
        faults.regressionPerNotification = wipeRate
        let peripheral = try SimulatedPeripheral(
            directory: dir.url.appendingPathComponent("device"), configuration: config, faults: faults, seed: seed)
        let gateway = try Gateway(directory: dir)
        var random = SeededGenerator(seed: seed &+ 1)
        for round in 0..<(rounds * 6) {
            // Past `rounds`, keep going only until the device has both wiped and regressed mid-burst and the
            // gateway holds `minimumStored` events (the faults are random: the test must pass neither by never
            // meeting them nor by a wipe that left next to nothing to check).
            let causes = Set(peripheral.generations.map(\.cause))
            let stored = try gateway.store.streams().reduce(0) { $0 + $1.framesStaged }
            if round >= rounds && (wipeRate == 0 || causes.isSuperset(of: [.epochReset, .counterRegression]))
                && stored >= minimumStored
            {
                break
            }
            try peripheral.record(count: eventsPerRound)
            try await gateway.syncUntilCaughtUp(peripheral, maxSessions: 2_000) { _ in random.chance(crashRate) }
            gateway.clock.advance(by: 60)
        }
        let ledger = try expectConsistent(gateway, peripheral)
        return (ledger, peripheral, gateway, dir)
    }

    @Test("mid-burst wipes and counter regressions, crashes, every link fault: 10k events")
    func everythingAtOnce() async throws {
        let (ledger, peripheral, gateway, dir) = try await run(
            seed: 71, rounds: 5, eventsPerRound: 2_000, crashRate: 0.01, wipeRate: 0.0015, capacity: nil, live: false,
            minimumStored: 5_000)
        defer { dir.remove() }
        let causes = peripheral.generations.map(\.cause)
        #expect(causes.contains(.epochReset) && causes.contains(.counterRegression), "\(causes)")
        #expect(try gateway.outboxCount(type: .regression) >= 1)
        #expect(gateway.crashes >= 1)
        #expect(ledger.storedEvents >= 5_000)
        #expect(ledger.streams.count == Set(ledger.streams.map(\.status.epoch)).count)
        print("soak 10k: \(peripheral.generations.count) generations \(causes), \(gateway.sessions.count) sessions, "
            + "\(gateway.crashes) crashes, \(ledger.storedEvents) stored, \(ledger.lostAndMissing) lost by the device, "
            + "\(peripheral.statistics)")
    }

    @Test(
        "soak: 200k events, evictions, live events, everything (FERRY_SOAK=1)", .enabled(if: soakEnabled()),
        arguments: [UInt64(81), 82])
    func soak(seed: UInt64) async throws {
        let started = Date()
        let (ledger, peripheral, gateway, dir) = try await run(
            seed: seed, rounds: 20, eventsPerRound: 10_000, crashRate: 0.005, wipeRate: 0.00002,
            capacity: seed == 82 ? 8_000 : nil,
            live: seed == 82)
        defer { dir.remove() }
        #expect(ledger.storedEvents > 150_000, "a soak that wipes everything tests nothing")
        print("soak \(seed): \(peripheral.head) head, \(peripheral.generations.count) generations, "
            + "\(gateway.sessions.count) sessions, \(gateway.crashes) crashes, \(ledger.storedEvents) stored, "
            + "\(ledger.gapSeqs) in GAPs, \(ledger.lostAndMissing) lost by the device, "
            + "\(Int(Date().timeIntervalSince(started))) s; \(peripheral.statistics)")
    }
}
