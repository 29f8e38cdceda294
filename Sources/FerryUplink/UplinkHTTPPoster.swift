// POSTs one batch body over FoundationNetworking's URLSession (libcurl underneath)
// and classifies the result. No retry loop here: the forwarder owns the schedule
// (retry_count and next_retry_at live in the store so they survive a restart).

import Foundation
import Synchronization

#if canImport(FoundationNetworking)
    import FoundationNetworking
#endif

public enum FerryUplinkVersion {
    public static let string = "0.1.0"
}

/// When request bodies are gzip-compressed.
public enum UplinkCompression: Sendable, Hashable {
    /// Never compress.
    case never
    /// Compress bodies of at least `minimumBytes` from the first request on. Only for a
    /// backend known to accept `Content-Encoding: gzip`.
    case always(minimumBytes: Int)
    /// Compress bodies of at least `minimumBytes` once a response from the backend has
    /// carried `Accept-Encoding` listing gzip (RFC 7694); the reference backend sends it
    /// with every response. A backend that never advertises it never gets gzip.
    case whenAdvertised(minimumBytes: Int)
}

public struct UplinkHTTPConfiguration: Sendable {
    public var endpoint: URL
    /// Whole seconds, at least 1: libcurl's timer in swift-corelibs-foundation truncates
    /// `timeoutIntervalForRequest` to whole seconds (0.5 would become 0 = no timeout).
    public var requestTimeoutSeconds: Int
    public var userAgent: String
    public var compression: UplinkCompression
    /// Connections kept open to the backend (libcurl's pool); enough for a few requests in flight.
    public var maximumConnections: Int
    /// Plain `http://` is accepted for loopback hosts only unless this is set: the token and the
    /// frames would otherwise cross the network readable by anyone on the path.
    public var allowPlainHTTP: Bool
    /// Response body bytes kept; the rest is dropped unread (the connection is closed): a broken or hostile
    /// backend must not exhaust a Pi's memory. Only the first 512 bytes are ever used.
    public var maximumResponseBytes = 4096

    public init(
        endpoint: URL, requestTimeoutSeconds: Int = 30, userAgent: String = "ferry/" + FerryUplinkVersion.string,
        compression: UplinkCompression = .whenAdvertised(minimumBytes: 1024), maximumConnections: Int = 4,
        allowPlainHTTP: Bool = false
    ) {
        self.endpoint = endpoint
        self.requestTimeoutSeconds = requestTimeoutSeconds
        self.userAgent = userAgent
        self.compression = compression
        self.maximumConnections = maximumConnections
        self.allowPlainHTTP = allowPlainHTTP
    }
}

public enum UplinkHTTPError: Error, Sendable, Hashable, CustomStringConvertible {
    case invalidEndpoint(String)
    case invalidTimeout(Int)

    public var description: String {
        switch self {
        case .invalidEndpoint(let reason): return "uplink endpoint: \(reason)"
        case .invalidTimeout(let seconds): return "uplink request timeout \(seconds) s: must be at least 1 s"
        }
    }
}

/// One attempt, as seen on the wire.
public struct UplinkAttempt: Sendable, Hashable {
    public var outcome: UplinkOutcome
    /// The HTTP status when a response arrived.
    public var status: Int?
    /// Body bytes actually sent (after compression).
    public var sentBodyBytes: Int
    public var compressed: Bool
    public var elapsedSeconds: Double
    /// The first 512 bytes of the response body as text, for `last_error` and logs.
    public var responseSnippet: String
}

/// Sends batch bodies. One instance = one URLSession = one pool of kept-alive
/// connections; share it. Safe to call `post` from several tasks at once.
public final class UplinkHTTPPoster: Sendable {
    public let configuration: UplinkHTTPConfiguration
    private let session: URLSession
    private let collector: ResponseCollector
    private let gzipAdvertised = Mutex(false)
    private let wallClock: @Sendable () -> Double

    /// `wallClock`: seconds since 1970, used only to resolve an HTTP-date `Retry-After`.
    public init(
        configuration: UplinkHTTPConfiguration,
        wallClock: @escaping @Sendable () -> Double = { Date().timeIntervalSince1970 }
    ) throws(UplinkHTTPError) {
        guard let scheme = configuration.endpoint.scheme?.lowercased(), scheme == "https" || scheme == "http" else {
            throw .invalidEndpoint("scheme must be https or http")
        }
        guard let host = configuration.endpoint.host, !host.isEmpty else {
            throw .invalidEndpoint("no host")
        }
        guard scheme == "https" || UplinkEndpoint.isLoopback(host: host) || configuration.allowPlainHTTP else {
            throw .invalidEndpoint("plain http to \(host) would send the token and frames unencrypted; use https")
        }
        guard configuration.endpoint.user == nil, configuration.endpoint.password == nil else {
            // Credentials in the URL would end up in logs; the token file is the place for them.
            throw .invalidEndpoint("credentials in the URL are not allowed; use a token file")
        }
        guard configuration.requestTimeoutSeconds >= 1 else {
            throw .invalidTimeout(configuration.requestTimeoutSeconds)
        }
        self.configuration = configuration
        self.wallClock = wallClock
        let sessionConfiguration = URLSessionConfiguration.ephemeral
        // URLRequest.timeoutInterval is ignored on Linux; the session's value is what libcurl gets.
        sessionConfiguration.timeoutIntervalForRequest = TimeInterval(configuration.requestTimeoutSeconds)
        sessionConfiguration.timeoutIntervalForResource = TimeInterval(configuration.requestTimeoutSeconds)
        sessionConfiguration.httpMaximumConnectionsPerHost = configuration.maximumConnections
        sessionConfiguration.requestCachePolicy = .reloadIgnoringLocalAndRemoteCacheData
        sessionConfiguration.urlCache = nil
        sessionConfiguration.httpCookieStorage = nil
        sessionConfiguration.httpShouldSetCookies = false
        collector = ResponseCollector(cap: configuration.maximumResponseBytes)
        session = URLSession(configuration: sessionConfiguration, delegate: collector, delegateQueue: nil)
    }

    deinit {
        session.finishTasksAndInvalidate()
    }

    /// Whether the next large body would be gzipped.
    public var compressesLargeBodies: Bool {
        switch configuration.compression {
        case .never: return false
        case .always: return true
        case .whenAdvertised: return gzipAdvertised.withLock { $0 }
        }
    }

    /// POSTs `body` (the exact bytes from `UplinkBodyEncoder`) with `Idempotency-Key: idempotencyKey`.
    /// Never throws: every failure is an `UplinkOutcome`.
    public func post(body: [UInt8], idempotencyKey: String, token: BearerToken?) async -> UplinkAttempt {
        let started = ContinuousClock.now
        var compress = false
        switch configuration.compression {
        case .never: break
        case .always(let minimum): compress = body.count >= minimum
        case .whenAdvertised(let minimum): compress = body.count >= minimum && gzipAdvertised.withLock { $0 }
        }
        var attempt = await send(body: body, compress: compress, idempotencyKey: idempotencyKey, token: token)
        if compress, attempt.status == 415 {
            // The backend stopped accepting gzip (or never did, with `.always`): forget the
            // advertisement and resend plainly right away. The hash a backend keeps for the
            // key covers the decoded body, so this is the same request, not a new one.
            gzipAdvertised.withLock { $0 = false }
            attempt = await send(body: body, compress: false, idempotencyKey: idempotencyKey, token: token)
        }
        let elapsed = ContinuousClock.now - started
        attempt.elapsedSeconds =
            Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
        return attempt
    }

    private func send(body: [UInt8], compress: Bool, idempotencyKey: String, token: BearerToken?) async -> UplinkAttempt {
        var request = URLRequest(url: configuration.endpoint)
        request.httpMethod = "POST"
        let wireBody = compress ? Gzip.compress(body) : body
        request.httpBody = Data(wireBody)
        request.setValue("application/json", forHTTPHeaderField: "Content-Type")
        request.setValue("application/json", forHTTPHeaderField: "Accept")
        request.setValue(idempotencyKey, forHTTPHeaderField: "Idempotency-Key")
        request.setValue(configuration.userAgent, forHTTPHeaderField: "User-Agent")
        if compress { request.setValue("gzip", forHTTPHeaderField: "Content-Encoding") }
        if let token { request.setValue(token.authorizationHeaderValue, forHTTPHeaderField: "Authorization") }

        let collected = await withCheckedContinuation { (continuation: CheckedContinuation<Collected, Never>) in
            let task = session.dataTask(with: request)
            collector.register(task, continuation)
            task.resume()
        }
        let (data, response, error) = (collected.body, collected.response, collected.error)
        var attempt = UplinkAttempt(
            outcome: .retry(.connection("no response"), retryAfterSeconds: nil), status: nil,
            sentBodyBytes: wireBody.count, compressed: compress, elapsedSeconds: 0, responseSnippet: "")
        if let http = response as? HTTPURLResponse, error == nil {
            if let accepted = http.value(forHTTPHeaderField: "Accept-Encoding") {
                let advertised = accepted.lowercased().split(separator: ",").contains {
                    $0.split(separator: ";").first?.trimmingCharacters(in: .whitespaces) == "gzip"
                }
                gzipAdvertised.withLock { $0 = advertised }
            }
            let snippet = String(decoding: data.prefix(512), as: UTF8.self)
            attempt.status = http.statusCode
            attempt.responseSnippet = snippet
            attempt.outcome = UplinkResponseClassifier.classify(
                status: http.statusCode, retryAfter: http.value(forHTTPHeaderField: "Retry-After"),
                location: http.value(forHTTPHeaderField: "Location"), detail: snippet,
                nowSecondsSince1970: wallClock())
        } else {
            attempt.outcome = UplinkTransportErrors.classify(error)
        }
        return attempt
    }
}

/// Maps URLSession/libcurl failures to outcomes.
enum UplinkTransportErrors {
    static func classify(_ error: (any Error)?) -> UplinkOutcome {
        guard let error else { return .retry(.connection("no response"), retryAfterSeconds: nil) }
        let nsError = error as NSError
        let detail = describe(nsError)
        if nsError.domain == NSURLErrorDomain {
            switch nsError.code {
            case NSURLErrorTimedOut:
                return .retry(.timeout, retryAfterSeconds: nil)
            case NSURLErrorServerCertificateUntrusted, NSURLErrorServerCertificateHasBadDate,
                NSURLErrorServerCertificateHasUnknownRoot, NSURLErrorServerCertificateNotYetValid:
                return .pause(.untrustedCertificate(detail))
            default:
                break
            }
        }
        // swift-corelibs-foundation maps most libcurl codes, certificate failures included,
        // to NSURLErrorUnknown and keeps libcurl's message in the underlying error
        // ("SSL certificate problem: self-signed certificate", "SSL: no alternative
        // certificate subject name matches target host name ...").
        let lowered = detail.lowercased()
        if lowered.contains("ssl certificate problem") || lowered.contains("certificate subject name")
            || lowered.contains("ssl peer certificate")
        {
            return .pause(.untrustedCertificate(detail))
        }
        return .retry(.connection(detail), retryAfterSeconds: nil)
    }

    /// The most specific message available, without the URL (it is in the configuration already).
    static func describe(_ error: NSError) -> String {
        if let underlying = error.userInfo[NSUnderlyingErrorKey] as? NSError,
            let message = underlying.userInfo[NSLocalizedDescriptionKey] as? String
        {
            return "\(message) (code \(error.code))"
        }
        if let message = error.userInfo[NSLocalizedDescriptionKey] as? String {
            return "\(message) (code \(error.code))"
        }
        return "URL error \(error.code)"
    }
}

/// A response as the poster uses it: status and headers, at most `cap` body bytes.
struct Collected: Sendable {
    var response: URLResponse?
    var body: [UInt8]
    var error: (any Error)?
}

/// The session's delegate: collects each task's body up to a cap (then cancels the task, keeping the status
/// and headers already received), and refuses redirects (a 3xx comes back as a response and pauses the uplink).
private final class ResponseCollector: NSObject, URLSessionDataDelegate, Sendable {
    private struct Pending {
        var continuation: CheckedContinuation<Collected, Never>
        var body: [UInt8] = []
        var truncated = false
    }

    private let cap: Int
    private let pending = Mutex<[Int: Pending]>([:])

    init(cap: Int) {
        self.cap = max(0, cap)
    }

    /// Before `task.resume()`, so no callback can miss it.
    func register(_ task: URLSessionTask, _ continuation: CheckedContinuation<Collected, Never>) {
        pending.withLock { $0[task.taskIdentifier] = Pending(continuation: continuation) }
    }

    func urlSession(_ session: URLSession, dataTask: URLSessionDataTask, didReceive data: Data) {
        let overflow = pending.withLock { tasks -> Bool in
            guard var entry = tasks[dataTask.taskIdentifier], !entry.truncated else { return false }
            let room = cap - entry.body.count
            if data.count > room {
                entry.body.append(contentsOf: data.prefix(room))
                entry.truncated = true
            } else {
                entry.body.append(contentsOf: data)
            }
            tasks[dataTask.taskIdentifier] = entry
            return entry.truncated
        }
        if overflow { dataTask.cancel() }
    }

    func urlSession(_ session: URLSession, task: URLSessionTask, didCompleteWithError error: (any Error)?) {
        guard let entry = pending.withLock({ $0.removeValue(forKey: task.taskIdentifier) }) else { return }
        // A task cancelled because its body passed the cap still has its status and headers.
        entry.continuation.resume(
            returning: Collected(response: task.response, body: entry.body, error: entry.truncated ? nil : error))
    }

    func urlSession(
        _ session: URLSession, task: URLSessionTask, willPerformHTTPRedirection response: HTTPURLResponse,
        newRequest request: URLRequest, completionHandler: @escaping @Sendable (URLRequest?) -> Void
    ) {
        completionHandler(nil)
    }
}

/// Where plain http may go.
public enum UplinkEndpoint {
    /// `localhost`, an IPv4 literal in 127.0.0.0/8 (four decimal parts) or the IPv6 literal ::1. Host NAMES
    /// other than localhost are not loopback whatever they start with (`127.evil.example` is a remote host).
    public static func isLoopback(host: String) -> Bool {
        var name = host.lowercased()
        if name.hasPrefix("["), name.hasSuffix("]") { name = String(name.dropFirst().dropLast()) }
        if name == "localhost" { return true }
        var v4 = in_addr()
        if inet_pton(AF_INET, name, &v4) == 1 { return UInt32(bigEndian: v4.s_addr) >> 24 == 127 }
        var v6 = in6_addr()
        if inet_pton(AF_INET6, name, &v6) == 1 {
            return withUnsafeBytes(of: &v6) { $0.elementsEqual([UInt8](repeating: 0, count: 15) + [1]) }
        }
        return false
    }
}
