import Testing
@testable import FerryProtocol

/// Streaming decoder (PROTOCOL §2): chunking, resync, unknown types, the one-frame buffer bound, stalls.
@Suite struct FrameDecoderTests {
    static func someFrames(seed: UInt64, count: Int, maxPayload: Int = 200) -> [Frame] {
        var rng = SeededRNG(seed: seed)
        return (0..<count).map { i in Frame.data(seq: UInt64(i + 1), payload: rng.bytes(Int.random(in: 0...maxPayload, using: &rng))) }
    }

    static let bound = Frame.overhead + FrameDecoder.defaultMaxPayloadLength

    @Test func eachFrameWholeByteByByteAndAllAtOnce() {
        let frames = Self.someFrames(seed: 10, count: 60)
        let stream = frames.flatMap { $0.encoded() }
        let whole = decode(frames.map { $0.encoded() })
        let bytewise = decode(stream.map { [$0] })
        let atOnce = decode([stream])
        for run in [whole, bytewise, atOnce] {
            #expect(run.frames == frames)
            #expect(run.buffered == 0)
            #expect(run.statistics.frames == frames.count)
            #expect(run.statistics.discardedBytes == 0 && run.statistics.corruptRuns == 0)
        }
    }

    @Test(arguments: [11, 12, 13, 14] as [UInt64]) func randomSplitPoints(seed: UInt64) {
        var rng = SeededRNG(seed: seed)
        let frames = Self.someFrames(seed: seed, count: 80)
        let stream = frames.flatMap { $0.encoded() }
        for maxChunk in [2, 7, 30, 517, 5000] {
            let run = decode(randomChunks(stream, maxChunk: maxChunk, using: &rng))
            #expect(run.frames == frames, "seed \(seed) maxChunk \(maxChunk)")
            #expect(run.buffered == 0)
        }
    }

    /// A frame that was split must not be emitted before its last byte arrives.
    @Test func partialFrameWaitsForItsLastByte() {
        let frame = Frame.data(seq: 3, payload: Array("abcdef".utf8))
        let bytes = frame.encoded()
        var decoder = FrameDecoder()
        var out: [Frame] = []
        decoder.feed(Array(bytes.dropLast())) { out.append($0) }
        #expect(out.isEmpty)
        #expect(decoder.bufferedByteCount == bytes.count - 1)
        decoder.feed([bytes.last!]) { out.append($0) }
        #expect(out == [frame])
        #expect(decoder.bufferedByteCount == 0)
    }

    @Test func noiseWithoutMagicBetweenFrames() {
        var rng = SeededRNG(seed: 20)
        let frames = Self.someFrames(seed: 20, count: 40)
        var stream: [UInt8] = []
        var noiseBytes = 0
        for frame in frames {
            let noise = rng.bytes(Int.random(in: 0...40, using: &rng)).map { $0 == 0xA5 ? 0x00 : $0 }
            noiseBytes += noise.count
            stream += noise + frame.encoded()
        }
        for maxChunk in [1, 9, 4096] {
            let run = decode(randomChunks(stream, maxChunk: maxChunk, using: &rng))
            #expect(run.frames == frames)
            #expect(run.statistics.discardedBytes == noiseBytes)
            #expect(run.buffered == 0)
        }
    }

    /// Noise full of 0xA5 (each one a false start) must not cost a single real frame once the stall is resolved.
    @Test(arguments: [21, 22, 23] as [UInt64]) func noiseFullOfMagicBytes(seed: UInt64) {
        var rng = SeededRNG(seed: seed)
        let frames = Self.someFrames(seed: seed, count: 40)
        var stream: [UInt8] = []
        for frame in frames {
            let noise = rng.bytes(Int.random(in: 0...40, using: &rng)).map { rng.chance(0.3) ? 0xA5 : $0 }
            stream += noise + frame.encoded()
        }
        let run = decode(randomChunks(stream, maxChunk: 64, using: &rng), resolveStallAtEnd: true)
        #expect(run.frames == frames)
        #expect(run.buffered == 0)
        #expect(run.peakBuffered < Self.bound)
    }

    /// Every single-bit flip of a frame: that frame is dropped, the ones before and after it survive (after the
    /// idle-time stall resolution when the flip made the length bigger), and nothing spurious is emitted.
    @Test func everyBitFlipDropsOnlyTheDamagedFrame() {
        let before = Frame.data(seq: 1, payload: Array("before".utf8))
        let victim = Frame.data(seq: 2, payload: Array("the frame that gets a flipped bit".utf8))
        let after = [Frame.data(seq: 3, payload: Array("after".utf8)), Frame.data(seq: 4, payload: [])]
        let victimBytes = victim.encoded()
        for byteIndex in 0..<victimBytes.count {
            for bit in 0..<8 {
                var damaged = victimBytes
                damaged[byteIndex] ^= 1 << bit
                let stream = before.encoded() + damaged + after.flatMap { $0.encoded() }
                for chunks in [[stream], stream.map { [$0] }] {
                    let run = decode(chunks, resolveStallAtEnd: true)
                    #expect(run.frames == [before] + after, "byte \(byteIndex) bit \(bit)")
                    #expect(run.buffered == 0)
                    #expect(run.statistics.discardedBytes > 0)
                }
            }
        }
    }

    /// The fast path (empty buffer) and the buffered path must treat a flip in the SAME way.
    @Test func bitFlipsInLongRandomStreamsAreChunkingIndependent() {
        var rng = SeededRNG(seed: 30)
        for round in 0..<30 {
            let frames = Self.someFrames(seed: 100 + UInt64(round), count: 30)
            var stream = frames.flatMap { $0.encoded() }
            for _ in 0..<Int.random(in: 1...6, using: &rng) {
                stream[Int.random(in: 0..<stream.count, using: &rng)] ^= 1 << UInt8.random(in: 0...7, using: &rng)
            }
            let reference = decode([stream], resolveStallAtEnd: true)
            for maxChunk in [1, 3, 50, 600] {
                let run = decode(randomChunks(stream, maxChunk: maxChunk, using: &rng), resolveStallAtEnd: true)
                #expect(run == DecodeRun(frames: reference.frames, statistics: reference.statistics, buffered: 0, peakBuffered: run.peakBuffered),
                        "round \(round) maxChunk \(maxChunk)")
                #expect(run.peakBuffered < Self.bound)
            }
            // Survivors are a subsequence of the originals: corruption never invents or reorders frames.
            var it = frames.makeIterator()
            for f in reference.frames {
                var found = false
                while let g = it.next() { if g == f { found = true; break } }
                #expect(found, "round \(round): emitted a frame that was not sent: seq \(f.seq)")
            }
        }
    }

    @Test func oversizeLengthResyncsWithoutBuffering() {
        // A header announcing 0xFFFF payload bytes, followed by 70 KB of frames: none of it may be held back.
        let liar: [UInt8] = [0xA5, 0x03, 0, 0, 0, 0, 0, 0, 0, 9, 0xFF, 0xFF]
        let frames = Self.someFrames(seed: 40, count: 600)
        var decoder = FrameDecoder()
        var out: [Frame] = []
        decoder.feed(liar) { out.append($0) }
        #expect(decoder.bufferedByteCount == 0)
        #expect(decoder.statistics.oversizeLengths == 1)
        for frame in frames {
            decoder.feed(frame.encoded()) { out.append($0) }
            #expect(decoder.bufferedByteCount == 0)
        }
        #expect(out == frames)
        #expect(decoder.statistics.discardedBytes == liar.count)
        #expect(decoder.statistics.corruptRuns == 1)
    }

    @Test func capIsConfigurable() {
        let small = Frame.data(seq: 1, payload: [UInt8](repeating: 1, count: 10))
        let big = Frame.data(seq: 2, payload: [UInt8](repeating: 2, count: 11))
        let next = Frame.data(seq: 3, payload: [3])
        let stream = small.encoded() + big.encoded() + next.encoded()
        let run = decode(stream.map { [$0] }, cap: 10)
        #expect(run.frames == [small, next])
        #expect(run.statistics.oversizeLengths == 1)
        #expect(run.peakBuffered < Frame.overhead + 10)
        #expect(decode([stream], cap: 11).frames == [small, big, next])
        // Cap 0: only empty payloads pass.
        #expect(decode([stream + Frame.data(seq: 4, payload: []).encoded()], cap: 0).frames == [Frame.data(seq: 4, payload: [])])
    }

    /// Garbage that looks like a header whose claimed span covers a real frame: the real frame is found after
    /// the false start fails its CRC and ONE byte is dropped.
    @Test func validFrameStartingInsideGarbage() {
        let real = Frame.data(seq: 7, payload: Array("real".utf8))
        let fakeHeader: [UInt8] = [0xA5, 0x03, 0, 0, 0, 0, 0, 0, 0, 7, 0x00, 0x10]  // claims 16 payload bytes
        for prefix in [fakeHeader, [0xA5], [0xA5, 0xA5], [0xA5, 0x03, 0x00]] {
            let stream = prefix + real.encoded() + [UInt8](repeating: 0, count: 20)
            for chunks in [[stream], stream.map { [$0] }] {
                let run = decode(chunks, resolveStallAtEnd: true)
                #expect(run.frames == [real], "prefix \(hexString(prefix))")
            }
        }
        // The false start swallows the real frame's bytes AND needs more: only stall resolution recovers it.
        let greedy: [UInt8] = [0xA5, 0x03, 0, 0, 0, 0, 0, 0, 0, 7, 0x01, 0x00]  // claims 256
        var decoder = FrameDecoder()
        var out: [Frame] = []
        decoder.feed(greedy + real.encoded()) { out.append($0) }
        #expect(out.isEmpty)
        #expect(decoder.bufferedByteCount == greedy.count + real.encoded().count)
        decoder.resolveStall { out.append($0) }
        #expect(out == [real])
        #expect(decoder.statistics.stalls == 1)
        #expect(decoder.bufferedByteCount == 0)
    }

    @Test func unknownTypesAreSkippedAndCounted() {
        func frame(type: UInt8, seq: UInt8, payload: [UInt8]) -> [UInt8] {
            var bytes: [UInt8] = [0xA5, type, 0, 0, 0, 0, 0, 0, 0, seq, 0, UInt8(payload.count)] + payload
            let crc = CRC16.checksum(bytes)
            bytes += [UInt8(crc >> 8), UInt8(crc & 0xFF)]
            return bytes
        }
        let a = Frame.data(seq: 1, payload: [1])
        let b = Frame.data(seq: 2, payload: [2])
        let stream = a.encoded() + frame(type: 0x04, seq: 9, payload: [0xA5, 0xA5]) + frame(type: 0x00, seq: 9, payload: [])
            + b.encoded() + frame(type: 0xFF, seq: 9, payload: Array("future".utf8))
        for chunks in [[stream], stream.map { [$0] }] {
            let run = decode(chunks)
            #expect(run.frames == [a, b])
            #expect(run.statistics.unknownTypes == 3)
            #expect(run.statistics.frames == 2)
            #expect(run.statistics.discardedBytes == 0)
            #expect(run.buffered == 0)
        }
    }

    /// SYNC_REQ and SYNC_ACK are valid frames: the decoder emits them; the session decides they are not for it.
    @Test func knownNonDataTypesAreEmitted() {
        let frames: [Frame] = [.syncAck(committed: 4), .syncRequest(lastCommitted: 3), .data(seq: 1, payload: [])]
        #expect(decode([frames.flatMap { $0.encoded() }]).frames == frames)
    }

    /// Stall (PROTOCOL §2): a flipped bit in the length field makes the frame claim more bytes than ever come.
    @Test func flippedLengthBitIsRecoveredByResolveStall() {
        let first = Frame.data(seq: 1, payload: [1, 1])
        let victim = Frame.data(seq: 2, payload: Array("hello".utf8))
        let rest = (3...5).map { Frame.data(seq: UInt64($0), payload: [UInt8($0)]) }
        var damaged = victim.encoded()
        damaged[10] ^= 0x01  // length 5 → 261
        let stream = first.encoded() + damaged + rest.flatMap { $0.encoded() }
        var decoder = FrameDecoder()
        var out: [Frame] = []
        decoder.feed(stream) { out.append($0) }
        #expect(out == [first])
        #expect(decoder.bufferedByteCount > 0)
        let dropped = decoder.resolveStall { out.append($0) }
        #expect(out == [first] + rest)
        #expect(dropped == damaged.count)
        #expect(decoder.statistics.stalls == 1)
        #expect(decoder.bufferedByteCount == 0)
        // Nothing buffered: resolving again is a no-op, not another stall.
        #expect(decoder.resolveStall { _ in Issue.record("emitted from an empty buffer") } == 0)
        #expect(decoder.statistics.stalls == 1)
    }

    /// The bound from the issue: after ANY feed, bufferedByteCount < overhead + cap, for any input.
    @Test(arguments: [50, 51, 52] as [UInt64]) func bufferNeverExceedsOneFrame(seed: UInt64) {
        var rng = SeededRNG(seed: seed)
        for cap in [0, 16, 300, 4096] {
            var decoder = FrameDecoder(maxPayloadLength: cap)
            for _ in 0..<400 {
                var chunk: [UInt8]
                switch Int.random(in: 0..<4, using: &rng) {
                case 0: chunk = rng.bytes(Int.random(in: 1...600, using: &rng))
                case 1: chunk = [UInt8](repeating: 0xA5, count: Int.random(in: 1...200, using: &rng))
                case 2:
                    // A header claiming a random length, then not enough bytes.
                    chunk = [0xA5, 0x03] + rng.bytes(8) + [UInt8.random(in: 0...255, using: &rng), UInt8.random(in: 0...255, using: &rng)]
                default: chunk = randomFrame(using: &rng, maxPayload: cap).encoded()
                }
                decoder.feed(chunk) { _ in }
                #expect(decoder.bufferedByteCount < Frame.overhead + cap, "cap \(cap)")
            }
        }
    }

    /// Bytes in == bytes emitted + bytes of skipped unknown frames + discarded + buffered.
    @Test func statisticsAccountForEveryByte() {
        var rng = SeededRNG(seed: 60)
        let frames = Self.someFrames(seed: 60, count: 50)
        var stream: [UInt8] = []
        for f in frames {
            stream += rng.bytes(Int.random(in: 0...10, using: &rng)) + f.encoded()
        }
        var decoder = FrameDecoder()
        var emittedBytes = 0
        for chunk in randomChunks(stream, maxChunk: 33, using: &rng) {
            decoder.feed(chunk) { emittedBytes += $0.encoded().count }
        }
        decoder.resolveStall { emittedBytes += $0.encoded().count }
        #expect(decoder.statistics.unknownTypes == 0)
        #expect(emittedBytes + decoder.statistics.discardedBytes + decoder.bufferedByteCount == stream.count)
    }
}
