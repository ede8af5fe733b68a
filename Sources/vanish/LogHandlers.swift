import Glibc
import Logging
import Synchronization

/// stderr in the foreground; once daemonized (stderr is /dev/null then) the
/// log file given, else syslog, else (no syslog socket: nothing would read
/// it) a file of the user's, said once on stderr when it is first made.
/// Returns where the log goes, for `status`.
func bootstrapLogging(foreground: Bool, logFile: String?) -> String {
    if foreground {
        LoggingSystem.bootstrap { label in
            var h = StreamLogHandler.standardError(label: label)
            h.logLevel = .info
            return h
        }
        return "stderr"
    }
    var file = logFile
    if file == nil && !LogPlace.syslogListens, let fallback = LogPlace.fallbackFile() {
        if access(fallback, F_OK) != 0 {
            FileHandleStderr.write("vanish: no syslog socket (\(LogPlace.syslogSocket)): the daemon logs to \(fallback)\n")
        }
        file = fallback
    }
    if let file {
        let fd = open(file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0o640)
        if fd >= 0 {
            LoggingSystem.bootstrap { _ in LineLogHandler(fd: fd) }
            return file
        }
    }
    openlog("vanish", LOG_PID, LOG_DAEMON)
    LoggingSystem.bootstrap { _ in LineLogHandler(fd: -1) }
    return "syslog"
}

/// Where a daemon's log can go.
enum LogPlace {
    static let syslogSocket = "/dev/log"

    /// Whether something reads syslog here (journald or a syslog daemon owns the socket).
    static var syslogListens: Bool {
        var st = stat()
        return stat(syslogSocket, &st) == 0 && st.st_mode & S_IFMT == S_IFSOCK
    }

    /// /var/log/vanish.log for root; a user's $XDG_STATE_HOME/vanish/vanish.log
    /// (~/.local/state/...), its directories made owner-only. nil if none can be made.
    static func fallbackFile() -> String? {
        if getuid() == 0 { return "/var/log/vanish.log" }
        var base: String
        if let state = getenv("XDG_STATE_HOME"), state.pointee == 0x2F {
            base = String(cString: state)
        } else if let home = getenv("HOME"), home.pointee == 0x2F {
            base = String(cString: home) + "/.local/state"
        } else {
            return nil
        }
        var path = ""
        for part in (base + "/vanish").split(separator: "/") {
            path += "/" + part
            mkdir(path, 0o700)
        }
        var st = stat()
        guard stat(path, &st) == 0, st.st_uid == getuid() else { return nil }
        return path + "/vanish.log"
    }
}

/// One line per message, to an fd (O_APPEND writes are atomic) or to syslog when fd is -1.
struct LineLogHandler: LogHandler {
    let fd: Int32
    var logLevel: Logger.Level = .info
    var metadata: Logger.Metadata = [:]

    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    func log(event: LogEvent) {
        let level = event.level
        let message = event.message
        let all = metadata.merging(event.metadata ?? [:]) { $1 }
        let extras = all.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: " ")
        let text = extras.isEmpty ? "\(message)" : "\(message) \(extras)"
        if fd < 0 {
            let priority: Int32 = switch level {
            case .trace, .debug: LOG_DEBUG
            case .info: LOG_INFO
            case .notice: LOG_NOTICE
            case .warning: LOG_WARNING
            case .error: LOG_ERR
            case .critical: LOG_CRIT
            }
            text.withCString { cs in withVaList([cs]) { vsyslog(priority, "%s", $0) } }
        } else {
            var t = time(nil)
            var tm = tm()
            localtime_r(&t, &tm)
            var stamp = [UInt8](repeating: 0, count: 32)
            let n = strftime(&stamp, 32, "%Y-%m-%dT%H:%M:%S", &tm)
            let line = "\(String(decoding: stamp[..<n], as: UTF8.self)) vanish[\(getpid())] \(level): \(text)\n"
            _ = line.withCString { write(fd, $0, strlen($0)) }
        }
    }
}
