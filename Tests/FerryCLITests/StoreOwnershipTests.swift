import FerryCLI
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// `sudo ferry pair` against the service's store must not leave root-owned files behind (SQLite creates -wal
/// and -shm with the opener's owner): as root, pair and unpair refuse a store that belongs to another user and
/// say what to type. Needs root to set up (chown), so it only runs as root, and shows as skipped otherwise.
@Suite(.enabled(if: geteuid() == 0, "needs root to chown the store to another user")) struct StoreOwnershipTests {
    @Test func rootIsToldToRunAsTheStoreOwnerAndNothingIsCreated() throws {
        let dir = try TemporaryDirectory()
        let state = dir.file("state")
        try FileManager.default.createDirectory(atPath: state, withIntermediateDirectories: false)
        #expect(chown(state, 65534, 65534) == 0)  // nobody, like the ferry user owning /var/lib/ferry
        let owner = String(cString: getpwuid(65534)!.pointee.pw_name)
        let db = state + "/ferry.sqlite"
        // Before the store exists: judged by its directory (the dead bus is never reached).
        let pair = ferry("pair", "--address", peripheral, "--db", db, "--bus", "unix:path=/nonexistent/bus")
        #expect(pair.status == 1)
        #expect(pair.stderr == ["ferry: \(state) belongs to \(owner), not root: run this as \(owner) so the store stays writable by the service (sudo -u \(owner) ferry pair ...)"])
        #expect(try dir.entries() == ["state"] && FileManager.default.contentsOfDirectory(atPath: state).isEmpty)
        // An existing store owned by that user: unpair refuses too, before opening it.
        #expect(FileManager.default.createFile(atPath: db, contents: Data("x".utf8)))
        #expect(chown(db, 65534, 65534) == 0)
        let unpair = ferry("unpair", peripheral, "--db", db, "--bus", "unix:path=/nonexistent/bus")
        #expect(unpair.status == 1)
        #expect(unpair.stderr.first?.hasPrefix("ferry: \(db) belongs to \(owner), not root") == true, "\(unpair.stderr)")
        #expect(try FileManager.default.contentsOfDirectory(atPath: state) == ["ferry.sqlite"])
    }
}
