#if canImport(Glibc)
    import Glibc
#endif

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

/// CLOCK_MONOTONIC in nanoseconds: the deadlines of the threads that sleep on their own (DatabaseThread,
/// DeadlineThread). A wall-clock step (NTP after days offline) moves none of them.
public func monotonicNanoseconds() -> Int {
    var now = timespec()
    clock_gettime(CLOCK_MONOTONIC, &now)
    return Int(now.tv_sec) * 1_000_000_000 + Int(now.tv_nsec)
}
