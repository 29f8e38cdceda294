import FerryCore
import FerryProtocol
import FerrySimulator
import FerryStore
import FerrySync
import FerryTestSupport
import Foundation
import Testing

/// The per-phase marks of a session (`ferry sync --json` "phases" / "phases_cpu"): every step a caught-up
/// session passes is marked once, in order, on the runner's clock, with the process's CPU alongside.
@Suite("Session phases")
struct SessionPhasesTests {
    @Test func aCaughtUpSessionMarksEveryStepWithItsCPU() async throws {
        let dir = try TemporaryDirectory("phases")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: nil, seed: 5)
        try peripheral.record(count: 500)
        let store = try GatewayStore(path: dir.path("gateway.sqlite"))
        let clock = ManualClock(start: 100)
        let transport = SimulatedTransport(connectingTo: peripheral, now: clock.now())
        let runner = SyncSessionRunner(
            peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, store: store, transport: transport, clock: clock)
        let cpuBefore = ProcessCPU.seconds()
        let outcome = await SessionDriver.run(runner: runner, transport: transport, clock: clock)
        let cpuAfter = ProcessCPU.seconds()
        #expect(outcome.ending == .finished)
        #expect(runner.summary.end == .disconnected(.caughtUp) && runner.summary.framesStored == 500)

        let p = runner.phases
        let times = [p.streamInfo, p.subscribed, p.firstData, p.caughtUp, p.finalAck, p.disconnected]
        #expect(times.allSatisfy { $0 != nil }, "every step reached: \(p)")
        #expect(p.lastData != nil && p.lastData! >= p.firstData!)
        let ordered = [p.streamInfo, p.firstData, p.caughtUp, p.disconnected].compactMap { $0 }
        #expect(ordered == ordered.sorted(), "marks in session order: \(ordered)")

        let c = runner.phasesCPU
        let cpu = [c.streamInfo, c.subscribed, c.firstData, c.caughtUp, c.finalAck, c.disconnected]
        #expect(cpu.allSatisfy { $0 != nil }, "CPU taken at every mark: \(c)")
        #expect(c.lastData == nil, "no getrusage per notification")
        let cpuOrdered = [c.streamInfo, c.firstData, c.caughtUp, c.disconnected].compactMap { $0 }
        #expect(cpuOrdered == cpuOrdered.sorted(), "process CPU only grows: \(cpuOrdered)")
        #expect(cpuOrdered.first! >= cpuBefore && cpuOrdered.last! <= cpuAfter)
    }

    @Test func processCPUIsThisProcesssAndGrowsWithWork() {
        let before = ProcessCPU.seconds()
        var x: UInt64 = 1
        let start = ContinuousClock.now
        while ContinuousClock.now - start < .milliseconds(50) { x = x &* 6364136223846793005 &+ 1 }
        #expect(x != 0)
        let after = ProcessCPU.seconds()
        #expect(before > 0 && after > before, "\(before) -> \(after)")
    }
}
