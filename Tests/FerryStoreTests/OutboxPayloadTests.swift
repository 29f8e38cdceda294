import FerryStore
import Testing

/// The one type that writes outbox payloads (store) and reads them back (uplink): the stored bytes stay what
/// older databases hold and `ferry outbox list --json` shows, and every payload reads back to itself.
@Suite struct OutboxPayloadTests {
    static let payloads: [(OutboxPayload, String)] = [
        (
            .frames(peripheral: "C0:FF:EE:00:00:01", epoch: "7", firstSeq: 1, lastSeq: 20, count: 20),
            #"{"peripheral":"C0:FF:EE:00:00:01","epoch":"7","first_seq":"1","last_seq":"20","count":20}"#
        ),
        (
            .gap(
                peripheral: "C0:FF:EE:00:00:01", epoch: "18446744073709551615", firstSeq: 5, lastSeq: 9,
                detectedAt: "2026-11-30T15:00:00.123Z"),
            #"{"peripheral":"C0:FF:EE:00:00:01","epoch":"18446744073709551615","first_seq":"5","last_seq":"9","#
                + #""detected_at":"2026-11-30T15:00:00.123Z"}"#
        ),
        (
            .regression(
                peripheral: "C0:FF:EE:00:00:01", epoch: "7", cursor: 500, head: 3, newEpoch: UInt64.max,
                detectedAt: "2026-11-30T15:00:00.123Z"),
            #"{"peripheral":"C0:FF:EE:00:00:01","epoch":"7","cursor":"500","head":"3","#
                + #""new_epoch":"18446744073709551615","detected_at":"2026-11-30T15:00:00.123Z"}"#
        ),
    ]

    @Test func storedBytesAreUnchangedAndReadBack() {
        for (payload, json) in Self.payloads {
            #expect(payload.json == json)
            #expect(OutboxPayload(type: payload.type, json: json) == payload)
        }
    }

    @Test func aDamagedPayloadReadsAsNilNotAsZeros() {
        #expect(OutboxPayload(type: .regression, json: #"{"peripheral":"x","epoch":"7"}"#) == nil)
        #expect(OutboxPayload(type: .regression, json: #"{"peripheral":"x","epoch":"7","cursor":"-1","head":"3","new_epoch":"1","detected_at":"t"}"#) == nil)
        #expect(OutboxPayload(type: .frames, json: "not json") == nil)
        // A payload of another type does not pass for this one.
        #expect(OutboxPayload(type: .regression, json: Self.payloads[0].1) == nil)
    }
}
