// Swift side of scripts/bench-decoder. Linked against FerryProtocol built as its own module (as in the package).
//   DecoderBench generate FILE MEGABYTES SEED   writes realistic DATA frames (20–200 byte payloads)
//   DecoderBench pattern FILE MEGABYTES HEX     writes the byte pattern HEX repeated (hostile noise, no frames)
//   DecoderBench decode FILE PASSES CHUNK       decodes FILE fed in CHUNK-byte pieces (0 = all at once)
//   DecoderBench noise FILE PASSES CHUNK        the same for a file of noise: discards are expected
// Prints "swift-decoder <best MB/s> <frames> <checksum> <discarded>"; MB = 10^6 bytes. decode fails if a
// frame is lost.
import FerryProtocol
import Foundation

struct SplitMix64: RandomNumberGenerator {
    var state: UInt64
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}

@main struct DecoderBench {
    static func main() throws {
        let args = CommandLine.arguments
        guard args.count == 5 else { fatalError("usage: DecoderBench generate|decode FILE N M") }
        switch args[1] {
        case "generate":
            var rng = SplitMix64(state: UInt64(args[4])!)
            let target = Int(args[3])! * 1_000_000
            var stream = [UInt8]()
            stream.reserveCapacity(target + 300)
            var seq: UInt64 = 1
            while stream.count < target {
                let payload = (0..<Int.random(in: 20...200, using: &rng)).map { _ in UInt8.random(in: 0...255, using: &rng) }
                stream += Frame.data(seq: seq, payload: payload).encoded()
                seq += 1
            }
            try Data(stream).write(to: URL(fileURLWithPath: args[2]))
            print("generated \(seq - 1) frames, \(stream.count) bytes")
        case "pattern":
            let hex = Array(args[4].utf8)
            precondition(hex.count % 2 == 0 && !hex.isEmpty, "pattern: even number of hex digits")
            let unit = stride(from: 0, to: hex.count, by: 2).map {
                UInt8(String(decoding: hex[$0..<($0 + 2)], as: UTF8.self), radix: 16)!
            }
            let target = Int(args[3])! * 1_000_000
            var stream = [UInt8]()
            stream.reserveCapacity(target + unit.count)
            while stream.count < target { stream += unit }
            try Data(stream).write(to: URL(fileURLWithPath: args[2]))
            print("generated 0 frames, \(stream.count) bytes")
        case "decode", "noise":
            let bytes = [UInt8](try Data(contentsOf: URL(fileURLWithPath: args[2])))
            let passes = Int(args[3])!
            let chunk = Int(args[4])!
            var best = Duration.seconds(1000)
            var frames = 0
            var checksum: UInt64 = 0
            var discarded = 0
            for _ in 0..<passes {
                var decoder = FrameDecoder()
                var count = 0
                var sum: UInt64 = 0
                let elapsed = ContinuousClock().measure {
                    bytes.withUnsafeBytes { all in
                        let step = chunk == 0 ? all.count : chunk
                        var i = 0
                        while i < all.count {
                            let end = min(all.count, i + step)
                            decoder.feed(UnsafeRawBufferPointer(rebasing: all[i..<end])) { frame in
                                count += 1
                                sum &+= frame.seq &+ UInt64(frame.payload.count)
                            }
                            i = end
                        }
                    }
                }
                best = min(best, elapsed)
                frames = count
                checksum = sum
                discarded = decoder.statistics.discardedBytes
                if args[1] == "decode" {
                    precondition(discarded == 0 && decoder.bufferedByteCount == 0, "decoder lost bytes")
                }
            }
            let seconds = Double(best.components.seconds) + Double(best.components.attoseconds) / 1e18
            print("swift-decoder \(String(format: "%.3f", Double(bytes.count) / seconds / 1e6)) \(frames) \(checksum) \(discarded)")
        default:
            fatalError("unknown mode \(args[1])")
        }
    }
}
