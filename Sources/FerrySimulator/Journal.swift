import FerryCore
import FoundationEssentials
import Glibc

/// Everything the simulator reports as failing: its journal or capture files.
public enum SimulatorError: Error, CustomStringConvertible, Sendable {
    case io(String)
    /// The journal holds bytes that are not a record (a truncated write, or not a journal at all).
    case corruptJournal(path: String, offset: Int)

    public var description: String {
        switch self {
        case .io(let message): message
        case .corruptJournal(let path, let offset): "\(path): not a simulator journal at byte \(offset)"
        }
    }
}

/// One state change of the simulated device. Replaying them in order rebuilds the device.
enum JournalRecord: Equatable {
    case generation(cause: SimulatedPeripheral.GenerationCause, epoch: UInt64, firstSeq: UInt64)
    case event([UInt8])
    /// SYNC_ACK received: events up to seq may be deleted.
    case ack(UInt64)
    /// Oldest retained events dropped for lack of room.
    case evict(UInt32)
    /// New high-water mark of seqs put on the air (the ACK check needs it across reboots).
    case sent(UInt64)

    func encode(into bytes: inout [UInt8]) {
        switch self {
        case .generation(let cause, let epoch, let firstSeq):
            bytes.append(0x47)  // 'G'
            bytes.append(cause.rawValue)
            append(epoch, &bytes)
            append(firstSeq, &bytes)
        case .event(let payload):
            bytes.append(0x45)  // 'E'
            append(UInt16(payload.count), &bytes)
            bytes += payload
        case .ack(let seq):
            bytes.append(0x41)  // 'A'
            append(seq, &bytes)
        case .evict(let count):
            bytes.append(0x56)  // 'V'
            append(count, &bytes)
        case .sent(let seq):
            bytes.append(0x53)  // 'S'
            append(seq, &bytes)
        }
    }

    /// Decodes all records; nil offset on success, else the offset of the first bad record.
    static func decodeAll(_ bytes: [UInt8]) -> (records: [JournalRecord], badOffset: Int?) {
        var records: [JournalRecord] = []
        var i = 0
        func read<T: FixedWidthInteger>(_: T.Type) -> T? {
            let size = T.bitWidth / 8
            guard i + size <= bytes.count else { return nil }
            var value: T = 0
            for k in 0..<size { value = value << 8 | T(bytes[i + k]) }
            i += size
            return value
        }
        while i < bytes.count {
            let start = i
            let tag = bytes[i]
            i += 1
            let record: JournalRecord?
            switch tag {
            case 0x47:
                if let raw = read(UInt8.self), let cause = SimulatedPeripheral.GenerationCause(rawValue: raw),
                    let epoch = read(UInt64.self), let first = read(UInt64.self)
                {
                    record = .generation(cause: cause, epoch: epoch, firstSeq: first)
                } else {
                    record = nil
                }
            case 0x45:
                if let length = read(UInt16.self), i + Int(length) <= bytes.count {
                    record = .event(Array(bytes[i..<(i + Int(length))]))
                    i += Int(length)
                } else {
                    record = nil
                }
            case 0x41: record = read(UInt64.self).map { .ack($0) }
            case 0x56: record = read(UInt32.self).map { .evict($0) }
            case 0x53: record = read(UInt64.self).map { .sent($0) }
            default: record = nil
            }
            guard let record else { return (records, start) }
            records.append(record)
        }
        return (records, nil)
    }

    private func append<T: FixedWidthInteger>(_ value: T, _ bytes: inout [UInt8]) {
        var shift = T.bitWidth - 8
        while shift >= 0 {
            bytes.append(UInt8(truncatingIfNeeded: value >> shift))
            shift -= 8
        }
    }
}

/// The device's flash: an append-only file `peripheral.journal` in its directory. The only owner of its
/// file descriptor.
final class Journal {
    let path: String
    private let fd: Int32

    init(directory: URL) throws(SimulatorError) {
        path = directory.appendingPathComponent("peripheral.journal").path
        if let code = createDirectories(directory.path, mode: 0o755) {
            throw .io("cannot create \(directory.path): \(errnoDescription(code))")
        }
        fd = open(path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0o644)
        guard fd >= 0 else { throw .io("cannot open \(path): \(errnoDescription(errno))") }
    }

    deinit {
        close(fd)
    }

    func load() throws(SimulatorError) -> [JournalRecord] {
        guard lseek(fd, 0, SEEK_SET) == 0, let bytes = readUpTo(fd, limit: Int.max) else {
            throw .io("cannot read \(path): \(errnoDescription(errno))")
        }
        let (records, bad) = JournalRecord.decodeAll(bytes)
        if let bad { throw .corruptJournal(path: path, offset: bad) }
        return records
    }

    func append(_ record: JournalRecord) throws(SimulatorError) {
        var bytes: [UInt8] = []
        record.encode(into: &bytes)
        if let code = writeAll(fd, bytes) {
            throw .io("cannot append to \(path): \(errnoDescription(code))")
        }
    }
}
