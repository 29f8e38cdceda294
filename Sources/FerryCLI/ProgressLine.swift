import FerryCore
import FoundationEssentials

#if canImport(Glibc)
    import Glibc
#endif

/// One line of progress on stderr for long commands ("syncing 120 of ~600"), redrawn in place. Only at a
/// terminal: when stderr is a pipe, a file or journald, or the command prints --json, nothing is written, so
/// scripts and logs see exactly what they saw before.
struct ProgressLine: Sendable {
    let enabled: Bool

    /// What is on the terminal's last line. Global: there is one stderr, and log lines written between two
    /// redraws must first erase the progress text (`eraseForLogLine`).
    private struct Screen {
        var shown = false
        var lastText = ""
        /// A `SystemMonotonicClock` reading.
        var lastDraw = -Double.infinity
    }
    private static let screen = LockedValue(Screen())

    init(enabled: Bool) {
        self.enabled = enabled
    }

    /// For a command's stderr: on only at a terminal and without --json.
    static func forStderr(json: Bool) -> ProgressLine {
        ProgressLine(enabled: !json && isatty(2) == 1)
    }

    /// Redraws the line; at most ten times a second unless `force` (a phase change must show at once).
    func update(_ text: String, force: Bool = false) {
        guard enabled else { return }
        Self.screen.withLock { s in
            let now = SystemMonotonicClock().now()
            guard text != s.lastText || !s.shown, force || now - s.lastDraw >= 0.1 else { return }
            s.lastText = text
            s.lastDraw = now
            s.shown = true
            // \r + erase-line; cut to the terminal's width so the line never wraps (a wrapped line cannot be redrawn).
            StandardOutput.writeAll(2, "\r\u{1B}[K" + String(text.prefix(Self.width() - 1)))
        }
    }

    /// Erases the line (before the command's result, an error or a question is printed).
    func clear() {
        guard enabled else { return }
        Self.eraseForLogLine()
    }

    /// Called by the log sinks before they write a line: the line starts at column 0, not after the progress.
    static func eraseForLogLine() {
        screen.withLock { s in
            guard s.shown else { return }
            s.shown = false
            StandardOutput.writeAll(2, "\r\u{1B}[K")
        }
    }

    private static func width() -> Int {
        var size = winsize()
        guard ioctl(2, UInt(TIOCGWINSZ), &size) == 0, size.ws_col > 10 else { return 80 }
        return Int(size.ws_col)
    }
}
