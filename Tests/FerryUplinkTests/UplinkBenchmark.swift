// Measurements, run on demand (they take a while and the numbers belong to a release build):
//
//   FERRY_UPLINK_BENCH=1 swift test -c release -Xswiftc -enable-testing --filter UplinkBenchmark
//
// Prints `FERRY-UPLINK-BENCH` lines; without the variable the suite shows as skipped.

import Foundation
import Testing

@testable import FerryUplink

@Suite(
    .serialized,
    .enabled(if: ProcessInfo.processInfo.environment["FERRY_UPLINK_BENCH"] == "1", "set FERRY_UPLINK_BENCH=1 to run"))
struct UplinkBenchmark {

    func seconds(_ duration: Duration) -> Double {
        Double(duration.components.seconds) + Double(duration.components.attoseconds) / 1e18
    }

    /// Small POSTs (one 20-byte frame each), one at a time and 4 in flight, against a backend
    /// whose own SQLite runs with synchronous=off (the HTTP path) and =full (its default).
    @Test func smallPostRoundTrips() async throws {
        for synchronous in ["off", "full"] {
            let backend = try ReferenceBackend(arguments: ["--synchronous", synchronous])
            defer { backend.stop() }
            let poster = try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: backend.endpoint))
            func body(_ index: Int) -> [UInt8] {
                let frame = UplinkFrame(
                    seq: UInt64(index + 1), payload: [UInt8](repeating: 7, count: 20),
                    receivedAt: UplinkTimestamp(millisecondsSince1970: 1_796_050_800_000))
                return UplinkBodyEncoder.encode(
                    UplinkBatchBody(
                        gateway: "gw", batch: "s-\(index)",
                        events: [UplinkEvent(id: "e-\(index)", peripheral: "P", epoch: 0, content: .frames([frame]))]))
            }
            _ = await poster.post(body: body(-1), idempotencyKey: "s--1", token: nil)  // connect, warm up
            let count = 1000
            let clock = ContinuousClock()
            let sequential = try await clock.measure {
                for index in 0..<count {
                    let attempt = await poster.post(body: body(index), idempotencyKey: "s-\(index)", token: nil)
                    guard attempt.outcome == .completed(status: 200) else { throw TestFailure("\(attempt.outcome)") }
                }
            }
            let inFlight = 4
            let concurrent = try await clock.measure {
                try await withThrowingTaskGroup(of: Void.self) { group in
                    for lane in 0..<inFlight {
                        group.addTask {
                            for step in 0..<(count / inFlight) {
                                let index = count + lane * (count / inFlight) + step
                                let attempt = await poster.post(
                                    body: body(index), idempotencyKey: "s-\(index)", token: nil)
                                guard attempt.outcome == .completed(status: 200) else {
                                    throw TestFailure("\(attempt.outcome)")
                                }
                            }
                        }
                    }
                    try await group.waitForAll()
                }
            }
            print(
                "FERRY-UPLINK-BENCH small POST, backend synchronous=\(synchronous): "
                    + "sequential \(Int(Double(count) / seconds(sequential))) req/s "
                    + "(\(String(format: "%.3f", seconds(sequential) / Double(count) * 1000)) ms each), "
                    + "\(inFlight) in flight \(Int(Double(count) / seconds(concurrent))) req/s")
            #expect(try backend.stat("distinct_natural_keys") == 2 * count + 1)
        }
    }

    /// Frames per second through the poster alone with realistic batches (20 frames of
    /// 20 bytes, one ACK batch per request), sequential, backend synchronous=full.
    @Test func twentyFrameBatchesPerSecond() async throws {
        let backend = try ReferenceBackend()
        defer { backend.stop() }
        let poster = try UplinkHTTPPoster(configuration: UplinkHTTPConfiguration(endpoint: backend.endpoint))
        let batches = 500
        let bodies = (0..<batches).map {
            UplinkBodyEncoder.encode(FrameBatches.twentyFrames(batch: "f-\($0)", firstSeq: UInt64($0 * 20 + 1)))
        }
        _ = await poster.post(body: Array("{}".utf8), idempotencyKey: "warm-up", token: nil)
        let elapsed = try await ContinuousClock().measure {
            for (index, body) in bodies.enumerated() {
                let attempt = await poster.post(body: body, idempotencyKey: "f-\(index)", token: nil)
                guard attempt.outcome == .completed(status: 200) else { throw TestFailure("\(attempt.outcome)") }
            }
        }
        print(
            "FERRY-UPLINK-BENCH 20-frame batches, sequential, backend synchronous=full: "
                + "\(Int(Double(batches) / seconds(elapsed))) batches/s = "
                + "\(Int(Double(batches * 20) / seconds(elapsed))) frames/s")
        #expect(try backend.stat("distinct_natural_keys") == batches * 20)
    }

    /// Request bytes per frame for 20-frame batches of 20-byte payloads: headers as the backend
    /// received them plus the body as sent, plain and gzip (TCP/IP framing not included).
    @Test func bytesPerFrame() async throws {
        for compression in [UplinkCompression.never, .always(minimumBytes: 1)] {
            let backend = try ReferenceBackend(arguments: ["--synchronous", "off", "--token", "t0123456789abcdef0123"])
            defer { backend.stop() }
            let poster = try UplinkHTTPPoster(
                configuration: UplinkHTTPConfiguration(endpoint: backend.endpoint, compression: compression))
            let batches = 50
            var bodyBytes = 0
            var plainBytes = 0
            for index in 0..<batches {
                let batch = UUID().uuidString.lowercased()  // a realistic 36-character batch id
                let body = UplinkBodyEncoder.encode(
                    FrameBatches.twentyFrames(batch: batch, firstSeq: UInt64(index * 20 + 1)))
                let attempt = await poster.post(
                    body: body, idempotencyKey: batch, token: BearerToken("t0123456789abcdef0123"))
                #expect(attempt.outcome == .completed(status: 200))
                bodyBytes += attempt.sentBodyBytes
                plainBytes += body.count
            }
            let headerBytes = try backend.stat("request_header_bytes")
            let frames = Double(batches * 20)
            print(
                "FERRY-UPLINK-BENCH bytes per frame (20 x 20-byte payloads per batch), \(compression): "
                    + "body \(String(format: "%.1f", Double(bodyBytes) / frames)) "
                    + "+ headers \(String(format: "%.1f", Double(headerBytes) / frames)) "
                    + "= \(String(format: "%.1f", Double(bodyBytes + headerBytes) / frames)) B/frame "
                    + "(uncompressed body \(String(format: "%.1f", Double(plainBytes) / frames)))")
        }
    }
}
