import FerryCLI
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// A fresh directory per test, removed when released.
final class TemporaryDirectory {
    let path: String

    init() throws {
        path = FileManager.default.temporaryDirectory.path + "/ferry-clitests-" + UUID().uuidString
        try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: false)
    }

    deinit { try? FileManager.default.removeItem(atPath: path) }

    func file(_ name: String) -> String { path + "/" + name }

    func write(_ bytes: [UInt8], to name: String) throws -> String {
        let target = file(name)
        try Data(bytes).write(to: URL(fileURLWithPath: target))
        return target
    }

    /// Everything in the directory, so a test can prove a bad run created nothing.
    func entries() throws -> Set<String> { Set(try FileManager.default.contentsOfDirectory(atPath: path)) }
}

/// Captures are built here byte by byte from PROTOCOL §2, independently of FerryProtocol's encoder, so the CLI
/// is tested against the wire format rather than against its own codec.
enum Wire {
    static let data: UInt8 = 0x03
    static let syncRequest: UInt8 = 0x01
    static let syncAck: UInt8 = 0x02

    /// CRC-16/IBM-3740: poly 0x1021, init 0xFFFF, no reflection, xorout 0.
    static let crcTable: [UInt16] = (0..<256).map { byte in
        var crc = UInt16(byte) << 8
        for _ in 0..<8 { crc = crc & 0x8000 != 0 ? (crc << 1) ^ 0x1021 : crc << 1 }
        return crc
    }

    static func crc(_ bytes: [UInt8]) -> UInt16 {
        bytes.reduce(UInt16(0xFFFF)) { crc, byte in (crc << 8) ^ crcTable[Int(UInt8(crc >> 8) ^ byte)] }
    }

    static func frame(type: UInt8 = data, seq: UInt64, payload: [UInt8]) -> [UInt8] {
        var bytes: [UInt8] = [0xA5, type]
        for shift in stride(from: 56, through: 0, by: -8) { bytes.append(UInt8(truncatingIfNeeded: seq >> UInt64(shift))) }
        bytes += [UInt8(payload.count >> 8), UInt8(payload.count & 0xFF)]
        bytes += payload
        let check = crc(bytes)
        return bytes + [UInt8(check >> 8), UInt8(check & 0xFF)]
    }

    /// The DATA frame for `seq` with a payload derived from it (so stored payloads can be checked).
    static func dataFrame(_ seq: UInt64, payloadSize: Int = 8) -> [UInt8] {
        frame(seq: seq, payload: payload(for: seq, size: payloadSize))
    }

    static func payload(for seq: UInt64, size: Int = 8) -> [UInt8] {
        (0..<size).map { UInt8(truncatingIfNeeded: seq &* 31 &+ UInt64($0)) }
    }

    static func capture(_ seqs: some Sequence<UInt64>, payloadSize: Int = 8) -> [UInt8] {
        var bytes: [UInt8] = []
        for seq in seqs { bytes += dataFrame(seq, payloadSize: payloadSize) }
        return bytes
    }
}

struct CommandResult {
    var status: Int32
    var stdout: [String]
    var stderr: [String]

    /// The single JSON object a `--json` command printed.
    func json() throws -> [String: Any] {
        try #require(stdout.count == 1, "expected one line of JSON, got \(stdout)")
        let object = try JSONSerialization.jsonObject(with: Data(stdout[0].utf8))
        return try #require(object as? [String: Any])
    }
}

/// Runs `ferry <arguments>` in-process.
func ferry(_ arguments: String...) -> CommandResult {
    ferry(arguments)
}

func ferry(_ arguments: [String]) -> CommandResult {
    let output = CapturedOutput()
    let status = FerryCommandLine.run(arguments: arguments, output: output)
    return CommandResult(status: status, stdout: output.stdout, stderr: output.stderr)
}

let peripheral = "C0:FF:EE:00:00:01"
