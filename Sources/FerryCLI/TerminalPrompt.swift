import FerryCore
import Dispatch
import FerryGateway
import FerrySync
import FerryProtocol
import FoundationEssentials
import Glibc

/// Asks the operator at the terminal while pairing runs: a peripheral shows its passkey, or the number of a
/// numeric comparison, only once pairing has begun, so these cannot be options given in advance.
enum TerminalPrompt {
    static func operatorPrompt(for address: PeripheralAddress) -> PeripheralPairing.OperatorPrompt {
        PeripheralPairing.OperatorPrompt(
            enterPasskey: {
                let answer = await ask("ferry: \(address): type the 6-digit passkey the peripheral displays, then Enter: ")
                guard let text = answer?.trimmingWhitespace(), let value = UInt32(text),
                    value <= 999_999
                else { return nil }
                return value
            },
            confirmNumber: { shown in
                let answer = await ask(
                    "ferry: \(address): does the peripheral show \(shown)? Confirm on the peripheral too. [y/N]: ")
                return answer?.trimmingWhitespace().lowercased().hasPrefix("y") == true
            })
    }

    /// The question on stderr (stdout may be JSON), the answer from stdin; nil at end of input.
    private static func ask(_ question: String) async -> String? {
        StandardOutput.writeAll(2, question)
        // readLine blocks: keep it off the cooperative pool. bluetoothd bounds the wait (it cancels the request).
        return await withCheckedContinuation { continuation in
            DispatchQueue.global().async { continuation.resume(returning: readLine()) }
        }
    }
}
