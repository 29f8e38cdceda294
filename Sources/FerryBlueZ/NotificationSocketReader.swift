import FerryDBus
import Foundation
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Reads an AcquireNotify socket on its own thread: one read() is one notification (SOCK_SEQPACKET),
/// end-of-file means the link dropped. The thread sleeps in poll() on the socket and a stop pipe, so
/// `stop()` ends it promptly without closing an fd another thread is blocked on.
/// Closing the socket (done when the thread exits) is how BlueZ learns we unsubscribed.
final class NotificationSocketReader: Sendable {
    let values: AsyncStream<[UInt8]>
    private let stopWriteFD: Int32
    private let stopped = Mutex(false)

    init(fd: DBusUnixFD, mtu: Int) throws {
        var ends: [Int32] = [-1, -1]
        guard pipe(&ends) == 0 else {
            throw BlueZError(kind: .other, message: "pipe() failed: errno \(errno)")
        }
        let stopReadFD = ends[0]
        stopWriteFD = ends[1]
        let (stream, continuation) = AsyncStream<[UInt8]>.makeStream(bufferingPolicy: .unbounded)
        values = stream
        // A notification carries at most MTU-3 bytes; read with room to spare so none is truncated.
        let capacity = max(mtu, 23) + 64
        let thread = Thread {
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
                    let count = buffer.withUnsafeMutableBytes { read(fd.rawValue, $0.baseAddress, $0.count) }
                    switch count {
                    case let n where n > 0: continuation.yield(Array(buffer[0..<n]))
                    case 0: break loop  // link lost / BlueZ closed it
                    default:
                        if errno == EINTR || errno == EAGAIN { continue }
                        break loop
                    }
                }
            }
            fd.close()
            _ = Glibc.close(stopReadFD)
            continuation.finish()
        }
        thread.name = "ferry-notify"
        thread.start()
    }

    func stop() {
        let first = stopped.withLock { wasStopped -> Bool in
            defer { wasStopped = true }
            return !wasStopped
        }
        guard first else { return }
        var byte: UInt8 = 1
        _ = write(stopWriteFD, &byte, 1)
    }

    deinit {
        stop()
        _ = Glibc.close(stopWriteFD)
    }
}
