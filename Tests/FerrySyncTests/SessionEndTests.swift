import FerryProtocol
import FerryStore
@testable import FerrySync
import Synchronization
import Testing

/// How a session's typed end reaches the scheduler, the store and the log, and the Logger's line shape.
@Suite struct SessionEndTests {
    @Test func theSchedulerOutcomeFollowsTheEnd() {
        func summary(_ end: SessionEnd?, backpressure: Bool = false) -> SyncSummary {
            var s = SyncSummary(peripheral: "C0:FF:EE:00:00:01")
            s.end = end
            s.backpressure = backpressure
            return s
        }
        #expect(SyncScheduler.Outcome(summary(.disconnected(.caughtUp)), backlog: 0) == .caughtUp)
        #expect(SyncScheduler.Outcome(summary(.disconnected(.shutdown)), backlog: 7) == .interrupted(backlog: 7))
        #expect(SyncScheduler.Outcome(summary(.disconnected(.maxDurationReached)), backlog: nil) == .interrupted(backlog: nil))
        #expect(SyncScheduler.Outcome(summary(.disconnected(.storeFailed), backpressure: true), backlog: 3) == .interrupted(backlog: 3))
        for end: SessionEnd? in [.linkLost, .subscribeFailed("x"), .disconnected(.noResponse), .disconnected(.noProgress), nil] {
            #expect(SyncScheduler.Outcome(summary(end), backlog: 1) == .failed, "\(String(describing: end))")
        }
    }

    @Test func logTextAndStoredKindsKeepTheirWords() {
        let cases: [(SessionEnd, String, String)] = [
            (.disconnected(.caughtUp), "caughtUp", "caughtUp"),
            (.disconnected(.streamInfoUnreadable("a \"b\"")), #"streamInfoUnreadable("a \"b\"")"#, "streamInfoUnreadable"),
            (.subscribeFailed("Notify acquired"), "subscribe failed: Notify acquired", "subscribeFailed"),
            (.linkLost, "link lost", "linkLost"),
        ]
        for (end, text, stored) in cases {
            #expect("\(end)" == text)
            #expect(end.result.description == stored)
        }
        #expect(SyncResult.refusedBondLost.description == "refused: bond lost")
        #expect(SyncResult.backpressure.description == "backpressure")
    }

    final class Lines: LogSink {
        let lines = Mutex<[String]>([])
        func log(_ level: LogLevel, _ message: String) { lines.withLock { $0.append("\(level) \(message)") } }
    }

    @Test func theLoggerPutsItsMetadataInFrontAndFiltersByLevel() {
        let sink = Lines()
        var log = Logger(sink: sink).with(peripheral: "C0:FF:EE:00:00:01")
        log.warning("gap 5...9 recorded")
        log.logLevel = .info
        log.debug("not shown")
        log.metadata.session = "s2"
        log.info("caught up")
        Logger(sink: sink).error("plain")
        #expect(sink.lines.withLock { $0 } == [
            "warning C0:FF:EE:00:00:01: gap 5...9 recorded", "info C0:FF:EE:00:00:01 [s2]: caught up", "error plain",
        ])
    }
}
