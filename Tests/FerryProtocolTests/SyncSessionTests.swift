import Testing
@testable import FerryProtocol

// Scripted SyncSession scenarios (PROTOCOL §4): each test plays the owner by hand with an explicit `now`
// (times are binary-exact: idle 0.25 s, response 2 s) and checks the exact actions.

/// A recognisable payload per seq (its length varies with the seq, so frames differ in size).
func payload(_ seq: UInt64) -> [UInt8] {
    Array("event \(seq) ".utf8) + [UInt8](repeating: UInt8(truncatingIfNeeded: seq), count: Int(seq % 37))
}
func frames(_ seqs: ClosedRange<UInt64>) -> [Frame] { seqs.map { .data(seq: $0, payload: payload($0)) } }
func dataBytes(_ seqs: ClosedRange<UInt64>) -> [UInt8] { frames(seqs).flatMap { $0.encoded() } }
func info(epoch: UInt64 = 7, oldest: UInt64, head: UInt64) -> [UInt8] {
    StreamInfo(epoch: epoch, oldest: oldest, head: head).encoded()
}
func batch(_ expected: UInt64, _ seqs: ClosedRange<UInt64>?, gap: ClosedRange<UInt64>? = nil, ack: Bool = true) -> SyncAction {
    let f = seqs.map(frames) ?? []
    return .commit(
        CommitBatch(expectedCursor: expected, gap: gap, frames: f, newCursor: f.last?.seq ?? gap?.upperBound ?? expected,
                    acknowledge: ack))
}

/// A session that has read STREAM_INFO (or not) and loaded `cursor`; returns it with cursorLoaded's actions.
func startedSession(cursor: UInt64, streamInfo: [UInt8]?, configuration: SyncSession.Configuration = .init())
    -> (SyncSession, [SyncAction])
{
    var s = SyncSession(configuration: configuration)
    if let streamInfo {
        #expect(s.connected(hasStreamInfo: true, now: 0) == [.readStreamInfo])
        let epoch = try! StreamInfo(bytes: streamInfo).epoch
        #expect(s.streamInfoRead(streamInfo, now: 0) == [.loadCursor(epoch: epoch)])
    } else {
        #expect(s.connected(hasStreamInfo: false, now: 0) == [.loadCursor(epoch: 0)])
    }
    let actions = s.cursorLoaded(cursor, now: 0)
    return (s, actions)
}

@Suite struct SyncSessionTests {
    @Test func happyPathInTwentyFrameWindowsThenIdleCommitThenCaughtUp() {
        var (s, start) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(start == [.subscribe, .sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(1...25), now: 1) == [batch(0, 1...20)])
        #expect(s.commitFinished(cursor: 20, now: 1) == [.sendSyncAck(20)])
        // 21...50 staged: one commit of 20 at a time, the rest waits.
        #expect(s.bytesReceived(dataBytes(26...50), now: 2) == [batch(20, 21...40)])
        // The partial window (41...50) reaches STREAM_INFO's head: committed at once, no idle wait.
        #expect(s.commitFinished(cursor: 40, now: 2) == [.sendSyncAck(40), batch(40, 41...50)])
        #expect(s.commitFinished(cursor: 50, now: 2) == [.sendSyncAck(50), .caughtUp(cursor: 50), .disconnect(.caughtUp)])
        #expect(s.isClosed)
        #expect(s.nextDeadline == nil)
        #expect(s.statistics.committedFrames == 50 && s.statistics.acks == 3 && s.statistics.syncRequests == 1)
    }

    @Test func partialWindowBelowTheHeadWaitsForIdle() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 60))
        #expect(s.bytesReceived(dataBytes(1...25), now: 1) == [batch(0, 1...20)])
        #expect(s.commitFinished(cursor: 20, now: 1) == [.sendSyncAck(20)])
        // 21...25 staged, the head is 60: more may come, so the partial window waits for 0.25 s of silence.
        #expect(s.nextDeadline == 1.25)
        #expect(s.timerFired(now: 1.125) == [])
        #expect(s.timerFired(now: 1.25) == [batch(20, 21...25)])
        #expect(s.commitFinished(cursor: 25, now: 1.25) == [.sendSyncAck(25)])
    }

    /// Pipelined: frames past the batch being committed keep arriving; each commit takes one batch of 20, and an
    /// ACK only ever follows the commit that covers it.
    @Test func pipelinedFramesPastTheBatchAreStagedNotAcknowledged() {
        var configuration = SyncSession.Configuration()
        configuration.window = 40
        var (s, start) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 100), configuration: configuration)
        #expect(start == [.subscribe, .sendSyncRequest(lastCommitted: 0, window: 40)])
        // 40 frames in one go (the whole window): one commit of 20; 21...40 wait behind it.
        #expect(s.bytesReceived(dataBytes(1...40), now: 1) == [batch(0, 1...20)])
        #expect(s.commitFinished(cursor: 20, now: 1) == [.sendSyncAck(20), batch(20, 21...40)])
        #expect(s.bytesReceived(dataBytes(41...45), now: 1) == [])
        #expect(s.commitFinished(cursor: 40, now: 1) == [.sendSyncAck(40)])
        #expect(s.statistics.acks == 2 && s.statistics.committedFrames == 40)
    }

    /// A store slower than the air: while one commit runs, several cadences' worth arrive. They go into ONE
    /// transaction (whole cadences only; the rest waits), and the ACKs after it are those of committing them one
    /// cadence at a time, in order, none above the stored cursor.
    @Test func cadencesThatPiledUpDuringACommitAreCommittedTogether() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 200))
        #expect(s.bytesReceived(dataBytes(1...20), now: 1) == [batch(0, 1...20)])
        #expect(s.bytesReceived(dataBytes(21...85), now: 1.01) == [])
        #expect(s.commitFinished(cursor: 20, now: 1.02) == [.sendSyncAck(20), batch(20, 21...80)])
        #expect(s.commitFinished(cursor: 80, now: 1.03) == [.sendSyncAck(40), .sendSyncAck(60), .sendSyncAck(80)])
        #expect(s.statistics.commits == 2 && s.statistics.acks == 4 && s.statistics.committedFrames == 80)
        // 81...85 are less than a cadence: they wait for more, as any partial batch does.
        #expect(s.bytesReceived(dataBytes(86...100), now: 1.04) == [batch(80, 81...100)])
        // Less than two cadences behind: one cadence per commit, as without grouping.
        #expect(s.bytesReceived(dataBytes(101...130), now: 1.05) == [])
        #expect(s.commitFinished(cursor: 100, now: 1.06) == [.sendSyncAck(100), batch(100, 101...120)])
    }

    /// A peripheral that ignores the window cannot make one transaction larger than a window's worth: the rest
    /// stays staged for the next commit.
    /// A session holds at most one window of unacknowledged frames (being committed or staged), whatever the
    /// peripheral sends: one that keeps to the window (40 here) never sends more. The excess of one that does
    /// not is dropped and counted; its next frame is then a gap, drained, and asked for again.
    @Test func framesPastTheWindowAreDroppedNotHeld() {
        var configuration = SyncSession.Configuration()
        configuration.window = 40
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 300), configuration: configuration)
        #expect(s.bytesReceived(dataBytes(1...20), now: 1) == [batch(0, 1...20)])
        #expect(s.bytesReceived(dataBytes(21...130), now: 1.01) == [])
        #expect(s.statistics.staged == 40, "1-20 being committed, 21-40 staged: the window")
        #expect(s.statistics.pastWindow == 1, "41")
        #expect(s.statistics.gapsDetected == 1, "42 follows 40: a gap")
        #expect(s.statistics.droppedWhileDraining == 88, "43-130")
        #expect(s.commitFinished(cursor: 20, now: 1.02) == [.sendSyncAck(20), batch(20, 21...40)])
        #expect(s.commitFinished(cursor: 40, now: 1.03) == [.sendSyncAck(40)])
        // Silence ends the drain: STREAM_INFO is read again, and the replay asked for from the committed cursor.
        #expect(s.timerFired(now: 1.5) == [.readStreamInfo])
        #expect(s.streamInfoRead(info(oldest: 1, head: 300), now: 1.6) == [.sendSyncRequest(lastCommitted: 40, window: 40)])
        #expect(s.bytesReceived(dataBytes(41...60), now: 1.7) == [batch(40, 41...60)])
        #expect(s.statistics.gapsRecorded == 0, "nothing was lost")
    }

    /// Frames that piled up behind a slow commit, within the window, are committed together in whole cadences.
    @Test func framesBehindASlowCommitAreCommittedTogether() {
        var configuration = SyncSession.Configuration()
        configuration.window = 100
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 300), configuration: configuration)
        #expect(s.bytesReceived(dataBytes(1...20), now: 1) == [batch(0, 1...20)])
        #expect(s.bytesReceived(dataBytes(21...95), now: 1.01) == [])
        #expect(s.commitFinished(cursor: 20, now: 1.02) == [.sendSyncAck(20), batch(20, 21...80)])
        #expect(s.commitFinished(cursor: 80, now: 1.03) == [.sendSyncAck(40), .sendSyncAck(60), .sendSyncAck(80)])
        #expect(s.statistics.pastWindow == 0)
    }

    /// Large frames: a grouped commit stops adding cadences before its payloads pass `maxGroupPayloadBytes` (it
    /// becomes one outbox event, which the uplink would otherwise have to send alone, above its batch limit).
    @Test func aGroupedCommitIsBoundedByItsPayloadBytes() {
        var configuration = SyncSession.Configuration()
        configuration.window = 500
        configuration.maxGroupPayloadBytes = 2 * 20 * 100 + 10  // two cadences of 100-byte payloads, not three
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 300), configuration: configuration)
        let big = { (seqs: ClosedRange<UInt64>) in
            seqs.flatMap { Frame.data(seq: $0, payload: [UInt8](repeating: UInt8($0 % 256), count: 100)).encoded() }
        }
        guard case .commit(let first) = s.bytesReceived(big(1...20), now: 1).first else {
            Issue.record("no commit for the first cadence")
            return
        }
        #expect(first.frames.count == 20)
        #expect(s.bytesReceived(big(21...120), now: 1.01) == [])
        let next = s.commitFinished(cursor: 20, now: 1.02)
        #expect(next.first == .sendSyncAck(20))
        guard case .commit(let grouped) = next.last else {
            Issue.record("no grouped commit: \(next)")
            return
        }
        #expect(grouped.frames.map(\.seq) == Array(21...60), "two cadences fit the payload bound, a third does not")
    }

    @Test func duplicatesAreDroppedAndCounted() {
        var (s, start) = startedSession(cursor: 10, streamInfo: info(oldest: 1, head: 30))
        #expect(start == [.subscribe, .sendSyncAck(10), .sendSyncRequest(lastCommitted: 10, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(5...15), now: 1) == [])
        #expect(s.statistics.duplicates == 6)
        #expect(s.bytesReceived(dataBytes(11...12) + dataBytes(16...16), now: 1) == [])
        #expect(s.statistics.duplicates == 8)
        #expect(s.timerFired(now: 1.25) == [batch(10, 11...16)])
    }

    @Test func inOrderStagingAcrossRandomChunks() {
        var rng = SeededRNG(seed: 99)
        var (s, _) = startedSession(cursor: 0, streamInfo: nil)
        var commits: [CommitBatch] = []
        for chunk in randomChunks(dataBytes(1...60), maxChunk: 37, using: &rng) {
            for case .commit(let b) in s.bytesReceived(chunk, now: 1) {
                commits.append(b)
                for case .commit(let more) in s.commitFinished(cursor: b.newCursor, now: 1) { commits.append(more) }
            }
        }
        #expect(commits.map(\.frames) == [frames(1...20), frames(21...40), frames(41...60)])
        #expect(commits.map(\.expectedCursor) == [0, 20, 40])
    }

    @Test func linkDropCommitsWhatIsStagedWithoutAck() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...7), now: 1) == [])
        #expect(s.disconnected(now: 1.125) == [batch(0, 1...7, ack: false)])
        #expect(s.commitFinished(cursor: 7, now: 1.2) == [])
        #expect(s.isClosed)
        #expect(s.bytesReceived(dataBytes(8...9), now: 1.3) == [])
        #expect(s.timerFired(now: 10) == [])
    }

    @Test func linkDropDuringACommitSuppressesItsAckAndFlushesTheRest() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...25), now: 1) == [batch(0, 1...20)])
        #expect(s.disconnected(now: 1.125) == [])
        #expect(s.commitFinished(cursor: 20, now: 1.2) == [batch(20, 21...25, ack: false)])
        #expect(s.commitFinished(cursor: 25, now: 1.3) == [])
        #expect(s.isClosed)
    }

    /// Regression: a link drop while a drain-end commit was in flight used to resume the gap resolution on
    /// the dead link (readStreamInfo) and leave the closed phase.
    @Test func linkDropBeforeAPendingGapResolutionEndsTheSession() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...20), now: 1) == [batch(0, 1...20)])
        #expect(s.bytesReceived(dataBytes(23...25), now: 1) == [])  // gap: drain
        #expect(s.timerFired(now: 1.25) == [])  // idle while the commit is in flight: resolve after it
        #expect(s.disconnected(now: 1.375) == [])
        #expect(s.commitFinished(cursor: 20, now: 1.5) == [])
        #expect(s.isClosed)
        #expect(s.nextDeadline == nil)
    }

    /// Transit loss with STREAM_INFO: drain until idle, commit WITHOUT ack, re-read STREAM_INFO, re-request;
    /// the replay starts at cursor + 1, so no GAP is recorded.
    @Test func gapFromTransitLossIsReRequestedNotRecorded() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...5) + dataBytes(8...20), now: 1) == [])
        #expect(s.statistics.gapsDetected == 1)
        #expect(s.statistics.droppedWhileDraining == 12)
        // Frames of the old window still arriving extend the drain.
        #expect(s.bytesReceived(dataBytes(21...21), now: 1.125) == [])
        #expect(s.nextDeadline == 1.375)
        #expect(s.timerFired(now: 1.375) == [batch(0, 1...5, ack: false)])
        // No SYNC_ACK here: it would open the old window ahead of our re-request.
        #expect(s.commitFinished(cursor: 5, now: 1.5) == [.readStreamInfo])
        #expect(s.streamInfoRead(info(oldest: 1, head: 50), now: 1.5) == [.sendSyncRequest(lastCommitted: 5, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(6...25), now: 1.75) == [batch(5, 6...25)])
        #expect(s.commitFinished(cursor: 25, now: 1.75) == [.sendSyncAck(25)])
        #expect(s.statistics.gapsRecorded == 0)
    }

    /// Without STREAM_INFO: re-request, and the first DATA after it decides.
    /// Without STREAM_INFO a GAP is recorded only when three re-requested replays in a row skip past the
    /// cursor: one lost first notification must not declare events lost (docs/PROTOCOL.md, decisions).
    @Test func replaySkippingThreeTimesRecordsTheGapInTheSameCommit() {
        var (s, start) = startedSession(cursor: 0, streamInfo: nil)
        #expect(start == [.subscribe, .sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(1...3) + dataBytes(6...8), now: 1) == [])
        #expect(s.timerFired(now: 1.25) == [batch(0, 1...3, ack: false)])
        #expect(s.commitFinished(cursor: 3, now: 1.25) == [.sendSyncRequest(lastCommitted: 3, window: Frame.defaultWindow)])
        // The first two skipped replays only drain and ask again.
        #expect(s.bytesReceived(dataBytes(6...8), now: 1.5) == [])
        #expect(s.timerFired(now: 1.75) == [.sendSyncRequest(lastCommitted: 3, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(6...8), now: 2) == [])
        #expect(s.timerFired(now: 2.25) == [.sendSyncRequest(lastCommitted: 3, window: Frame.defaultWindow)])
        #expect(s.statistics.gapsRecorded == 0)
        // The third one is proof: the GAP goes into the same commit as the frames after it.
        #expect(s.bytesReceived(dataBytes(6...25), now: 2.5) == [batch(3, 6...25, gap: 4...5)])
        #expect(s.commitFinished(cursor: 25, now: 2.5) == [.sendSyncAck(25)])
        #expect(s.statistics.gapsRecorded == 1)
    }

    @Test func replayStartingAtCursorPlusOneMeansTheLossWasInTransit() {
        var (s, _) = startedSession(cursor: 0, streamInfo: nil)
        _ = s.bytesReceived(dataBytes(1...3) + dataBytes(6...8), now: 1)
        _ = s.timerFired(now: 1.25)
        #expect(s.commitFinished(cursor: 3, now: 1.25) == [.sendSyncRequest(lastCommitted: 3, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(4...23), now: 1.5) == [batch(3, 4...23)])
        #expect(s.statistics.gapsRecorded == 0)
    }

    /// STREAM_INFO says the peripheral's oldest event is past cursor + 1: record that GAP first (no ACK yet),
    /// then SYNC_REQ from the new cursor, THEN the ACK (so a window counted from the last ACK opens).
    @Test func streamInfoOldestBeyondCursorAtStart() {
        var (s, start) = startedSession(cursor: 10, streamInfo: info(oldest: 31, head: 40))
        #expect(start == [.subscribe, batch(10, nil, gap: 11...30, ack: false)])
        #expect(s.commitFinished(cursor: 30, now: 0.5) == [.sendSyncRequest(lastCommitted: 30, window: Frame.defaultWindow), .sendSyncAck(30)])
        #expect(s.bytesReceived(dataBytes(31...40), now: 1) == [batch(30, 31...40)])
        #expect(s.commitFinished(cursor: 40, now: 1) == [.sendSyncAck(40), .caughtUp(cursor: 40), .disconnect(.caughtUp)])
    }

    @Test func streamInfoOldestBeyondCursorAfterAGap() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...5) + dataBytes(12...20), now: 1) == [])
        #expect(s.timerFired(now: 1.25) == [batch(0, 1...5, ack: false)])
        #expect(s.commitFinished(cursor: 5, now: 1.25) == [.readStreamInfo])
        #expect(s.streamInfoRead(info(oldest: 12, head: 50), now: 1.25) == [batch(5, nil, gap: 6...11, ack: false)])
        #expect(s.commitFinished(cursor: 11, now: 1.5) == [.sendSyncRequest(lastCommitted: 11, window: Frame.defaultWindow), .sendSyncAck(11)])
        #expect(s.bytesReceived(dataBytes(12...31), now: 2) == [batch(11, 12...31)])
    }

    /// oldest == 0 with head > cursor: the peripheral holds nothing, everything up to head is lost.
    @Test func nothingRetainedMeansEverythingUpToHeadIsAGap() {
        var (s, start) = startedSession(cursor: 3, streamInfo: info(oldest: 0, head: 9))
        #expect(start == [.subscribe, batch(3, nil, gap: 4...9, ack: false)])
        #expect(s.commitFinished(cursor: 9, now: 0.5) == [.sendSyncAck(9), .caughtUp(cursor: 9), .disconnect(.caughtUp)])
    }

    @Test func newEpochLoadsThatStreamsCursor() {
        var s = SyncSession()
        _ = s.connected(hasStreamInfo: true, now: 0)
        #expect(s.streamInfoRead(info(epoch: 0xDEAD_BEEF, oldest: 1, head: 5), now: 0) == [.loadCursor(epoch: 0xDEAD_BEEF)])
        #expect(s.epoch == 0xDEAD_BEEF)
        #expect(s.cursorLoaded(0, now: 0) == [.subscribe, .sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
    }

    @Test func epochChangeMidSessionEndsTheSession() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(epoch: 7, oldest: 1, head: 50))
        _ = s.bytesReceived(dataBytes(1...2) + dataBytes(9...9), now: 1)
        #expect(s.timerFired(now: 1.25) == [batch(0, 1...2, ack: false)])
        #expect(s.commitFinished(cursor: 2, now: 1.25) == [.readStreamInfo])
        #expect(s.streamInfoRead(info(epoch: 8, oldest: 1, head: 3), now: 1.25) == [.disconnect(.epochChanged)])
        #expect(s.isClosed)
    }

    /// head < cursor on the same epoch: record a REGRESSION; after the owner rebases (cursorLoaded(0)) the
    /// peripheral's new events are staged, not dropped as "duplicates".
    @Test func regressionAtStartIsRecordedThenRebased() {
        var (s, start) = startedSession(cursor: 900, streamInfo: info(oldest: 1, head: 12))
        #expect(start == [.recordRegression(epoch: 7, cursor: 900, head: 12)])
        #expect(s.statistics.regressions == 1)
        #expect(s.cursorLoaded(0, now: 0.5) == [.subscribe, .sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(1...12), now: 1) == [batch(0, 1...12)])
        #expect(s.statistics.duplicates == 0)
    }

    @Test func regressionSeenWhenReReadingStreamInfoAfterAGap() {
        var (s, _) = startedSession(cursor: 100, streamInfo: info(oldest: 1, head: 150))
        _ = s.bytesReceived(dataBytes(101...102) + dataBytes(140...140), now: 1)
        #expect(s.timerFired(now: 1.25) == [batch(100, 101...102, ack: false)])
        #expect(s.commitFinished(cursor: 102, now: 1.25) == [.readStreamInfo])
        #expect(s.streamInfoRead(info(oldest: 1, head: 5), now: 1.25) == [.recordRegression(epoch: 7, cursor: 102, head: 5)])
        #expect(s.cursorLoaded(0, now: 1.5).contains(.sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)))
    }

    @Test func responseTimeoutRetriesThreeTimesThenDisconnects() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.nextDeadline == 2)
        #expect(s.timerFired(now: 1.75) == [])
        #expect(s.timerFired(now: 2) == [.sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
        #expect(s.timerFired(now: 4) == [.sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
        #expect(s.timerFired(now: 6) == [.disconnect(.noResponse)])
        #expect(s.statistics.syncRequests == 3)
    }

    @Test func dataResetsTheRetryCount() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.timerFired(now: 2) == [.sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
        #expect(s.timerFired(now: 4) == [.sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(1...20), now: 5) == [batch(0, 1...20)])
        #expect(s.commitFinished(cursor: 20, now: 5) == [.sendSyncAck(20)])
        #expect(s.timerFired(now: 7) == [.sendSyncRequest(lastCommitted: 20, window: Frame.defaultWindow)])
        #expect(s.timerFired(now: 9) == [.sendSyncRequest(lastCommitted: 20, window: Frame.defaultWindow)])
        #expect(s.timerFired(now: 11) == [.sendSyncRequest(lastCommitted: 20, window: Frame.defaultWindow)])
        #expect(s.timerFired(now: 13) == [.disconnect(.noResponse)])
    }

    @Test func caughtUpAtStartWithStreamInfo() {
        let (s, start) = startedSession(cursor: 50, streamInfo: info(oldest: 30, head: 50))
        #expect(start == [.subscribe, .sendSyncAck(50), .sendSyncRequest(lastCommitted: 50, window: Frame.defaultWindow),
                          .caughtUp(cursor: 50), .disconnect(.caughtUp)])
        #expect(s.isCaughtUp && s.isClosed)
    }

    /// Without STREAM_INFO, silence after the last ACK means caught up.
    @Test func caughtUpWithoutStreamInfoAfterSilence() {
        var (s, _) = startedSession(cursor: 0, streamInfo: nil)
        _ = s.bytesReceived(dataBytes(1...5), now: 1)
        #expect(s.timerFired(now: 1.25) == [batch(0, 1...5)])
        #expect(s.commitFinished(cursor: 5, now: 1.25) == [.sendSyncAck(5)])
        #expect(s.nextDeadline == 3.25)
        #expect(s.timerFired(now: 3.25) == [.caughtUp(cursor: 5), .disconnect(.caughtUp)])
    }

    /// Regression: nothing new and no STREAM_INFO used to end without any SYNC_ACK (PROTOCOL §4 step 7). The
    /// cursor is acknowledged at the start (frames of a dropped link were committed without ACK).
    @Test func caughtUpWithoutStreamInfoAndNothingNewStillAcknowledges() {
        var (s, start) = startedSession(cursor: 10, streamInfo: nil)
        #expect(start == [.subscribe, .sendSyncAck(10), .sendSyncRequest(lastCommitted: 10, window: Frame.defaultWindow)])
        #expect(s.timerFired(now: 2) == [.caughtUp(cursor: 10), .disconnect(.caughtUp)])
        var (fresh, freshStart) = startedSession(cursor: 0, streamInfo: nil)
        #expect(freshStart == [.subscribe, .sendSyncRequest(lastCommitted: 0, window: Frame.defaultWindow)])
        #expect(fresh.timerFired(now: 2) == [.sendSyncAck(0), .caughtUp(cursor: 0), .disconnect(.caughtUp)])
    }

    @Test func stayConnectedTakesLiveEvents() {
        var config = SyncSession.Configuration()
        config.stayConnected = true
        var (s, start) = startedSession(cursor: 5, streamInfo: info(oldest: 1, head: 5), configuration: config)
        #expect(start == [.subscribe, .sendSyncAck(5), .sendSyncRequest(lastCommitted: 5, window: Frame.defaultWindow), .caughtUp(cursor: 5)])
        #expect(!s.isClosed)
        #expect(s.bytesReceived(dataBytes(6...6), now: 10) == [])
        #expect(s.timerFired(now: 10.25) == [batch(5, 6...6)])
        #expect(s.commitFinished(cursor: 6, now: 10.25) == [.sendSyncAck(6)])
        #expect(s.nextDeadline == nil)  // live mode: silence is normal, no timer
    }

    @Test func stopCommitsAndAcknowledgesThenDisconnects() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        _ = s.bytesReceived(dataBytes(1...7), now: 1)
        #expect(s.stop(now: 1.125) == [batch(0, 1...7)])
        #expect(s.bytesReceived(dataBytes(8...9), now: 1.125) == [])
        #expect(s.commitFinished(cursor: 7, now: 1.2) == [.sendSyncAck(7), .disconnect(.shutdown)])
        #expect(s.isClosed)
    }

    @Test func stopWithACommitInFlightFlushesTheRestFirst() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...23), now: 1) == [batch(0, 1...20)])
        #expect(s.stop(now: 1.125) == [])
        #expect(s.commitFinished(cursor: 20, now: 1.2) == [.sendSyncAck(20), batch(20, 21...23)])
        #expect(s.commitFinished(cursor: 23, now: 1.3) == [.sendSyncAck(23), .disconnect(.shutdown)])
        var (idle, _) = startedSession(cursor: 0, streamInfo: nil)
        #expect(idle.stop(now: 1) == [.disconnect(.shutdown)])
    }

    /// Stall: a flipped length bit holds back the frames behind it; idle resolves it, the frames behind are
    /// recovered, the damaged one is re-requested (it was a transit loss: no GAP).
    @Test func stallIsResolvedByIdle() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        var damaged = frames(2...2)[0].encoded()
        damaged[10] ^= 0x01  // payload length + 256
        #expect(s.bytesReceived(dataBytes(1...1) + damaged + dataBytes(3...5), now: 1) == [])
        #expect(s.decoder.bufferedByteCount > 0)
        #expect(s.nextDeadline == 1.25)
        // Idle: the stall resolves, 3...5 surface behind a gap at 2: drain (idle again), commit 1, re-read.
        #expect(s.timerFired(now: 1.25) == [batch(0, 1...1, ack: false)])
        #expect(s.decoder.statistics.stalls == 1)
        #expect(s.commitFinished(cursor: 1, now: 1.25) == [.readStreamInfo])
        #expect(s.streamInfoRead(info(oldest: 1, head: 50), now: 1.25) == [.sendSyncRequest(lastCommitted: 1, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(2...21), now: 1.5) == [batch(1, 2...21)])
    }

    /// A frame split across two notifications, with a commit in between that takes longer than the idle
    /// timeout (an SD card's fsync, another connection's checkpoint): the gateway was busy, not the link, so
    /// the half frame waits for its rest instead of being dropped as a stall (which cost a re-request).
    @Test func aSlowCommitIsNotTakenForAnIdleLink() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        let bytes = dataBytes(1...22)
        let cut = dataBytes(1...20).count + 7  // frame 21 split after 7 bytes
        #expect(s.bytesReceived(Array(bytes[..<cut]), now: 1) == [batch(0, 1...20)])
        #expect(s.commitFinished(cursor: 20, now: 1.4) == [.sendSyncAck(20)])
        if let deadline = s.nextDeadline, deadline <= 1.41 { _ = s.timerFired(now: 1.41) }
        #expect(s.decoder.statistics.stalls == 0)
        #expect(s.bytesReceived(Array(bytes[cut...]), now: 1.45) == [])
        #expect(s.decoder.statistics.corruptRuns == 0)
        #expect(s.timerFired(now: 1.7) == [batch(20, 21...22)])
    }

    /// A session that got frames 1...10 and the first 9 bytes of frame 11, went idle (1...10 committed and
    /// acknowledged, the half frame kept) and has nothing due before the response timeout. Returns the rest of
    /// frame 11 followed by frame 12.
    private func sessionHoldingAHalfFrame() -> (SyncSession, rest: [UInt8]) {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        let bytes = dataBytes(1...12)
        let cut = dataBytes(1...10).count + 9  // frame 11 split after 9 bytes
        #expect(s.bytesReceived(Array(bytes[..<cut]), now: 1) == [])
        #expect(s.nextDeadline == 1.25)
        #expect(s.timerFired(now: 1.25) == [batch(0, 1...10)])
        #expect(s.decoder.bufferedByteCount == 9, "the half frame is kept")
        #expect(s.commitFinished(cursor: 10, now: 1.25) == [.sendSyncAck(10)])
        // Nothing to do before the response timeout (counted from the commit's end): no past deadline for an
        // owner to spin on.
        #expect(s.nextDeadline == 3.25)
        return (s, Array(bytes[cut...]))
    }

    /// A link that pauses mid-frame (a frame split across two notifications, the second one late): at idle the
    /// complete frames are committed and acknowledged, the half frame waits for its rest, and when it comes the
    /// frame is staged as if nothing happened: no corrupt run, no re-request.
    @Test func aHalfFrameWaitsOutASlowLink() {
        var (s, rest) = sessionHoldingAHalfFrame()
        #expect(s.timerFired(now: 2) == [])
        #expect(s.bytesReceived(rest, now: 2.5) == [])
        #expect(s.decoder.statistics.corruptRuns == 0 && s.decoder.statistics.stalls == 0)
        #expect(s.timerFired(now: 2.75) == [batch(10, 11...12)])
    }

    /// The rest of a kept half frame never comes (its notification was lost) and the link stays quiet: once DATA
    /// has been silent for the response timeout the half frame is a corrupt run, and the session goes on.
    @Test func aHalfFrameWhoseRestNeverComesIsDroppedAtTheResponseTimeout() {
        var (s, _) = sessionHoldingAHalfFrame()
        // Silent for the response timeout: the half frame is dropped, and the peripheral is asked again.
        #expect(s.timerFired(now: 3.25) == [.sendSyncRequest(lastCommitted: 10, window: Frame.defaultWindow)])
        #expect(s.decoder.bufferedByteCount == 0)
        #expect(s.decoder.statistics.stalls == 1 && s.decoder.statistics.corruptRuns == 1)
    }

    /// Bytes after a half frame whose rest was really lost (the peripheral sent on): at the next idle the frames
    /// behind it are found (one corrupt run) and reach the session as a gap to resolve, as before.
    @Test func aKeptHalfFrameFollowedByOtherFramesIsOneCorruptRun() {
        var (s, _) = sessionHoldingAHalfFrame()
        _ = s.bytesReceived(dataBytes(13...20), now: 1.5)
        #expect(s.nextDeadline == 1.75, "frames wait behind the half frame: idle resolves it as a stall")
        _ = s.timerFired(now: 1.75)
        #expect(s.decoder.statistics.corruptRuns == 1 && s.decoder.statistics.stalls == 1)
        #expect(s.statistics.dataFrames == 18, "frames 13...20 surface behind the damaged one")
        #expect(s.decoder.bufferedByteCount == 0)
    }

    /// Regression: idle used to be measured from the last whole frame, so a big frame arriving in small
    /// notifications over more than idleTimeout was "stall-resolved" in the middle. Owner fires every deadline.
    @Test func slowLargeFrameIsNotTakenForAStall() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...1), now: 1) == [])
        let big = Frame.data(seq: 2, payload: [UInt8](repeating: 0x42, count: 4000)).encoded()
        var now = 1.0
        var staged: [SyncAction] = []
        var rng = SeededRNG(seed: 12345)
        for (i, piece) in randomChunks(big, maxChunk: 20, using: &rng).enumerated() {
            now = 1.0 + Double(i + 1) * 0.0078125  // one 20-byte notification per 7.8 ms: ~1.6 s for the frame
            if let deadline = s.nextDeadline, deadline <= now { staged += s.timerFired(now: deadline) }
            staged += s.bytesReceived(piece, now: now)
        }
        #expect(s.decoder.statistics.stalls == 0)
        #expect(s.decoder.statistics.discardedBytes == 0)
        #expect(s.timerFired(now: now + 0.25) == [.commit(CommitBatch(
            expectedCursor: 0, gap: nil, frames: frames(1...1) + [.data(seq: 2, payload: [UInt8](repeating: 0x42, count: 4000))],
            newCursor: 2, acknowledge: true))])
        #expect(staged.isEmpty)
    }

    /// Regression: nextDeadline used to stay in the past while a commit was in flight (owner spins).
    @Test func nextDeadlineIsNeverAPastDeadlineThatDoesNothing() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...25), now: 1) == [batch(0, 1...20)])
        // Staged 21...25 wait for the commit; the idle deadline must not fire while it is in flight. Only the
        // no-progress bound (30 s after the cursor was loaded) stands.
        #expect(s.nextDeadline == 30)
        #expect(s.commitFinished(cursor: 20, now: 1.5) == [.sendSyncAck(20)])
        // Idle counts from the commit's end (the gateway was busy until then): due at 1.75, and actionable.
        #expect(s.nextDeadline == 1.75)
        #expect(s.timerFired(now: 1.75) == [batch(20, 21...25)])
        #expect(s.nextDeadline == 31.5)  // the commit of 1...20 at 1.5 was progress
    }

    // MARK: liveness bounds (issue 12)

    /// The field fault: a peripheral that stops sending new frames with the link up and answers each SYNC_REQ
    /// with one stale duplicate. Duplicates used to reset the response timer and the attempt count, so the
    /// session never ended (303 s through real bluetoothd until the daemon was stopped).
    @Test func staleDuplicateAnswersDoNotKeepTheSessionAlive() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...20), now: 1) == [batch(0, 1...20)])
        #expect(s.commitFinished(cursor: 20, now: 1) == [.sendSyncAck(20)])
        // Nothing new: the response timeout re-sends SYNC_REQ; each is answered by one old frame.
        #expect(s.timerFired(now: 3) == [.sendSyncRequest(lastCommitted: 20, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(20...20), now: 3.1) == [])
        #expect(s.nextDeadline == 5)
        #expect(s.timerFired(now: 5) == [.sendSyncRequest(lastCommitted: 20, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(19...19), now: 5.1) == [])
        #expect(s.timerFired(now: 7) == [.sendSyncRequest(lastCommitted: 20, window: Frame.defaultWindow)])
        #expect(s.bytesReceived(dataBytes(20...20), now: 7.1) == [])
        #expect(s.timerFired(now: 9) == [.disconnect(.noResponse)])
        #expect(s.isClosed && s.statistics.duplicates == 3)
    }

    /// A failed SYNC_REQ write plus one stale duplicate used to leave the session with no deadline at all.
    @Test func aStaleDuplicateNeverClearsTheDeadline() {
        var (s, _) = startedSession(cursor: 10, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(10...10), now: 0.5) == [])
        #expect(s.nextDeadline == 2)
    }

    /// Whatever keeps arriving, a session that commits nothing new ends at the no-progress bound: here a
    /// stream of frames far beyond the cursor keeps the drain from ever going idle (so no gap resolution, no
    /// response timer). It ends with what is committed acknowledged.
    @Test func noProgressEndsTheSessionWhateverArrives() {
        var config = SyncSession.Configuration()
        config.noProgressTimeout = 30
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 500), configuration: config)
        #expect(s.bytesReceived(dataBytes(1...20), now: 1) == [batch(0, 1...20)])
        #expect(s.commitFinished(cursor: 20, now: 1) == [.sendSyncAck(20)])
        #expect(s.nextDeadline == 3)  // response timer; the no-progress bound is at 31
        var now = 1.0
        var actions: [SyncAction] = []
        while !s.isClosed && now < 100 {
            now += 0.125
            if let deadline = s.nextDeadline, deadline <= now { actions += s.timerFired(now: deadline) }
            if s.isClosed { break }
            actions += s.bytesReceived(dataBytes(400...400), now: now)
        }
        #expect(actions == [.disconnect(.noProgress)])
        #expect(now >= 31 && now <= 31.125, "ended at \(now)")
        #expect(s.statistics.droppedWhileDraining > 200)
    }

    /// Frames staged when the bound hits are committed and acknowledged before the disconnect.
    @Test func noProgressEndCommitsAndAcknowledgesWhatIsStaged() {
        var config = SyncSession.Configuration()
        config.noProgressTimeout = 10
        config.maxSessionDuration = 100
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 500), configuration: config)
        #expect(s.nextDeadline == 2)
        _ = s.timerFired(now: 2)
        _ = s.bytesReceived(dataBytes(1...3), now: 2.1)
        // The idle commit would come at 2.35; fire the bound instead (an owner late by 8 s).
        #expect(s.timerFired(now: 10) == [batch(0, 1...3)])
        #expect(s.commitFinished(cursor: 3, now: 10) == [.sendSyncAck(3), .disconnect(.noProgress)])
    }

    @Test func progressMovesTheNoProgressBound() {
        var config = SyncSession.Configuration()
        config.noProgressTimeout = 10
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 500), configuration: config)
        for i in 0..<20 {
            let t = Double(i) * 5 + 1
            let first = UInt64(i * 20 + 1)
            #expect(s.bytesReceived(dataBytes(first...(first + 19)), now: t) == [batch(first - 1, first...(first + 19))])
            #expect(s.commitFinished(cursor: first + 19, now: t) == [.sendSyncAck(first + 19)])
            #expect(!s.isClosed)
        }
        #expect(s.nextDeadline == 98)  // response timer after the last ACK at 96
    }

    @Test func maxSessionDurationEndsASyncAndReleaseSession() {
        var config = SyncSession.Configuration()
        config.maxSessionDuration = 60
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 100_000), configuration: config)
        var seq: UInt64 = 0
        var now = 0.0
        var ended: [SyncAction] = []
        while !s.isClosed && now < 200 {
            now += 1
            if let deadline = s.nextDeadline, deadline <= now {
                ended = s.timerFired(now: deadline)
                break
            }
            #expect(s.bytesReceived(dataBytes((seq + 1)...(seq + 20)), now: now) == [batch(seq, (seq + 1)...(seq + 20))])
            #expect(s.commitFinished(cursor: seq + 20, now: now) == [.sendSyncAck(seq + 20)])
            seq += 20
        }
        // Nothing staged, everything committed was acknowledged: just the disconnect, at 60 s.
        #expect(ended == [.disconnect(.maxDurationReached)])
        #expect(now == 60 && seq == 59 * 20)
        // Not for stay-connected sessions: holding the link is their purpose.
        config.stayConnected = true
        var (live, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 100_000), configuration: config)
        _ = live.bytesReceived(dataBytes(1...20), now: 1)
        _ = live.commitFinished(cursor: 20, now: 1)
        #expect(live.nextDeadline == 3)
        _ = live.bytesReceived(dataBytes(21...40), now: 59)
        _ = live.commitFinished(cursor: 40, now: 59)
        #expect(live.timerFired(now: 60.5) == [])
        #expect(!live.isClosed)
    }

    /// A caught-up stay-connected session has no bound (live events may never come); once something makes
    /// it expect frames again (a live frame beyond a gap), the bound runs from that moment.
    @Test func theNoProgressClockRunsOnlyWhileProgressIsExpected() {
        var config = SyncSession.Configuration()
        config.stayConnected = true
        config.noProgressTimeout = 10
        var (s, _) = startedSession(cursor: 5, streamInfo: info(oldest: 1, head: 5), configuration: config)
        #expect(s.isCaughtUp && s.nextDeadline == nil)
        // An hour later, a live frame beyond a gap: drain, then (fed noise) never idle.
        var now = 3600.0
        var actions: [SyncAction] = []
        while !s.isClosed && now < 3700 {
            if let deadline = s.nextDeadline, deadline <= now { actions += s.timerFired(now: deadline) }
            if s.isClosed { break }
            actions += s.bytesReceived(dataBytes(9...9), now: now)
            now += 0.125
        }
        #expect(actions == [.disconnect(.noProgress)])
        #expect(now >= 3610 && now <= 3610.25, "ended at \(now)")
    }

    @Test func commitFailureDisconnectsWithoutAck() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        #expect(s.bytesReceived(dataBytes(1...20), now: 1) == [batch(0, 1...20)])
        #expect(s.commitFailed(now: 1.1) == [.disconnect(.storeFailed)])
        #expect(s.isClosed)
    }

    @Test func nonDataFramesOnTheDataStreamAreIgnored() {
        var (s, _) = startedSession(cursor: 0, streamInfo: info(oldest: 1, head: 50))
        let stray = Frame.syncAck(committed: 3).encoded() + Frame.syncRequest(lastCommitted: 1).encoded()
        #expect(s.bytesReceived(stray + dataBytes(1...1), now: 1) == [])
        #expect(s.statistics.unexpectedFrames == 2)
        #expect(s.timerFired(now: 1.25) == [batch(0, 1...1)])
    }

    @Test func unreadableStreamInfoEndsTheSession() {
        var s = SyncSession()
        _ = s.connected(hasStreamInfo: true, now: 0)
        #expect(s.streamInfoRead([1, 0, 0], now: 0) == [.disconnect(.streamInfoUnreadable(StreamInfo.ParseError.tooShort(3).description))])
        var t = SyncSession()
        _ = t.connected(hasStreamInfo: true, now: 0)
        #expect(t.streamInfoFailed("ATT error 0x0e", now: 0) == [.disconnect(.streamInfoUnreadable("ATT error 0x0e"))])
    }
}
