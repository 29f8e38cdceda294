// The JSON body of one uplink request (PROTOCOL.md §6) and its deterministic encoder.
//
// Why a hand-written encoder instead of JSONEncoder: a retry must resend the
// byte-identical body under the same Idempotency-Key (the backend answers 422 to
// the same key with a different body). JSONEncoder's key order, number and
// escaping choices are not a promise across Foundation versions; this file (and FerryCore's JSONWriter) is.

import FerryCore

/// A point in time as milliseconds since 1970-01-01T00:00:00Z. The body carries it as
/// RFC 3339 with exactly three fractional digits and a `Z` suffix.
public struct UplinkTimestamp: Sendable, Hashable, Comparable {
    public var millisecondsSince1970: Int64

    public init(millisecondsSince1970: Int64) {
        self.millisecondsSince1970 = millisecondsSince1970
    }

    public static func < (lhs: UplinkTimestamp, rhs: UplinkTimestamp) -> Bool {
        lhs.millisecondsSince1970 < rhs.millisecondsSince1970
    }

    /// `2026-11-30T15:00:00.123Z` (FerryCore's CivilTime: integer arithmetic, same value, same bytes).
    public var rfc3339: String { CivilTime.rfc3339(millisecondsSince1970: millisecondsSince1970) }
}

/// One validated frame as it goes upstream.
public struct UplinkFrame: Sendable, Hashable {
    public var seq: UInt64
    public var payload: [UInt8]
    public var receivedAt: UplinkTimestamp

    public init(seq: UInt64, payload: [UInt8], receivedAt: UplinkTimestamp) {
        self.seq = seq
        self.payload = payload
        self.receivedAt = receivedAt
    }
}

/// One outbox event inside a batch. `id` is the outbox event id.
public struct UplinkEvent: Sendable, Hashable {
    public enum Content: Sendable, Hashable {
        /// Consecutive frames committed together (one outbox event per commit).
        case frames([UplinkFrame])
        /// The peripheral no longer has `[firstSeq, lastSeq]` (§4 step 5).
        case gap(firstSeq: UInt64, lastSeq: UInt64, detectedAt: UplinkTimestamp)
        /// The peripheral's head went below the committed cursor on the same epoch (§4 step 2).
        case regression(cursor: UInt64, head: UInt64, detectedAt: UplinkTimestamp)
    }

    public var id: String
    /// Identity address, upper-case and colon separated, e.g. `C0:FF:EE:00:00:01`.
    public var peripheral: String
    public var epoch: UInt64
    public var content: Content

    public init(id: String, peripheral: String, epoch: UInt64, content: Content) {
        self.id = id
        self.peripheral = peripheral
        self.epoch = epoch
        self.content = content
    }

    /// The `type` field of the body.
    public var typeName: String {
        switch content {
        case .frames: return "FRAMES"
        case .gap: return "GAP"
        case .regression: return "REGRESSION"
        }
    }
}

/// The whole request body: `{"gateway":…,"batch":…,"events":[…]}`.
public struct UplinkBatchBody: Sendable, Hashable {
    public var gateway: String
    /// The batch id; also the Idempotency-Key header.
    public var batch: String
    public var events: [UplinkEvent]

    public init(gateway: String, batch: String, events: [UplinkEvent]) {
        self.gateway = gateway
        self.batch = batch
        self.events = events
    }
}

/// Deterministic JSON for the §6 body. Compact (no spaces), fixed key order, 64-bit
/// integers as decimal strings, payloads as padded standard base64 (RFC 4648 §4),
/// strings escaped per RFC 8259 (`"`, `\\`, control characters; everything else verbatim UTF-8).
public enum UplinkBodyEncoder {
    public static func encode(_ body: UplinkBatchBody) -> [UInt8] {
        encode(gateway: body.gateway, batch: body.batch, encodedEvents: body.events.map(encode(event:)))
    }

    /// Splices events that were encoded earlier (for example when they were committed)
    /// into a body. The result is byte-identical to `encode(_:)` for the same events.
    public static func encode(gateway: String, batch: String, encodedEvents: [[UInt8]]) -> [UInt8] {
        var out = JSONWriter()
        out.raw("{\"gateway\":")
        out.string(gateway)
        out.raw(",\"batch\":")
        out.string(batch)
        out.raw(",\"events\":[")
        for (index, event) in encodedEvents.enumerated() {
            if index > 0 { out.raw(",") }
            out.bytes.append(contentsOf: event)
        }
        out.raw("]}")
        return out.bytes
    }

    /// One element of `events`, e.g. to size a batch before claiming more events.
    public static func encode(event: UplinkEvent) -> [UInt8] {
        var out = JSONWriter()
        out.raw("{\"id\":")
        out.string(event.id)
        out.raw(",\"type\":\"" + event.typeName + "\",\"peripheral\":")
        out.string(event.peripheral)
        out.raw(",\"epoch\":")
        out.decimal(event.epoch)
        switch event.content {
        case .frames(let frames):
            out.raw(",\"frames\":[")
            for (index, frame) in frames.enumerated() {
                if index > 0 { out.raw(",") }
                out.raw("{\"seq\":")
                out.decimal(frame.seq)
                out.raw(",\"payload\":\"")
                Base64.append(frame.payload, to: &out.bytes)
                out.raw("\",\"received_at\":\"" + frame.receivedAt.rfc3339 + "\"}")
            }
            out.raw("]")
        case .gap(let firstSeq, let lastSeq, let detectedAt):
            out.raw(",\"first_seq\":")
            out.decimal(firstSeq)
            out.raw(",\"last_seq\":")
            out.decimal(lastSeq)
            out.raw(",\"detected_at\":\"" + detectedAt.rfc3339 + "\"")
        case .regression(let cursor, let head, let detectedAt):
            out.raw(",\"cursor\":")
            out.decimal(cursor)
            out.raw(",\"head\":")
            out.decimal(head)
            out.raw(",\"detected_at\":\"" + detectedAt.rfc3339 + "\"")
        }
        out.raw("}")
        return out.bytes
    }
}

/// Standard padded base64 (RFC 4648 §4), the alphabet every backend language decodes by default.
enum Base64 {
    private static let alphabet: [UInt8] = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".utf8)

    static func append(_ input: [UInt8], to out: inout [UInt8]) {
        out.reserveCapacity(out.count + (input.count + 2) / 3 * 4)
        var index = 0
        while index + 3 <= input.count {
            let chunk = UInt32(input[index]) << 16 | UInt32(input[index + 1]) << 8 | UInt32(input[index + 2])
            out.append(alphabet[Int(chunk >> 18 & 63)])
            out.append(alphabet[Int(chunk >> 12 & 63)])
            out.append(alphabet[Int(chunk >> 6 & 63)])
            out.append(alphabet[Int(chunk & 63)])
            index += 3
        }
        let rest = input.count - index
        if rest == 1 {
            let chunk = UInt32(input[index]) << 16
            out.append(alphabet[Int(chunk >> 18 & 63)])
            out.append(alphabet[Int(chunk >> 12 & 63)])
            out.append(contentsOf: [UInt8(ascii: "="), UInt8(ascii: "=")])
        } else if rest == 2 {
            let chunk = UInt32(input[index]) << 16 | UInt32(input[index + 1]) << 8
            out.append(alphabet[Int(chunk >> 18 & 63)])
            out.append(alphabet[Int(chunk >> 12 & 63)])
            out.append(alphabet[Int(chunk >> 6 & 63)])
            out.append(UInt8(ascii: "="))
        }
    }
}
