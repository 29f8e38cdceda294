import FerryGateway
import FerrySync
import FerryProtocol
import FerrySimulator
import FerryTestSupport
import Foundation
import Testing

/// The session driver over the simulator, with a whole gateway (the simulator's own tests are FerrySimulatorTests).
@Suite("Session driver")
struct SessionDriverTests {
    @Test("the driver reports a machine that never finishes instead of hanging")
    func stepCap() async throws {
        let dir = try TemporaryDirectory("cap")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: nil, seed: 5)
        try peripheral.record(count: 1_000)
        let gateway = try Gateway(directory: dir)
        gateway.limits.maxSteps = 10
        let record = try await gateway.session(with: peripheral)
        #expect(record.outcome.ending == .stepCapReached)
    }
}
