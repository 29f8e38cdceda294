import FerryDBus

/// Properties of one interface, variant wrappers removed.
public typealias BlueZProperties = [String: DBusValue]

/// An immutable view of bluetoothd's object tree: path → interface → properties.
public struct BlueZObjects: Sendable {
    public var byPath: [String: [String: BlueZProperties]]

    public init(byPath: [String: [String: BlueZProperties]] = [:]) {
        self.byPath = byPath
    }

    public func properties(_ path: String, _ interface: String) -> BlueZProperties? {
        byPath[path]?[interface]
    }

    /// Objects strictly below `path` (not `path` itself) that implement `interface`, sorted by path.
    public func descendants(of path: String, implementing interface: String) -> [(path: String, properties: BlueZProperties)] {
        let prefix = path == "/" ? "/" : path + "/"
        return byPath.compactMap { entry -> (path: String, properties: BlueZProperties)? in
            guard entry.key.hasPrefix(prefix), let properties = entry.value[interface] else { return nil }
            return (entry.key, properties)
        }.sorted { $0.path < $1.path }
    }

    /// All objects implementing `interface`, sorted by path.
    public func all(implementing interface: String) -> [(path: String, properties: BlueZProperties)] {
        descendants(of: "/", implementing: interface)
    }
}

/// A change to the cached tree, in bus order.
public enum BlueZObjectEvent: Sendable {
    case interfacesAdded(path: String, interfaces: [String: BlueZProperties])
    case interfacesRemoved(path: String, interfaces: [String])
    case propertiesChanged(path: String, interface: String, changed: BlueZProperties, invalidated: [String])
    /// bluetoothd left the bus: the cache is now empty and every object path is dead.
    case serviceVanished
    /// bluetoothd (re)appeared and the cache was rebuilt from a fresh GetManagedObjects.
    case serviceAppeared
}

/// Mirror of bluetoothd's objects: one GetManagedObjects, then kept fresh by InterfacesAdded/Removed
/// and PropertiesChanged; dropped and rebuilt when bluetoothd's bus name changes owner.
///
/// Signals are subscribed BEFORE the snapshot is requested, and each carries its position in the
/// connection's receive order: signals older than the snapshot reply are discarded, newer ones are
/// applied on top. So nothing between subscribe and snapshot is lost or applied twice.
public actor BlueZObjectCache {
    public nonisolated let connection: DBusConnection
    public nonisolated let serviceName: String
    private let log: DBusLogSink?

    private var objects = BlueZObjects()
    /// Receive index of the snapshot the tree is based on; nil while a snapshot is being loaded.
    private var snapshotIndex: UInt64?
    private var buffered: [DBusSignal] = []
    /// True while a resync's GetManagedObjects is out: signals are buffered as during a rebuild.
    private var holding = false
    private var serviceOwner: String?
    /// Increments on every rebuild, so holders of object paths can tell that bluetoothd restarted.
    public private(set) var generation = 0
    private var listeners: [Int: Listener] = [:]
    private var waiters: [Int: Waiter] = [:]
    private var nextID = 0
    private var pump: Task<Void, Never>?

    /// One `events` stream, typed away: `offer` yields what the listener makes of an event (if anything).
    private struct Listener {
        var offer: @Sendable (BlueZObjectEvent) -> Void
        var finish: @Sendable () -> Void
    }

    private struct Waiter {
        var check: @Sendable (BlueZObjects) -> Bool
        var continuation: CheckedContinuation<Void, any Error>
    }

    public init(connection: DBusConnection, serviceName: String = BlueZInterface.service, log: DBusLogSink? = nil) {
        self.connection = connection
        self.serviceName = serviceName
        self.log = log
    }

    /// Subscribes and loads the first snapshot. If bluetoothd is not running this still succeeds with
    /// an empty cache (`isServiceAvailable == false`) and fills it when bluetoothd appears.
    public func start() async throws {
        guard pump == nil else { return }
        let stream = try await mappingErrors {
            // One rule for all of bluetoothd's signals (InterfacesAdded/Removed, PropertiesChanged; `apply` ignores any
            // other member) rather than one per member: each AddMatch is a round trip before the snapshot is asked for.
            try await connection.signals(matching: [
                .nameOwnerChanged(name: serviceName),
                .allSignals(sender: serviceName),
            ])
        }
        pump = Task { [weak self] in
            for await signal in stream {
                guard let self else { return }
                await self.receive(signal)
            }
        }
        try await reload()
    }

    /// Stops following the bus. Pending waiters fail.
    public func stop() {
        pump?.cancel()
        pump = nil
        for (_, waiter) in waiters {
            waiter.continuation.resume(throwing: BlueZError(kind: .disconnected, message: "object cache stopped"))
        }
        waiters.removeAll()
        for listener in listeners.values { listener.finish() }
        listeners.removeAll()
    }

    public var isServiceAvailable: Bool { serviceOwner != nil }

    /// bluetoothd's unique bus name: the sender of the tree the cache holds; nil while bluetoothd is not on the bus.
    public var serviceOwnerName: String? { serviceOwner }

    /// The current tree.
    public var snapshot: BlueZObjects { objects }

    public func properties(_ path: String, _ interface: String) -> BlueZProperties? {
        objects.properties(path, interface)
    }

    /// A stream of the changes from now on for which `wants` is true. The filter runs here, as each signal is
    /// applied: a listener that ignores most changes (discovery's RSSI and advertising updates, many per second;
    /// the removal of every temporary device half a minute after a scan) is not woken for them.
    public func events(
        where wants: @escaping @Sendable (BlueZObjectEvent) -> Bool = { _ in true }
    ) -> AsyncStream<BlueZObjectEvent> {
        classifiedEvents { wants($0) ? $0 : nil }
    }

    /// A stream of what `classify` makes of each change from now on, skipping the changes it returns nil for
    /// (run here, as each signal is applied, like `events(where:)`'s filter).
    public func classifiedEvents<Classified: Sendable>(
        _ classify: @escaping @Sendable (BlueZObjectEvent) -> Classified?
    ) -> AsyncStream<Classified> {
        let (stream, continuation) = AsyncStream<Classified>.makeStream(bufferingPolicy: .unbounded)
        let id = nextID
        nextID += 1
        listeners[id] = Listener(
            offer: { event in
                if let classified = classify(event) { continuation.yield(classified) }
            },
            finish: { continuation.finish() })
        continuation.onTermination = { [weak self] _ in
            Task { await self?.removeListener(id) }
        }
        return stream
    }

    private func removeListener(_ id: Int) { listeners[id] = nil }

    /// Waits until `probe` returns a value for the current tree (checked now and after every change).
    /// Throws BlueZError(.timeout) after `timeout`.
    public func waitFor<T: Sendable>(
        timeout: Duration, _ probe: @escaping @Sendable (BlueZObjects) -> T?
    ) async throws -> T {
        if let value = probe(objects) { return value }
        let id = nextID
        nextID += 1
        let timer = Task { [weak self] in
            try? await Task.sleep(for: timeout)
            await self?.expireWaiter(id, after: timeout)
        }
        defer { timer.cancel() }
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
                if Task.isCancelled {
                    continuation.resume(throwing: CancellationError())
                    return
                }
                waiters[id] = Waiter(check: { probe($0) != nil }, continuation: continuation)
            }
        } onCancel: {
            Task { await self.cancelWaiter(id) }
        }
        // Re-read under the actor: the tree may have moved on again, but the caller wants a current value.
        guard let value = probe(objects) else { return try await waitFor(timeout: timeout, probe) }
        return value
    }

    /// Waits until `condition` holds for the current tree. Throws BlueZError(.timeout) after `timeout`.
    public func waitUntil(timeout: Duration, _ condition: @escaping @Sendable (BlueZObjects) -> Bool) async throws {
        _ = try await waitFor(timeout: timeout) { condition($0) ? true : nil }
    }

    private func expireWaiter(_ id: Int, after timeout: Duration) {
        waiters.removeValue(forKey: id)?.continuation.resume(
            throwing: BlueZError(kind: .timeout, message: "condition not met within \(timeout)"))
    }

    private func cancelWaiter(_ id: Int) {
        waiters.removeValue(forKey: id)?.continuation.resume(throwing: CancellationError())
    }

    // MARK: Loading

    private func reload() async throws {
        snapshotIndex = nil
        let reply: DBusReply
        do {
            reply = try await connection.call(
                destination: serviceName, path: "/", interface: BlueZInterface.objectManager,
                member: "GetManagedObjects")
        } catch let error as DBusError where BlueZError(error).kind == .serviceUnknown {
            // Not running: wait for NameOwnerChanged.
            install(BlueZObjects(), owner: nil, index: 0)
            return
        } catch let error as DBusError {
            throw BlueZError(error)
        }
        guard let managed = reply.arguments.first, case .dict = managed else {
            throw BlueZError.unexpectedReply("GetManagedObjects returned \(reply.signature)")
        }
        var tree: [String: [String: BlueZProperties]] = [:]
        for (path, interfaces) in managed.dictionary ?? [:] {
            tree[path] = Self.interfaceMap(interfaces)
        }
        install(BlueZObjects(byPath: tree), owner: reply.sender, index: reply.receiveIndex)
    }

    /// Re-reads bluetoothd's tree with a fresh GetManagedObjects and applies the difference to the cache as
    /// the events the signals would have carried (interfaces added/removed, properties changed), without
    /// treating it as a restart (no `.serviceAppeared`, same generation).
    ///
    /// Why: bluetoothd (gdbus) flushes InterfacesAdded/PropertiesChanged AND dispatches incoming calls from GLib
    /// idle callbacks, which a main loop busy with advertising reports does not run. Measured in the test bed
    /// (~20 reports/s per emulated peripheral): after StartDiscovery bluetoothd sent nothing for 7–20 s although
    /// it had created the device objects at once, so a 8–20 s `ferry scan` read an empty cache. A resync's reply
    /// comes after the signals bluetoothd had pending (a barrier: the tree is current once it returns), and the
    /// diff covers signals that never come.
    /// A no-op while a full rebuild is in progress or bluetoothd is gone; a restart meanwhile wins.
    public func resync(timeout: Duration? = nil) async throws {
        guard snapshotIndex != nil, serviceOwner != nil, !holding else { return }
        let generationBefore = generation
        // Hold signals while the call is out (as a rebuild does): one the pump applied now might be newer than
        // the reply and would be overwritten by it.
        holding = true
        let reply: DBusReply
        do {
            reply = try await connection.call(
                destination: serviceName, path: "/", interface: BlueZInterface.objectManager,
                member: "GetManagedObjects", timeout: timeout)
        } catch let error as DBusError {
            releaseHeld()
            throw BlueZError(error)
        } catch {
            releaseHeld()
            throw error
        }
        // bluetoothd restarted (or a rebuild ran) while we waited: the rebuild's tree is the truth.
        guard generation == generationBefore, let index = snapshotIndex, reply.receiveIndex > index,
            reply.sender == serviceOwner, let managed = reply.arguments.first, case .dict = managed
        else {
            releaseHeld()
            return
        }
        var fresh: [String: [String: BlueZProperties]] = [:]
        for (path, interfaces) in managed.dictionary ?? [:] {
            fresh[path] = Self.interfaceMap(interfaces)
        }
        let events = Self.difference(from: objects.byPath, to: fresh)
        objects = BlueZObjects(byPath: fresh)
        snapshotIndex = reply.receiveIndex
        for event in events { broadcast(event) }
        releaseHeld()
    }

    /// Ends a resync's hold: signals received meanwhile that are newer than the tree go on top, in order.
    private func releaseHeld() {
        holding = false
        guard let index = snapshotIndex else { return }  // a rebuild is loading: it takes the buffer
        let pending = buffered
        buffered = []
        for signal in pending where signal.receiveIndex > index { apply(signal) }
        settleWaiters()
    }

    /// The events that turn tree `old` into tree `new`, in path order. Pure.
    static func difference(
        from old: [String: [String: BlueZProperties]], to new: [String: [String: BlueZProperties]]
    ) -> [BlueZObjectEvent] {
        var events: [BlueZObjectEvent] = []
        for path in Set(old.keys).union(new.keys).sorted() {
            let before = old[path] ?? [:]
            let after = new[path] ?? [:]
            let added = after.filter { before[$0.key] == nil }
            let removed = before.keys.filter { after[$0] == nil }.sorted()
            if !added.isEmpty { events.append(.interfacesAdded(path: path, interfaces: added)) }
            for (interface, properties) in after.sorted(by: { $0.key < $1.key }) {
                guard let previous = before[interface] else { continue }
                let changed = properties.filter { previous[$0.key] != $0.value }
                let invalidated = previous.keys.filter { properties[$0] == nil }.sorted()
                if !changed.isEmpty || !invalidated.isEmpty {
                    events.append(.propertiesChanged(path: path, interface: interface, changed: changed, invalidated: invalidated))
                }
            }
            if !removed.isEmpty { events.append(.interfacesRemoved(path: path, interfaces: removed)) }
        }
        return events
    }

    private func install(_ tree: BlueZObjects, owner: String?, index: UInt64) {
        objects = tree
        serviceOwner = owner
        snapshotIndex = index
        generation += 1
        let pending = buffered
        buffered = []
        for signal in pending where signal.receiveIndex > index { apply(signal) }
        if owner != nil { broadcast(.serviceAppeared) }
        settleWaiters()
    }

    /// `a{sa{sv}}` → interface → unwrapped properties.
    static func interfaceMap(_ value: DBusValue) -> [String: BlueZProperties] {
        var out: [String: BlueZProperties] = [:]
        for (interface, properties) in value.dictionary ?? [:] {
            out[interface] = unwrappedProperties(properties)
        }
        return out
    }

    static func unwrappedProperties(_ value: DBusValue) -> BlueZProperties {
        (value.dictionary ?? [:]).mapValues(\.unwrapped)
    }

    // MARK: Signals

    private func receive(_ signal: DBusSignal) async {
        if signal.member == "NameOwnerChanged" {
            let newOwner = signal.arguments.count == 3 ? (signal.arguments[2].string ?? "") : ""
            await ownerChanged(to: newOwner)
            return
        }
        guard let index = snapshotIndex, !holding else {
            buffered.append(signal)
            return
        }
        guard signal.receiveIndex > index else { return }  // already in the snapshot
        apply(signal)
        settleWaiters()
    }

    private func ownerChanged(to newOwner: String) async {
        if !newOwner.isEmpty && newOwner == serviceOwner { return }
        if serviceOwner != nil {
            log?("bluez: \(serviceName) left the bus; dropping \(objects.byPath.count) cached objects")
            objects = BlueZObjects()
            serviceOwner = nil
            broadcast(.serviceVanished)
            settleWaiters()
        }
        guard !newOwner.isEmpty else { return }
        log?("bluez: \(serviceName) is now \(newOwner); rebuilding the object cache")
        do {
            try await reload()
        } catch {
            log?("bluez: rebuilding the object cache failed: \(error)")
        }
    }

    private func apply(_ signal: DBusSignal) {
        let args = signal.arguments
        switch signal.member {
        case "InterfacesAdded":
            guard args.count == 2, let path = args[0].objectPath else { return }
            let added = Self.interfaceMap(args[1])
            objects.byPath[path, default: [:]].merge(added) { _, new in new }
            broadcast(.interfacesAdded(path: path, interfaces: added))
        case "InterfacesRemoved":
            guard args.count == 2, let path = args[0].objectPath, let names = args[1].stringArray else { return }
            for name in names { objects.byPath[path]?[name] = nil }
            if objects.byPath[path]?.isEmpty == true { objects.byPath[path] = nil }
            broadcast(.interfacesRemoved(path: path, interfaces: names))
        case "PropertiesChanged":
            guard args.count >= 2, let interface = args[0].string else { return }
            let changed = Self.unwrappedProperties(args[1])
            let invalidated = args.count > 2 ? (args[2].stringArray ?? []) : []
            // Only for objects we know: a late signal must not resurrect a removed object.
            guard objects.byPath[signal.path]?[interface] != nil else { return }
            objects.byPath[signal.path]?[interface]?.merge(changed) { _, new in new }
            for name in invalidated { objects.byPath[signal.path]?[interface]?[name] = nil }
            broadcast(
                .propertiesChanged(path: signal.path, interface: interface, changed: changed, invalidated: invalidated))
        default:
            return
        }
    }

    private func broadcast(_ event: BlueZObjectEvent) {
        for listener in listeners.values { listener.offer(event) }
    }

    private func settleWaiters() {
        let tree = objects
        for (id, waiter) in waiters where waiter.check(tree) {
            waiters[id] = nil
            waiter.continuation.resume()
        }
    }
}
