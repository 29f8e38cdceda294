/// Why a Device1.Connect (or the session right after it) failed, grouped by what helps.

import FerryCore
public enum ConnectFailureClass: String, Sendable, Equatable, CaseIterable {
    /// Radio-level hiccup (le-connection-abort-by-local, le-connection-timeout, "Software caused
    /// connection abort", page timeout, our own call timeout...): retry with backoff.
    case transient
    /// BlueZ holds stale state for the device (InProgress on Connect): disconnect it (remove it only when it
    /// is not bonded), retry once.
    case staleState
    /// Controller out of connection slots ("Limited Resources", concurrent-connection-limit):
    /// back off much longer, other links must end first.
    case resourcesExhausted
    /// The device object is gone (removed, or aged out of BlueZ's cache): rediscover it first.
    case deviceVanished
    /// Adapter powered off, not ready or removed: wait for it; retrying Connect cannot help.
    case adapterUnavailable
    /// bluetoothd is not on the bus (crashed, restarting): wait for it to come back.
    case bluetoothdUnavailable
    /// Already connected: not a failure.
    case alreadyConnected
    /// Will fail the same way again (not supported, not permitted, authentication, bad arguments).
    case permanent
}

public enum ConnectFailureClassifier {
    /// Classifies by error kind first, then by the text BlueZ puts in org.bluez.Error.Failed, which is
    /// where it reports the LE connect errno strings.
    public static func classify(_ error: BlueZError) -> ConnectFailureClass {
        let message = error.message.lowercased()
        switch error.kind {
        case .alreadyConnected:
            return .alreadyConnected
        case .inProgress:
            return .staleState
        case .doesNotExist, .unknownObject, .notFound:
            return .deviceVanished
        case .notReady:
            return .adapterUnavailable
        case .serviceUnknown, .disconnected:
            return .bluetoothdUnavailable
        case .timeout, .connectionAttemptFailed, .notConnected:
            return .transient
        case .notSupported, .notPermitted, .notAuthorized, .authenticationFailed, .authenticationCanceled,
            .authenticationRejected, .authenticationTimeout, .invalidArguments, .accessDenied, .invalidValueLength,
            .invalidOffset, .alreadyExists:
            return .permanent
        case .failed, .notAvailable, .other, .unexpectedReply:
            if message.contains("limited resources") || message.contains("concurrent-connection-limit")
                || message.contains("connection limit") || message.contains("cannot allocate memory")
            {
                return .resourcesExhausted
            }
            if message.contains("adapter-not-powered") || message.contains("not powered")
                || message.contains("resource not ready") || message.contains("no such device")
            {
                return .adapterUnavailable
            }
            if message.contains("already-connected") || message.contains("already connected") {
                return .alreadyConnected
            }
            if message.contains("busy") || message.contains("already in progress") {
                return .staleState
            }
            if message.contains("not-supported") || message.contains("invalid-arguments") {
                return .permanent
            }
            // abort-by-local/remote, timeout, refused, host down, link-layer errors, gatt-browsing,
            // unknown: a fresh attempt may work; the retry budget bounds it.
            return .transient
        }
    }
}

/// What to do after a failed connect attempt.
public enum ConnectRecovery: Sendable, Equatable {
    /// Try Connect again after the delay.
    case retry(after: Duration)
    /// Disconnect the device (and remove it if `remove`: never for a bonded device), then retry after the delay.
    case resetDeviceThenRetry(remove: Bool, after: Duration)
    /// Run discovery until the device reappears, then retry.
    case rediscoverThenRetry(after: Duration)
    /// Wait until the adapter is present and powered (or bluetoothd is back), then retry.
    case waitForAdapter
    case waitForBluetoothd
    /// Connected after all.
    case proceed
    case giveUp(reason: String)
}

/// Retry budget and backoff per failure class. A value type: it decides, the caller sleeps.
/// The random source is injected so tests are deterministic; `now` comes from the caller's clock so
/// the budget can refill after a quiet period.
public struct ConnectRetryPolicy: Sendable {
    public struct Configuration: Sendable, Equatable {
        public var transientBase: Duration = .milliseconds(500)
        public var transientCap: Duration = .seconds(15)
        public var maxTransientAttempts = 6
        public var resourceBase: Duration = .seconds(5)
        public var resourceCap: Duration = .seconds(60)
        public var maxResourceAttempts = 5
        /// InProgress: one reset. The first retry disconnects, a repeat also removes the device — unless it is
        /// bonded: then only Disconnect and the longer `resourceBase` backoff, and the caller's own backoff after
        /// giving up (the bond is the operator's; removing it is never Ferry's call).
        public var maxStaleResets = 2
        public var maxRediscoveries = 2
        /// After this long without a failure, the budget starts over.
        public var forgetAfter: Duration = .seconds(300)

        public init() {}
    }

    public var configuration: Configuration
    private let random: @Sendable () -> Double
    private var attempts: [ConnectFailureClass: Int] = [:]
    /// A `MonotonicClock` reading.
    private var lastFailure: Double?

    /// `random` must return values in [0, 1).
    public init(configuration: Configuration = Configuration(), random: @escaping @Sendable () -> Double = { Double.random(in: 0..<1) }) {
        self.configuration = configuration
        self.random = random
    }

    public func attempts(of failureClass: ConnectFailureClass) -> Int { attempts[failureClass] ?? 0 }

    /// Call after a successful connect: the budget starts over.
    public mutating func reset() {
        attempts.removeAll()
        lastFailure = nil
    }

    /// `now`: a `MonotonicClock` reading. `bonded`: BlueZ holds keys for the device (Paired/Bonded), read just
    /// before the call.
    public mutating func next(after error: BlueZError, now: Double, bonded: Bool = false) -> ConnectRecovery {
        if let lastFailure, now - lastFailure >= configuration.forgetAfter.inSeconds { attempts.removeAll() }
        lastFailure = now
        let failureClass = ConnectFailureClassifier.classify(error)
        let n = (attempts[failureClass] ?? 0) + 1
        attempts[failureClass] = n
        let c = configuration
        switch failureClass {
        case .alreadyConnected:
            return .proceed
        case .transient:
            guard n <= c.maxTransientAttempts else { return .giveUp(reason: "\(n - 1) transient failures, last: \(error)") }
            return .retry(after: backoff(attempt: n, base: c.transientBase, cap: c.transientCap))
        case .resourcesExhausted:
            guard n <= c.maxResourceAttempts else { return .giveUp(reason: "no free connection slot: \(error)") }
            return .retry(after: backoff(attempt: n, base: c.resourceBase, cap: c.resourceCap))
        case .staleState:
            guard n <= c.maxStaleResets else { return .giveUp(reason: "stale BlueZ state persists: \(error)") }
            if bonded {
                return .resetDeviceThenRetry(remove: false, after: backoff(attempt: n, base: c.resourceBase, cap: c.resourceCap))
            }
            return .resetDeviceThenRetry(remove: n > 1, after: backoff(attempt: n, base: c.transientBase, cap: c.transientCap))
        case .deviceVanished:
            guard n <= c.maxRediscoveries else { return .giveUp(reason: "device not found again: \(error)") }
            return .rediscoverThenRetry(after: backoff(attempt: n, base: c.transientBase, cap: c.transientCap))
        case .adapterUnavailable:
            return .waitForAdapter
        case .bluetoothdUnavailable:
            return .waitForBluetoothd
        case .permanent:
            return .giveUp(reason: "\(error)")
        }
    }

    /// Exponential backoff with "equal jitter": half the step is fixed, half random. Full jitter could
    /// pick ~0 and hammer a controller that just aborted; no jitter would synchronise gateways.
    func backoff(attempt: Int, base: Duration, cap: Duration) -> Duration {
        let step = Backoff.ceiling(base: base, cap: cap, doublings: attempt - 1)
        let r = min(max(random(), 0), 0.999_999)
        return step / 2 + step / 2 * r
    }
}
