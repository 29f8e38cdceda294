import FerryCore
import FoundationEssentials
import Glibc

// What one POST of a batch came to, classified exactly as PROTOCOL.md §6 says.
// Pure: no I/O, so every status and transport failure is testable without a server.

/// Why a batch will be sent again.
public enum UplinkRetryReason: Sendable, Hashable, CustomStringConvertible {
    /// 408, 429 or 5xx.
    case status(Int)
    /// No complete response within the request timeout.
    case timeout
    /// Refused, reset, closed without a response (a response lost after the commit
    /// looks exactly like this), DNS failure, TLS handshake failure other than trust.
    case connection(String)

    public var description: String {
        switch self {
        case .status(let code): return "HTTP \(code)"
        case .timeout: return "timeout"
        case .connection(let detail): return "connection error: \(detail)"
        }
    }
}

/// Why the uplink stops sending until an operator (or a re-read file) fixes it.
/// A pause never burns a retry and never makes an event FAILED.
public enum UplinkPauseReason: Sendable, Hashable, CustomStringConvertible {
    /// 401 or 403: re-read the token file before the next attempt.
    case unauthorized(status: Int)
    /// The server's certificate did not verify (unknown CA, wrong name, expired).
    /// Not in §6; paused rather than retried because no retry can fix it and
    /// exhausting retries would dead-letter healthy events over a configuration error.
    case untrustedCertificate(String)
    /// 3xx: the endpoint moved. Redirects are not followed (a POST body must not be
    /// replayed to a place nobody configured); the operator fixes the URL.
    case redirect(status: Int, location: String?)

    public var description: String {
        switch self {
        case .unauthorized(let status): return "HTTP \(status): credentials rejected"
        case .untrustedCertificate(let detail): return "server certificate not trusted: \(detail)"
        case .redirect(let status, let location): return "HTTP \(status) redirect to \(location ?? "?") not followed"
        }
    }
}

/// The classified result of one attempt.
public enum UplinkOutcome: Sendable, Hashable, CustomStringConvertible {
    /// 2xx: the batch's events become COMPLETED.
    case completed(status: Int)
    /// Send the identical body again after a backoff. `retryAfter` is the server's
    /// `Retry-After` in seconds when it sent one.
    case retry(UplinkRetryReason, retryAfterSeconds: Double?)
    /// Stop the uplink; see `UplinkPauseReason`.
    case pause(UplinkPauseReason)
    /// Other 4xx: the batch's events become FAILED (dead letter, kept for audit and manual retry).
    case failed(status: Int, detail: String)

    public var description: String {
        switch self {
        case .completed(let status): return "completed (HTTP \(status))"
        case .retry(let reason, let after):
            return "retry: \(reason)" + (after.map { ", Retry-After \($0) s" } ?? "")
        case .pause(let reason): return "paused: \(reason)"
        case .failed(let status, let detail): return "failed: HTTP \(status) \(detail)"
        }
    }
}

public enum UplinkResponseClassifier {
    /// Classifies an HTTP status. `retryAfter` is the raw `Retry-After` header;
    /// `nowSecondsSince1970` resolves its HTTP-date form.
    public static func classify(
        status: Int, retryAfter: String?, location: String? = nil, detail: String = "",
        nowSecondsSince1970: Double
    ) -> UplinkOutcome {
        switch status {
        case 200..<300:
            return .completed(status: status)
        case 401, 403:
            return .pause(.unauthorized(status: status))
        case 408, 429, 500..<600:
            let after = retryAfter.flatMap { RetryAfter.seconds(from: $0, nowSecondsSince1970: nowSecondsSince1970) }
            return .retry(.status(status), retryAfterSeconds: after)
        case 300..<400:
            return .pause(.redirect(status: status, location: location))
        case 400..<500:
            return .failed(status: status, detail: detail)
        default:
            // 1xx as a final status or a number outside 100-599: the server is broken,
            // not the batch. Retrying lets a fixed server take it; exhaustion still ends in FAILED.
            return .retry(.status(status), retryAfterSeconds: nil)
        }
    }
}

/// `Retry-After` (RFC 9110 §10.2.3): delay-seconds or an HTTP-date.
public enum RetryAfter {
    /// Seconds to wait from now, never negative; nil when the value parses as neither form.
    public static func seconds(from header: String, nowSecondsSince1970: Double) -> Double? {
        let value = header.trimmingWhitespace()
        if !value.isEmpty, value.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) {
            // Huge digit strings saturate instead of failing: the policy caps the wait anyway.
            return Double(value) ?? Double.greatestFiniteMagnitude
        }
        guard let date = HTTPDate.secondsSince1970(value) else { return nil }
        return max(0, Double(date) - nowSecondsSince1970)
    }
}

/// Parses the three HTTP-date forms RFC 9110 §5.6.7 requires recipients to accept.
public enum HTTPDate {
    private static let months = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]

    public static func secondsSince1970(_ text: String) -> Int64? {
        let parts = text.split(separator: " ", omittingEmptySubsequences: true).map(String.init)
        // IMF-fixdate: Sun, 06 Nov 1994 08:49:37 GMT
        if parts.count == 6, parts[0].hasSuffix(","), parts[5] == "GMT",
            let day = Int(parts[1]), let month = month(parts[2]), let year = Int64(parts[3]), parts[3].count == 4
        {
            return assemble(year: year, month: month, day: day, time: parts[4])
        }
        // RFC 850: Sunday, 06-Nov-94 08:49:37 GMT (two-digit years: RFC 9110 says pick the
        // year that is not more than 50 years in the future; for a gateway clock, 19xx vs 20xx
        // by < 70 is good enough until 2070).
        if parts.count == 4, parts[0].hasSuffix(","), parts[3] == "GMT" {
            let dateParts = parts[1].split(separator: "-").map(String.init)
            if dateParts.count == 3, let day = Int(dateParts[0]), let month = month(dateParts[1]),
                let shortYear = Int64(dateParts[2]), dateParts[2].count == 2
            {
                let year = shortYear < 70 ? 2000 + shortYear : 1900 + shortYear
                return assemble(year: year, month: month, day: day, time: parts[2])
            }
        }
        // asctime: Sun Nov  6 08:49:37 1994. Four digits, like the other forms: a year of 999999999999 would
        // overflow the day arithmetic (it trapped: SIGILL from one response header).
        if parts.count == 5, let month = month(parts[1]), let day = Int(parts[2]), parts[4].count == 4,
            let year = Int64(parts[4])
        {
            return assemble(year: year, month: month, day: day, time: parts[3])
        }
        return nil
    }

    private static func month(_ name: String) -> Int? {
        months.firstIndex(of: name.lowercased()).map { $0 + 1 }
    }

    private static func assemble(year: Int64, month: Int, day: Int, time: String) -> Int64? {
        // Every caller passes at most four digits (a sign included); checked again here because the calendar
        // arithmetic below is only overflow-free for small years.
        guard (-9999...9999).contains(year) else { return nil }
        let clock = time.split(separator: ":").map { Int64($0) }
        guard clock.count == 3, let hour = clock[0], let minute = clock[1], let second = clock[2],
            (1...31).contains(day), (0...23).contains(hour), (0...59).contains(minute), (0...60).contains(second)
        else { return nil }
        let days = CivilTime.days(fromCivil: year, month: month, day: day)
        return days * 86_400 + hour * 3600 + minute * 60 + second
    }
}
