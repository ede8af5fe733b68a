import CLinux
import FUSEKit
import Glibc
import LinuxSyscalls
import SystemPackage
import VanishGraveyard

extension Deleter {
    /// Writes down an unlink about to be answered before its burial (see
    /// `UnlinkIntents`); `unkept`: the undo window leaves the file out, as
    /// the next mount must too if it finishes the unlink. False if it could
    /// not be written: the caller then buries the file before answering.
    func recordIntent(_ d: DeferredBurials.File, parent: Inode, name: UnsafePointer<CChar>, caller: Caller,
                      unkept: Bool) -> Bool {
        guard let intents = burials.intents else { return false }
        let failure: Errno? = table.withPath(of: parent, appending: name) { path in
            do throws(Errno) {
                try intents.record(d.st, deleted: d.deleted, uid: caller.uid, gid: caller.gid, inPlace: d.inPlace,
                                   unkept: unkept, path: path)
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
    /// burying (see `UnlinkIntents.finishInterrupted`), found in the logs
    /// `opened` holds. Runs before the mount serves.
    func finishInterruptedUnlinks(_ opened: Opened) {
        guard let graveyard, let intents = opened.intents else { return }
        let leftover = opened.leftover
        let keeps = undoWindow > 0
        let (finished, logged) = UnlinkIntents.finishInterrupted(
            intents, leftover: leftover, graveyard: graveyard, rootFD: rootFD, keepingRecords: keeps,
            buried: { [reaper] in reaper?.noteBuried(shard: $0) },
            failed: { [log] in log.warning("could not finish an interrupted unlink", metadata: ["error": "\($0)"]) })
        if finished > 0 {
            log.notice("finished unlinks answered by the last session but not yet done when it ended",
                       metadata: ["finished": "\(finished)", "logged": "\(logged)"])
        }
    }
}
