// Pure parsing of what the backend's side of a connection controls or the operator configured: kept free of
// libcurl so the fuzz target (Fuzz/UplinkHeadersFuzz.swift) can build it alone.

import FerryCore
import FoundationEssentials
import Glibc

/// One line of a response head as libcurl hands it to the header callback (CRLF included).
public enum HTTPHeaderLine: Sendable, Equatable {
    case statusLine
    /// The empty line that ends the head.
    case end
    /// Name lower-cased, value without surrounding whitespace.
    case field(name: String, value: String)
    case malformed

    public init(_ line: String) {
        let trimmed = line.trimmingWhitespace()
        if trimmed.hasPrefix("HTTP/") {
            self = .statusLine
        } else if trimmed.isEmpty {
            self = .end
        } else if let colon = trimmed.firstIndex(of: ":") {
            self = .field(
                name: trimmed[..<colon].trimmingWhitespace().lowercased(),
                value: trimmed[trimmed.index(after: colon)...].trimmingWhitespace())
        } else {
            self = .malformed
        }
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
