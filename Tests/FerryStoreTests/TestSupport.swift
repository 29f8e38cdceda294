import FerryProtocol
import FerryStore
import Foundation

/// A fresh directory per test, removed when the value is released: every test gets its own real SQLite file.
final class TemporaryDirectory {
    let path: String

    init() throws {
        let base = FileManager.default.temporaryDirectory.path
        path = base + "/ferry-storetests-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: false)
    }

    deinit { try? FileManager.default.removeItem(atPath: path) }

    func file(_ name: String) -> String { path + "/" + name }
}

/// A wall clock that stands still, so created_at / received_at are known values.
struct FixedClock: WallClock {
    var millis: Int64 = 1_796_000_000_000
    func nowMillis() -> Int64 { millis }
}

let testPeripheral = PeripheralAddress("C0:FF:EE:00:00:01")!

func dataFrames(_ seqs: ClosedRange<UInt64>, payloadSize: Int = 4) -> [Frame] {
    seqs.map { seq in Frame.data(seq: seq, payload: (0..<payloadSize).map { UInt8(truncatingIfNeeded: seq &+ UInt64($0)) }) }
}

func batch(from cursor: UInt64, gap: ClosedRange<UInt64>? = nil, _ frames: [Frame]) -> CommitBatch {
    CommitBatch(
        expectedCursor: cursor, gap: gap, frames: frames, newCursor: frames.last?.seq ?? gap?.upperBound ?? cursor,
        acknowledge: true)
}

extension GatewayStore {
    /// Count of rows a query returns as its single integer (tests only).
    func count(_ sql: String, _ values: [SQLValue] = []) throws -> Int64 {
        try database.integer(sql, values) ?? 0
    }

    /// Outbox event types in insertion order (rowid), which is the order the uplink claims them in.
    func outboxTypes() throws -> [String] {
        var types: [String] = []
        try database.prepare("SELECT event_type FROM outbox_events ORDER BY rowid").forEach { types.append($0.text(0)) }
        return types
    }

    func cursor(of key: StreamKey) throws -> UInt64? {
        try database.integer(
            "SELECT cursor FROM stream_cursors WHERE peripheral = ? AND epoch = ?",
            [.text(key.peripheral.string), .text(String(key.epoch))]
        ).map { UInt64(bitPattern: $0) }
    }
}

/// `CommitOutcome` has no public memberwise initializer; tests compare through this mirror.
struct Outcome: Equatable, CustomStringConvertible {
    var cursor: UInt64
    var framesInserted: Int
    var framesAlreadyStored: Int
    var gapRecorded: ClosedRange<UInt64>?

    init(cursor: UInt64, framesInserted: Int, framesAlreadyStored: Int, gapRecorded: ClosedRange<UInt64>?) {
        self.cursor = cursor
        self.framesInserted = framesInserted
        self.framesAlreadyStored = framesAlreadyStored
        self.gapRecorded = gapRecorded
    }

    init(_ outcome: CommitOutcome) {
        self.init(
            cursor: outcome.cursor, framesInserted: outcome.framesInserted,
            framesAlreadyStored: outcome.framesAlreadyStored, gapRecorded: outcome.gapRecorded)
    }

    var description: String {
        "cursor \(cursor), inserted \(framesInserted), already \(framesAlreadyStored), gap \(gapRecorded.map { "\($0)" } ?? "none")"
    }
}
