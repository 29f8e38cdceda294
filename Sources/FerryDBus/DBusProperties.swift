// org.freedesktop.DBus.Properties on a remote object.

extension DBusConnection {
    public static let propertiesInterface = "org.freedesktop.DBus.Properties"

    /// Reads one property; the variant wrapper is removed.
    public func getProperty(
        destination: String, path: String, interface: String, name: String, timeout: Duration? = nil
    ) async throws -> DBusValue {
        let reply = try await call(
            destination: destination, path: path, interface: Self.propertiesInterface, member: "Get",
            arguments: [.string(interface), .string(name)], timeout: timeout)
        guard let value = reply.arguments.first else {
            throw DBusError(name: DBusError.Name.invalidArgs, message: "Properties.Get returned no value")
        }
        return value.unwrapped
    }

    /// Writes one property (wrapped in a variant as the interface requires).
    public func setProperty(
        destination: String, path: String, interface: String, name: String, value: DBusValue,
        timeout: Duration? = nil
    ) async throws {
        _ = try await call(
            destination: destination, path: path, interface: Self.propertiesInterface, member: "Set",
            arguments: [.string(interface), .string(name), .variant(value)], timeout: timeout)
    }

    /// All properties of one interface; values stay variant-wrapped.
    public func getAllProperties(
        destination: String, path: String, interface: String, timeout: Duration? = nil
    ) async throws -> [String: DBusValue] {
        let reply = try await call(
            destination: destination, path: path, interface: Self.propertiesInterface, member: "GetAll",
            arguments: [.string(interface)], timeout: timeout)
        guard let properties = reply.arguments.first?.dictionary else {
            throw DBusError(name: DBusError.Name.invalidArgs, message: "Properties.GetAll returned \(reply.signature)")
        }
        return properties
    }
}
