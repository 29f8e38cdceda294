/// Who holds a store's forwarder lease (`uplink_forwarder`, schema 3).
public struct ForwarderLeaseHolder: Sendable, Equatable {
    public var owner: String
    public var pid: Int64
    public var bootID: String
    public var expiresAt: Int64
}

/// `uplink_forwarder.state`: what the forwarder last recorded. The raw values are the stored text and what
/// `ferry status` and the metrics show.
public enum UplinkState: String, Sendable, CaseIterable {
    case online, offline
    /// Waiting for credentials (401/403, an unusable token file) or a human (TLS trust, redirects).
    case paused
    /// The forwarder gave its lease up.
    case stopped
}

/// The uplink's state as its forwarder last recorded it, for `ferry status`.
public struct UplinkStateRecord: Sendable, Equatable {
    public var running: Bool
    public var pid: Int64
    public var state: UplinkState
    public var since: Int64?
    public var detail: String?
}

public enum LeaseOutcome: Sendable, Equatable {
    /// This forwarder holds the lease. `previousOwnerGone`: a dead or expired owner's IN_FLIGHT rows may be
    /// released.
    case acquired(previousOwnerGone: Bool)
    case heldBy(ForwarderLeaseHolder)
}

extension GatewayStore {
    /// Takes the lease for `owner` unless another forwarder holds it: a live process (`isAlive`) on this boot
    /// with an unexpired lease. A holder on another boot, a dead pid, an expired lease, or this same process (a
    /// forwarder restarted inside the daemon: the previous instance has ended) is gone.
    public func acquireForwarderLease(
        owner: String, pid: Int64, bootID: String, now: Int64, ttlMillis: Int64, isAlive: (Int64) -> Bool
    ) throws -> LeaseOutcome {
        try store {
            try database.writeTransaction {
                var holder: ForwarderLeaseHolder?
                try database.cached("SELECT owner, pid, boot_id, expires_at FROM uplink_forwarder WHERE id = 1").forEach([]) {
                    holder = ForwarderLeaseHolder(owner: $0.text(0), pid: $0.int64(1), bootID: $0.text(2), expiresAt: $0.int64(3))
                }
                if let holder, holder.owner != owner, holder.expiresAt > now, holder.bootID == bootID,
                    holder.pid != pid, isAlive(holder.pid)
                {
                    return .heldBy(holder)
                }
                try database.cached(
                    """
                    INSERT INTO uplink_forwarder (id, owner, pid, boot_id, expires_at, state, state_since, detail)
                    VALUES (1, ?1, ?2, ?3, ?4, 'online', ?5, NULL)
                    ON CONFLICT (id) DO UPDATE SET owner = ?1, pid = ?2, boot_id = ?3, expires_at = ?4,
                        state = 'online', state_since = ?5, detail = NULL
                    """
                ).run([.text(owner), .integer(pid), .text(bootID), .integer(now &+ ttlMillis), .integer(now)])
                return .acquired(previousOwnerGone: holder.map { $0.owner != owner } ?? true)
            }
        }
    }

    /// Extends the lease; false when `owner` no longer holds it (another forwarder took over an expired lease:
    /// this one must stop claiming).
    public func renewForwarderLease(owner: String, now: Int64, ttlMillis: Int64) throws -> Bool {
        try store {
            try database.cached("UPDATE uplink_forwarder SET expires_at = ? WHERE id = 1 AND owner = ?")
                .run([.integer(now &+ ttlMillis), .text(owner)])
            return database.changes == 1
        }
    }

    /// Gives the lease up (the forwarder is ending): the next forwarder starts at once.
    public func releaseForwarderLease(owner: String) throws {
        try store {
            try database.cached("UPDATE uplink_forwarder SET expires_at = 0, state = 'stopped' WHERE id = 1 AND owner = ?")
                .run([.text(owner)])
        }
    }

    /// Records the uplink's state (online / offline / paused) for `ferry status`; only the lease's owner writes.
    public func recordUplinkState(owner: String, state: UplinkState, since: Int64, detail: String?) throws {
        try store {
            try database.cached("UPDATE uplink_forwarder SET state = ?, state_since = ?, detail = ? WHERE id = 1 AND owner = ?")
                .run([.text(state.rawValue), .integer(since), detail.map { .text($0) } ?? .null, .text(owner)])
        }
    }

    /// The last recorded uplink state; nil when no forwarder ever ran on this store.
    public func uplinkState(now: Int64) throws -> UplinkStateRecord? {
        try store {
            var record: UplinkStateRecord?
            try database.cached("SELECT pid, expires_at, state, state_since, detail FROM uplink_forwarder WHERE id = 1")
                .forEach([]) {
                    let text = $0.text(2)
                    guard let state = UplinkState(rawValue: text) else {
                        throw StoreError.unexpectedValue(column: "uplink_forwarder.state", value: text)
                    }
                    record = UplinkStateRecord(
                        running: $0.int64(1) > now, pid: $0.int64(0), state: state,
                        since: $0.isNull(3) ? nil : $0.int64(3), detail: $0.optionalText(4))
                }
            return record
        }
    }

    /// A wall-clock step of `deltaMillis` (negative: the clock went back) moves every PENDING event's
    /// `next_retry_at` that lies ahead by the same amount, so each keeps the wait it had left: a Pi without an
    /// RTC stepping back a day after NTP must not stall its uplink for a day.
    @discardableResult
    public func shiftPendingRetries(byMillis deltaMillis: Int64, after now: Int64) throws -> Int {
        try store {
            try database.cached(
                "UPDATE outbox_events SET next_retry_at = next_retry_at + ? WHERE status = 'PENDING' AND next_retry_at > ?"
            ).run([.integer(deltaMillis), .integer(now)])
            return database.changes
        }
    }

    /// Steps that happened while no forwarder ran cannot be measured: no PENDING event waits longer than
    /// `horizonMillis` from now (the longest wait the policy can produce).
    @discardableResult
    public func clampPendingRetries(now: Int64, horizonMillis: Int64) throws -> Int {
        try store {
            try database.cached(
                "UPDATE outbox_events SET next_retry_at = ?1 WHERE status = 'PENDING' AND next_retry_at > ?1"
            ).run([.integer(now &+ horizonMillis)])
            return database.changes
        }
    }
}
