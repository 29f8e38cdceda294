import FerryBlueZ
import FerryCore
import FerrySync

/// A Sync peripheral seen advertising during a scan (`ferry scan`).
public struct ScannedPeripheral: Sendable, Equatable {
    public var address: String
    /// "public" or "random" (BlueZ's Device1.AddressType).
    public var addressType: String
    /// dBm; nil when BlueZ reported the advertisement without one.
    public var rssi: Int?
    public var name: String?
    /// BlueZ's view: paired (keys exchanged), bonded (keys stored), trusted.
    public var paired: Bool
    public var bonded: Bool
    public var trusted: Bool

    public init(
        address: String, addressType: String, rssi: Int?, name: String?, paired: Bool, bonded: Bool, trusted: Bool
    ) {
        self.address = address
        self.addressType = addressType
        self.rssi = rssi
        self.name = name
        self.paired = paired
        self.bonded = bonded
        self.trusted = trusted
    }
}

/// Finds the Sync peripherals in range: discovery on one adapter filtered by the Sync service UUID (the shared
/// `BlueZDiscovery`, so BlueZ itself drops everything else), for a fixed time. A device is listed when it is
/// under that adapter, advertises the Sync UUID (or advertises no UUID list at all: BlueZ only reported it
/// because it matched our UUID filter), and was heard during the scan: its object appeared or an
/// advertisement property changed while we watched, or it carries an RSSI (BlueZ only holds one for a device
/// heard during the current discovery and clears them when discovery stops). A peripheral that is merely
/// known (paired last month, now out of range) is not listed.
public enum PeripheralScan {
    /// Scans for `seconds`; `progress` gets the number found so far and the seconds left, about twice a second.
    public static func run(
        client: BlueZClient, adapter: BlueZAdapter, seconds: Double,
        progress: @Sendable (_ found: Int, _ secondsLeft: Double) -> Void = { _, _ in }
    ) async throws -> [ScannedPeripheral] {
        // Watch before discovery starts, so no advertisement reported in between is missed.
        let heard = LockedValue<Set<String>>([])
        let prefix = adapter.path + "/"
        let events = await client.objects.events()
        let watcher = Task {
            for await event in events {
                switch event {
                case .interfacesAdded(let path, let interfaces)
                where path.hasPrefix(prefix) && interfaces[BlueZInterface.device] != nil:
                    heard.withLock { _ = $0.insert(path) }
                case .propertiesChanged(let path, let interface, let changed, _)
                where path.hasPrefix(prefix) && interface == BlueZInterface.device
                    && !Set(changed.keys).isDisjoint(with: DeviceProperties.advertisementNames):
                    heard.withLock { _ = $0.insert(path) }
                default: break
                }
            }
        }
        defer { watcher.cancel() }
        // Objects that exist now were not heard by this scan unless they change; any that appear later were (read
        // from the tree as well as from the events, which the watcher may not have taken yet).
        let known = Set(await client.objects.snapshot.byPath.keys)
        let heardNow = { @Sendable (objects: BlueZObjects) -> Set<String> in
            heard.withLock { $0 }.union(objects.byPath.keys.filter { !known.contains($0) })
        }
        let lease = try await client.discovery(on: adapter).acquire()
        let clock = SystemMonotonicClock()
        let end = clock.now() + seconds
        var found: [ScannedPeripheral] = []
        do {
            while clock.now() < end {
                try Task.checkCancellation()
                let objects = await client.objects.snapshot
                found = inRange(objects, adapterPath: adapter.path, heard: heardNow(objects))
                let left = clock.remaining(until: end)
                progress(found.count, left.inSeconds)
                try await Task.sleep(for: min(.milliseconds(500), left))
            }
            // bluetoothd may not have announced what it found yet (its signals and its answers wait for an idle
            // main loop, which a flood of advertising reports starves): ask for its tree, which also waits until it
            // caught up. Before releasing: stopping discovery clears the RSSIs. Bounded: a bluetoothd too busy to
            // answer within 10 s is asked again once discovery stopped.
            let fresh = await resync(client, timeout: .seconds(10))
            let objects = await client.objects.snapshot
            found = inRange(objects, adapterPath: adapter.path, heard: heardNow(objects))
            await lease.release()
            if !fresh {
                // Discovery has stopped, so bluetoothd catches up; what it found now shows (without RSSI).
                _ = await resync(client, timeout: .seconds(10))
                let objects = await client.objects.snapshot
                let late = inRange(objects, adapterPath: adapter.path, heard: heardNow(objects))
                found += late.filter { peripheral in !found.contains { $0.address == peripheral.address } }
            }
            // The progress line ends at what the scan returns, including what only the last read of the tree showed.
            progress(found.count, 0)
        } catch {
            await lease.release()
            throw error
        }
        return found
    }

    /// True when the cache now reflects bluetoothd's tree; a timeout or error leaves it as it was.
    private static func resync(_ client: BlueZClient, timeout: Duration) async -> Bool {
        do {
            try await client.objects.resync(timeout: timeout)
            return true
        } catch {
            return false
        }
    }

    /// The Sync peripherals under `adapterPath` heard during the scan (`heard`: device paths that appeared or
    /// changed while scanning), strongest first, those without an RSSI last. Pure.
    public static func inRange(_ objects: BlueZObjects, adapterPath: String, heard: Set<String> = []) -> [ScannedPeripheral] {
        var result: [ScannedPeripheral] = []
        for (path, device) in objects.devices(under: adapterPath) {
            guard device.rssi != nil || heard.contains(path), let address = device.address else { continue }
            guard device.uuids.isEmpty || device.offers(service: SyncProfile.serviceUUID) else { continue }
            result.append(
                ScannedPeripheral(
                    address: address, addressType: device.addressType ?? "public", rssi: device.rssi,
                    name: device.name, paired: device.paired, bonded: device.bonded, trusted: device.trusted))
        }
        return result.sorted { ($0.rssi ?? Int.min, $1.address) > ($1.rssi ?? Int.min, $0.address) }
    }
}
