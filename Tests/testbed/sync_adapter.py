#!/usr/bin/env python3
"""Adapter recovery (issue 15 item 4) on real bluetoothd and the kernel, in ONE boot of the test bed.

The emulated controller (hci0, bumble behind /dev/vhci) is wedged behind bluetoothd's back with the bed's
control command `wedge hci0`: it ignores every HCI packet from the kernel and sends nothing, while bluetoothd
still calls it powered (the failure reported most on Pis).

 A. heal-on-reset wedge (an HCI_Reset brings it back, as with many real controllers): `ferry run` syncs a
    peripheral, the controller wedges, new events arrive; the daemon sees every connect fail, power cycles the
    adapter through bluetoothd and/or resets it through the kernel, connects work again, the new events are
    drained; every step is in the log and in /metrics. In lab mode: besides each connect's own discovery, the
    daemon holds a discovery across the power cycle, which bluetoothd drops at power-off and Ferry must start
    again (without that, nothing was ever found after the recovery).
 B. a controller that never comes back (`wedge hci0 forever`), fresh `ferry run` with an allowlist: the ladder
    ends with ferry exiting non-zero (status 1) after a power cycle and an HCI reset, so systemd would restart it.

Host: python3 Tests/testbed/sync_adapter.py [--results DIR]      (build ferry first: swift build)
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bedlib as b  # noqa: E402

SCENARIO = "sync_adapter"
EVENTS = 40
MORE = 30
METRICS = "127.0.0.1:9464"


def write_config(path: str, state: str, address: str, lab: bool) -> None:
    with open(path, "w") as f:
        json.dump({
            "require_bond": False, "allow_any_sync_peripheral": lab, "state_dir": state, "peripherals": [address],
            "max_connections": 2,
            "sync_interval_seconds": 2, "backoff_base_seconds": 1, "backoff_cap_seconds": 4,
            "connect_timeout_seconds": 10, "log_level": "info", "metrics_listen": METRICS,
            # A wedged controller finds nothing: each connect fails after this discovery (default 15 s).
            "discovery_timeout_seconds": 5,
            # Short thresholds so the ladder fits a CI boot (defaults: 300 / 3 / 60 / 120 / 3600 s); verify 30 s: after a
            # power cycle the bed's busy bluetoothd needs ~15 s to report the peripheral again.
            "adapter_recovery": {"wedged_after_seconds": 12, "min_failures": 2, "adapter_missing_seconds": 8,
                                 "verify_seconds": 30, "cooldown_seconds": 600},
        }, f)


class Daemon:
    """`ferry run` with its log in a file (a pipe would fill up and block it)."""

    def __init__(self, config: str, log_name: str, limit: int):
        self.log_path = os.path.join(b.results_dir(), log_name)
        self.log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(["timeout", "-k", "5", str(limit), b.FERRY, "run", "--config", config],
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_log(self, pattern: str, limit: float) -> float | None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if re.search(pattern, self.text()):
                return time.monotonic() - self.t0
            if self.proc.poll() is not None:
                return None
            time.sleep(0.3)
        return None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def metric(name: str, labels: str = "") -> float | None:
    try:
        text = urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return None


def controller() -> dict:
    try:
        with open(os.path.join(b.results_dir(), "controller.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def diagnose(c: b.Checks, label: str, addr: str, daemon: "Daemon") -> None:
    """What the CI log otherwise hides when recovery fails: the daemon's last lines, whether bluetoothd is up
    with the adapter powered and the device known, and the kernel's Bluetooth complaints (an oops, command
    timeouts)."""
    c.note(f"{label} ferry run's last lines:\n" + "\n".join(daemon.text().splitlines()[-15:]))
    up = subprocess.run(["pidof", "bluetoothd"], capture_output=True, text=True).stdout.strip()
    adapter = subprocess.run(["dbus-send", "--system", "--print-reply", "--reply-timeout=5000", "--dest=org.bluez",
                              f"/org/bluez/{b.adapter()}", "org.freedesktop.DBus.Properties.Get",
                              "string:org.bluez.Adapter1", "string:Powered"], capture_output=True, text=True)
    c.note(f"{label} bluetoothd pid {up or 'none'}; adapter Powered: "
           f"{adapter.stdout.split()[-1] if adapter.returncode == 0 else adapter.stderr.strip()[:200]}; "
           f"device Address {b.device_prop(addr, 'Address')}, Connected {b.device_prop(addr, 'Connected')}; "
           f"controller {controller()}")
    dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()
    kernel = [l for l in dmesg if re.search(r"Bluetooth|hci|BUG|Oops|Call Trace|RIP:", l)]
    c.note(f"{label} kernel (last Bluetooth lines):\n" + "\n".join(kernel[-25:]))


def scenario_heal(c: b.Checks, addr: str, config: str) -> None:
    d = Daemon(config, "ferry-run-heal.log", 400)
    try:
        drained = b.wait_stats(addr, lambda s: s["highest_ack"] >= EVENTS, 90)
        c.check("A daemon drains the peripheral before the wedge", drained is not None, str(b.stats(addr)["highest_ack"]))
        b.control("wedge hci0")
        wedged_at = time.monotonic()
        c.check("A controller wedged (bed)", b.wait_stats(addr, lambda s: controller().get("wedged") == "heal-on-reset", 5)
                is not None, str(controller()))
        b.control(f"add {addr} {MORE}")
        step = d.wait_log(r"adapter recovery: every connect failed for 12 s: (power cycling|resetting)", 120)
        c.check("A every connect failing is detected and a recovery step starts", step is not None,
                f"after {step:.0f} s of ferry run" if step else d.text()[-1500:])
        recovered = d.wait_log(r"adapter recovery: connects work again after the (power cycle|hci reset)", 150)
        if not c.check("A connects work again after a recovery step", recovered is not None,
                       f"after {recovered:.0f} s of ferry run" if recovered else d.text()[-1500:]):
            diagnose(c, "A", addr, d)
        drained = b.wait_stats(addr, lambda s: s["highest_ack"] >= EVENTS + MORE, 90)
        c.note(f"A wedge to recovered: {time.monotonic() - wedged_at:.1f} s; controller {controller()}")
        c.check("A the events added during the wedge are drained afterwards", drained is not None,
                str(b.stats(addr)["highest_ack"]))
        c.check("A the controller was healed by an HCI_Reset (power on or kernel reset)",
                controller().get("healed_by_reset", 0) >= 1 and controller().get("wedged") is None, str(controller()))
        steps = (metric("ferry_adapter_recovery_steps_total", '{step="power_cycle"}') or 0) \
            + (metric("ferry_adapter_recovery_steps_total", '{step="hci_reset"}') or 0)
        c.check("A /metrics counts the step(s) and one recovery, wedged back to 0",
                steps >= 1 and metric("ferry_adapter_recoveries_total") == 1 and metric("ferry_adapter_wedged") == 0
                and metric("ferry_adapter_recovery_steps_total", '{step="exit"}') == 0,
                f"steps {steps}, recoveries {metric('ferry_adapter_recoveries_total')}, wedged {metric('ferry_adapter_wedged')}")
        s = b.stats(addr)
        c.check("A 0 protocol violations", s["violations"] == 0, str(s["violation_list"][:3]))
    finally:
        rc = d.stop()
        c.check("A the daemon stops cleanly (SIGTERM, exit 0)", rc == 0, f"rc {rc}")


def scenario_forever(c: b.Checks, addr: str, config: str) -> None:
    b.control("wedge hci0 forever")
    time.sleep(1)
    d = Daemon(config, "ferry-run-forever.log", 300)
    t0 = time.monotonic()
    try:
        d.proc.wait(280)
    except subprocess.TimeoutExpired:
        pass
    took = time.monotonic() - t0
    text = d.text()
    if d.proc.poll() is None:
        diagnose(c, "B", addr, d)
    rc = d.stop()
    c.note(f"B exit after {took:.1f} s with status {rc}")
    c.check("B a controller that never comes back ends in exit status 1", rc == 1, f"rc {rc}; {text[-1500:]}")
    c.check("B the log shows the ladder: power cycle, HCI reset, exit",
            "power cycling hci0" in text and "resetting hci0 through the kernel" in text
            and "exiting non-zero so the service manager restarts ferry" in text, text[-2000:])
    c.check("B the last line says why it exits", "unusable after a power cycle and an HCI reset" in text.strip().splitlines()[-1]
            if text.strip() else False, text[-300:])
    b.control("unwedge hci0")


def guest() -> int:
    c = b.Checks(SCENARIO)
    addr = b.peripherals()[0]
    state = os.path.join(b.scratch(), "state")
    os.makedirs(state, mode=0o700, exist_ok=True)
    config = os.path.join(b.scratch(), "ferry.json")
    write_config(config, state, addr, lab=True)
    allowlist = os.path.join(b.scratch(), "ferry-allowlist.json")
    write_config(allowlist, state, addr, lab=False)
    try:
        scenario_heal(c, addr, config)
        scenario_forever(c, addr, allowlist)
    except Exception as e:  # a crash in the scenario is a failure, with its reason in checks.json
        c.crashed(e)
    return c.finish()


if __name__ == "__main__":
    if "--guest" in sys.argv:
        sys.exit(guest())
    sys.exit(b.host_main(__file__, SCENARIO, ["--peripherals", "1", "--events", str(EVENTS)], bed_timeout=900))
