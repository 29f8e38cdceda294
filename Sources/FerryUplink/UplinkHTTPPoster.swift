// POSTs one batch body over libcurl (a Debian system library, used directly: issue 11) and classifies the
// result. No retry loop here: the forwarder owns the schedule (retry_count and next_retry_at live in the store
// so they survive a restart).
//
// Why not URLSession: on Linux it cannot bound a response body (its reader outruns the delegate), has no
// per-process CA file or client certificate, and after a lost response on a kept-alive connection it resent
// the request WITHOUT its body and hung until the request timeout — a body-less request that reached the
// backend under the same Idempotency-Key. libcurl with a copied body resends the whole request at once.

import FerryCore
import FerryStore
import CCurl
import FoundationEssentials
import Glibc
import Synchronization

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
    /// Whole seconds, at least 1: the deadline of one request, connect to last response byte.
    public var requestTimeoutSeconds: Int
    public var userAgent: String
    public var compression: UplinkCompression
    /// Connections kept open to the backend (idle libcurl handles); enough for the requests in flight.
    public var maximumConnections: Int
    /// Plain `http://` is accepted for loopback hosts only unless this is set: the token and the
    /// frames would otherwise cross the network readable by anyone on the path.
    public var allowPlainHTTP: Bool
    /// Response body bytes kept; the rest is dropped unread (the connection is closed): a broken or hostile
    /// backend must not exhaust a Pi's memory. Only the first 512 bytes are ever used.
    public var maximumResponseBytes = 4096
    /// PEM file of the CA certificates that may sign the backend's certificate, instead of the system's
    /// bundle (a private CA). nil: the system bundle.
    public var caFile: String?
    /// Client certificate (PEM) and its private key (PEM) for a backend that wants mutual TLS.
    public var clientCertificateFile: String?
    public var clientKeyFile: String?

    public init(
        endpoint: URL, requestTimeoutSeconds: Int = 30, userAgent: String = "ferry/" + FerryVersion.string,
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
    case unreadableFile(option: String, path: String)
    case libcurl(String)

    public var description: String {
        switch self {
        case .invalidEndpoint(let reason): return "uplink endpoint: \(reason)"
        case .invalidTimeout(let seconds): return "uplink request timeout \(seconds) s: must be at least 1 s"
        case .unreadableFile(let option, let path): return "uplink \(option) \(path): not a readable file"
        case .libcurl(let detail): return "libcurl: \(detail)"
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

/// Sends batch bodies. One instance = one pool of kept-alive connections; share it. Safe to call `post` from
/// several tasks at once: each request runs on its own thread with its own libcurl handle (libcurl's easy
/// interface blocks; a handle is never used by two threads at once).
public final class UplinkHTTPPoster: Sendable {
    public let configuration: UplinkHTTPConfiguration
    private let gzipAdvertised = Mutex(false)
    private let wallClock: any WallClock
    private let idle: Mutex<[CurlHandle]>
    private let url: String

    /// `wallClock`: used only to resolve an HTTP-date `Retry-After`.
    public init(
        configuration: UplinkHTTPConfiguration,
        wallClock: any WallClock = SystemWallClock()
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
        for (option, path) in [
            ("ca_file", configuration.caFile), ("client_cert", configuration.clientCertificateFile),
            ("client_key", configuration.clientKeyFile),
        ] {
            guard let path else { continue }
            guard FileManager.default.isReadableFile(atPath: path) else { throw .unreadableFile(option: option, path: path) }
        }
        guard CurlHandle.globalInit == CURLE_OK else {
            throw .libcurl(
                ferry_curl_available() != 0
                    ? "curl_global_init failed" : "libcurl (libcurl.so.4) could not be loaded: install libcurl4")
        }
        self.configuration = configuration
        self.wallClock = wallClock
        url = configuration.endpoint.absoluteString
        idle = Mutex([])
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
        let clock = SystemMonotonicClock()
        let started = clock.now()
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
        attempt.elapsedSeconds = clock.seconds(since: started)
        return attempt
    }

    private func send(body: [UInt8], compress: Bool, idempotencyKey: String, token: BearerToken?) async -> UplinkAttempt {
        let wireBody = compress ? Gzip.compress(body) : body
        var headers = [
            "Content-Type: application/json", "Accept: application/json", "Idempotency-Key: \(idempotencyKey)",
            "User-Agent: \(configuration.userAgent)",
            // No "Expect: 100-continue" round trip before large bodies: the backend answers after the body anyway.
            "Expect:",
        ]
        if compress { headers.append("Content-Encoding: gzip") }
        if let token { headers.append("Authorization: \(token.authorizationHeaderValue)") }
        let request = CurlRequest(url: url, headers: headers, body: wireBody, configuration: configuration)
        let handle = idle.withLock { $0.popLast() }
        // libcurl's easy interface blocks for up to the request timeout.
        let (response, handleBack) = await runOnOwnThread(name: "ferry-curl", stackSize: 1 << 20) {
            () -> (CurlResponse, CurlHandle?) in
            let handle = handle ?? CurlHandle()
            let response = handle.map { $0.perform(request) } ?? CurlResponse(code: CURLE_OUT_OF_MEMORY)
            return (response, handle)
        }
        if let handleBack {
            idle.withLock { pool in
                if pool.count < max(1, configuration.maximumConnections) { pool.append(handleBack) }
            }
        }
        var attempt = UplinkAttempt(
            outcome: .retry(.connection("no response"), retryAfterSeconds: nil), status: nil,
            sentBodyBytes: wireBody.count, compressed: compress, elapsedSeconds: 0, responseSnippet: "")
        guard let status = response.status else {
            attempt.outcome = UplinkTransportErrors.classify(code: response.code, message: response.message)
            return attempt
        }
        if let accepted = response.header("accept-encoding") {
            let advertised = accepted.lowercased().split(separator: ",").contains {
                $0.split(separator: ";").first?.trimmingWhitespace() == "gzip"
            }
            gzipAdvertised.withLock { $0 = advertised }
        }
        let snippet = String(decoding: response.body.prefix(512), as: UTF8.self)
        attempt.status = status
        attempt.responseSnippet = snippet
        attempt.outcome = UplinkResponseClassifier.classify(
            status: status, retryAfter: response.header("retry-after"), location: response.header("location"),
            detail: snippet, nowSecondsSince1970: Double(wallClock.nowMillis()) / 1000)
        return attempt
    }
}

/// Maps libcurl's result codes to outcomes.
enum UplinkTransportErrors {
    static func classify(code: CURLcode, message: String) -> UplinkOutcome {
        let detail = message.isEmpty ? String(cString: ferry_curl_easy_strerror(code)) : message
        switch code {
        case CURLE_OPERATION_TIMEDOUT:
            return .retry(.timeout, retryAfterSeconds: nil)
        case CURLE_PEER_FAILED_VERIFICATION, CURLE_SSL_CACERT_BADFILE, CURLE_SSL_CERTPROBLEM, CURLE_SSL_ISSUER_ERROR,
            CURLE_SSL_PINNEDPUBKEYNOTMATCH, CURLE_SSL_INVALIDCERTSTATUS:
            // No retry can fix a certificate; dead-lettering healthy events over configuration would be worse.
            return .pause(.untrustedCertificate(detail))
        default:
            return .retry(.connection(detail), retryAfterSeconds: nil)
        }
    }
}

/// Everything one request needs, copied so the request thread shares nothing mutable.
struct CurlRequest: Sendable {
    var url: String
    var headers: [String]
    var body: [UInt8]
    var configuration: UplinkHTTPConfiguration
}

struct CurlResponse: Sendable {
    var code: CURLcode
    var message = ""
    /// nil when no complete status line and headers arrived.
    var status: Int?
    /// Lower-cased names; the last value of a repeated header wins.
    var headers: [String: String] = [:]
    var body: [UInt8] = []

    func header(_ name: String) -> String? { headers[name] }
}

/// One libcurl easy handle. A reused handle keeps its connection (keep-alive) and DNS cache. Used by one thread
/// at a time (the pool hands it out), hence @unchecked.
final class CurlHandle: @unchecked Sendable {
    static let globalInit: CURLcode = ferry_curl_global_init()
    private let handle: UnsafeMutableRawPointer

    init?() {
        guard Self.globalInit == CURLE_OK, let handle = ferry_curl_easy_init() else { return nil }
        self.handle = handle
    }

    deinit {
        ferry_curl_easy_cleanup(handle)
    }

    func perform(_ request: CurlRequest) -> CurlResponse {
        // Options from a previous request must not leak into this one; the connection cache survives a reset.
        ferry_curl_easy_reset(handle)
        let sink = ResponseSink(cap: max(0, request.configuration.maximumResponseBytes))
        var errorBuffer = [CChar](repeating: 0, count: Int(CURL_ERROR_SIZE) + 1)
        var headerList: UnsafeMutablePointer<curl_slist>?
        for line in request.headers { headerList = ferry_curl_slist_append(headerList, line) }
        defer { ferry_curl_slist_free_all(headerList) }
        let code = withExtendedLifetime(sink) { () -> CURLcode in
            errorBuffer.withUnsafeMutableBufferPointer { errorPointer -> CURLcode in
                let context = Unmanaged.passUnretained(sink).toOpaque()
                var setup = CURLE_OK
                func set(_ result: CURLcode) { if setup == CURLE_OK { setup = result } }
                let configuration = request.configuration
                set(ferry_curl_setopt_pointer(handle, CURLOPT_ERRORBUFFER, errorPointer.baseAddress))
                set(ferry_curl_setopt_pointer(handle, CURLOPT_URL, request.url))
                set(ferry_curl_setopt_pointer(handle, CURLOPT_PROTOCOLS_STR, "http,https"))
                set(ferry_curl_setopt_long(handle, CURLOPT_FOLLOWLOCATION, 0))  // 3xx pauses the uplink
                set(ferry_curl_setopt_long(handle, CURLOPT_NOSIGNAL, 1))  // threads: no SIGALRM for DNS timeouts
                set(ferry_curl_setopt_long(handle, CURLOPT_TIMEOUT_MS, configuration.requestTimeoutSeconds * 1000))
                set(ferry_curl_setopt_long(handle, CURLOPT_TCP_KEEPALIVE, 1))
                set(ferry_curl_setopt_long(handle, CURLOPT_POST, 1))
                set(ferry_curl_setopt_off(handle, CURLOPT_POSTFIELDSIZE_LARGE, curl_off_t(request.body.count)))
                // COPY: libcurl owns the bytes, so a resend on a fresh connection (a reused one died before
                // answering) carries the whole body again.
                request.body.withUnsafeBytes { set(ferry_curl_setopt_pointer(handle, CURLOPT_COPYPOSTFIELDS, $0.baseAddress ?? UnsafeRawPointer(bitPattern: 1))) }
                set(ferry_curl_setopt_pointer(handle, CURLOPT_HTTPHEADER, headerList))
                set(ferry_curl_setopt_callback(handle, CURLOPT_WRITEFUNCTION, ResponseSink.write))
                set(ferry_curl_setopt_pointer(handle, CURLOPT_WRITEDATA, context))
                set(ferry_curl_setopt_callback(handle, CURLOPT_HEADERFUNCTION, ResponseSink.header))
                set(ferry_curl_setopt_pointer(handle, CURLOPT_HEADERDATA, context))
                if let caFile = configuration.caFile { set(ferry_curl_setopt_pointer(handle, CURLOPT_CAINFO, caFile)) }
                if let certificate = configuration.clientCertificateFile {
                    set(ferry_curl_setopt_pointer(handle, CURLOPT_SSLCERT, certificate))
                }
                if let key = configuration.clientKeyFile { set(ferry_curl_setopt_pointer(handle, CURLOPT_SSLKEY, key)) }
                guard setup == CURLE_OK else { return setup }
                return ferry_curl_easy_perform(handle)
            }
        }
        let message = errorBuffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }
        var response = CurlResponse(code: code, message: String(decoding: message, as: UTF8.self))
        var status = 0
        _ = ferry_curl_getinfo_long(handle, CURLINFO_RESPONSE_CODE, &status)
        // A complete head is a response even when the body was cut at the cap (CURLE_WRITE_ERROR, on purpose).
        if status > 0, sink.headComplete, code == CURLE_OK || (code == CURLE_WRITE_ERROR && sink.truncated) {
            response.status = status
            response.headers = sink.headers
            response.body = sink.body
        }
        return response
    }
}

/// Receives one response: headers of the final status (1xx interim heads are dropped), body up to `cap`.
final class ResponseSink {
    let cap: Int
    var body: [UInt8] = []
    var truncated = false
    var headers: [String: String] = [:]
    var headerBytes = 0
    var headComplete = false

    init(cap: Int) {
        self.cap = cap
    }

    static let write: ferry_curl_data_callback = { data, size, count, context in
        guard let context else { return 0 }
        let sink = Unmanaged<ResponseSink>.fromOpaque(context).takeUnretainedValue()
        let (bytes, overflow) = size.multipliedReportingOverflow(by: count)
        guard !overflow else { return 0 }
        let room = sink.cap - sink.body.count
        if let data, room > 0 {
            data.withMemoryRebound(to: UInt8.self, capacity: min(bytes, room)) {
                sink.body.append(contentsOf: UnsafeBufferPointer(start: $0, count: min(bytes, room)))
            }
        }
        guard bytes <= room else {
            // Past the cap: stop reading (libcurl closes the connection). The status and headers are kept.
            sink.truncated = true
            return 0
        }
        return bytes
    }

    static let header: ferry_curl_data_callback = { data, size, count, context in
        guard let context, let data else { return 0 }
        let sink = Unmanaged<ResponseSink>.fromOpaque(context).takeUnretainedValue()
        let (bytes, overflow) = size.multipliedReportingOverflow(by: count)
        guard !overflow else { return 0 }
        // libcurl bounds one header line (100 KB); this bounds their sum.
        sink.headerBytes += bytes
        guard sink.headerBytes <= 256 * 1024 else { return 0 }
        let line = data.withMemoryRebound(to: UInt8.self, capacity: bytes) {
            String(decoding: UnsafeBufferPointer(start: $0, count: bytes), as: UTF8.self)
        }
        switch HTTPHeaderLine(line) {
        case .statusLine:
            // A new status line (after a 100 Continue): only the final head counts.
            sink.headers = [:]
            sink.headComplete = false
        case .end:
            sink.headComplete = true
        case .field(let name, let value):
            sink.headers[name] = value
        case .malformed:
            break
        }
        return bytes
    }
}
