import FerryCore
import FerryDBus
import FoundationEssentials

#if canImport(Glibc)
    import Glibc
#endif

/// Reads an AcquireNotify socket on its own thread: one read() is one notification (SOCK_SEQPACKET),
/// end-of-file means the link dropped. The thread sleeps in poll() on the socket and a stop pipe, so
/// `stop()` ends it promptly without closing an fd another thread is blocked on.
/// Closing the socket (done when the thread exits) is how BlueZ learns we unsubscribed.
final class NotificationSocketReader: Sendable {
    let values: AsyncStream<[UInt8]>
    private let stopSignal: StopPipe
    private let stopped = LockedValue(false)

    /// With `deliver`, each notification (and the end) is handed to it on the reader thread and `values` is
    /// empty; otherwise `values` carries them.
    init(fd: DBusUnixFD, mtu: Int, deliver: GattNotificationSink? = nil) throws {
        let stopSignal = try StopPipe()
        self.stopSignal = stopSignal
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
        // A notification carries at most MTU-3 bytes; read with room to spare so none is truncated.
        let capacity = max(mtu, 23) + 64
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
                    let count = buffer.withUnsafeMutableBytes { read(fd.rawValue, $0.baseAddress, $0.count) }
                    switch count {
                    case let n where n > 0: emit(.value(Array(buffer[0..<n])))
                    case 0: break loop  // link lost / BlueZ closed it
                    default:
                        if errno == EINTR || errno == EAGAIN { continue }
                        break loop
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
        stopSignal.signal()
    }

    deinit { stop() }
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
