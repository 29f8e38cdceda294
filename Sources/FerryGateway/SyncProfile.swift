/// GATT identifiers of the Sync service (PROTOCOL.md §1), lower-case as BlueZ reports UUIDs.
public enum SyncProfile {
    public static let serviceUUID = "f3a70001-8a96-49d6-9124-d674293fa28b"
    /// Notify: the frame byte stream, peripheral → gateway.
    public static let dataUUID = "f3a70002-8a96-49d6-9124-d674293fa28b"
    /// Write / write-without-response: one frame per write, gateway → peripheral.
    public static let controlUUID = "f3a70003-8a96-49d6-9124-d674293fa28b"
    /// Read: 26 bytes of stream info (optional on peripherals).
    public static let streamInfoUUID = "f3a70004-8a96-49d6-9124-d674293fa28b"
}
