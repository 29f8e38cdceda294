import FerryCore
import FerryProtocol
import FoundationEssentials
import FerrySync

#if canImport(Glibc)
    import Glibc
#endif

/// sd_notify without libsystemd: one datagram per message to the AF_UNIX socket named in `$NOTIFY_SOCKET`
/// (a path, or an abstract name written with a leading '@'). Under `Type=notify` systemd waits for `READY=1`,
/// shows `STATUS=` in `systemctl status`, and with `WatchdogSec=` restarts the service when `WATCHDOG=1`
/// stops arriving. Outside systemd (no `$NOTIFY_SOCKET`) every send is a no-op.
public struct SystemdNotifier: Sendable {
    /// Where to send, and how often systemd wants a watchdog ping; parsed from the environment.
    public struct Setup: Sendable, Equatable {
        /// The socket address as given ("/run/systemd/notify" or "@abstract").
        public var socket: String?
        /// `$WATCHDOG_USEC` in seconds, when the watchdog is on and meant for this process (`$WATCHDOG_PID`
        /// absent or ours: a child must not ping for its parent).
        public var watchdogSeconds: Double?

        public init(environment: [String: String], pid: Int32) {
            if let path = environment["NOTIFY_SOCKET"], path.hasPrefix("/") || path.hasPrefix("@"),
                path.utf8.count > 1, path.utf8.count < 108
            {
                socket = path
            }
            if let usec = environment["WATCHDOG_USEC"].flatMap({ UInt64($0) }), usec > 0,
                environment["WATCHDOG_PID"].map({ Int32($0) == pid }) ?? true
            {
                watchdogSeconds = Double(usec) / 1_000_000
            }
        }
    }

    public let setup: Setup

    public init(setup: Setup) {
        self.setup = setup
    }

    public static func fromEnvironment() -> SystemdNotifier {
        SystemdNotifier(setup: Setup(environment: ProcessInfo.processInfo.environment, pid: getpid()))
    }

    public var isActive: Bool { setup.socket != nil }

    /// Sends `state` ("READY=1\nSTATUS=..."); returns false when there is no socket or the send failed
    /// (systemd gone: nothing to do about it but keep running).
    @discardableResult
    public func send(_ state: String) -> Bool {
        guard let path = setup.socket else { return false }
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var bytes = Array(path.utf8)
        if bytes.first == UInt8(ascii: "@") { bytes[0] = 0 }  // abstract namespace: no trailing NUL either
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        guard bytes.count <= capacity else { return false }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            for (i, byte) in bytes.enumerated() { raw[i] = byte }
        }
        let length = socklen_t(MemoryLayout<sockaddr_un>.offset(of: \.sun_path)! + bytes.count)
        let payload = Array(state.utf8)
        let sent = withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { socketAddress in
                sendto(fd, payload, payload.count, Int32(MSG_NOSIGNAL), socketAddress, length)
            }
        }
        return sent == payload.count
    }
}

/// The thread that talks to systemd for `ferry run`: READY=1 once the daemon says it is ready, STATUS= when the
/// status line changes, WATCHDOG=1 every half watchdog interval while every part of the daemon makes progress.
/// A thread of its own, not a task: if the cooperative pool is wedged the heartbeats stop, and this thread then
/// stops pinging rather than being wedged with it.
public final class SystemdSupervision: Sendable {
    private let notifier: SystemdNotifier
    private let health: DaemonHealth
    private let log: any LogSink
    private let stopped = LockedValue(false)

    public init(notifier: SystemdNotifier, health: DaemonHealth, log: any LogSink) {
        self.notifier = notifier
        self.health = health
        self.log = log
    }

    /// Starts the thread when `$NOTIFY_SOCKET` is set; otherwise does nothing.
    public func start() {
        guard notifier.isActive else { return }
        if !startThread(name: "ferry-sd-notify", { [self] in loop() }) {
            log.log(.error, "cannot start the systemd notification thread: no READY=1 or watchdog pings will be sent")
        }
    }

    /// Tells systemd we are stopping and ends the thread.
    public func stop() {
        stopped.withLock { $0 = true }
        notifier.send("STOPPING=1\nSTATUS=stopping")
    }

    private func loop() {
        let clock = health.clock
        let watchdog = notifier.setup.watchdogSeconds
        // Ticks often enough for READY to go out promptly and for at least two pings per watchdog interval.
        let tick = min(1, (watchdog ?? 4) / 4)
        var sentReady = false
        var sentStatus = ""
        var lastPing = -Double.infinity
        var lastStale: [WatchdogMonitor.Part] = []
        while !stopped.withLock({ $0 }) {
            let snapshot = health.current
            let now = clock.now()
            var message: [String] = []
            if snapshot.ready && !sentReady {
                message.append("READY=1")
                sentReady = true
            }
            var status = snapshot.status
            let verdict = health.verdict()
            if case .stale(let parts) = verdict {
                status = "not progressing: \(parts.map(\.rawValue).joined(separator: ", ")) (watchdog pings withheld)"
                if parts != lastStale {
                    log.log(
                        .error,
                        "watchdog: \(parts.map(\.rawValue).joined(separator: ", ")) made no progress within its limit; "
                            + (watchdog != nil ? "no longer telling systemd we are alive (it restarts us)" : "no systemd watchdog configured"))
                }
                lastStale = parts
            } else {
                if !lastStale.isEmpty { log.log(.notice, "watchdog: every part makes progress again") }
                lastStale = []
            }
            if status != sentStatus {
                message.append("STATUS=\(status)")
                sentStatus = status
            }
            if let watchdog, sentReady, verdict == .healthy, now - lastPing >= watchdog / 2 {
                message.append("WATCHDOG=1")
                lastPing = now
            }
            if !message.isEmpty { notifier.send(message.joined(separator: "\n")) }
            usleep(useconds_t(tick * 1_000_000))
        }
    }
}
