import FerryCore

#if canImport(Glibc)
    import Glibc
#endif

/// Sole owner of one file descriptor that crossed D-Bus (type `h`).
///
/// libdbus duplicates descriptors both when sending and when receiving, so every fd that reaches Swift
/// is a private copy: this object closes it when it goes away unless someone took it with `take()`.
/// BlueZ's AcquireNotify/AcquireWrite fds are the main users: closing them is how a client unsubscribes.
public final class DBusUnixFD: Sendable, Equatable, CustomStringConvertible {
    private let descriptor: LockedValue<Int32>

    /// Takes ownership of `fd`.
    public init(adopting fd: Int32) {
        descriptor = LockedValue(fd)
    }

    /// Duplicates `fd` (the caller keeps its own copy). Returns nil if dup fails.
    public convenience init?(duplicating fd: Int32) {
        let copy = fcntl(fd, F_DUPFD_CLOEXEC, 0)
        guard copy >= 0 else { return nil }
        self.init(adopting: copy)
    }

    /// The descriptor, or -1 once taken or closed. Valid only while this object is alive and untaken.
    public var rawValue: Int32 { descriptor.withLock { $0 } }

    /// Transfers ownership to the caller: this object will no longer close it.
    public func take() -> Int32 {
        descriptor.withLock { fd in
            let taken = fd
            fd = -1
            return taken
        }
    }

    /// Closes the descriptor now (idempotent).
    public func close() {
        let fd = take()
        if fd >= 0 { _ = Glibc.close(fd) }
    }

    deinit {
        let fd = descriptor.withLock { $0 }
        if fd >= 0 { _ = Glibc.close(fd) }
    }

    /// Identity: two objects are equal only if they are the same owner (a received fd is always a new copy).
    public static func == (lhs: DBusUnixFD, rhs: DBusUnixFD) -> Bool { lhs === rhs }

    public var description: String { "DBusUnixFD(\(rawValue))" }
}
