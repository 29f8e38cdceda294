import FerryCore
import FerryBlueZ
import FerryGateway
import FerrySync

#if canImport(Glibc)
    import Glibc
#endif

enum ScanCommand {
    static let help = """
        Usage: ferry scan [--timeout S] [--json] [--adapter hciN] [--bus ADDRESS]

        Lists the Sync peripherals in range, so you can find the address to give `ferry pair` without
        bluetoothctl. Runs BlueZ discovery filtered by the Sync service UUID for S seconds (default 10), then
        prints each peripheral heard: address, address type (public, or random for a static/private address),
        signal strength (RSSI, dBm; stronger first; "-" if BlueZ gave none), advertised name, and whether BlueZ holds a pairing for it
        (paired / bonded / trusted). Peripherals BlueZ knows (paired earlier) but did not hear during the scan are not listed.
        It can run beside `ferry run` (BlueZ shares discovery between clients).

        Options:
          --timeout S      scan for S seconds (1-3600, default 10; peripherals advertising slowly need longer)
          --adapter hciN   the Bluetooth adapter (default: the first one)
          --bus ADDRESS    D-Bus address of the bus bluetoothd is on (default: the system bus)
          --json           print {"adapter","seconds","peripherals":[{"address","address_type","rssi","name",
                           "paired","bonded","trusted"}]}

        Exit status: 0 scanned (also when nothing was found: the output says so); 1 failed (bluetoothd
        unreachable, adapter missing or powered off, discovery refused); 2 usage error.
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "scan", options: ["--timeout", "--adapter", "--bus"], flags: ["--json"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let seconds = try args.number("--timeout", default: 10, range: 1...3_600)
        let adapterName = args.values["--adapter"]
        let bus = args.values["--bus"]
        let json = args.flags.contains("--json")
        let progress = ProgressLine.forStderr(json: json)
        defer { progress.clear() }

        let (adapter, found) = try AsyncBridge.run(cancelOnSignals: true) {
            // The scan itself is bounded by S, its final reads of bluetoothd's tree by 2 × 10 s; the deadline
            // covers a bluetoothd that stops answering.
            try await withDeadline(seconds: seconds + 60, what: "scanning") {
                progress.update("connecting to bluetoothd", force: true)
                let client = try await BlueZAccess.client(bus: bus)
                let adapter = try await BlueZAccess.poweredAdapter(client, named: adapterName)
                do {
                    let found = try await PeripheralScan.run(client: client, adapter: adapter, seconds: seconds) {
                        found, left in
                        progress.update("scanning on \(adapter.name): \(found) Sync peripherals, \(Int(left.rounded(.up))) s left")
                    }
                    return (adapter.name, found)
                } catch let error as BlueZError {
                    throw CommandFailure("cannot scan on \(adapter.name): \(error)")
                }
            }
        }
        progress.clear()
        if json {
            output.out(
                JSON.object([
                    ("adapter", .string(adapter)), ("seconds", .double(seconds)),
                    ("peripherals", .array(found.map { p in
                        JSON.object([
                            ("address", .string(p.address)), ("address_type", .string(p.addressType)),
                            ("rssi", p.rssi.map { .int($0) } ?? .null), ("name", p.name.map { .string($0) } ?? .null),
                            ("paired", .bool(p.paired)), ("bonded", .bool(p.bonded)), ("trusted", .bool(p.trusted)),
                        ])
                    })),
                ]).text)
            return 0
        }
        guard !found.isEmpty else {
            output.out(
                "no Sync peripheral heard on \(adapter) in \(formatSeconds(seconds)) s (is it advertising and in range? "
                    + "try a longer --timeout)")
            return 0
        }
        let rows = found.map { p in
            [p.address, p.addressType, p.rssi.map { "\($0)" } ?? "-", p.name ?? "-",
             p.bonded ? "bonded" : (p.paired ? "paired" : "no") + (p.trusted ? ", trusted" : "")]
        }
        let header = ["ADDRESS", "TYPE", "RSSI", "NAME", "PAIRED"]
        let widths = header.indices.map { column in ([header] + rows).map { $0[column].count }.max() ?? 0 }
        for row in [header] + rows {
            output.out(row.indices.map { $0 == row.count - 1 ? row[$0] : pad(row[$0], widths[$0] + 1) }.joined())
        }
        output.out("\(found.count) Sync peripherals on \(adapter) in \(formatSeconds(seconds)) s; pair one with: "
            + "sudo -u ferry ferry pair --address ADDR --db /var/lib/ferry/ferry.sqlite")
        return 0
    }

    private static func formatSeconds(_ s: Double) -> String {
        s == s.rounded() ? String(Int(s)) : String(s)
    }
}
