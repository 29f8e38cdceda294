#if canImport(Glibc)
    import Glibc
#endif

/// The directory part of `path`, as dirname(1) gives it: "." when the path has no slash, "/" for the root.
/// Trailing slashes do not make a component ("/var/lib/ferry/" → "/var/lib").
public func directoryName(of path: String) -> String {
    var bytes = Array(path.utf8)
    while bytes.count > 1, bytes.last == UInt8(ascii: "/") { bytes.removeLast() }
    guard let slash = bytes.lastIndex(of: UInt8(ascii: "/")) else { return "." }
    var end = slash
    while end > 0, bytes[end - 1] == UInt8(ascii: "/") { end -= 1 }
    return end == 0 ? "/" : String(decoding: bytes[..<end], as: UTF8.self)
}

/// `name` inside `directory`, with exactly one slash between them ("" means the current directory).
public func joiningPath(_ directory: String, _ name: String) -> String {
    if directory.isEmpty { return name }
    return directory.hasSuffix("/") ? directory + name : directory + "/" + name
}

/// `mkdir -p`: creates `path` and any missing parent with `mode` (narrowed by the umask); nil when it exists as
/// a directory afterwards, else the errno of the step that failed (EEXIST: `path` is a file; ENOTDIR: a parent is).
public func createDirectories(_ path: String, mode: mode_t) -> Int32? {
    var info = stat()
    if stat(path, &info) == 0 { return (info.st_mode & S_IFMT) == S_IFDIR ? nil : EEXIST }
    let parent = directoryName(of: path)
    if parent != path, let failure = createDirectories(parent, mode: mode) {
        return failure == EEXIST ? ENOTDIR : failure  // a parent that is a file
    }
    if mkdir(path, mode) == 0 || errno == EEXIST && stat(path, &info) == 0 && (info.st_mode & S_IFMT) == S_IFDIR {
        return nil
    }
    return errno
}
