import CBluetooth

#if canImport(Glibc)
    import Glibc
#endif

/// Gets bluetoothd scanning again when it believes it discovers while the kernel does not (measured with
/// bluetoothd 5.66 in the test bed: the kernel ended a discovery without announcing it; bluetoothd's next
/// StopDiscovery was refused and every later StartDiscovery with the same filter started nothing, so devices it
/// did not know yet were never found). An LE discovery started and stopped through the kernel's management
/// channel is announced to every management client: bluetoothd takes the "stopped" as its own discovery ending
/// and starts a real one for its clients. Needs CAP_NET_ADMIN (the systemd unit grants it).
public enum DiscoveryKick {
    public enum Outcome: Sendable, Equatable {
        /// The kernel was not discovering although bluetoothd's clients asked for it: kicked.
        case kicked
        /// The kernel is discovering: nothing was stale, nothing done.
        case notNeeded
        /// Could not ask the kernel (no CAP_NET_ADMIN, no such controller, a timeout): `errno`, or a
        /// management status in `status`.
        case failed(errno: Int32, status: Int32?)
    }

    /// Blocks for up to ~10 s (two management commands bounded by the kernel's own timeouts and ours).
    public static func kick(adapterName: String) -> Outcome {
        guard let index = HCIDevice.index(of: adapterName) else { return .failed(errno: ENODEV, status: nil) }
        let result = ferry_mgmt_discovery_kick(index)
        switch result {
        case 0: return .kicked
        case 1: return .notNeeded
        case let r where r <= -0x100: return .failed(errno: 0, status: -r - 0x100)
        default: return .failed(errno: -result, status: nil)
        }
    }
}
