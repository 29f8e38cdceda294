import FerrySimulator
import Foundation
import Testing
@testable import FerryProtocol

/// THE DURABILITY RULE and exactly-once coverage over many seeded random worlds: the simulator's peripheral
/// (notification sizes from 1 to 517 bytes, drops, duplicates, corruption, noise, losses on the peripheral,
/// ignored requests, three readings of SYNC_REQ's window, live events, disconnects) against the machine with
/// random commit delays.
/// Default: a quick sample. `FERRY_SYNC_PROPERTY_RUNS=20000 swift test --filter SyncSessionProperty` for a long run;
/// `FERRY_SYNC_PROPERTY_SEED=N` replays one world.
@Suite struct SyncSessionPropertyTests {
    static var seeds: [UInt64] {
        let env = ProcessInfo.processInfo.environment
        if let one = env["FERRY_SYNC_PROPERTY_SEED"].flatMap(UInt64.init) { return [one] }
        let runs = env["FERRY_SYNC_PROPERTY_RUNS"].flatMap(UInt64.init) ?? 60
        return Array(1...max(1, runs))
    }

    @Test func randomWorldsKeepTheDurabilityRuleAndCoverEveryEventOnce() async throws {
        var failed: [String] = []
        var totals = (sessions: 0, acks: 0, gaps: 0, spurious: 0, race: 0, events: UInt64(0))
        for seed in Self.seeds {
            let world = try SessionWorld(.random(seed: seed))
            if ProcessInfo.processInfo.environment["FERRY_SYNC_TRACE"] != nil { world.trace = [] }
            await world.run()
            if let trace = world.trace { print(trace.suffix(400).joined(separator: "\n")) }
            let problems = world.failures + world.coverageProblems()
            if !problems.isEmpty {
                failed.append("[\(world.config)] " + problems.prefix(3).joined(separator: "; "))
            }
            totals.sessions += world.sessionsStarted
            totals.acks += world.acks.count
            totals.gaps += world.gaps.count
            totals.spurious += world.spuriousGaps.count
            totals.race += world.raceGaps.count
            totals.events += world.head
        }
        let report = "\(failed.count) of \(Self.seeds.count) worlds failed:\n" + failed.prefix(8).joined(separator: "\n")
        #expect(failed.isEmpty, "\(report)")
        // The worlds must actually exercise the machine (a property over nothing proves nothing).
        if Self.seeds.count >= 50 {
            #expect(totals.sessions > Self.seeds.count && totals.acks > 100 && totals.gaps > 0)
        }
        print("sync property: \(Self.seeds.count) worlds, \(totals.events) events, \(totals.sessions) sessions, "
            + "\(totals.acks) acks, \(totals.gaps) gaps; over events the peripheral still had: \(totals.spurious) "
            + "(first frame after a re-request lost), \(totals.race) (decided by a frame sent before the re-request)")
    }

    /// A clean link, no faults: no gap ever, one session, cursor == head.
    @Test(arguments: [true, false]) func cleanLinkNeedsOneSessionAndRecordsNoGap(hasStreamInfo: Bool) async throws {
        var config = SessionWorld.Config(seed: 7)
        config.events = 1000
        config.hasStreamInfo = hasStreamInfo
        let world = try SessionWorld(config)
        await world.run()
        #expect(world.failures.isEmpty, "\(world.failures)")
        #expect(world.coverageProblems().isEmpty, "\(world.coverageProblems())")
        #expect(world.gaps.isEmpty)
        #expect(world.sessionsStarted == 1)
        #expect(world.disconnectReasons == [.caughtUp])
        #expect(world.acks.last == 1000)
    }

    /// Heavy transit loss only (nothing lost on the peripheral): every event arrives, never a GAP.
    @Test(arguments: [true, false]) func transitLossNeverBecomesAGap(hasStreamInfo: Bool) async throws {
        for seed: UInt64 in 1...15 {
            var config = SessionWorld.Config(seed: seed)
            config.events = 300
            config.hasStreamInfo = hasStreamInfo
            config.dropRate = 0.05
            config.corruptRate = 0.05
            config.noiseRate = 0.1
            config.notificationSize = 30
            let world = try SessionWorld(config)
            await world.run()
            #expect(world.failures.isEmpty, "seed \(seed): \(world.failures)")
            #expect(world.coverageProblems().isEmpty, "seed \(seed): \(world.coverageProblems())")
            #expect(world.gaps.isEmpty, "seed \(seed): \(world.gaps)")
        }
    }

    /// Real losses on the peripheral: each becomes a GAP, and nothing else does.
    @Test(arguments: [true, false]) func peripheralLossBecomesExactlyTheGap(hasStreamInfo: Bool) async throws {
        for seed: UInt64 in 1...15 {
            var config = SessionWorld.Config(seed: seed)
            config.events = 300
            config.hasStreamInfo = hasStreamInfo
            config.initiallyLost = seed % 3 == 0 ? 40 : 0
            config.pruneRate = 0.01
            let world = try SessionWorld(config)
            await world.run()
            #expect(world.failures.isEmpty, "seed \(seed): \(world.failures)")
            #expect(world.coverageProblems().isEmpty, "seed \(seed): \(world.coverageProblems())")
        }
    }
}
