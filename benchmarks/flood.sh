#!/bin/bash
# Does a request flood by one user slow another's work through the mount more
# than the same flood of native syscalls? Four of nobody's processes open and
# close a file without end, through the mount or on the source, while root
# creates, opens and unlinks 500 files through the mount; rounds interleaved.
#   sudo benchmarks/flood.sh BINARY [OPTIONS] [ROUNDS]
# Prints root's seconds per round beside each flood, and alone.
set -eu
BIN=$1; OPTS=${2:-}; ROUNDS=${3:-3}
DIR=$(mktemp -d /tmp/vanish-flood.XXXXXX)
cleanup() { fusermount3 -u "$DIR/m" 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
mkdir -p "$DIR/s/pub" "$DIR/s/work" "$DIR/m"; chmod 755 "$DIR"; chmod 777 "$DIR/s/pub"
echo x > "$DIR/s/pub/f"; chmod 644 "$DIR/s/pub/f"
cat > "$DIR/flood.py" <<'PY'
import os, sys
while True:
    try: os.close(os.open(sys.argv[1], os.O_RDONLY))
    except OSError: pass
PY
cat > "$DIR/work.py" <<'PY'
import os, sys, time
t = time.monotonic()
for i in range(500):
    p = os.path.join(sys.argv[1], "w%d" % i)
    os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
    os.close(os.open(p, os.O_RDONLY))
    os.unlink(p)
print("%.3f" % (time.monotonic() - t))
PY
"$BIN" mount -f -o "allow_other${OPTS:+,$OPTS}" "$DIR/s" "$DIR/m" 2>/dev/null &
for _ in $(seq 100); do mountpoint -q "$DIR/m" && break; sleep 0.05; done
for round in $(seq "$ROUNDS"); do
    line="round $round: alone $(/usr/bin/python3 "$DIR/work.py" "$DIR/m/work")"
    for where in mount source; do
        target=$([ $where = mount ] && echo "$DIR/m/pub/f" || echo "$DIR/s/pub/f")
        pids=""
        for _ in 1 2 3 4; do
            setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 "$DIR/flood.py" "$target" & pids="$pids $!"
        done
        sleep 0.5
        line="$line, beside the flood on the $where $(/usr/bin/python3 "$DIR/work.py" "$DIR/m/work")"
        kill $pids; wait $pids 2>/dev/null || true
    done
    echo "$line"
done
