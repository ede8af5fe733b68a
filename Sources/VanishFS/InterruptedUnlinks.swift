import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage
import VanishGraveyard

extension PassthroughFilesystem {
    /// Writes down an unlink about to be answered before its burial (see
    /// `UnlinkIntents`). False if it could not be written: the caller then
    /// buries the file before answering.
    func recordIntent(_ d: DeferredBurial, parent: Inode, name: UnsafePointer<CChar>, caller: Caller) -> Bool {
        guard let intents = namespace.intents else { return false }
        let failure: Errno? = table.withPath(of: parent, appending: name) { path in
            do throws(Errno) {
                try intents.record(d.st, deleted: d.deleted, uid: caller.uid, gid: caller.gid, inPlace: d.inPlace,
                                   path: path)
                return nil
            } catch {
                return error
            }
        }
        guard let failure else { return true }
        log.warning("cannot write an unlink's intent; burying it before the answer", metadata: ["error": "\(failure)"])
        return false
    }

    /// Finishes the unlinks an earlier daemon answered but was killed before
    /// burying: each file still at its path and unchanged since (same inode,
    /// same ctime) goes to the graveyard as that unlink would have sent it,
    /// with its trash record and deletion time. Runs before the mount serves.
    func finishInterruptedUnlinks(_ intents: UnlinkIntents) {
        let pending = intents.intents()
        var finished = 0
        for intent in pending where finish(intent) { finished += 1 }
        // Also opens the log for this session's records.
        intents.clear()
        if finished > 0 {
            log.notice("finished unlinks answered by the last session but not yet done when it ended",
                       metadata: ["finished": "\(finished)", "logged": "\(pending.count)"])
        }
    }

    private func finish(_ intent: UnlinkIntents.Intent) -> Bool {
        guard let graveyard else { return false }
        var components = intent.path.split(separator: 0x2F, omittingEmptySubsequences: false)
        guard let leaf = components.popLast(),
              !(components + [leaf]).contains(where: { $0.isEmpty || $0.elementsEqual([0x2E]) || $0.elementsEqual([0x2E, 0x2E]) })
        else { return false }
        // Walk down from the root one directory at a time, never following a symlink.
        var dirFD = (try? Sys.dup(rootFD)) ?? -1
        guard dirFD >= 0 else { return false }
        defer { Sys.close(dirFD) }
        for component in components {
            let next = (Array(component) + [0]).withUnsafeBufferPointer { name in
                name.withMemoryRebound(to: CChar.self) {
                    try? Sys.openat(dirFD, $0.baseAddress!, VANISH_O_PATH | O_DIRECTORY | O_NOFOLLOW)
                }
            }
            guard let next else { return false }
            Sys.close(dirFD)
            dirFD = next
        }
        return (Array(leaf) + [0]).withUnsafeBufferPointer { raw in
            raw.withMemoryRebound(to: CChar.self) { buffer -> Bool in
                let name = buffer.baseAddress!
                guard let st = try? Sys.lstatat(dirFD, name), intent.matches(st), st.st_dev == graveyard.device else {
                    return false
                }
                do throws(Errno) {
                    if intent.inPlace {
                        try Sys.unlinkat(dirFD, name, 0)
                        return true
                    }
                    var record: TrashRecord?
                    if let reaper, reaper.policy.keep > 0 {
                        record = TrashRecord(path: intent.path, uid: intent.uid, gid: intent.gid,
                                             bytes: UInt64(st.st_blocks) * 512, kind: TrashRecord.Kind(mode: st.st_mode))
                    }
                    let shard = try graveyard.bury(dirFD, name, record: record, time: intent.deleted)
                    reaper?.noteBuried(shard: shard)
                    return true
                } catch {
                    log.warning("could not finish an interrupted unlink", metadata: ["error": "\(error)"])
                    return false
                }
            }
        }
    }
}
