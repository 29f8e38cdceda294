import FerryGateway
import FerryProtocol
import FerryStore
import Foundation
import Testing

/// The store file is input too: a damaged or hand-edited one may hold any 64-bit integer in any INTEGER column.
/// The uplink's claim, the /metrics scrape and `ferry status`/`peripherals`/`outbox list` (the real binary, where
/// a trap is a signal, not a crash of this runner) read it without trapping or allocating what a count claims.
@Suite struct HostileStoreValuesTests {
    static let extremes: [Int64] = [.min, .max, -1]

    /// A store with one stream of 60 frames (3 outbox events), a sync state and a forwarder row, then every INTEGER
    /// column of every table set to `value`.
    static func damagedStore(at path: String, value: Int64) throws {
        do {
            let store = try GatewayStore(path: path)
            let peripheral = PeripheralAddress("C0:FF:EE:00:00:01")!
            let stream = try store.openStream(peripheral: peripheral, deviceEpoch: 7)
            for w in 0..<3 {
                let first = UInt64(w * 20 + 1)
                let frames = (first...(first + 19)).map { Frame.data(seq: $0, payload: [UInt8](repeating: 7, count: 40)) }
                try store.commit(
                    CommitBatch(expectedCursor: first - 1, gap: nil, frames: frames, newCursor: first + 19, acknowledge: true),
                    to: stream.key)
            }
            try store.recordSessionEnd(peripheral: peripheral, result: .disconnected(.caughtUp), epoch: 7, head: 90)
        }
        let sql = try Database.open(path: path)
        try sql.execute(
            """
            INSERT INTO trusted_peripherals VALUES ('C0:FF:EE:00:00:01', 'public', 'x', 'just-works', 0);
            INSERT INTO uplink_forwarder (id, owner, pid, boot_id, expires_at, state, state_since, detail)
                VALUES (1, 'o', 1, 'b', 0, 'offline', 0, 'd');
            """)
        var columns: [(table: String, column: String)] = []
        try sql.prepare(
            "SELECT m.name, p.name FROM sqlite_master m, pragma_table_info(m.name) p "
                + "WHERE m.type = 'table' AND p.type LIKE '%INT%'"
        ).forEach { columns.append(($0.text(0), $0.text(1))) }
        #expect(columns.count > 20)
        for (table, column) in columns {
            // A CHECK or key constraint may refuse the value: that column keeps its own.
            try? sql.prepare("UPDATE \(table) SET \(column) = ?").run([.integer(value)])
        }
    }

    @Test(arguments: extremes)
    func theUplinksClaimAndTheScrapeReadAnyIntegers(_ value: Int64) throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("ferry.sqlite")
        try Self.damagedStore(at: path, value: value)
        let store = try GatewayStore(path: path)
        for now in [Int64.min, 0, 1_000_000, Int64.max] {
            _ = try StoreReadings.read(from: store, now: now)
        }
        // Claimed (whatever next_retry_at holds, a claim at the end of time finds it due) and its frames read;
        // frame_count (Int32.max here at most) is not taken as a size to reserve.
        if let batch = try store.claimBatch(now: Int64.max) {
            for event in batch.events { _ = try store.frames(for: event) }
        }
    }

    @Test(arguments: extremes)
    func commandsThatReadTheStoreAnswerWithoutATrap(_ value: Int64) async throws {
        let dir = try TemporaryDirectory()
        let path = dir.file("ferry.sqlite")
        try Self.damagedStore(at: path, value: value)
        for command in [
            ["status", "--db", path], ["status", "--db", path, "--json"], ["peripherals", "--db", path],
            ["peripherals", "--db", path, "--json"], ["outbox", "list", "--db", path, "--json"],
        ] {
            let finished = try await BinaryTests.run(command)
            #expect(!finished.signaled, "ferry \(command.joined(separator: " ")): \(finished.stderr)")
            #expect(finished.status == 0 || finished.status == 1, "ferry \(command.joined(separator: " ")): \(finished.stderr)")
        }
    }
}
