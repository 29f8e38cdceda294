import FerryCore
import FerryBlueZ
import FerryGateway
import FerrySync
import FerryProtocol
import FerryStore

#if canImport(Glibc)
    import Glibc
#endif

enum PairCommand {
    static let help = """
        Usage: ferry pair --address ADDR [--passkey N] --db PATH [--adapter hciN] [--timeout S] [--json]

        Pairs the gateway with a peripheral and records it as trusted, so `ferry run` syncs it (with the
        default require_bond policy, only bonded peripherals are ever synced). Steps: find and connect the
        peripheral, Device1.Pair with Ferry's pairing agent, mark it Trusted, check that it has the Sync
        service and that its STREAM_INFO reads over the encrypted link, then store it in the table
        trusted_peripherals under its identity address (the address BlueZ reports once bonded, also for
        peripherals that use resolvable private addresses).

        Options:
          --address ADDR   the peripheral, AA:BB:CC:DD:EE:FF (discovered first if BlueZ does not know it)
          --passkey N      a fixed 6-digit passkey (printed on the peripheral, or set in it): answers passkey
                           entry, and numeric comparison only if the number shown matches. Without it, and
                           with a terminal on stdin, ferry asks while pairing runs: it prompts for the passkey
                           the peripheral displays, or asks you to confirm the number of a numeric comparison.
                           Without either, only Just Works pairing (no protection against a man in the middle)
                           can succeed.
          --db PATH        the gateway store, e.g. /var/lib/ferry/ferry.sqlite (created if missing)
          --adapter hciN   the Bluetooth adapter (default: the first one)
          --timeout S      give up after S seconds (1-3600, default 90)
          --bus ADDRESS    D-Bus address of the bus bluetoothd is on (default: the system bus)
          --json           print {"address","identity_address","address_type","name","bonded","paired","method",
                           "duration_seconds"}; method: just-works | passkey | numeric-comparison | existing-bond
          --verbose        log the steps on stderr

        If BlueZ already holds a bond for the peripheral it is verified and recorded, not made anew: to pair
        again (the peripheral lost its keys), run `ferry unpair ADDR` first.

        Exit status: 0 paired and recorded; 1 failed (not found, authentication failed / wrong passkey, not a
        Sync peripheral, timeout; nothing is recorded); 2 usage error.
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "pair", options: ["--address", "--passkey", "--db", "--adapter", "--timeout", "--bus"],
            flags: ["--json", "--verbose"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let address = try FerryCommandLine.address(try args.required("--address", command: "pair"), option: "--address")
        let dbPath = try args.required("--db", command: "pair")
        let passkey: UInt32? = args.values["--passkey"] == nil
            ? nil : try args.integer("--passkey", UInt32.self, default: 0, range: 0...999_999)
        let timeout = try args.number("--timeout", default: 90, range: 1...3_600)
        let adapterName = args.values["--adapter"]
        let bus = args.values["--bus"]
        let log: any LogSink = StderrLogSink(minimum: args.flags.contains("--verbose") ? .info : .notice)
        try StoreOwnership.requireCallerOwns(dbPath, command: "pair")
        _ = try FerryCommandLine.openStore(dbPath, create: true)  // a bad store fails before the radio is touched
        let interactive = isatty(0) == 1
        let progress = ProgressLine.forStderr(json: args.flags.contains("--json"))
        defer { progress.clear() }

        let result = try AsyncBridge.run(cancelOnSignals: true) {
            try await withDeadline(seconds: timeout, what: "pairing with \(address)") {
                let client = try await BlueZAccess.client(bus: bus)
                let adapter = try await BlueZAccess.poweredAdapter(client, named: adapterName)
                let store = try FerryCommandLine.openStore(dbPath, create: true)
                var pairing = PeripheralPairing(client: client, adapter: adapter, log: log)
                if passkey == nil && interactive {
                    let prompt = TerminalPrompt.operatorPrompt(for: address)
                    // The question must not be drawn over the progress line.
                    pairing.operatorPrompt = .init(
                        enterPasskey: { progress.clear(); return await prompt.enterPasskey() },
                        confirmNumber: { progress.clear(); return await prompt.confirmNumber($0) })
                }
                pairing.progress = { step in
                    switch step {
                    case .connecting: progress.update("\(address): connecting", force: true)
                    case .pairing: progress.update("\(address): pairing (answer on the peripheral if it asks)", force: true)
                    case .verifying: progress.update("\(address): bonded; checking the Sync service over the encrypted link", force: true)
                    case .disconnecting: progress.update("\(address): disconnecting", force: true)
                    }
                }
                do {
                    return try await pairing.pair(address: address, passkey: passkey, store: store)
                } catch let error as PairingError {
                    throw CommandFailure("pairing failed: \(error)")
                }
            }
        }
        progress.clear()
        if args.flags.contains("--json") {
            output.out(
                JSON.object([
                    ("address", .string(address.string)), ("identity_address", .string(result.address.string)),
                    ("address_type", .string(result.addressType)), ("name", result.name.map { .string($0) } ?? .null),
                    ("bonded", .bool(result.bonded)), ("paired", .bool(true)), ("method", .string(result.method.rawValue)),
                    ("duration_seconds", .double((result.seconds * 1000).rounded() / 1000)),
                ]).text)
        } else {
            let identity = result.address == address ? "" : " (identity address \(result.address))"
            output.out(
                "paired \(address)\(identity): \(result.method.rawValue)"
                    + (result.bonded ? ", bonded" : ", NOT bonded (keys not stored: reconnects will pair again)")
                    + (result.name.map { ", name \($0)" } ?? "") + "; recorded as trusted")
            if result.method == .justWorks {
                output.err(
                    "ferry: note: Just Works pairing does not protect against a man in the middle during pairing; "
                        + "pair where no stranger's radio can interfere (Hardware/PAIRING.md)")
            }
        }
        return 0
    }
}

enum UnpairCommand {
    static let help = """
        Usage: ferry unpair ADDR --db PATH [--adapter hciN] [--bus ADDRESS]

        Forgets a peripheral: Adapter1.RemoveDevice (BlueZ drops its keys and disconnects it) and its row in
        trusted_peripherals. Its frames, cursors and outbox events stay (they are data already received, and
        the uplink still owes them to the backend). With the default require_bond policy `ferry run` stops
        syncing it; pairing it again is an explicit `ferry pair`.

        Exit status: 0 forgotten (also if BlueZ or the store did not know it; the output says which); 1 failed
        (bluetoothd unreachable: the store row is kept so the two stay in step); 2 usage error.
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(arguments, command: "unpair", options: ["--db", "--adapter", "--bus"], flags: [])
        guard args.positionals.count == 1 else {
            throw UsageError(args.positionals.isEmpty ? "missing ADDR (ferry unpair)" : "unpair takes one ADDR")
        }
        let address = try FerryCommandLine.address(args.positionals[0], option: "ADDR")
        let dbPath = try args.required("--db", command: "unpair")
        let adapterName = args.values["--adapter"]
        let bus = args.values["--bus"]
        try StoreOwnership.requireCallerOwns(dbPath, command: "unpair")
        let store = try FerryCommandLine.openStore(dbPath, create: false)
        let removedFromBlueZ = try AsyncBridge.run {
            let client = try await BlueZAccess.client(bus: bus)
            let adapter: BlueZAdapter
            do { adapter = try await client.adapter(named: adapterName) } catch {
                throw CommandFailure("adapter missing: \(error)")
            }
            guard let device = await client.knownDevice(address: address.string, on: adapter) else { return false }
            do {
                try await adapter.removeDevice(device.path)
            } catch let error as BlueZError where error.kind == .doesNotExist {
                return false
            } catch {
                throw CommandFailure("cannot remove \(address) from BlueZ: \(error)")
            }
            return true
        }
        let forgotten: Bool
        do { forgotten = try store.forget(address) } catch { throw CommandFailure("database \(dbPath): \(error)") }
        output.out(
            "unpaired \(address): "
                + (removedFromBlueZ ? "bond removed from BlueZ" : "BlueZ had no record of it") + ", "
                + (forgotten ? "removed from trusted peripherals" : "it was not a trusted peripheral")
                + "; its stored frames are kept")
        return 0
    }
}

enum PeripheralsCommand {
    static let help = """
        Usage: ferry peripherals --db PATH [--adapter hciN] [--bus ADDRESS] [--json]

        The trusted peripherals (paired with `ferry pair`): bond state as BlueZ sees it now, when the last
        session ended and how, the stream cursor, the head last seen in STREAM_INFO, and the backlog
        (head − cursor: events the peripheral held that are not yet stored here, as of the last session).
        Opens the store read-only: never migrates or writes it.

        bond: bonded (BlueZ holds keys) | missing (BlueZ has no key: the bond was lost or removed; `ferry run`
        will not sync it until it is paired again) | unknown (bluetoothd not reachable).

        --json prints {"peripherals":[{"address","name","address_type","pairing_method","paired_at","bond",
                       "last_sync_at","last_result","epoch","cursor","head","backlog"}]}
        (times as ISO 8601 UTC; epoch, cursor, head as decimal strings; null when unknown).
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "peripherals", options: ["--db", "--adapter", "--bus"], flags: ["--json"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let dbPath = try args.required("--db", command: "peripherals")
        let adapterName = args.values["--adapter"]
        let bus = args.values["--bus"]
        let store = try FerryCommandLine.openStore(dbPath, create: false, readOnly: true)
        struct Row {
            var trusted: TrustedPeripheral
            var state: PeripheralSyncState?
            var cursor: (epoch: UInt64, cursor: UInt64)?
        }
        let rows: [Row]
        do {
            rows = try store.trustedPeripherals().map {
                Row(trusted: $0, state: try store.syncState($0.address), cursor: try store.activeCursor($0.address))
            }
        } catch {
            throw CommandFailure("database \(dbPath): \(error)")
        }
        let addresses = rows.map(\.trusted.address.string)
        let bonds: [String: String] = (try? AsyncBridge.run {
            try await withDeadline(seconds: 10, what: "asking bluetoothd") {
                let client = try await BlueZAccess.client(bus: bus)
                let adapter = try await client.adapter(named: adapterName)
                var result: [String: String] = [:]
                for address in addresses {
                    let device = await client.knownDevice(address: address, on: adapter)
                    let bonded = await device?.isBonded() ?? false
                    result[address] = bonded ? "bonded" : "missing"
                }
                return result
            }
        }) ?? [:]

        func backlog(_ row: Row) -> UInt64? {
            guard let head = row.state?.head, let cursor = row.cursor?.cursor else { return nil }
            return head > cursor ? head - cursor : 0
        }
        if args.flags.contains("--json") {
            output.out(
                JSON.object([
                    (
                        "peripherals",
                        .array(
                            rows.map { row in
                                let a = row.trusted.address.string
                                return .object([
                                    ("address", .string(a)), ("name", row.trusted.name.map { .string($0) } ?? .null),
                                    ("address_type", .string(row.trusted.addressType)),
                                    ("pairing_method", .string(row.trusted.pairingMethod.rawValue)),
                                    ("paired_at", .string(Timestamp.iso8601(millis: row.trusted.pairedAt))),
                                    ("bond", .string(bonds[a] ?? "unknown")),
                                    ("last_sync_at", row.state.map { .string(Timestamp.iso8601(millis: $0.lastSyncAt)) } ?? .null),
                                    ("last_result", row.state.map { .string($0.lastResult) } ?? .null),
                                    ("epoch", row.cursor.map { .string(String($0.epoch)) } ?? .null),
                                    ("cursor", row.cursor.map { .string(String($0.cursor)) } ?? .null),
                                    ("head", row.state?.head.map { .string(String($0)) } ?? .null),
                                    ("backlog", backlog(row).map { .string(String($0)) } ?? .null),
                                ])
                            })
                    )
                ]).text)
            return 0
        }
        if rows.isEmpty {
            output.out("no trusted peripherals (pair one with: ferry pair --address ADDR --db \(dbPath))")
            return 0
        }
        output.out(
            pad("PERIPHERAL", 18) + pad("BOND", 9) + pad("METHOD", 19) + pad("LAST SYNC", 22) + pad("RESULT", 14)
                + pad("CURSOR", 12) + "BACKLOG")
        for row in rows {
            let a = row.trusted.address.string
            output.out(
                pad(a, 18) + pad(bonds[a] ?? "unknown", 9) + pad(row.trusted.pairingMethod.rawValue, 19)
                    + pad(row.state.map { Timestamp.iso8601(millis: $0.lastSyncAt) } ?? "never", 22)
                    + pad(row.state?.lastResult ?? "-", 14) + pad(row.cursor.map { String($0.cursor) } ?? "-", 12)
                    + (backlog(row).map(String.init) ?? "-") + (row.trusted.name.map { "  \($0)" } ?? ""))
        }
        if bonds.isEmpty { output.err("ferry: bluetoothd not reachable: bond state unknown") }
        return 0
    }
}
