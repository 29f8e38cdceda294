import Testing
@testable import FerryProtocol

/// SplitMix64: a tiny seeded generator so every randomized test replays exactly from its seed.
struct SeededRNG: RandomNumberGenerator {
    private var state: UInt64
    init(seed: UInt64) { state = seed }
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}

extension RandomNumberGenerator {
    mutating func bytes(_ count: Int) -> [UInt8] {
        (0..<count).map { _ in UInt8.random(in: 0...255, using: &self) }
    }
    mutating func chance(_ p: Double) -> Bool { Double.random(in: 0..<1, using: &self) < p }
}

func hexBytes(_ hex: String) -> [UInt8] {
    let digits = Array(hex.utf8)
    precondition(digits.count % 2 == 0)
    return stride(from: 0, to: digits.count, by: 2).map { UInt8(String(decoding: digits[$0..<$0 + 2], as: UTF8.self), radix: 16)! }
}

func hexString(_ bytes: [UInt8]) -> String {
    bytes.map { ($0 < 16 ? "0" : "") + String($0, radix: 16) }.joined()
}

/// Splits `bytes` at random points into chunks of 1...maxChunk bytes.
func randomChunks<R: RandomNumberGenerator>(_ bytes: [UInt8], maxChunk: Int, using rng: inout R) -> [[UInt8]] {
    var chunks: [[UInt8]] = []
    var i = 0
    while i < bytes.count {
        let n = min(Int.random(in: 1...maxChunk, using: &rng), bytes.count - i)
        chunks.append(Array(bytes[i..<(i + n)]))
        i += n
    }
    return chunks
}

/// The result of running a decoder over a stream cut into `chunks`, checking the buffer bound after every feed.
struct DecodeRun: Equatable {
    var frames: [Frame] = []
    var statistics = FrameDecoder.Statistics()
    var buffered = 0
    /// Largest `bufferedByteCount` seen after any feed.
    var peakBuffered = 0
}

func decode(_ chunks: [[UInt8]], cap: Int = FrameDecoder.defaultMaxPayloadLength, resolveStallAtEnd: Bool = false)
    -> DecodeRun
{
    var decoder = FrameDecoder(maxPayloadLength: cap)
    var run = DecodeRun()
    for chunk in chunks {
        decoder.feed(chunk) { run.frames.append($0) }
        run.peakBuffered = max(run.peakBuffered, decoder.bufferedByteCount)
    }
    if resolveStallAtEnd { decoder.resolveStall { run.frames.append($0) } }
    run.statistics = decoder.statistics
    run.buffered = decoder.bufferedByteCount
    return run
}

func randomFrame<R: RandomNumberGenerator>(using rng: inout R, maxPayload: Int = 200, types: [FrameType] = [.data])
    -> Frame
{
    let seq: UInt64 =
        switch Int.random(in: 0..<4, using: &rng) {
        case 0: UInt64.random(in: 0...100, using: &rng)
        case 1: UInt64.max - UInt64.random(in: 0...3, using: &rng)
        default: rng.next()
        }
    let payload = rng.bytes(Int.random(in: 0...maxPayload, using: &rng))
    return Frame(type: types.randomElement(using: &rng)!, seq: seq, payload: payload)
}

/// Short failure messages: a frame prints as "DATA#7(5B)", not as its whole payload.
extension Frame: CustomTestStringConvertible {
    public var testDescription: String { "\(type)#\(seq)(\(payload.count)B)" }
}
