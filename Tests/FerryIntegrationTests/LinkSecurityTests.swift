import FerryGateway
import Testing

/// Telling a security refusal apart from other failures, in the words bluetoothd 5.66 uses.
@Suite struct LinkSecurityTests {
    @Test func securityRefusalsAreRecognised() {
        // Seen in the test bed: the pairing bluetoothd started by itself was refused by the peripheral.
        let refused = #"streamInfoUnreadable("org.bluez.Error.Failed: Operation failed with ATT error: 0x0e")"#
        #expect(LinkSecurity.encryptionProblem(in: refused)?.contains("ferry pair --address") == true)
        for code in ["0x05", "0x08", "0x0c", "0x0f"] {
            #expect(LinkSecurity.encryptionProblem(in: "Operation failed with ATT error: \(code)") != nil, "\(code)")
        }
        #expect(LinkSecurity.encryptionProblem(in: "org.bluez.Error.AuthenticationFailed: Authentication Failed") != nil)
    }

    @Test func otherFailuresAreNot() {
        for text in [
            "Operation failed with ATT error: 0x01",  // invalid handle
            "org.bluez.Error.NotConnected: Not connected", "linkLost", "noResponse",
        ] {
            #expect(LinkSecurity.encryptionProblem(in: text) == nil, "\(text)")
        }
        #expect(SyncResultKind.of(#"streamInfoUnreadable("x: y")"#) == "streamInfoUnreadable")
        #expect(SyncResultKind.of("caughtUp") == "caughtUp")
    }
}
