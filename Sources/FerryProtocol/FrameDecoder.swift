/// Streaming decoder for the DATA byte stream (PROTOCOL §2).
///
/// Bytes arrive in arbitrary chunks: a frame may span notifications and a notification may carry several
/// frames. Like swift-nio's `SingleStepByteToMessageDecoder`, a frame is only consumed once it is whole;
/// until then the bytes wait in `buffer`, which between calls never holds more than one (partial) frame:
/// at most `Frame.overhead + maxPayloadLength - 1` bytes.
///
/// Resync: on a bad magic, a CRC mismatch or a length above the cap, exactly ONE byte is dropped and the
/// scan restarts at the next 0xA5 — a valid frame may begin inside what looked like garbage.
///
/// Cost (issue 12): hostile noise can put a candidate 0xA5 claiming a 4 KB payload at every third byte. Running
/// the CRC over each candidate's span would cost ~1000 CRC steps per received byte. Instead, once a candidate
/// fails, the decoder keeps the running CRC state at every stream position ahead of it (a ring of prefix
/// states) and judges every later overlapping candidate by combining two prefix states (`CRC16.multiply`), so
/// each byte goes through the CRC at most twice (once directly, once into the ring) and each candidate costs
/// O(1). Clean streams never touch the ring. The decisions — which frames, which statistics — are exactly those
/// of the plain algorithm: the combined CRC is the same number.
public struct FrameDecoder: Sendable {
    public struct Statistics: Sendable, Equatable {
        /// Frames of a known type handed to the caller.
        public var frames = 0
        /// Whole frames with a valid CRC but a type this protocol version does not know: skipped.
        public var unknownTypes = 0
        public var crcMismatches = 0
        /// Headers announcing a payload above the configured cap (treated as noise).
        public var oversizeLengths = 0
        /// Idle periods that found a partial frame buffered (its length field may be a flipped bit).
        public var stalls = 0
        /// Every byte dropped while resynchronising.
        public var discardedBytes = 0
        /// Contiguous runs of discarded bytes between valid frames: "how many places was the stream damaged".
        public var corruptRuns = 0

        public init() {}
    }

    public static let defaultMaxPayloadLength = 4096

    public let maxPayloadLength: Int
    public private(set) var statistics = Statistics()
    /// Unconsumed bytes are `buffer[head...]`; consumed ones are dropped in bulk (`compactIfWorthIt`) so that a
    /// frame arriving in small pieces is not copied once per piece.
    private var buffer: [UInt8] = []
    private var head = 0
    /// Stream offset of the next unconsumed byte (the key of the prefix ring).
    private var position = 0
    /// True while the bytes being discarded continue the same damaged region (counted once in `corruptRuns`).
    private var inCorruptRun = false
    /// Prefix CRC states: `ring[k & mask]` is the state after stream byte k-1, for k in a window ending at
    /// `ringEnd`, relative to an arbitrary origin. Allocated on the first CRC mismatch only.
    private var ring: [UInt16] = []
    private var ringEnd = -1
    /// Bytes run through the CRC plus candidates judged: the decoder's work, which the fuzz target bounds by a
    /// constant times the bytes fed. Not part of `statistics` (those describe the stream, this the decoder).
    internal private(set) var work = 0

    public init(maxPayloadLength: Int = FrameDecoder.defaultMaxPayloadLength) {
        precondition(maxPayloadLength >= 0 && maxPayloadLength <= Int(UInt16.max), "payload cap out of range")
        self.maxPayloadLength = maxPayloadLength
    }

    /// Bytes of an incomplete frame (or of a prefix still to be judged) held until more arrive.
    public var bufferedByteCount: Int { buffer.count - head }

    /// Feeds a chunk; `emit` receives every complete, valid frame of a known type, in stream order.
    public mutating func feed(_ bytes: UnsafeRawBufferPointer, emit: (Frame) throws -> Void) rethrows {
        if bufferedByteCount == 0 {
            // Fast path: parse straight from the caller's bytes, keep only the unfinished tail.
            buffer.removeAll(keepingCapacity: true)
            head = 0
            let consumed = try scan(bytes, base: position, emit: emit)
            position += consumed
            if consumed < bytes.count {
                buffer.append(contentsOf: UnsafeRawBufferPointer(rebasing: bytes[consumed...]))
            }
        } else {
            compactIfWorthIt()
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
        guard bufferedByteCount > 0 else { return 0 }
        statistics.stalls += 1
        let before = statistics.discardedBytes
        while bufferedByteCount > 0 {
            head += 1
            position += 1
            discard(1)
            try rescanBuffer(emit: emit)
        }
        return statistics.discardedBytes - before
    }

    /// Drops consumed bytes once they are at least as many as the live ones: each byte is moved O(1) times.
    private mutating func compactIfWorthIt() {
        if head > 0 && head >= buffer.count - head {
            buffer.removeSubrange(0..<head)
            head = 0
        }
    }

    private mutating func rescanBuffer(emit: (Frame) throws -> Void) rethrows {
        // Move the buffer out so the scan can mutate statistics without overlapping access to `self`.
        let pending = buffer
        buffer = []
        defer { buffer = pending }
        let start = head
        let consumed = try pending.withUnsafeBytes {
            try scan(UnsafeRawBufferPointer(rebasing: $0[start...]), base: position, emit: emit)
        }
        head += consumed
        position += consumed
    }

    /// Scans `p` (whose first byte is stream byte `base`) from its start; returns how many bytes were consumed
    /// (emitted, skipped or discarded). Stops at the first position where a frame might start but is not
    /// complete yet.
    private mutating func scan(_ p: UnsafeRawBufferPointer, base: Int, emit: (Frame) throws -> Void) rethrows -> Int {
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
                let crcEnd = i + Frame.headerLength + length
                let stored = readBigEndian(UInt16.self, p, at: crcEnd)
                if !crcMatches(p, from: i, to: crcEnd, base: base, stored: stored, table: table) {
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

    /// Whether the CRC over `p[from..<to]` equals `stored`. A candidate that starts past every prefix state
    /// known runs the CRC directly (clean streams: once per frame); if that fails, the prefix states over its
    /// span go into the ring, and every later candidate overlapping them is judged from the ring in O(1).
    private mutating func crcMatches(
        _ p: UnsafeRawBufferPointer, from: Int, to: Int, base: Int, stored: UInt16, table: UnsafeBufferPointer<UInt16>
    ) -> Bool {
        let start = base + from
        let end = base + to
        work += 1
        if ringEnd <= start {
            work += to - from
            if CRC16.update(CRC16.initial, UnsafeRawBufferPointer(rebasing: p[from..<to]), table: table) == stored {
                return true
            }
            if ring.isEmpty {
                // Every state a later candidate can need lies within header + cap bytes of its start.
                var size = 1
                while size <= Frame.headerLength + maxPayloadLength { size <<= 1 }
                ring = [UInt16](repeating: 0, count: size)
            }
            ring[start & (ring.count - 1)] = 0  // new origin: nothing before `start` is needed again
            ringEnd = start
        }
        var ring = self.ring
        self.ring = []
        defer { self.ring = ring }
        let mask = ring.count - 1
        let startState = ring[start & mask]
        if ringEnd < end {
            var crc = ring[ringEnd & mask]
            var k = ringEnd - base
            work += to - k
            while k < to {
                crc = (crc << 8) ^ table[Int(UInt8(truncatingIfNeeded: crc >> 8) ^ p[k])]
                k += 1
                ring[(base + k) & mask] = crc
            }
            ringEnd = end
        }
        let shifted = CRC16.multiply(CRC16.initial ^ startState, CRC16.zeroBytePowers[to - from])
        return shifted ^ ring[end & mask] == stored
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
