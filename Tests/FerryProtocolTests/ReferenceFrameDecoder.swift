@testable import FerryProtocol

/// The decoder as it was before issue 12 made its worst case linear: the plain algorithm (CRC over every
/// candidate's span, `removeFirst` per dropped byte), kept verbatim as the oracle the fast decoder must equal
/// frame for frame and statistic for statistic.
///
/// Streaming decoder for the DATA byte stream (PROTOCOL §2).
///
/// Bytes arrive in arbitrary chunks: a frame may span notifications and a notification may carry several
/// frames. Like swift-nio's `SingleStepByteToMessageDecoder`, a frame is only consumed once it is whole;
/// until then the bytes wait in `buffer`, which between calls never holds more than one (partial) frame:
/// at most `Frame.overhead + maxPayloadLength - 1` bytes.
///
/// Resync: on a bad magic, a CRC mismatch or a length above the cap, exactly ONE byte is dropped and the
/// scan restarts at the next 0xA5 — a valid frame may begin inside what looked like garbage.
struct ReferenceFrameDecoder {
    typealias Statistics = FrameDecoder.Statistics
    public let maxPayloadLength: Int
    public private(set) var statistics = Statistics()
    private var buffer: [UInt8] = []
    /// True while the bytes being discarded continue the same damaged region (counted once in `corruptRuns`).
    private var inCorruptRun = false

    public init(maxPayloadLength: Int = FrameDecoder.defaultMaxPayloadLength) {
        precondition(maxPayloadLength >= 0 && maxPayloadLength <= Int(UInt16.max), "payload cap out of range")
        self.maxPayloadLength = maxPayloadLength
    }

    /// Bytes of an incomplete frame (or of a prefix still to be judged) held until more arrive.
    public var bufferedByteCount: Int { buffer.count }

    /// Feeds a chunk; `emit` receives every complete, valid frame of a known type, in stream order.
    public mutating func feed(_ bytes: UnsafeRawBufferPointer, emit: (Frame) throws -> Void) rethrows {
        if buffer.isEmpty {
            // Fast path: parse straight from the caller's bytes, keep only the unfinished tail.
            let consumed = try scan(bytes, emit: emit)
            if consumed < bytes.count {
                buffer.append(contentsOf: UnsafeRawBufferPointer(rebasing: bytes[consumed...]))
            }
        } else {
            buffer.append(contentsOf: bytes)
            try rescanBuffer(emit: emit)
        }
    }

    public mutating func feed(_ bytes: [UInt8], emit: (Frame) throws -> Void) rethrows {
        try bytes.withUnsafeBytes { try feed($0, emit: emit) }
    }

    /// The stream went idle with a partial frame buffered: its length field may be the flipped bit, so the
    /// frame will never complete. Treat it as corrupt: drop one byte and rescan what is buffered, repeating
    /// until nothing partial is left. Frames found on the way are emitted. Returns the bytes dropped.
    @discardableResult
    public mutating func resolveStall(emit: (Frame) throws -> Void) rethrows -> Int {
        guard !buffer.isEmpty else { return 0 }
        statistics.stalls += 1
        let before = statistics.discardedBytes
        while !buffer.isEmpty {
            buffer.removeFirst()
            discard(1)
            try rescanBuffer(emit: emit)
        }
        return statistics.discardedBytes - before
    }

    private mutating func rescanBuffer(emit: (Frame) throws -> Void) rethrows {
        // Move the buffer out so the scan can mutate statistics without overlapping access to `self`.
        let pending = buffer
        buffer = []
        let consumed = try pending.withUnsafeBytes { try scan($0, emit: emit) }
        if consumed < pending.count {
            buffer = Array(pending[consumed...])
        }
    }

    /// Scans `p` from its start; returns how many bytes were consumed (emitted, skipped or discarded).
    /// Stops at the first position where a frame might start but is not complete yet.
    private mutating func scan(_ p: UnsafeRawBufferPointer, emit: (Frame) throws -> Void) rethrows -> Int {
        let n = p.count
        var i = 0
        try CRC16.table.withUnsafeBufferPointer { table in
            while i < n {
                if p[i] != Frame.magic {
                    var j = i + 1
                    while j < n && p[j] != Frame.magic { j += 1 }
                    discard(j - i)
                    i = j
                    continue
                }
                if n - i < Frame.headerLength { break }
                let length = Int(readBigEndian(UInt16.self, p, at: i + 10))
                if length > maxPayloadLength {
                    statistics.oversizeLengths += 1
                    discard(1)
                    i += 1
                    continue
                }
                let total = Frame.overhead + length
                if n - i < total { break }
                let covered = UnsafeRawBufferPointer(rebasing: p[i..<(i + Frame.headerLength + length)])
                let computed = CRC16.update(CRC16.initial, covered, table: table)
                let stored = readBigEndian(UInt16.self, p, at: i + Frame.headerLength + length)
                if computed != stored {
                    statistics.crcMismatches += 1
                    discard(1)
                    i += 1
                    continue
                }
                inCorruptRun = false
                if let type = FrameType(rawValue: p[i + 1]) {
                    let seq = readBigEndian(UInt64.self, p, at: i + 2)
                    let payloadStart = i + Frame.headerLength
                    let payload = [UInt8](UnsafeRawBufferPointer(rebasing: p[payloadStart..<(payloadStart + length)]))
                    statistics.frames += 1
                    i += total
                    try emit(Frame(type: type, seq: seq, payload: payload))
                } else {
                    statistics.unknownTypes += 1
                    i += total
                }
            }
        }
        return i
    }

    private mutating func discard(_ count: Int) {
        guard count > 0 else { return }
        statistics.discardedBytes += count
        if !inCorruptRun {
            inCorruptRun = true
            statistics.corruptRuns += 1
        }
    }
}
