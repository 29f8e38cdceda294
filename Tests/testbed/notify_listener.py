#!/usr/bin/env python3
"""The systemd side of sd_notify, for the test bed: binds an AF_UNIX datagram socket (a path, or '@name' for
the abstract namespace) and appends one JSON line per datagram to LOG: {"t": wall-clock seconds, "msg": text}.

  notify_listener.py SOCKET LOG      (runs until killed)
"""
import json
import socket
import sys
import time

path, log = sys.argv[1], sys.argv[2]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind("\0" + path[1:] if path.startswith("@") else path)
with open(log, "a", buffering=1) as out:
    while True:
        data = sock.recv(4096)
        out.write(json.dumps({"t": time.time(), "msg": data.decode("utf-8", "replace")}) + "\n")
