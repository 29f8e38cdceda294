import FerryProtocol
import FerrySimulator
import FerryStore
import FerrySync
import Foundation
import Testing
import FerryTestSupport

/// RSS of a long replay through the simulator (issue 13: flat RSS for a 1M-event replay). A benchmark, not a
/// timed test: it only runs when asked and prints the series. One simulated peripheral records in bursts and
/// the gateway syncs each burst through the real session runner into a real SQLite store on disk; the
/// peripheral releases what it got acknowledged (`keepsAcknowledgedPayloads = false`), so the process's
/// memory is the gateway's. RSS (VmRSS) is read at every 10 % of the events; the first sample, after the
/// first 10 %, is the baseline the growth is measured against.
///   FERRY_REPLAY_BENCH=1 swift test --skip-build --filter ReplayMemoryBenchmark     (scripts/bench-replay)
/// FERRY_REPLAY_EVENTS overrides the 1,000,000 events; FERRY_REPLAY_KEEP=1 lets the peripheral keep every payload
/// (the growth the series then shows is the simulator's ground truth: a check that the measurement sees growth).
@Suite(
    "Replay memory benchmark", .serialized,
    .enabled(if: ProcessInfo.processInfo.environment["FERRY_REPLAY_BENCH"] != nil, "set FERRY_REPLAY_BENCH=1 to run"))
struct ReplayMemoryBenchmark {
    static func residentKiB() -> Int {
        let status = (try? String(contentsOfFile: "/proc/self/status", encoding: .utf8)) ?? ""
        return status.split(separator: "\n").first { $0.hasPrefix("VmRSS:") }
            .flatMap { Int($0.split(separator: " ").dropFirst().first ?? "") } ?? 0
    }

    @Test func rssStaysFlatOverAMillionEvents() async throws {
        let total = ProcessInfo.processInfo.environment["FERRY_REPLAY_EVENTS"].flatMap(Int.init) ?? 1_000_000
        let burst = 10_000
        let dir = try TemporaryDirectory("replay")
        defer { dir.remove() }
        let store = try GatewayStore(path: dir.path("gateway.sqlite"))
        var configuration = SimulatedPeripheral.Configuration()
        configuration.keepsAcknowledgedPayloads = ProcessInfo.processInfo.environment["FERRY_REPLAY_KEEP"] != nil
        let peripheral = try SimulatedPeripheral(directory: nil, configuration: configuration, seed: 1)
        let address = PeripheralAddress("C0:FF:EE:00:00:01")!
        let clock = ManualClock(start: 1_000)
        var samples: [(events: Int, kib: Int)] = []
        var sessions = 0
        let started = ContinuousClock.now
        while peripheral.head < UInt64(total) {
            try peripheral.record(count: min(burst, total - Int(peripheral.head)))
            while store.cursorBehind(peripheral) {
                let transport = SimulatedTransport(connectingTo: peripheral, now: clock.now())
                let runner = SyncSessionRunner(peripheral: address, store: store, transport: transport, clock: clock)
                let outcome = await SessionDriver.run(runner: runner, transport: transport, clock: clock)
                sessions += 1
                #expect(outcome.ending == .finished, "\(outcome)")
                guard outcome.ending == .finished, sessions < 10 * total / burst else { return }
                clock.advance(by: 60)
            }
            let events = Int(peripheral.head)
            if events % (total / 10) < burst || events == total {
                samples.append((events, Self.residentKiB()))
                print("replay-bench \(events) events: RSS \(String(format: "%.1f", Double(samples.last!.kib) / 1024)) MiB")
            }
        }
        let seconds = Double((ContinuousClock.now - started) / .milliseconds(1)) / 1000
        let stream = try store.openStream(peripheral: address, deviceEpoch: peripheral.epoch)
        #expect(stream.cursor == UInt64(total), "everything stored")
        let base = samples.first!.kib
        let peak = samples.map(\.kib).max()!
        print(
            "replay-bench: \(total) events in \(sessions) sessions, \(String(format: "%.0f", Double(total) / seconds)) events/s; "
                + "RSS after 10 %: \(String(format: "%.1f", Double(base) / 1024)) MiB, peak \(String(format: "%.1f", Double(peak) / 1024)) MiB, "
                + "last \(String(format: "%.1f", Double(samples.last!.kib) / 1024)) MiB: growth "
                + "\(String(format: "%.1f", Double(peak - base) / 1024)) MiB over the last 90 % (flat: < 8 MiB, bench-ingest's bound)")
    }
}

extension GatewayStore {
    /// The stream's committed cursor is behind what the peripheral holds.
    fileprivate func cursorBehind(_ peripheral: SimulatedPeripheral) -> Bool {
        let stream = try? openStream(peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, deviceEpoch: peripheral.epoch)
        return (stream?.cursor ?? 0) < peripheral.head
    }
}
