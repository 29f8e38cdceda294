// swift-tools-version:6.0
// Ferry: a BLE central gateway for Linux/BlueZ. One module per concern; see README.md.
import PackageDescription

/// Links `archive` (a Debian -dev package's static library, by file name) instead of the shared library.
func linkingStatically(_ archive: String) -> [LinkerSetting] {
    [.unsafeFlags(["-Xlinker", "-l:\(archive)"])]
}

/// libdbus from Debian's libdbus-1-dev, linked as its static archive. The shared libdbus-1.so.3 links libsystemd
/// (for a bus server's socket activation, which a client never uses), and with it six more libraries (libgcrypt,
/// liblzma, libzstd, liblz4, libcap, libgpg-error) that every start of `ferry` had to map and relocate: in the
/// test bed that was some 30 % of `ferry --version`'s CPU. FerryDBus defines the two libsystemd functions the archive
/// refers to (DBusSystemdStubs.swift). The headers' paths are what `pkg-config --cflags dbus-1` gives on Debian.
let staticDBus: (swift: [SwiftSetting], linker: [LinkerSetting]) = {
    #if arch(x86_64)
        let multiarch = "x86_64-linux-gnu"
    #elseif arch(arm64)
        let multiarch = "aarch64-linux-gnu"
    #elseif arch(arm)
        let multiarch = "arm-linux-gnueabihf"
    #else
        let multiarch = "unknown"
    #endif
    return (
        [.unsafeFlags(["-Xcc", "-I/usr/include/dbus-1.0", "-Xcc", "-I/usr/lib/\(multiarch)/dbus-1.0/include"])],
        linkingStatically("libdbus-1.a")
    )
}()

/// How the `ferry` executable is linked: every start of a process pays the dynamic loader for what the binary leaves
/// to it. Both changes below together: `ferry --version` 2.78 M → 0.93 M instructions (callgrind), 79 → 66 ms of
/// CPU in the test bed.
/// - libstdc++, which the static Swift runtime needs, from its static archive (libstdc++-12-dev): the shared
///   libstdc++.so cost ld.so some 1.6 M instructions of symbol lookups at every start. swiftc's static-stdlib
///   link line always says `-lstdc++`; `Sources/ferry/link/libstdc++.so` is a one-line linker script that names
///   the archive instead, found first because its directory comes before the compiler's in the library search
///   path. Its symbols stay local (`--exclude-libs ALL`, from the same link line). A link with the Swift runtime
///   as shared libraries takes nothing from the archive: nothing in Ferry's own code calls C++.
/// - lld with DT_RELR (`-z pack-relative-relocs`; glibc 2.36, Debian 12): the binary's 41 000 relative
///   relocations as an 8 KB bitmap instead of a 990 KB table. gold, swiftc's default linker on Linux, cannot
///   write it; lld ships with the Swift toolchain.
let executableLink: [LinkerSetting] = [
    .unsafeFlags([
        "-use-ld=lld", "-Xlinker", "-z", "-Xlinker", "pack-relative-relocs",
        "-L", "\(Context.packageDirectory)/Sources/ferry/link",
    ])
]

let package = Package(
    name: "Ferry",
    platforms: [.macOS(.v14)],
    products: [
        .executable(name: "ferry", targets: ["ferry"]),
    ],
    targets: [
        // C libraries from Debian, as system library targets. SQLite and zlib are linked from their static archives
        // (libsqlite3-dev's and zlib1g-dev's, set on FerryStore and FerryUplink): two shared libraries fewer to find,
        // map and relocate at every start (`ferry --version` 4.0 M -> 2.8 M instructions), and SQLite's calls to
        // its own API go direct instead of through the PLT (a window commit some 1.6 % fewer instructions). No
        // pkgConfig: its --libs would put the shared libraries on the link line as well.
        .systemLibrary(
            name: "CSQLite", path: "Sources/CSQLite",
            providers: [.apt(["libsqlite3-dev"])]),
        // libcurl's headers only: the library is loaded at first use (dlopen, see Sources/CCurl/shim.h), so
        // no pkgConfig here, whose --libs would link it (and its dependencies) into every start of ferry.
        .systemLibrary(
            name: "CCurl", path: "Sources/CCurl",
            providers: [.apt(["libcurl4-openssl-dev"])]),
        .systemLibrary(
            name: "CZlib", path: "Sources/CZlib",
            providers: [.apt(["zlib1g-dev"])]),
        // libdbus is linked statically (see `staticDBus` above), so no pkgConfig here: its --libs would link the
        // shared library as well.
        .systemLibrary(
            name: "CDBus", path: "Sources/CDBus",
            providers: [.apt(["libdbus-1-dev"])]),
        // libbluetooth's headers only (HCI and mgmt socket constants and structs): no function of the library is
        // called, so it is not linked, and a start of ferry loads one shared library fewer.
        .systemLibrary(
            name: "CBluetooth", path: "Sources/CBluetooth",
            providers: [.apt(["libbluetooth-dev"])]),
        // System calls Swift cannot make (variadic syscall/prctl; Linux headers only, nothing linked): the futex of
        // ThreadExecutor's sleep and wake, and the process's opt-out of transparent huge pages.
        .systemLibrary(name: "CSyscall", path: "Sources/CSyscall"),

        // The one way to do small shared things: JSON writer, civil time / RFC 3339, backoff, version, a locked value,
        // a wake-up for waiting loops, an executor with a thread of its own. No C beyond CSyscall's system calls.
        .target(name: "FerryCore", dependencies: ["CSyscall"]),
        // Pure protocol logic: frames, CRC, STREAM_INFO, the sync session state machine. No I/O, no C.
        .target(name: "FerryProtocol"),
        // Durable store over SQLite: staged frames, transactional outbox, cursors.
        .target(
            name: "FerryStore", dependencies: ["CSQLite", "FerryCore", "FerryProtocol"],
            linkerSettings: linkingStatically("libsqlite3.a")),
        // Outbox forwarder to the backend over HTTP(S).
        .target(
            name: "FerryUplink", dependencies: ["FerryCore", "FerryStore", "FerryProtocol", "CCurl", "CZlib"],
            linkerSettings: linkingStatically("libz.a")),
        // libdbus bindings: connection, marshalling, signals.
        .target(
            name: "FerryDBus", dependencies: ["FerryCore", "CDBus"], swiftSettings: staticDBus.swift,
            linkerSettings: staticDBus.linker),
        // BlueZ client over D-Bus: adapter, device, GATT.
        .target(name: "FerryBlueZ", dependencies: ["FerryCore", "FerryDBus", "CBluetooth"]),
        // BLE-agnostic sync: the session runner over any SyncTransport, its typed end, the live session loop,
        // the scheduler, dump ingest. No BlueZ, D-Bus or HTTP: the simulator and `ferry ingest` need none.
        .target(name: "FerrySync", dependencies: ["FerryCore", "FerryProtocol", "FerryStore"]),
        // In-process simulated Sync peripheral (tests, demo, benchmarks).
        .target(name: "FerrySimulator", dependencies: ["FerryCore", "FerryProtocol", "FerrySync"]),
        // BlueZ- and daemon-specific wiring: BlueZ transport, daemon, config, pairing, metrics.
        .target(name: "FerryGateway", dependencies: ["FerryCore", "FerryProtocol", "FerryStore", "FerrySync", "FerryUplink", "FerryBlueZ"]),
        // Command line: argument parsing and subcommands (library so tests can call it in-process).
        .target(name: "FerryCLI", dependencies: ["FerryCore", "FerrySync", "FerryGateway", "FerryStore", "FerryUplink", "FerryProtocol", "FerrySimulator", "FerryBlueZ", "FerryDBus"]),
        .executableTarget(
            name: "ferry", dependencies: ["FerryCLI", "CSyscall"], exclude: ["link"], linkerSettings: executableLink),

        // Test tools shared by test targets (libraries, since a test target cannot depend on another): a private
        // dbus-daemon per test, a fake org.bluez on it, and a temporary directory.
        .target(name: "FerryTestBus", dependencies: ["FerryCore", "FerryDBus"], path: "Tests/FerryTestBus"),
        .target(name: "FerryFakeBlueZ", dependencies: ["FerryCore", "FerryTestBus", "FerryDBus", "FerryBlueZ"], path: "Tests/FerryFakeBlueZ"),
        .target(name: "FerryTestSupport", path: "Tests/FerryTestSupport"),

        // One test target per library module; FerryIntegrationTests for whole sessions across modules.
        .testTarget(name: "FerryCoreTests", dependencies: ["FerryCore"]),
        .testTarget(name: "FerryProtocolTests", dependencies: ["FerryProtocol", "FerrySimulator"]),
        .testTarget(name: "FerryStoreTests", dependencies: ["FerryCore", "FerryStore", "FerryProtocol"]),
        .testTarget(name: "FerrySyncTests", dependencies: ["FerryCore", "FerrySync", "FerryStore", "FerryProtocol"]),
        .testTarget(name: "FerrySimulatorTests", dependencies: ["FerrySimulator", "FerryProtocol", "FerryTestSupport"]),
        .testTarget(name: "FerryUplinkTests", dependencies: ["FerryUplink", "FerryStore", "FerryProtocol"]),
        .testTarget(name: "FerryDBusTests", dependencies: ["FerryDBus", "FerryTestBus"]),
        .testTarget(name: "FerryBlueZTests", dependencies: ["FerryCore", "FerryBlueZ", "FerryDBus", "FerryTestBus", "FerryFakeBlueZ"]),
        .testTarget(
            name: "FerryGatewayTests",
            dependencies: [
                "FerryCore", "FerryGateway", "FerryBlueZ", "FerryDBus", "FerrySync", "FerryStore", "FerryProtocol", "FerrySimulator",
                "FerryTestBus", "FerryFakeBlueZ", "FerryTestSupport",
            ]),
        .testTarget(
            name: "FerryIntegrationTests",
            dependencies: ["FerrySync", "FerryGateway", "FerryStore", "FerryProtocol", "FerrySimulator", "FerryTestSupport"]),
        .testTarget(name: "FerryCLITests", dependencies: ["FerryCLI", "FerryStore", "FerryTestBus", "FerryGateway", "FerryProtocol"]),
    ],
    swiftLanguageModes: [.v6]
)

// Ferry's own code refers to a concrete type's metadata through the type's accessor, not through a mangled name the
// runtime demangles and looks up at first use (the compiler's default, for smaller code). Every generic type a
// process touched first cost that demangling: 19 % of the instructions up to a sync's bus connection (callgrind),
// some 4 % of a window-20 sync's CPU in the test bed. The binary grows by 40 KB.
for target in package.targets where target.type == .regular || target.type == .executable {
    target.swiftSettings = (target.swiftSettings ?? [])
        + [.unsafeFlags(["-Xfrontend", "-disable-concrete-type-metadata-mangled-name-accessors"])]
}
