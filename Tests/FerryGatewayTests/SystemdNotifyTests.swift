import FerryGateway
import FerrySync
import FerryTestSupport
import Foundation
import Testing
import FerryTestBus
import FerryFakeBlueZ

#if canImport(Glibc)
    import Glibc
#endif

/// sd_notify for real: datagrams to a bound AF_UNIX socket (what systemd listens on), and the built `ferry run`
/// as a subprocess against a fake org.bluez on a private dbus-daemon, with `$NOTIFY_SOCKET` pointing at the
/// test: READY=1 only once the adapter is found, WATCHDOG=1 while it runs, none while it is frozen (SIGSTOP).
@Suite(.serialized) struct SystemdNotifyTests {
    @Test(arguments: [false, true]) func datagramsReachAPathOrAnAbstractSocket(abstract: Bool) throws {
        let name = abstract ? "@ferry-test-\(UUID().uuidString.prefix(8))" : NSTemporaryDirectory() + "ferry-notify-\(UUID().uuidString.prefix(8))"
        let listener = try DatagramListener(name)
        defer { listener.close() }
        let notifier = SystemdNotifier(setup: .init(environment: ["NOTIFY_SOCKET": name], pid: getpid()))
        #expect(notifier.send("READY=1\nSTATUS=ok"))
        #expect(listener.receive(timeout: 2) == "READY=1\nSTATUS=ok")
    }

    @Test func ferryRunIsReadyWithAnAdapterPingsTheWatchdogAndStopsPingingWhenFrozen() async throws {
        let bus = try TestBus()
        let fake = try await FakeBlueZ.start(on: bus)
        defer { fake.stop() }
        let run = try FerryRunProcess(bus: bus, watchdogUSec: 1_000_000)
        defer { run.kill() }

        var seen = try await blocking { run.listener.collect(seconds: 30, until: { $0.contains { $0.contains("READY=1") } && $0.filter { $0 == "WATCHDOG=1" }.count >= 2 }) }
        #expect(seen.contains { $0.contains("READY=1") }, "\(seen) \(run.stderr())")
        #expect(seen.filter { $0.contains("WATCHDOG=1") }.count >= 2, "\(seen)")
        #expect(seen.contains { $0.contains("STATUS=0 of 3 slots in use") }, "\(seen)")

        kill(run.pid, SIGSTOP)
        _ = try await blocking { run.listener.collect(seconds: 0.3, until: { _ in false }) }  // what was already queued
        seen = try await blocking { run.listener.collect(seconds: 3, until: { _ in false }) }
        #expect(!seen.contains { $0.contains("WATCHDOG=1") }, "a frozen process sent \(seen)")

        kill(run.pid, SIGCONT)
        seen = try await blocking { run.listener.collect(seconds: 10, until: { $0.contains { $0.contains("WATCHDOG=1") } }) }
        #expect(seen.contains { $0.contains("WATCHDOG=1") }, "\(seen)")

        kill(run.pid, SIGTERM)
        seen = try await blocking { run.listener.collect(seconds: 15, until: { $0.contains { $0.contains("STOPPING=1") } }) }
        #expect(seen.contains { $0.contains("STOPPING=1") }, "\(seen)")
        #expect(try await blocking { run.wait(seconds: 15) } == 0, "\(run.stderr())")
    }

    @Test func ferryRunIsNotReadyWithoutAnAdapterAndSaysWhatItWaitsFor() async throws {
        let bus = try TestBus()
        let fake = try await FakeBlueZ.start(on: bus, tree: [:])
        defer { fake.stop() }
        let run = try FerryRunProcess(bus: bus, watchdogUSec: 1_000_000)
        defer { run.kill() }
        var seen = try await blocking { run.listener.collect(seconds: 20, until: { $0.contains { $0.contains("STATUS=waiting") } }) }
        seen += try await blocking { run.listener.collect(seconds: 2, until: { _ in false }) }  // and still nothing more
        #expect(seen.contains { $0.contains("STATUS=waiting for a Bluetooth adapter") }, "\(seen) \(run.stderr()) \(fake.calls)")
        #expect(!seen.contains { $0.contains("READY=1") || $0.contains("WATCHDOG=1") }, "\(seen)")
    }
}

/// `ferry run` (the built executable) with a notify socket of its own.
final class FerryRunProcess: @unchecked Sendable {  // used from one test at a time
    let listener: DatagramListener
    let process = Process()
    let directory: URL
    var pid: pid_t { process.processIdentifier }

    init(bus: TestBus, watchdogUSec: Int) throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("ferry-notify-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        let state = directory.appendingPathComponent("state").path
        let config = directory.appendingPathComponent("ferry.json")
        try #"{"state_dir": "\#(state)", "require_bond": false, "log_level": "debug"}"#.write(to: config, atomically: true, encoding: .utf8)
        let socketName = "@ferry-notify-test-\(UUID().uuidString.prefix(12))"
        listener = try DatagramListener(socketName)
        let testBinary = URL(fileURLWithPath: "/proc/self/exe").resolvingSymlinksInPath()
        process.executableURL = testBinary.deletingLastPathComponent().appendingPathComponent("ferry")
        process.arguments = ["run", "--config", config.path, "--bus", bus.address]
        var environment = ProcessInfo.processInfo.environment
        environment["NOTIFY_SOCKET"] = socketName
        environment["WATCHDOG_USEC"] = String(watchdogUSec)
        environment["WATCHDOG_PID"] = nil
        process.environment = environment
        process.standardInput = FileHandle.nullDevice
        _ = FileManager.default.createFile(atPath: directory.appendingPathComponent("stderr").path, contents: nil)
        process.standardError = try FileHandle(forWritingTo: directory.appendingPathComponent("stderr"))
        process.standardOutput = FileHandle.nullDevice
        try process.run()
    }

    func stderr() -> String {
        (try? String(contentsOf: directory.appendingPathComponent("stderr"), encoding: .utf8)) ?? ""
    }

    /// Exit status, or nil if it did not exit within `seconds`.
    func wait(seconds: Double) -> Int32? {
        let deadline = Date().addingTimeInterval(seconds)
        while process.isRunning && Date() < deadline { usleep(50_000) }
        return process.isRunning ? nil : process.terminationStatus
    }

    func kill() {
        if process.isRunning {
            Glibc.kill(pid, SIGCONT)
            Glibc.kill(pid, SIGKILL)
            process.waitUntilExit()
        }
        listener.close()
        try? FileManager.default.removeItem(at: directory)
    }
}

/// The systemd side of sd_notify, for tests: a bound AF_UNIX datagram socket.
final class DatagramListener: @unchecked Sendable {  // used from one thread at a time
    let fd: Int32
    let path: String

    init(_ name: String) throws {
        path = name
        fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var bytes = Array(name.utf8)
        if bytes.first == UInt8(ascii: "@") { bytes[0] = 0 }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in for (i, b) in bytes.enumerated() { raw[i] = b } }
        let length = socklen_t(MemoryLayout<sockaddr_un>.offset(of: \.sun_path)! + bytes.count)
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, length) }
        }
        guard bound == 0 else { throw POSIXError(.init(rawValue: errno) ?? .EIO) }
    }

    /// The next datagram, or nil after `timeout` seconds.
    func receive(timeout: Double) -> String? {
        var p = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        guard poll(&p, 1, Int32(timeout * 1000)) == 1 else { return nil }
        var buffer = [UInt8](repeating: 0, count: 4096)
        let n = recv(fd, &buffer, buffer.count, 0)
        guard n >= 0 else { return nil }
        return String(decoding: buffer[..<n], as: UTF8.self)
    }

    func close() {
        _ = Glibc.close(fd)
        if !path.hasPrefix("@") { unlink(path) }
    }
}

extension DatagramListener {
    /// Datagrams received within `seconds`, or fewer once `until` holds for what arrived so far.
    func collect(seconds: Double, until done: ([String]) -> Bool) -> [String] {
        var seen: [String] = []
        let deadline = Date().addingTimeInterval(seconds)
        while !done(seen) {
            let left = deadline.timeIntervalSinceNow
            guard left > 0 else { break }
            if let message = receive(timeout: min(left, 0.5)) { seen.append(message) }
        }
        return seen
    }
}
