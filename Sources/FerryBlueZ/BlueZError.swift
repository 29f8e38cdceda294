import FerryDBus

/// What went wrong, by BlueZ's own error names plus the D-Bus-level failures a BlueZ client meets.
public enum BlueZErrorKind: String, Sendable, Equatable, CaseIterable {
    // org.bluez.Error.*
    case inProgress
    case failed
    case notReady
    case notPermitted
    case notSupported
    case notAuthorized
    case notAvailable
    case notConnected
    case alreadyConnected
    case alreadyExists
    case doesNotExist
    case invalidArguments
    case invalidValueLength
    case invalidOffset
    case authenticationFailed
    case authenticationCanceled
    case authenticationRejected
    case authenticationTimeout
    case connectionAttemptFailed
    // D-Bus level
    /// No reply in time (our deadline or a daemon/peer timeout).
    case timeout
    /// bluetoothd is not on the bus (never started, crashed, restarting, or the bus failed to activate it).
    case serviceUnknown
    /// The object path is gone (device removed, adapter unplugged).
    case unknownObject
    case accessDenied
    /// The system bus connection itself is gone.
    case disconnected
    /// Local: the cache has no such adapter / device / service / characteristic.
    case notFound
    /// Local: BlueZ answered with an unexpected shape.
    case unexpectedReply
    case other
}

/// The one error type of FerryBlueZ.
public struct BlueZError: Error, Sendable, Equatable, CustomStringConvertible {
    public var kind: BlueZErrorKind
    /// The D-Bus error name as received (empty for local errors).
    public var name: String
    public var message: String

    public init(kind: BlueZErrorKind, name: String = "", message: String) {
        self.kind = kind
        self.name = name
        self.message = message
    }

    public init(_ error: DBusError) {
        self.init(kind: Self.kind(forName: error.name), name: error.name, message: error.message)
    }

    public var description: String {
        name.isEmpty ? "\(kind): \(message)" : "\(kind) (\(name)): \(message)"
    }

    /// The ATT error code of a failed GATT operation, where bluetoothd gives it only in the message
    /// (org.bluez.Error.Failed "Operation failed with ATT error: 0x0e"); nil otherwise. Read from BlueZ's text
    /// here, once, so that nothing past this type looks at error messages.
    public var attErrorCode: UInt8? {
        let text = message.lowercased()
        guard let marker = text.firstRange(of: "att error: 0x") else { return nil }
        let digits = text[marker.upperBound...].prefix { $0.isHexDigit }
        guard digits.count == 2 else { return nil }
        return UInt8(digits, radix: 16)
    }

    /// ATT errors a peripheral answers when a characteristic needs more security than the link has:
    /// 0x05 insufficient authentication, 0x08 insufficient authorization, 0x0c insufficient encryption key
    /// size, 0x0e unlikely error (what bluetoothd 5.66 reports when the pairing it started was refused),
    /// 0x0f insufficient encryption.
    public static let securityATTErrorCodes: Set<UInt8> = [0x05, 0x08, 0x0c, 0x0e, 0x0f]

    /// The peripheral (or bluetoothd for it) refused for want of security: the link needed encryption, or
    /// authentication failed, and there was no usable bond.
    public var isSecurityRefusal: Bool {
        switch kind {
        case .authenticationFailed, .authenticationRejected, .authenticationCanceled: return true
        default: return attErrorCode.map(Self.securityATTErrorCodes.contains) ?? false
        }
    }

    static func kind(forName name: String) -> BlueZErrorKind {
        let bluezPrefix = "org.bluez.Error."
        if name.hasPrefix(bluezPrefix) {
            switch name.dropFirst(bluezPrefix.count) {
            case "InProgress": return .inProgress
            case "Failed": return .failed
            case "NotReady": return .notReady
            case "NotPermitted": return .notPermitted
            case "NotSupported": return .notSupported
            case "NotAuthorized": return .notAuthorized
            case "NotAvailable": return .notAvailable
            case "NotConnected": return .notConnected
            case "AlreadyConnected": return .alreadyConnected
            case "AlreadyExists": return .alreadyExists
            case "DoesNotExist": return .doesNotExist
            case "InvalidArguments": return .invalidArguments
            case "InvalidValueLength": return .invalidValueLength
            case "InvalidOffset": return .invalidOffset
            case "AuthenticationFailed": return .authenticationFailed
            case "AuthenticationCanceled": return .authenticationCanceled
            case "AuthenticationRejected": return .authenticationRejected
            case "AuthenticationTimeout": return .authenticationTimeout
            case "ConnectionAttemptFailed": return .connectionAttemptFailed
            default: return .other
            }
        }
        // The bus could not start bluetoothd for us (org.bluez is activatable, the activation failed: no
        // systemd, the unit disabled or masked): for the caller it is not running, as with ServiceUnknown.
        if name.hasPrefix(DBusError.Name.spawnPrefix) || name.hasPrefix(DBusError.Name.systemdPrefix) {
            return .serviceUnknown
        }
        switch name {
        case DBusError.Name.noReply, DBusError.Name.timeout, DBusError.Name.timedOut: return .timeout
        case DBusError.Name.serviceUnknown, DBusError.Name.nameHasNoOwner: return .serviceUnknown
        case DBusError.Name.unknownObject, DBusError.Name.unknownMethod, DBusError.Name.unknownInterface:
            // bluetoothd answers UnknownMethod/UnknownObject for a path it no longer exports.
            return .unknownObject
        case DBusError.Name.accessDenied: return .accessDenied
        case DBusError.Name.disconnected: return .disconnected
        case DBusError.Name.invalidArgs: return .invalidArguments
        default: return .other
        }
    }

    static func notFound(_ message: String) -> BlueZError { BlueZError(kind: .notFound, message: message) }
    static func unexpectedReply(_ message: String) -> BlueZError { BlueZError(kind: .unexpectedReply, message: message) }
}

/// Runs a D-Bus operation and re-throws its DBusError as a BlueZError (cancellation passes through).
func mappingErrors<T>(
    isolation: isolated (any Actor)? = #isolation, _ body: () async throws -> T
) async throws -> T {
    do {
        return try await body()
    } catch let error as DBusError {
        throw BlueZError(error)
    }
}
