import Dispatch
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Runs async work from the synchronous CLI entry point, and turns SIGINT/SIGTERM into task cancellation
/// (long-running commands stop cleanly: batches on the wire stay IN_FLIGHT and are resent under the same key).
enum AsyncBridge {
    static func run<T: Sendable>(cancelOnSignals: Bool = false, _ body: @escaping @Sendable () async throws -> T) throws -> T {
        let result = Mutex<Result<T, any Error>?>(nil)
        let done = DispatchSemaphore(value: 0)
        let task = Task {
            let outcome: Result<T, any Error>
            do { outcome = .success(try await body()) } catch { outcome = .failure(error) }
            result.withLock { $0 = outcome }
            done.signal()
        }
        var sources: [any DispatchSourceSignal] = []
        if cancelOnSignals {
            for sig in [SIGINT, SIGTERM] {
                signal(sig, SIG_IGN)
                let source = DispatchSource.makeSignalSource(signal: sig, queue: .global())
                source.setEventHandler { task.cancel() }
                source.resume()
                sources.append(source)
            }
        }
        done.wait()
        sources.forEach { $0.cancel() }
        return try result.withLock { $0! }.get()
    }
}
