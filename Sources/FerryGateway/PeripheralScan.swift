import FerryBlueZ
import FerryDBus

/// A Sync peripheral seen advertising during a scan (`ferry scan`).
public struct ScannedPeripheral: Sendable, Equatable {
    public var address: String
    /// "public" or "random" (BlueZ's Device1.AddressType).
    public var addressType: String
    public var rssi: Int
    public var name: String?
    /// BlueZ's view: paired (keys exchanged), bonded (keys stored), trusted.
    public var paired: Bool
    public var bonded: Bool
    public var trusted: Bool

    public init(
        address: String, addressType: String, rssi: Int, name: String?, paired: Bool, bonded: Bool, trusted: Bool
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
/// `BlueZDiscovery`, so BlueZ itself drops everything else), for a fixed time, then every device under that
/// adapter that advertises the Sync UUID and has an RSSI. BlueZ only holds an RSSI for a device it has heard
/// during the current discovery (it clears them when discovery stops), so a peripheral that is merely known
/// (paired last month, now out of range) is not listed as in range.
public enum PeripheralScan {
    /// Scans for `seconds`; `progress` gets the number found so far and the seconds left, about twice a second.
    public static func run(
        client: BlueZClient, adapter: BlueZAdapter, seconds: Double,
        progress: @Sendable (_ found: Int, _ secondsLeft: Double) -> Void = { _, _ in }
    ) async throws -> [ScannedPeripheral] {
        let lease = try await client.discovery(on: adapter).acquire()
        let clock = ContinuousClock()
        let end = clock.now + .milliseconds(Int64(seconds * 1000))
        var found: [ScannedPeripheral] = []
        do {
            while clock.now < end {
                try Task.checkCancellation()
                found = inRange(await client.objects.snapshot, adapterPath: adapter.path)
                let left = end - clock.now
                progress(found.count, max(0, Double(left.components.seconds) + Double(left.components.attoseconds) / 1e18))
                try await Task.sleep(for: min(.milliseconds(500), max(.zero, left)))
            }
            // Read before releasing: stopping discovery clears the RSSIs.
            found = inRange(await client.objects.snapshot, adapterPath: adapter.path)
        } catch {
            await lease.release()
            throw error
        }
        await lease.release()
        return found
    }

    /// The Sync peripherals under `adapterPath` that BlueZ currently hears, strongest first. Pure.
    public static func inRange(_ objects: BlueZObjects, adapterPath: String) -> [ScannedPeripheral] {
        let prefix = adapterPath + "/"
        var result: [ScannedPeripheral] = []
        for (path, properties) in objects.all(implementing: BlueZInterface.device) where path.hasPrefix(prefix) {
            let uuids = properties["UUIDs"]?.stringArray ?? []
            guard uuids.contains(where: { $0.lowercased() == SyncProfile.serviceUUID }),
                let address = properties["Address"]?.string, let rssi = rssiValue(properties["RSSI"])
            else { continue }
            result.append(
                ScannedPeripheral(
                    address: address, addressType: properties["AddressType"]?.string ?? "public", rssi: rssi,
                    name: properties["Name"]?.string, paired: properties["Paired"]?.bool ?? false,
                    bonded: BlueZDevice.hasBond(properties), trusted: properties["Trusted"]?.bool ?? false))
        }
        return result.sorted { ($0.rssi, $1.address) > ($1.rssi, $0.address) }
    }

    private static func rssiValue(_ value: DBusValue?) -> Int? {
        switch value {
        case .int16(let v): return Int(v)
        case .variant(let inner): return rssiValue(inner)
        default: return nil
        }
    }
}
