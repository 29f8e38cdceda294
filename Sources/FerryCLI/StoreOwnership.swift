import FerryCore
import FoundationEssentials

#if canImport(Glibc)
    import Glibc
#endif

/// Root must not write a store that belongs to the service user. SQLite creates the -wal and -shm files with
/// the opener's owner, so one `sudo ferry pair` against /var/lib/ferry/ferry.sqlite leaves root-owned files
/// that `ferry run` (user ferry) then cannot open: the daemon fails until someone chowns them. Instead of
/// changing identity behind the operator's back, the command refuses and says what to type.
enum StoreOwnership {
    /// Throws when running as root and the store (or, before it exists, its directory) belongs to another user.
    static func requireCallerOwns(_ dbPath: String, command: String) throws {
        guard geteuid() == 0 else { return }  // anyone else simply cannot open another user's 0700 directory
        var info = stat()
        let target = stat(dbPath, &info) == 0 ? dbPath : directoryName(of: dbPath)
        guard target == dbPath || stat(target, &info) == 0, info.st_uid != 0 else { return }
        let owner = userName(info.st_uid)
        throw CommandFailure(
            "\(target) belongs to \(owner), not root: run this as \(owner) so the store stays writable by the service "
                + "(sudo -u \(owner) ferry \(command) ...)")
    }

    private static func userName(_ uid: uid_t) -> String {
        guard let entry = getpwuid(uid), let name = entry.pointee.pw_name else { return "uid \(uid)" }
        return String(cString: name)
    }
}
