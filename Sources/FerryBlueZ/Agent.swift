import FerryCore
import FerryDBus

/// What the agent tells bluetoothd it can do for pairing (Agent1 IO capability).
public enum BlueZAgentCapability: String, Sendable {
    case noInputNoOutput = "NoInputNoOutput"
    case displayOnly = "DisplayOnly"
    case displayYesNo = "DisplayYesNo"
    case keyboardOnly = "KeyboardOnly"
    case keyboardDisplay = "KeyboardDisplay"
}

/// What bluetoothd asked the agent during a pairing: lets the pairing flow tell the operator which method
/// was used and show a passkey the gateway must display.
public enum BlueZAgentRequest: Sendable, Equatable {
    /// RequestPasskey: passkey entry, the peripheral displays the number (MITM-protected).
    case passkeyRequested(device: String)
    /// RequestConfirmation: numeric comparison (LE Secure Connections, MITM-protected).
    case confirmationRequested(device: String, passkey: UInt32)
    /// RequestAuthorization / AuthorizeService: Just Works on an incoming request, or a service.
    case authorizationRequested(device: String)
    /// DisplayPasskey / DisplayPinCode: the operator must type this on the peripheral.
    case displayPasskey(device: String, passkey: String)
    /// Cancel: bluetoothd gave up on the request (timeout, link lost).
    case canceled
}

/// Pairing decisions. Every request names the device object path, so the gateway can allow only the
/// peripherals it manages: bluetoothd starts pairing by itself when a characteristic needs
/// encryption, and with a permissive agent a Just Works device would bond silently.
public struct BlueZAgentPolicy: Sendable {
    /// Authorization requests (Just Works on incoming pairing, service authorization).
    public var authorize: @Sendable (_ devicePath: String) async -> Bool
    /// A passkey to enter for the device, or nil to refuse.
    public var passkey: @Sendable (_ devicePath: String) async -> UInt32?
    /// Numeric comparison: accept only if the number both sides show is the expected one.
    public var confirm: @Sendable (_ devicePath: String, _ shown: UInt32) async -> Bool
    /// Told of every request (before it is answered).
    public var observe: @Sendable (BlueZAgentRequest) -> Void

    /// `confirm` defaults to: the expected passkey if one is known for the device, else `authorize`.
    public init(
        authorize: @escaping @Sendable (_ devicePath: String) async -> Bool,
        passkey: @escaping @Sendable (_ devicePath: String) async -> UInt32? = { _ in nil },
        confirm: (@Sendable (_ devicePath: String, _ shown: UInt32) async -> Bool)? = nil,
        observe: @escaping @Sendable (BlueZAgentRequest) -> Void = { _ in }
    ) {
        self.authorize = authorize
        self.passkey = passkey
        self.confirm =
            confirm ?? { device, shown in
                if let expected = await passkey(device) { return expected == shown }
                return await authorize(device)
            }
        self.observe = observe
    }

    /// Refuses everything: pairing-triggering calls then fail fast instead of hanging until their
    /// D-Bus timeout, which is what happens when no agent is registered at all.
    public static let rejectAll = BlueZAgentPolicy(authorize: { _ in false })

    /// The pairing flow for one device: Just Works is accepted for it; with an operator-provided passkey,
    /// passkey entry answers with it and numeric comparison accepts only that number. Without one, the
    /// operator is asked while pairing runs (`askPasskey`, `askConfirmation`: a terminal), if anyone can be.
    /// Other devices are refused (bluetoothd may start pairings of its own meanwhile).
    public static func pairing(
        device: String, passkey: UInt32?, askPasskey: (@Sendable () async -> UInt32?)? = nil,
        askConfirmation: (@Sendable (_ shown: UInt32) async -> Bool)? = nil,
        observe: @escaping @Sendable (BlueZAgentRequest) -> Void = { _ in }
    ) -> BlueZAgentPolicy {
        BlueZAgentPolicy(
            authorize: { $0 == device },
            passkey: { path in
                guard path == device else { return nil }
                if let passkey { return passkey }
                return await askPasskey?()
            },
            confirm: { path, shown in
                guard path == device else { return false }
                // Without a number or a person to ask, a comparison cannot be checked: accepting it blindly
                // would give up exactly the MITM protection numeric comparison exists for.
                if let passkey { return passkey == shown }
                return await askConfirmation?(shown) ?? false
            },
            observe: observe)
    }
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
        let events = await client.objects.events { event in
            if case .serviceAppeared = event { true } else { false }
        }
        let task = Task { [weak agent] in
            for await _ in events {
                guard let agent else { continue }
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
        case "Release":
            return .reply([])
        case "Cancel":
            policy.observe(.canceled)
            return .reply([])
        case "DisplayPasskey":
            let shown = call.arguments.count > 1 ? call.arguments[1].uint32 ?? 0 : 0
            policy.observe(.displayPasskey(device: device, passkey: formatPasskey(shown)))
            return .reply([])
        case "DisplayPinCode":
            policy.observe(.displayPasskey(device: device, passkey: call.arguments.count > 1 ? call.arguments[1].string ?? "" : ""))
            return .reply([])
        case "RequestPinCode":
            return rejected("PIN codes are not supported")  // legacy BR/EDR pairing; not for LE peripherals
        case "RequestPasskey":
            policy.observe(.passkeyRequested(device: device))
            guard let passkey = await policy.passkey(device) else { return rejected("no passkey for \(device)") }
            return .reply([.uint32(passkey)])
        case "RequestConfirmation":
            let shown = call.arguments.count > 1 ? call.arguments[1].uint32 ?? 0 : 0
            policy.observe(.confirmationRequested(device: device, passkey: shown))
            return await policy.confirm(device, shown)
                ? .reply([]) : rejected("numeric comparison for \(device) not confirmed (\(formatPasskey(shown)))")
        case "RequestAuthorization", "AuthorizeService":
            policy.observe(.authorizationRequested(device: device))
            return await policy.authorize(device) ? .reply([]) : rejected("pairing with \(device) not allowed")
        default:
            return .unknownMethod(call)
        }
    }

    /// "/org/bluez/hci0/dev_C0_FF_EE_00_00_01" → "C0:FF:EE:00:00:01" (for log lines).
    public static func address(ofDevicePath path: String) -> String {
        guard let last = path.split(separator: "/").last, last.hasPrefix("dev_") else { return path }
        return String(last.dropFirst(4).map { $0 == "_" ? ":" : $0 })
    }

    /// Passkeys are six decimal digits with leading zeros, as both sides display them.
    public static func formatPasskey(_ value: UInt32) -> String {
        let digits = String(value)
        return String(repeating: "0", count: max(0, 6 - digits.count)) + digits
    }
}

func mappingErrorsSync<T>(_ body: () throws -> T) throws -> T {
    do {
        return try body()
    } catch let error as DBusError {
        throw BlueZError(error)
    }
}
