import FerryBlueZ
import FerryDBus
import FerryFakeBlueZ
import FerryProtocol
import FerryTestBus
import Foundation
import Testing
import FerryTestSupport

#if canImport(Glibc)
    import Glibc
#endif

/// `ferry sync` (the built executable) against the fake org.bluez, the test playing the peripheral: its JSON
/// (keys, phases, discovery_needed), its exit status and its store, for the connect → resolve → transport →
/// runner → classify sequence it shares with `ferry run`.
@Suite(.serialized) struct SyncCommandProcessTests {
    struct Run {
        var status: Int32?
        var json: [String: Any]
        var stdout: String
        var stderr: String
        /// The store's WAL file was still there after the process exited.
        var walKept = false
    }

    /// Runs `ferry sync --json` for the fake's device while answering each SYNC_REQ with DATA up to `head`.
    func sync(
        head: UInt64, answer: Bool = true, extra: [String] = [], tree: FakeBlueZ.Tree? = nil,
        configure: (inout FakeBlueZ.State) -> Void = { _ in }
    ) async throws -> (Run, FakeBlueZ) {
        let bus = try TestBus()
        var tree = tree ?? [:]
        if tree.isEmpty {
            tree = FakeBlueZ.adapterOnly()
            tree[FakeBlueZ.devicePath] = FakeBlueZ.deviceInterfaces(resolved: true)
            tree.merge(FakeBlueZ.gattObjects()) { $1 }
        }
        let fake = try await FakeBlueZ.start(on: bus, tree: tree)
        fake.state.withLock {
            $0.streamInfo = StreamInfo(epoch: 7, oldest: 1, head: head).encoded()
            configure(&$0)
        }
        let scratch = try TemporaryDirectory("sync")
        defer { scratch.remove() }
        let directory = scratch.url

        // The peripheral: every SYNC_REQ written is answered with the window's frames, one per notification.
        let peripheral = Task(executorPreference: FakeSideExecutor.shared) {
            var answered: Set<Int> = []
            while !Task.isCancelled {
                fake.pumpAcquiredWrites()  // the SYNC_ACKs sent on CONTROL's write socket
                let writes = fake.state.withLock { $0.writes }
                for write in writes where !answered.contains(write.id) {
                    answered.insert(write.id)
                    var decoder = FrameDecoder()
                    decoder.feed(write.bytes) { frame in
                        guard answer, frame.type == .syncRequest, let window = frame.requestedWindow else { return }
                        let last = min(head, frame.seq + UInt64(window))
                        guard last > frame.seq else { return }
                        for seq in (frame.seq + 1)...last {
                            _ = fake.notifyThroughSocket(Frame.data(seq: seq, payload: Array("event \(seq)".utf8)).encoded())
                        }
                    }
                }
                try? await Task.sleep(for: .milliseconds(5))
            }
        }
        defer { peripheral.cancel() }

        let process = Process()
        let testBinary = URL(fileURLWithPath: "/proc/self/exe").resolvingSymlinksInPath()
        process.executableURL = testBinary.deletingLastPathComponent().appendingPathComponent("ferry")
        process.arguments = [
            "sync", "--address", FakeBlueZ.deviceAddress, "--db", directory.appendingPathComponent("ferry.db").path,
            "--bus", bus.address, "--json", "--verbose",
        ] + extra
        let out = directory.appendingPathComponent("stdout"), err = directory.appendingPathComponent("stderr")
        _ = FileManager.default.createFile(atPath: out.path, contents: nil)
        _ = FileManager.default.createFile(atPath: err.path, contents: nil)
        process.standardOutput = try FileHandle(forWritingTo: out)
        process.standardError = try FileHandle(forWritingTo: err)
        process.standardInput = FileHandle.nullDevice
        try process.run()
        // Waited for off the cooperative pool, where the fake answers the process's calls.
        let status = try await blocking { () -> Int32? in
            let deadline = Date().addingTimeInterval(60)
            while process.isRunning && Date() < deadline { usleep(20_000) }
            if process.isRunning { process.terminate(); return nil }
            return process.terminationStatus
        }
        let stdout = (try? String(contentsOf: out, encoding: .utf8)) ?? ""
        let stderr = (try? String(contentsOf: err, encoding: .utf8)) ?? ""
        let json = (try? JSONSerialization.jsonObject(with: Data(stdout.utf8))) as? [String: Any] ?? [:]
        let walKept = FileManager.default.fileExists(atPath: directory.appendingPathComponent("ferry.db-wal").path)
        return (Run(status: status, json: json, stdout: stdout, stderr: stderr, walKept: walKept), fake)
    }

    @Test func aSyncToTheHeadPrintsItsJSONAndExitsZero() async throws {
        let (run, fake) = try await sync(head: 45)
        defer { fake.stop() }
        #expect(run.status == 0, "\(run.stdout) \(run.stderr)")
        #expect(run.json["result"] as? String == "caught up", "\(run.stdout) \(run.stderr)")
        #expect(run.json["frames_stored"] as? Int == 45)
        #expect(run.json["cursor"] as? String == "45" && run.json["epoch"] as? String == "7")
        #expect(run.json["discovery_needed"] as? Bool == false, "BlueZ knew the device")
        #expect(run.json["notify_path"] as? String == "acquireNotify")
        #expect(run.json["mtu"] as? Int == 247)
        let keys: Set<String> = [
            "address", "result", "frames_stored", "duplicates", "gaps", "regressions", "corrupt", "crc_mismatches",
            "stalls", "epoch", "cursor", "notify_path", "mtu", "duration_seconds", "discovery_needed", "phases",
            "phases_cpu",
        ]
        #expect(Set(run.json.keys) == keys)
        let phases = run.json["phases"] as? [String: Any] ?? [:]
        #expect(
            Set(phases.keys) == [
                "discovery", "connect", "services_resolved", "stream_info", "subscribed", "first_data", "last_data",
                "caught_up", "final_ack", "disconnected",
            ], "\(phases)")
        #expect(phases.values.allSatisfy { $0 is Double }, "every phase happened: \(phases)")
        let cpu = run.json["phases_cpu"] as? [String: Any] ?? [:]
        #expect(
            cpu["start"] is Double && cpu["connect"] is Double && cpu["disconnected"] is Double
                && Set(cpu.keys).subtracting(["start"]).isSubset(of: Set(phases.keys)),
            "CPU at the start and at the phase marks: \(cpu)")
        #expect(run.stderr.contains("connected to \(FakeBlueZ.deviceAddress)"), "\(run.stderr)")
        // The SYNC_ACKs went out as writes without response on CONTROL's write socket, the last one for the head
        // (confirmed with a response before the link ended).
        fake.pumpAcquiredWrites()
        let writes = fake.state.withLock { $0.writes }
        let acks = writes.filter { $0.type == "command" }
        #expect(
            !acks.isEmpty && acks.allSatisfy { $0.viaSocket },
            "\(writes.map { ($0.type, $0.viaSocket) }); ferry's log: \(run.stderr)")
        #expect(acks.last?.bytes == Frame.syncAck(committed: 45).encoded())
        #expect(writes.last.map { $0.type == "request" && $0.bytes == Frame.syncAck(committed: 45).encoded() } == true)
        #expect(fake.calls.contains("Device1.Disconnect \(FakeBlueZ.devicePath)"))
        #expect(run.walKept, "the next sync writes over this one's WAL file")
    }

    @Test func aSilentPeripheralIsNoResponseAndExitsNonZero() async throws {
        let (run, fake) = try await sync(head: 10, answer: false)
        defer { fake.stop() }
        #expect(run.status == 1, "\(run.stdout) \(run.stderr)")
        #expect(run.json["result"] as? String == "no response from the peripheral after 3 SYNC_REQs", "\(run.stdout)")
        #expect(run.json["frames_stored"] as? Int == 0)
        #expect(run.stderr.contains("did not finish: no response"), "\(run.stderr)")
    }

    @Test func anUnbondedPeripheralUnderRequireBondIsRefusedBeforeAnyConnect() async throws {
        let (run, fake) = try await sync(head: 10, extra: ["--require-bond"])
        defer { fake.stop() }
        #expect(run.status != 0 && run.stdout.isEmpty, "\(run.stdout)")
        #expect(run.stderr.contains("is not bonded with this gateway (--require-bond)"), "\(run.stderr)")
        #expect(!fake.calls.contains("Device1.Connect \(FakeBlueZ.devicePath)"))
    }

    @Test func aPeripheralWithoutTheSyncServiceIsNamedAndDisconnected() async throws {
        let tree = FakeBlueZ.batteryOnlyDevice()
        let (run, fake) = try await sync(head: 10, extra: ["--timeout", "15"], tree: tree)
        defer { fake.stop() }
        #expect(run.status == 1 && run.stdout.isEmpty, "\(run.stdout)")
        #expect(run.stderr.contains("is not a Sync peripheral"), "\(run.stderr)")
        #expect(fake.calls.contains("Device1.Connect \(FakeBlueZ.devicePath)"))
        #expect(fake.calls.contains("Device1.Disconnect \(FakeBlueZ.devicePath)"))
    }

    @Test func aDiscoveryThatNeverStartsSaysSoRatherThanDeviceNotFound() async throws {
        // BlueZ does not know the device, so `ferry sync` must discover; bluetoothd never answers StartDiscovery.
        let (run, fake) = try await sync(head: 10, extra: ["--timeout", "5"], tree: FakeBlueZ.adapterOnly()) {
            $0.startDiscoveryDelay = .seconds(600)
        }
        defer { fake.stop() }
        #expect(run.status == 1 && run.stdout.isEmpty, "\(run.stdout)")
        #expect(run.stderr.contains("discovery on hci0 did not start (bluetoothd gave no answer)"), "\(run.stderr)")
        #expect(!run.stderr.contains("not found"), "\(run.stderr)")
    }

    @Test func aDiscoveryThatNeverStartsIsWaitedForNoLongerThanTimeout() async throws {
        // bluetoothd's start may take 10 s by default, but --timeout is the user's bound on the whole command.
        // The message names the start wait actually used (what is left of --timeout, rounded up), so this checks
        // the bound that was applied, not how fast this machine is.
        let (run, fake) = try await sync(head: 10, extra: ["--timeout", "4"], tree: FakeBlueZ.adapterOnly()) {
            $0.startDiscoveryDelay = .seconds(600)
        }
        defer { fake.stop() }
        #expect(run.status == 1 && run.stdout.isEmpty, "\(run.stdout)")
        let bound = run.stderr.firstMatch(of: /no answer to the discovery start within (\d+) s/).flatMap { Int($0.1) }
        #expect(bound != nil && bound! <= 4, "\(run.stderr)")
    }
}
