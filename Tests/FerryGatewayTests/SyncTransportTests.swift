import FerryBlueZ
import FerryCore
import FerryDBus
import FerryGateway
import FerryProtocol
import FerrySync
import Foundation
import Testing
import FerryTestBus
import FerryFakeBlueZ

/// BlueZSyncTransport against the fake org.bluez: SYNC_REQ keeps its ATT response, SYNC_ACK goes without one
/// when CONTROL allows it, and the DATA subscription is started before the session asks for it (while it
/// reads STREAM_INFO).
@Suite(.serialized) struct SyncTransportTests {
    private func transport(
        _ bus: TestBus, controlFlags: [String], bonded: Bool = true
    ) async throws -> (FakeBlueZ, BlueZSyncTransport) {
        let (fake, transport, _) = try await transportWithEvents(bus, controlFlags: controlFlags, bonded: bonded)
        return (fake, transport)
    }

    private func transportWithEvents(
        _ bus: TestBus, controlFlags: [String], bonded: Bool = true, readingOn thread: ThreadExecutor? = nil
    ) async throws -> (FakeBlueZ, BlueZSyncTransport, LinkEvents) {
        var tree = FakeBlueZ.adapterOnly()
        tree[FakeBlueZ.devicePath] = FakeBlueZ.deviceInterfaces(connected: true, resolved: true)
        tree[FakeBlueZ.devicePath]?[BlueZInterface.device]?["Bonded"] = .bool(bonded)
        tree[FakeBlueZ.devicePath]?[BlueZInterface.device]?["Paired"] = .bool(bonded)
        tree.merge(FakeBlueZ.gattObjects()) { _, new in new }
        tree[FakeBlueZ.controlPath]?[BlueZInterface.gattCharacteristic]?["Flags"] = .strings(controlFlags)
        let fake = try await FakeBlueZ.start(on: bus, tree: tree)
        let client = try await BlueZClient(connection: try await bus.connect())
        let device = client.device(address: FakeBlueZ.deviceAddress, on: try await client.adapter())
        let service = try await device.waitUntilServicesResolved(
            serviceUUID: SyncProfile.serviceUUID, characteristicUUIDs: [SyncProfile.dataUUID])
        let events = LinkEvents()
        let transport = try await BlueZSyncTransport(
            device: device, service: service, events: events, readingOn: thread, log: NullLogSink())
        return (fake, transport, events)
    }

    /// Read by a reader thread of its own, or by the session's thread between its jobs (what SessionWorker does).
    @Test(arguments: [false, true])
    func notificationsReachTheSessionQueueInOrderThenTheLinkEnd(readOnSessionThread: Bool) async throws {
        let bus = try TestBus()
        let thread = readOnSessionThread ? ThreadExecutor(name: "test-session") : nil
        defer { thread?.stop() }
        let (fake, transport, events) = try await transportWithEvents(
            bus, controlFlags: ["write", "write-without-response"], readingOn: thread)
        defer { fake.stop() }
        try await transport.subscribe()
        #expect(transport.notifyMethod == .acquireNotify)
        let sent = (0..<30).map { i in [UInt8](repeating: UInt8(i), count: 10 + i) }
        for chunk in sent { #expect(fake.notifyThroughSocket(chunk)) }
        fake.dropNotifySocket()
        var received: [[UInt8]] = []
        var ended = false
        while !ended, let batch = await events.next() {
            for event in batch {
                switch event {
                case .bytes(let chunk): received.append(chunk)
                case .linkEnded: ended = true
                default: break
                }
            }
        }
        #expect(received == sent)
        #expect(ended, "end of file on the socket is the link's end")
        await transport.disconnect()
    }

    private func waitFor(_ what: String, _ condition: () -> Bool) async throws {
        let deadline = ContinuousClock.now + .seconds(30)
        while !condition() {
            guard ContinuousClock.now < deadline else { throw TransportError("timed out waiting for \(what)") }
            try await Task.sleep(for: .milliseconds(20))
        }
    }

    /// Each pass of `fake.pumpAcquiredWrites()` plays bluetoothd reading CONTROL's write socket.
    private func writesSeen(_ fake: FakeBlueZ) -> [(bytes: [UInt8], type: String, serial: UInt32, id: Int, viaSocket: Bool)] {
        fake.pumpAcquiredWrites()
        return fake.state.withLock { $0.writes }
    }

    /// Without a bond the STREAM_INFO read comes first: a peripheral that wants encryption refuses it, and an
    /// AcquireNotify cut short by the end of that session would leave DATA "acquired" in bluetoothd for good.
    @Test func anUnbondedDeviceIsSubscribedOnlyAfterItsStreamInfoWasRead() async throws {
        let bus = try TestBus()
        let (fake, transport) = try await transport(bus, controlFlags: ["write", "write-without-response"], bonded: false)
        defer { fake.stop() }
        // Time for a subscription started with the transport to reach the fake (the bonded case sees it at once).
        try await Task.sleep(for: .milliseconds(300))
        #expect(!fake.calls.contains { $0.hasPrefix("GattCharacteristic1.AcquireNotify") }, "\(fake.calls)")
        #expect(try await transport.readStreamInfo().count == 26)
        try await transport.subscribe()
        #expect(transport.notifyMethod == .acquireNotify)
        let calls = fake.calls.map { String($0.split(separator: " ")[0]) }
        let read = calls.firstIndex(of: "GattCharacteristic1.ReadValue")
        let acquire = calls.firstIndex(of: "GattCharacteristic1.AcquireNotify")
        #expect(read != nil && acquire != nil && read! < acquire!, "\(calls)")
        await transport.disconnect()
    }

    @Test func acksGoOnTheWriteSocketRequestsWithAResponse() async throws {
        let bus = try TestBus()
        let (fake, transport) = try await transport(bus, controlFlags: ["write", "write-without-response"])
        defer { fake.stop() }
        // Subscribing started with the transport, before the session's subscribe() (STREAM_INFO is read first).
        try await waitFor("AcquireNotify") { fake.calls.contains { $0.hasPrefix("GattCharacteristic1.AcquireNotify") } }
        let info = try await transport.readStreamInfo()
        #expect(info.count == 26)
        try await transport.subscribe()
        #expect(transport.notifyMethod == .acquireNotify)
        #expect(transport.ackWrite == .writeCommand)
        #expect(fake.calls.filter { $0.hasPrefix("GattCharacteristic1.AcquireNotify") }.count == 1)
        let request = Frame.syncRequest(lastCommitted: 0, window: 40).encoded()
        let ack = Frame.syncAck(committed: 20).encoded()
        try await transport.writeControl(request)
        try await transport.writeAck(ack)
        // The first ACK acquires CONTROL's write socket and goes through it: no D-Bus message of its own.
        try await waitFor("the ACK on the write socket") { writesSeen(fake).count == 2 }
        var writes = writesSeen(fake)
        #expect(writes.map(\.type) == ["request", "command"])
        #expect(writes.map(\.viaSocket) == [false, true])
        #expect(writes.map(\.bytes) == [request, ack])
        #expect(fake.calls.filter { $0.hasPrefix("GattCharacteristic1.AcquireWrite") }.count == 1)
        // A SYNC_REQ gives the socket back first (bluetoothd refuses WriteValue while it is held), keeps its
        // response, and goes out after the ACK sent before it.
        let ack2 = Frame.syncAck(committed: 40).encoded()
        try await transport.writeAck(ack2)
        try await transport.writeControl(request)
        writes = writesSeen(fake)
        #expect(writes.map(\.bytes) == [request, ack, ack2, request])
        #expect(writes.map(\.type) == ["request", "command", "command", "request"])
        #expect(fake.state.withLock { $0.writeAcquiredRefusals } == 0)
        // ACKs sent back to back (a grouped commit's cadence boundaries) are seen in the order they were sent,
        // on a socket acquired again.
        let burst = (41...100).map { Frame.syncAck(committed: UInt64($0)).encoded() }
        for bytes in burst { try await transport.writeAck(bytes) }
        try await waitFor("the burst of ACKs") { writesSeen(fake).count == 4 + burst.count }
        #expect(writesSeen(fake).dropFirst(4).map(\.bytes) == burst)
        #expect(writesSeen(fake).dropFirst(4).allSatisfy { $0.viaSocket })
        #expect(fake.calls.filter { $0.hasPrefix("GattCharacteristic1.AcquireWrite") }.count == 2)
        await transport.disconnect()
        // The final ACK is confirmed with a response, which needed the socket given back again.
        #expect(writesSeen(fake).last.map { $0.type == "request" && $0.bytes == burst.last } == true)
    }

    /// bluetoothd notices the closed write socket in its own main loop: a WriteValue that reaches it first is
    /// still refused with "Write acquired". The SYNC_REQ is tried again and goes out.
    @Test func aRequestRefusedWhileBluezStillSeesTheSocketHeldIsRetried() async throws {
        let bus = try TestBus()
        let (fake, transport) = try await transport(bus, controlFlags: ["write", "write-without-response"])
        defer { fake.stop() }
        try await transport.subscribe()
        fake.state.withLock { $0.writeReleaseLag = 3 }
        let ack = Frame.syncAck(committed: 20).encoded()
        try await transport.writeAck(ack)
        let request = Frame.syncRequest(lastCommitted: 20, window: 40).encoded()
        try await transport.writeControl(request)
        #expect(fake.state.withLock { $0.writeAcquiredRefusals } == 3)
        #expect(writesSeen(fake).map(\.bytes) == [ack, request])
        await transport.disconnect()
    }

    /// Without CONTROL's write socket (AcquireWrite refused), ACKs are WriteValue commands without a D-Bus reply.
    @Test func acksFallBackToWriteCommandsWithoutTheSocket() async throws {
        let bus = try TestBus()
        let (fake, transport) = try await transport(bus, controlFlags: ["write", "write-without-response"])
        defer { fake.stop() }
        try await transport.subscribe()
        // Another client holds the socket: bluetoothd refuses our AcquireWrite (and would refuse WriteValue too,
        // so the fake's holder lets go right after).
        fake.state.withLock { $0.writeReleaseLag = 1 }
        var pair: [Int32] = [-1, -1]
        #expect(socketpair(AF_UNIX, Int32(SOCK_SEQPACKET.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0, &pair) == 0)
        fake.state.withLock { $0.writePeer = pair[1] }
        close(pair[0])  // its holder is gone; bluetoothd notices late (the lag): the AcquireWrite is refused
        let ack = Frame.syncAck(committed: 20).encoded()
        try await transport.writeAck(ack)
        try await waitFor("the ACK's WriteValue") { writesSeen(fake).count == 1 }
        #expect(writesSeen(fake).map(\.type) == ["command"])
        #expect(writesSeen(fake).map(\.viaSocket) == [false])
        #expect(fake.state.withLock { $0.writesWithoutReply } == [true])
        await transport.disconnect()
    }

    /// The kernel's Disconnect (the fast teardown) does not wait for queued ATT writes: the last ACK, sent without
    /// response, is confirmed with one first. This host has no kernel Bluetooth (or no such link), so the link then
    /// ends through Device1.Disconnect.
    @Test func disconnectConfirmsTheLastAckWithAResponseBeforeEndingTheLink() async throws {
        let bus = try TestBus()
        let (fake, transport) = try await transport(bus, controlFlags: ["write", "write-without-response"])
        defer { fake.stop() }
        try await transport.subscribe()
        let ack = Frame.syncAck(committed: 60).encoded()
        try await transport.writeAck(ack)
        try await waitFor("the ACK on the write socket") { writesSeen(fake).count == 1 }
        await transport.disconnect()
        let writes = writesSeen(fake)
        #expect(writes.map(\.type) == ["command", "request"])
        #expect(writes.map(\.bytes) == [ack, ack])
        #expect(transport.teardown == .bluez)
        let calls = fake.calls.map { String($0.split(separator: " ")[0]) }
        let confirm = calls.lastIndex(of: "GattCharacteristic1.WriteValue")
        let disconnect = calls.firstIndex(of: "Device1.Disconnect")
        #expect(confirm != nil && disconnect != nil && confirm! < disconnect!, "\(calls)")
    }

    @Test func noConfirmationWhenTheLastAckHadAResponseOrTheLinkIsDown() async throws {
        let bus = try TestBus()
        let (fake, transport) = try await transport(bus, controlFlags: ["write"])
        defer { fake.stop() }
        try await transport.subscribe()
        try await transport.writeAck(Frame.syncAck(committed: 20).encoded())
        await transport.disconnect()
        #expect(fake.state.withLock { $0.writes }.map(\.type) == ["request"])

        let bus2 = try TestBus()
        let (fake2, transport2) = try await self.transport(bus2, controlFlags: ["write", "write-without-response"])
        defer { fake2.stop() }
        try await transport2.subscribe()
        try await transport2.writeAck(Frame.syncAck(committed: 20).encoded())
        try await waitFor("the ACK on the write socket") { writesSeen(fake2).count == 1 }
        try fake2.setProperty(FakeBlueZ.devicePath, BlueZInterface.device, "Connected", DBusValue.bool(false))
        let deadline = ContinuousClock.now + .seconds(10)
        while await transport2.device.isConnected(), ContinuousClock.now < deadline {
            try await Task.sleep(for: .milliseconds(20))
        }
        await transport2.disconnect()
        #expect(writesSeen(fake2).map { $0.type } == ["command"], "a lost link gets no confirmation")
        #expect(transport2.teardown == .bluez, "an unconfirmed final ACK: the slow way")
    }

    /// The kernel's fast Disconnect only after a session that ended in order; anything else the slow, safe way.
    @Test func theKernelDisconnectOnlyWithASettledSubscriptionAndAConfirmedFinalAck() {
        #expect(BlueZSyncTransport.teardown(subscriptionSettled: true, finalAckConfirmed: true) == .kernel)
        #expect(BlueZSyncTransport.teardown(subscriptionSettled: false, finalAckConfirmed: true) == .bluez)
        #expect(BlueZSyncTransport.teardown(subscriptionSettled: true, finalAckConfirmed: false) == .bluez)
        #expect(BlueZSyncTransport.teardown(subscriptionSettled: false, finalAckConfirmed: false) == .bluez)
    }

    @Test func acksKeepTheResponseWhenControlHasNoWriteWithoutResponse() async throws {
        let bus = try TestBus()
        let (fake, transport) = try await transport(bus, controlFlags: ["write"])
        defer { fake.stop() }
        try await transport.subscribe()
        #expect(transport.ackWrite == .writeRequest)
        try await transport.writeAck(Frame.syncAck(committed: 20).encoded())
        #expect(fake.state.withLock { $0.writes.map(\.type) } == ["request"])
        #expect(fake.state.withLock { $0.writesWithoutReply } == [false], "a write request keeps its reply")
        await transport.disconnect()
    }
}
