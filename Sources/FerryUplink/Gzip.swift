// gzip (RFC 1952) over DEFLATE (RFC 1951) with LZ77 matching and the fixed Huffman code.
//
// Why our own: the package may only use C libraries declared as system library targets
// and zlib is not one; Foundation on Linux has no compression API. Uplink bodies are
// JSON with the same keys in every frame, where LZ77 does nearly all of the work, so the
// fixed code (no per-block tables to build or send) gets most of zlib's ratio.
// Deterministic: the same input always gives the same bytes (mtime is 0).

enum Gzip {
    static func compress(_ input: [UInt8]) -> [UInt8] {
        var out: [UInt8] = [0x1F, 0x8B, 8, 0, 0, 0, 0, 0, 0, 255]  // deflate, no flags, mtime 0, OS unknown
        out.reserveCapacity(input.count / 3 + 32)
        Deflate.compressFixed(input, into: &out)
        let crc = CRC32.checksum(input)
        let size = UInt32(truncatingIfNeeded: input.count)
        for shift in stride(from: 0, to: 32, by: 8) { out.append(UInt8(truncatingIfNeeded: crc >> UInt32(shift))) }
        for shift in stride(from: 0, to: 32, by: 8) { out.append(UInt8(truncatingIfNeeded: size >> UInt32(shift))) }
        return out
    }
}

enum CRC32 {
    private static let table: [UInt32] = (0..<256).map { index in
        var value = UInt32(index)
        for _ in 0..<8 { value = value & 1 == 1 ? 0xEDB8_8320 ^ (value >> 1) : value >> 1 }
        return value
    }

    static func checksum(_ bytes: [UInt8]) -> UInt32 {
        var crc: UInt32 = 0xFFFF_FFFF
        for byte in bytes { crc = table[Int((crc ^ UInt32(byte)) & 0xFF)] ^ (crc >> 8) }
        return crc ^ 0xFFFF_FFFF
    }
}

enum Deflate {
    private static let lengthBase: [Int] = [
        3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258,
    ]
    private static let lengthExtra: [Int] = [
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
    ]
    private static let distanceBase: [Int] = [
        1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097,
        6145, 8193, 12289, 16385, 24577,
    ]
    private static let distanceExtra: [Int] = [
        0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13,
    ]

    private static let windowSize = 32768
    private static let minimumMatch = 3
    private static let maximumMatch = 258
    /// How many earlier positions with the same 3-byte hash are tried; bounds the CPU per byte.
    private static let maximumChain = 64

    /// Appends one final fixed-Huffman block holding all of `input`.
    static func compressFixed(_ input: [UInt8], into out: inout [UInt8]) {
        var bits = BitWriter()
        bits.write(1, count: 1)  // BFINAL
        bits.write(1, count: 2)  // BTYPE = 01, fixed Huffman
        let hashBits = 15
        var head = [Int32](repeating: -1, count: 1 << hashBits)
        var previous = [Int32](repeating: -1, count: windowSize)
        func hash(_ position: Int) -> Int {
            let value = UInt32(input[position]) << 16 | UInt32(input[position + 1]) << 8 | UInt32(input[position + 2])
            return Int((value &* 2_654_435_761) >> UInt32(32 - hashBits))
        }
        func insert(_ position: Int) {
            guard position + minimumMatch <= input.count else { return }
            let key = hash(position)
            previous[position & (windowSize - 1)] = head[key]
            head[key] = Int32(position)
        }

        var position = 0
        while position < input.count {
            var bestLength = 0
            var bestDistance = 0
            if position + minimumMatch <= input.count {
                var candidate = Int(head[hash(position)])
                var chain = maximumChain
                let limit = min(maximumMatch, input.count - position)
                while candidate >= 0, position - candidate <= windowSize, chain > 0 {
                    if input[candidate + bestLength] == input[position + bestLength] || bestLength == 0 {
                        var length = 0
                        while length < limit, input[candidate + length] == input[position + length] { length += 1 }
                        if length > bestLength {
                            bestLength = length
                            bestDistance = position - candidate
                            if length == limit { break }
                        }
                    }
                    let next = Int(previous[candidate & (windowSize - 1)])
                    if next >= candidate { break }  // the slot was reused by a newer position
                    candidate = next
                    chain -= 1
                }
            }
            if bestLength >= minimumMatch {
                writeLength(bestLength, &bits)
                writeDistance(bestDistance, &bits)
                for offset in 0..<bestLength { insert(position + offset) }
                position += bestLength
            } else {
                writeLiteral(Int(input[position]), &bits)
                insert(position)
                position += 1
            }
            bits.drain(into: &out)
        }
        writeLiteral(256, &bits)  // end of block
        bits.flush(into: &out)
    }

    /// Fixed literal/length code (RFC 1951 §3.2.6), sent most significant bit first.
    private static func writeLiteral(_ symbol: Int, _ bits: inout BitWriter) {
        switch symbol {
        case 0...143: bits.writeHuffman(0x30 + symbol, count: 8)
        case 144...255: bits.writeHuffman(0x190 + symbol - 144, count: 9)
        case 256...279: bits.writeHuffman(symbol - 256, count: 7)
        default: bits.writeHuffman(0xC0 + symbol - 280, count: 8)
        }
    }

    private static func writeLength(_ length: Int, _ bits: inout BitWriter) {
        var index = lengthBase.count - 1
        while lengthBase[index] > length { index -= 1 }
        writeLiteral(257 + index, &bits)
        if lengthExtra[index] > 0 { bits.write(UInt64(length - lengthBase[index]), count: lengthExtra[index]) }
    }

    private static func writeDistance(_ distance: Int, _ bits: inout BitWriter) {
        var index = distanceBase.count - 1
        while distanceBase[index] > distance { index -= 1 }
        bits.writeHuffman(index, count: 5)
        if distanceExtra[index] > 0 { bits.write(UInt64(distance - distanceBase[index]), count: distanceExtra[index]) }
    }
}

/// DEFLATE packs bits least significant first; Huffman codes go in most significant bit first.
struct BitWriter {
    private var buffer: UInt64 = 0
    private var count = 0

    mutating func write(_ value: UInt64, count bitCount: Int) {
        buffer |= (value & ((1 << UInt64(bitCount)) - 1)) << UInt64(count)
        count += bitCount
    }

    mutating func writeHuffman(_ code: Int, count bitCount: Int) {
        var reversed: UInt64 = 0
        for bit in 0..<bitCount where code & (1 << bit) != 0 { reversed |= 1 << UInt64(bitCount - 1 - bit) }
        write(reversed, count: bitCount)
    }

    /// Moves whole bytes out; at most 7 bits stay buffered.
    mutating func drain(into out: inout [UInt8]) {
        while count >= 8 {
            out.append(UInt8(truncatingIfNeeded: buffer))
            buffer >>= 8
            count -= 8
        }
    }

    mutating func flush(into out: inout [UInt8]) {
        drain(into: &out)
        if count > 0 {
            out.append(UInt8(truncatingIfNeeded: buffer))
            buffer = 0
            count = 0
        }
    }
}
