// The JSON body of one uplink request (PROTOCOL.md §6) and its deterministic encoder.
//
// Why a hand-written encoder instead of JSONEncoder: a retry must resend the
// byte-identical body under the same Idempotency-Key (the backend answers 422 to
// the same key with a different body). JSONEncoder's key order, number and
// escaping choices are not a promise across Foundation versions; this file is.

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

    /// `2026-11-30T15:00:00.123Z`. Computed with integer calendar arithmetic, not a
    /// DateFormatter: no locale, time zone or thread-safety surprises, and the same
    /// value always gives the same bytes.
    public var rfc3339: String {
        let ms = millisecondsSince1970
        let (days, msOfDay) = ms.floorDividedAndModulo(by: 86_400_000)
        let (year, month, day) = CivilCalendar.civil(fromDays: days)
        let seconds = msOfDay / 1000
        var text = ""
        text.reserveCapacity(24)
        text += CivilCalendar.pad(year, 4) + "-" + CivilCalendar.pad(Int64(month), 2) + "-"
        text += CivilCalendar.pad(Int64(day), 2) + "T" + CivilCalendar.pad(seconds / 3600, 2) + ":"
        text += CivilCalendar.pad(seconds / 60 % 60, 2) + ":" + CivilCalendar.pad(seconds % 60, 2)
        text += "." + CivilCalendar.pad(msOfDay % 1000, 3) + "Z"
        return text
    }
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

/// Appends JSON tokens to a byte buffer.
struct JSONWriter {
    var bytes: [UInt8] = []

    mutating func raw(_ text: String) {
        bytes.append(contentsOf: text.utf8)
    }

    /// A 64-bit value as a quoted decimal string: JSON numbers lose precision above 2^53.
    mutating func decimal(_ value: UInt64) {
        bytes.append(UInt8(ascii: "\""))
        bytes.append(contentsOf: String(value).utf8)
        bytes.append(UInt8(ascii: "\""))
    }

    mutating func string(_ text: String) {
        bytes.append(UInt8(ascii: "\""))
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "\""): bytes.append(contentsOf: [0x5C, 0x22])
            case UInt8(ascii: "\\"): bytes.append(contentsOf: [0x5C, 0x5C])
            case 0x0A: bytes.append(contentsOf: [0x5C, UInt8(ascii: "n")])
            case 0x0D: bytes.append(contentsOf: [0x5C, UInt8(ascii: "r")])
            case 0x09: bytes.append(contentsOf: [0x5C, UInt8(ascii: "t")])
            case 0x00..<0x20:
                let hex: [UInt8] = Array("0123456789abcdef".utf8)
                bytes.append(contentsOf: [0x5C, UInt8(ascii: "u"), 0x30, 0x30, hex[Int(byte >> 4)], hex[Int(byte & 0xF)]])
            default: bytes.append(byte)
            }
        }
        bytes.append(UInt8(ascii: "\""))
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

/// Proleptic Gregorian calendar arithmetic on day numbers (days since 1970-01-01).
/// Algorithms from Howard Hinnant's "chrono-Compatible Low-Level Date Algorithms".
enum CivilCalendar {
    static func civil(fromDays days: Int64) -> (year: Int64, month: Int, day: Int) {
        let z = days + 719_468
        let era = (z >= 0 ? z : z - 146_096) / 146_097
        let dayOfEra = z - era * 146_097
        let yearOfEra = (dayOfEra - dayOfEra / 1460 + dayOfEra / 36_524 - dayOfEra / 146_096) / 365
        let dayOfYear = dayOfEra - (365 * yearOfEra + yearOfEra / 4 - yearOfEra / 100)
        let mp = (5 * dayOfYear + 2) / 153
        let day = Int(dayOfYear - (153 * mp + 2) / 5 + 1)
        let month = Int(mp < 10 ? mp + 3 : mp - 9)
        return (yearOfEra + era * 400 + (month <= 2 ? 1 : 0), month, day)
    }

    static func days(fromCivil year: Int64, month: Int, day: Int) -> Int64 {
        let y = month <= 2 ? year - 1 : year
        let era = (y >= 0 ? y : y - 399) / 400
        let yearOfEra = y - era * 400
        let m = Int64(month)
        let dayOfYear = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + Int64(day) - 1
        let dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear
        return era * 146_097 + dayOfEra - 719_468
    }

    static func pad(_ value: Int64, _ width: Int) -> String {
        let digits = String(value)
        return digits.count >= width ? digits : String(repeating: "0", count: width - digits.count) + digits
    }
}

extension Int64 {
    /// Floor division: -1 ms is 1969-12-31T23:59:59.999Z, not 1970-01-01T00:00:00.-01.
    func floorDividedAndModulo(by divisor: Int64) -> (Int64, Int64) {
        let quotient = self / divisor
        let remainder = self % divisor
        return remainder < 0 ? (quotient - 1, remainder + divisor) : (quotient, remainder)
    }
}
