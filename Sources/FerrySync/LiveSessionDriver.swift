import FerryCore
import FerryProtocol
import FerryStore

/// What the live driver's loop reacts to, in arrival order.
public enum LinkEvent: Sendable {
    /// A chunk of the DATA stream (one notification / one read of the AcquireNotify socket).
    case bytes([UInt8])
    /// The notification stream ended: link dropped, device or bluetoothd gone.
    case linkEnded
    /// A timer armed for the session's next deadline went off.
    case tick
    /// Stop requested (SIGTERM, --timeout): commit and acknowledge what is staged, then disconnect.
    case stop
}

/// Runs a session over a live link: one loop takes the `LinkEvent`s queued since its last turn and hands them
/// to the runner, arming a timer for the runner's next deadline. Returns when the runner has finished.
public enum LiveSessionDriver {
    /// `thread`: where the loop runs between awaits — the runner, its state machine and its store's commits — and
    /// whose timer wakes it at the runner's next deadline. The thread that owns the runner's store connection,
    /// so sqlite3's blocking calls stay off the cooperative pool.
    public static func run(
        runner: SyncSessionRunner, events: LinkEvents, clock: any MonotonicClock = SystemMonotonicClock(),
        thread: ThreadExecutor,
        afterEvent: (SyncSessionRunner) -> Void = { _ in }  // a progress display; runs in this task, between events
    ) async {
        await withTaskExecutorPreference(thread) {
            await loop(runner: runner, events: events, clock: clock, thread: thread, afterEvent: afterEvent)
        }
        thread.setTimer(after: nil)
    }

    private static func loop(
        runner: SyncSessionRunner, events: LinkEvents, clock: any MonotonicClock, thread: ThreadExecutor,
        afterEvent: (SyncSessionRunner) -> Void
    ) async {
        await runner.start()
        // The session can end during start (STREAM_INFO unreadable, subscribe refused): then no event will
        // ever come, and waiting for one would hang the caller.
        if runner.finished { return }
        var armedFor: Double?
        func rearm() {
            guard let deadline = runner.nextDeadline else {
                if armedFor != nil { thread.setTimer(after: nil) }
                armedFor = nil
                return
            }
            // The idle deadline moves later with every notification: a timer armed for an earlier time is left
            // armed (its tick finds nothing due and re-arms once), instead of re-arming per notification. Only an
            // earlier deadline replaces it.
            if let armed = armedFor, armed <= deadline { return }
            armedFor = deadline
            // 1 ms late rather than early: a tick before the deadline would find nothing due.
            thread.setTimer(after: max(0, deadline - clock.now()) + 0.001) { events.yield(.tick) }
        }
        rearm()
        var droppedReported = 0
        batches: while let batch = await events.next() {
            let dropped = events.droppedChunks
            if dropped > droppedReported {
                runner.queueDroppedData(chunks: dropped - droppedReported, budget: events.byteBudget)
                droppedReported = dropped
            }
            var chunks: [[UInt8]] = []
            for (position, event) in batch.enumerated() {
                if runner.finished { break batches }
                switch event {
                case .bytes(let chunk):
                    // Consecutive chunks go to the runner together: it hands them all to the state machine
                    // before the first commit runs, so what piled up meanwhile is committed as one group.
                    chunks.append(chunk)
                    if position + 1 < batch.count, case .bytes = batch[position + 1] { continue }
                    await runner.receive(chunks)
                    chunks.removeAll(keepingCapacity: true)
                case .linkEnded: await runner.linkLost()
                case .tick:
                    armedFor = nil
                    await runner.timerFired()
                case .stop: await runner.stop()
                }
                afterEvent(runner)
                if runner.finished { break batches }
                rearm()
            }
        }
    }
}
