import FerryBlueZ
import FerryCore
import FerryProtocol
import FerryStore
import FerrySync

/// A failed `ferry pair`, with the operator's next step in the message.
public struct PairingError: Error, CustomStringConvertible, Sendable {
    public var description: String
    public init(_ description: String) { self.description = description }
}

/// The operator's pairing flow: connect, Device1.Pair with Ferry's agent, Trusted, verify the Sync service
/// over the now encrypted link, record the peripheral as trusted under its identity address.
public struct PeripheralPairing: Sendable {
    public struct Result: Sendable {
        /// The identity address (what streams are keyed by).
        public var address: PeripheralAddress
        public var addressType: String
        public var name: String?
        public var method: PairingMethod
        public var bonded: Bool
        public var seconds: Double
    }

    public let client: BlueZClient
    public let adapter: BlueZAdapter
    public let log: any LogSink
    public var connectTimeout: Duration = .seconds(35)
    public var pairTimeout: Duration = .seconds(60)
    /// Someone to ask while pairing runs (a terminal), for numbers that only exist once it has begun: the
    /// passkey a peripheral displays, the number of a numeric comparison. nil: nobody (a script, a service).
    public var operatorPrompt: OperatorPrompt?
    /// Told each step as it begins (`ferry pair`'s progress line at a terminal).
    public var progress: @Sendable (Step) -> Void = { _ in }

    public enum Step: String, Sendable {
        case connecting, pairing, verifying, disconnecting
    }

    /// Questions for the operator during pairing.
    public struct OperatorPrompt: Sendable {
        /// "Type the passkey the peripheral displays": nil refuses.
        public var enterPasskey: @Sendable () async -> UInt32?
        /// "Does the peripheral show NNNNNN?" (six digits, leading zeros).
        public var confirmNumber: @Sendable (_ shown: String) async -> Bool
        public init(
            enterPasskey: @escaping @Sendable () async -> UInt32?,
            confirmNumber: @escaping @Sendable (_ shown: String) async -> Bool
        ) {
            self.enterPasskey = enterPasskey
            self.confirmNumber = confirmNumber
        }
    }

    public init(client: BlueZClient, adapter: BlueZAdapter, log: any LogSink) {
        self.client = client
        self.adapter = adapter
        self.log = log
    }

    /// Pairs with `address`. `passkey`: the number the peripheral displays (passkey entry) or shows for
    /// comparison; without it only Just Works can succeed.
    public func pair(address: PeripheralAddress, passkey: UInt32?, store: GatewayStore) async throws -> Result {
        let clock = SystemMonotonicClock()
        let started = clock.now()
        let requests = LockedValue<[BlueZAgentRequest]>([])
        progress(.connecting)
        let device = try await connect(address)
        let log = self.log
        let prompt = operatorPrompt
        var askPasskey: (@Sendable () async -> UInt32?)?
        var askConfirmation: (@Sendable (UInt32) async -> Bool)?
        if let prompt {
            askPasskey = { await prompt.enterPasskey() }
            askConfirmation = { shown in await prompt.confirmNumber(BlueZAgent.formatPasskey(shown)) }
        }
        let observe: @Sendable (BlueZAgentRequest) -> Void = { request in
            requests.withLock { $0.append(request) }
            switch request {
            case .displayPasskey(_, let shown):
                Logger(sink: log).with(peripheral: address.string).log(.notice, "enter passkey \(shown) on the peripheral")
            case .confirmationRequested(_, let shown):
                Logger(sink: log).with(peripheral: address.string).log(.info, "numeric comparison, the peripheral shows \(BlueZAgent.formatPasskey(shown))")
            case .passkeyRequested:
                Logger(sink: log).with(peripheral: address.string).log(.info, "the peripheral asks for its passkey")
            default: break
            }
        }
        let policy = BlueZAgentPolicy.pairing(
            device: device.path, passkey: passkey, askPasskey: askPasskey, askConfirmation: askConfirmation,
            observe: observe)
        // KeyboardDisplay lets bluetoothd pick passkey entry or numeric comparison (both need the operator's
        // number or the operator); with neither, NoInputNoOutput asks for Just Works, the only method Ferry
        // can then finish.
        let canAnswer = passkey != nil || prompt != nil
        let agent = try await BlueZAgent.register(
            client: client, path: "/ferry/pairing", capability: canAnswer ? .keyboardDisplay : .noInputNoOutput,
            policy: policy, makeDefault: false, log: { log.log(.debug, $0) })
        var method = PairingMethod.existingBond
        do {
            if await device.isBonded() {
                Logger(sink: log).with(peripheral: address.string).log(.info, "BlueZ already holds a bond; verifying it (to pair anew: ferry unpair first)")
            } else {
                progress(.pairing)
                try await pairAndWaitForBond(device)
                method = Self.method(from: requests.withLock { $0 })
            }
            progress(.verifying)
            try await device.setTrusted(true)
            let service = try await verifySyncService(device, address: address)
            // A read over the encrypted link proves the keys work both ways (the peripheral may refuse clear reads).
            if let info = await service.characteristic(uuid: SyncProfile.streamInfoUUID) {
                _ = try await info.readValue()
            }
        } catch {
            await agent.unregister()
            await disconnectAndWait(device)
            throw PairingError("\(address): " + Self.explain(
                    error, requests: requests.withLock { $0 }, passkey: passkey, askedOperator: prompt != nil))
        }
        await agent.unregister()
        let identity = await device.address().flatMap(PeripheralAddress.init) ?? address
        let addressType = await device.addressType() ?? "public"
        let name = await device.name()
        let bonded = await device.isBonded()
        progress(.disconnecting)
        await disconnectAndWait(device)
        try store.trust(
            TrustedPeripheral(
                address: identity, addressType: addressType == "random" ? "random" : "public", name: name,
                pairingMethod: method, pairedAt: SystemWallClock().nowMillis()))
        return Result(
            address: identity, addressType: addressType, name: name, method: method, bonded: bonded,
            seconds: clock.seconds(since: started))
    }

    /// Device1.Pair, done when BlueZ reports the bond. Two things seen with bluetoothd 5.66 in the test bed:
    /// Pair called while the first GATT discovery after connect is still running made the bond but never
    /// replied; so wait for ServicesResolved first, and take Paired/Bonded turning true as success even if
    /// the reply is still outstanding.
    private func pairAndWaitForBond(_ device: BlueZDevice) async throws {
        let devicePath = device.path
        let cache = client.objects
        try? await cache.waitUntil(timeout: .seconds(20)) {
            $0.device(devicePath)?.servicesResolved == true
        }
        let timeout = pairTimeout
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask {
                do {
                    try await device.pair(timeout: timeout)
                } catch let error as BlueZError where error.kind == .alreadyExists {
                    // Bonded between our check and the call (bluetoothd's own security upgrade): fine.
                }
            }
            group.addTask {
                try await cache.waitUntil(timeout: timeout + .seconds(1)) {
                    BlueZDevice.hasBond($0.properties(devicePath, BlueZInterface.device))
                }
                // Give the Pair reply (and an error it might carry) a moment to arrive first.
                try await Task.sleep(for: .milliseconds(500))
            }
            defer { group.cancelAll() }
            try await group.next()
        }
        // The Pair reply can beat the PropertiesChanged signal that reports the bond.
        try? await cache.waitUntil(timeout: .seconds(5)) {
            BlueZDevice.hasBond($0.properties(devicePath, BlueZInterface.device))
        }
        guard await device.isBonded() else {
            throw PairingError("paired but not bonded: the peripheral did not hand over keys, so every reconnect "
                + "would be in clear or pair again; Ferry needs a bond")
        }
    }

    /// Device1.Disconnect returns before the link is down (~2.5 s with bluetoothd 5.66): a command run right
    /// after `ferry pair` would otherwise find the device "connected" and lose the link mid-start.
    private func disconnectAndWait(_ device: BlueZDevice) async {
        try? await device.disconnect()
        let devicePath = device.path
        try? await client.objects.waitUntil(timeout: .seconds(6)) {
            $0.device(devicePath)?.connected != true
        }
    }

    private func connect(_ address: PeripheralAddress) async throws -> BlueZDevice {
        var connector = DeviceConnector(client: client, adapter: adapter, address: address.string) { [log] in
            log.log(.debug, $0)
        }
        connector.waitTimeout = .seconds(30)
        var policy = ConnectRetryPolicy()
        do {
            if let known = await client.knownDevice(address: address.string, on: adapter),
                await known.isConnected()
            {
                return known
            }
            return try await connector.connect(policy: &policy, connectTimeout: connectTimeout)
        } catch let error as BlueZError
            where error.kind == .timeout || error.kind == .unknownObject || error.kind == .notFound
        {
            throw PairingError("\(address): not found on \(adapter.name) (is it advertising and in range?): \(error)")
        } catch {
            throw PairingError("\(address): cannot connect: \(error)")
        }
    }

    private func verifySyncService(_ device: BlueZDevice, address: PeripheralAddress) async throws -> BlueZGattService {
        do {
            return try await device.resolveService(
                uuid: SyncProfile.serviceUUID, characteristicUUIDs: [SyncProfile.dataUUID, SyncProfile.controlUUID],
                timeout: .seconds(20))
        } catch let missing as ServiceMissing {
            // Ferry only keeps bonds it will use: drop the one just made.
            try? await adapter.removeDevice(device.path)
            throw PairingError("not a Sync peripheral (\(missing)); bond removed")
        }
    }

    static func method(from requests: [BlueZAgentRequest]) -> PairingMethod {
        for request in requests {
            switch request {
            case .passkeyRequested, .displayPasskey: return .passkey
            case .confirmationRequested: return .numericComparison
            default: continue
            }
        }
        return .justWorks
    }

    /// One line an operator can act on.
    static func explain(
        _ error: any Error, requests: [BlueZAgentRequest], passkey: UInt32?, askedOperator: Bool = false
    ) -> String {
        let askedForNumber = requests.contains {
            if case .passkeyRequested = $0 { return true }
            if case .confirmationRequested = $0 { return true }
            return false
        }
        guard let bluez = error as? BlueZError else { return "\(error)" }
        switch bluez.kind {
        case .authenticationFailed, .authenticationRejected, .authenticationCanceled:
            if askedForNumber && passkey == nil && !askedOperator {
                return "authentication failed: the peripheral wants a passkey or a confirmed number; run "
                    + "ferry pair in a terminal (it asks), or with --passkey N for a fixed passkey [\(bluez)]"
            }
            if passkey != nil || (askedForNumber && askedOperator) {
                return "authentication failed: wrong passkey or number not confirmed, or the peripheral refused "
                    + "to pair [\(bluez)]"
            }
            return "authentication failed: the peripheral refused Just Works pairing (does it need a passkey? "
                + "then --passkey N) [\(bluez)]"
        case .authenticationTimeout:
            return "pairing timed out: nobody confirmed on the peripheral in time [\(bluez)]"
        case .connectionAttemptFailed, .notConnected:
            return "the link dropped during pairing (out of range?) [\(bluez)]"
        default:
            return bluez.isSecurityRefusal ? LinkSecurity.encryptionProblem(detail: bluez.description) : "\(bluez)"
        }
    }
}

/// The one thing an operator must know when a link was refused for want of security (`BlueZError
/// .isSecurityRefusal`, a session's `refusedForSecurity`): it needed encryption and there was no usable bond.
public enum LinkSecurity {
    /// The sentence for a session that ended on a security refusal, quoting its end as logged; nil for any
    /// other session.
    public static func encryptionProblem(after summary: SyncSummary) -> String? {
        guard summary.refusedForSecurity, let end = summary.end else { return nil }
        return encryptionProblem(detail: end.description)
    }

    /// The sentence, with `detail` (the error or session end as logged) in brackets.
    public static func encryptionProblem(detail: String) -> String {
        "the peripheral's Sync characteristics need an encrypted link and there is no usable bond "
            + "(pairing refused or failed): pair it first with `ferry pair --address ADDR [--passkey N]` [\(detail)]"
    }
}
