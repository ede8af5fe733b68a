import FUSEKit
import Glibc
import SystemPackage

/// What the handlers tell of each change they make through the mount. With
/// events on it is an `EventRecorder`, which writes them to the journal;
/// with events off, `NoEvents`, which ignores them: no handler asks which.
///
/// Calls made before a change (`linking`, `removing`, `settingAttributes`)
/// read what the event will need while it is still there; they cost
/// nothing with events off. A change a request made is told with that
/// request, before it is answered: the request carries the caller and its
/// place in the kernel's order, which its event keeps.
protocol ChangeObserver: AnyObject, Sendable {
    /// How callers are named in events, for the session's first log line.
    var callerNames: String { get }
    /// Whether events carry file ids (so a new file's may be read with its handle).
    var recordsIDs: Bool { get }

    /// Before a change of names: an earlier request still recording its
    /// event names its file as it is then, so it records first.
    func awaitEarlierChanges(_ req: Request)

    func created(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, node: Inode, st: stat, fd: Int32)

    /// Before `node` gets another name: its path now (the event's target).
    func linking(_ node: Inode, unnamed: Bool) -> [UInt8]
    /// `node` got `name` in `parent` (`parentFD`); `unnamed`: it was an O_TMPFILE file.
    func linked(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, parentFD: Int32, node: Inode,
                st: stat, target: [UInt8], unnamed: Bool)

    /// Before `name` (lstat `st`) leaves `dirFD`: its file id.
    func removing(_ dirFD: Int32, _ name: UnsafePointer<CChar>, _ st: stat) -> String
    /// Before the directory `name` leaves `dirFD`: its id and lstat (nil
    /// when nothing is recorded: rmdir then stats it only if it must).
    func removingDirectory(_ dirFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> (id: String, st: stat?)
    /// `entry`: for `vanish rm`, its graveyard entry.
    func deleted(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, mode: mode_t, id: String, tree: Bool,
                 entry: String?)

    /// `name` in `parent` is now `newName` in `newParent` (`newParentFD`);
    /// `moved`: the inode under the new name, `st` its lstat if known.
    func renamed(_ req: Request, from parent: Inode, _ name: UnsafePointer<CChar>, to newParent: Inode,
                 _ newName: UnsafePointer<CChar>, newParentFD: Int32, moved: Inode?, st: stat?, exchange: Bool,
                 replaced: Bool)

    /// A graveyard entry was put back as `leaf` in `dirFD`, at `path` in the mount, by `uid`;
    /// `kept`: by the daemon, because its deleter could not have removed all of it with `rm -r`.
    func restored(into dirFD: Int32, _ leaf: UnsafePointer<CChar>, path: [UInt8], kind: String, entry: String,
                  uid: uid_t, kept: Bool)

    /// A directory's attributes as a getattr or lookup just read them
    /// (changes behind the mount show as a moved mtime).
    func sawDirectory(_ node: Inode, _ st: stat)

    /// A handle of the regular file `node` was opened on `fd`; `writing`:
    /// it can write data; `passthrough`: the kernel writes it without the
    /// daemon; `known`: the file's stat if the opener has it.
    func opened(_ fd: Int32, _ node: Inode, writing: Bool, passthrough: Bool, stat known: stat?, _ req: Request)
    /// A write (or fallocate) through the daemon on `fd`.
    func wrote(_ fd: Int32, _ node: Inode, _ req: Request)
    /// copy_file_range of `length` bytes from `input` into `output`.
    func copied(from input: Inode, _ inFD: Int32, at inputOffset: off_t, into output: Inode, _ outFD: Int32,
                at outputOffset: off_t, length: Int, _ req: Request)
    /// A handle of `node` is released; `report`: its `written` event may go out
    /// (not for a handle whose open was never answered).
    func released(_ fd: Int32, _ node: Inode, writing: Bool, report: Bool, during req: Request?)

    /// Before a setattr: the file's stat, when a passthrough writer's session
    /// needs to tell what changed before it. `stat` reads it.
    func settingAttributes(_ node: Inode, toSet: Int32, stat: () -> stat?) -> stat?
    func attributesChanged(_ req: Request, _ node: Inode, toSet: Int32, before: stat?, after: stat)
    /// chattr: the inode flags changed.
    func flagsChanged(_ req: Request, _ node: Inode)
    func xattrChanged(_ req: Request, _ node: Inode, name: UnsafePointer<CChar>)

    /// Whether passthrough writers of `node` are followed (their writes show only in the file).
    func follows(_ node: Inode) -> Bool
}

/// Events off: every change goes unrecorded, at no cost.
final class NoEvents: ChangeObserver {
    var callerNames: String { "-" }
    var recordsIDs: Bool { false }
    func awaitEarlierChanges(_ req: Request) {}
    func created(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, node: Inode, st: stat, fd: Int32) {}
    func linking(_ node: Inode, unnamed: Bool) -> [UInt8] { [] }
    func linked(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, parentFD: Int32, node: Inode,
                st: stat, target: [UInt8], unnamed: Bool) {}
    func removing(_ dirFD: Int32, _ name: UnsafePointer<CChar>, _ st: stat) -> String { "" }
    func removingDirectory(_ dirFD: Int32, _ name: UnsafePointer<CChar>) throws(Errno) -> (id: String, st: stat?) {
        ("", nil)
    }
    func deleted(_ req: Request, parent: Inode, name: UnsafePointer<CChar>, mode: mode_t, id: String, tree: Bool,
                 entry: String?) {}
    func renamed(_ req: Request, from parent: Inode, _ name: UnsafePointer<CChar>, to newParent: Inode,
                 _ newName: UnsafePointer<CChar>, newParentFD: Int32, moved: Inode?, st: stat?, exchange: Bool,
                 replaced: Bool) {}
    func restored(into dirFD: Int32, _ leaf: UnsafePointer<CChar>, path: [UInt8], kind: String, entry: String,
                  uid: uid_t, kept: Bool) {}
    func sawDirectory(_ node: Inode, _ st: stat) {}
    func opened(_ fd: Int32, _ node: Inode, writing: Bool, passthrough: Bool, stat known: stat?, _ req: Request) {}
    func wrote(_ fd: Int32, _ node: Inode, _ req: Request) {}
    func copied(from input: Inode, _ inFD: Int32, at inputOffset: off_t, into output: Inode, _ outFD: Int32,
                at outputOffset: off_t, length: Int, _ req: Request) {}
    func released(_ fd: Int32, _ node: Inode, writing: Bool, report: Bool, during req: Request?) {}
    func settingAttributes(_ node: Inode, toSet: Int32, stat: () -> stat?) -> stat? { nil }
    func attributesChanged(_ req: Request, _ node: Inode, toSet: Int32, before: stat?, after: stat) {}
    func flagsChanged(_ req: Request, _ node: Inode) {}
    func xattrChanged(_ req: Request, _ node: Inode, name: UnsafePointer<CChar>) {}
    func follows(_ node: Inode) -> Bool { false }
}
