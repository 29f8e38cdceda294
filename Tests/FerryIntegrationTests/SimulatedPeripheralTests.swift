import FerryGateway
import FerrySync
import FerryProtocol
import FerrySimulator
import Foundation
import Testing

/// The simulator is the yardstick of every other test here, so it is tested too: its window, its journal,
/// its captures, and that its referee really catches a misbehaving gateway.
@Suite("Simulated peripheral")
struct SimulatedPeripheralTests {
    /// DATA seqs a central would decode from everything on the air right now.
    func drain(_ transport: SimulatedTransport) -> [UInt64] {
        var decoder = FrameDecoder()
        var seqs: [UInt64] = []
        while case .notification(let bytes) = transport.nextDelivery() {
            decoder.feed(bytes) { seqs.append($0.seq) }
        }
        return seqs
    }

    @Test("replays from SYNC_REQ, never more than the window beyond the last ACK, deletes on ACK")
    func windowAndReplay() async throws {
        var config = SimulatedPeripheral.Configuration()
        config.notificationSize = 7  // frames span notifications
        let peripheral = try SimulatedPeripheral(directory: nil, configuration: config, seed: 1)
        try peripheral.record(count: 50)
        let transport = SimulatedTransport(connectingTo: peripheral, now: 0)
        try await transport.subscribe()
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 0, window: 5).encoded())
        #expect(drain(transport) == [1, 2, 3, 4, 5])
        try await transport.writeControl(Frame.syncAck(committed: 3).encoded())
        #expect(drain(transport) == [6, 7, 8])
        #expect(peripheral.streamInfo == StreamInfo(epoch: peripheral.epoch, oldest: 4, head: 50))
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 3, window: 40).encoded())
        #expect(drain(transport) == Array(4...43))
        try peripheral.record(count: 1)
        #expect(drain(transport) == [], "the window is full")
        try await transport.writeControl(Frame.syncAck(committed: 43).encoded())
        #expect(drain(transport) == Array(44...51))
        #expect(peripheral.violations.isEmpty, "\(peripheral.violations)")
    }

    @Test("the referee catches a gateway that breaks the protocol")
    func refereeCatchesViolations() async throws {
        let peripheral = try SimulatedPeripheral(directory: nil, seed: 2)
        try peripheral.record(count: 30)
        let transport = SimulatedTransport(connectingTo: peripheral, now: 0)
        try await transport.subscribe()
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 0, window: 20).encoded())
        _ = drain(transport)  // 1...20 sent
        try await transport.writeControl(Frame.syncAck(committed: 25).encoded())  // 21... never sent
        try await transport.writeControl(Frame.syncAck(committed: 10).encoded())
        try await transport.writeControl(Frame.syncAck(committed: 5).encoded())  // backwards
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 4).encoded())  // below the ACK
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 99).encoded())  // beyond head
        try await transport.writeControl(Array(Frame.syncAck(committed: 10).encoded().dropLast()))
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 10, window: 0).encoded())
        try await transport.writeControl(Frame(type: .syncAck, seq: 10, payload: [1]).encoded())
        try await transport.writeControl(Frame.data(seq: 1, payload: []).encoded())
        try await transport.writeControl(Frame.syncAck(committed: 10).encoded() + Frame.syncAck(committed: 11).encoded())
        #expect(peripheral.violations.map(\.kind) == [
            .ackAboveSent, .ackBelowAcknowledged, .requestBelowAcknowledged, .requestBeyondHead,
            .malformedControl, .malformedControl, .malformedControl, .malformedControl, .malformedControl,
        ])
    }

    @Test("the journal survives a reboot: same epoch, same retained events, same ground truth")
    func journalSurvivesReboot() async throws {
        let dir = try TemporaryDirectory("journal")
        defer { dir.remove() }
        var config = SimulatedPeripheral.Configuration()
        config.capacity = 100
        let device = dir.url.appendingPathComponent("device")
        let first = try SimulatedPeripheral(directory: device, configuration: config, seed: 3)
        try first.record(count: 150)
        let transport = SimulatedTransport(connectingTo: first, now: 0)
        try await transport.subscribe()
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 0, window: 20).encoded())
        _ = drain(transport)
        try await transport.writeControl(Frame.syncAck(committed: 70).encoded())
        try first.regressCounter()
        try first.record(count: 5)

        let rebooted = try SimulatedPeripheral(directory: device, configuration: config, seed: 99)
        #expect(rebooted.epoch == first.epoch && rebooted.head == 5 && rebooted.streamInfo == first.streamInfo)
        #expect(rebooted.generations.count == 2)
        #expect(rebooted.generations[0].lost == first.generations[0].lost)
        #expect(rebooted.generations[0].lost == [1...50, 71...150])
        #expect(rebooted.generations[0].acknowledgedUpTo == 70 && rebooted.generations[0].highestSent == 90, "the ACK released 71...90")
        #expect(rebooted.generations.map(\.payloads) == first.generations.map(\.payloads))

        let journal = try FileHandle(forWritingTo: device.appendingPathComponent("peripheral.journal"))
        try journal.seekToEnd()
        try journal.write(contentsOf: [0x45, 0x00])  // a torn event record
        try journal.close()
        #expect(throws: SimulatorError.self) {
            _ = try SimulatedPeripheral(directory: device, configuration: config, seed: 99)
        }
    }

    @Test("a capture without noise decodes to every retained event; with noise the decoder sees damage")
    func captures() throws {
        let dir = try TemporaryDirectory("capture")
        defer { dir.remove() }
        let peripheral = try SimulatedPeripheral(directory: nil, seed: 4)
        try peripheral.record(count: 2_000)
        let clean = dir.path("clean.bin")
        try peripheral.writeCapture(to: clean, faults: .none)
        var decoder = FrameDecoder()
        var frames: [Frame] = []
        decoder.feed([UInt8](try Data(contentsOf: URL(fileURLWithPath: clean)))) { frames.append($0) }
        #expect(frames.map(\.seq) == Array(1...2_000))
        #expect(frames.map(\.payload) == peripheral.current.payloads)

        var noise = SimulatedPeripheral.Faults()
        noise.bitFlipRate = 1e-4
        noise.noisePerFrame = 0.01
        noise.oversizeHeaderPerFrame = 0.01
        noise.unknownTypePerFrame = 0.01
        noise.duplicateFrame = 0.01
        let noisy = peripheral.captureBytes(faults: noise)
        var noisyDecoder = FrameDecoder()
        var noisyFrames: [Frame] = []
        noisyDecoder.feed(noisy) { noisyFrames.append($0) }
        noisyDecoder.resolveStall { noisyFrames.append($0) }
        let s = noisyDecoder.statistics
        #expect(s.unknownTypes > 0 && s.oversizeLengths > 0 && s.crcMismatches > 0)
        #expect(Set(noisyFrames.map(\.seq)).count > 1_900, "only the flipped frames are lost")
        #expect(noisyFrames.allSatisfy { peripheral.current.payload(of: $0.seq) == $0.payload })
    }

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
