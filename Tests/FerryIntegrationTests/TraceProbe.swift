import FerryGateway
import FerryProtocol
import FerrySimulator
import FerryStore
import Foundation
import Testing

final class PrintSink: LogSink {
    func log(_ level: LogLevel, _ message: String) { print("[\(level)] \(message)") }
}

@Test(.enabled(if: ProcessInfo.processInfo.environment["FERRY_TRACE"] == "1"))
func traceProbe() async throws {
    let dir = try TemporaryDirectory("trace")
    defer { dir.remove() }
    var config = SimulatedPeripheral.Configuration()
    config.notificationSize = 20
    let peripheral = try SimulatedPeripheral(directory: nil, configuration: config, faults: hostileLink(), seed: 7)
    try peripheral.record(count: 12_000)
    let store = try GatewayStore(path: dir.path("t.sqlite"))
    let clock = ManualClock()
    for session in 0..<30 {
        let transport = SimulatedTransport(connectingTo: peripheral, now: clock.now())
        let runner = SyncSessionRunner(peripheral: PeripheralAddress("C0:FF:EE:00:00:01")!, store: store, transport: transport, clock: clock, log: PrintSink())
        var lastControl = 0
        var probe = FrameDecoder()
        transport.controlHook = { frame in
            lastControl += 1
            print("t=\(clock.now()) CONTROL \(frame.type) \(frame.seq)")
            return .deliver
        }
        var steps = 0
        await runner.start()
        while !runner.finished && steps < 300000 {
            steps += 1
            switch transport.nextDelivery() {
            case .notification(let b):
                clock.advance(by: 0.001)
                var seqs: [UInt64] = []
                probe.feed(b) { seqs.append($0.seq) }
                if !seqs.isEmpty { print("t=\(clock.now()) frames \(seqs)") }
                await runner.receive(b)
            case .linkLost: print("LINK LOST"); await runner.linkLost()
            case .idle:
                guard let d = runner.nextDeadline else { print("quiescent"); break }
                clock.advance(to: d); print("t=\(clock.now()) TIMER"); await runner.timerFired()
            }
            if runner.summary.gapsRecorded > 0 { print("GAP RECORDED"); return }
        }
        print("session \(session) ended \(runner.summary)")
    }
}
