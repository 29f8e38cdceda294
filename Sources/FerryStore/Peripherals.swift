import FerryProtocol

/// A peripheral the operator paired with this gateway (`ferry pair`).
public struct TrustedPeripheral: Sendable, Equatable {
    /// The identity address: stable across a peripheral's resolvable private addresses once bonded.
    public var address: PeripheralAddress
    /// "public" or "random".
    public var addressType: String
    public var name: String?
    public var pairingMethod: PairingMethod
    public var pairedAt: Int64

    public init(address: PeripheralAddress, addressType: String, name: String?, pairingMethod: PairingMethod, pairedAt: Int64) {
        self.address = address
        self.addressType = addressType
        self.name = name
        self.pairingMethod = pairingMethod
        self.pairedAt = pairedAt
    }
}

/// How a peripheral's last session ended, as `peripheral_sync_state.last_result` stores it (the raw values are
/// what operators see in `ferry peripherals`: keep them).
public enum SyncResult: Sendable, Equatable, CustomStringConvertible {
    /// The sync state machine disconnected for this reason (its `kind`: "caughtUp", "noResponse", ...).
    case disconnected(SyncSession.DisconnectReason)
    case linkLost
    case subscribeFailed
    /// The store was over its budget or the disk full: nothing committed or acknowledged.
    case backpressure
    /// Not synced: BlueZ lost the bond of a peripheral this gateway paired (require_bond).
    case refusedBondLost
    /// Not synced: never bonded with this gateway (require_bond).
    case refusedNotBonded

    /// The stored text.
    public var description: String {
        switch self {
        case .disconnected(let reason): reason.kind
        case .linkLost: "linkLost"
        case .subscribeFailed: "subscribeFailed"
        case .backpressure: "backpressure"
        case .refusedBondLost: "refused: bond lost"
        case .refusedNotBonded: "refused: not bonded"
        }
    }
}

/// What the last session with a peripheral left behind.
public struct PeripheralSyncState: Sendable, Equatable {
    public var peripheral: PeripheralAddress
    public var lastSyncAt: Int64
    public var lastResult: String
    public var epoch: UInt64?
    public var head: UInt64?

    public init(peripheral: PeripheralAddress, lastSyncAt: Int64, lastResult: String, epoch: UInt64?, head: UInt64?) {
        self.peripheral = peripheral
        self.lastSyncAt = lastSyncAt
        self.lastResult = lastResult
        self.epoch = epoch
        self.head = head
    }
}

extension GatewayStore {
    /// Records (or refreshes, after a re-pairing) a trusted peripheral.
    public func trust(_ peripheral: TrustedPeripheral) throws {
        try store {
            try database.cached(
                """
                INSERT INTO trusted_peripherals (address, address_type, name, pairing_method, paired_at)
                VALUES (?, ?, ?, ?, ?)
                ON CONFLICT (address) DO UPDATE SET address_type = excluded.address_type, name = excluded.name,
                    pairing_method = excluded.pairing_method, paired_at = excluded.paired_at
                """
            ).run([
                .text(peripheral.address.string), .text(peripheral.addressType),
                peripheral.name.map { .text($0) } ?? .null, .text(peripheral.pairingMethod.rawValue),
                .integer(peripheral.pairedAt),
            ])
        }
    }

    /// Forgets a trusted peripheral. Its streams, frames and outbox events stay: they are data already
    /// received, and the uplink still owes them to the backend. Returns false if it was not trusted.
    @discardableResult
    public func forget(_ address: PeripheralAddress) throws -> Bool {
        try store {
            try database.cached("DELETE FROM trusted_peripherals WHERE address = ?").run([.text(address.string)])
            return try database.integer("SELECT changes()") ?? 0 > 0
        }
    }

    public func trustedPeripherals() throws -> [TrustedPeripheral] {
        try store {
            var result: [TrustedPeripheral] = []
            try database.cached(
                "SELECT address, address_type, name, pairing_method, paired_at FROM trusted_peripherals ORDER BY address"
            ).forEach { row in
                // Rows are only written through `trust`, so the address parses; skip rather than crash if not.
                guard let address = PeripheralAddress(row.text(0)) else { return }
                result.append(
                    TrustedPeripheral(
                        address: address, addressType: row.text(1), name: row.optionalText(2),
                        pairingMethod: try Self.pairingMethod(row.text(3)), pairedAt: row.int64(4)))
            }
            return result
        }
    }

    public func trustedPeripheral(_ address: PeripheralAddress) throws -> TrustedPeripheral? {
        try trustedPeripherals().first { $0.address == address }
    }

    /// Notes how a session (or a refusal to start one) ended. Kept separate from the commit transaction:
    /// it is information for operators, and losing it in a crash loses nothing the protocol relies on.
    public func recordSyncState(_ state: PeripheralSyncState) throws {
        try store {
            try database.cached(
                """
                INSERT INTO peripheral_sync_state (peripheral, last_sync_at, last_result, epoch, head)
                VALUES (?, ?, ?, ?, ?)
                ON CONFLICT (peripheral) DO UPDATE SET last_sync_at = excluded.last_sync_at,
                    last_result = excluded.last_result, epoch = coalesce(excluded.epoch, epoch),
                    head = coalesce(excluded.head, head)
                """
            ).run([
                .text(state.peripheral.string), .integer(state.lastSyncAt), .text(state.lastResult),
                state.epoch.map { .text(String($0)) } ?? .null,
                state.head.map { .integer(Int64(bitPattern: $0)) } ?? .null,
            ])
        }
    }

    /// `recordSyncState` at the store clock's now.
    public func recordSessionEnd(peripheral: PeripheralAddress, result: SyncResult, epoch: UInt64?, head: UInt64?) throws {
        try recordSyncState(
            PeripheralSyncState(
                peripheral: peripheral, lastSyncAt: clock.nowMillis(), lastResult: result.description, epoch: epoch,
                head: head))
    }

    public func syncState(_ peripheral: PeripheralAddress) throws -> PeripheralSyncState? {
        try store {
            var result: PeripheralSyncState?
            try database.cached(
                "SELECT last_sync_at, last_result, epoch, head FROM peripheral_sync_state WHERE peripheral = ?"
            ).forEach([.text(peripheral.string)]) { row in
                result = PeripheralSyncState(
                    peripheral: peripheral, lastSyncAt: row.int64(0), lastResult: row.text(1),
                    epoch: row.optionalText(2).flatMap { UInt64($0) },
                    head: row.isNull(3) ? nil : UInt64(bitPattern: row.int64(3)))
            }
            return result
        }
    }

    /// The cursor of a peripheral's active stream (the newest one if several epochs are active).
    public func activeCursor(_ peripheral: PeripheralAddress) throws -> (epoch: UInt64, cursor: UInt64)? {
        try store {
            var result: (UInt64, UInt64)?
            try database.cached(
                """
                SELECT epoch, cursor FROM stream_cursors WHERE peripheral = ? AND active = 1
                ORDER BY updated_at DESC LIMIT 1
                """
            ).forEach([.text(peripheral.string)]) { row in
                if let epoch = UInt64(row.text(0)) { result = (epoch, UInt64(bitPattern: row.int64(1))) }
            }
            return result
        }
    }

    /// The stored method; a value this ferry never writes is a damaged or foreign row, said so rather than guessed.
    static func pairingMethod(_ text: String) throws -> PairingMethod {
        guard let method = PairingMethod(rawValue: text) else {
            throw StoreError.unexpectedValue(column: "trusted_peripherals.pairing_method", value: text)
        }
        return method
    }
}
