/// Runs blocking work (an ioctl, poll() on a kernel socket, libcurl's easy interface) on a thread of its own
/// and returns its result: such work must never hold a thread of Swift's cooperative pool, which has only one
/// thread per core. `stackSize` 0 keeps the platform's default. When the system refuses another thread, the work
/// runs on the calling thread: late, but never lost.
public func runOnOwnThread<T: Sendable>(
    name: String, stackSize: Int = 0, _ body: @escaping @Sendable () -> T
) async -> T {
    await withCheckedContinuation { continuation in
        let work: @Sendable () -> Void = { continuation.resume(returning: body()) }
        if !startThread(name: name, stackSize: stackSize, work) { work() }
    }
}
