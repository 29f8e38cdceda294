import FerryCore
import FoundationEssentials
import Glibc

/// `outbox_events.event_type`. The raw values are the stored text (a CHECK constraint allows only these).
public enum OutboxEventType: String, Sendable, CaseIterable {
    /// A run of staged frames (`first_seq...last_seq`), sent with their payloads.
    case frames = "FRAMES"
    /// Events the peripheral lost (a gap in its sequence).
    case gap = "GAP"
    /// The peripheral's sequence went backwards on the same epoch; the store rebased it onto `new_epoch`.
    case regression = "REGRESSION"
}

/// What an outbox event's `payload` column holds: written by the store in the transaction that creates the
/// event, read back by the uplink. One type on both sides, so the two cannot drift apart.
///
/// Written with FerryCore's JSONWriter: the stored bytes are what older databases hold and what
/// `ferry outbox list --json` shows, so the key order and the quoting of numbers (seqs and epochs are
/// strings: they do not fit a double) must stay exactly as they are.
public enum OutboxPayload: Sendable, Equatable {
    case frames(peripheral: String, epoch: String, firstSeq: UInt64, lastSeq: UInt64, count: Int)
    /// `detectedAt`: RFC 3339 text, as stored.
    case gap(peripheral: String, epoch: String, firstSeq: UInt64, lastSeq: UInt64, detectedAt: String)
    case regression(
        peripheral: String, epoch: String, cursor: UInt64, head: UInt64, newEpoch: UInt64, detectedAt: String)

    public var type: OutboxEventType {
        switch self {
        case .frames: .frames
        case .gap: .gap
        case .regression: .regression
        }
    }

    /// The stored text.
    public var json: String {
        var out = JSONWriter()
        func start(_ peripheral: String, _ epoch: String) {
            out.raw(#"{"peripheral":"#)
            out.string(peripheral)
            out.raw(#","epoch":"#)
            out.string(epoch)
        }
        func seqs(_ first: UInt64, _ last: UInt64) {
            out.raw(#","first_seq":"#)
            out.decimal(first)
            out.raw(#","last_seq":"#)
            out.decimal(last)
        }
        switch self {
        case .frames(let peripheral, let epoch, let first, let last, let count):
            start(peripheral, epoch)
            seqs(first, last)
            out.raw(#","count":\#(count)"#)
        case .gap(let peripheral, let epoch, let first, let last, let detectedAt):
            start(peripheral, epoch)
            seqs(first, last)
            out.raw(#","detected_at":"#)
            out.string(detectedAt)
        case .regression(let peripheral, let epoch, let cursor, let head, let newEpoch, let detectedAt):
            start(peripheral, epoch)
            out.raw(#","cursor":"#)
            out.decimal(cursor)
            out.raw(#","head":"#)
            out.decimal(head)
            out.raw(#","new_epoch":"#)
            out.decimal(newEpoch)
            out.raw(#","detected_at":"#)
            out.string(detectedAt)
        }
        out.raw("}")
        return out.text
    }

    /// Reads a stored payload back; nil if it is not what `json` writes for `type` (a damaged row).
    public init?(type: OutboxEventType, json: String) {
        guard let fields = try? JSONDecoder().decode(Fields.self, from: Data(json.utf8)) else { return nil }
        let peripheral = fields.peripheral
        let epoch = fields.epoch
        switch type {
        case .frames:
            guard let first = fields.firstSeq.flatMap(UInt64.init), let last = fields.lastSeq.flatMap(UInt64.init),
                let count = fields.count
            else { return nil }
            self = .frames(peripheral: peripheral, epoch: epoch, firstSeq: first, lastSeq: last, count: count)
        case .gap:
            guard let first = fields.firstSeq.flatMap(UInt64.init), let last = fields.lastSeq.flatMap(UInt64.init),
                let detectedAt = fields.detectedAt
            else { return nil }
            self = .gap(peripheral: peripheral, epoch: epoch, firstSeq: first, lastSeq: last, detectedAt: detectedAt)
        case .regression:
            guard let cursor = fields.cursor.flatMap(UInt64.init), let head = fields.head.flatMap(UInt64.init),
                let newEpoch = fields.newEpoch.flatMap(UInt64.init), let detectedAt = fields.detectedAt
            else { return nil }
            self = .regression(
                peripheral: peripheral, epoch: epoch, cursor: cursor, head: head, newEpoch: newEpoch,
                detectedAt: detectedAt)
        }
    }

    private struct Fields: Decodable {
        var peripheral: String
        var epoch: String
        var firstSeq: String?
        var lastSeq: String?
        var count: Int?
        var cursor: String?
        var head: String?
        var newEpoch: String?
        var detectedAt: String?

        enum CodingKeys: String, CodingKey {
            case peripheral, epoch, count, cursor, head
            case firstSeq = "first_seq"
            case lastSeq = "last_seq"
            case newEpoch = "new_epoch"
            case detectedAt = "detected_at"
        }
    }
}

/// How a pairing was authenticated, as recorded in `trusted_peripherals.pairing_method` (the raw values are
/// the stored text and what `ferry peripherals` shows).
public enum PairingMethod: String, Sendable {
    /// No MITM protection: anyone in radio range during pairing could have sat in the middle.
    case justWorks = "just-works"
    /// The peripheral displayed a passkey, the operator gave it to Ferry.
    case passkey = "passkey"
    /// Both sides showed a number; Ferry accepted it because it matched the operator's.
    case numericComparison = "numeric-comparison"
    /// BlueZ already held a bond for it (made earlier, maybe by another tool).
    case existingBond = "existing-bond"
}
