import FerryCore

/// The queue between a live link's producers (the notification reader's thread, the session's timer, a stop
/// request) and the one loop that runs the session. A producer appends from any thread; the loop takes
/// everything that arrived since its last turn in one `next()`.
///
/// Taking a batch is what lets a session that falls behind catch up: the chunks that piled up while a commit
/// ran are all handed to the state machine before the next commit runs, so they are committed together
/// (`SyncSession`'s grouping) instead of one transaction per ACK cadence, and the loop resumes once per batch
/// instead of once per notification.
///
/// The DATA bytes waiting in the queue are bounded (`byteBudget`): a loop blocked for long (a commit waiting out
/// another writer's lock) must not let a peripheral that keeps sending grow the process without limit. Chunks
/// past the budget are dropped and counted; the session sees them as lost on the air (a gap it asks for again).
public final class LinkEvents: Sendable {
    private struct State {
        var pending: [LinkEvent] = []
        var waiter: CheckedContinuation<[LinkEvent], Never>?
        var finished = false
        /// DATA bytes in `pending`.
        var pendingBytes = 0
        var droppedChunks = 0
    }

    private let state = LockedValue(State())
    public let byteBudget: Int

    /// 4 MiB: some 25 s of the fastest BLE link, longer than a commit may wait for the store's lock (three busy
    /// timeouts of 5 s), and little beside a Pi's memory even with several sessions.
    public static let defaultByteBudget = 4 << 20

    public init(byteBudget: Int = LinkEvents.defaultByteBudget) {
        self.byteBudget = byteBudget
    }

    /// DATA chunks dropped so far because the queue held `byteBudget` bytes.
    public var droppedChunks: Int { state.withLock { $0.droppedChunks } }

    /// Appends `event`; ignored once `finish()` was called. A chunk of DATA that would take the queued bytes past
    /// `byteBudget` is dropped (counted in `droppedChunks`).
    public func yield(_ event: LinkEvent) {
        let waiter = state.withLock { s -> CheckedContinuation<[LinkEvent], Never>? in
            guard !s.finished else { return nil }
            guard let waiter = s.waiter else {
                if case .bytes(let chunk) = event {
                    guard s.pendingBytes + chunk.count <= byteBudget else {
                        s.droppedChunks += 1
                        return nil
                    }
                    s.pendingBytes += chunk.count
                }
                s.pending.append(event)
                return nil
            }
            s.waiter = nil
            return waiter
        }
        waiter?.resume(returning: [event])
    }

    /// No more events: `next()` returns what is still queued, then nil.
    public func finish() {
        let waiter = state.withLock { s -> CheckedContinuation<[LinkEvent], Never>? in
            s.finished = true
            defer { s.waiter = nil }
            return s.waiter
        }
        waiter?.resume(returning: [])
    }

    /// Every event queued since the last call, in arrival order, waiting for one if there is none; nil once
    /// finished and drained, or when the calling task is cancelled. One consumer only.
    public func next() async -> [LinkEvent]? {
        if let ready = takeQueued() { return ready.isEmpty ? nil : ready }
        let batch = await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<[LinkEvent], Never>) in
                let ready = state.withLock { s -> [LinkEvent]? in
                    if !s.pending.isEmpty || s.finished || Task.isCancelled {
                        defer {
                            s.pending = []
                            s.pendingBytes = 0
                        }
                        return s.pending
                    }
                    precondition(s.waiter == nil, "LinkEvents has one consumer")
                    s.waiter = continuation
                    return nil
                }
                if let ready { continuation.resume(returning: ready) }
            }
        } onCancel: {
            let waiter = state.withLock { s -> CheckedContinuation<[LinkEvent], Never>? in
                defer { s.waiter = nil }
                return s.waiter
            }
            waiter?.resume(returning: [])
        }
        return batch.isEmpty ? nil : batch
    }

    /// The queued events without waiting: nil when there are none and more may come; empty once finished.
    private func takeQueued() -> [LinkEvent]? {
        state.withLock { s -> [LinkEvent]? in
            if !s.pending.isEmpty {
                defer {
                    s.pending = []
                    s.pendingBytes = 0
                }
                return s.pending
            }
            return s.finished ? [] : nil
        }
    }
}
