import FerryGateway
import FerrySync
import FerryStore
import Testing

/// Telling a security refusal apart from other failures, in the words bluetoothd 5.66 uses.
@Suite struct LinkSecurityTests {
    @Test func securityRefusalsAreRecognised() {
        // Seen in the test bed: the pairing bluetoothd started by itself was refused by the peripheral.
        let refused = SessionEnd.disconnected(
            .streamInfoUnreadable("org.bluez.Error.Failed: Operation failed with ATT error: 0x0e"))
        let sentence = LinkSecurity.encryptionProblem(after: refused)
        #expect(sentence?.contains("ferry pair --address") == true)
        // The sentence quotes the end as the log shows it.
        #expect(sentence?.hasSuffix(#"[streamInfoUnreadable("org.bluez.Error.Failed: Operation failed with ATT error: 0x0e")]"#) == true)
        #expect(LinkSecurity.encryptionProblem(after: .subscribeFailed("org.bluez.Error.Failed: ATT error: 0x05")) != nil)
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
        for end: SessionEnd? in [.linkLost, .disconnected(.noResponse), .disconnected(.caughtUp), nil] {
            #expect(LinkSecurity.encryptionProblem(after: end) == nil, "\(String(describing: end))")
        }
        #expect(SessionEnd.disconnected(.streamInfoUnreadable("x: y")).result.description == "streamInfoUnreadable")
        #expect(SessionEnd.disconnected(.caughtUp).result.description == "caughtUp")
        #expect(SessionEnd.subscribeFailed("x: y").result.description == "subscribeFailed")
        #expect("\(SessionEnd.disconnected(.streamInfoUnreadable("x: y")))" == #"streamInfoUnreadable("x: y")"#)
    }
}
