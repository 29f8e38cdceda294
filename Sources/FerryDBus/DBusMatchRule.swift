/// A signal match rule: sent to the bus daemon with AddMatch (so the daemon routes matching signals to
/// us) and also applied locally (so each subscriber sees only its own signals, not those another
/// subscriber's rule let in).
public struct DBusMatchRule: Sendable, Hashable, CustomStringConvertible {
    /// Well-known or unique bus name of the emitter.
    public var sender: String?
    public var path: String?
    /// Matches `path` and every object below it.
    public var pathNamespace: String?
    public var interface: String?
    public var member: String?
    /// First argument, when it is a string (e.g. the interface name of PropertiesChanged, or the
    /// bus name of NameOwnerChanged).
    public var arg0: String?

    public init(
        sender: String? = nil, path: String? = nil, pathNamespace: String? = nil, interface: String? = nil,
        member: String? = nil, arg0: String? = nil
    ) {
        self.sender = sender
        self.path = path
        self.pathNamespace = pathNamespace
        self.interface = interface
        self.member = member
        self.arg0 = arg0
    }

    /// The rule in the daemon's syntax.
    public var ruleString: String {
        var parts = ["type='signal'"]
        func add(_ key: String, _ value: String?) {
            // Inside a quoted value only the apostrophe needs escaping: close, escaped quote, reopen.
            if let value { parts.append("\(key)='\(value.split(separator: "'", omittingEmptySubsequences: false).joined(separator: "'\\''"))'") }
        }
        add("sender", sender)
        add("path", path)
        add("path_namespace", pathNamespace)
        add("interface", interface)
        add("member", member)
        add("arg0", arg0)
        return parts.joined(separator: ",")
    }

    public var description: String { ruleString }

    /// Local check. `senderOwner` is the current unique owner of a well-known `sender`, if known.
    func matches(_ signal: DBusSignal, senderOwner: String?) -> Bool {
        if let sender, sender != signal.sender, senderOwner != signal.sender { return false }
        if let path, path != signal.path { return false }
        if let pathNamespace, !Self.isInNamespace(signal.path, pathNamespace) { return false }
        if let interface, interface != signal.interface { return false }
        if let member, member != signal.member { return false }
        if let arg0 {
            guard let first = signal.arguments.first, first.string == arg0 else { return false }
        }
        return true
    }

    static func isInNamespace(_ path: String, _ namespace: String) -> Bool {
        if namespace == "/" || path == namespace { return true }
        return path.hasPrefix(namespace + "/")
    }

    // MARK: The rules BlueZ clients need.

    public static func propertiesChanged(sender: String?, pathNamespace: String? = nil, interface: String? = nil)
        -> DBusMatchRule
    {
        DBusMatchRule(
            sender: sender, pathNamespace: pathNamespace, interface: "org.freedesktop.DBus.Properties",
            member: "PropertiesChanged", arg0: interface)
    }

    /// Every signal `sender` broadcasts. One rule where a rule per member would cost a round trip to the daemon
    /// each (AddMatch is a call), for a subscriber that wants all of them anyway (BlueZ's object cache).
    public static func allSignals(sender: String) -> DBusMatchRule {
        DBusMatchRule(sender: sender)
    }

    public static func interfacesRemoved(sender: String?) -> DBusMatchRule {
        DBusMatchRule(sender: sender, interface: "org.freedesktop.DBus.ObjectManager", member: "InterfacesRemoved")
    }

    /// Owner changes of one bus name (appears, vanishes, restarts).
    public static func nameOwnerChanged(name: String) -> DBusMatchRule {
        DBusMatchRule(
            sender: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            member: "NameOwnerChanged", arg0: name)
    }
}
