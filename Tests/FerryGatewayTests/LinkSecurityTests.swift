import FerryBlueZ
import FerryGateway
@testable import FerrySync
import FerryStore
import Testing

/// Telling a security refusal apart from other failures: BlueZ's errors are classified once, in `BlueZError`
/// (by name, and by the ATT code bluetoothd 5.66 gives only in the message); the operator's sentence follows
/// from the session's typed verdict.
@Suite struct LinkSecurityTests {
    func failed(_ message: String) -> BlueZError {
        BlueZError(kind: .failed, name: "org.bluez.Error.Failed", message: message)
    }

    @Test func securityRefusalsAreRecognised() {
        // Seen in the test bed: the pairing bluetoothd started by itself was refused by the peripheral.
        #expect(failed("Operation failed with ATT error: 0x0e").attErrorCode == 0x0e)
        for code in ["0x05", "0x08", "0x0c", "0x0e", "0x0f", "0x0E", "0x0F"] {
            #expect(failed("Operation failed with ATT error: \(code)").isSecurityRefusal, "\(code)")
        }
        for kind: BlueZErrorKind in [.authenticationFailed, .authenticationRejected, .authenticationCanceled] {
            #expect(BlueZError(kind: kind, message: "Authentication Failed").isSecurityRefusal, "\(kind)")
        }
    }

    @Test func otherFailuresAreNot() {
        #expect(!failed("Operation failed with ATT error: 0x01").isSecurityRefusal)  // invalid handle
        #expect(failed("Operation failed with ATT error: 0x01").attErrorCode == 0x01)
        #expect(failed("Operation failed").attErrorCode == nil)
        #expect(failed("ATT error: 0x").attErrorCode == nil)
        #expect(failed("ATT error: 0x123").attErrorCode == nil, "not a byte")
        #expect(!BlueZError(kind: .notConnected, message: "Not connected").isSecurityRefusal)
        #expect(!BlueZError(kind: .authenticationTimeout, message: "timed out").isSecurityRefusal)
        // The kind decides, not words in the message.
        #expect(!BlueZError(kind: .failed, message: "AuthenticationFailed").isSecurityRefusal)
    }

    @Test func theSentenceFollowsTheSessionsVerdict() {
        var summary = SyncSummary(peripheral: "C0:FF:EE:00:00:01")
        summary.end = .disconnected(.streamInfoUnreadable("failed: Operation failed with ATT error: 0x0e"))
        #expect(LinkSecurity.encryptionProblem(after: summary) == nil, "no verdict, no sentence")
        summary.refusedForSecurity = true
        let sentence = LinkSecurity.encryptionProblem(after: summary)
        #expect(sentence?.contains("ferry pair --address") == true)
        // The sentence quotes the end as the log shows it.
        let quoted = #"[streamInfoUnreadable("failed: Operation failed with ATT error: 0x0e")]"#
        #expect(sentence?.hasSuffix(quoted) == true)
        summary.end = nil
        #expect(LinkSecurity.encryptionProblem(after: summary) == nil, "a session still running ended on nothing")
    }

    @Test func endsKeepTheirWords() {
        #expect(SessionEnd.disconnected(.streamInfoUnreadable("x: y")).result.description == "streamInfoUnreadable")
        #expect(SessionEnd.disconnected(.caughtUp).result.description == "caughtUp")
        #expect(SessionEnd.subscribeFailed("x: y").result.description == "subscribeFailed")
        #expect("\(SessionEnd.disconnected(.streamInfoUnreadable("x: y")))" == #"streamInfoUnreadable("x: y")"#)
    }
}
