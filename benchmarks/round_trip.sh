#!/bin/bash
# The cost of one FUSE round trip, per call, with the kernel's caches off:
# native, libfuse's passthrough_ll, Vanish over io_uring and over /dev/fuse,
# interleaved, on an ext4 RAM disk. Medians of ROUNDS rounds of CALLS calls.
#   sudo benchmarks/round_trip.sh [VANISH_BINARY] [ROUNDS] [CALLS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
vanish=${1:-$("$here/../mount-scripts/build" | tail -1)}
rounds=${2:-5}
calls=${3:-20000}
work=$(mktemp -d /var/tmp/round-trip.XXXXXX)
image=/dev/shm/round-trip.img
examples=/usr/share/doc/libfuse3-dev/examples
switch=/sys/module/fuse/parameters/enable_uring
saved=$(cat "$switch" 2>/dev/null || true)

cleanup() {
    cd /
    mountpoint -q "$work/disk/ll" && fusermount3 -u "$work/disk/ll"
    # vanish unmount waits for the daemon to end.
    for m in dev ring; do mountpoint -q "$work/disk/$m" && "$vanish" unmount "$work/disk/$m"; done
    for _ in $(seq 50); do umount "$work/disk" 2>/dev/null && break; sleep 0.1; done
    rm -f "$image"
    rm -rf "$work"
    [ -n "$saved" ] && echo "$saved" > "$switch"
}
trap cleanup EXIT

gcc -O2 -o "$work/round_trip" "$here/round_trip.c"
gcc -O2 -DHAVE_FALLOCATE -DHAVE_COPY_FILE_RANGE -I"$examples" "$examples/passthrough_ll.c" \
    -o "$work/passthrough_ll" $(pkg-config --cflags --libs fuse3)
[ -n "$saved" ] && echo Y > "$switch"
truncate -s 1G "$image"
mkfs.ext4 -q -F "$image"
mkdir -p "$work/disk"
mount -o loop "$image" "$work/disk"
cd "$work/disk"
mkdir -p src src2 ll dev ring
echo x > src/f
echo x > src2/f
"$work/passthrough_ll" -o source="$work/disk/src",cache=never,xattr ll &
"$vanish" mount -o cache=never,noevents,io_uring=off src dev
"$vanish" mount -o cache=never,noevents,io_uring=auto src2 ring
while ! mountpoint -q ll; do sleep 0.1; done

declare -A results
for ((r = 0; r < rounds; r++)); do
    for call in fstat getxattr; do
        for target in native:src ll:ll dev:dev ring:ring; do
            results[$call,${target%%:*}]+="$("$work/round_trip" "$call" "${target#*:}/f" "$calls") "
        done
    done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
echo "µs per call, median of $rounds rounds of $calls (cache=never):"
printf '%-10s %8s %15s %18s %18s\n' call native passthrough_ll "vanish /dev/fuse" "vanish io_uring"
for call in fstat getxattr; do
    printf '%-10s %8s %15s %18s %18s\n' "$call" \
        "$(echo "${results[$call,native]}" | median)" "$(echo "${results[$call,ll]}" | median)" \
        "$(echo "${results[$call,dev]}" | median)" "$(echo "${results[$call,ring]}" | median)"
done
