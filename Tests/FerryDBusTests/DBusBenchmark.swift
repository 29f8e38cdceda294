import FerryDBus
import Foundation
import Testing
import FerryTestBus

/// Round-trip throughput against a real dbus-daemon. Not a timed assertion: it only runs when asked,
/// and prints what it measured. Run it in a release build:
///   FERRY_DBUS_BENCH=1 swift test -c release --filter DBusBenchmark
@Suite("FerryDBus benchmark", .serialized, .enabled(if: ProcessInfo.processInfo.environment["FERRY_DBUS_BENCH"] != nil, "set FERRY_DBUS_BENCH=1 to run"))
struct DBusBenchmark {
    @Test func roundTripCallsPerSecond() async throws {
        let bus = try TestBus()
        let service = try await bus.connect()
        try service.export(path: "/bench") { call in .reply(call.arguments) }
        let client = try await bus.connect()
        let payload: [DBusValue] = [.bytes([UInt8](repeating: 0xA5, count: 20)), .uint16(1)]

        func measure(_ label: String, count: Int, inFlight: Int, _ body: @escaping @Sendable () async throws -> Void)
            async throws
        {
            for _ in 0..<200 { try await body() }  // warm-up
            let start = ContinuousClock.now
            try await withThrowingTaskGroup(of: Void.self) { group in
                for worker in 0..<inFlight {
                    let share = count / inFlight + (worker < count % inFlight ? 1 : 0)
                    group.addTask { for _ in 0..<share { try await body() } }
                }
                try await group.waitForAll()
            }
            let seconds = Double((ContinuousClock.now - start) / .milliseconds(1)) / 1000
            print(
                "dbus-bench \(label): \(count) calls, \(inFlight) in flight: "
                    + "\(Int(Double(count) / seconds)) calls/s (\(String(format: "%.1f", seconds * 1e6 / Double(count))) µs each)")
        }

        var connectTimes: [Duration] = []
        for _ in 0..<20 {
            let start = ContinuousClock.now
            let connection = try await bus.connect()
            _ = try await connection.listNames()
            connectTimes.append(ContinuousClock.now - start)
            connection.close()
        }
        connectTimes.sort()
        print("dbus-bench connect + first call: median \(connectTimes[10]), max \(connectTimes[19]) (20 connections)")

        try await measure("bus driver GetNameOwner", count: 20_000, inFlight: 1) {
            _ = try await client.nameOwner("org.freedesktop.DBus")
        }
        let serviceName = service.uniqueName
        try await measure("echo peer (ay,q)", count: 20_000, inFlight: 1) {
            _ = try await client.call(
                destination: serviceName, path: "/bench", interface: "com.example.Bench", member: "Echo", arguments: payload)
        }
        try await measure("echo peer (ay,q)", count: 50_000, inFlight: 32) {
            _ = try await client.call(
                destination: serviceName, path: "/bench", interface: "com.example.Bench", member: "Echo", arguments: payload)
        }
    }

    /// The StartNotify path's ceiling: PropertiesChanged(Value) signals from one peer to a subscriber.
    @Test func signalsPerSecond() async throws {
        let bus = try TestBus()
        let emitter = try await bus.connect()
        let client = try await bus.connect()
        let stream = try await client.signals(
            matching: .propertiesChanged(sender: emitter.uniqueName, interface: "org.bluez.GattCharacteristic1"))
        let count = 50_000
        let value = DBusValue.bytes([UInt8](repeating: 0xA5, count: 20))
        let start = ContinuousClock.now
        let emitting = Task {
            for _ in 0..<count {
                try emitter.emitSignal(
                    path: "/org/bluez/hci0/dev_X/service0010/char0011", interface: "org.freedesktop.DBus.Properties",
                    member: "PropertiesChanged",
                    arguments: [.string("org.bluez.GattCharacteristic1"), .properties(["Value": value]), .strings([])])
            }
        }
        var received = 0
        for await signal in stream {
            if signal.arguments[1].dictionary?["Value"]?.bytes?.count == 20 { received += 1 }
            if received == count { break }
        }
        try await emitting.value
        let seconds = Double((ContinuousClock.now - start) / .milliseconds(1)) / 1000
        print("dbus-bench PropertiesChanged(Value ay[20]) signals: \(received)/\(count) in \(seconds) s = \(Int(Double(received) / seconds)) signals/s")
    }
}
