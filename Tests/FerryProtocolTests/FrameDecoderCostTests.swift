import Testing
@testable import FerryProtocol

/// Issue 12: the decoder's worst case is linear (work counted, not timed) and its decisions are exactly those of
/// the plain algorithm (`ReferenceFrameDecoder`) on clean, noisy and hostile streams, for any chunking and stalls.
@Suite struct FrameDecoderCostTests {
    /// Hostile patterns without a valid frame: a candidate 0xA5 every 3rd/4th byte claiming a long payload.
    static let hostilePatterns: [[UInt8]] = [
        [0xA5, 0x10, 0x00], [0xA5, 0x0F, 0xA0], [0xA5, 0x03, 0x0F, 0xA0], [0xA5, 0x00, 0x10], [0xA5],
    ]

    struct Run: Equatable {
        var frames: [Frame] = []
        var statistics = FrameDecoder.Statistics()
        var buffered = 0
        var stallDrops: [Int] = []
    }

    /// Feeds both decoders the same chunks, resolving a stall after every `stallEvery`-th chunk.
    static func both(_ chunks: [[UInt8]], cap: Int, stallEvery: Int?) -> (fast: Run, reference: Run, work: Int) {
        var fast = FrameDecoder(maxPayloadLength: cap)
        var reference = ReferenceFrameDecoder(maxPayloadLength: cap)
        var f = Run()
        var r = Run()
        for (index, chunk) in chunks.enumerated() {
            fast.feed(chunk) { f.frames.append($0) }
            reference.feed(chunk) { r.frames.append($0) }
            if let every = stallEvery, (index + 1) % every == 0 {
                f.stallDrops.append(fast.resolveStall { f.frames.append($0) })
                r.stallDrops.append(reference.resolveStall { r.frames.append($0) })
            }
        }
        f.statistics = fast.statistics
        f.buffered = fast.bufferedByteCount
        r.statistics = reference.statistics
        r.buffered = reference.bufferedByteCount
        return (f, r, fast.work)
    }

    /// A stream mixing valid frames, bit-flipped frames, hostile runs, random noise and truncated headers.
    static func mixedStream(seed: UInt64, cap: Int) -> [UInt8] {
        var rng = SeededRNG(seed: seed)
        var stream: [UInt8] = []
        var seq: UInt64 = 1
        for _ in 0..<120 {
            switch Int.random(in: 0..<6, using: &rng) {
            case 0, 1:
                stream += Frame.data(seq: seq, payload: rng.bytes(Int.random(in: 0...min(cap, 300), using: &rng))).encoded()
                seq += 1
            case 2:
                var bytes = Frame.data(seq: seq, payload: rng.bytes(Int.random(in: 0...min(cap, 300), using: &rng))).encoded()
                let bit = Int.random(in: 0..<(bytes.count * 8), using: &rng)
                bytes[bit / 8] ^= UInt8(1) << UInt8(bit % 8)
                stream += bytes
                seq += 1
            case 3:
                let pattern = hostilePatterns.randomElement(using: &rng)!
                for _ in 0..<Int.random(in: 1...400, using: &rng) { stream += pattern }
            case 4:
                stream += rng.bytes(Int.random(in: 1...200, using: &rng))
            default:
                // A header claiming a small payload, cut short: later frames start inside its span.
                stream += [0xA5, 0x03] + rng.bytes(8) + [0x00, UInt8.random(in: 0...60, using: &rng)]
            }
        }
        return stream
    }

    @Test(arguments: [1, 2, 3, 4, 5, 6] as [UInt64]) func sameDecisionsAsThePlainAlgorithm(seed: UInt64) {
        var rng = SeededRNG(seed: seed &* 7919)
        for cap in [4096, 0, 16, 300] {
            let stream = Self.mixedStream(seed: seed, cap: cap)
            for maxChunk in [1, 20, 244, 5000] {
                let chunks = randomChunks(stream, maxChunk: maxChunk, using: &rng)
                for stallEvery in [nil, 3, 17] as [Int?] {
                    let (fast, reference, work) = Self.both(chunks, cap: cap, stallEvery: stallEvery)
                    #expect(fast == reference, "seed \(seed) cap \(cap) maxChunk \(maxChunk) stall \(String(describing: stallEvery))")
                    #expect(work <= 3 * stream.count, "work \(work) for \(stream.count) bytes")
                }
            }
        }
    }

    /// The bound itself: bytes through the CRC plus candidates judged stay below 3 per byte fed, whereas the plain
    /// algorithm does ~1000 CRC steps per byte on these patterns.
    @Test(arguments: FrameDecoderCostTests.hostilePatterns) func hostilePatternCostIsLinear(pattern: [UInt8]) {
        var stream: [UInt8] = []
        while stream.count < 200_000 { stream += pattern }
        for chunk in [1, 20, 512, stream.count] {
            var decoder = FrameDecoder()
            var i = 0
            while i < stream.count {
                let end = min(stream.count, i + chunk)
                decoder.feed(Array(stream[i..<end])) { _ in Issue.record("a frame out of pure noise") }
                i = end
            }
            decoder.resolveStall { _ in Issue.record("a frame out of pure noise") }
            #expect(decoder.work <= 3 * stream.count, "pattern \(hexString(pattern)) chunk \(chunk): work \(decoder.work)")
            #expect(decoder.statistics.discardedBytes == stream.count)
        }
    }

    /// A frame after a hostile run is still found, and clean frames cost one CRC pass each (work = bytes + frames).
    @Test func cleanStreamsCostOneCRCPass() {
        let frames = FrameDecoderTests.someFrames(seed: 90, count: 200)
        let stream = frames.flatMap { $0.encoded() }
        var decoder = FrameDecoder()
        var out: [Frame] = []
        decoder.feed(stream) { out.append($0) }
        #expect(out == frames)
        #expect(decoder.work == stream.count - 2 * frames.count + frames.count)

        var noisy: [UInt8] = []
        for _ in 0..<1000 { noisy += [0xA5, 0x10, 0x00] }
        var second = FrameDecoder()
        var found: [Frame] = []
        second.feed(noisy + stream) { found.append($0) }
        second.resolveStall { found.append($0) }
        // The hostile run's last candidates claim 4 KB and swallow the first frames' bytes: the plain algorithm
        // decides which survive; both must agree.
        let (fast, reference, _) = Self.both([noisy + stream], cap: 4096, stallEvery: 1)
        #expect(fast == reference)
        #expect(!found.isEmpty && found.last == frames.last)
    }
}
