import CBluetooth
import FerryCore

#if canImport(Glibc)
    import Glibc
#endif

/// The kernel's own switch for one controller (HCIDEVDOWN / HCIDEVUP on a raw HCI socket, libbluetooth's API),
/// below bluetoothd. A wedged controller that still reports "powered" refuses bluetoothd's power-off (the kernel
/// waits for answers to the commands it sends first); taking it down through the kernel needs no answer, and the
/// power-on that follows starts with HCI_Reset and the whole configuration a controller gets at boot, in the
/// kernel's and bluetoothd's view as well as the controller's. Needs CAP_NET_ADMIN (the systemd unit grants it
/// as an ambient capability).
public enum HCIDevice {
    public enum Operation: String, Sendable {
        case down, up
    }

    public struct Failure: Error, CustomStringConvertible, Sendable, Equatable {
        public var device: String
        public var operation: Operation
        public var errno: Int32
        public var description: String {
            let text = errnoDescription(errno)
            return "taking \(device) \(operation.rawValue) through the kernel failed: \(text)"
                + (errno == EPERM || errno == EACCES ? " (needs CAP_NET_ADMIN: see the systemd unit)" : "")
        }
        /// A missing permission is the unit's, not the controller's.
        public var isPermission: Bool { errno == EPERM || errno == EACCES }
    }

    /// "hci3" → 3; nil for anything else.
    public static func index(of adapterName: String) -> Int32? {
        guard adapterName.hasPrefix("hci"), let n = Int32(adapterName.dropFirst(3)), n >= 0, n < 1024 else { return nil }
        return n
    }

    /// Blocks for as long as the kernel takes (bounded by its own HCI command timeouts). A controller that is
    /// already down (or up) is not a failure.
    public static func set(_ operation: Operation, adapterName: String) throws(Failure) {
        guard let id = index(of: adapterName) else { throw Failure(device: adapterName, operation: operation, errno: ENODEV) }
        let result = operation == .down ? ferry_hci_dev_down(id) : ferry_hci_dev_up(id)
        if result < 0 && -result != EALREADY { throw Failure(device: adapterName, operation: operation, errno: -result) }
    }
}
