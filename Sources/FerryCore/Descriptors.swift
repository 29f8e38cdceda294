#if canImport(Glibc)
    import Glibc
#endif

/// The C library's text for an errno value ("No such file or directory"), as Ferry's one-line errors quote it.
/// Pass `errno` as read right after the failing call: building the rest of a message first may change it.
public func errnoDescription(_ code: Int32) -> String {
    String(cString: strerror(code))
}

/// Writes all of `bytes` to `fd`, again after a signal interrupts a write; nil when done, else the errno of the
/// failure (EIO when the descriptor took nothing).
@discardableResult
public func writeAll(_ fd: Int32, _ bytes: [UInt8]) -> Int32? {
    var rest = bytes[...]
    while !rest.isEmpty {
        let n = rest.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
        if n < 0 && errno == EINTR { continue }
        if n <= 0 { return n < 0 ? errno : EIO }
        rest = rest.dropFirst(n)
    }
    return nil
}

/// Reads `fd` from its current offset to the end of the file, or up to `limit` bytes; nil with errno set when
/// a read fails. Again after a signal interrupts a read.
public func readUpTo(_ fd: Int32, limit: Int) -> [UInt8]? {
    var bytes: [UInt8] = []
    var chunk = [UInt8](repeating: 0, count: min(64 * 1024, max(limit, 1)))
    while bytes.count < limit {
        let n = chunk.withUnsafeMutableBytes { read(fd, $0.baseAddress, min($0.count, limit - bytes.count)) }
        if n < 0 && errno == EINTR { continue }
        if n < 0 { return nil }
        if n == 0 { break }
        bytes.append(contentsOf: chunk[..<n])
    }
    return bytes
}

/// Reads the file at `path` from its start into `bytes`, up to `limit` bytes (a larger file is cut there: the
/// caller that bounds it compares the count); nil when done, else the errno of the open or of a read, never
/// overwritten by the close.
public func readFile(_ path: String, limit: Int, into bytes: inout [UInt8]) -> Int32? {
    let fd = open(path, O_RDONLY | O_CLOEXEC)
    guard fd >= 0 else { return errno }
    defer { close(fd) }
    guard let read = readUpTo(fd, limit: limit) else { return errno }
    bytes = read
    return nil
}

/// Creates or truncates the file at `path` (close-on-exec, `mode` narrowed by the umask) and writes all of
/// `bytes`, without an fsync; nil when done, else the errno. A failed write leaves no file behind.
public func writeFile(_ path: String, _ bytes: [UInt8], mode: mode_t = 0o666) -> Int32? {
    let fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode)
    guard fd >= 0 else { return errno }
    var failure = writeAll(fd, bytes)
    if close(fd) != 0 && failure == nil { failure = errno }
    if failure != nil { unlink(path) }
    return failure
}
