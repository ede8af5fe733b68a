import Glibc
import Logging
import Synchronization

/// stderr in the foreground; a log file or syslog once daemonized (stderr is /dev/null then).
func bootstrapLogging(foreground: Bool, logFile: String?) {
    if foreground {
        LoggingSystem.bootstrap { label in
            var h = StreamLogHandler.standardError(label: label)
            h.logLevel = .info
            return h
        }
    } else if let logFile {
        let fd = open(logFile, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0o640)
        LoggingSystem.bootstrap { _ in LineLogHandler(fd: fd >= 0 ? fd : 2) }
    } else {
        openlog("vanish", LOG_PID, LOG_DAEMON)
        LoggingSystem.bootstrap { _ in LineLogHandler(fd: -1) }
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
