import FerryCore
import FerryProtocol
import FerryStore
import FerryUplink
import FoundationEssentials
import Glibc

enum ForwardCommand {
    static let help = """
        Usage: ferry forward --db PATH --endpoint URL [--token-file F] [--until-empty] [--json] [options]

        Drains the outbox of the store at PATH to the backend (POST, one request per claimed batch, with
        Idempotency-Key = batch id; see docs/UPLINK.md). 2xx → COMPLETED; 408/429/5xx/timeouts/connection
        errors → resent later under the same key. When two batches in a row fail that way the uplink is
        offline: one probe batch at a time after an exponential pause (with jitter), full speed again on the
        first success; an outage never uses up retries. Only a batch answered 5xx while other batches are
        accepted uses its retries (--max-retries), then becomes FAILED. Retry-After holds the whole uplink.
        401/403 → the uplink pauses and re-reads the token file (no retry is used up); other 4xx → FAILED
        (kept; 'ferry outbox retry' sends them again). Without --until-empty it runs until SIGINT/SIGTERM.

        Options:
          --db PATH             the gateway store
          --endpoint URL        https://… (http:// only for loopback tests)
          --token-file F        bearer token, one line; must not be readable by group/others (chmod 600)
          --gateway-id ID       the "gateway" field of every body (default: the host name)
          --until-empty         exit once no PENDING or IN_FLIGHT event remains (waits through backoff):
                                exit 0 if all delivered, 3 if some events are FAILED
          --max-in-flight N     batches on the wire at once (default 4)
          --batch-events N      outbox events per batch at most (default 50)
          --timeout S           per-request timeout in whole seconds (default 30)
          --max-retries N       retries of a batch answered 5xx while others are accepted, before it is
                                FAILED (default 12)
          --backoff-base-ms N   first backoff ceiling of a batch and of the offline pause (default 500)
          --backoff-max-ms N    longest backoff ceiling and offline pause (default 300000)
          --max-retry-after-ms N  a longer Retry-After from the backend is cut to this (default 3600000)
          --retention-hours H   delete delivered (COMPLETED) events and their frames H hours after delivery
                                (0-87600, default 72; 0 = at the next housekeeping, once a minute)
          --gzip MODE           never | auto (when the backend advertises Accept-Encoding: gzip) | always;
                                default auto; bodies under 1 KiB are never compressed
          --ca-file F           PEM CA certificates to verify the backend with instead of the system's bundle
          --client-cert F       client certificate (PEM) for a backend that wants mutual TLS; with --client-key
          --client-key F        the client certificate's private key (PEM)
          --json                print the run's report as one JSON object
          --verbose             log every retry and pause on stderr

        One forwarder per store: a second one (or `ferry forward` beside `ferry run` with an uplink) exits 1 with
        one line naming the first one's pid; batches in flight are only released once their forwarder is gone.

        Certificates are verified against the system's CA store, or --ca-file for a private backend CA: see
        docs/UPLINK.md §6.
        """

    static func run(_ arguments: [String], output: any CommandOutput) throws -> Int32 {
        let args = try ParsedArguments(
            arguments, command: "forward",
            options: [
                "--db", "--endpoint", "--token-file", "--gateway-id", "--max-in-flight",
                "--batch-events", "--timeout", "--max-retries", "--gzip", "--backoff-base-ms",
                "--backoff-max-ms", "--max-retry-after-ms", "--ca-file", "--client-cert", "--client-key",
                "--retention-hours",
            ],
            flags: ["--until-empty", "--json", "--verbose"])
        guard args.positionals.isEmpty else { throw UsageError("unexpected argument '\(args.positionals[0])'") }
        let dbPath = try args.required("--db", command: "forward")
        let endpointText = try args.required("--endpoint", command: "forward")
        guard let endpoint = URL(string: endpointText), endpoint.scheme != nil else {
            throw UsageError("--endpoint '\(endpointText)' is not a URL")
        }
        let maxInFlight = try args.integer("--max-in-flight", Int.self, default: 4, range: 1...64)
        let batchEvents = try args.integer("--batch-events", Int.self, default: 50, range: 1...10_000)
        let timeout = try args.integer("--timeout", Int.self, default: 30, range: 1...3600)
        let maxRetries = try args.integer("--max-retries", Int.self, default: 12, range: 0...1000)
        let retentionHours = try args.number("--retention-hours", default: 72, range: 0...87_600)  // 10 years, as in the config
        let backoffBase = try args.integer("--backoff-base-ms", Int.self, default: 500, range: 1...3_600_000)
        let backoffMax = try args.integer("--backoff-max-ms", Int.self, default: 300_000, range: 1...86_400_000)
        let maxRetryAfter = try args.integer("--max-retry-after-ms", Int.self, default: 3_600_000, range: 0...86_400_000)
        let compression: UplinkCompression
        switch args.values["--gzip"] ?? "auto" {
        case "never": compression = .never
        case "auto": compression = .whenAdvertised(minimumBytes: 1024)
        case "always": compression = .always(minimumBytes: 1024)
        case let other: throw UsageError("--gzip must be never, auto or always, got '\(other)'")
        }
        let tokenFile = args.values["--token-file"].map { TokenFile(path: $0) }
        if let tokenFile {
            // Fail fast on a bad file at start-up; later re-reads (after a 401) report in the log instead.
            do { _ = try tokenFile.read() } catch { throw CommandFailure(error.description) }
        }
        // Check the store exists and is ours before any network traffic.
        let store = try FerryCommandLine.openStore(dbPath, create: false)
        let untilEmpty = args.flags.contains("--until-empty")

        var configuration = ForwarderConfiguration(gatewayID: args.values["--gateway-id"] ?? ProcessInfo.processInfo.hostName)
        configuration.maxInFlight = maxInFlight
        configuration.limits.maxEvents = batchEvents
        configuration.policy.maxRetries = maxRetries
        configuration.retentionSeconds = retentionHours * 3600
        configuration.leaseSeconds = max(120, 4 * Double(timeout))
        configuration.policy.baseDelaySeconds = Double(backoffBase) / 1000
        configuration.policy.maxDelaySeconds = Double(max(backoffBase, backoffMax)) / 1000
        configuration.policy.maxRetryAfterSeconds = Double(maxRetryAfter) / 1000
        // --until-empty at a terminal: "forwarding n of m events" (m: undelivered when it started).
        let progress = ProgressLine.forStderr(json: args.flags.contains("--json") || !untilEmpty)
        defer { progress.clear() }
        if untilEmpty, let total = try? store.undeliveredCount() {
            configuration.onProgress = { report in
                progress.update("forwarding \(report.eventsDelivered) of \(total) events (\(report.framesDelivered) frames)")
            }
        }
        let poster: UplinkHTTPPoster
        guard (args.values["--client-cert"] == nil) == (args.values["--client-key"] == nil) else {
            throw UsageError("--client-cert and --client-key go together")
        }
        do {
            var http = UplinkHTTPConfiguration(
                endpoint: endpoint, requestTimeoutSeconds: timeout, compression: compression,
                maximumConnections: maxInFlight)
            http.caFile = args.values["--ca-file"]
            http.clientCertificateFile = args.values["--client-cert"]
            http.clientKeyFile = args.values["--client-key"]
            poster = try UplinkHTTPPoster(configuration: http)
        } catch {
            throw UsageError(error.description)
        }
        // Under systemd the same journald priorities as `ferry run` (a 401 pause shows as a warning there).
        let log: any LogSink = DaemonLogSink.forEnvironment(minimum: args.flags.contains("--verbose") ? .info : .warning)
        let forwarder: OutboxForwarder
        do {
            forwarder = try OutboxForwarder(
                databasePath: dbPath, poster: poster, configuration: configuration,
                tokenSource: { try tokenFile?.read() }, log: log)
        } catch {
            throw CommandFailure("database \(dbPath): \(error)")
        }
        let clock = SystemMonotonicClock()
        let started = clock.now()
        let report: ForwardReport
        do {
            report = try AsyncBridge.run(cancelOnSignals: true) { try await forwarder.run(untilEmpty: untilEmpty) }
        } catch let error as ForwarderError {
            throw CommandFailure("database \(dbPath): \(error)")
        }
        let seconds = clock.seconds(since: started)
        progress.clear()
        if args.flags.contains("--json") {
            output.out(
                JSON.object([
                    ("batches", .int(report.batchesDelivered)), ("events", .int(report.eventsDelivered)),
                    ("frames", .int(report.framesDelivered)), ("attempts", .int(report.attempts)),
                    ("retries", .int(report.retries)), ("pauses", .int(report.pauses)),
                    ("offline_periods", .int(report.offlinePeriods)),
                    ("failed", .int(report.eventsFailed)), ("bytes_sent", .int(report.bytesSent)),
                    ("failed_in_store", .int(report.failedInStore)), ("pending", .int(report.pendingInStore)),
                    ("seconds", .double((seconds * 1000).rounded() / 1000)),
                ]).text)
        } else {
            output.out(
                "forwarded \(report.framesDelivered) frames in \(report.eventsDelivered) events / "
                    + "\(report.batchesDelivered) batches (\(report.attempts) requests, \(report.retries) retries, "
                    + "\(report.pauses) pauses, \(report.bytesSent) bytes) in \(cFormat("%.1f", seconds)) s; "
                    + "\(report.pendingInStore) undelivered, \(report.failedInStore) FAILED in the store")
        }
        if untilEmpty && report.failedInStore > 0 { return 3 }
        return 0
    }
}

/// One line per message on stderr: "ferry[level]: message". journald adds its own timestamps.
struct StderrLogSink: LogSink {
    let minimum: LogLevel
    func log(_ level: LogLevel, _ message: String) {
        guard level >= minimum else { return }
        ProgressLine.eraseForLogLine()
        StandardOutput.writeAll(2, "ferry[\(level)]: \(message)\n")
    }
}
