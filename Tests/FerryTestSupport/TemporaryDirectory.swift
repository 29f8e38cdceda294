import Foundation

/// A fresh directory under the system temp dir for one test, removed by `remove()`.
public struct TemporaryDirectory: Sendable {
    public let url: URL

    /// `label` names the directory (`ferry-test-LABEL-xxxxxxxx`), to tell a test's leftovers apart.
    public init(_ label: String) throws {
        url = FileManager.default.temporaryDirectory.appendingPathComponent(
            "ferry-test-\(label)-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
    }

    public func path(_ name: String) -> String { url.appendingPathComponent(name).path }

    public func remove() { try? FileManager.default.removeItem(at: url) }
}
