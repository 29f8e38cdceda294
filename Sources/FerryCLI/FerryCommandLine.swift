import FerryCore
import FerryProtocol
import FerryStore

#if canImport(Glibc)
    import Glibc
#endif

/// A failure at run time (bad input file, database problem): printed as one line, exit status 1.
struct CommandFailure: Error, CustomStringConvertible {
    var description: String
    var exitCode: Int32 = 1
    init(_ description: String, exitCode: Int32 = 1) {
        self.description = description
        self.exitCode = exitCode
    }
}

public enum FerryCommandLine {
    public static var version: String { FerryVersion.string }

    /// Every subcommand: its name, the line `ferry --help` shows, its own help text and its entry point.
    struct Subcommand: Sendable {
        let name: String
        let summary: String
        let help: String
        let run: @Sendable ([String], any CommandOutput) throws -> Int32
    }

    static let subcommands: [Subcommand] = [
        Subcommand(
            name: "run", summary: "The gateway daemon: keep allowed peripherals synced, forward the outbox (--config FILE)",
            help: RunCommand.help, run: RunCommand.run),
        Subcommand(
            name: "sync", summary: "One sync with one peripheral over BlueZ, until it is caught up",
            help: SyncCommand.help, run: SyncCommand.run),
        Subcommand(
            name: "scan", summary: "List the Sync peripherals in range: address, type, RSSI, name, paired or not",
            help: ScanCommand.help, run: ScanCommand.run),
        Subcommand(
            name: "pair", summary: "Pair with a peripheral (bond, Trusted, Sync service checked) and trust it",
            help: PairCommand.help, run: PairCommand.run),
        Subcommand(
            name: "unpair", summary: "Forget a peripheral: remove its bond and its trust (its stored data stays)",
            help: UnpairCommand.help, run: UnpairCommand.run),
        Subcommand(
            name: "peripherals", summary: "Trusted peripherals: bond state, last sync, cursor, backlog",
            help: PeripheralsCommand.help, run: PeripheralsCommand.run),
        Subcommand(
            name: "ingest", summary: "Feed a captured DATA byte stream into the store (same decoder and rules as a live sync)",
            help: IngestCommand.help, run: IngestCommand.run),
        Subcommand(
            name: "status", summary: "Streams, cursors and outbox counts of a store",
            help: StatusCommand.help, run: StatusCommand.run),
        Subcommand(
            name: "forward", summary: "Drain the outbox to the backend over HTTP(S)",
            help: ForwardCommand.help, run: ForwardCommand.run),
        Subcommand(
            name: "outbox", summary: "List outbox events; send FAILED ones again",
            help: OutboxCommand.help, run: OutboxCommand.run),
        Subcommand(
            name: "demo", summary: "The core engine with no radio: a noisy capture ingested twice, then the status",
            help: DemoCommand.help, run: DemoCommand.run),
    ]

    static var usage: String {
        let width = subcommands.map(\.name.count).max() ?? 0
        let lines = subcommands.map { "  " + $0.name + String(repeating: " ", count: width - $0.name.count + 3) + $0.summary }
        return """
            ferry \(version) — BLE Sync gateway for Linux/BlueZ

            Usage: ferry <command> [options]

            Commands:
            \(lines.joined(separator: "\n"))

            Run 'ferry <command> --help' for the options of a command.
            Exit status: 0 success, 1 failure (message on stderr), 2 usage error, 3 (forward --until-empty) some events FAILED.
            """
    }

    /// Entry point of the `ferry` binary.
    public static func main(arguments: [String]) -> Int32 {
        run(arguments: arguments, output: StandardOutput())
    }

    /// Runs one command in-process (tests call this directly).
    public static func run(arguments: [String], output: any CommandOutput) -> Int32 {
        guard let command = arguments.first else {
            output.err(usage)
            return 2
        }
        let rest = Array(arguments.dropFirst())
        let wantsHelp = rest.contains("--help") || rest.contains("-h")
        do {
            switch command {
            case "--help", "-h", "help":
                output.out(usage)
                return 0
            case "--version", "version":
                output.out("ferry \(version)")
                return 0
            default:
                guard let subcommand = subcommands.first(where: { $0.name == command }) else {
                    throw UsageError("unknown command '\(command)'; see 'ferry --help'")
                }
                if wantsHelp {
                    output.out(subcommand.help)
                    return 0
                }
                return try subcommand.run(rest, output)
            }
        } catch let error as UsageError {
            output.err("ferry: \(error.description)")
            return 2
        } catch let error as CommandFailure {
            output.err("ferry: \(error.description)")
            return error.exitCode
        } catch {
            output.err("ferry: \(error)")
            return 1
        }
    }

    static func address(_ text: String, option: String) throws -> PeripheralAddress {
        guard let address = PeripheralAddress(text) else {
            throw UsageError("\(option) '\(text)' is not a Bluetooth address (expected AA:BB:CC:DD:EE:FF)")
        }
        return address
    }

    /// Opens the store with errors that name the file and the problem. `readOnly`: the commands that only look
    /// (status, peripherals, outbox list) never migrate or write a store, so they work next to a running daemon
    /// and on a copy without changing it.
    static func openStore(_ path: String, create: Bool, readOnly: Bool = false) throws -> GatewayStore {
        if !create || readOnly {
            var info = stat()
            guard stat(path, &info) == 0 else { throw CommandFailure("no database at \(path)") }
            // An empty file would otherwise be turned into a fresh store by a read-only command.
            guard info.st_size > 0 else { throw CommandFailure("\(path) is empty, not a Ferry database") }
        }
        do {
            return readOnly ? try GatewayStore.openReadOnly(path: path) : try GatewayStore(path: path, create: create)
        } catch let error as StoreError {
            if case .needsMigration = error { throw CommandFailure(error.description) }
            if case .sqlite(let e) = error, e.resultCode == .cantopen {
                throw CommandFailure("cannot open database \(path): \(errnoDescription(errno))")
            }
            throw CommandFailure("database \(path): \(error)")
        }
    }
}
