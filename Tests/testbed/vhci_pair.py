#!/usr/bin/env python3
"""Two more emulated adapters on one emulated radio link, both driven by the guest's bluetoothd: the first
(hciN) is a gateway's adapter, the second (hciN+1) the Linux peripheral's (Hardware/peripheral/linux), so
`ferry sync` and `ferry-peripheral` meet through real bluetoothd on BOTH sides. Runs in the test-bed guest
with the bed's venv python (bumble); the bed's two bumble fixes are reused from peripheral.py.

Usage: vhci_pair.py READY_FILE      (writes "ready" once both /dev/vhci controllers are open)
"""
import asyncio
import os
import signal
import sys

sys.path.insert(0, os.environ["FERRY_TESTBED_DIR"])
import peripheral as bed  # noqa: E402


async def main(ready_file: str) -> None:
    RoutingLink, KernelFacingController = bed.make_link_and_controller_classes()
    link = RoutingLink()
    keep = []
    for n, address in enumerate(("F0:E0:D0:00:00:03", "F0:E0:D0:00:00:04")):
        transport = await bed.open_controller_transport("vhci")
        keep.append((transport, KernelFacingController(
            f"hci-vhci-pair-{n}", host_source=transport.source, host_sink=transport.sink, link=link,
            public_address=address)))
        await asyncio.sleep(1.0)  # in order: the gateway's adapter gets the lower hci number
    with open(ready_file, "w") as f:
        f.write("ready\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for transport, _ in keep:
        await transport.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
