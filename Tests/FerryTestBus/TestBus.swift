import Foundation
import FerryDBus
import FerryCore

#if canImport(Glibc)
    import Glibc
#endif

// Test support shared by the D-Bus, BlueZ and gateway test targets (a library target, not a test target:
// test targets cannot depend on each other).

/// A private dbus-daemon for one test: own config, own socket in its own temp dir, killed afterwards.
/// Real daemon, real sockets, real fd passing: nothing here is mocked.
public final class TestBus {
    public let directory: URL
    public let address: String
    public let pid: pid_t

    /// `activatable`: bus names the daemon starts on demand, with the command it runs (`.service` files in a
    /// service directory of its own), e.g. a bluetoothd that cannot start.
    public init(activatable: [String: String] = [:]) throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("ferry-dbus-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        let services = directory.appendingPathComponent("services")
        try FileManager.default.createDirectory(at: services, withIntermediateDirectories: true)
        for (name, command) in activatable {
            try "[D-BUS Service]\nName=\(name)\nExec=\(command)\n".write(
                to: services.appendingPathComponent("\(name).service"), atomically: true, encoding: .utf8)
        }
        let config = directory.appendingPathComponent("bus.conf")
        try """
        <!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
         "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
        <busconfig>
          <type>session</type>
          <listen>unix:dir=\(directory.path)</listen>
          <servicedir>\(services.path)</servicedir>
          <auth>EXTERNAL</auth>
          <policy context="default">
            <allow send_destination="*" eavesdrop="true"/>
            <allow eavesdrop="true"/>
            <allow own="*"/>
          </policy>
        </busconfig>
        """.write(to: config, atomically: true, encoding: .utf8)

        // posix_spawn + waitpid instead of Foundation.Process: Process.waitUntilExit hangs here once the
        // forked daemon outlives its parent.
        let outputPath = directory.appendingPathComponent("daemon.out").path
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_addopen(&actions, 1, outputPath, O_WRONLY | O_CREAT | O_TRUNC, 0o600)
        let argv = [
            "/usr/bin/dbus-daemon", "--config-file=\(config.path)", "--print-address=1", "--print-pid=1", "--fork",
        ]
        var cArgs: [UnsafeMutablePointer<CChar>?] = argv.map { strdup($0) } + [nil]
        defer { for arg in cArgs { free(arg) } }
        // The test runner's threads block signals and a spawned child inherits that mask: without a
        // clean mask the daemon would ignore the SIGTERM in deinit and outlive the test.
        var attributes = posix_spawnattr_t()
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }
        var noSignals = sigset_t()
        sigemptyset(&noSignals)
        posix_spawnattr_setsigmask(&attributes, &noSignals)
        var defaults = sigset_t()
        sigemptyset(&defaults)
        sigaddset(&defaults, SIGTERM)
        posix_spawnattr_setsigdefault(&attributes, &defaults)
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF))
        var child: pid_t = 0
        let spawned = posix_spawn(&child, argv[0], &actions, &attributes, &cArgs, environ)
        guard spawned == 0 else { throw TestBusError(message: "posix_spawn dbus-daemon failed: \(spawned)") }
        var status: Int32 = 0
        waitpid(child, &status, 0)
        let text = (try? String(contentsOfFile: outputPath, encoding: .utf8)) ?? ""
        let lines = text.split(separator: "\n").map(String.init)
        guard status == 0, lines.count >= 2, let pid = pid_t(lines[1]) else {
            throw TestBusError(message: "dbus-daemon failed: status \(status), output \(text)")
        }
        address = lines[0]
        self.pid = pid
    }

    public func connect(timeout: Duration = .seconds(5)) async throws -> DBusConnection {
        try await DBusConnection.connect(to: .address(address), defaultCallTimeout: timeout)
    }

    deinit {
        kill(pid, SIGTERM)
        // The daemon is not our child (it forked), so poll for its exit before removing its directory:
        // it deletes its socket on the way out and would race the removal.
        for _ in 0..<200 where isAlive(pid) { usleep(5_000) }
        try? FileManager.default.removeItem(at: directory)
    }
}

/// Running and not a zombie (a container's init may never reap the forked daemon).
private func isAlive(_ pid: pid_t) -> Bool {
    guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
        let close = stat.lastIndex(of: ")")
    else { return false }
    let state = stat[stat.index(after: close)...].split(separator: " ").first
    return state != "Z" && state != "X"
}

public struct TestBusError: Error, CustomStringConvertible {
    public var message: String
    public var description: String { message }
    public init(message: String) { self.message = message }
}

/// Waits for the first element of `stream` satisfying `predicate`, failing after `timeout`.
public func first<T: Sendable>(
    _ stream: AsyncStream<T>, within timeout: Duration = .seconds(5), where predicate: @escaping @Sendable (T) -> Bool = { _ in true }
) async throws -> T {
    try await withThrowingTaskGroup(of: T?.self) { group in
        group.addTask {
            for await element in stream where predicate(element) { return element }
            return nil
        }
        group.addTask {
            try await Task.sleep(for: timeout)
            return nil
        }
        defer { group.cancelAll() }
        guard let result = try await group.next(), let value = result else {
            throw TestBusError(message: "no matching element within \(timeout)")
        }
        return value
    }
}

/// Runs blocking work (waiting for a subprocess, polling a socket) on a thread of its own: the fake org.bluez
/// lives in this test process and answers on the cooperative pool, which a blocked test must not occupy (two
/// suites blocking both pool threads of a 2-core machine starve the fakes, and the subprocess's calls time out).
public func blocking<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
    try await runOnOwnThread(name: "test-blocking") { Result { try body() } }.get()
}

/// The fakes' side of a test (the fake org.bluez's method calls, a test's emulated peripheral) runs on a thread of
/// its own: tasks preferring `shared` run there, so the fakes answer in time while CPU-bound suites keep the
/// cooperative pool busy (two threads on a 2-core machine). Jobs run one at a time; none of them may block. The
/// thread lives as long as the process: one is shared by every fake.
public enum FakeSideExecutor {
    public static let shared = ThreadExecutor(name: "fake-side")
}
