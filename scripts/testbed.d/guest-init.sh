#!/usr/bin/env bash
# Runs inside the throw-away VM (started by scripts/testbed through vng). Argument: the
# results dir, shared read-write with the host. Brings up kernel Bluetooth, the system bus,
# bluetoothd and the emulated peripherals, runs the user's command, collects logs.
# Every wait here is bounded; the host also bounds the whole VM with `timeout`.
set -uo pipefail

RESULTS="$1"
# shellcheck disable=SC1091
source "$RESULTS/bed.conf"

T0=$(awk '{print $1}' /proc/uptime)
mark() { echo "$1 $(awk -v t0="$T0" '{printf "%.1f", $1}' /proc/uptime)" >>"$RESULTS/timings.txt"; }
fail() {
    echo "$*" >"$RESULTS/bed-failure.txt"
    echo "testbed guest: FAILED: $*" >&2
    collect
    exit 1
}
PIDS=()
collect() {
    # Stop what we started (SIGTERM: the peripheral writes its final stats), newest first.
    local i
    for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill "${PIDS[i]}" 2>/dev/null; done
    for ((i=0; i<50; i++)); do
        local alive=0 p
        for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [[ $alive -eq 0 ]] && break
        sleep 0.1
    done
    dmesg >"$RESULTS/dmesg.log" 2>/dev/null || true
    sync
}

: >"$RESULTS/timings.txt"
mark guest-start

# --- scratch tmpfs: SQLite WAL fails on the 9p-shared folders
SCRATCH=/tmp/ferry-testbed-scratch
mkdir -p "$SCRATCH" && mount -t tmpfs -o size=256m tmpfs "$SCRATCH" || fail "cannot mount tmpfs scratch at $SCRATCH"

# --- emulated controller + peripherals, started first: importing bumble takes ~20 s under
# TCG and overlaps with the rest of the bring-up; it opens /dev/vhci once that exists.
# With the peripherals on the host there is no control channel (FERRY_TESTBED_CONTROL is empty).
CONTROL=""
if [[ "${TB_PERIPHERALS_ON:-guest}" == guest ]]; then
    CONTROL=/run/ferry-testbed-control
    mkfifo "$CONTROL" || fail "mkfifo $CONTROL failed"
    rm -f "$RESULTS/peripherals.ready"
    "$TB_VENV/bin/python" "$TB_DIR/peripheral.py" \
        --peripherals "$TB_PERIPHERALS" --events "$TB_EVENTS" "${TB_PERIPHERAL_ARGS[@]}" \
        --stats-dir "$RESULTS" --store-dir "$SCRATCH/peripheral-store" \
        --ready-file "$RESULTS/peripherals.ready" --control "$CONTROL" \
        >"$RESULTS/peripherals.log" 2>&1 &
    PERIPHERAL_PID=$!
    PIDS+=("$PERIPHERAL_PID")
fi

# --- kernel Bluetooth
# Generous bounds: on a loaded host the emulated CPU is starved, and loading bluetooth (its crypto self-tests)
# took over 30 s once (a crypto_wait_for_test warning in dmesg). A bound is there to end a hang, not to time it.
timeout 120 modprobe bluetooth || fail "modprobe bluetooth failed (kernel $(uname -r) lacks Bluetooth?)"
timeout 120 modprobe hci_vhci || fail "modprobe hci_vhci failed"
for _ in $(seq 300); do [[ -c /dev/vhci ]] && break; sleep 0.1; done
[[ -c /dev/vhci ]] || fail "/dev/vhci did not appear after loading hci_vhci"
if [[ "${TB_PERIPHERALS_ON:-guest}" == host ]]; then
    # The controller runs on the host (scripts/testbed --peripherals-on host), behind a virtio-serial port.
    port=""
    for d in /sys/class/virtio-ports/*; do
        [[ "$(cat "$d/name" 2>/dev/null)" == ferry-hci ]] && port="/dev/$(basename "$d")"
    done
    [[ -n "$port" ]] || fail "no virtio-serial port ferry-hci (qemu options not applied?)"
    for _ in $(seq 50); do [[ -c "$port" ]] && break; sleep 0.1; done
    [[ -c "$port" ]] || mknod "$port" c "$(cut -d: -f1 "/sys/class/virtio-ports/$(basename "$port")/dev")" \
        "$(cut -d: -f2 "/sys/class/virtio-ports/$(basename "$port")/dev")"
    "$TB_RELAY" "$port" /dev/vhci >"$RESULTS/vhci-relay.log" 2>&1 &
    PERIPHERAL_PID=$!
    PIDS+=("$PERIPHERAL_PID")
fi

# --- system bus and bluetoothd
mkdir -p /run/dbus /var/lib/bluetooth
rm -f /run/dbus/pid
timeout 60 dbus-daemon --system --fork --print-pid=1 >/tmp/dbus.pid 2>"$RESULTS/dbus-daemon.log" \
    || fail "dbus-daemon --system did not start (see dbus-daemon.log)"
PIDS+=("$(head -1 /tmp/dbus.pid)")
BLUETOOTHD=/usr/libexec/bluetooth/bluetoothd
[[ -x "$BLUETOOTHD" ]] || BLUETOOTHD=/usr/lib/bluetooth/bluetoothd
[[ -x "$BLUETOOTHD" ]] || fail "bluetoothd not found (apt-get install bluez)"
"$BLUETOOTHD" -n -d >"$RESULTS/bluetoothd.log" 2>&1 &
PIDS+=($!)
mark system-bus-and-bluetoothd-started

# --- wait (bounded) for the adapter on D-Bus, then power it on
adapter_on_bus() {
    dbus-send --system --print-reply --reply-timeout=2000 --dest=org.bluez /org/bluez/hci0 \
        org.freedesktop.DBus.Properties.Get string:org.bluez.Adapter1 string:Address >/dev/null 2>&1
}
deadline=$(( $(date +%s) + TB_ADAPTER_TIMEOUT ))
until adapter_on_bus; do
    kill -0 "$PERIPHERAL_PID" 2>/dev/null || fail "the emulated peripheral process died: $(tail -5 "$RESULTS/peripherals.log" | tr '\n' ' ')"
    [[ $(date +%s) -lt $deadline ]] || fail "no adapter hci0 on D-Bus after ${TB_ADAPTER_TIMEOUT}s"
    sleep 0.5
done
mark adapter-on-dbus
timeout 30 dbus-send --system --print-reply --dest=org.bluez /org/bluez/hci0 org.freedesktop.DBus.Properties.Set \
    string:org.bluez.Adapter1 string:Powered variant:boolean:true >/dev/null || fail "could not power on hci0"
until [[ -s "$RESULTS/peripherals.ready" ]]; do
    kill -0 "$PERIPHERAL_PID" 2>/dev/null || fail "the emulated peripheral process died: $(tail -5 "$RESULTS/peripherals.log" | tr '\n' ' ')"
    [[ $(date +%s) -lt $deadline ]] || fail "peripherals not advertising after ${TB_ADAPTER_TIMEOUT}s"
    sleep 0.2
done
mark adapter-powered-peripherals-advertising

# --- the user's command
FERRY_TESTBED_PERIPHERALS="$(cat "$RESULTS/peripherals.ready")"
export FERRY_TESTBED_PERIPHERALS
export FERRY_TESTBED_ADAPTER=hci0
export FERRY_TESTBED_RESULTS="$RESULTS"
export FERRY_TESTBED_SCRATCH="$SCRATCH"
export FERRY_TESTBED_CONTROL="$CONTROL"
export FERRY_TESTBED_EVENTS="$TB_EVENTS"
export FERRY_TESTBED_PAYLOAD_BYTES="$TB_PAYLOAD_BYTES"
export FERRY_TESTBED_DIR="$TB_DIR"
cd "$TB_CWD" 2>/dev/null || cd /
echo "testbed guest: running: ${TB_CMD[*]}" >&2
"${TB_CMD[@]}"
status=$?
mark command-done
echo "$status" >"$RESULTS/cmd.status.tmp"
collect
mv "$RESULTS/cmd.status.tmp" "$RESULTS/cmd.status"
exit 0
