import CBluetooth

#if canImport(Glibc)
    import Glibc
#endif

/// The kernel's reset of one controller (HCIDEVRESET on a raw HCI socket, libbluetooth's API): it drops the
/// controller's links and sends it HCI_Reset, below bluetoothd, which a wedged controller that still reports
/// "powered" may need. Needs CAP_NET_ADMIN (the systemd unit grants it as an ambient capability).
public enum HCIReset {
    public struct Failure: Error, CustomStringConvertible, Sendable, Equatable {
        public var device: String
        public var errno: Int32
        public var description: String {
            let text = String(cString: strerror(errno))
            return "HCI reset of \(device) failed: \(text)"
                + (errno == EPERM || errno == EACCES ? " (needs CAP_NET_ADMIN: see the systemd unit)" : "")
        }
    }

    /// "hci3" → 3; nil for anything else.
    public static func index(of adapterName: String) -> Int32? {
        guard adapterName.hasPrefix("hci"), let n = Int32(adapterName.dropFirst(3)), n >= 0, n < 1024 else { return nil }
        return n
    }

    /// Blocks for as long as the kernel takes (it bounds the reset with its own HCI command timeouts).
    public static func reset(adapterName: String) throws(Failure) {
        guard let id = index(of: adapterName) else { throw Failure(device: adapterName, errno: ENODEV) }
        let result = ferry_hci_dev_reset(id)
        if result < 0 { throw Failure(device: adapterName, errno: -result) }
    }
}
