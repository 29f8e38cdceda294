import FerrySync
import Testing

/// A session that stays connected for days writes an ACK every 20 frames: its record of them must not grow.
@Suite struct AcknowledgementLogTests {
    @Test func keepsCountFirstHighestAndOnlyTheRecentOnes() {
        var log = AcknowledgementLog()
        #expect(log.count == 0 && log.first == nil && log.highest == nil && log.last == nil)
        for seq in stride(from: UInt64(20), through: 200_000, by: 20) { log.record(seq) }
        #expect(log.count == 10_000)
        #expect(log.first == 20)
        #expect(log.highest == 200_000)
        #expect(log.last == 200_000)
        #expect(log.recent.count == AcknowledgementLog.recentLimit)
        #expect(log.recent.first == 200_000 - UInt64(AcknowledgementLog.recentLimit - 1) * 20)
    }

    @Test func highestIsTheLargestEvenWhenACursorWentBack() {
        var log = AcknowledgementLog()
        for seq: UInt64 in [40, 60, 20] { log.record(seq) }  // a new epoch restarts the numbering
        #expect(log.highest == 60 && log.last == 20 && log.recent == [40, 60, 20])
    }
}
