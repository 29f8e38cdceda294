import Foundation
import Testing

@testable import FerryUplink

@Suite struct TokenFileTests {
    let secret = "s3cr3t-T0KEN-value_42"

    func write(_ content: String, mode: Int) throws -> (URL, String) {
        let directory = try TestSupport.temporaryDirectory()
        let path = directory.appendingPathComponent("token").path
        try content.write(toFile: path, atomically: false, encoding: .utf8)
        #expect(chmod(path, mode_t(mode)) == 0)
        return (directory, path)
    }

    @Test func readsAPrivateFileAndTrimsTheNewline() throws {
        let (directory, path) = try write(secret + "\n", mode: 0o600)
        defer { try? FileManager.default.removeItem(at: directory) }
        let token = try TokenFile(path: path).read()
        #expect(token.authorizationHeaderValue == "Bearer " + secret)
        #expect(!"\(token)".contains(secret))
        #expect(!String(reflecting: token).contains(secret))
    }

    @Test(arguments: [0o644, 0o640, 0o604, 0o660, 0o606])
    func refusesFilesOthersCanRead(mode: Int) throws {
        let (directory, path) = try write(secret, mode: mode)
        defer { try? FileManager.default.removeItem(at: directory) }
        #expect(throws: TokenFileError.permissionsTooOpen(path: path, mode: UInt32(0o100000 | mode))) {
            try TokenFile(path: path).read()
        }
        do {
            _ = try TokenFile(path: path).read()
        } catch {
            #expect(error.description.contains("too open"))
            #expect(error.description.contains("chmod 600"))
            #expect(!error.description.contains(secret))
        }
    }

    @Test func rejectsEmptyMultiWordAndMissingFilesWithoutLeakingTheToken() throws {
        let cases: [(String, (String) -> TokenFileError)] = [
            ("  \n", { .empty(path: $0) }),
            (secret + " " + secret, { .invalidCharacters(path: $0) }),
            (secret + "\n" + secret, { .invalidCharacters(path: $0) }),
            (secret + "\u{7F}", { .invalidCharacters(path: $0) }),
        ]
        for (content, expected) in cases {
            let (directory, path) = try write(content, mode: 0o600)
            defer { try? FileManager.default.removeItem(at: directory) }
            do {
                _ = try TokenFile(path: path).read()
                Issue.record("accepted \(content.debugDescription)")
            } catch {
                #expect(error == expected(path))
                #expect(!error.description.contains(secret))
            }
        }
        #expect(throws: TokenFileError.unreadable(path: "/nonexistent/ferry-token", errno: ENOENT)) {
            try TokenFile(path: "/nonexistent/ferry-token").read()
        }
        #expect(throws: TokenFileError.notARegularFile(path: "/tmp")) { try TokenFile(path: "/tmp").read() }
    }

    @Test func rejectsOversizedFiles() throws {
        let (directory, path) = try write(String(repeating: "a", count: 5000), mode: 0o600)
        defer { try? FileManager.default.removeItem(at: directory) }
        #expect(throws: TokenFileError.tooLarge(path: path, bytes: 5000)) { try TokenFile(path: path).read() }
    }
}

@Suite struct GzipTests {
    /// Decompresses with Python's zlib (an independent inflater) and returns the bytes.
    func inflateWithPython(_ compressed: [UInt8]) throws -> [UInt8] {
        let directory = try TestSupport.temporaryDirectory()
        defer { try? FileManager.default.removeItem(at: directory) }
        let input = directory.appendingPathComponent("in.gz")
        let output = directory.appendingPathComponent("out")
        try Data(compressed).write(to: input)
        let (status, text) = try TestSupport.run(
            TestSupport.which("python3") ?? "/usr/bin/python3",
            [
                "-c", "import gzip,sys; open(sys.argv[2],'wb').write(gzip.decompress(open(sys.argv[1],'rb').read()))",
                input.path, output.path,
            ])
        guard status == 0 else { throw TestFailure("python could not inflate: \(text)") }
        return [UInt8](try Data(contentsOf: output))
    }

    @Test func roundTripsThroughAnIndependentInflater() throws {
        var random = SeededGenerator(state: 7)
        let samples: [[UInt8]] = [
            [],
            [0x41],
            Array("abcabcabcabcabcabcabcabc".utf8),
            [UInt8](repeating: 0, count: 100_000),
            (0..<70_000).map { _ in UInt8.random(in: 0...255, using: &random) },
            (0..<70_000).map { index in UInt8(truncatingIfNeeded: index % 251 ^ index / 7) },
            UplinkBodyEncoder.encode(UplinkBodyTests.sample),
        ]
        for sample in samples {
            #expect(try inflateWithPython(Gzip.compress(sample)) == sample, "length \(sample.count)")
            #expect(try inflateWithPython(Gzip.stored(sample)) == sample, "stored, length \(sample.count)")
        }
    }

    @Test func isDeterministicAndShrinksAFrameBatch() {
        let body = UplinkBodyEncoder.encode(FrameBatches.twentyFrames(batch: "b-1"))
        let compressed = Gzip.compress(body)
        #expect(compressed == Gzip.compress(body))
        #expect(compressed.count * 2 < body.count)
    }

    @Test func crc32CheckValue() {
        #expect(CRC32.checksum(Array("123456789".utf8)) == 0xCBF4_3926)
    }
}

/// Realistic batches: 20 frames of 20-byte payloads, as one FRAMES event (one ACK batch).
enum FrameBatches {
    static func twentyFrames(batch: String, firstSeq: UInt64 = 1, peripheral: String = "C0:FF:EE:00:00:01")
        -> UplinkBatchBody
    {
        let base: Int64 = 1_796_050_800_000
        let frames = (0..<20).map { index in
            let seq = firstSeq + UInt64(index)
            let payload = (0..<20).map { UInt8(truncatingIfNeeded: seq &* 31 &+ UInt64($0) &* 7) }
            return UplinkFrame(
                seq: seq, payload: payload,
                receivedAt: UplinkTimestamp(millisecondsSince1970: base + Int64(seq) * 13))
        }
        return UplinkBatchBody(
            gateway: "gw-bench", batch: batch,
            events: [UplinkEvent(id: "ev-\(batch)", peripheral: peripheral, epoch: 1234, content: .frames(frames))])
    }
}
