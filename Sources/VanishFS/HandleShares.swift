import Glibc
import Synchronization
import LinuxSyscalls
import SystemPackage

/// How many open handles (each an fd of the daemon's: files and directory
/// listings) users other than root and the daemon's own may hold at once.
/// Natively each process has a descriptor limit of its own; through the
/// mount every user's open files share the daemon's one, so without shares
/// two users holding 15,000 files each left root EMFILE on every open.
///
/// A user gets at most a quarter of the daemon's fd limit, all such users
/// together half of it; past that their opens fail with ENFILE (the
/// system's table is full, as far as they can tell). So that two users
/// filling the half leave the others some, each user may still hold a few
/// (`floor`) while all of them together hold less than three quarters.
/// Root, the daemon's own user and the fd cache (which gives fds back when
/// they run short) keep the rest. A user is an account: the uids of its
/// subordinate ranges are charged to it (`SubordinateIDs`).
/// Lock order: a leaf lock.
final class HandleShares: Sendable {
    let perUser: Int
    let allUsers: Int
    let floor: Int
    let ceiling: Int
    private let exempt: uid_t
    private let accounts: SubordinateIDs
    private struct State {
        var byUser: [uid_t: Int] = [:]
        var total = 0
        /// Who holds each counted handle's fd.
        var owners: [Int32: uid_t] = [:]
    }
    private let state = Mutex(State())
    /// Counted handles: releases skip the lock while there are none.
    private let counted = Atomic<Int>(0)

    init(fdLimit: Int, accounts: SubordinateIDs = .shared) {
        perUser = max(16, fdLimit / 4)
        allUsers = max(32, fdLimit / 2)
        floor = min(64, max(4, fdLimit / 16))
        ceiling = max(allUsers, fdLimit * 3 / 4)
        exempt = geteuid()
        self.accounts = accounts
    }

    /// Whether `uid`'s handles count at all.
    @inline(__always)
    func counts(_ uid: uid_t) -> Bool { uid != 0 && uid != exempt }

    /// Takes a place for a handle of `uid`'s before its fd is opened:
    /// ENFILE past the user's share or all users'. Give it back with
    /// `giveBack` if no handle comes of it, or name its fd with `opened`.
    func take(_ uid: uid_t) throws(Errno) {
        guard counts(uid) else { return }
        let account = accounts.owner(of: uid)
        let granted = state.withLock { s -> Bool in
            let mine = s.byUser[account, default: 0]
            guard (mine < perUser && s.total < allUsers) || (mine < floor && s.total < ceiling) else { return false }
            s.byUser[account] = mine + 1
            s.total += 1
            return true
        }
        guard granted else { throw .tooManyOpenFilesInSystem }
        counted.add(1, ordering: .relaxed)
    }

    /// The place `take` gave came to nothing, or its handle is gone.
    func giveBack(_ uid: uid_t) {
        guard counts(uid) else { return }
        let account = accounts.owner(of: uid)
        state.withLock { s in
            // At most 0: /etc/subuid may have moved the uid to another account since.
            if let n = s.byUser[account] { s.byUser[account] = n > 1 ? n - 1 : nil }
            s.total -= 1
        }
        counted.subtract(1, ordering: .relaxed)
    }

    /// The handle `take` made room for holds `fd`.
    func opened(_ fd: Int32, by uid: uid_t) {
        guard counts(uid) else { return }
        state.withLock { $0.owners[fd] = uid }
    }

    /// A file handle's `fd` is being closed.
    @inline(__always)
    func released(_ fd: Int32) {
        guard counted.load(ordering: .relaxed) > 0 else { return }
        guard let uid = state.withLock({ $0.owners.removeValue(forKey: fd) }) else { return }
        giveBack(uid)
    }
}
