import FerryCore

/// A `GatewayStore` confined to its own thread (`ThreadExecutor`): the one owner of its connection, and every
/// call on it is made off the cooperative pool. Callers hand it a closure: `try await connection.read {
/// try $0.trustedPeripherals() }`. A closure is one unit of work on the connection, so the one-transaction
/// durability rule is kept by the store's own methods as before (a commit is one `GatewayStore.commit`).
public actor StoreConnection {
    private let thread: ThreadExecutor
    private var store: GatewayStore?

    public nonisolated var unownedExecutor: UnownedSerialExecutor { thread.asUnownedSerialExecutor() }

    private init(thread: ThreadExecutor) {
        self.thread = thread
    }

    deinit { thread.stop() }

    /// Opens (creates, migrates) the store on the connection's own thread.
    public static func open(
        path: String, create: Bool = true, clock: any WallClock = SystemWallClock(), threadName: String = "ferry-sqlite"
    ) async throws -> StoreConnection {
        let connection = StoreConnection(thread: ThreadExecutor(name: threadName))
        try await connection.openStore(path: path, create: create, clock: clock)
        return connection
    }

    private func openStore(path: String, create: Bool, clock: any WallClock) throws {
        store = try GatewayStore(path: path, clock: clock, create: create)
    }

    /// Runs `body` with the store, on the connection's thread.
    public func read<T: Sendable>(_ body: @Sendable (GatewayStore) throws -> T) throws -> T {
        guard let store else { preconditionFailure("StoreConnection.open opens the store before handing it out") }
        return try body(store)
    }

    /// Whether the caller runs on this connection's thread (tests).
    public nonisolated var runsOnItsOwnThread: Bool { thread.isCurrent }
}
