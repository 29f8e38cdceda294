@testable import FerryCLI
import FerrySync
import Testing

/// `ferry sync`'s result is a typed value; its description is the JSON's "result" and the summary line's word,
/// which operators' scripts read: the texts stay as documented in `ferry sync --help`'s JSON keys.
@Suite struct SyncResultTests {
    @Test func eachResultReadsAsBefore() {
        let cases: [(SyncCommand.Result, String)] = [
            (.caughtUp, "caught up"),
            (.interrupted, "interrupted"),
            (.timedOut(seconds: 90), "timeout after 90 s"),
            (.noResponse, "no response from the peripheral after 3 SYNC_REQs"),
            (.noProgress(seconds: 30), "no progress: no new frame for 30 s (committed frames are kept; run again)"),
            (.overDiskBudget, "store over its disk budget"),
            (.insecureLink("needs a bond"), "needs a bond"),
            (.bluetoothdRestarted(.linkLost),
             "link lost: bluetoothd exited or restarted during the sync (committed frames are kept; run again)"),
            (.ended(.subscribeFailed("refused")), "subscribe failed: refused"),
        ]
        for (result, text) in cases {
            #expect(result.description == text)
        }
        // Only a session that caught up counts as done (exit 0).
        #expect(cases.filter { $0.0 == .caughtUp }.count == 1)
    }
}
