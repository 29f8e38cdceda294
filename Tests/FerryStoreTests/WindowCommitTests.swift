import FerryProtocol
import FerryStore
import Foundation
import Testing

/// The window commit (PROTOCOL §4.6, §5): frames + outbox event + cursor in ONE transaction, the cursor
/// re-checked inside it.
@Suite struct WindowCommitTests {
    @Test func commitStoresFramesOneFramesEventAndTheCursorTogether() throws {
        let dir = try TemporaryDirectory()
        let clock = FixedClock(millis: 1_796_000_123_456)
        let store = try GatewayStore(path: dir.file("commit.sqlite"), clock: clock)
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        #expect(stream.cursor == 0)
        let frames = dataFrames(1...20)
        let outcome = try store.commit(batch(from: 0, frames), to: stream.key)
        #expect(Outcome(outcome) == Outcome(cursor: 20, framesInserted: 20, framesAlreadyStored: 0, gapRecorded: nil))
        #expect(try store.cursor(of: stream.key) == 20)
        #expect(try store.frames(of: stream.key).map(\.seq) == Array(1...20))
        #expect(try store.frames(of: stream.key).map(\.payload) == frames.map(\.payload))
        #expect(try store.outboxTypes() == ["FRAMES"])

        var row: (status: String, retries: Int64, first: Int64, last: Int64, count: Int64, created: Int64, id: String)?
        try store.database.prepare(
            "SELECT status, retry_count, first_seq, last_seq, frame_count, created_at, id FROM outbox_events"
        ).forEach { row = ($0.text(0), $0.int64(1), $0.int64(2), $0.int64(3), $0.int64(4), $0.int64(5), $0.text(6)) }
        #expect(row?.status == "PENDING")
        #expect(row?.retries == 0)
        #expect(row?.first == 1)
        #expect(row?.last == 20)
        #expect(row?.count == 20)
        #expect(row?.created == clock.millis)
        // Every frame points at the FRAMES event that carries it upstream.
        #expect(try store.count("SELECT count(*) FROM staged_frames WHERE outbox_id = ?", [.text(row?.id ?? "")]) == 20)
        #expect(try store.count("SELECT count(*) FROM staged_frames WHERE received_at = ?", [.integer(clock.millis)]) == 20)
    }

    /// Event ids are version-7 UUIDs carrying the commit's time, so the id index grows at its end: later commits'
    /// ids sort after earlier ones.
    @Test func outboxEventIDsCarryTheCommitTimeAndSortInCommitOrder() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("ids.sqlite"), clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        let times: [Int64] = [1_796_000_000_000, 1_796_000_000_001, 1_796_000_000_001, 1_796_000_090_000]
        for (window, millis) in times.enumerated() {
            let first = UInt64(window * 20 + 1)
            try store.commit(batch(from: first - 1, dataFrames(first...(first + 19))), to: stream.key, receivedAt: millis)
        }
        var ids: [String] = []
        try store.database.prepare("SELECT id FROM outbox_events ORDER BY rowid").forEach { ids.append($0.text(0)) }
        #expect(ids.count == 4 && Set(ids).count == 4)
        // 1_796_000_000_000 ms is 0x01a229f12800.
        #expect(ids.map { String($0.prefix(13)) } == ["01a229f1-2800", "01a229f1-2801", "01a229f1-2801", "01a229f2-8790"])
        #expect(ids[0] < ids[1] && ids[1] < ids[3] && ids[2] < ids[3])
        #expect(ids.allSatisfy { Array($0.utf8)[14] == UInt8(ascii: "7") })
    }

    /// A trigger created by the test makes the LAST statement of the transaction (the cursor move) fail, after
    /// the frames and the outbox event were already inserted: none of them may be visible afterwards.
    @Test func failureAtTheCursorMoveLeavesNothingOfTheBatch() throws {
        let (dir, store, stream) = try storeHoldingFiveFrames()
        let path = dir.file("store.sqlite")
        try store.database.execute(
            """
            CREATE TRIGGER fail_cursor_move BEFORE UPDATE OF cursor ON stream_cursors
            WHEN NEW.cursor > 5 BEGIN SELECT RAISE(ABORT, 'forced failure at the cursor move'); END
            """)
        let error = #expect(throws: StoreError.self) {
            try store.commit(batch(from: 5, gap: 6...7, dataFrames(8...20)), to: stream.key)
        }
        guard case .sqlite(let sqlite) = error else {
            Issue.record("expected a SQLite error, got \(String(describing: error))")
            return
        }
        #expect(sqlite.message.contains("forced failure at the cursor move"))
        #expect(!store.database.isInTransaction)
        try expectOnlyTheFirstFiveFrames(in: store, key: stream.key)
        // A second connection (an operator's sqlite3, the uplink) sees the same: nothing leaked to disk.
        let other = try GatewayStore(path: path, clock: FixedClock())
        try expectOnlyTheFirstFiveFrames(in: other, key: stream.key)

        // Once the fault is gone the same batch commits in full.
        try store.database.execute("DROP TRIGGER fail_cursor_move")
        let outcome = try store.commit(batch(from: 5, gap: 6...7, dataFrames(8...20)), to: stream.key)
        #expect(outcome.cursor == 20)
        #expect(outcome.gapRecorded == 6...7)
        #expect(try store.outboxTypes() == ["FRAMES", "GAP", "FRAMES"])
    }

    /// A fault in the middle of the frame inserts (the 7th of 15 frames).
    @Test func failureHalfwayThroughTheFramesLeavesNothingOfTheBatch() throws {
        let (dir, store, stream) = try storeHoldingFiveFrames()
        defer { withExtendedLifetime(dir) {} }
        try store.database.execute(
            """
            CREATE TRIGGER fail_frame BEFORE INSERT ON staged_frames
            WHEN NEW.seq = 12 BEGIN SELECT RAISE(ABORT, 'forced failure at seq 12'); END
            """)
        #expect(throws: StoreError.self) { try store.commit(batch(from: 5, dataFrames(6...20)), to: stream.key) }
        try expectOnlyTheFirstFiveFrames(in: store, key: stream.key)
    }

    /// A window larger than one INSERT carries (an --ack-every above 32) is split over several statements; a
    /// failure in a later statement still takes the earlier ones with it.
    @Test func aBatchLargerThanOneInsertIsStoredWholeOrNotAtAll() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("large.sqlite"), clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        let first = dataFrames(1...75, payloadSize: 9)
        let outcome = try store.commit(batch(from: 0, first), to: stream.key)
        #expect(Outcome(outcome) == Outcome(cursor: 75, framesInserted: 75, framesAlreadyStored: 0, gapRecorded: nil))
        #expect(try store.frames(of: stream.key).map(\.seq) == Array(1...75))
        #expect(try store.frames(of: stream.key).map(\.payload) == first.map(\.payload))
        #expect(try store.count("SELECT count(DISTINCT outbox_id) FROM staged_frames") == 1)
        #expect(try store.count("SELECT count(DISTINCT received_at) FROM staged_frames") == 1)

        try store.database.execute(
            """
            CREATE TRIGGER fail_frame BEFORE INSERT ON staged_frames
            WHEN NEW.seq = 150 BEGIN SELECT RAISE(ABORT, 'forced failure at seq 150'); END
            """)
        #expect(throws: StoreError.self) { try store.commit(batch(from: 75, dataFrames(76...160)), to: stream.key) }
        #expect(try store.cursor(of: stream.key) == 75)
        #expect(try store.count("SELECT count(*) FROM staged_frames") == 75)
        #expect(try store.outboxTypes() == ["FRAMES"])
    }

    /// A row already staged above the cursor (a store edited by hand): the frame INSERT meets it (OR ROLLBACK)
    /// and SQLite ends the transaction itself. The error still reaches the caller, the outbox event inserted
    /// before the frames is gone with the rest, and the next commit starts a transaction of its own.
    @Test func aConflictingStagedRowEndsTheTransactionWithNothingOfTheBatch() throws {
        let (dir, store, stream) = try storeHoldingFiveFrames()
        defer { withExtendedLifetime(dir) {} }
        try store.database.execute(
            """
            INSERT INTO staged_frames (peripheral, epoch, seq, payload, received_at, outbox_id)
            VALUES ('\(testPeripheral.string)', '0', 12, x'00', 0, 'stray')
            """)
        let error = #expect(throws: StoreError.self) {
            try store.commit(batch(from: 5, dataFrames(6...20)), to: stream.key)
        }
        guard case .sqlite(let sqlite) = error else {
            Issue.record("expected a SQLite error, got \(String(describing: error))")
            return
        }
        #expect(sqlite.resultCode == .constraint)
        #expect(!store.database.isInTransaction)
        #expect(try store.cursor(of: stream.key) == 5)
        #expect(try store.outboxTypes() == ["FRAMES"])
        #expect(try store.count("SELECT count(*) FROM staged_frames") == 6)

        try store.database.execute("DELETE FROM staged_frames WHERE outbox_id = 'stray'")
        #expect(try store.commit(batch(from: 5, dataFrames(6...20)), to: stream.key).cursor == 20)
        #expect(try store.frames(of: stream.key).map(\.seq) == Array(1...20))
    }

    /// A new store (`store.sqlite` in the returned directory, which lives as long as the caller keeps it) whose
    /// stream holds frames 1...5: the state each fault test starts from.
    private func storeHoldingFiveFrames() throws -> (TemporaryDirectory, GatewayStore, StreamHandle) {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("store.sqlite"), clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        try store.commit(batch(from: 0, dataFrames(1...5)), to: stream.key)
        return (dir, store, stream)
    }

    private func expectOnlyTheFirstFiveFrames(in store: GatewayStore, key: StreamKey) throws {
        #expect(try store.cursor(of: key) == 5)
        #expect(try store.frames(of: key).map(\.seq) == Array(1...5))
        #expect(try store.outboxTypes() == ["FRAMES"])
        #expect(try store.count("SELECT count(*) FROM staged_frames") == 5)
    }

    /// Replay after a crash between commit and SYNC_ACK: the peripheral sends the committed frames again.
    @Test func framesAtOrBelowTheStoredCursorAreSkippedInsideTheTransaction() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("replay.sqlite"), clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        try store.commit(batch(from: 0, dataFrames(1...20)), to: stream.key)

        // The engine still believes the cursor is 10 (its ACK for 11...20 was lost with the crash).
        let overlap = try store.commit(batch(from: 10, dataFrames(11...30)), to: stream.key)
        #expect(Outcome(overlap) == Outcome(cursor: 30, framesInserted: 10, framesAlreadyStored: 10, gapRecorded: nil))

        // A batch entirely at or below the cursor writes nothing at all, not even an empty outbox event.
        let replay = try store.commit(batch(from: 0, dataFrames(1...30)), to: stream.key)
        #expect(Outcome(replay) == Outcome(cursor: 30, framesInserted: 0, framesAlreadyStored: 30, gapRecorded: nil))
        #expect(try store.outboxTypes() == ["FRAMES", "FRAMES"])
        #expect(try store.count("SELECT count(*) FROM staged_frames") == 30)
        #expect(try store.count("SELECT sum(frame_count) FROM outbox_events") == 30)
        #expect(try store.frames(of: stream.key).map(\.seq) == Array(1...30))
    }

    @Test func aBatchThatDoesNotContinueTheCursorIsRejectedAndWritesNothing() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("mismatch.sqlite"), clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        try store.commit(batch(from: 0, dataFrames(1...10)), to: stream.key)

        let skipped = #expect(throws: StoreError.self) {
            try store.commit(batch(from: 11, dataFrames(12...20)), to: stream.key)
        }
        guard case .cursorMismatch(let stored, let start) = skipped else {
            Issue.record("expected cursorMismatch, got \(String(describing: skipped))")
            return
        }
        #expect(stored == 10)
        #expect(start == 12)

        // Not contiguous inside the batch: 11, 12, 14.
        let holey = dataFrames(11...12) + dataFrames(14...14)
        #expect(throws: StoreError.self) { try store.commit(batch(from: 10, holey), to: stream.key) }
        // A gap that does not start right after the cursor.
        #expect(throws: StoreError.self) { try store.commit(batch(from: 10, gap: 12...13, dataFrames(14...15)), to: stream.key) }
        // Non-DATA frames never enter the store.
        #expect(throws: StoreError.self) {
            try store.commit(batch(from: 10, [Frame(type: .syncAck, seq: 11)]), to: stream.key)
        }
        // A stream that was never opened has no cursor to continue.
        let unknown = StreamKey(peripheral: testPeripheral, epoch: 99)
        #expect(throws: StoreError.self) { try store.commit(batch(from: 0, dataFrames(1...3)), to: unknown) }

        #expect(try store.cursor(of: stream.key) == 10)
        #expect(try store.count("SELECT count(*) FROM staged_frames") == 10)
        #expect(try store.outboxTypes() == ["FRAMES"])
        #expect(!store.database.isInTransaction)
    }

    @Test func gapEventComesInFrontOfTheFramesEventInTheSameTransaction() throws {
        let dir = try TemporaryDirectory()
        let clock = FixedClock(millis: 1_796_000_000_000)
        let store = try GatewayStore(path: dir.file("gap.sqlite"), clock: clock)
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        try store.commit(batch(from: 0, dataFrames(1...4)), to: stream.key)
        let outcome = try store.commit(batch(from: 4, gap: 5...9, dataFrames(10...12)), to: stream.key)
        #expect(Outcome(outcome) == Outcome(cursor: 12, framesInserted: 3, framesAlreadyStored: 0, gapRecorded: 5...9))
        #expect(try store.outboxTypes() == ["FRAMES", "GAP", "FRAMES"])

        var gap: (first: Int64, last: Int64, count: Int64, payload: String)?
        try store.database.prepare(
            "SELECT first_seq, last_seq, frame_count, payload FROM outbox_events WHERE event_type = 'GAP'"
        ).forEach { gap = ($0.int64(0), $0.int64(1), $0.int64(2), $0.text(3)) }
        #expect(gap?.first == 5)
        #expect(gap?.last == 9)
        #expect(gap?.count == 0)
        let json = try #require(gap.flatMap { try? JSONSerialization.jsonObject(with: Data($0.payload.utf8)) as? [String: Any] })
        #expect(json["first_seq"] as? String == "5")
        #expect(json["last_seq"] as? String == "9")
        #expect(json["epoch"] as? String == "0")
        #expect(json["peripheral"] as? String == "C0:FF:EE:00:00:01")
        #expect(json["detected_at"] as? String == Timestamp.iso8601(millis: clock.millis))
        // Lost seqs have no frames; the cursor moved past them.
        #expect(try store.frames(of: stream.key).map(\.seq) == Array(1...4) + Array(10...12))

        // A gap-only batch (STREAM_INFO says the peripheral no longer has them) moves the cursor alone.
        let gapOnly = try store.commit(batch(from: 12, gap: 13...40, []), to: stream.key)
        #expect(Outcome(gapOnly) == Outcome(cursor: 40, framesInserted: 0, framesAlreadyStored: 0, gapRecorded: 13...40))
        #expect(try store.outboxTypes() == ["FRAMES", "GAP", "FRAMES", "GAP"])
    }

    @Test func regressionRecordsAnEventAndRebasesOntoAFreshActiveStream() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("regression.sqlite"), clock: FixedClock())
        let old = try store.openStream(peripheral: testPeripheral, deviceEpoch: 5)
        try store.commit(batch(from: 0, dataFrames(1...30)), to: old.key)

        let fresh = try store.recordRegression(stream: old, cursor: 30, head: 3)
        #expect(fresh.key.peripheral == testPeripheral)
        #expect(fresh.key.epoch != old.key.epoch)
        #expect(fresh.deviceEpoch == 5)
        #expect(fresh.cursor == 0)
        #expect(try store.outboxTypes() == ["FRAMES", "REGRESSION"])

        var payload = ""
        try store.database.prepare("SELECT payload, epoch FROM outbox_events WHERE event_type = 'REGRESSION'").forEach {
            payload = $0.text(0)
            #expect($0.text(1) == "5")  // filed under the old stream
        }
        let json = try #require(try JSONSerialization.jsonObject(with: Data(payload.utf8)) as? [String: Any])
        #expect(json["cursor"] as? String == "30")
        #expect(json["head"] as? String == "3")
        #expect(json["epoch"] as? String == "5")
        #expect(json["new_epoch"] as? String == String(fresh.key.epoch))

        let streams = try store.streams()
        #expect(streams.count == 2)
        let oldStatus = try #require(streams.first { $0.epoch == "5" })
        let newStatus = try #require(streams.first { $0.epoch == String(fresh.key.epoch) })
        #expect(!oldStatus.active)
        #expect(oldStatus.cursor == 30)
        #expect(oldStatus.framesStaged == 30)
        #expect(newStatus.active)
        #expect(newStatus.deviceEpoch == "5")
        #expect(newStatus.cursor == 0)

        // The peripheral's next session (same reported epoch) lands on the new stream, and its seq 1...3 are
        // stored as new events, not dropped as duplicates of the old 1...3.
        let reopened = try store.openStream(peripheral: testPeripheral, deviceEpoch: 5)
        #expect(reopened == fresh)
        try store.commit(batch(from: 0, dataFrames(1...3, payloadSize: 1)), to: reopened.key)
        #expect(try store.frames(of: reopened.key).count == 3)
        #expect(try store.frames(of: old.key).count == 30)
    }

    @Test func aNewEpochIsANewStreamAndTheOldRowsAreKept() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("epochs.sqlite"), clock: FixedClock())
        let first = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        try store.commit(batch(from: 0, dataFrames(1...25)), to: first.key)
        let wiped = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0xDEAD_BEEF)
        #expect(wiped.key == StreamKey(peripheral: testPeripheral, epoch: 0xDEAD_BEEF))
        #expect(wiped.cursor == 0)
        try store.commit(batch(from: 0, dataFrames(1...5)), to: wiped.key)
        #expect(try store.frames(of: first.key).count == 25)
        #expect(try store.frames(of: wiped.key).count == 5)
        // Reopening either epoch finds its own cursor.
        #expect(try store.openStream(peripheral: testPeripheral, deviceEpoch: 0).cursor == 25)
        #expect(try store.openStream(peripheral: testPeripheral, deviceEpoch: 0xDEAD_BEEF).cursor == 5)
        // Another peripheral is yet another stream.
        let other = try store.openStream(peripheral: PeripheralAddress("c0:ff:ee:00:00:02")!, deviceEpoch: 0)
        #expect(other.cursor == 0)
        #expect(try store.streams().count == 3)
    }

    @Test func seqsAndEpochsAbove2To63RoundTrip() throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("big.sqlite")
        let epoch = UInt64.max - 1
        let base: UInt64 = 1 << 63
        do {
            let store = try GatewayStore(path: path, clock: FixedClock())
            let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: epoch)
            // Jump straight up to just below 2^63 with a recorded gap, cross it, then frames up to UInt64.max.
            let outcome = try store.commit(
                batch(from: 0, gap: 1...(base - 3), dataFrames((base - 2)...(base + 5))), to: stream.key)
            #expect(outcome.cursor == base + 5)
            try store.commit(
                batch(from: base + 5, gap: (base + 6)...(UInt64.max - 2), dataFrames((UInt64.max - 1)...UInt64.max)),
                to: stream.key)
        }
        let store = try GatewayStore(path: path, clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: epoch)
        #expect(stream.key.epoch == epoch)
        #expect(stream.cursor == UInt64.max)
        // In unsigned seq order, across the point where the stored bit pattern turns negative.
        let seqs = try store.frames(of: stream.key).map(\.seq)
        #expect(seqs == Array((base - 2)...(base + 5)) + [UInt64.max - 1, UInt64.max])
        var gaps: [(Int64, Int64)] = []
        try store.database.prepare("SELECT first_seq, last_seq FROM outbox_events WHERE event_type = 'GAP' ORDER BY rowid")
            .forEach { gaps.append(($0.int64(0), $0.int64(1))) }
        #expect(gaps.map { UInt64(bitPattern: $0.0) } == [1, base + 6])
        #expect(gaps.map { UInt64(bitPattern: $0.1) } == [base - 3, UInt64.max - 2])
        #expect(try store.streams().first?.epoch == String(epoch))
        // A replay of the top frame is still a duplicate, even though its stored bit pattern is negative.
        let replay = try store.commit(batch(from: UInt64.max - 1, dataFrames(UInt64.max...UInt64.max)), to: stream.key)
        #expect(replay.framesAlreadyStored == 1)
        #expect(replay.framesInserted == 0)
    }

    @Test func emptyPayloadsAreStoredAsEmptyBlobsNotNull() throws {
        let dir = try TemporaryDirectory()
        let store = try GatewayStore(path: dir.file("empty.sqlite"), clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        try store.commit(batch(from: 0, dataFrames(1...3, payloadSize: 0)), to: stream.key)
        #expect(try store.count("SELECT count(*) FROM staged_frames WHERE typeof(payload) = 'blob' AND length(payload) = 0") == 3)
        #expect(try store.frames(of: stream.key).map(\.payload) == [[], [], []])
    }
}
