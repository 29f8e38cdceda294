#!/usr/bin/python3
"""A minimal org.bluez.Agent1 for the test bed (python3-dbus + GLib), run as its own process.

bluetoothd asks the agent of the process that called Device1.Pair, or else the default agent; this
one registers itself as the default, so a probe in another process can call Pair synchronously
while this process answers bluetoothd's questions. Without any agent a pairing-triggering call
hangs until its D-Bus timeout (measured on bluetoothd 5.66), so a test registers one first.

  pair_agent.py --capability NoInputNoOutput|KeyboardDisplay|DisplayOnly|... [--passkey N]
                [--ready FILE] [--log FILE]

- RequestPasskey answers N (without --passkey: Rejected, never a guess);
- RequestConfirmation accepts only if the number shown equals N (or, without --passkey, Rejects);
- DisplayPasskey / DisplayPinCode are logged; RequestAuthorization and AuthorizeService accept
  (the operator asked for this pairing); everything else is Rejected.
Each request is one JSON line in --log. SIGTERM unregisters and exits.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import dbus
import dbus.mainloop.glib
import dbus.service
from gi.repository import GLib

AGENT_PATH = "/ferry/testbed/agent"


class Rejected(dbus.DBusException):
    _dbus_error_name = "org.bluez.Error.Rejected"


class Agent(dbus.service.Object):
    def __init__(self, bus, passkey: int | None, log_path: str | None):
        super().__init__(bus, AGENT_PATH)
        self.passkey = passkey
        self.log_path = log_path

    def note(self, method: str, **fields) -> None:
        line = json.dumps({"t": round(time.time(), 3), "method": method, **{k: str(v) for k, v in fields.items()}})
        print(line, flush=True)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(line + "\n")

    @dbus.service.method("org.bluez.Agent1", in_signature="", out_signature="")
    def Release(self):
        self.note("Release")

    @dbus.service.method("org.bluez.Agent1", in_signature="os", out_signature="")
    def AuthorizeService(self, device, uuid):
        self.note("AuthorizeService", device=device, uuid=uuid)

    @dbus.service.method("org.bluez.Agent1", in_signature="o", out_signature="s")
    def RequestPinCode(self, device):
        self.note("RequestPinCode", device=device, answer="rejected")
        raise Rejected("no PIN code (LE only)")

    @dbus.service.method("org.bluez.Agent1", in_signature="o", out_signature="u")
    def RequestPasskey(self, device):
        if self.passkey is None:
            self.note("RequestPasskey", device=device, answer="rejected")
            raise Rejected("no passkey configured")
        self.note("RequestPasskey", device=device, answer=f"{self.passkey:06d}")
        return dbus.UInt32(self.passkey)

    @dbus.service.method("org.bluez.Agent1", in_signature="ouq", out_signature="")
    def DisplayPasskey(self, device, passkey, entered):
        self.note("DisplayPasskey", device=device, passkey=f"{int(passkey):06d}", entered=int(entered))

    @dbus.service.method("org.bluez.Agent1", in_signature="os", out_signature="")
    def DisplayPinCode(self, device, pincode):
        self.note("DisplayPinCode", device=device, pincode=pincode)

    @dbus.service.method("org.bluez.Agent1", in_signature="ou", out_signature="")
    def RequestConfirmation(self, device, passkey):
        ok = self.passkey is not None and int(passkey) == self.passkey
        self.note("RequestConfirmation", device=device, shown=f"{int(passkey):06d}",
                  answer="accepted" if ok else "rejected")
        if not ok:
            raise Rejected("the number shown is not the configured passkey")

    @dbus.service.method("org.bluez.Agent1", in_signature="o", out_signature="")
    def RequestAuthorization(self, device):
        self.note("RequestAuthorization", device=device, answer="accepted")

    @dbus.service.method("org.bluez.Agent1", in_signature="", out_signature="")
    def Cancel(self):
        self.note("Cancel")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capability", default="NoInputNoOutput")
    ap.add_argument("--passkey", type=int, default=None)
    ap.add_argument("--ready", default=None, help="file written once the agent is the default agent")
    ap.add_argument("--log", default=None)
    args = ap.parse_args()

    dbus.mainloop.glib.DBusGMainLoop(set_as_default=True)
    bus = dbus.SystemBus()
    agent = Agent(bus, args.passkey, args.log)
    manager = dbus.Interface(bus.get_object("org.bluez", "/org/bluez"), "org.bluez.AgentManager1")
    manager.RegisterAgent(AGENT_PATH, args.capability, timeout=10)
    manager.RequestDefaultAgent(AGENT_PATH, timeout=10)
    agent.note("Registered", capability=args.capability,
               passkey="none" if args.passkey is None else f"{args.passkey:06d}")
    if args.ready:
        with open(args.ready, "w") as f:
            f.write("ready\n")

    loop = GLib.MainLoop()

    def stop(*_):
        try:
            manager.UnregisterAgent(AGENT_PATH, timeout=5)
        except dbus.DBusException:
            pass  # bluetoothd gone or restarted: nothing to unregister
        loop.quit()

    GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGTERM, stop)
    GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGINT, stop)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
