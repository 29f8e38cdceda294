import FerryDBus

/// What the agent tells bluetoothd it can do for pairing (Agent1 IO capability).
public enum BlueZAgentCapability: String, Sendable {
    case noInputNoOutput = "NoInputNoOutput"
    case displayOnly = "DisplayOnly"
    case displayYesNo = "DisplayYesNo"
    case keyboardOnly = "KeyboardOnly"
    case keyboardDisplay = "KeyboardDisplay"
}

/// Pairing decisions. Every request names the device object path, so the gateway can allow only the
/// peripherals it manages: bluetoothd starts pairing by itself when a characteristic needs
/// encryption, and with a permissive agent a Just Works device would bond silently.
public struct BlueZAgentPolicy: Sendable {
    /// Confirmation / authorization requests (Just Works, numeric comparison, service authorization).
    public var authorize: @Sendable (_ devicePath: String) async -> Bool
    /// A passkey to enter for the device, or nil to refuse.
    public var passkey: @Sendable (_ devicePath: String) async -> UInt32?

    public init(
        authorize: @escaping @Sendable (_ devicePath: String) async -> Bool,
        passkey: @escaping @Sendable (_ devicePath: String) async -> UInt32? = { _ in nil }
    ) {
        self.authorize = authorize
        self.passkey = passkey
    }

    /// Refuses everything: pairing-triggering calls then fail fast instead of hanging until their
    /// D-Bus timeout, which is what happens when no agent is registered at all.
    public static let rejectAll = BlueZAgentPolicy(authorize: { _ in false })
}

/// An org.bluez.Agent1 exported on the client's connection and registered with AgentManager1.
public final class BlueZAgent: Sendable {
    public let path: String
    public let capability: BlueZAgentCapability
    private let client: BlueZClient
    private let reregistration: LockedValue<Task<Void, Never>?>

    public static let agentInterface = "org.bluez.Agent1"
    public static let managerInterface = "org.bluez.AgentManager1"

    private init(path: String, capability: BlueZAgentCapability, client: BlueZClient) {
        self.path = path
        self.capability = capability
        self.client = client
        reregistration = LockedValue(nil)
    }

    /// Exports the agent at `path`, registers it (as the default agent if `makeDefault`), and
    /// registers it again whenever bluetoothd restarts (a new bluetoothd knows no agents).
    public static func register(
        client: BlueZClient, path: String = "/ferry/agent", capability: BlueZAgentCapability = .noInputNoOutput,
        policy: BlueZAgentPolicy, makeDefault: Bool = true, log: DBusLogSink? = nil
    ) async throws -> BlueZAgent {
        let agent = BlueZAgent(path: path, capability: capability, client: client)
        try mappingErrorsSync { try client.connection.export(path: path) { call in await handle(call, policy) } }
        try await agent.registerWithBluetoothd(makeDefault: makeDefault)
        let events = await client.objects.events()
        let task = Task { [weak agent] in
            for await event in events {
                guard case .serviceAppeared = event, let agent else { continue }
                do {
                    try await agent.registerWithBluetoothd(makeDefault: makeDefault)
                    log?("bluez: agent \(path) registered again after bluetoothd restarted")
                } catch {
                    log?("bluez: re-registering agent \(path) failed: \(error)")
                }
            }
        }
        agent.reregistration.withLock { $0 = task }
        return agent
    }

    /// Unregisters and stops answering.
    public func unregister() async {
        reregistration.withLock { $0?.cancel() }
        _ = try? await client.connection.call(
            destination: client.objects.serviceName, path: "/org/bluez", interface: Self.managerInterface,
            member: "UnregisterAgent", arguments: [.objectPath(path)], timeout: .seconds(5))
        client.connection.unexport(path: path)
    }

    private func registerWithBluetoothd(makeDefault: Bool) async throws {
        let connection = client.connection
        let service = client.objects.serviceName
        try await mappingErrors {
            _ = try await connection.call(
                destination: service, path: "/org/bluez", interface: Self.managerInterface, member: "RegisterAgent",
                arguments: [.objectPath(path), .string(capability.rawValue)], timeout: .seconds(10))
            if makeDefault {
                _ = try await connection.call(
                    destination: service, path: "/org/bluez", interface: Self.managerInterface,
                    member: "RequestDefaultAgent", arguments: [.objectPath(path)], timeout: .seconds(10))
            }
        }
    }

    static func rejected(_ why: String) -> DBusMethodResult {
        .error(DBusError(name: "org.bluez.Error.Rejected", message: why))
    }

    static func handle(_ call: DBusMethodCall, _ policy: BlueZAgentPolicy) async -> DBusMethodResult {
        guard call.interface == agentInterface || call.interface.isEmpty else { return .unknownMethod(call) }
        let device = call.arguments.first?.objectPath ?? ""
        switch call.member {
        case "Release", "Cancel", "DisplayPinCode", "DisplayPasskey":
            return .reply([])
        case "RequestPinCode":
            return rejected("PIN codes are not supported")  // legacy BR/EDR pairing; not for LE peripherals
        case "RequestPasskey":
            guard let passkey = await policy.passkey(device) else { return rejected("no passkey for \(device)") }
            return .reply([.uint32(passkey)])
        case "RequestConfirmation", "RequestAuthorization", "AuthorizeService":
            return await policy.authorize(device) ? .reply([]) : rejected("pairing with \(device) not allowed")
        default:
            return .unknownMethod(call)
        }
    }
}

func mappingErrorsSync<T>(_ body: () throws -> T) throws -> T {
    do {
        return try body()
    } catch let error as DBusError {
        throw BlueZError(error)
    }
}
