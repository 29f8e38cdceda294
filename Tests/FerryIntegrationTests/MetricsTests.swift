import FerryProtocol
import FerrySimulator
import FerryStore
import FerryTestSupport
import Foundation
import Testing

@testable import FerryGateway
@testable import FerrySync

#if canImport(Glibc)
    import Glibc
#endif

/// The metrics registry and its text (exact), Ferry's families, the store's gauges, `/healthz`, the live view,
/// and the HTTP server against real sockets on loopback (hostile clients included).
@Suite struct MetricsRegistryTests {
    @Test func rendersCountersGaugesAndHistogramsAsExactExpositionText() {
        var r = MetricsRegistry()
        r.declare("t_events_total", .counter, help: "Events.\nSecond line \\ backslash.")
        r.declare("t_temp", .gauge, help: "A gauge.")
        r.declare("t_latency_seconds", .histogram, help: "Latency.", buckets: [1, 0.5, 2.5])
        r.declare("t_empty", .gauge, help: "Nothing yet.")
        r.add("t_events_total", 2, labels: .init(["kind": "b"]))
        r.add("t_events_total", labels: .init(["kind": "a\"q\\\n"]))
        r.add("t_events_total", 3, labels: .init(["kind": "b"]))
        r.add("t_events_total", -7, labels: .init(["kind": "b"]))  // ignored: counters never go down
        r.set("t_temp", 21.5)
        r.set("t_temp", 1e20, labels: .init(["at": "x"]))
        r.observe("t_latency_seconds", 0.2)
        r.observe("t_latency_seconds", 0.7)
        r.observe("t_latency_seconds", 1)
        r.observe("t_latency_seconds", 30)
        r.set("t_events_total", 99)  // wrong kind: ignored
        r.add("t_unknown", 1)  // undeclared: ignored
        let expected = """
            # HELP t_events_total Events.\\nSecond line \\\\ backslash.
            # TYPE t_events_total counter
            t_events_total{kind="a\\"q\\\\\\n"} 1
            t_events_total{kind="b"} 5
            # HELP t_temp A gauge.
            # TYPE t_temp gauge
            t_temp 21.5
            t_temp{at="x"} 1e+20
            # HELP t_latency_seconds Latency.
            # TYPE t_latency_seconds histogram
            t_latency_seconds_bucket{le="0.5"} 1
            t_latency_seconds_bucket{le="1"} 3
            t_latency_seconds_bucket{le="2.5"} 3
            t_latency_seconds_bucket{le="+Inf"} 4
            t_latency_seconds_sum 31.9
            t_latency_seconds_count 4
            # HELP t_empty Nothing yet.
            # TYPE t_empty gauge

            """
        #expect(r.render() == expected)
        #expect(r.value("t_events_total", labels: .init(["kind": "b"])) == 5)
        r.clear("t_temp")
        #expect(!r.render().contains("t_temp 21.5"))
        #expect(r.render().contains("# TYPE t_temp gauge\n"))
    }

    @Test func numbersRenderAsPrometheusReadsThem() {
        #expect(MetricsRegistry.number(0) == "0")
        #expect(MetricsRegistry.number(1_073_741_824) == "1073741824")
        #expect(MetricsRegistry.number(0.25) == "0.25")
        #expect(MetricsRegistry.number(.infinity) == "+Inf")
        #expect(MetricsRegistry.number(-.infinity) == "-Inf")
        #expect(MetricsRegistry.number(.nan) == "NaN")
    }

    @Test func sessionOutcomeLabelsComeFromTheTypedEnd() {
        #expect(SessionOutcome(end: .disconnected(.caughtUp), backpressure: false) == .caughtUp)
        #expect(SessionOutcome(end: .disconnected(.streamInfoUnreadable("x(y)")), backpressure: false) == .streamInfoUnreadable)
        #expect(SessionOutcome(end: .disconnected(.maxDurationReached), backpressure: false) == .maxDuration)
        #expect(SessionOutcome(end: .linkLost, backpressure: false) == .linkLost)
        #expect(SessionOutcome(end: .subscribeFailed("no"), backpressure: false) == .subscribeFailed)
        #expect(SessionOutcome(end: .disconnected(.storeFailed), backpressure: true) == .backpressure)
        #expect(SessionOutcome(SessionResult(outcome: .failed)) == .connectFailed)
        #expect(SessionOutcome(SessionResult(outcome: .failed, bondMissingAfterConnect: true)) == .refusedUnbonded)
        #expect(SessionOutcome(SessionResult(outcome: .interrupted(backlog: nil))) == .cancelled)
        var summary = SyncSummary(peripheral: "AA:BB:CC:DD:EE:01")
        summary.end = nil  // a runner that never recorded an end: counted as a link loss, as the store does
        #expect(SessionOutcome(SessionResult(outcome: .failed, summary: summary)) == .linkLost)
    }

    @Test func gatewayMetricsCountSessionsFramesBytesAndConnectLatency() {
        let metrics = GatewayMetrics(maxConnections: 3)
        var summary = SyncSummary(peripheral: "AA:BB:CC:DD:EE:01")
        summary.end = .disconnected(.caughtUp)
        metrics.stored(frames: 40)
        metrics.received(bytes: 1234)
        summary.gapsRecorded = 1
        metrics.sessionEnded(SessionResult(outcome: .caughtUp, summary: summary, connectSeconds: 0.8))
        summary.end = .linkLost
        metrics.stored(frames: 2)
        metrics.received(bytes: 66)
        metrics.sessionEnded(SessionResult(outcome: .failed, summary: summary, connectSeconds: 3))
        metrics.sessionEnded(SessionResult(outcome: .failed))
        metrics.slotsInUse(2)
        metrics.diskBudget(5_000_000)
        let text = metrics.snapshot.render()
        for line in [
            "ferry_sessions_total{outcome=\"caught_up\"} 1", "ferry_sessions_total{outcome=\"link_lost\"} 1",
            "ferry_sessions_total{outcome=\"connect_failed\"} 1", "ferry_sessions_total{outcome=\"no_response\"} 0",
            "ferry_frames_stored_total 42", "ferry_bytes_received_total 1300", "ferry_gaps_total 2",
            "ferry_connect_seconds_bucket{le=\"0.5\"} 0", "ferry_connect_seconds_bucket{le=\"1\"} 1",
            "ferry_connect_seconds_bucket{le=\"5\"} 2", "ferry_connect_seconds_bucket{le=\"+Inf\"} 2",
            "ferry_connect_seconds_sum 3.8", "ferry_connect_seconds_count 2", "ferry_slots_in_use 2", "ferry_slots 3",
            "ferry_store_disk_budget_bytes 5000000",
        ] {
            #expect(text.contains("\n" + line + "\n"), "missing: \(line)")
        }
    }

    @Test func storeGaugesComeFromAReadOnlyScrapeOfARealStore() throws {
        let dir = try TemporaryDirectory("metrics-store")
        defer { dir.remove() }
        let path = dir.path("ferry.sqlite")
        let a = PeripheralAddress("AA:BB:CC:DD:EE:01")!
        let b = PeripheralAddress("AA:BB:CC:DD:EE:02")!
        do {
            let store = try GatewayStore(path: path, clock: FixedWallClock(millis: 1_000_000))
            _ = try store.openStream(peripheral: a, deviceEpoch: 7)
            _ = try store.openStream(peripheral: b, deviceEpoch: 9)
            try store.recordSessionEnd(peripheral: a, result: .disconnected(.caughtUp), epoch: 7, head: 12)
        }
        let store = try GatewayStore.openReadOnly(path: path)
        let readings = try StoreReadings.read(from: store, now: 1_030_500)
        #expect(readings.uplinkState == "not running")
        #expect(readings.oldestPendingAgeSeconds == nil)
        #expect(readings.diskBytes > 0)
        #expect(
            readings.peripherals == [
                .init(address: a.string, backlog: 12, lastSyncAgeSeconds: 30.5),
                .init(address: b.string, backlog: nil, lastSyncAgeSeconds: nil),
            ])
        var registry = FerryMetric.registry(maxConnections: 2)
        registry.set(FerryMetric.backlog, 99, labels: .init(["peripheral": "gone"]))  // must not survive a scrape
        readings.apply(to: &registry)
        let text = registry.render()
        for line in [
            "ferry_peripheral_backlog_frames{peripheral=\"AA:BB:CC:DD:EE:01\"} 12",
            "ferry_peripheral_last_sync_age_seconds{peripheral=\"AA:BB:CC:DD:EE:01\"} 30.5",
            "ferry_outbox_events{status=\"pending\"} 0", "ferry_outbox_events{status=\"in_flight\"} 0",
            "ferry_outbox_events{status=\"failed\"} 0", "ferry_outbox_oldest_pending_age_seconds 0",
            "ferry_uplink_state{state=\"not_running\"} 1", "ferry_uplink_state{state=\"online\"} 0",
            "ferry_store_disk_bytes \(readings.diskBytes)", "ferry_store_readable 1",
        ] {
            #expect(text.contains("\n" + line + "\n"), "missing: \(line)")
        }
        #expect(!text.contains("gone"))
        #expect(!text.contains("EE:02\"} "))  // no head known: no backlog or age invented for it
    }
}

/// A wall clock that stands still (the store's timestamps in a test).
final class FixedWallClock: WallClock {
    let millis: Int64
    init(millis: Int64) { self.millis = millis }
    func nowMillis() -> Int64 { millis }
}

@Suite struct HealthAndLiveViewTests {
    @Test func healthzIsOkOnlyWhenReadyEveryPartBeatsAndTheStoreReads() throws {
        let dir = try TemporaryDirectory("healthz")
        defer { dir.remove() }
        let path = dir.path("ferry.sqlite")
        let clock = ManualClock(start: 100)
        let health = DaemonHealth(monitor: WatchdogMonitor(limits: [.scheduler: 60, .dbus: 60]), clock: clock)
        let endpoint = MetricsEndpoint(metrics: GatewayMetrics(maxConnections: 3), health: health, databasePath: path)

        var answer = endpoint.respond(path: "/healthz")
        #expect(answer.status == 503)  // no store yet, not ready
        #expect(answer.body.contains("not ready") && answer.body.contains("store:"))
        _ = try GatewayStore(path: path)
        health.beat(.scheduler)
        health.expect(.dbus)
        #expect(endpoint.respond(path: "/healthz").status == 503)  // store there, but no adapter yet
        health.markReady()
        answer = endpoint.respond(path: "/healthz")
        #expect(answer == MetricsHTTPServer.Response(status: 200, body: "ok\n"))
        clock.advance(by: 59)
        health.beat(.dbus)
        #expect(endpoint.respond(path: "/healthz").status == 200)
        clock.advance(by: 2)  // the scheduler loop has been silent for 61 s
        answer = endpoint.respond(path: "/healthz")
        #expect(answer == MetricsHTTPServer.Response(status: 503, body: "no progress: scheduler\n"))
        health.beat(.scheduler)
        #expect(endpoint.respond(path: "/healthz").status == 200)
        #expect(endpoint.respond(path: "/nope").status == 404)
        #expect(endpoint.respond(path: "/metrics").body.contains("ferry_store_readable 1\n"))
    }

    @Test func liveViewRoundTripsAndGoesStale() throws {
        let dir = try TemporaryDirectory("live")
        defer { dir.remove() }
        let file = LiveViewFile(databasePath: dir.path("ferry.sqlite"))
        #expect(file.path == dir.path("ferry-live.json"))
        #expect(file.readFresh(nowMillis: 0) == nil)
        let view = LiveView(
            pid: 42, updatedAt: 1_000_000, adapter: "hci0", slotsInUse: 1, maxConnections: 3,
            sessions: [.init(peripheral: "AA:BB:CC:DD:EE:01", phase: "syncing", seconds: 2.5)])
        try file.write(view)
        #expect(file.readFresh(nowMillis: 1_029_000) == view)
        // The keys sorted, as JSONEncoder(.sortedKeys) wrote them before the one JSON writer did.
        #expect(
            try String(contentsOfFile: file.path, encoding: .utf8)
                == #"{"adapter":"hci0","max_connections":3,"pid":42,"sessions":[{"peripheral":"AA:BB:CC:DD:EE:01","#
                + #""phase":"syncing","seconds":2.5}],"slots_in_use":1,"updated_at":1000000}"#)
        let noAdapter = LiveView(pid: 7, updatedAt: 1_000_000, adapter: nil, slotsInUse: 0, maxConnections: 1, sessions: [])
        try file.write(noAdapter)
        #expect(file.readFresh(nowMillis: 1_000_000) == noAdapter)
        #expect(file.readFresh(nowMillis: 1_031_000) == nil)  // not rewritten for 31 s: that daemon is gone
        try "{not json".write(toFile: file.path, atomically: true, encoding: .utf8)
        #expect(file.readFresh(nowMillis: 1_000_000) == nil)
        file.remove()
        #expect(!FileManager.default.fileExists(atPath: file.path))
    }

    /// A view that cannot be written (its directory is gone) is an error for the caller, and leaves nothing behind.
    @Test func aLiveViewThatCannotBeWrittenThrowsAndLeavesNoFile() throws {
        let dir = try TemporaryDirectory("live-missing")
        defer { dir.remove() }
        let file = LiveViewFile(path: dir.path("gone/ferry-live.json"))
        let view = LiveView(pid: 1, updatedAt: 0, adapter: nil, slotsInUse: 0, maxConnections: 1, sessions: [])
        #expect(throws: (any Error).self) { try file.write(view) }
        #expect(!FileManager.default.fileExists(atPath: dir.path("gone/ferry-live.json.tmp")))
        #expect(!FileManager.default.fileExists(atPath: file.path))
    }

    @Test func listenAddressesAreLiteralsWithAPort() {
        #expect(ListenAddress("127.0.0.1:9464") == ListenAddress(host: "127.0.0.1", port: 9464))
        #expect(ListenAddress("127.0.0.1:9464")?.isLoopback == true)
        #expect(ListenAddress("[::1]:9464")?.isLoopback == true)
        #expect(ListenAddress("[::1]:9464")?.description == "[::1]:9464")
        #expect(ListenAddress("0.0.0.0:9464")?.isLoopback == false)
        #expect(ListenAddress("192.168.1.5:80")?.isLoopback == false)
        for bad in ["localhost:9464", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", ":9464", "::1:9464", "[::1]9464", "1.2.3:4", ""] {
            #expect(ListenAddress(bad) == nil, "\(bad)")
        }
    }
}

/// The HTTP server on a real loopback socket, with clients that behave and clients that do not.
@Suite(.serialized) struct MetricsHTTPServerTests {
    func makeServer(_ limits: MetricsHTTPServer.Limits = .init()) throws -> MetricsHTTPServer {
        let s = try MetricsHTTPServer(address: ListenAddress(host: "127.0.0.1", port: 0), limits: limits) { path in
            path == "/metrics" ? .init(status: 200, body: "ferry_up 1\n") : .init(status: 404, body: "not found\n")
        }
        s.start()
        return s
    }

    @Test func answersAScrapeA404AndRefusesOtherMethods() throws {
        let s = try makeServer()
        defer { s.stop() }
        let ok = try Client(port: s.port).exchange("GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        #expect(
            ok == "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 11\r\n"
                + "Connection: close\r\n\r\nferry_up 1\n")
        #expect(try Client(port: s.port).exchange("GET /other HTTP/1.1\r\n\r\n").hasPrefix("HTTP/1.1 404 Not Found\r\n"))
        #expect(try Client(port: s.port).exchange("POST /metrics HTTP/1.1\r\n\r\n").hasPrefix("HTTP/1.1 405 "))
        #expect(try Client(port: s.port).exchange("garbage\r\n\r\n").hasPrefix("HTTP/1.1 400 "))
    }

    @Test func anOversizeRequestGets431AndTheServerCarriesOn() throws {
        var limits = MetricsHTTPServer.Limits()
        limits.maxRequestBytes = 8192
        let s = try makeServer(limits)
        defer { s.stop() }
        let huge = "GET /metrics HTTP/1.1\r\nX-Junk: " + String(repeating: "a", count: 20_000)
        #expect(try Client(port: s.port).exchange(huge, readFor: 5).hasPrefix("HTTP/1.1 431 "))
        #expect(try Client(port: s.port).exchange("GET /metrics HTTP/1.1\r\n\r\n").hasPrefix("HTTP/1.1 200 "))
    }

    @Test func aSlowClientHitsTheReadDeadline() throws {
        var limits = MetricsHTTPServer.Limits()
        limits.readDeadlineSeconds = 0.5
        let s = try makeServer(limits)
        defer { s.stop() }
        let client = try Client(port: s.port)
        // Trickles a byte every 100 ms: each recv is quick, but the head never completes in time.
        let started = Date()
        for byte in "GET /metrics HTTP/1.1\r\n".utf8.prefix(8) {
            client.send([byte])
            usleep(100_000)
        }
        let answer = client.readAll(for: 5)
        #expect(answer.hasPrefix("HTTP/1.1 408 Request Timeout\r\n"))
        #expect(Date().timeIntervalSince(started) < 3)
        #expect(try Client(port: s.port).exchange("GET /metrics HTTP/1.1\r\n\r\n").hasPrefix("HTTP/1.1 200 "))
    }

    @Test func connectionsBeyondTheCapAre503dAtOnceAndSlotsComeBack() throws {
        var limits = MetricsHTTPServer.Limits()
        limits.maxConnections = 2
        limits.readDeadlineSeconds = 30  // the held connections would otherwise time out during the test
        let s = try makeServer(limits)
        defer { s.stop() }
        let held = [try Client(port: s.port), try Client(port: s.port)]
        held[0].send(Array("GET /met".utf8))
        held[1].send(Array("G".utf8))
        try waitUntil { s.activeConnections == 2 }
        #expect(try Client(port: s.port).exchange("GET /metrics HTTP/1.1\r\n\r\n").hasPrefix("HTTP/1.1 503 "))
        for client in held { client.close() }  // hang up mid-request: their threads end, the slots come back
        try waitUntil { s.activeConnections == 0 }
        #expect(try Client(port: s.port).exchange("GET /metrics HTTP/1.1\r\n\r\n").hasPrefix("HTTP/1.1 200 "))
    }

    @Test func aTakenPortFailsTheStartInOneLine() throws {
        let s = try makeServer()
        defer { s.stop() }
        #expect(throws: MetricsHTTPServer.StartError.self) {
            _ = try MetricsHTTPServer(address: ListenAddress(host: "127.0.0.1", port: s.port)) { _ in .init(status: 200, body: "") }
        }
        // A server stopped without ever being started lets go of its port (and stop does not wait for a thread).
        // Its port is taken below the kernel's ephemeral range (32768-60999): a port-0 listener of a test running
        // alongside cannot get it between the stop and the second bind.
        var bound: MetricsHTTPServer?
        for candidate in UInt16(20_000)..<20_500 where bound == nil {
            bound = try? MetricsHTTPServer(address: ListenAddress(host: "127.0.0.1", port: candidate)) { _ in
                .init(status: 200, body: "")
            }
        }
        let unstarted = try #require(bound, "no free port in 20000-20499")
        let port = unstarted.port
        unstarted.stop()
        unstarted.stop()
        let again = try MetricsHTTPServer(address: ListenAddress(host: "127.0.0.1", port: port)) { _ in .init(status: 200, body: "") }
        again.stop()
    }

    func waitUntil(_ condition: () -> Bool) throws {
        let deadline = Date().addingTimeInterval(5)
        while !condition() {
            guard Date() < deadline else { throw ClientError("condition not met within 5 s") }
            usleep(10_000)
        }
    }
}

struct ClientError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}

/// A plain TCP client on loopback: sends bytes, reads until the server closes (or a deadline).
final class Client {
    let fd: Int32

    init(port: UInt16) throws {
        fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        var sa = sockaddr_in()
        sa.sin_family = sa_family_t(AF_INET)
        sa.sin_port = port.bigEndian
        sa.sin_addr.s_addr = UInt32(0x7f00_0001).bigEndian
        let ok = withUnsafePointer(to: &sa) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard ok == 0 else { throw ClientError("connect: \(String(cString: strerror(errno)))") }
    }

    deinit { close() }

    private var closed = false
    func close() {
        if !closed { Glibc.close(fd) }
        closed = true
    }

    /// Sends what it can (a server that answered early and closed makes the rest fail: that is fine here).
    func send(_ bytes: [UInt8]) {
        var offset = 0
        while offset < bytes.count {
            let n = bytes[offset...].withUnsafeBytes { Glibc.send(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
            guard n > 0 else { return }
            offset += n
        }
    }

    func readAll(for seconds: Double) -> String {
        var out: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 4096)
        let deadline = Date().addingTimeInterval(seconds)
        while Date() < deadline {
            var p = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            guard poll(&p, 1, 100) > 0 else { continue }
            let n = chunk.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, 0) }
            guard n > 0 else { break }
            out.append(contentsOf: chunk[0..<n])
        }
        return String(decoding: out, as: UTF8.self)
    }

    func exchange(_ request: String, readFor seconds: Double = 5) throws -> String {
        send(Array(request.utf8))
        return readAll(for: seconds)
    }
}

/// Frames and bytes are counted as they commit and arrive, through a hostile simulated link: the counter ends
/// equal to what the store holds, whatever the duplicates, corruption and reconnects.
@Test func framesStoredCounterMatchesTheStoreThroughAHostileLink() async throws {
    let dir = try TemporaryDirectory("metrics-live")
    defer { dir.remove() }
    let peripheral = try SimulatedPeripheral(directory: nil, faults: hostileLink(), seed: 15)
    try peripheral.record(count: 1_500)
    let store = try GatewayStore(path: dir.path("g.sqlite"))
    let clock = ManualClock()
    let address = PeripheralAddress("C0:FF:EE:00:00:03")!
    let metrics = GatewayMetrics(maxConnections: 3)
    var counted: [Double] = []
    let results = await SessionDriver.syncUntilCaughtUp(peripheral, clock: clock) { transport in
        counted.append(metrics.snapshot.value(FerryMetric.framesStored) ?? -1)
        let runner = SyncSessionRunner(peripheral: address, store: store, transport: transport, clock: clock)
        runner.metrics = metrics
        return runner
    }
    #expect(results.last?.summary.end == .disconnected(.caughtUp))
    let stored = try store.frames(of: StreamKey(peripheral: address, epoch: peripheral.epoch)).count
    #expect(stored == 1_500)
    #expect(metrics.snapshot.value(FerryMetric.framesStored) == Double(stored))
    #expect(counted.count == results.count && counted.first == 0)
    if results.count > 1 { #expect(counted[1] > 0, "counted during the sessions, not at the end") }
    let bytes = results.reduce(0) { $0 + $1.summary.bytesReceived }
    #expect(bytes > 0 && metrics.snapshot.value(FerryMetric.bytesReceived) == Double(bytes))
}
