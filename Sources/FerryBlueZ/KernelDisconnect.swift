import CBluetooth
import FerryCore

#if canImport(Glibc)
    import Glibc
#endif

/// Takes an LE link down through the kernel's management channel instead of Device1.Disconnect.
///
/// bluetoothd answers Device1.Disconnect only after its own DISCONNECT_TIMER (2 s in 5.66) has given the
/// device's profiles a chance to disconnect first; for a GATT-only Sync link there is nothing to wait for, and
/// those 2 s are link time the slot is held (measured in the test bed: 2.0–2.3 s from the final SYNC_ACK to the
/// peripheral seeing the link end). The kernel's Disconnect is the command bluetoothd itself sends when its
/// timer fires; bluetoothd learns of the link's end from the kernel as it does for any disconnection. Needs
/// CAP_NET_ADMIN (the systemd unit grants it); without it, or if the kernel cannot find the link, callers fall
/// back to Device1.Disconnect.
public enum KernelDisconnect {
    public enum Outcome: Sendable, Equatable {
        case disconnected
        /// `errno`, or a management status in `status` (0x02: not connected).
        case failed(errno: Int32, status: Int32?)
    }

    /// "C0:FF:EE:00:00:01" → its six bytes, most significant first; nil for anything else.
    static func addressBytes(_ address: String) -> [UInt8]? {
        let parts = address.split(separator: ":", omittingEmptySubsequences: false)
        guard parts.count == 6 else { return nil }
        var bytes: [UInt8] = []
        for part in parts {
            guard part.count == 2, let byte = UInt8(part, radix: 16) else { return nil }
            bytes.append(byte)
        }
        return bytes
    }

    /// Blocks until the controller reported the link down, at most `timeoutMilliseconds` (plus the kernel's
    /// own bound). `addressType`: Device1.AddressType ("public" or "random").
    public static func disconnect(
        adapterName: String, address: String, addressType: String, timeoutMilliseconds: Int32 = 3000
    ) -> Outcome {
        guard let index = HCIDevice.index(of: adapterName) else { return .failed(errno: ENODEV, status: nil) }
        guard let bytes = addressBytes(address) else { return .failed(errno: EINVAL, status: nil) }
        let type: UInt8 = addressType == "random" ? 2 : 1  // BDADDR_LE_RANDOM : BDADDR_LE_PUBLIC
        let result = bytes.withUnsafeBufferPointer {
            ferry_mgmt_disconnect(index, $0.baseAddress, type, timeoutMilliseconds)
        }
        switch result {
        case 0: return .disconnected
        case let r where r <= -0x100: return .failed(errno: 0, status: -r - 0x100)
        default: return .failed(errno: -result, status: nil)
        }
    }
}

extension BlueZDevice {
    /// Ends the link through the kernel (`KernelDisconnect`), then waits (bounded) until bluetoothd reports it
    /// down. `.failed` leaves the link as it was (no permission, no such link): the caller then uses
    /// Device1.Disconnect.
    public func disconnectThroughKernel() async -> KernelDisconnect.Outcome {
        guard let properties = await typedProperties(), let address = properties.address else {
            return .failed(errno: ENODEV, status: nil)
        }
        // The adapter is the device's parent object: /org/bluez/hci0/dev_… → hci0.
        let adapterName = path.split(separator: "/").dropLast().last.map(String.init) ?? ""
        let addressType = properties.addressType ?? "public"
        // It blocks in poll() until the controller answers.
        let outcome = await runOnOwnThread(name: "ferry-disconnect") {
            KernelDisconnect.disconnect(adapterName: adapterName, address: address, addressType: addressType)
        }
        if outcome == .disconnected {
            let devicePath = path
            try? await cache.waitUntil(timeout: .seconds(2)) { $0.device(devicePath)?.connected != true }
        }
        return outcome
    }
}
