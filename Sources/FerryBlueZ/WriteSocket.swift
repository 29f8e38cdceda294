import FerryDBus

#if canImport(Glibc)
    import Glibc
#endif

/// An AcquireWrite socket: each `send` is one ATT Write Command (write-without-response) that bluetoothd
/// forwards without a D-Bus round trip. Closing it (here, or when this object goes away) releases it.
public final class BlueZWriteSocket: Sendable {
    public let mtu: UInt16
    private let fd: DBusUnixFD

    init(fd: DBusUnixFD, mtu: UInt16) {
        self.fd = fd
        self.mtu = mtu
    }

    /// Writes one value. Never blocks (MSG_DONTWAIT) and never raises SIGPIPE (MSG_NOSIGNAL): a full buffer
    /// or a closed link is an error the caller handles (falls back to WriteValue, or the link loss shows on
    /// DATA).
    public func send(_ bytes: [UInt8]) throws(BlueZError) {
        // ATT Write Command carries at most MTU − 3 bytes; bluetoothd would cut a longer one.
        guard bytes.count <= Int(mtu) - 3 else {
            throw BlueZError(kind: .other, message: "write of \(bytes.count) bytes exceeds MTU \(mtu) − 3")
        }
        let raw = fd.rawValue
        guard raw >= 0 else { throw BlueZError(kind: .other, message: "write socket closed") }
        let sent = bytes.withUnsafeBytes { Glibc.send(raw, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL | MSG_DONTWAIT)) }
        guard sent == bytes.count else {
            let reason = sent < 0 ? String(cString: strerror(errno)) : "short write (\(sent) of \(bytes.count))"
            throw BlueZError(kind: .other, message: "AcquireWrite socket: \(reason)")
        }
    }

    public func close() { fd.close() }
}

extension BlueZGattCharacteristic {
    /// AcquireWrite as a socket (the characteristic must have the write-without-response flag).
    public func acquireWriteSocket(timeout: Duration = .seconds(5)) async throws -> BlueZWriteSocket {
        let (fd, mtu) = try await acquireWrite(timeout: timeout)
        return BlueZWriteSocket(fd: fd, mtu: mtu)
    }
}
