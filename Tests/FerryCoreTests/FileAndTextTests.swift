import FerryCore
import Foundation
import Testing

/// The small file and text helpers that replace Foundation's (Ferry links FoundationEssentials only): the same
/// results for the cases Ferry relies on.
@Suite struct FilePathTests {
    @Test(arguments: [
        ("/var/lib/ferry/ferry.sqlite", "/var/lib/ferry"), ("/var/lib/ferry/", "/var/lib"), ("/ferry.sqlite", "/"),
        ("/", "/"), ("ferry.sqlite", "."), ("state/ferry.sqlite", "state"), ("a//b", "a"), ("", "."),
    ])
    func directoryNameIsWhatDirnameGives(path: String, directory: String) {
        #expect(directoryName(of: path) == directory)
        #expect(directoryName(of: path) == String(cString: dirname(strdup(path))))
    }

    @Test func joiningPathPutsOneSlashBetween() {
        #expect(joiningPath("/var/lib/ferry", "ferry.sqlite") == "/var/lib/ferry/ferry.sqlite")
        #expect(joiningPath("/var/lib/ferry/", "ferry.sqlite") == "/var/lib/ferry/ferry.sqlite")
        #expect(joiningPath("/", "x") == "/x")
        #expect(joiningPath("", "x") == "x")
    }

    @Test func createDirectoriesMakesEveryMissingParentAndReportsWhatStoppedIt() throws {
        let root = FileManager.default.temporaryDirectory.appendingPathComponent("ferry-dirs-\(getpid())-\(UInt32.random(in: 0...UInt32.max))").path
        defer { try? FileManager.default.removeItem(atPath: root) }
        #expect(createDirectories(root + "/a/b/c", mode: 0o700) == nil)
        var info = stat()
        #expect(stat(root + "/a/b/c", &info) == 0 && (info.st_mode & S_IFMT) == S_IFDIR)
        #expect(info.st_mode & 0o777 == 0o700 & ~currentUmask())
        #expect(createDirectories(root + "/a/b/c", mode: 0o700) == nil)  // already there
        #expect(writeFile(root + "/file", [1]) == nil)
        #expect(createDirectories(root + "/file", mode: 0o700) == EEXIST)
        #expect(createDirectories(root + "/file/sub", mode: 0o700) == ENOTDIR)
    }

    private func currentUmask() -> mode_t {
        let mask = umask(0o022)
        umask(mask)
        return mask
    }
}

@Suite struct FileBytesTests {
    @Test func writeFileThenReadUpToRoundTripsAndBoundsTheRead() throws {
        let path = FileManager.default.temporaryDirectory.appendingPathComponent("ferry-bytes-\(getpid())").path
        defer { unlink(path) }
        let bytes = (0..<200_000).map { UInt8(truncatingIfNeeded: $0 * 7) }
        #expect(writeFile(path, bytes) == nil)
        let fd = open(path, O_RDONLY)
        defer { close(fd) }
        #expect(readUpTo(fd, limit: 1 << 20) == bytes)
        #expect(lseek(fd, 0, SEEK_SET) == 0)
        #expect(readUpTo(fd, limit: 1000) == Array(bytes[..<1000]))
        // Truncates what was there.
        #expect(writeFile(path, [9, 9]) == nil)
        #expect(fileSize(atPath: path) == 2)
    }

    @Test func writeFileReportsTheErrnoAndLeavesNothing() {
        #expect(writeFile("/nonexistent-dir-\(getpid())/x", [1]) == ENOENT)
    }

    @Test func readFileReadsFromTheStartUpToTheLimit() throws {
        let path = FileManager.default.temporaryDirectory.appendingPathComponent("ferry-read-\(getpid())").path
        defer { unlink(path) }
        let bytes = (0..<100_000).map { UInt8(truncatingIfNeeded: $0 * 13) }
        #expect(writeFile(path, bytes) == nil)
        var read: [UInt8] = []
        #expect(readFile(path, limit: 1 << 20, into: &read) == nil)
        #expect(read == bytes)
        #expect(readFile(path, limit: 10, into: &read) == nil)
        #expect(read == Array(bytes[..<10]))
        #expect(writeFile(path, []) == nil)
        #expect(readFile(path, limit: 10, into: &read) == nil)
        #expect(read.isEmpty)
    }

    @Test func readFileReportsTheErrnoOfTheOpenOrTheReadAndLeavesTheBytes() {
        var read: [UInt8] = [7]
        #expect(readFile("/nonexistent-dir-\(getpid())/x", limit: 10, into: &read) == ENOENT)
        // A directory opens for reading; its read fails.
        #expect(readFile(FileManager.default.temporaryDirectory.path, limit: 10, into: &read) == EISDIR)
        #expect(read == [7])
    }
}

@Suite struct TextTests {
    @Test func cFormatGivesPrintfsText() {
        #expect(cFormat("%.1f", 2.25) == "2.2")  // the binary value of 2.25 is exact: round half to even
        #expect(cFormat("%.2f s (%.0f frames/s)", 1.005, 1234.5) == String(format: "%.2f s (%.0f frames/s)", 1.005, 1234.5))
        #expect(cFormat("%g", 72.0) == "72")
        #expect(cFormat("%g", 0.5) == "0.5")
        #expect(cFormat("; %.2f s", 12.3456) == "; 12.35 s")
        #expect(cFormat("%.0f", 1e300).count == 301)  // longer than any first guess
        #expect(cFormat("") == "")
    }

    @Test func plainNumberWritesWholeNumbersWithoutAFraction() {
        #expect(plainNumber(86_400) == "86400")
        #expect(plainNumber(-3) == "-3")
        #expect(plainNumber(0.05) == "0.05")
        #expect(plainNumber(1_048_576) == "1048576")  // not %g's 1.04858e+06
        #expect(plainNumber(1e300) == "1e+300")  // past Int64: Swift's shortest exact form
        #expect(plainNumber(.nan) == "nan")
    }

    @Test func trimmingWhitespaceDropsSpacesTabsAndLineEndsAtBothEnds() {
        #expect(" \t gzip \r\n".trimmingWhitespace() == "gzip")
        #expect("a b".trimmingWhitespace() == "a b")
        #expect(" \n ".trimmingWhitespace() == "")
        #expect("".trimmingWhitespace() == "")
        #expect("x: y ".split(separator: ":")[1].trimmingWhitespace() == "y")
    }

    /// The errno text in Ferry's one-line errors is the C library's own, for any value (one unknown to it too).
    @Test func errnoDescriptionIsTheCLibrarysText() {
        #expect(errnoDescription(ENOENT) == "No such file or directory")
        #expect(errnoDescription(EACCES) == "Permission denied")
        #expect(errnoDescription(0) == "Success")
        #expect(errnoDescription(99_999) == "Unknown error 99999")
    }
}
