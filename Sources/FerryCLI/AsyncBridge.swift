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

/// Runs `body`, failing with a one-line message after `seconds` (every radio command is bounded).
func withDeadline<T: Sendable>(seconds: Double, what: String, _ body: @escaping @Sendable () async throws -> T)
    async throws -> T
{
    try await withThrowingTaskGroup(of: T.self) { group in
        group.addTask { try await body() }
        group.addTask {
            try await Task.sleep(for: .milliseconds(Int64(seconds * 1000)))
            throw CommandFailure("\(what): no result within \(Int(seconds)) s")
        }
        defer { group.cancelAll() }
        guard let first = try await group.next() else { throw CancellationError() }
        return first
    }
}
