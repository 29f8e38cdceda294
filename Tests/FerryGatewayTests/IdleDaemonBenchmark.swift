import FerryBlueZ
import FerryDBus
import Foundation
import Testing
import FerryTestBus
import FerryFakeBlueZ

#if canImport(Glibc)
    import Glibc
#endif

/// CPU of an idle `ferry run` (issue 13 item 4: < 0.5 % of a core over 60 s with nothing to do). A benchmark, not
/// a timed test: it only runs when asked and prints what it measured. The daemon is the real binary in its own
/// process (so its /proc/PID/stat counts only the daemon), on a real dbus-daemon with the fake org.bluez: one
/// adapter, powered, and one allowlisted peripheral BlueZ holds no bond for (require_bond refuses it: nothing to
/// do). Run by scripts/bench-idle; by hand:
///   FERRY_IDLE_BENCH=1 FERRY_BINARY=.build/release/ferry swift test --skip-build --filter IdleDaemonBenchmark
/// FERRY_BASELINE_BINARY=path measures that binary too, in the same run (e.g. one built from main), and prints
/// the ratio. FERRY_IDLE_SECONDS overrides the 60 s window.
@Suite(
    "Idle daemon benchmark", .serialized,
    .enabled(if: ProcessInfo.processInfo.environment["FERRY_IDLE_BENCH"] != nil, "set FERRY_IDLE_BENCH=1 to run"))
struct IdleDaemonBenchmark {
    static let environment = ProcessInfo.processInfo.environment

    /// The ferry binary next to this test bundle unless FERRY_BINARY names another.
    static var binary: String {
        if let path = environment["FERRY_BINARY"] { return path }
        return URL(fileURLWithPath: CommandLine.arguments[0]).deletingLastPathComponent().appendingPathComponent("ferry").path
    }

    struct Usage {
        var cpuSeconds: Double
        var voluntarySwitches: Int
        /// Per thread ("name/tid"), to tell who wakes up.
        var switchesByThread: [String: Int]
    }

    static func usage(of pid: pid_t) throws -> Usage {
        let stat = try String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8)
        guard let close = stat.lastIndex(of: ")") else { throw BenchFailure("unreadable /proc/\(pid)/stat") }
        let fields = stat[stat.index(after: close)...].split(separator: " ")
        // After the command name: field 3 (state) is fields[0]; utime and stime are fields 14 and 15.
        guard fields.count > 12, let user = Double(fields[11]), let system = Double(fields[12]) else {
            throw BenchFailure("unreadable /proc/\(pid)/stat")
        }
        // Wake-ups: every thread's voluntary context switches (a sleeping thread that wakes up and sleeps again).
        var byThread: [String: Int] = [:]
        for thread in (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task")) ?? [] {
            let status = (try? String(contentsOfFile: "/proc/\(pid)/task/\(thread)/status", encoding: .utf8)) ?? ""
            let name = status.split(separator: "\n").first { $0.hasPrefix("Name:") }
                .map { $0.dropFirst(5).trimmingCharacters(in: .whitespaces) } ?? "?"
            byThread["\(name)/\(thread)"] = status.split(separator: "\n").first { $0.hasPrefix("voluntary_ctxt_switches:") }
                .flatMap { Int($0.split(separator: ":")[1].trimmingCharacters(in: .whitespaces)) } ?? 0
        }
        return Usage(
            cpuSeconds: (user + system) / Double(sysconf(Int32(_SC_CLK_TCK))),
            voluntarySwitches: byThread.values.reduce(0, +), switchesByThread: byThread)
    }

    /// Starts `binary` as `ferry run` on `bus`, waits until it is idle, and measures `seconds` of it.
    static func measure(binary: String, label: String, bus: TestBus, uplink: Bool, seconds: Double) async throws -> Double {
        let dir = FileManager.default.temporaryDirectory.appendingPathComponent("ferry-idle-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        defer { try? FileManager.default.removeItem(at: dir) }
        let config = dir.appendingPathComponent("ferry.json")
        // Nothing listens on port 9 (discard); an empty outbox is never posted anyway.
        let uplinkKey = uplink ? #", "uplink": {"endpoint": "http://127.0.0.1:9/ingest", "gateway_id": "bench"}"# : ""
        try #"{"state_dir": "\#(dir.path)/state", "peripherals": ["\#(FakeBlueZ.deviceAddress)"]\#(uplinkKey)}"#
            .write(to: config, atomically: true, encoding: .utf8)
        let logPath = dir.appendingPathComponent("daemon.log").path
        let pid = try spawn([binary, "run", "--config", config.path, "--bus", bus.address, "--log-level", "info"], stderr: logPath)
        defer {
            kill(pid, SIGTERM)
            var status: Int32 = 0
            waitpid(pid, &status, 0)
        }
        // Idle: the adapter is found and the peripheral refused (require_bond); then let start-up settle.
        let deadline = ContinuousClock.now + .seconds(60)
        while !((try? String(contentsOfFile: logPath, encoding: .utf8)) ?? "").contains("not bonded with this gateway") {
            guard ContinuousClock.now < deadline else {
                throw BenchFailure("the daemon did not get idle: \((try? String(contentsOfFile: logPath, encoding: .utf8)) ?? "")")
            }
            try await Task.sleep(for: .milliseconds(100))
        }
        try await Task.sleep(for: .seconds(3))
        let before = try usage(of: pid)
        let start = ContinuousClock.now
        try await Task.sleep(for: .seconds(seconds))
        let after = try usage(of: pid)
        let wall = Double((ContinuousClock.now - start) / .milliseconds(1)) / 1000
        let cpu = after.cpuSeconds - before.cpuSeconds
        let percent = cpu / wall * 100
        print(
            "idle-bench \(label)\(uplink ? " +uplink" : ""): \(String(format: "%.3f", cpu)) s CPU in \(String(format: "%.1f", wall)) s "
                + "= \(String(format: "%.3f", percent)) % of a core (target < 0.5), "
                + "\(String(format: "%.1f", Double(after.voluntarySwitches - before.voluntarySwitches) / wall)) "
                + "wake-ups/s (voluntary context switches, all threads)")
        let busiest = after.switchesByThread.map { ($0.key, $0.value - (before.switchesByThread[$0.key] ?? 0)) }
            .filter { $0.1 > 0 }.sorted { $0.1 > $1.1 }.prefix(6)
        print("idle-bench \(label): wake-ups by thread: " + busiest.map { "\($0.0) \($0.1)" }.joined(separator: ", "))
        return percent
    }

    static func spawn(_ argv: [String], stderr path: String) throws -> pid_t {
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0)
        posix_spawn_file_actions_addopen(&actions, 2, path, O_WRONLY | O_CREAT | O_TRUNC, 0o600)
        // The test runner's threads block signals; the daemon must see our SIGTERM.
        var attributes = posix_spawnattr_t()
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }
        var none = sigset_t()
        sigemptyset(&none)
        posix_spawnattr_setsigmask(&attributes, &none)
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGMASK))
        var cArgs: [UnsafeMutablePointer<CChar>?] = argv.map { strdup($0) } + [nil]
        defer { for arg in cArgs { free(arg) } }
        var pid: pid_t = 0
        let result = posix_spawn(&pid, argv[0], &actions, &attributes, &cArgs, environ)
        guard result == 0 else { throw BenchFailure("cannot start \(argv[0]): \(String(cString: strerror(result)))") }
        return pid
    }

    @Test func idleDaemonCPU() async throws {
        let seconds = Self.environment["FERRY_IDLE_SECONDS"].flatMap(Double.init) ?? 60
        let bus = try TestBus()
        let fake = try await FakeBlueZ.start(on: bus, tree: FakeBlueZ.adapterOnly())
        defer { fake.stop() }
        var runs: [(String, String)] = [("ferry", Self.binary)]
        if let baseline = Self.environment["FERRY_BASELINE_BINARY"] { runs.insert(("baseline", baseline), at: 0) }
        for uplink in [false, true] {
            var measured: [String: Double] = [:]
            for (label, binary) in runs {
                measured[label] = try await Self.measure(binary: binary, label: label, bus: bus, uplink: uplink, seconds: seconds)
            }
            if let base = measured["baseline"], let now = measured["ferry"], now > 0 {
                print("idle-bench\(uplink ? " +uplink" : ""): baseline / ferry = \(String(format: "%.1f", base / now))x")
            }
        }
    }
}

struct BenchFailure: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}
