import FerryProtocol
import FerryStore

/// Feeds a captured DATA byte stream (a dump pulled from a device, noise and all) through the same decoder
/// and sequencing rules as a live session, committing in windows. There is no peripheral to re-ask, so a
/// gap is recorded as soon as it is seen (a GAP outbox event) and the frame after it is accepted.
public struct DumpIngestReport: Sendable, Equatable {
    /// Valid DATA frames decoded.
    public var frames = 0
    /// Frames newly committed.
    public var stored = 0
    /// Frames at or below the cursor (already stored, or repeated within the dump).
    public var duplicates = 0
    public var gaps = 0
    /// Damaged places in the stream (runs of discarded bytes between valid frames).
    public var corrupt = 0
    /// Valid frames of another type (SYNC_REQ/SYNC_ACK) or of an unknown type: skipped.
    public var skipped = 0
    /// Bytes of an incomplete frame at the end of the dump: reported, not stored.
    public var trailingPartialBytes = 0
    public var cursor: UInt64 = 0
    public var epoch: UInt64 = 0
}

public final class DumpIngestor {
    public private(set) var report = DumpIngestReport()
    private var decoder: FrameDecoder
    private let store: GatewayStore
    private var stream: StreamHandle
    private let windowSize: Int
    private var staged: [Frame] = []
    private var stagedGap: ClosedRange<UInt64>?
    private var stagedCursor: UInt64

    public init(
        store: GatewayStore, peripheral: PeripheralAddress, epoch: UInt64, windowSize: Int = 20,
        maxPayloadLength: Int = FrameDecoder.defaultMaxPayloadLength
    ) throws {
        self.store = store
        self.windowSize = windowSize
        decoder = FrameDecoder(maxPayloadLength: maxPayloadLength)
        stream = try store.openStream(peripheral: peripheral, deviceEpoch: epoch)
        stagedCursor = stream.cursor
        report.cursor = stream.cursor
        report.epoch = stream.key.epoch
    }

    public func feed(_ bytes: UnsafeRawBufferPointer) throws {
        var frames: [Frame] = []
        decoder.feed(bytes) { frames.append($0) }
        try accept(frames)
    }

    /// End of the dump: a trailing partial frame is dropped byte by byte (frames inside it are recovered, as
    /// after a stall) and reported; everything staged is committed.
    public func finish() throws -> DumpIngestReport {
        var frames: [Frame] = []
        report.trailingPartialBytes = decoder.resolveStall { frames.append($0) }
        try accept(frames)
        try commitStaged()
        let stats = decoder.statistics
        report.corrupt = stats.corruptRuns
        report.skipped += stats.unknownTypes
        return report
    }

    private func accept(_ frames: [Frame]) throws {
        for frame in frames {
            guard frame.type == .data else {
                report.skipped += 1
                continue
            }
            report.frames += 1
            switch SequenceVerdict.classify(seq: frame.seq, cursor: stagedCursor) {
            case .duplicate:
                report.duplicates += 1
            case .next:
                try stage(frame)
            case .gap(let first, let last):
                // A batch carries at most one gap, in front of its frames.
                if !staged.isEmpty || stagedGap != nil { try commitStaged() }
                stagedGap = first...last
                report.gaps += 1
                try stage(frame)
            }
        }
        report.corrupt = decoder.statistics.corruptRuns
    }

    private func stage(_ frame: Frame) throws {
        staged.append(frame)
        stagedCursor = frame.seq
        if staged.count >= windowSize { try commitStaged() }
    }

    private func commitStaged() throws {
        guard !staged.isEmpty || stagedGap != nil else { return }
        let batch = CommitBatch(
            expectedCursor: stream.cursor, gap: stagedGap, frames: staged,
            newCursor: staged.last?.seq ?? stagedGap!.upperBound, acknowledge: false)
        let outcome = try store.commit(batch, to: stream.key)
        stream.cursor = outcome.cursor
        report.stored += outcome.framesInserted
        report.duplicates += outcome.framesAlreadyStored
        report.cursor = outcome.cursor
        staged.removeAll(keepingCapacity: true)
        stagedGap = nil
    }
}
