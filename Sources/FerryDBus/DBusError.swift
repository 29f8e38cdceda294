/// The one error type of the D-Bus layer: a D-Bus error name and its human message.
///
/// Errors that come back from a peer keep the peer's name verbatim (e.g. `org.bluez.Error.InProgress`),
/// so higher layers classify by name. Failures detected locally use the standard
/// `org.freedesktop.DBus.Error.*` names that libdbus itself would use for the same situation.
public struct DBusError: Error, Sendable, Equatable, CustomStringConvertible {
    public var name: String
    public var message: String

    public init(name: String, message: String) {
        self.name = name
        self.message = message
    }

    public var description: String { message.isEmpty ? name : "\(name): \(message)" }

    /// Well-known names.
    public enum Name {
        public static let failed = "org.freedesktop.DBus.Error.Failed"
        public static let noReply = "org.freedesktop.DBus.Error.NoReply"
        public static let timeout = "org.freedesktop.DBus.Error.Timeout"
        public static let timedOut = "org.freedesktop.DBus.Error.TimedOut"
        public static let serviceUnknown = "org.freedesktop.DBus.Error.ServiceUnknown"
        public static let nameHasNoOwner = "org.freedesktop.DBus.Error.NameHasNoOwner"
        public static let unknownObject = "org.freedesktop.DBus.Error.UnknownObject"
        public static let unknownMethod = "org.freedesktop.DBus.Error.UnknownMethod"
        public static let unknownInterface = "org.freedesktop.DBus.Error.UnknownInterface"
        public static let unknownProperty = "org.freedesktop.DBus.Error.UnknownProperty"
        public static let invalidArgs = "org.freedesktop.DBus.Error.InvalidArgs"
        public static let disconnected = "org.freedesktop.DBus.Error.Disconnected"
        public static let noMemory = "org.freedesktop.DBus.Error.NoMemory"
        public static let accessDenied = "org.freedesktop.DBus.Error.AccessDenied"
        public static let matchRuleInvalid = "org.freedesktop.DBus.Error.MatchRuleInvalid"
        public static let notSupported = "org.freedesktop.DBus.Error.NotSupported"
        /// `org.freedesktop.DBus.Error.Spawn.*`: the bus failed to start an activatable service.
        public static let spawnPrefix = "org.freedesktop.DBus.Error.Spawn."
        /// `org.freedesktop.systemd1.*`, as the bus relays it when systemd could not start the service's unit.
        public static let systemdPrefix = "org.freedesktop.systemd1."
    }

    /// True when no reply came in time (our own deadline, or a peer/daemon timeout).
    public var isTimeout: Bool {
        name == Name.noReply || name == Name.timeout || name == Name.timedOut
    }

    /// True when the bus connection itself is gone: every later call will fail too.
    public var isDisconnected: Bool { name == Name.disconnected }

    static func invalidArgs(_ message: String) -> DBusError { DBusError(name: Name.invalidArgs, message: message) }
    static func disconnected(_ message: String) -> DBusError { DBusError(name: Name.disconnected, message: message) }
}
