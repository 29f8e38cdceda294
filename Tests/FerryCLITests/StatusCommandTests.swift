import FerryCLI
import FerryStore
import Foundation
import Testing

/// `ferry status`: per-stream cursors and frame counts, outbox counts for all four statuses, oldest PENDING age.
@Suite struct StatusCommandTests {
    @Test func jsonShapeWithEveryOutboxStatus() throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let capture = try dir.write(Wire.capture(1...80), to: "c.bin")
        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, capture).status == 0)
        do {
            // Play the uplink: one event of each status; the PENDING one is an hour old.
            let sql = try Database.open(path: db)
            var ids: [String] = []
            try sql.prepare("SELECT id FROM outbox_events ORDER BY rowid").forEach { ids.append($0.text(0)) }
            try #require(ids.count == 4)
            let hourAgo = Int64(Date().timeIntervalSince1970 * 1000) - 3_600_000
            try sql.prepare("UPDATE outbox_events SET created_at = ? WHERE id = ?").run([.integer(hourAgo), .text(ids[0])])
            for (id, status) in zip(ids.dropFirst(), ["IN_FLIGHT", "COMPLETED", "FAILED"]) {
                try sql.prepare("UPDATE outbox_events SET status = ? WHERE id = ?").run([.text(status), .text(id)])
            }
        }

        let result = ferry("status", "--db", db, "--json")
        #expect(result.status == 0)
        #expect(result.stderr.isEmpty)
        let json = try result.json()
        #expect(Set(json.keys) == ["streams", "outbox", "oldest_pending_age_seconds", "disk_bytes", "uplink", "daemon"])
        #expect(json["daemon"] as? [String: Bool] == ["running": false])
        let uplink = try #require(json["uplink"] as? [String: Any])
        #expect(uplink["state"] as? String == "not running")
        #expect(uplink["backlog"] as? Int == 2)
        #expect((json["disk_bytes"] as? Int ?? 0) > 0)
        let streams = try #require(json["streams"] as? [[String: Any]])
        #expect(streams.count == 1)
        let stream = try #require(streams.first)
        #expect(Set(stream.keys) == ["peripheral", "epoch", "device_epoch", "cursor", "frames_staged", "active"])
        #expect(stream["peripheral"] as? String == peripheral)
        #expect(stream["epoch"] as? String == "0")
        #expect(stream["device_epoch"] as? String == "0")
        #expect(stream["cursor"] as? String == "80")
        #expect(stream["frames_staged"] as? Int == 80)
        #expect(stream["active"] as? Bool == true)
        let outbox = try #require(json["outbox"] as? [String: Int])
        #expect(outbox == ["PENDING": 1, "IN_FLIGHT": 1, "COMPLETED": 1, "FAILED": 1])
        let age = try #require(json["oldest_pending_age_seconds"] as? Double)
        #expect(age >= 3600 && age < 3660, "oldest PENDING age \(age) s")

        let text = ferry("status", "--db", db)
        #expect(text.status == 0)
        #expect(text.stdout.contains { $0.hasPrefix(peripheral) && $0.contains("80") })
        #expect(text.stdout.contains("outbox: PENDING 1, IN_FLIGHT 1, COMPLETED 1, FAILED 1"))
        #expect(text.stdout.contains { $0.hasPrefix("oldest PENDING event: 36") })
    }

    /// The live view file `ferry run` keeps beside the store (written by hand here: the format is the contract).
    @Test func showsTheRunningDaemonsLiveViewOnlyWhileItIsFreshAndItsProcessExists() throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, try dir.write([], to: "empty.bin")).status == 0)
        func live(pid: Int32, ageMillis: Int64) throws {
            let now = Int64(Date().timeIntervalSince1970 * 1000)
            let text = #"{"adapter":"hci0","max_connections":3,"pid":\#(pid),"sessions":[{"peripheral":"AA:BB:CC:DD:EE:01","#
                + #""phase":"syncing","seconds":12.5}],"slots_in_use":1,"updated_at":\#(now - ageMillis)}"#
            try text.write(toFile: dir.file("ferry-live.json"), atomically: true, encoding: .utf8)
        }
        try live(pid: getpid(), ageMillis: 1000)
        let json = try ferry("status", "--db", db, "--json").json()
        let daemon = try #require(json["daemon"] as? [String: Any])
        #expect(daemon["running"] as? Bool == true)
        #expect(daemon["pid"] as? Int == Int(getpid()))
        #expect(daemon["slots_in_use"] as? Int == 1 && daemon["max_connections"] as? Int == 3)
        #expect(daemon["adapter"] as? String == "hci0")
        let sessions = try #require(daemon["sessions"] as? [[String: Any]])
        #expect(sessions.count == 1 && sessions.first?["phase"] as? String == "syncing")
        let text = ferry("status", "--db", db).stdout
        #expect(text.contains("daemon: running (pid \(getpid())), adapter hci0, 1 of 3 slots in use"))
        #expect(text.contains("  AA:BB:CC:DD:EE:01: syncing for 13 s") || text.contains("  AA:BB:CC:DD:EE:01: syncing for 12 s"))
        #expect(daemon["adapter_recovery"] is NSNull)  // a file from before adapter recovery existed
        // Adapter recovery at work: named in the daemon line and the JSON.
        let now = Int64(Date().timeIntervalSince1970 * 1000)
        try (#"{"adapter":"hci0","adapter_recovery":"verifying_power_cycle","max_connections":3,"pid":\#(getpid()),"#
            + #""sessions":[],"slots_in_use":0,"updated_at":\#(now)}"#)
            .write(toFile: dir.file("ferry-live.json"), atomically: true, encoding: .utf8)
        #expect(ferry("status", "--db", db).stdout.contains(
            "daemon: running (pid \(getpid())), adapter hci0 (adapter recovery: verifying_power_cycle), 0 of 3 slots in use"))
        let recovering = try #require(try ferry("status", "--db", db, "--json").json()["daemon"] as? [String: Any])
        #expect(recovering["adapter_recovery"] as? String == "verifying_power_cycle")
        try live(pid: getpid(), ageMillis: 60_000)  // not rewritten for a minute: the daemon is gone
        #expect(ferry("status", "--db", db).stdout.contains("daemon: not running on this store"))
        try live(pid: Int32.max, ageMillis: 0)  // fresh, but no such process (SIGKILLed daemon)
        #expect(try ferry("status", "--db", db, "--json").json()["daemon"] as? [String: Bool] == ["running": false])
    }

    @Test func jsonOfAStoreWithoutPendingEventsHasANullAge() throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let capture = try dir.write([], to: "empty.bin")
        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, "--epoch", "12345678901234567890", capture).status == 0)
        let result = ferry("status", "--db", db, "--json")
        #expect(result.status == 0)
        // The store's size varies with the SQLite build; everything else is exact.
        let line = result.stdout.first ?? ""
        let withoutSize = line.replacingOccurrences(of: #","disk_bytes":[0-9]+,"#, with: ",", options: .regularExpression)
        #expect(withoutSize != line)
        let expected: String =
            #"{"streams":[{"peripheral":"C0:FF:EE:00:00:01","epoch":"12345678901234567890","#
            + #""device_epoch":"12345678901234567890","cursor":"0","frames_staged":0,"active":true}],"#
            + #""outbox":{"PENDING":0,"IN_FLIGHT":0,"COMPLETED":0,"FAILED":0},"oldest_pending_age_seconds":null,"#
            + #""uplink":{"state":"not running","since":null,"detail":null,"pid":null,"backlog":0},"daemon":{"running":false}}"#
        #expect([withoutSize] == [expected])
    }

    @Test func severalStreamsAreListed() throws {
        let dir = try TemporaryDirectory()
        let db = dir.file("ferry.sqlite")
        let capture = try dir.write(Wire.capture(1...5), to: "c.bin")
        #expect(ferry("ingest", "--db", db, "--peripheral", peripheral, capture).status == 0)
        #expect(ferry("ingest", "--db", db, "--peripheral", "AA:BB:CC:DD:EE:FF", "--epoch", "3", capture).status == 0)
        let streams = try #require(try ferry("status", "--db", db, "--json").json()["streams"] as? [[String: Any]])
        #expect(streams.map { $0["peripheral"] as? String } == ["AA:BB:CC:DD:EE:FF", peripheral])
        #expect(streams.map { $0["epoch"] as? String } == ["3", "0"])
        #expect(streams.map { $0["frames_staged"] as? Int } == [5, 5])
    }
}
