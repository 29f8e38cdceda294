import Synchronization

/// An open store passed from the owner that opened it to the one that will use it (`ferry sync`'s check of the
/// store before touching the radio, to the session's thread). Taken once: whoever takes it is the connection's
/// only user from then on, so the one-owner rule of `GatewayStore` holds across the move.
///
/// Why: opening a store is not free (SQLite's open, the schema parsed, the WAL and its shared memory mapped,
/// the migration check in a write transaction), and a sync that opened it twice paid that twice, the second
/// time while holding the peripheral's link.
public final class StoreHandoff: Sendable {
    private let store: Mutex<GatewayStore?>

    public init(_ store: sending GatewayStore) {
        self.store = Mutex(store)
    }

    /// The store, the first time; nil after that.
    public func take() -> GatewayStore? {
        store.withLock { $0.take() }
    }
}
