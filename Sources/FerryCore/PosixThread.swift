#if canImport(Glibc)
    import Glibc
#endif

/// Starts a detached POSIX thread named `name` that runs `body`. Returns false, running nothing, when the system
/// refuses another thread (pthread_create's EAGAIN: a process or user limit); the caller decides what then.
/// `stackSize` 0 keeps the platform's default.
///
/// Why not Foundation's `Thread`: in the test bed's emulated guest, the first `Thread` a process starts costs
/// 15-20 ms of CPU (Foundation's thread machinery set up on first use) and each later one about 0.5-1.5 ms more
/// than a plain pthread_create (measured there: ten threads started one after another, three runs each).
/// `ferry sync` starts three or four of its own (bus loop, session, notification reader, maybe deadlines).
@discardableResult
public func startThread(name: String, stackSize: Int = 0, _ body: @escaping @Sendable () -> Void) -> Bool {
    final class Start {
        let name: String
        let body: @Sendable () -> Void
        init(name: String, body: @escaping @Sendable () -> Void) {
            self.name = name
            self.body = body
        }
    }
    var attributes = pthread_attr_t()
    pthread_attr_init(&attributes)
    defer { pthread_attr_destroy(&attributes) }
    pthread_attr_setdetachstate(&attributes, Int32(PTHREAD_CREATE_DETACHED))
    if stackSize > 0 { pthread_attr_setstacksize(&attributes, stackSize) }
    let start = Unmanaged.passRetained(Start(name: name, body: body)).toOpaque()
    var thread = pthread_t()
    let rc = pthread_create(
        &thread, &attributes,
        { context in
            let start = Unmanaged<Start>.fromOpaque(context!).takeRetainedValue()
            nameCurrentThread(start.name)
            start.body()
            return nil
        }, start)
    guard rc == 0 else {
        Unmanaged<Start>.fromOpaque(start).release()
        return false
    }
    return true
}

/// Names the calling thread as the kernel knows it (`top -H`, /proc; at most 15 bytes are kept). Through /proc:
/// Glibc's module does not show pthread_setname_np (a _GNU_SOURCE function), and prctl is variadic.
private func nameCurrentThread(_ name: String) {
    let comm = Array(name.utf8.prefix(15))
    let fd = open("/proc/thread-self/comm", O_WRONLY | O_CLOEXEC)
    guard fd >= 0 else { return }
    _ = comm.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
    _ = close(fd)
}
