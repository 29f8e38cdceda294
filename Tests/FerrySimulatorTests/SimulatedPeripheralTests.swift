import FerryProtocol
import FerrySimulator
import FerryTestSupport
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

    @Test("a buffer overflow per frame (evictPerFrame) loses events mid-replay, and the ground truth names them")
    func evictionPerFrame() async throws {
        var faults = SimulatedPeripheral.Faults()
        faults.evictPerFrame = 0.2
        let peripheral = try SimulatedPeripheral(directory: nil, faults: faults, seed: 6)
        try peripheral.record(count: 200)
        let transport = SimulatedTransport(connectingTo: peripheral, now: 0)
        try await transport.subscribe()
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 0, window: 500).encoded())
        let seen = drain(transport)
        let lost = Set(peripheral.current.lost.flatMap { $0 })
        #expect(!lost.isEmpty && peripheral.statistics.evicted == lost.count)
        // The oldest retained events go, sent or not (nothing is acknowledged here): those not sent yet never are.
        #expect(seen.count < 200, "some events were evicted before their turn")
        #expect(Set(seen).union(lost) == Set(1...200), "every event is either sent or lost")
        #expect(seen == seen.sorted())
    }

    @Test("spareFirstFrameAfterRequest: the first frame after each answered SYNC_REQ arrives intact on a hostile link")
    func firstFrameAfterRequestIsSpared() async throws {
        var faults = SimulatedPeripheral.Faults()
        faults.dropNotification = 0.5
        faults.bitFlipRate = 0.01
        faults.noisePerFrame = 0.5
        faults.spareFirstFrameAfterRequest = true
        var config = SimulatedPeripheral.Configuration()
        config.notificationSize = 20  // the spared frame spans notifications: all of them are spared
        let peripheral = try SimulatedPeripheral(directory: nil, configuration: config, faults: faults, seed: 7)
        try peripheral.record(count: 400)
        let transport = SimulatedTransport(connectingTo: peripheral, now: 0)
        try await transport.subscribe()
        var damagedElsewhere = false
        for from: UInt64 in stride(from: 0, to: 300, by: 15) {
            try await transport.writeControl(Frame.syncRequest(lastCommitted: from, window: 10).encoded())
            let seqs = drain(transport)
            #expect(seqs.first == from + 1, "the first frame after SYNC_REQ(\(from)) is spared")
            if seqs != Array((from + 1)...(from + 10)) { damagedElsewhere = true }
        }
        #expect(damagedElsewhere, "the other frames still suffer the link's faults")
    }

    @Test("how a SYNC_REQ's window counts: from the request, from the last ACK, or as an ACK")
    func requestWindowReadings() async throws {
        func replay(_ reading: SimulatedPeripheral.RequestWindow) async throws -> (seqs: [UInt64], oldest: UInt64) {
            var config = SimulatedPeripheral.Configuration()
            config.requestWindow = reading
            let peripheral = try SimulatedPeripheral(directory: nil, configuration: config, seed: 8)
            try peripheral.record(count: 100)
            let transport = SimulatedTransport(connectingTo: peripheral, now: 0)
            try await transport.subscribe()
            try await transport.writeControl(Frame.syncRequest(lastCommitted: 0, window: 10).encoded())
            _ = drain(transport)
            try await transport.writeControl(Frame.syncAck(committed: 5).encoded())
            _ = drain(transport)
            try await transport.writeControl(Frame.syncRequest(lastCommitted: 8, window: 10).encoded())
            return (drain(transport), peripheral.streamInfo.oldest)
        }
        let fromRequest = try await replay(.fromRequest)
        #expect(fromRequest.seqs == Array(9...18) && fromRequest.oldest == 6)
        let fromLastAck = try await replay(.fromLastAck)
        #expect(fromLastAck.seqs == Array(9...15) && fromLastAck.oldest == 6, "10 beyond the ACK of 5")
        let acknowledges = try await replay(.acknowledges)
        #expect(acknowledges.seqs == Array(9...18) && acknowledges.oldest == 9, "1...8 deleted by the request")
    }

    @Test("each notification says how many SYNC_REQs the peripheral had answered when it sent it")
    func notificationsCarryTheirRequestCount() async throws {
        var config = SimulatedPeripheral.Configuration()
        config.notificationSize = 1_000
        let peripheral = try SimulatedPeripheral(directory: nil, configuration: config, seed: 9)
        try peripheral.record(count: 100)
        let transport = SimulatedTransport(connectingTo: peripheral, now: 0)
        try await transport.subscribe()
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 0, window: 10).encoded())
        try await transport.writeControl(Frame.syncRequest(lastCommitted: 0, window: 20).encoded())
        // The first replay's notification is still on the air (PROTOCOL §4): it was sent after one request.
        guard case .notification = transport.nextDelivery() else { Issue.record("no first notification"); return }
        #expect(transport.lastNotificationRequestsAnswered == 1)
        guard case .notification = transport.nextDelivery() else { Issue.record("no second notification"); return }
        #expect(transport.lastNotificationRequestsAnswered == 2)
    }
}
