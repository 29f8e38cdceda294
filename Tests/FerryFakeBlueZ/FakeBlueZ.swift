import FerryBlueZ
import FerryCore
import FerryDBus
import FerryTestBus
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// A minimal org.bluez-shaped service on a private bus: an ObjectManager at "/", an adapter, devices,
/// GATT objects, and just enough method behaviour to exercise the client's plumbing. It is NOT a model
/// of bluetoothd's radio behaviour; real BlueZ runs in the VM test bed.
public final class FakeBlueZ: Sendable {
    public typealias Tree = [String: [String: [String: DBusValue]]]

    public struct State: Sendable {
        public var tree: Tree = [:]
        public var calls: [String] = []  // "Interface.Member path" in arrival order
        public var connectScript: [DBusError?] = []  // popped per Connect; nil = success
        public var discoveryFilter: [String: DBusValue] = [:]
        /// WriteValue calls in the order the client sent them (by D-Bus serial: the fake handles each call in a
        /// task of its own, so the order handlers run in is not the wire's). A write that overtook an earlier
        /// one is put back behind it, so an index seen once can later hold an earlier write: follow by `id`.
        /// Datagrams the client sent on CONTROL's AcquireWrite socket are writes too (type "command",
        /// `viaSocket`), recorded when the fake reads the socket (`pumpAcquiredWrites`), behind the D-Bus writes
        /// seen so far.
        public var writes: [(bytes: [UInt8], type: String, serial: UInt32, id: Int, viaSocket: Bool)] = []
        public var nextWriteID = 0
        /// Per write in `writes`: the caller asked for no reply (NO_REPLY_EXPECTED).
        public var writesWithoutReply: [Bool] = []
        public var acquireNotifyError: DBusError?
        public var startNotifyError: DBusError?
        public var notifyPeer: Int32 = -1  // our end of the AcquireNotify socket pair
        public var writePeer: Int32 = -1  // our end of the AcquireWrite socket pair
        /// After the client closes its write socket, this many more WriteValue/AcquireWrite calls are still
        /// refused with "Write acquired": bluetoothd notices the hang-up in its own main loop, not at once.
        public var writeReleaseLag = 0
        /// How many calls were refused with "Write acquired".
        public var writeAcquiredRefusals = 0
        var releaseLagLeft = 0
        public var deviceAppearsOnDiscovery = false
        /// The next Connect removes the device object and never replies: bluetoothd 5.66 dropping a temporary
        /// device when the last discovery session ends while a Connect on it is pending.
        public var connectRemovesDeviceOnce = false
        /// Announce nothing and leave GetManagedObjects unanswered while discovering: a bluetoothd whose main
        /// loop an advertising flood keeps from its idle callbacks (signals and calls alike).
        public var starvedWhileDiscovering = false
        public var discovering = false
        /// StartDiscovery answers only after this long (a controller slow to take the scan commands).
        public var startDiscoveryDelay: Duration?
        /// Set Adapter1.Powered true fails (a controller that does not come back).
        public var refusePowerOn = false
        public var agents: [(sender: String, path: String, capability: String)] = []
        /// What Device1.Pair does (bluetoothd + the peripheral's SMP, reduced to the agent dialogue).
        public var pairing: PairBehaviour = .justWorks
        /// What ReadValue returns (STREAM_INFO); nil: version 1, epoch 7, oldest 1, head 5000.
        public var streamInfo: [UInt8]?
    }

    public enum PairBehaviour: Sendable {
        /// Bonds without asking the agent (a locally initiated Just Works pairing).
        case justWorks
        /// The peripheral displays `expected`; bluetoothd asks the agent (RequestPasskey).
        case passkey(expected: UInt32)
        /// Both sides show `shown`; bluetoothd asks the agent to confirm (RequestConfirmation).
        case numericComparison(shown: UInt32)
        /// The peripheral refuses pairing.
        case refuse
    }

    public let connection: DBusConnection
    public let state = LockedValue(State())
    /// The Sync profile's GATT UUIDs (PROTOCOL.md §1) as literals: the fake is a FerryBlueZ test tool and must not
    /// link FerryGateway; FerryGatewayTests checks they are SyncProfile's.
    public static let serviceUUID = "f3a70001-8a96-49d6-9124-d674293fa28b"
    public static let dataUUID = "f3a70002-8a96-49d6-9124-d674293fa28b"
    public static let controlUUID = "f3a70003-8a96-49d6-9124-d674293fa28b"
    public static let streamInfoUUID = "f3a70004-8a96-49d6-9124-d674293fa28b"
    public static let adapterPath = "/org/bluez/hci0"
    public static let deviceAddress = "C0:FF:EE:00:00:01"
    public static let devicePath = "/org/bluez/hci0/dev_C0_FF_EE_00_00_01"
    public static let servicePath = devicePath + "/service0010"
    public static let dataPath = servicePath + "/char0011"
    public static let controlPath = servicePath + "/char0014"
    public static let streamInfoPath = servicePath + "/char0016"

    private init(connection: DBusConnection) {
        self.connection = connection
    }

    public static func start(on bus: TestBus, tree: Tree = FakeBlueZ.adapterOnly()) async throws -> FakeBlueZ {
        let fake = FakeBlueZ(connection: try await bus.connect())
        fake.state.withLock { $0.tree = tree }
        try fake.exportAll()
        // A fake started right after another one stopped (a "bluetoothd restart") may find the name still
        // owned: the bus frees it only once it has seen the old connection close.
        let deadline = ContinuousClock.now + .seconds(10)
        while true {
            do {
                try await fake.connection.requestName("org.bluez")
                break
            } catch is DBusError where ContinuousClock.now < deadline {
                try await Task.sleep(for: .milliseconds(50))
            }
        }
        return fake
    }

    public func stop() {
        let peer = state.withLock { s -> Int32 in
            let p = s.notifyPeer
            s.notifyPeer = -1
            return p
        }
        if peer >= 0 { close(peer) }
        let writePeer = state.withLock { s -> Int32 in
            let p = s.writePeer
            s.writePeer = -1
            return p
        }
        if writePeer >= 0 { close(writePeer) }
        connection.close()
    }

    public var calls: [String] { state.withLock { $0.calls } }

    // MARK: Trees

    public static func adapterOnly(powered: Bool = true) -> Tree {
        [
            adapterPath: [
                BlueZInterface.adapter: [
                    "Address": .string("00:AA:BB:CC:DD:EE"), "Powered": .bool(powered), "Discovering": .bool(false),
                ]
            ]
        ]
    }

    public static func deviceInterfaces(connected: Bool = false, resolved: Bool = false) -> [String: [String: DBusValue]] {
        [
            BlueZInterface.device: [
                "Address": .string(deviceAddress), "Adapter": .objectPath(adapterPath), "Connected": .bool(connected),
                "ServicesResolved": .bool(resolved), "UUIDs": .strings([Self.serviceUUID]),
            ]
        ]
    }

    /// The adapter and a resolved device whose only service is Battery (0x180F): a peripheral that is not a Sync
    /// peripheral, whatever its address.
    public static func batteryOnlyDevice() -> Tree {
        let battery = "0000180f-0000-1000-8000-00805f9b34fb"
        var tree = adapterOnly()
        var device = deviceInterfaces(resolved: true)
        device[BlueZInterface.device]?["UUIDs"] = .strings([battery])
        tree[devicePath] = device
        tree[devicePath + "/service0001"] = [
            BlueZInterface.gattService: [
                "UUID": .string(battery), "Device": .objectPath(devicePath), "Primary": .bool(true),
            ]
        ]
        return tree
    }

    public static func gattObjects() -> Tree {
        func characteristic(_ uuid: String, _ flags: [String]) -> [String: [String: DBusValue]] {
            [
                BlueZInterface.gattCharacteristic: [
                    "UUID": .string(uuid), "Service": .objectPath(servicePath), "Flags": .strings(flags),
                    "Notifying": .bool(false), "MTU": .uint16(247),
                ]
            ]
        }
        return [
            servicePath: [
                BlueZInterface.gattService: [
                    "UUID": .string(Self.serviceUUID), "Device": .objectPath(devicePath), "Primary": .bool(true),
                ]
            ],
            dataPath: characteristic(Self.dataUUID, ["notify"]),
            controlPath: characteristic(Self.controlUUID, ["write", "write-without-response"]),
            streamInfoPath: characteristic(Self.streamInfoUUID, ["read"]),
        ]
    }

    // MARK: Mutations that emit the signals bluetoothd would

    public func addObject(_ path: String, _ interfaces: [String: [String: DBusValue]]) throws {
        state.withLock { $0.tree[path, default: [:]].merge(interfaces) { _, new in new } }
        try connection.export(path: path, executor: FakeSideExecutor.shared) { [weak self] call in
            await self?.handle(call) ?? .unknownMethod(call)
        }
        try connection.emitSignal(
            path: "/", interface: BlueZInterface.objectManager, member: "InterfacesAdded",
            arguments: [.objectPath(path), Self.encode(interfaces)])
    }

    /// The object exists (GetManagedObjects and method calls see it) but its InterfacesAdded is not sent: a
    /// bluetoothd whose main loop is too busy to run the idle callback that flushes its signals.
    public func addObjectUnannounced(_ path: String, _ interfaces: [String: [String: DBusValue]]) throws {
        state.withLock { $0.tree[path, default: [:]].merge(interfaces) { _, new in new } }
        try connection.export(path: path, executor: FakeSideExecutor.shared) { [weak self] call in
            await self?.handle(call) ?? .unknownMethod(call)
        }
    }

    public func removeObject(_ path: String) throws {
        let names = state.withLock { s -> [String] in
            let names = s.tree[path].map { Array($0.keys).sorted() } ?? []
            s.tree[path] = nil
            return names
        }
        connection.unexport(path: path)
        try connection.emitSignal(
            path: "/", interface: BlueZInterface.objectManager, member: "InterfacesRemoved",
            arguments: [.objectPath(path), .strings(names)])
    }

    public func setProperty(_ path: String, _ interface: String, _ name: String, _ value: DBusValue) throws {
        state.withLock { $0.tree[path]?[interface]?[name] = value }
        try connection.emitSignal(
            path: path, interface: BlueZInterface.properties, member: "PropertiesChanged",
            arguments: [.string(interface), .properties([name: value]), .strings([])])
    }

    /// Writes one notification into the AcquireNotify socket (one datagram = one notification).
    public func notifyThroughSocket(_ bytes: [UInt8]) -> Bool {
        let fd = state.withLock { $0.notifyPeer }
        guard fd >= 0 else { return false }
        return bytes.withUnsafeBytes { send(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) } == bytes.count
    }

    /// Reads one datagram the client wrote through its AcquireWrite socket (waits up to 10 s for it).
    public func receiveAcquiredWrite() -> [UInt8]? {
        let fd = state.withLock { $0.writePeer }
        guard fd >= 0 else { return nil }
        var ready = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        guard poll(&ready, 1, 10_000) == 1 else { return nil }
        var buffer = [UInt8](repeating: 0, count: 600)
        let n = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, 0) }
        return n >= 0 ? Array(buffer[0..<n]) : nil
    }

    /// What bluetoothd does with CONTROL's write socket: each datagram queued on it becomes a write command
    /// (recorded in `writes`); the client's close releases the characteristic. Tests that watch `writes` call
    /// it before looking; the WriteValue and AcquireWrite handlers call it first.
    public func pumpAcquiredWrites() {
        state.withLock { s in
            guard s.writePeer >= 0 else { return }
            var buffer = [UInt8](repeating: 0, count: 600)
            while true {
                let n = buffer.withUnsafeMutableBytes { recv(s.writePeer, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
                if n > 0 {
                    let serial = s.writes.map(\.serial).max() ?? 0
                    s.writes.append((Array(buffer[0..<n]), "command", serial, s.nextWriteID, true))
                    s.nextWriteID += 1
                    s.writesWithoutReply.append(true)
                    continue
                }
                if n == 0 {  // the client closed its end: released
                    close(s.writePeer)
                    s.writePeer = -1
                    s.releaseLagLeft = s.writeReleaseLag
                }
                return
            }
        }
    }

    /// "Write acquired" while the client holds CONTROL's write socket (or bluetoothd has not yet seen it close).
    private func writeAcquiredRefusal() -> DBusError? {
        pumpAcquiredWrites()
        return state.withLock { s -> DBusError? in
            if s.writePeer >= 0 || s.releaseLagLeft > 0 {
                if s.writePeer < 0 { s.releaseLagLeft -= 1 }
                s.writeAcquiredRefusals += 1
                return DBusError(name: "org.bluez.Error.NotPermitted", message: "Write acquired")
            }
            return nil
        }
    }

    /// Closes our end of the notify socket: the client sees end-of-file, as on link loss.
    public func dropNotifySocket() {
        let fd = state.withLock { s -> Int32 in
            let fd = s.notifyPeer
            s.notifyPeer = -1
            return fd
        }
        if fd >= 0 { close(fd) }
    }

    public static func encode(_ interfaces: [String: [String: DBusValue]]) -> DBusValue {
        .dict(
            keySignature: "s", valueSignature: "a{sv}",
            interfaces.sorted { $0.key < $1.key }.map { DBusDictEntry(key: .string($0.key), value: .properties($0.value)) })
    }

    // MARK: Method handling

    private func exportAll() throws {
        let paths = state.withLock { Array($0.tree.keys) } + ["/", "/org/bluez"]
        for path in paths {
            try connection.export(path: path, executor: FakeSideExecutor.shared) { [weak self] call in
                await self?.handle(call) ?? .unknownMethod(call)
            }
        }
    }

    /// bluetoothd asks the agent the CALLER registered (falling back to the first one), as Device1.Pair does.
    private func pair(_ call: DBusMethodCall) async -> DBusMethodResult {
        let (behaviour, agents) = state.withLock { ($0.pairing, $0.agents) }
        let agent = agents.last { $0.sender == call.sender } ?? agents.first
        func ask(_ member: String, _ arguments: [DBusValue]) async -> DBusReply? {
            guard let agent else { return nil }
            return try? await connection.call(
                destination: agent.sender, path: agent.path, interface: "org.bluez.Agent1", member: member,
                arguments: arguments, timeout: .seconds(5))
        }
        switch behaviour {
        case .justWorks:
            break
        case .refuse:
            return fail("org.bluez.Error.AuthenticationFailed", "Authentication Failed")
        case .passkey(let expected):
            guard let reply = await ask("RequestPasskey", [.objectPath(call.path)]) else {
                return fail("org.bluez.Error.AuthenticationRejected", "Authentication Rejected")
            }
            guard reply.arguments.first?.uint32 == expected else {
                return fail("org.bluez.Error.AuthenticationFailed", "Authentication Failed")
            }
        case .numericComparison(let shown):
            guard await ask("RequestConfirmation", [.objectPath(call.path), .uint32(shown)]) != nil else {
                return fail("org.bluez.Error.AuthenticationRejected", "Authentication Rejected")
            }
        }
        try? setProperty(call.path, BlueZInterface.device, "Paired", .bool(true))
        try? setProperty(call.path, BlueZInterface.device, "Bonded", .bool(true))
        return .reply([])
    }

    private func fail(_ name: String, _ message: String) -> DBusMethodResult {
        .error(DBusError(name: name, message: message))
    }

    private func handle(_ call: DBusMethodCall) async -> DBusMethodResult {
        state.withLock { $0.calls.append("\(call.interface.split(separator: ".").last ?? "").\(call.member) \(call.path)") }
        switch (call.interface, call.member) {
        case (BlueZInterface.objectManager, "GetManagedObjects"):
            for _ in 0..<400 where state.withLock({ $0.starvedWhileDiscovering && $0.discovering }) {
                try? await Task.sleep(for: .milliseconds(50))
            }
            let tree = state.withLock { $0.tree }
            return .reply([
                .dict(
                    keySignature: "o", valueSignature: "a{sa{sv}}",
                    tree.sorted { $0.key < $1.key }.map { DBusDictEntry(key: .objectPath($0.key), value: Self.encode($0.value)) })
            ])
        case (BlueZInterface.properties, "Set"):
            guard call.arguments.count == 3, let interface = call.arguments[0].string, let name = call.arguments[1].string
            else { return fail("org.bluez.Error.InvalidArguments", "Invalid arguments") }
            if interface == BlueZInterface.adapter, name == "Powered", call.arguments[2].unwrapped == .bool(true),
                state.withLock({ $0.refusePowerOn })
            {
                return fail("org.bluez.Error.Failed", "Failed")
            }
            try? setProperty(call.path, interface, name, call.arguments[2].unwrapped)
            return .reply([])
        case ("org.bluez.AgentManager1", "RegisterAgent"):
            guard call.arguments.count == 2, let path = call.arguments[0].objectPath, let capability = call.arguments[1].string
            else { return fail("org.bluez.Error.InvalidArguments", "") }
            state.withLock { $0.agents.append((call.sender, path, capability)) }
            return .reply([])
        case ("org.bluez.AgentManager1", "RequestDefaultAgent"), ("org.bluez.AgentManager1", "UnregisterAgent"):
            return .reply([])
        case (BlueZInterface.adapter, "SetDiscoveryFilter"):
            let filter = (call.arguments.first?.dictionary ?? [:]).mapValues(\.unwrapped)
            state.withLock { $0.discoveryFilter = filter }
            return .reply([])
        case (BlueZInterface.adapter, "StartDiscovery"):
            if let delay = state.withLock({ $0.startDiscoveryDelay }) { try? await Task.sleep(for: delay) }
            try? setProperty(call.path, BlueZInterface.adapter, "Discovering", .bool(true))
            let (appears, starved) = state.withLock { s -> (Bool, Bool) in
                s.discovering = true
                return (s.deviceAppearsOnDiscovery, s.starvedWhileDiscovering)
            }
            if appears {
                if starved { try? addObjectUnannounced(Self.devicePath, Self.deviceInterfaces()) }
                else { try? addObject(Self.devicePath, Self.deviceInterfaces()) }
            }
            return .reply([])
        case (BlueZInterface.adapter, "StopDiscovery"):
            state.withLock { $0.discovering = false }
            try? setProperty(call.path, BlueZInterface.adapter, "Discovering", .bool(false))
            return .reply([])
        case (BlueZInterface.adapter, "RemoveDevice"):
            guard let path = call.arguments.first?.objectPath else { return fail("org.bluez.Error.InvalidArguments", "") }
            try? removeObject(path)
            return .reply([])
        case (BlueZInterface.device, "Connect"):
            if state.withLock({ s in defer { s.connectRemovesDeviceOnce = false }; return s.connectRemovesDeviceOnce }) {
                try? removeObject(call.path)
                try? await Task.sleep(for: .seconds(120))
                return .error(DBusError(name: "org.freedesktop.DBus.Error.NoReply", message: "never answered"))
            }
            let scripted = state.withLock { s -> DBusError?? in s.connectScript.isEmpty ? .none : s.connectScript.removeFirst() }
            if case .some(.some(let error)) = scripted { return .error(error) }
            try? setProperty(call.path, BlueZInterface.device, "Connected", .bool(true))
            return .reply([])
        case (BlueZInterface.device, "Pair"):
            return await pair(call)
        case (BlueZInterface.device, "CancelPairing"):
            return .reply([])
        case (BlueZInterface.device, "Disconnect"):
            try? setProperty(call.path, BlueZInterface.device, "Connected", .bool(false))
            return .reply([])
        case (BlueZInterface.gattCharacteristic, "ReadValue"):
            if let scripted = state.withLock({ $0.streamInfo }) { return .reply([.bytes(scripted)]) }
            // STREAM_INFO: version 1, flags 0, epoch 7, oldest 1, head 5000.
            var bytes: [UInt8] = [1, 0]
            for field: UInt64 in [7, 1, 5000] { bytes += (0..<8).reversed().map { UInt8(truncatingIfNeeded: field >> ($0 * 8)) } }
            return .reply([.bytes(bytes)])
        case (BlueZInterface.gattCharacteristic, "WriteValue"):
            let bytes = call.arguments.first?.bytes ?? []
            let type = call.arguments.count > 1 ? (call.arguments[1].dictionary?["type"]?.string ?? "") : ""
            if let refusal = writeAcquiredRefusal() { return .error(refusal) }
            state.withLock {
                let index = $0.writes.lastIndex { $0.serial < call.serial }.map { $0 + 1 } ?? 0
                $0.writes.insert((bytes, type, call.serial, $0.nextWriteID, false), at: index)
                $0.nextWriteID += 1
                $0.writesWithoutReply.insert(call.noReplyExpected, at: index)
            }
            return .reply([])
        case (BlueZInterface.gattCharacteristic, "AcquireNotify"):
            if let error = state.withLock({ $0.acquireNotifyError }) { return .error(error) }
            var pair: [Int32] = [-1, -1]
            guard socketpair(AF_UNIX, Int32(SOCK_SEQPACKET.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0, &pair) == 0 else {
                return fail("org.bluez.Error.Failed", "socketpair failed")
            }
            state.withLock { $0.notifyPeer = pair[1] }
            try? setProperty(call.path, BlueZInterface.gattCharacteristic, "NotifyAcquired", .bool(true))
            // The reply carries a duplicate; our copy of the client's end is released with the value.
            return .reply([.unixFD(DBusUnixFD(adopting: pair[0])), .uint16(247)])
        case (BlueZInterface.gattCharacteristic, "AcquireWrite"):
            if let refusal = writeAcquiredRefusal() { return .error(refusal) }
            var pair: [Int32] = [-1, -1]
            guard socketpair(AF_UNIX, Int32(SOCK_SEQPACKET.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0, &pair) == 0 else {
                return fail("org.bluez.Error.Failed", "socketpair failed")
            }
            _ = fcntl(pair[1], F_SETFL, fcntl(pair[1], F_GETFL) | O_NONBLOCK)
            state.withLock { $0.writePeer = pair[1] }
            return .reply([.unixFD(DBusUnixFD(adopting: pair[0])), .uint16(247)])
        case (BlueZInterface.gattCharacteristic, "StartNotify"):
            if let error = state.withLock({ $0.startNotifyError }) { return .error(error) }
            try? setProperty(call.path, BlueZInterface.gattCharacteristic, "Notifying", .bool(true))
            return .reply([])
        case (BlueZInterface.gattCharacteristic, "StopNotify"):
            try? setProperty(call.path, BlueZInterface.gattCharacteristic, "Notifying", .bool(false))
            return .reply([])
        default:
            return .unknownMethod(call)
        }
    }
}
