/// The 26-byte STREAM_INFO characteristic (PROTOCOL §3). A stream is (peripheral identity address, epoch).
public struct StreamInfo: Sendable, Hashable {
    public static let encodedLength = 26
    public static let version: UInt8 = 1

    /// Random value chosen when the peripheral's event store was created; changes only when it is wiped.
    public var epoch: UInt64
    /// Oldest seq the peripheral still holds (0 = none).
    public var oldest: UInt64
    /// Highest seq assigned so far (0 = none).
    public var head: UInt64

    public init(epoch: UInt64, oldest: UInt64, head: UInt64) {
        self.epoch = epoch
        self.oldest = oldest
        self.head = head
    }

    public enum ParseError: Error, Equatable, CustomStringConvertible {
        case tooShort(Int)
        case unsupportedVersion(UInt8)
        case oldestAfterHead(oldest: UInt64, head: UInt64)

        public var description: String {
            switch self {
            case .tooShort(let n): "STREAM_INFO is \(n) bytes, expected \(StreamInfo.encodedLength)"
            case .unsupportedVersion(let v): "STREAM_INFO version \(v) is not supported (expected 1)"
            case .oldestAfterHead(let o, let h): "STREAM_INFO says oldest \(o) > head \(h)"
            }
        }
    }

    /// Parses the characteristic value. Decision (PROTOCOL is silent): bytes past the 26th are ignored so a
    /// later minor revision can append fields; the reserved flags byte is ignored; oldest > head is rejected
    /// because a gateway acting on it could record a bogus gap.
    public init(bytes: [UInt8]) throws(ParseError) {
        guard bytes.count >= StreamInfo.encodedLength else { throw .tooShort(bytes.count) }
        guard bytes[0] == StreamInfo.version else { throw .unsupportedVersion(bytes[0]) }
        let (epoch, oldest, head) = bytes.withUnsafeBytes { p in
            (readBigEndian(UInt64.self, p, at: 2), readBigEndian(UInt64.self, p, at: 10),
             readBigEndian(UInt64.self, p, at: 18))
        }
        guard oldest <= head else { throw .oldestAfterHead(oldest: oldest, head: head) }
        self.init(epoch: epoch, oldest: oldest, head: head)
    }

    public func encoded() -> [UInt8] {
        var bytes: [UInt8] = [StreamInfo.version, 0]
        appendBigEndian(epoch, to: &bytes)
        appendBigEndian(oldest, to: &bytes)
        appendBigEndian(head, to: &bytes)
        return bytes
    }
}

/// The per-frame sequencing rule shared by live sessions and dump ingest (PROTOCOL §4 step 5).
public enum SequenceVerdict: Sendable, Equatable {
    /// seq ≤ cursor: already have it.
    case duplicate
    /// seq == cursor + 1: stage it.
    case next
    /// seq > cursor + 1: `first...last` are missing before it.
    case gap(first: UInt64, last: UInt64)

    public static func classify(seq: UInt64, cursor: UInt64) -> SequenceVerdict {
        if seq <= cursor { return .duplicate }
        if seq == cursor + 1 { return .next }  // cannot overflow: cursor < seq ≤ UInt64.max
        return .gap(first: cursor + 1, last: seq - 1)
    }
}
