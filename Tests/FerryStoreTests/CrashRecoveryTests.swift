import FerryProtocol
import FerryStore
import Foundation
import Testing

/// What a crash leaves on disk: the main file plus the WAL, never checkpointed or closed. (The CLI tests also
/// SIGKILL a real `ferry ingest` mid-run; this one needs no binary.)
@Suite struct CrashRecoveryTests {
    @Test func committedWindowsSurviveAProcessThatNeverClosedTheStore() throws {
        let dir = try TemporaryDirectory()
        let live = dir.file("live.sqlite")
        let crashed = dir.file("crashed.sqlite")
        let store = try GatewayStore(path: live, clock: FixedClock())
        let stream = try store.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        var cursor: UInt64 = 0
        for _ in 0..<50 {
            try store.commit(batch(from: cursor, dataFrames((cursor + 1)...(cursor + 20))), to: stream.key)
            cursor += 20
        }
        // An uncommitted write in progress at the moment of the "crash".
        try store.database.execute("BEGIN IMMEDIATE")
        try store.database.execute("UPDATE stream_cursors SET cursor = 999999")
        try store.database.execute("DELETE FROM staged_frames WHERE seq > 500")

        // Snapshot the files exactly as they are while the connection is still open (no close, no checkpoint):
        // that is what a killed process leaves behind. The -shm index is rebuilt from the WAL on open.
        #expect(FileManager.default.fileExists(atPath: live + "-wal"))
        try FileManager.default.copyItem(atPath: live, toPath: crashed)
        try FileManager.default.copyItem(atPath: live + "-wal", toPath: crashed + "-wal")

        let recovered = try GatewayStore(path: crashed, clock: FixedClock())
        #expect(try recovered.database.text("PRAGMA integrity_check") == "ok")
        let reopened = try recovered.openStream(peripheral: testPeripheral, deviceEpoch: 0)
        #expect(reopened.cursor == 1000)
        let seqs = try recovered.frames(of: reopened.key).map(\.seq)
        #expect(seqs == Array(1...1000), "frames are not exactly 1...cursor")
        #expect(try recovered.count("SELECT count(*) FROM outbox_events WHERE event_type = 'FRAMES'") == 50)
        #expect(try recovered.count("SELECT sum(frame_count) FROM outbox_events") == 1000)
        // Recovery continues where the crash left off.
        let next = try recovered.commit(batch(from: 1000, dataFrames(1001...1020)), to: reopened.key)
        #expect(next.cursor == 1020)
        try store.database.execute("ROLLBACK")
    }
}
