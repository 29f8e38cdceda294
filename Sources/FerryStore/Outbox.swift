import FerryCore
import FerryProtocol
import FoundationEssentials
import Glibc

/// One row of `outbox_events`.
public struct OutboxEvent: Sendable, Equatable {
    public var id: String
    public var type: OutboxEventType
    /// The stored JSON text (`OutboxPayload.json`); `decodedPayload` reads it.
    public var payload: String
    public var status: OutboxStatus
    public var retryCount: Int
    public var nextRetryAt: Int64
    public var createdAt: Int64
    public var peripheral: String
    public var epoch: String
    public var firstSeq: UInt64?
    public var lastSeq: UInt64?
    public var frameCount: Int
    public var payloadBytes: Int
    public var batchID: String?
    public var lastError: String?

    /// The payload, typed; nil for a damaged row.
    public var decodedPayload: OutboxPayload? { OutboxPayload(type: type, json: payload) }
}

/// A frame as it goes upstream.
public struct StoredFrame: Sendable, Equatable {
    public var seq: UInt64
    public var payload: [UInt8]
    public var receivedAt: Int64
}

/// Events claimed together under one batch id (the upload's Idempotency-Key).
public struct ClaimedBatch: Sendable, Equatable {
    public var id: String
    public var events: [OutboxEvent]
    /// True when the batch was claimed before (a retry or a zombie): same events, same key.
    public var isRetry: Bool
    /// The `gateway` field the batch was first sent with (nil: claimed without one).
    public var gateway: String? = nil
}

public enum OutboxStatus: String, Sendable, CaseIterable {
    case pending = "PENDING"
    case inFlight = "IN_FLIGHT"
    case completed = "COMPLETED"
    case failed = "FAILED"
}

/// Batch limits for a claim.
public struct ClaimLimits: Sendable, Equatable {
    public var maxEvents = 50
    public var maxFrames = 1000
    /// Sum of frame payload bytes (before base64); the first event is always taken whatever its size. The same
    /// bound caps a session's grouped commit (one outbox event), so one such event fits one batch.
    public var maxPayloadBytes = SyncSession.Configuration.defaultMaxGroupPayloadBytes
    public init() {}
}

extension GatewayStore {
    private static let eventColumns = """
        id, event_type, payload, status, retry_count, next_retry_at, created_at, peripheral, epoch,
        first_seq, last_seq, frame_count, payload_bytes, batch_id, last_error
        """

    private static func event(_ row: Statement) throws -> OutboxEvent {
        let typeText = row.text(1)
        let statusText = row.text(3)
        // CHECK constraints allow only these values; anything else is a damaged or foreign file.
        guard let type = OutboxEventType(rawValue: typeText) else {
            throw StoreError.unexpectedValue(column: "outbox_events.event_type", value: typeText)
        }
        guard let status = OutboxStatus(rawValue: statusText) else {
            throw StoreError.unexpectedValue(column: "outbox_events.status", value: statusText)
        }
        return OutboxEvent(
            id: row.text(0), type: type, payload: row.text(2), status: status,
            retryCount: count(row.int64(4)), nextRetryAt: row.int64(5), createdAt: row.int64(6),
            peripheral: row.text(7), epoch: row.text(8),
            firstSeq: row.isNull(9) ? nil : UInt64(bitPattern: row.int64(9)),
            lastSeq: row.isNull(10) ? nil : UInt64(bitPattern: row.int64(10)),
            frameCount: count(row.int64(11)), payloadBytes: count(row.int64(12)), batchID: row.optionalText(13),
            lastError: row.optionalText(14))
    }

    /// A count column (retries, frames, bytes) as the forwarder adds it up: 0...Int32.max, whatever a damaged
    /// file holds, so sums of a batch's worth cannot overflow.
    private static func count(_ value: Int64) -> Int {
        Int(min(max(value, 0), Int64(Int32.max)))
    }

    /// Claims the next batch atomically (ONE transaction): the oldest due PENDING event decides. If it was
    /// claimed before (a retry, or a zombie returned to PENDING) its whole batch is claimed again under the
    /// same id, so the retry carries the identical body and key. Otherwise a new batch of the oldest due,
    /// never-claimed events is formed within `limits` and its id persisted on the rows.
    /// `gateway` is recorded with a new batch and kept for its resends (the batch's stored one wins).
    public func claimBatch(limits: ClaimLimits = ClaimLimits(), now: Int64, gateway: String? = nil) throws -> ClaimedBatch? {
        try store {
            try database.writeTransaction {
                let first = try database.cached(
                    "SELECT id, batch_id FROM outbox_events WHERE status = 'PENDING' AND next_retry_at <= ? "
                        + "ORDER BY created_at, rowid LIMIT 1")
                var oldest: (id: String, batch: String?)?
                try first.forEach([.integer(now)]) { oldest = ($0.text(0), $0.optionalText(1)) }
                guard let oldest else { return nil }

                var events: [OutboxEvent] = []
                let batchID: String
                let isRetry: Bool
                if let existing = oldest.batch {
                    batchID = existing
                    isRetry = true
                    try database.cached(
                        "SELECT \(GatewayStore.eventColumns) FROM outbox_events "
                            + "WHERE batch_id = ? AND status = 'PENDING' ORDER BY created_at, rowid"
                    ).forEach([.text(existing)]) { events.append(try GatewayStore.event($0)) }
                } else {
                    batchID = RandomID.uuidV4()
                    isRetry = false
                    var frames = 0
                    var bytes = 0
                    try database.cached(
                        "SELECT \(GatewayStore.eventColumns) FROM outbox_events "
                            + "WHERE status = 'PENDING' AND batch_id IS NULL AND next_retry_at <= ? "
                            + "ORDER BY created_at, rowid LIMIT ?"
                    ).forEach([.integer(now), .integer(Int64(limits.maxEvents))]) { row in
                        let event = try GatewayStore.event(row)
                        let fits =
                            events.isEmpty
                            || (frames + event.frameCount <= limits.maxFrames
                                && bytes + event.payloadBytes <= limits.maxPayloadBytes)
                        guard fits, events.count < limits.maxEvents else { return }
                        frames += event.frameCount
                        bytes += event.payloadBytes
                        events.append(event)
                    }
                }
                // A batch first claimed before schema 3 has no gateway yet: it keeps the one it gets now.
                let stored = isRetry
                    ? try database.text(
                        "SELECT batch_gateway FROM outbox_events WHERE batch_id = ? AND batch_gateway IS NOT NULL LIMIT 1",
                        [.text(batchID)])
                    : nil
                let batchGateway = stored ?? gateway
                let claim = try database.cached(
                    "UPDATE outbox_events SET status = 'IN_FLIGHT', batch_id = ?, claimed_at = ?, batch_gateway = ? "
                        + "WHERE id = ?")
                for index in events.indices {
                    try claim.run([
                        .text(batchID), .integer(now), batchGateway.map { .text($0) } ?? .null, .text(events[index].id),
                    ])
                    events[index].status = .inFlight
                    events[index].batchID = batchID
                }
                return events.isEmpty
                    ? nil : ClaimedBatch(id: batchID, events: events, isRetry: isRetry, gateway: batchGateway)
            }
        }
    }

    /// The frames a FRAMES event carries, in seq order.
    public func frames(for event: OutboxEvent) throws -> [StoredFrame] {
        guard event.type == .frames, let first = event.firstSeq, let last = event.lastSeq else { return [] }
        return try store {
            var frames: [StoredFrame] = []
            // frame_count is the file's word: a hint, not a size to allocate.
            frames.reserveCapacity(min(event.frameCount, 1 << 12))
            let lo = Int64(bitPattern: first)
            let hi = Int64(bitPattern: last)
            // Seqs are stored as their Int64 bit pattern; a range crossing 2^63 is found by the event id instead.
            let statement =
                lo <= hi
                ? try database.cached(
                    "SELECT seq, payload, received_at FROM staged_frames "
                        + "WHERE peripheral = ? AND epoch = ? AND seq BETWEEN ? AND ? AND outbox_id = ?")
                : try database.cached(
                    "SELECT seq, payload, received_at FROM staged_frames "
                        + "WHERE peripheral = ? AND epoch = ? AND (seq >= ? OR seq <= ?) AND outbox_id = ?")
            try statement.forEach([.text(event.peripheral), .text(event.epoch), .integer(lo), .integer(hi), .text(event.id)])
            { row in
                frames.append(
                    StoredFrame(seq: UInt64(bitPattern: row.int64(0)), payload: row.blob(1), receivedAt: row.int64(2)))
            }
            frames.sort { $0.seq < $1.seq }
            return frames
        }
    }

    /// 2xx: the batch's events are delivered. Also accepted for rows released to PENDING in the meantime (their
    /// forwarder died; same key: the backend deduplicated).
    public func completeBatch(_ batchID: String, now: Int64) throws {
        try store {
            try database.cached(
                "UPDATE outbox_events SET status = 'COMPLETED', completed_at = ?, last_error = NULL "
                    + "WHERE batch_id = ? AND status IN ('IN_FLIGHT', 'PENDING')"
            ).run([.integer(now), .text(batchID)])
        }
    }

    /// A retriable failure: back to PENDING (keeping the batch) at `nextRetryAt`. When `countsAsRetry`, the
    /// retry count goes up and reaching `maxRetries` makes the events FAILED. Returns true if they failed.
    @discardableResult
    public func retryBatch(
        _ batchID: String, error: String, nextRetryAt: Int64, countsAsRetry: Bool, maxRetries: Int
    ) throws -> Bool {
        try store {
            try database.writeTransaction {
                let increment: Int64 = countsAsRetry ? 1 : 0
                try database.cached(
                    """
                    UPDATE outbox_events
                    SET retry_count = retry_count + ?1,
                        status = CASE WHEN ?1 = 1 AND retry_count + 1 >= ?2 THEN 'FAILED' ELSE 'PENDING' END,
                        next_retry_at = ?3, last_error = ?4
                    WHERE batch_id = ?5 AND status = 'IN_FLIGHT'
                    """
                ).run([.integer(increment), .integer(Int64(maxRetries)), .integer(nextRetryAt), .text(error), .text(batchID)])
                return try database.integer(
                    "SELECT count(*) FROM outbox_events WHERE batch_id = ? AND status = 'FAILED'", [.text(batchID)]) ?? 0 > 0
            }
        }
    }

    /// Charges one retry to a batch after the fact: it failed with 5xx and another batch got through since
    /// (a poison batch, issue 11). Failures of the uplink as a whole are never charged. More than `maxRetries`
    /// charges make the batch's PENDING events FAILED with `error`; an IN_FLIGHT batch keeps its attempt.
    /// Returns how many events became FAILED.
    @discardableResult
    public func chargeRetry(_ batchID: String, maxRetries: Int, error: String) throws -> Int {
        try store {
            try database.writeTransaction {
                // SQLite evaluates every SET expression against the row as it was before the UPDATE.
                try database.cached(
                    """
                    UPDATE outbox_events
                    SET retry_count = retry_count + 1,
                        status = CASE WHEN status = 'PENDING' AND retry_count + 1 > ?2 THEN 'FAILED' ELSE status END,
                        last_error = CASE WHEN status = 'PENDING' AND retry_count + 1 > ?2 THEN ?3 ELSE last_error END
                    WHERE batch_id = ?1 AND status IN ('PENDING', 'IN_FLIGHT')
                    """
                ).run([.text(batchID), .integer(Int64(maxRetries)), .text(error)])
                return Int(
                    try database.integer(
                        "SELECT count(*) FROM outbox_events WHERE batch_id = ? AND status = 'FAILED'", [.text(batchID)])
                        ?? 0)
            }
        }
    }

    /// The uplink is back: PENDING events parked in a backoff become due now (full speed on first success).
    @discardableResult
    public func makePendingDue(now: Int64) throws -> Int {
        try store {
            try database.cached(
                "UPDATE outbox_events SET next_retry_at = ? WHERE status = 'PENDING' AND next_retry_at > ?"
            ).run([.integer(now), .integer(now)])
            return database.changes
        }
    }

    /// A permanent failure (4xx other than 401/403/408/429): dead letter, kept for audit and manual retry.
    public func failBatch(_ batchID: String, error: String) throws {
        try store {
            try database.cached(
                "UPDATE outbox_events SET status = 'FAILED', last_error = ? WHERE batch_id = ? AND status = 'IN_FLIGHT'"
            ).run([.text(error), .text(batchID)])
        }
    }

    /// Zombies: IN_FLIGHT rows claimed before `claimedBefore` (nil: all, at start-up) go back to PENDING,
    /// keeping their batch id so the retry reuses the same key. Returns how many.
    @discardableResult
    public func releaseInFlight(claimedBefore: Int64?) throws -> Int {
        try store {
            if let claimedBefore {
                try database.cached(
                    "UPDATE outbox_events SET status = 'PENDING' WHERE status = 'IN_FLIGHT' AND claimed_at < ?"
                ).run([.integer(claimedBefore)])
            } else {
                try database.cached("UPDATE outbox_events SET status = 'PENDING' WHERE status = 'IN_FLIGHT'").run()
            }
            return database.changes
        }
    }

    /// Operator retry of FAILED events: back to PENDING with a fresh retry budget and NO batch id, so they go
    /// out under a new Idempotency-Key (the old key's response — the failure — may be cached upstream).
    @discardableResult
    public func retryFailed(id: String?, now: Int64) throws -> Int {
        try store {
            let sql =
                "UPDATE outbox_events SET status = 'PENDING', retry_count = 0, next_retry_at = ?, batch_id = NULL, batch_gateway = NULL "
                + "WHERE status = 'FAILED'" + (id == nil ? "" : " AND id = ?")
            try database.cached(sql).run([.integer(now)] + (id.map { [.text($0)] } ?? []))
            let changed = database.changes
            if let id, changed == 0 {
                let exists = try database.integer("SELECT count(*) FROM outbox_events WHERE id = ?", [.text(id)]) ?? 0
                if exists == 0 { throw StoreError.unknownOutboxEvent(id) }
            }
            return changed
        }
    }

    public func outboxEvents(status: OutboxStatus?, limit: Int = 1000) throws -> [OutboxEvent] {
        try store {
            var events: [OutboxEvent] = []
            let sql =
                "SELECT \(GatewayStore.eventColumns) FROM outbox_events"
                + (status == nil ? "" : " WHERE status = ?") + " ORDER BY created_at, rowid LIMIT ?"
            let values: [SQLValue] = (status.map { [.text($0.rawValue)] } ?? []) + [.integer(Int64(limit))]
            try database.cached(sql).forEach(values) { events.append(try GatewayStore.event($0)) }
            return events
        }
    }

    /// Counts of PENDING and IN_FLIGHT events: zero means the outbox is drained.
    public func undeliveredCount() throws -> Int {
        try store {
            Int(
                try database.integer(
                    "SELECT count(*) FROM outbox_events WHERE status IN ('PENDING', 'IN_FLIGHT')") ?? 0)
        }
    }

    /// When the next PENDING event becomes due (for sleeping through backoff).
    public func nextDueAt() throws -> Int64? {
        try store { try database.integer("SELECT min(next_retry_at) FROM outbox_events WHERE status = 'PENDING'") }
    }

    /// Deletes COMPLETED events completed before `before`, oldest first, with their frames, in transactions of
    /// `chunk` events, at most `maxEvents` in all (storage pressure frees space a chunk at a time). FAILED events
    /// are never pruned. Returns (events, frames) deleted. Chunks are small (100 events, ~2000 frames) so that a
    /// session's commit never waits long for the write lock on a slow SD card (busy timeout 5 s).
    @discardableResult
    public func pruneCompleted(before: Int64, chunk: Int = 100, maxEvents: Int = Int.max) throws -> (events: Int, frames: Int) {
        try store {
            var totalEvents = 0
            var totalFrames = 0
            while totalEvents < maxEvents {
                let limit = min(chunk, maxEvents - totalEvents)
                let deleted: (Int, Int) = try database.writeTransaction {
                    var ids: [String] = []
                    try database.cached(
                        """
                        SELECT id FROM outbox_events WHERE status = 'COMPLETED' AND completed_at < ?
                        ORDER BY completed_at LIMIT ?
                        """
                    ).forEach([.integer(before), .integer(Int64(limit))]) { ids.append($0.text(0)) }
                    var frames = 0
                    for id in ids {
                        try database.cached(
                            """
                            DELETE FROM staged_frames WHERE (peripheral, epoch) =
                                (SELECT peripheral, epoch FROM outbox_events WHERE id = ?1)
                              AND seq BETWEEN (SELECT min(first_seq, last_seq) FROM outbox_events WHERE id = ?1)
                                          AND (SELECT max(first_seq, last_seq) FROM outbox_events WHERE id = ?1)
                              AND outbox_id = ?1
                            """
                        ).run([.text(id)])
                        frames += database.changes
                        try database.cached("DELETE FROM outbox_events WHERE id = ?").run([.text(id)])
                    }
                    return (ids.count, frames)
                }
                totalEvents += deleted.0
                totalFrames += deleted.1
                if deleted.0 < limit { break }
            }
            return (totalEvents, totalFrames)
        }
    }

    /// Returns free pages to the file system (auto_vacuum=INCREMENTAL); run when idle.
    public func incrementalVacuum(pages: Int = 1000) throws {
        try store { try database.execute("PRAGMA incremental_vacuum(\(pages))") }
    }

    /// Bytes the store occupies on disk: the main file's pages plus the WAL.
    public func diskBytes() throws -> Int64 {
        try store {
            let pages = try database.integer("PRAGMA page_count") ?? 0
            let size = try database.integer("PRAGMA page_size") ?? 4096
            return pages * size + (fileSize(atPath: database.path + "-wal") ?? 0)
        }
    }
}
