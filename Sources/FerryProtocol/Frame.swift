/// The frame types of Sync protocol v1 (PROTOCOL §2). Other type bytes are skipped by the decoder.
public enum FrameType: UInt8, Sendable, Hashable, CustomStringConvertible {
    case syncRequest = 0x01
    case syncAck = 0x02
    case data = 0x03

    public var description: String {
        switch self {
        case .syncRequest: "SYNC_REQ"
        case .syncAck: "SYNC_ACK"
        case .data: "DATA"
        }
    }
}

/// One validated frame. `payload` is a fresh array (never a slice of the decoder's buffer).
public struct Frame: Sendable, Hashable {
    public static let magic: UInt8 = 0xA5
    public static let headerLength = 12
    public static let crcLength = 2
    /// 12-byte header + 2-byte CRC: the size of a frame with an empty payload.
    public static let overhead = headerLength + crcLength
    /// The window the gateway asks for in SYNC_REQ unless configured otherwise (PROTOCOL §2, §4): 100 times
    /// the ACK cadence (`defaultAckEvery`), so batches stay on the air while earlier ones commit and their ACKs
    /// travel; with window == cadence the peripheral idles one round trip per batch (stop-and-wait). An ACK's
    /// trip through bluetoothd, and a commit on a slow disk, outlast many batches on the air: with window 500 the
    /// test bed's peripheral still waited for ACKs most of the data phase on a loaded host (PROTOCOL.md, "Window
    /// and ACK cadence", has the numbers).
    public static let defaultWindow: UInt16 = 2000
    /// Commit + SYNC_ACK every this many staged frames unless configured otherwise (the ACK cadence).
    public static let defaultAckEvery = 20

    public var type: FrameType
    public var seq: UInt64
    public var payload: [UInt8]

    public init(type: FrameType, seq: UInt64, payload: [UInt8] = []) {
        self.type = type
        self.seq = seq
        self.payload = payload
    }

    public static func data(seq: UInt64, payload: [UInt8]) -> Frame {
        Frame(type: .data, seq: seq, payload: payload)
    }

    /// SYNC_REQ: `lastCommitted` is the highest seq durably stored for the stream (0 = nothing yet).
    public static func syncRequest(lastCommitted: UInt64, window: UInt16 = defaultWindow) -> Frame {
        Frame(type: .syncRequest, seq: lastCommitted, payload: [UInt8(window >> 8), UInt8(window & 0xFF)])
    }

    /// SYNC_ACK: `committed` is the highest seq durably stored; the peripheral may delete everything up to it.
    public static func syncAck(committed: UInt64) -> Frame {
        Frame(type: .syncAck, seq: committed)
    }

    /// The window carried by a SYNC_REQ payload, if this is a well-formed SYNC_REQ.
    public var requestedWindow: UInt16? {
        guard type == .syncRequest, payload.count == 2 else { return nil }
        return UInt16(payload[0]) << 8 | UInt16(payload[1])
    }

    /// Wire bytes: magic, type, seq (BE), length (BE), payload, CRC (BE) over everything before it.
    public func encoded() -> [UInt8] {
        precondition(payload.count <= Int(UInt16.max), "payload longer than a frame can carry")
        var bytes = [UInt8]()
        bytes.reserveCapacity(Frame.overhead + payload.count)
        bytes.append(Frame.magic)
        bytes.append(type.rawValue)
        appendBigEndian(seq, to: &bytes)
        appendBigEndian(UInt16(payload.count), to: &bytes)
        bytes.append(contentsOf: payload)
        appendBigEndian(CRC16.checksum(bytes), to: &bytes)
        return bytes
    }
}

@inlinable
func appendBigEndian<T: FixedWidthInteger>(_ value: T, to bytes: inout [UInt8]) {
    var shift = T.bitWidth - 8
    while shift >= 0 {
        bytes.append(UInt8(truncatingIfNeeded: value >> shift))
        shift -= 8
    }
}

/// Reads a big-endian integer byte by byte: no unaligned loads, no assumptions about slice indices.
@inlinable
func readBigEndian<T: FixedWidthInteger>(_ type: T.Type, _ bytes: UnsafeRawBufferPointer, at offset: Int) -> T {
    var value: T = 0
    for i in 0..<(T.bitWidth / 8) {
        value = value << 8 | T(bytes[offset + i])
    }
    return value
}
