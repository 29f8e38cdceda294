import FerryCore
import FerryStore
import FoundationEssentials
import FerrySync

#if canImport(Glibc)
    import Glibc
#endif

/// Where the metrics endpoint listens (`metrics_listen`): an IP literal and a port, "127.0.0.1:9464" or
/// "[::1]:9464". Literals only: no name lookup at start, and the operator sees exactly which interface is open.
public struct ListenAddress: Sendable, Equatable, CustomStringConvertible {
    public var host: String
    public var port: UInt16
    public var isIPv6: Bool

    public init(host: String, port: UInt16) {
        self.host = host
        self.port = port
        isIPv6 = host.contains(":")
    }

    /// nil when `text` is not "IPv4:port" or "[IPv6]:port" with a port in 1...65535.
    public init?(_ text: String) {
        let host: Substring
        let portText: Substring
        if text.hasPrefix("[") {
            guard let close = text.firstIndex(of: "]"), text[text.index(after: close)...].hasPrefix(":") else { return nil }
            host = text[text.index(after: text.startIndex)..<close]
            portText = text[text.index(close, offsetBy: 2)...]
        } else {
            guard let colon = text.lastIndex(of: ":"), !text[..<colon].contains(":") else { return nil }
            host = text[..<colon]
            portText = text[text.index(after: colon)...]
        }
        guard let port = UInt16(portText), port > 0, !host.isEmpty else { return nil }
        self.init(host: String(host), port: port)
        guard Self.parse(self.host, isIPv6) != nil else { return nil }
    }

    public var description: String { isIPv6 ? "[\(host)]:\(port)" : "\(host):\(port)" }

    /// 127.0.0.0/8 or ::1: only processes on this machine can connect.
    public var isLoopback: Bool {
        guard let bytes = Self.parse(host, isIPv6) else { return false }
        return isIPv6 ? bytes == Array(repeating: 0, count: 15) + [1] : bytes[0] == 127
    }

    /// The address in network order (4 or 16 bytes), or nil when `host` is not a literal of that family.
    static func parse(_ host: String, _ v6: Bool) -> [UInt8]? {
        var bytes = [UInt8](repeating: 0, count: v6 ? 16 : 4)
        let ok = bytes.withUnsafeMutableBytes { inet_pton(v6 ? AF_INET6 : AF_INET, host, $0.baseAddress) }
        return ok == 1 ? bytes : nil
    }
}

/// A minimal HTTP/1.1 server for `/metrics` and `/healthz`, on POSIX sockets and threads of its own.
///
/// Whoever can reach the port is a stranger, so every connection is bounded: one request of at most
/// `maxRequestBytes` of head (a larger one gets 431), read within `readDeadlineSeconds` in total however slowly
/// it trickles (then 408), answered and closed (no keep-alive, no body read), the answer written within
/// `writeDeadlineSeconds`; at most `maxConnections` at once (the next is answered 503 without reading and
/// closed). It runs on its own threads, never on the daemon's actor or the cooperative pool: a stuck client or
/// a slow store read cannot delay the scheduling loop, and a wedged pool does not silence `/healthz`.
public final class MetricsHTTPServer: Sendable {
    public struct Limits: Sendable, Equatable {
        public var maxRequestBytes = 8192
        public var readDeadlineSeconds = 5.0
        public var writeDeadlineSeconds = 5.0
        public var maxConnections = 4
        public init() {}
    }

    public struct Response: Sendable, Equatable {
        public var status: Int
        public var contentType: String
        public var body: String

        public init(status: Int, contentType: String = "text/plain; charset=utf-8", body: String) {
            self.status = status
            self.contentType = contentType
            self.body = body
        }
    }

    /// The socket could not be opened, bound or listened on: one line naming the address and the reason.
    public struct StartError: Error, CustomStringConvertible, Sendable {
        public var description: String
    }

    public let address: ListenAddress
    /// The bound port (the configured one, or the kernel's pick for port 0 in tests).
    public let port: UInt16
    private let limits: Limits
    private let listener: Int32
    private let handler: @Sendable (String) -> Response
    private let active = LockedValue(0)
    private let stopped = LockedValue(false)
    private let acceptEnded = LockedValue(false)
    private let started = LockedValue(false)
    /// A pipe whose write end `stop()` closes: the accept thread sleeps in poll() on it and the listener, so a
    /// stop is noticed at once without waking every 200 ms to look.
    private let stopPipe: (read: Int32, write: Int32)

    /// Binds and listens at once (so a bad address or a taken port fails the start, in one line); `start()`
    /// then serves. `handler` gets the request path (query removed) of a GET and answers it; it runs on a
    /// connection thread.
    public init(address: ListenAddress, limits: Limits = Limits(), handler: @escaping @Sendable (String) -> Response) throws {
        self.address = address
        self.limits = limits
        self.handler = handler
        let family = address.isIPv6 ? AF_INET6 : AF_INET
        let fd = socket(family, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw StartError(description: "metrics_listen \(address): socket: \(errnoDescription(errno))") }
        var one: Int32 = 1
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size))
        let bytes = ListenAddress.parse(address.host, address.isIPv6) ?? []
        var bound: Int32
        if address.isIPv6 {
            var sa = sockaddr_in6()
            sa.sin6_family = sa_family_t(AF_INET6)
            sa.sin6_port = address.port.bigEndian
            withUnsafeMutableBytes(of: &sa.sin6_addr) { raw in for (i, b) in bytes.enumerated() { raw[i] = b } }
            bound = withUnsafePointer(to: &sa) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in6>.size)) }
            }
        } else {
            var sa = sockaddr_in()
            sa.sin_family = sa_family_t(AF_INET)
            sa.sin_port = address.port.bigEndian
            withUnsafeMutableBytes(of: &sa.sin_addr) { raw in for (i, b) in bytes.enumerated() { raw[i] = b } }
            bound = withUnsafePointer(to: &sa) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
            }
        }
        guard bound == 0, listen(fd, 16) == 0 else {
            let why = errnoDescription(errno)
            close(fd)
            throw StartError(description: "metrics_listen \(address): cannot listen: \(why)")
        }
        var ends: [Int32] = [-1, -1]
        guard pipe(&ends) == 0 else {
            let why = errnoDescription(errno)
            close(fd)
            throw StartError(description: "metrics_listen \(address): pipe: \(why)")
        }
        for end in ends { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        stopPipe = (ends[0], ends[1])
        var storage = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        _ = withUnsafeMutablePointer(to: &storage) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        port = withUnsafeBytes(of: &storage) { raw in
            // sin_port and sin6_port sit at the same offset, right after the family.
            UInt16(bigEndian: raw.loadUnaligned(fromByteOffset: 2, as: UInt16.self))
        }
        listener = fd
    }

    /// Starts the accept thread.
    public func start() {
        guard !started.withLock({ s in defer { s = true }; return s }) else { return }
        if !startThread(name: "ferry-metrics", { [self] in acceptLoop() }) {
            close(listener)  // nothing will serve it: refuse connections rather than leave them hanging
            close(stopPipe.read)
            acceptEnded.withLock { $0 = true }
        }
    }

    /// Stops accepting and closes the listening socket (connections in progress finish on their own, bounded
    /// by their deadlines). Returns once the accept thread has let go of the socket.
    public func stop() {
        let wasStarted = started.withLock { s in defer { s = true }; return s }  // no start after a stop
        guard !stopped.withLock({ s in defer { s = true }; return s }) else { return }
        close(stopPipe.write)  // the accept thread's poll() sees the hang-up
        guard wasStarted else {
            close(listener)  // never served: no accept thread to wait for
            close(stopPipe.read)
            return
        }
        while !acceptEnded.withLock({ $0 }) { usleep(10_000) }
    }

    /// Connections being served now (tests).
    public var activeConnections: Int { active.withLock { $0 } }

    private func acceptLoop() {
        defer {
            close(listener)
            close(stopPipe.read)
            acceptEnded.withLock { $0 = true }
        }
        while !stopped.withLock({ $0 }) {
            // Sleeps until a connection comes or `stop()` closes the pipe's write end (no timeout: no polling).
            var fds = [pollfd(fd: listener, events: Int16(POLLIN), revents: 0), pollfd(fd: stopPipe.read, events: Int16(POLLIN), revents: 0)]
            guard poll(&fds, 2, -1) > 0, fds[1].revents == 0, fds[0].revents & Int16(POLLIN) != 0 else { continue }
            let fd = accept(listener, nil, nil)
            guard fd >= 0 else { continue }
            _ = fcntl(fd, F_SETFD, FD_CLOEXEC)  // accept4 is not visible to Swift here; no exec happens anyway
            let admitted = active.withLock { count -> Bool in
                guard count < limits.maxConnections else { return false }
                count += 1
                return true
            }
            guard admitted else {
                // Said without reading and without waiting: a full send buffer just drops the courtesy.
                let text = Self.head(status: 503, contentType: "text/plain", length: 18) + "too many requests\n"
                _ = text.utf8CString.withUnsafeBufferPointer { send(fd, $0.baseAddress, $0.count - 1, Int32(MSG_NOSIGNAL | MSG_DONTWAIT)) }
                close(fd)
                continue
            }
            let served = startThread(name: "ferry-metrics-conn") { [self] in
                serve(fd)
                close(fd)
                active.withLock { $0 -= 1 }
            }
            if !served {
                close(fd)
                active.withLock { $0 -= 1 }
            }
        }
    }

    private func serve(_ fd: Int32) {
        let response: Response
        switch readRequest(fd) {
        case .head(let head):
            response = route(head)
        case .tooLarge:
            response = Response(status: 431, body: "request head over \(limits.maxRequestBytes) bytes\n")
        case .timedOut:
            response = Response(status: 408, body: "request not received within \(limits.readDeadlineSeconds) s\n")
        case .closed:
            return
        }
        write(fd, response)
    }

    enum ReadResult: Equatable {
        case head(String)
        case tooLarge
        case timedOut
        case closed
    }

    /// Reads until the blank line ending the head, within one deadline for the whole head.
    private func readRequest(_ fd: Int32) -> ReadResult {
        let deadline = Self.now() + limits.readDeadlineSeconds
        var buffer: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 2048)
        while true {
            let remaining = deadline - Self.now()
            guard remaining > 0 else { return .timedOut }
            var p = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            let ready = poll(&p, 1, Int32(min(remaining * 1000, 60_000).rounded(.up)))
            if ready < 0 && errno == EINTR { continue }
            guard ready > 0 else { continue }  // the deadline is checked at the top
            let n = chunk.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
            if n < 0 && (errno == EAGAIN || errno == EINTR) { continue }
            guard n > 0 else { return .closed }
            buffer.append(contentsOf: chunk[0..<n])
            if let end = Self.headEnd(buffer) {
                guard end <= limits.maxRequestBytes else { return .tooLarge }
                return .head(String(decoding: buffer[0..<end], as: UTF8.self))
            }
            if buffer.count > limits.maxRequestBytes { return .tooLarge }
        }
    }

    /// Index just past "\r\n\r\n" (or a bare "\n\n", which lenient clients send).
    static func headEnd(_ bytes: [UInt8]) -> Int? {
        var i = 0
        while i < bytes.count {
            if bytes[i] == 10 {
                if i + 1 < bytes.count, bytes[i + 1] == 10 { return i + 2 }
                if i + 2 < bytes.count, bytes[i + 1] == 13, bytes[i + 2] == 10 { return i + 3 }
            }
            i += 1
        }
        return nil
    }

    private func route(_ head: String) -> Response {
        let requestLine = head.prefix { !$0.isNewline }  // "\r\n" is one Character: isNewline covers both
        let parts = requestLine.split(separator: " ", omittingEmptySubsequences: false)
        guard parts.count == 3, parts[2].hasPrefix("HTTP/1."), parts[1].hasPrefix("/") else {
            return Response(status: 400, body: "bad request line\n")
        }
        guard parts[0] == "GET" else { return Response(status: 405, body: "only GET\n") }
        let path = parts[1].prefix { $0 != "?" }
        return handler(String(path))
    }

    private func write(_ fd: Int32, _ response: Response) {
        let body = Array(response.body.utf8)
        let bytes = Array(Self.head(status: response.status, contentType: response.contentType, length: body.count).utf8) + body
        let deadline = Self.now() + limits.writeDeadlineSeconds
        var offset = 0
        while offset < bytes.count {
            let remaining = deadline - Self.now()
            guard remaining > 0 else { return }
            var p = pollfd(fd: fd, events: Int16(POLLOUT), revents: 0)
            let ready = poll(&p, 1, Int32((remaining * 1000).rounded(.up)))
            if ready < 0 && errno == EINTR { continue }
            guard ready > 0 else { continue }
            let n = bytes[offset...].withUnsafeBytes {
                send(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL | MSG_DONTWAIT))
            }
            if n < 0 && (errno == EAGAIN || errno == EINTR) { continue }
            guard n > 0 else { return }
            offset += n
        }
        shutdown(fd, Int32(SHUT_WR))
        // Lingering close: a client whose request was cut short (431, 408) may still be sending; closing with
        // unread input would reset the connection and could destroy the answer before it reads it. Drain
        // briefly (bounded in time and bytes), then close.
        let lingerUntil = Self.now() + 0.5
        var sink = [UInt8](repeating: 0, count: 4096)
        var drained = 0
        while drained < 65_536, Self.now() < lingerUntil {
            var p = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            guard poll(&p, 1, 100) >= 0 else { return }
            if p.revents == 0 { continue }
            let n = sink.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
            if n < 0 && (errno == EAGAIN || errno == EINTR) { continue }
            guard n > 0 else { return }  // the client closed: done
            drained += n
        }
    }

    static func head(status: Int, contentType: String, length: Int) -> String {
        "HTTP/1.1 \(status) \(reason(status))\r\nContent-Type: \(contentType)\r\nContent-Length: \(length)\r\n"
            + "Connection: close\r\n\r\n"
    }

    static func reason(_ status: Int) -> String {
        switch status {
        case 200: "OK"
        case 400: "Bad Request"
        case 404: "Not Found"
        case 405: "Method Not Allowed"
        case 408: "Request Timeout"
        case 431: "Request Header Fields Too Large"
        case 503: "Service Unavailable"
        default: "Error"
        }
    }

    private static func now() -> Double { SystemMonotonicClock().now() }
}

/// What the daemon serves: `/metrics` (its in-memory registry plus the store's gauges, read at scrape time
/// through a read-only connection of the scrape's own), `/healthz` (`HealthCheck`), 404 for anything else.
public struct MetricsEndpoint: Sendable {
    public let metrics: GatewayMetrics
    public let health: DaemonHealth
    public let databasePath: String
    public let wallClock: any WallClock

    public init(metrics: GatewayMetrics, health: DaemonHealth, databasePath: String, wallClock: any WallClock = SystemWallClock()) {
        self.metrics = metrics
        self.health = health
        self.databasePath = databasePath
        self.wallClock = wallClock
    }

    public func respond(path: String) -> MetricsHTTPServer.Response {
        switch path {
        case "/metrics":
            var registry = metrics.snapshot
            do {
                let store = try GatewayStore.openReadOnly(path: databasePath)
                try StoreReadings.read(from: store, now: wallClock.nowMillis()).apply(to: &registry)
            } catch {
                registry.set(FerryMetric.storeReadable, 0)
            }
            return MetricsHTTPServer.Response(
                status: 200, contentType: "text/plain; version=0.0.4; charset=utf-8", body: registry.render())
        case "/healthz":
            var storeProblem: String?
            do {
                _ = try GatewayStore.openReadOnly(path: databasePath).diskBytes()
            } catch {
                storeProblem = "\(error)"
            }
            let (healthy, body) = HealthCheck.evaluate(
                ready: health.current.ready, verdict: health.verdict(), storeProblem: storeProblem)
            return MetricsHTTPServer.Response(status: healthy ? 200 : 503, body: body)
        default:
            return MetricsHTTPServer.Response(status: 404, body: "not found: try /metrics or /healthz\n")
        }
    }
}
