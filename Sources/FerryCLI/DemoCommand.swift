import FerryCore
import FerryProtocol
import FerrySimulator
import FerryStore

#if canImport(Glibc)
    import Glibc
#endif

/// The README's first command until the gateway daemon exists: shows the core engine end to end without a
/// radio. It writes a capture the way a flaky link would deliver it (noise, damaged frames, repeats, a lost
/// range), ingests it, ingests it again (everything is a duplicate), and prints the status.
enum DemoCommand {
    static let help = """
        Usage: ferry demo [--dir DIR] [--events N] [--seed S]

        Writes DIR/capture.bin (N DATA frames with noise, bit flips, repeats and one lost range), then runs
        'ferry ingest' on it twice into DIR/ferry.sqlite and 'ferry status'. DIR defaults to ./ferry-demo.
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(arguments, command: "demo", options: ["--dir", "--events", "--seed"], flags: [])
        let dir = args.values["--dir"] ?? "ferry-demo"
        let events = try args.integer("--events", Int.self, default: 5000, range: 1...10_000_000)
        let seed = try args.integer("--seed", UInt64.self, default: 42)
        if mkdir(dir, 0o700) != 0 && errno != EEXIST {
            throw CommandFailure("cannot create \(dir): \(errnoDescription(errno))")
        }
        let capturePath = dir + "/capture.bin"
        let dbPath = dir + "/ferry.sqlite"
        unlink(dbPath)
        unlink(dbPath + "-wal")
        unlink(dbPath + "-shm")

        var rng = SeededGenerator(seed: seed)  // the same capture on every machine
        let lost = (events / 2)...(events / 2 + 9)  // the peripheral lost these before we got them
        var capture: [UInt8] = []
        var damaged = 0
        var repeated = 0
        for seq in 1...UInt64(events) where !lost.contains(Int(seq)) {
            let payload = (0..<20).map { _ in UInt8.random(in: 0...255, using: &rng) }
            var bytes = Frame.data(seq: seq, payload: payload).encoded()
            let roll = rng.next() % 1000
            if roll < 5 {
                // A flipped bit: the frame is dropped by the CRC and the stream resynchronises after it.
                bytes[Int(rng.next() % UInt64(bytes.count))] ^= 1 << UInt8(rng.next() % 8)
                damaged += 1
            } else if roll < 10 {
                capture += bytes  // sent twice (the peripheral did not see our ACK)
                repeated += 1
            } else if roll < 15 {
                capture += (0..<Int(rng.next() % 7 + 1)).map { _ in UInt8.random(in: 0...255, using: &rng) }
            }
            capture += bytes
        }
        if let code = writeFile(capturePath, capture, mode: 0o600) {
            throw CommandFailure("cannot write \(capturePath): \(errnoDescription(code))")
        }

        output.out(
            "capture: \(capturePath), \(capture.count) bytes, events 1...\(events) with \(lost.count) lost "
                + "(\(lost.lowerBound)...\(lost.upperBound)), \(damaged) damaged frames, \(repeated) repeats")
        output.out("$ ferry ingest --db \(dbPath) --peripheral C0:FF:EE:00:00:01 \(capturePath)")
        var rc = try IngestCommand.run(
            ["--db", dbPath, "--peripheral", "C0:FF:EE:00:00:01", capturePath], output: output)
        guard rc == 0 else { return rc }
        output.out("$ ferry ingest ... again (every frame is now a duplicate)")
        rc = try IngestCommand.run(["--db", dbPath, "--peripheral", "C0:FF:EE:00:00:01", capturePath], output: output)
        guard rc == 0 else { return rc }
        output.out("$ ferry status --db \(dbPath)")
        return try StatusCommand.run(["--db", dbPath], output: output)
    }
}
