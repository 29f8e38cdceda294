#if canImport(Glibc)
    import Glibc
#endif

/// The size of the file at `path` (following symlinks), nil when it cannot be stat'ed. A plain stat():
/// FileManager's attributes also resolve the owner's and group's names, reading /etc/passwd and /etc/group on
/// every call, which the daemon's periodic storage checks do not need.
public func fileSize(atPath path: String) -> Int64? {
    var info = stat()
    guard stat(path, &info) == 0 else { return nil }
    return Int64(info.st_size)
}
