import Foundation
import Glibc
import Testing
import VanishTestSupport
@testable import vanish

/// mount-scripts/: the mount(8) helper behind `mount -t fuse.vanish` and fstab lines.
@Suite("mount scripts", .serialized, .enabled(if: FUSEAvailability.shouldRunAsRoot, "needs /dev/fuse, fusermount3 and root"))
struct MountScriptsTests {
    static let repo = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().path
    static let helper = "/sbin/mount.fuse.vanish"

    /// Runs `body` with the repository's helper where mount(8) looks for it,
    /// putting back whatever was there.
    func withHelperInstalled(_ body: () throws -> Void) throws {
        let backup = Self.helper + ".test-backup"
        let had = access(Self.helper, F_OK) == 0
        if had { rename(Self.helper, backup) }
        defer {
            unlink(Self.helper)
            if had { rename(backup, Self.helper) }
        }
        #expect(symlink(Self.repo + "/mount-scripts/mount.vanish", Self.helper) == 0)
        try body()
    }

    @Test("the systemd unit: its command line takes an instance's options, and the daemon says it is ready once the mount is up (issue 51)")
    func systemdUnit() throws {
        let (base, src, mnt) = try scratch()
        defer { unmountAndRemove(mnt, base: base) }
        let unit = try String(contentsOfFile: Self.repo + "/mount-scripts/vanish@.service", encoding: .utf8)
        #expect(unit.contains("Type=notify") && unit.contains("EnvironmentFile=-/etc/vanish/%i.conf"), "\(unit)")
        #expect(unit.contains("ExecStart=vanish mount --foreground $VANISH_OPTIONS %f $VANISH_MOUNTPOINT"), "\(unit)")
        if let analyze = which("systemd-analyze") {
            // The unit as installed names `vanish` on systemd's path and its
            // manual: this checks the unit itself, also where neither is installed yet.
            let instance = base + "/vanish@srv-data.service"
            try unit.replacingOccurrences(of: "ExecStart=vanish ", with: "ExecStart=\(vanishBinary) ")
                .write(toFile: instance, atomically: true, encoding: .utf8)
            let verified = try run([analyze, "verify", "--man=no", instance])
            #expect(verified.ok && verified.stderr.isEmpty, "\(verified)")
        }
        // What systemd runs, with VANISH_OPTIONS="--keep 1h" and VANISH_MOUNTPOINT set,
        // and its notification socket: READY=1 comes once the mount is there.
        let listener = base + "/listen.py", heard = base + "/heard"
        try """
            import os, socket, sys
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.bind(sys.argv[1]); s.settimeout(60)
            open(sys.argv[1] + ".ready", "w").close()
            message = s.recv(4096).decode()
            with open(sys.argv[3], "w") as f: f.write("%s|%s" % (message.split("\\n")[0], os.path.ismount(sys.argv[2])))
            """.write(toFile: listener, atomically: true, encoding: .utf8)
        let notify = base + "/notify"
        let python = try spawn(["/usr/bin/python3", listener, notify, mnt, heard])
        defer { kill(python, SIGKILL); var st: Int32 = 0; waitpid(python, &st, 0) }
        try waitFor("the listener") { access(notify + ".ready", F_OK) == 0 }
        var environment = ProcessInfo.processInfo.environment
        environment["NOTIFY_SOCKET"] = notify
        let daemon = try spawn([vanishBinary, "mount", "--foreground", "--keep", "1h", src, mnt], environment: environment)
        defer { kill(daemon, SIGTERM); var st: Int32 = 0; waitpid(daemon, &st, 0) }
        try waitFor("READY=1") { (try? String(contentsOfFile: heard, encoding: .utf8))?.contains("|") == true }
        let said = try String(contentsOfFile: heard, encoding: .utf8)
        #expect(said == "READY=1|True", "\(said)")
        #expect(try statusJSON(path: mnt)["keep_seconds"] as? Double == 3600)
    }

    func scratch() throws -> (String, String, String) {
        let base = try makeTempDirectory()
        mkdir(base + "/src", 0o755); mkdir(base + "/mnt", 0o755)
        return (base, base + "/src", base + "/mnt")
    }

    @Test("mount -t fuse.vanish with mount(8)-only options, then umount")
    func mountType() throws {
        let (base, src, mnt) = try scratch()
        defer { unmountAndRemove(mnt, base: base) }
        try withHelperInstalled {
            let r = try run(["mount", "-t", "fuse.vanish", src, mnt, "-o", "noauto,nofail,allow_other,cache=never"],
                            environment: ["VANISH_BINARY": vanishBinary])
            #expect(r.ok, "\(r.stderr)")
            let line = try String(contentsOfFile: "/proc/mounts", encoding: .utf8).split(separator: "\n")
                .first { $0.contains(" \(mnt) ") }.map(String.init) ?? ""
            #expect(line.contains("fuse.vanish"))
            #expect(line.contains("allow_other") && line.contains("default_permissions"))
            #expect(try sh("echo x > f && cat f", cwd: mnt).stdout == "x\n")
            #expect(try run(["umount", mnt]).ok)
            #expect(VanishTestSupport.mountType(at: mnt) == nil)
        }
    }

    @Test("an fstab line of type fuse.vanish")
    func fstab() throws {
        let (base, src, mnt) = try scratch()
        defer { unmountAndRemove(mnt, base: base) }
        try withHelperInstalled {
            let tab = base + "/fstab"
            try "\(src) \(mnt) fuse.vanish defaults,noauto,x-systemd.automount,cache=auto 0 0\n"
                .write(toFile: tab, atomically: true, encoding: .utf8)
            let r = try run(["mount", "--fstab", tab, mnt], environment: ["VANISH_BINARY": vanishBinary])
            #expect(r.ok, "\(r.stderr)")
            #expect(VanishTestSupport.mountType(at: mnt) == "fuse.vanish")
            #expect(try run([vanishBinary, "unmount", mnt]).ok)
        }
    }

    @Test("remount,ro and remount,rw change the mount as mount(8) would; relatime is taken; dev and suid are as on other filesystems unless nodev, nosuid")
    func remountAndKernelFlags() throws {
        let (base, src, mnt) = try scratch()
        defer { unmountAndRemove(mnt, base: base) }
        try withHelperInstalled {
            let env = ["VANISH_BINARY": vanishBinary]
            func flags() throws -> [Substring] {
                let line = try String(contentsOfFile: "/proc/mounts", encoding: .utf8).split(separator: "\n")
                    .first { $0.contains(" \(mnt) ") } ?? ""
                return line.split(separator: " ").dropFirst(3).first?.split(separator: ",") ?? []
            }
            let up = try run(["mount", "-t", "fuse.vanish", src, mnt, "-o", "relatime"], environment: env)
            #expect(up.ok, "\(up.stderr)")
            let defaults = try flags()
            #expect(!defaults.contains("nodev") && !defaults.contains("nosuid"), "\(defaults)")
            let ro = try run(["mount", "-o", "remount,ro", mnt], environment: env)
            #expect(ro.ok, "\(ro.stderr)")
            #expect(try flags().contains("ro"))
            #expect(try !sh("touch f", cwd: mnt).ok, "read-only after remount,ro")
            let rw = try run(["mount", "-o", "remount,rw", mnt], environment: env)
            #expect(rw.ok, "\(rw.stderr)")
            #expect(try sh("touch f && rm f", cwd: mnt).ok)
            #expect(try run(["umount", mnt]).ok)
            let safe = try run(["mount", "-t", "fuse.vanish", src, mnt, "-o", "nodev,nosuid"], environment: env)
            #expect(safe.ok, "\(safe.stderr)")
            let asked = try flags()
            #expect(asked.contains("nodev") && asked.contains("nosuid"), "\(asked)")
            #expect(try run(["umount", mnt]).ok)
        }
    }

    /// A manual page's text as `man` shows it, near enough to search: no
    /// escaped dashes, no font changes.
    static func plain(_ page: String) -> String {
        page.replacingOccurrences(of: "\\-", with: "-").replacingOccurrences(of: "\\fB", with: "")
            .replacingOccurrences(of: "\\fI", with: "").replacingOccurrences(of: "\\fR", with: "")
            .replacingOccurrences(of: "\\fP", with: "")
    }

    @Test("a manual page for vanish and for each subcommand, naming every option the binary takes, with examples and exit status, rendered without warnings; completions from the command-line definitions")
    func manualsAndCompletions() throws {
        let out = try makeTempDirectory()
        defer { removeTree(out) }
        let r = try run([Self.repo + "/mount-scripts/manuals", vanishBinary, out])
        #expect(r.ok, "\(r.stderr)")
        let pages = [("vanish", ["--version"]), ("vanish-mount", ["mount"]), ("vanish-unmount", ["unmount"]),
                     ("vanish-rm", ["rm"]), ("vanish-status", ["status"]), ("vanish-reap", ["reap"]),
                     ("vanish-trash", ["trash", "list"]), ("vanish-trash", ["trash", "empty"]), ("vanish-restore", ["restore"]), ("vanish-events", ["events"])]
        // Every subcommand the binary has is in the list above.
        let top = try run([vanishBinary, "--help"]).stdout
        let listed = top.components(separatedBy: "SUBCOMMANDS:").last ?? ""
        for line in listed.split(separator: "\n") {
            guard let word = line.split(separator: " ").first, line.hasPrefix("  "), !line.hasPrefix("    "), word != "help",
                  !line.contains("See '") else { continue }
            #expect(pages.contains { $0.1.first == String(word) }, "vanish \(word) has no manual page")
        }
        for (name, command) in pages {
            let path = out + "/man1/\(name).1"
            let page = Self.plain(try String(contentsOfFile: path, encoding: .utf8))
            for section in ["NAME", "SYNOPSIS", "DESCRIPTION", "EXAMPLES", "EXIT STATUS", "SEE ALSO"] {
                #expect(page.contains(".SH \(section)"), "\(name) has no \(section)")
            }
            let shown = try run(["man", "-l", "--warnings", path], environment: ["MANWIDTH": "80"])
            #expect(shown.ok && shown.stderr.isEmpty, "\(name): \(shown.stderr)")
            guard command != ["--version"] else { continue }
            // Each long option --help lists is on the page.
            let help = try run([vanishBinary, "help"] + command).stdout
            let options = help.components(separatedBy: "OPTIONS:").last ?? ""
            for match in options.matches(of: /(?m)^  (?:-\w, )*(--[a-z][a-z-]*)/) where !["--version", "--help"].contains(String(match.1)) {
                #expect(page.contains(String(match.1)), "\(name) does not mention \(match.1)")
            }
        }
        // The mount page and docs/options.md name every -o option Vanish takes itself (its one table).
        let mount = Self.plain(try String(contentsOfFile: out + "/man1/vanish-mount.1", encoding: .utf8))
        let options = try String(contentsOfFile: Self.repo + "/docs/options.md", encoding: .utf8)
        let help = try run([vanishBinary, "help", "mount"]).stdout.split(whereSeparator: \.isWhitespace).joined(separator: " ")
        for spec in MountOptionList.table where spec.listed {
            #expect(mount.contains(spec.key), "vanish-mount.1 does not mention -o \(spec.key)")
            #expect(options.contains("`" + spec.key), "docs/options.md does not list -o \(spec.key)")
            #expect(help.contains(spec.usage), "vanish help mount does not list -o \(spec.usage)")
        }
        #expect(try run(["bash", "-n", out + "/completions/vanish.bash"]).ok)
        let words = try run(["bash", "-c", """
            source \(shellQuote(out + "/completions/vanish.bash"))
            COMP_WORDS=(vanish ""); COMP_CWORD=1; COMP_LINE="vanish "; COMP_POINT=7
            _vanish; echo "${COMPREPLY[@]}"
            """], environment: ["PATH": (vanishBinary as NSString).deletingLastPathComponent + ":/usr/bin:/bin"])
        #expect(words.stdout.contains("mount") && words.stdout.contains("rm") && words.stdout.contains("events"), "\(words)")
        let zsh = try String(contentsOfFile: out + "/completions/_vanish", encoding: .utf8)
        #expect(zsh.hasPrefix("#compdef vanish"))
    }

    @Test("the helper rejects arguments it does not know")
    func badHelperArguments() throws {
        let r = try run([Self.repo + "/mount-scripts/mount.vanish", "/a", "/b", "--bogus"])
        #expect(r.status == 1)
        #expect(r.stderr.contains("unknown argument"))
    }
}
