import FerryCore
import FerryDBus
import FoundationEssentials

#if canImport(Glibc)
    import Glibc
#endif

/// Reads an AcquireNotify socket: one read() is one notification (SOCK_SEQPACKET), end-of-file means the link
/// dropped. Either on a thread of its own, which sleeps in poll() on the socket and a stop pipe so `stop()` ends it
/// promptly without closing an fd another thread is blocked on; or, given the thread its notifications are for (a
/// live session's), as that thread's watched descriptor: read between the session's own work, with no thread in
/// between to wake the session's for every notification (in the test bed that hand-off was some 7 % of a
/// window-20 sync's CPU).
/// Closing the socket (when reading ends) is how BlueZ learns we unsubscribed.
final class NotificationSocketReader: Sendable {
    let values: AsyncStream<[UInt8]>
    private enum Reading {
        case ownThread(StopPipe)
        case watched(ThreadExecutor, token: UInt64, WatchedSocket)
    }
    private let reading: Reading
    private let stopped = LockedValue(false)

    /// Reads `fd` as `thread`'s watched descriptor and hands each notification (and the end) to `deliver` on that
    /// thread. Falls back to a thread of its own when `thread` cannot watch it (it has ended).
    convenience init(fd: DBusUnixFD, mtu: Int, deliver: @escaping GattNotificationSink, on thread: ThreadExecutor) throws {
        let socket = WatchedSocket(fd: fd, capacity: notificationCapacity(mtu: mtu), deliver: deliver)
        if let token = thread.watch(fd.rawValue, { socket.readAvailable() }) {
            self.init(watchedBy: thread, token: token, socket: socket)
        } else {
            try self.init(fd: fd, mtu: mtu, deliver: deliver)
        }
    }

    private init(watchedBy thread: ThreadExecutor, token: UInt64, socket: WatchedSocket) {
        let (stream, continuation) = AsyncStream<[UInt8]>.makeStream(bufferingPolicy: .unbounded)
        continuation.finish()
        values = stream
        reading = .watched(thread, token: token, socket)
    }

    /// With `deliver`, each notification (and the end) is handed to it on the reader thread and `values` is
    /// empty; otherwise `values` carries them.
    init(fd: DBusUnixFD, mtu: Int, deliver: GattNotificationSink? = nil) throws {
        let stopSignal = try StopPipe()
        reading = .ownThread(stopSignal)
        let stopReadFD = stopSignal.readFD
        let (stream, continuation) = AsyncStream<[UInt8]>.makeStream(bufferingPolicy: .unbounded)
        values = stream
        let emit: GattNotificationSink
        if let deliver {
            continuation.finish()
            emit = deliver
        } else {
            emit = { notification in
                switch notification {
                case .value(let bytes): continuation.yield(bytes)
                case .ended: continuation.finish()
                }
            }
        }
        let capacity = notificationCapacity(mtu: mtu)
        let started = startThread(name: "ferry-notify") {
            var buffer = [UInt8](repeating: 0, count: capacity)
            var fds = [
                pollfd(fd: fd.rawValue, events: Int16(POLLIN), revents: 0),
                pollfd(fd: stopReadFD, events: Int16(POLLIN), revents: 0),
            ]
            loop: while true {
                fds[0].revents = 0
                fds[1].revents = 0
                let ready = poll(&fds, 2, -1)
                if ready < 0 {
                    if errno == EINTR { continue }
                    break
                }
                if fds[1].revents != 0 { break }
                if fds[0].revents != 0 {
                    switch readNotification(fd.rawValue, into: &buffer, flags: 0) {
                    case .notification(let bytes): emit(.value(bytes))
                    case .nothingYet: continue
                    case .closed: break loop
                    }
                }
            }
            fd.close()
            emit(.ended)
            withExtendedLifetime(stopSignal) {}
        }
        guard started else {
            fd.close()  // unsubscribes, as the thread would have on its way out
            throw BlueZError(kind: .other, message: "cannot start a thread to read the notification socket")
        }
    }

    func stop() {
        let first = stopped.withLock { wasStopped -> Bool in
            defer { wasStopped = true }
            return !wasStopped
        }
        guard first else { return }
        switch reading {
        case .ownThread(let stopSignal): stopSignal.signal()
        case .watched(let thread, let token, let socket): thread.endWatch(token) { socket.end() }
        }
    }

    deinit { stop() }
}

/// A notification carries at most MTU-3 bytes; read with room to spare so none is truncated.
private func notificationCapacity(mtu: Int) -> Int { max(mtu, 23) + 64 }

private enum NotificationRead {
    case notification([UInt8])
    /// Interrupted, or (non-blocking) nothing waiting.
    case nothingYet
    /// End of file (the link was lost or BlueZ closed it) or the socket failed.
    case closed
}

/// One recv() of an AcquireNotify socket: one call is one notification (SOCK_SEQPACKET).
private func readNotification(_ fd: Int32, into buffer: inout [UInt8], flags: Int32) -> NotificationRead {
    let count = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, flags) }
    if count > 0 { return .notification(Array(buffer[0..<count])) }
    if count < 0 && (errno == EINTR || errno == EAGAIN) { return .nothingYet }
    return .closed
}

/// The socket of a watched reader; its methods run on the watching thread (`end` also where that thread has
/// ended), never two at once.
private final class WatchedSocket: @unchecked Sendable {
    private let fd: DBusUnixFD
    private let deliver: GattNotificationSink
    private var buffer: [UInt8]
    private var ended = false
    /// Most notifications one call reads: the session's own work (a commit) comes between, and poll() says when
    /// more is waiting.
    private static let readsPerTurn = 64

    init(fd: DBusUnixFD, capacity: Int, deliver: @escaping GattNotificationSink) {
        self.fd = fd
        self.deliver = deliver
        buffer = [UInt8](repeating: 0, count: capacity)
    }

    /// Reads what is waiting (without blocking); false once the socket is done (end of file or an error).
    func readAvailable() -> Bool {
        guard !ended else { return false }
        for _ in 0..<Self.readsPerTurn {
            switch readNotification(fd.rawValue, into: &buffer, flags: Int32(MSG_DONTWAIT)) {
            case .notification(let bytes): deliver(.value(bytes))
            case .nothingYet: return true
            case .closed:
                end()
                return false
            }
        }
        return true
    }

    /// Closes the socket (unsubscribing) and reports the end, once.
    func end() {
        guard !ended else { return }
        ended = true
        fd.close()
        deliver(.ended)
    }
}

/// Both ends of the reader's stop pipe, closed together when the last of the reader and its thread
/// lets go. Keeping the read end open as long as anyone may write is what prevents SIGPIPE.
private final class StopPipe: Sendable {
    let readFD: Int32
    let writeFD: Int32

    init() throws {
        var ends: [Int32] = [-1, -1]
        guard pipe(&ends) == 0 else {
            throw BlueZError(kind: .other, message: "pipe() failed: errno \(errno)")
        }
        // A process spawned later must not keep an end open.
        for end in ends { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        readFD = ends[0]
        writeFD = ends[1]
    }

    func signal() {
        var byte: UInt8 = 1
        _ = write(writeFD, &byte, 1)
    }

    deinit {
        _ = Glibc.close(readFD)
        _ = Glibc.close(writeFD)
    }
}
