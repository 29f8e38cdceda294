// The bearer token, read from a file the way ssh reads a private key: refuse it when
// other users could read it. The token's text never appears in any error, description
// or log line this module produces.

import FerryCore

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#elseif canImport(Darwin)
    import Darwin
#endif

/// A bearer token. Its `description` is redacted so string interpolation into a log is harmless.
public struct BearerToken: Sendable, Hashable, CustomStringConvertible, CustomDebugStringConvertible {
    private let secret: String

    /// Validates like the file reader does: visible ASCII only (RFC 6750 b64token plus
    /// a few more), so the value can never break out of the Authorization header.
    public init?(_ value: String) {
        guard !value.isEmpty, value.utf8.count <= TokenFile.maximumBytes,
            value.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F })
        else { return nil }
        secret = value
    }

    /// `Bearer <token>`, for the Authorization header only.
    public var authorizationHeaderValue: String { "Bearer " + secret }

    public var description: String { "BearerToken(redacted, \(secret.utf8.count) bytes)" }
    public var debugDescription: String { description }
}

public enum TokenFileError: Error, Sendable, Hashable, CustomStringConvertible {
    case unreadable(path: String, errno: Int32)
    /// Group or other may read it (mode & 077 != 0), like ssh's "UNPROTECTED PRIVATE KEY FILE".
    case permissionsTooOpen(path: String, mode: UInt32)
    /// Owned by neither the current user nor root: someone else could rewrite it.
    case wrongOwner(path: String, owner: UInt32)
    case notARegularFile(path: String)
    case empty(path: String)
    case tooLarge(path: String, bytes: Int)
    /// Whitespace inside, control or non-ASCII bytes: no header-safe token.
    case invalidCharacters(path: String)

    public var description: String {
        switch self {
        case .unreadable(let path, let code):
            return "token file \(path): cannot read (\(errnoDescription(code)))"
        case .permissionsTooOpen(let path, let mode):
            return "token file \(path): permissions 0\(String(mode & 0o777, radix: 8)) are too open; "
                + "group and others must have no access to it (chmod 600 \(path))"
        case .wrongOwner(let path, let owner):
            return "token file \(path): owned by uid \(owner), expected the current user or root"
        case .notARegularFile(let path):
            return "token file \(path): not a regular file"
        case .empty(let path):
            return "token file \(path): empty"
        case .tooLarge(let path, let bytes):
            return "token file \(path): \(bytes) bytes, more than the \(TokenFile.maximumBytes) a token may have"
        case .invalidCharacters(let path):
            return "token file \(path): the token must be one line of visible ASCII characters"
        }
    }
}

/// Where the token lives. `read()` is called at start-up and again after every 401/403,
/// so rotating the token is: rewrite the file, nothing else.
public struct TokenFile: Sendable, Hashable {
    public static let maximumBytes = 4096

    public let path: String

    public init(path: String) {
        self.path = path
    }

    /// Reads and checks the file. Leading/trailing whitespace (the usual trailing newline)
    /// is dropped.
    public func read() throws(TokenFileError) -> BearerToken {
        let descriptor = open(path, O_RDONLY | O_CLOEXEC)
        guard descriptor >= 0 else { throw .unreadable(path: path, errno: errno) }
        defer { close(descriptor) }
        // fstat on the opened descriptor: the checked file is the read file (no swap in between).
        var info = stat()
        guard fstat(descriptor, &info) == 0 else { throw .unreadable(path: path, errno: errno) }
        guard info.st_mode & S_IFMT == S_IFREG else { throw .notARegularFile(path: path) }
        if info.st_mode & 0o077 != 0 { throw .permissionsTooOpen(path: path, mode: UInt32(info.st_mode)) }
        if info.st_uid != geteuid() && info.st_uid != 0 { throw .wrongOwner(path: path, owner: UInt32(info.st_uid)) }
        if info.st_size > TokenFile.maximumBytes + 2 {
            throw .tooLarge(path: path, bytes: Int(info.st_size))
        }
        // Bounded even if the file grows after the fstat.
        guard let read = readUpTo(descriptor, limit: TokenFile.maximumBytes + 3) else {
            throw .unreadable(path: path, errno: errno)
        }
        var bytes = read[...]
        let isSpace: (UInt8) -> Bool = { $0 == 0x20 || $0 == 0x09 || $0 == 0x0A || $0 == 0x0D }
        while let first = bytes.first, isSpace(first) { bytes = bytes.dropFirst() }
        while let last = bytes.last, isSpace(last) { bytes = bytes.dropLast() }
        guard !bytes.isEmpty else { throw .empty(path: path) }
        guard bytes.count <= TokenFile.maximumBytes else { throw .tooLarge(path: path, bytes: bytes.count) }
        guard let token = BearerToken(String(decoding: bytes, as: UTF8.self)) else {
            throw .invalidCharacters(path: path)
        }
        return token
    }
}

