import FerrySync
import FerryProtocol

/// One central's link to a `SimulatedPeripheral`, as a `SyncTransport` for `SyncSessionRunner`.
///
/// The link is gone when the gateway disconnects, when the peripheral drops it (a fault, a wipe), or when
/// a newer transport connects. `controlHook` sees every CONTROL frame before it goes out: tests use it to
/// check the store at the instant an ACK is written, and to "crash" the gateway process at that instant.
public final class SimulatedTransport: SyncTransport {
    public enum ControlDecision: Sendable {
        case deliver
        /// The gateway process dies before the write leaves it: nothing reaches the peripheral, the link
        /// drops, and the driver abandons the runner.
        case crash
    }

    public enum Delivery: Equatable, Sendable {
        case notification([UInt8])
        case linkLost
        /// Nothing on the air right now.
        case idle
    }

    public let peripheral: SimulatedPeripheral
    public var controlHook: ((Frame) -> ControlDecision)?
    public private(set) var crashed = false
    /// CONTROL frames delivered to the peripheral, in order.
    public private(set) var controlFramesWritten: [Frame] = []
    /// How many SYNC_REQs the peripheral had answered on this link when it put the notification `nextDelivery()`
    /// returned last on the air. Below the number the gateway sent, that notification is still the old replay
    /// (PROTOCOL §4: the rest of the old window stays in flight after a re-request).
    public private(set) var lastNotificationRequestsAnswered = 0

    private let linkID: Int
    private var closedByGateway = false

    public init(connectingTo peripheral: SimulatedPeripheral, now: Double) {
        self.peripheral = peripheral
        linkID = peripheral.connect(now: now)
    }

    public var isLinked: Bool { !crashed && peripheral.isLinked(linkID) }

    public var hasStreamInfo: Bool { peripheral.configuration.hasStreamInfo }

    public func readStreamInfo() async throws -> [UInt8] {
        guard hasStreamInfo else { throw TransportError("the Sync service has no STREAM_INFO") }
        guard isLinked else { throw TransportError("not connected") }
        return peripheral.streamInfo.encoded()
    }

    public func subscribe() async throws {
        guard isLinked else { throw TransportError("not connected") }
        peripheral.subscribe(linkID)
    }

    public func writeControl(_ bytes: [UInt8]) async throws {
        guard isLinked else { throw TransportError("not connected") }
        if let hook = controlHook, let frame = SimulatedPeripheral.parseControl(bytes), hook(frame) == .crash {
            crashed = true
            peripheral.disconnect(linkID)  // the process is gone, so is its link
            return
        }
        if let frame = SimulatedPeripheral.parseControl(bytes) { controlFramesWritten.append(frame) }
        peripheral.controlWritten(bytes, link: linkID)
    }

    /// The simulated radio loses CONTROL writes only as a link loss, so an ACK goes the same way as a request.
    public func writeAck(_ bytes: [UInt8]) async throws {
        try await writeControl(bytes)
    }

    public func disconnect() async {
        closedByGateway = true
        peripheral.disconnect(linkID)
    }

    /// The next thing the radio delivers to the gateway. `.linkLost` is reported for a link the peripheral
    /// dropped, never for one the gateway closed itself.
    public func nextDelivery() -> Delivery {
        if crashed || closedByGateway { return .idle }
        switch peripheral.nextNotification(linkID) {
        case .notification(let bytes, let requestsAnswered):
            lastNotificationRequestsAnswered = requestsAnswered
            return .notification(bytes)
        case .idle: return .idle
        case .linkLost: return .linkLost
        }
    }

    /// When the peripheral next records a live event on this link, if it does.
    public var nextLiveEventAt: Double? {
        isLinked ? peripheral.nextLiveEventAt(linkID) : nil
    }

    public func liveEventDue(now: Double) {
        peripheral.liveEventDue(linkID, now: now)
    }
}
