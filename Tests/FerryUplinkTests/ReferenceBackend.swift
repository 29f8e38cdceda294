// Starts the real reference backend (scripts/backend/ferry-backend) on loopback for a test.

import Foundation

#if canImport(FoundationNetworking)
    import FoundationNetworking
#endif

enum TestSupport {
    /// The package root, found from this file's path (tests run from anywhere).
    static let packageRoot: URL = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    static let backendScript = packageRoot.appendingPathComponent("scripts/backend/ferry-backend").path

    static func temporaryDirectory() throws -> URL {
        let url = FileManager.default.temporaryDirectory
            .appendingPathComponent("ferry-uplink-test-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
        return url
    }

    /// Runs a command to completion; returns (status, stdout+stderr).
    @discardableResult
    static func run(_ executable: String, _ arguments: [String], environment: [String: String]? = nil) throws -> (
        Int32, String
    ) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: executable)
        process.arguments = arguments
        if let environment { process.environment = environment }
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = pipe
        try process.run()
        let output = pipe.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        return (process.terminationStatus, String(decoding: output, as: UTF8.self))
    }

    static func which(_ name: String) -> String? {
        for directory in (ProcessInfo.processInfo.environment["PATH"] ?? "/usr/bin:/bin").split(separator: ":") {
            let candidate = "\(directory)/\(name)"
            if FileManager.default.isExecutableFile(atPath: candidate) { return candidate }
        }
        return nil
    }

    /// A self-signed certificate for 127.0.0.1 made with the openssl CLI.
    static func makeSelfSignedCertificate(in directory: URL) throws -> (cert: String, key: String) {
        let cert = directory.appendingPathComponent("cert.pem").path
        let key = directory.appendingPathComponent("key.pem").path
        let (status, output) = try run(
            which("openssl") ?? "/usr/bin/openssl",
            [
                "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                "-addext", "subjectAltName=IP:127.0.0.1",
            ])
        guard status == 0 else { throw TestFailure("openssl failed: \(output)") }
        return (cert, key)
    }
}

struct TestFailure: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}

/// One `ferry-backend serve` process with `--port 0 --port-file`, stopped with SIGTERM.
final class ReferenceBackend: @unchecked Sendable {
    let directory: URL
    let database: String
    let port: Int
    let scheme: String
    private let process: Process

    init(arguments extra: [String] = [], scheme: String = "http") throws {
        directory = try TestSupport.temporaryDirectory()
        database = directory.appendingPathComponent("backend.db").path
        self.scheme = scheme
        let portFile = directory.appendingPathComponent("port").path
        process = Process()
        process.executableURL = URL(fileURLWithPath: TestSupport.which("python3") ?? "/usr/bin/python3")
        process.arguments =
            [
                TestSupport.backendScript, "serve", "--db", database, "--port", "0", "--port-file", portFile,
                "--quiet", "--control",
            ] + extra
        process.standardOutput = FileHandle.nullDevice
        try process.run()
        let deadline = Date().addingTimeInterval(15)
        var found: Int?
        while found == nil {
            if let text = try? String(contentsOfFile: portFile, encoding: .utf8),
                let value = Int(text.trimmingCharacters(in: .whitespacesAndNewlines))
            {
                found = value
            } else if !process.isRunning {
                throw TestFailure("ferry-backend exited with \(process.terminationStatus)")
            } else if Date() > deadline {
                process.terminate()
                throw TestFailure("ferry-backend wrote no port file within 15 s")
            } else {
                usleep(20_000)
            }
        }
        port = found!
    }

    var endpoint: URL { URL(string: "\(scheme)://127.0.0.1:\(port)/ingest")! }

    func stop() {
        if process.isRunning {
            process.terminate()
            process.waitUntilExit()
        }
        try? FileManager.default.removeItem(at: directory)
    }

    deinit { stop() }

    /// `ferry-backend stats --db` as a dictionary.
    func stats() throws -> [String: Any] {
        let (status, output) = try TestSupport.run(
            TestSupport.which("python3") ?? "/usr/bin/python3", [TestSupport.backendScript, "stats", "--db", database])
        guard status == 0, let object = try JSONSerialization.jsonObject(with: Data(output.utf8)) as? [String: Any]
        else { throw TestFailure("stats failed: \(output)") }
        return object
    }

    func stat(_ name: String) throws -> Int {
        (try stats()[name] as? Int) ?? -1
    }

    /// Changes fault settings through the control endpoint (plain http only).
    func control(_ settings: [String: Any]) async throws {
        var request = URLRequest(url: URL(string: "http://127.0.0.1:\(port)/_ferry/control")!)
        request.httpMethod = "POST"
        request.httpBody = try JSONSerialization.data(withJSONObject: settings)
        request.setValue("application/json", forHTTPHeaderField: "Content-Type")
        let (_, response) = try await URLSession.shared.data(for: request)
        guard (response as? HTTPURLResponse)?.statusCode == 200 else { throw TestFailure("control refused") }
    }
}
