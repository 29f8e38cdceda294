// libFuzzer entry for FrameDecoder. Built by scripts/fuzz together with Sources/FerryProtocol/*.swift into one
// module (so internal helpers are visible); not part of Package.swift because SwiftPM cannot add
// -sanitize=fuzzer to one product only.
//
// Input layout: byte 0 picks the payload cap and whether stalls are resolved mid-stream; the rest is the
// stream. Chunk sizes come from the stream's own bytes (cyclically), so the fuzzer controls the split points
// and every split is reproducible from the crashing input alone.

private let caps = [4096, 0, 16, 255]

@inline(never)
private func violated(_ message: String) -> Never {
    fatalError("FrameDecoder invariant violated: \(message)")
}

/// Whether `needle` occurs as a contiguous run inside `haystack`.
private func contains(_ haystack: [UInt8], _ needle: [UInt8]) -> Bool {
    guard needle.count <= haystack.count else { return false }
    if needle.isEmpty { return true }
    var i = 0
    while i + needle.count <= haystack.count {
        if haystack[i] == needle[0] && haystack[i..<(i + needle.count)].elementsEqual(needle) { return true }
        i += 1
    }
    return false
}

private struct Outcome {
    var frames: [Frame] = []
    var emittedBytes = 0
    var statistics = FrameDecoder.Statistics()
    var buffered = 0
}

/// The decoding loop shared by the decoder under test and the plain reference algorithm.
private protocol StreamDecoder {
    init(maxPayloadLength: Int)
    var bufferedByteCount: Int { get }
    var statistics: FrameDecoder.Statistics { get }
    mutating func feed(_ bytes: UnsafeRawBufferPointer, emit: (Frame) throws -> Void) rethrows
    @discardableResult mutating func resolveStall(emit: (Frame) throws -> Void) rethrows -> Int
}
extension FrameDecoder: StreamDecoder {}
extension ReferenceFrameDecoder: StreamDecoder {}

/// Issue 12: time is a finding too. The decoder's work (bytes through the CRC + candidates judged) must stay
/// within a constant of the bytes fed, whatever they are; libFuzzer's -timeout catches anything else slow.
private let workPerByte = 3

private func run(_ stream: [UInt8], cap: Int, chunked: Bool, stallEvery: Int?) -> Outcome {
    run(FrameDecoder.self, stream, cap: cap, chunked: chunked, stallEvery: stallEvery)
}

private func run<D: StreamDecoder>(_: D.Type, _ stream: [UInt8], cap: Int, chunked: Bool, stallEvery: Int?) -> Outcome {
    var decoder = D(maxPayloadLength: cap)
    var out = Outcome()
    let bound = Frame.overhead + cap
    let take: (Frame) -> Void = { frame in
        out.frames.append(frame)
        let bytes = frame.encoded()
        out.emittedBytes += bytes.count
        if frame.payload.count > cap { violated("emitted a \(frame.payload.count)-byte payload over cap \(cap)") }
        if !contains(stream, bytes) { violated("emitted \(frame.type)#\(frame.seq) whose bytes are not in the input") }
    }
    var i = 0
    var chunkIndex = 0
    while i < stream.count {
        let size = chunked ? Int(stream[chunkIndex % stream.count] % 64) + 1 : stream.count
        let end = min(stream.count, i + size)
        stream[i..<end].withUnsafeBytes { decoder.feed($0, emit: take) }
        if decoder.bufferedByteCount >= bound {
            violated("buffered \(decoder.bufferedByteCount) bytes, bound \(bound)")
        }
        chunkIndex += 1
        if let every = stallEvery, chunkIndex % every == 0 {
            decoder.resolveStall(emit: take)
            if decoder.bufferedByteCount != 0 { violated("resolveStall left \(decoder.bufferedByteCount) bytes") }
        }
        i = end
    }
    out.statistics = decoder.statistics
    out.buffered = decoder.bufferedByteCount
    if let fast = decoder as? FrameDecoder, fast.work > workPerByte * stream.count {
        violated("work \(fast.work) for \(stream.count) bytes (bound \(workPerByte) per byte)")
    }
    return out
}

private func checkAccounting(_ o: Outcome, fed: Int) {
    let s = o.statistics
    if s.frames != o.frames.count { violated("statistics.frames \(s.frames) != emitted \(o.frames.count)") }
    // Every byte is emitted, skipped inside an unknown-type frame, discarded, or still buffered.
    let skipped = fed - o.emittedBytes - s.discardedBytes - o.buffered
    if skipped < Frame.overhead * s.unknownTypes || (s.unknownTypes == 0 && skipped != 0) {
        violated("byte accounting: fed \(fed) emitted \(o.emittedBytes) discarded \(s.discardedBytes) "
            + "buffered \(o.buffered) unknown frames \(s.unknownTypes)")
    }
    if s.crcMismatches + s.oversizeLengths + s.stalls > s.discardedBytes {
        violated("more resync events than discarded bytes")
    }
    if s.corruptRuns > s.discardedBytes || (s.discardedBytes > 0) != (s.corruptRuns > 0) {
        violated("corruptRuns \(s.corruptRuns) inconsistent with discardedBytes \(s.discardedBytes)")
    }
}

@_cdecl("LLVMFuzzerTestOneInput")
public func frameDecoderFuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    guard size > 0 else { return 0 }
    let control = data[0]
    let stream = Array(UnsafeBufferPointer(start: data + 1, count: size - 1))
    let cap = caps[Int(control & 0x03)]
    let stallEvery: Int? = control & 0x04 != 0 ? Int(control >> 3) % 7 + 1 : nil

    let chunked = run(stream, cap: cap, chunked: true, stallEvery: stallEvery)
    checkAccounting(chunked, fed: stream.count)
    // Same decisions as the plain algorithm (Tests/FerryProtocolTests/ReferenceFrameDecoder.swift), which
    // judges every candidate with its own CRC pass.
    let reference = run(ReferenceFrameDecoder.self, stream, cap: cap, chunked: true, stallEvery: stallEvery)
    if reference.frames != chunked.frames || reference.statistics != chunked.statistics
        || reference.buffered != chunked.buffered
    {
        violated("differs from the reference algorithm")
    }
    if stallEvery == nil {
        // Without idle events in between, the split points must not change anything.
        let whole = run(stream, cap: cap, chunked: false, stallEvery: nil)
        checkAccounting(whole, fed: stream.count)
        if whole.frames != chunked.frames || whole.statistics != chunked.statistics || whole.buffered != chunked.buffered {
            violated("chunked decode differs from one-shot decode")
        }
    }
    return 0
}
