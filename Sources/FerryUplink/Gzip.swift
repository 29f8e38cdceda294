// gzip (RFC 1952) through zlib, a Debian system library like SQLite and libdbus (issue 11 replaced the
// hand-written fixed-Huffman DEFLATE: zlib's dynamic codes are smaller and its code is what every backend
// already trusts). Deterministic for one zlib version: the header's mtime is 0 and no file name is stored,
// so a retry compressed again is the same bytes (the backend hashes the decoded body anyway, UPLINK.md §3).

import CZlib

enum Gzip {
    /// Level 6, zlib's default: measured on uplink bodies it is within a few percent of 9 at half the CPU.
    static func compress(_ input: [UInt8], level: Int32 = 6) -> [UInt8] {
        var stream = z_stream()
        guard ferry_deflate_init_gzip(&stream, level) == Z_OK else { return stored(input) }
        defer { deflateEnd(&stream) }
        let bound = Int(deflateBound(&stream, uLong(input.count)))
        var out = [UInt8](repeating: 0, count: bound)
        let status = input.withUnsafeBufferPointer { source -> Int32 in
            out.withUnsafeMutableBufferPointer { target -> Int32 in
                // zlib's next_in is not const in this header version; it never writes through it.
                stream.next_in = UnsafeMutablePointer(mutating: source.baseAddress)
                stream.avail_in = uInt(source.count)
                stream.next_out = target.baseAddress
                stream.avail_out = uInt(target.count)
                return deflate(&stream, Z_FINISH)
            }
        }
        // deflateBound is an upper bound for one Z_FINISH call, so anything but Z_STREAM_END is a zlib failure.
        guard status == Z_STREAM_END else { return stored(input) }
        out.removeSubrange(Int(stream.total_out)...)
        return out
    }

    /// zlib cannot fail on valid input with enough output space; should it (out of memory in deflateInit2), a
    /// stored-blocks gzip keeps the request valid instead of sending garbage or trapping.
    static func stored(_ input: [UInt8]) -> [UInt8] {
        var out: [UInt8] = [0x1F, 0x8B, 8, 0, 0, 0, 0, 0, 0, 255]
        var offset = 0
        repeat {
            let count = min(65_535, input.count - offset)
            let final: UInt8 = offset + count == input.count ? 1 : 0
            out += [final, UInt8(count & 0xFF), UInt8(count >> 8), UInt8(~count & 0xFF), UInt8((~count >> 8) & 0xFF)]
            out += input[offset..<(offset + count)]
            offset += count
        } while offset < input.count
        let crc = CRC32.checksum(input)
        let size = UInt32(truncatingIfNeeded: input.count)
        for shift in stride(from: 0, to: 32, by: 8) { out.append(UInt8(truncatingIfNeeded: crc >> UInt32(shift))) }
        for shift in stride(from: 0, to: 32, by: 8) { out.append(UInt8(truncatingIfNeeded: size >> UInt32(shift))) }
        return out
    }
}

enum CRC32 {
    static func checksum(_ bytes: [UInt8]) -> UInt32 {
        bytes.withUnsafeBufferPointer { UInt32(crc32(0, $0.baseAddress, uInt($0.count))) }
    }
}
