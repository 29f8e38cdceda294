import Foundation
import Testing

@testable import FerryUplink

@Suite struct UplinkBodyTests {
    static let at = UplinkTimestamp(millisecondsSince1970: 1_796_050_800_123)  // 2026-11-30T15:00:00.123Z

    static let sample = UplinkBatchBody(
        gateway: "gw-1", batch: "batch-7",
        events: [
            UplinkEvent(
                id: "ev-1", peripheral: "C0:FF:EE:00:00:01", epoch: 0,
                content: .frames([
                    UplinkFrame(seq: 41, payload: Array("hello".utf8), receivedAt: at),
                    UplinkFrame(seq: UInt64.max, payload: [], receivedAt: at),
                ])),
            UplinkEvent(
                id: "ev-2", peripheral: "C0:FF:EE:00:00:01", epoch: 0xFFFF_FFFF_FFFF_FFFF,
                content: .gap(firstSeq: 42, lastSeq: 57, detectedAt: at)),
            UplinkEvent(
                id: "ev-3", peripheral: "C0:FF:EE:00:00:01", epoch: 9_007_199_254_740_993,
                content: .regression(cursor: 900, head: 12, detectedAt: at)),
        ])

    @Test func encodesTheExactDocumentedBytes() {
        let expected =
            #"{"gateway":"gw-1","batch":"batch-7","events":["#
            + #"{"id":"ev-1","type":"FRAMES","peripheral":"C0:FF:EE:00:00:01","epoch":"0","frames":["#
            + #"{"seq":"41","payload":"aGVsbG8=","received_at":"2026-11-30T15:00:00.123Z"},"#
            + #"{"seq":"18446744073709551615","payload":"","received_at":"2026-11-30T15:00:00.123Z"}]},"#
            + #"{"id":"ev-2","type":"GAP","peripheral":"C0:FF:EE:00:00:01","epoch":"18446744073709551615","#
            + #""first_seq":"42","last_seq":"57","detected_at":"2026-11-30T15:00:00.123Z"},"#
            + #"{"id":"ev-3","type":"REGRESSION","peripheral":"C0:FF:EE:00:00:01","epoch":"9007199254740993","#
            + #""cursor":"900","head":"12","detected_at":"2026-11-30T15:00:00.123Z"}]}"#
        #expect(String(decoding: UplinkBodyEncoder.encode(Self.sample), as: UTF8.self) == expected)
    }

    @Test func sameInputGivesIdenticalBytesAndSplicingMatches() {
        let first = UplinkBodyEncoder.encode(Self.sample)
        #expect(first == UplinkBodyEncoder.encode(Self.sample))
        let spliced = UplinkBodyEncoder.encode(
            gateway: "gw-1", batch: "batch-7", encodedEvents: Self.sample.events.map(UplinkBodyEncoder.encode(event:)))
        #expect(spliced == first)
    }

    @Test func isValidJSONThatFoundationReadsBack() throws {
        let object = try #require(
            try JSONSerialization.jsonObject(with: Data(UplinkBodyEncoder.encode(Self.sample))) as? [String: Any])
        let events = try #require(object["events"] as? [[String: Any]])
        #expect(events.count == 3)
        let frames = try #require(events[0]["frames"] as? [[String: Any]])
        #expect(frames[1]["seq"] as? String == "18446744073709551615")
        #expect(Data(base64Encoded: frames[0]["payload"] as? String ?? "") == Data("hello".utf8))
    }

    @Test func escapesStringsPerRFC8259() throws {
        let body = UplinkBatchBody(
            gateway: "quote\" back\\ nl\n tab\t bell\u{07} é",
            batch: "b", events: [])
        let text = String(decoding: UplinkBodyEncoder.encode(body), as: UTF8.self)
        #expect(text.contains(#""quote\" back\\ nl\n tab\t bell\u0007 é""#))
        let object = try #require(try JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any])
        #expect(object["gateway"] as? String == body.gateway)
    }

    @Test(arguments: [
        (Int64(0), "1970-01-01T00:00:00.000Z"),
        (Int64(-1), "1969-12-31T23:59:59.999Z"),
        (Int64(951_782_400_000), "2000-02-29T00:00:00.000Z"),
        (Int64(1_709_251_199_999), "2024-02-29T23:59:59.999Z"),
        (Int64(1_796_050_800_123), "2026-11-30T15:00:00.123Z"),
        (Int64(253_402_300_799_999), "9999-12-31T23:59:59.999Z"),
    ])
    func formatsTimestamps(milliseconds: Int64, expected: String) {
        #expect(UplinkTimestamp(millisecondsSince1970: milliseconds).rfc3339 == expected)
    }

    @Test func timestampsAgreeWithFoundationOverARange() {
        let formatter = ISO8601DateFormatter()
        formatter.formatOptions = [.withInternetDateTime, .withFractionalSeconds]
        formatter.timeZone = TimeZone(identifier: "UTC")
        var generator = SystemRandomNumberGenerator()
        for _ in 0..<2000 {
            let ms = Int64.random(in: 0..<4_102_444_800_000, using: &generator)  // up to 2100
            let date = Date(timeIntervalSince1970: Double(ms) / 1000)
            #expect(UplinkTimestamp(millisecondsSince1970: ms).rfc3339 == formatter.string(from: date))
        }
    }

    @Test func base64MatchesFoundation() {
        var generator = SystemRandomNumberGenerator()
        for length in 0..<70 {
            let bytes = (0..<length).map { _ in UInt8.random(in: 0...255, using: &generator) }
            var ours: [UInt8] = []
            Base64.append(bytes, to: &ours)
            #expect(String(decoding: ours, as: UTF8.self) == Data(bytes).base64EncodedString())
        }
    }
}
