#!/usr/bin/env python3
"""A peripheral that is NOT a Sync peripheral, on its own emulated adapter (hci1), for the
"not a Sync peripheral" check. Runs in the test-bed guest with the bed's venv python (bumble).

It advertises the Sync service UUID (so a gateway's discovery filter finds it) but its GATT
database has only a Battery service: the gateway must say "not a Sync peripheral" after
services resolve, instead of hanging or calling it "not found".

Usage: foreign_peripheral.py ADDRESS READY_FILE   (opens a new /dev/vhci controller = hciN)
"""
import asyncio
import os
import signal
import sys

sys.path.insert(0, os.environ["FERRY_TESTBED_DIR"])
import peripheral as bed  # noqa: E402  (the bed's two bumble fixes: routing link, enhanced conn. complete)


async def main(address: str, ready_file: str) -> None:
    from bumble.controller import Controller
    from bumble.device import Device
    from bumble.gatt import Characteristic, Service
    from bumble.hci import Address
    from bumble.host import Host
    from bumble.transport.common import AsyncPipeSink

    RoutingLink, KernelFacingController = bed.make_link_and_controller_classes()
    link = RoutingLink()
    controller = Controller("foreign", link=link)
    host = Host(controller, AsyncPipeSink(controller))
    name = "NotSync"
    device = Device(name=name, address=Address(address, Address.RANDOM_DEVICE_ADDRESS), host=host)
    battery = Characteristic("2A19", Characteristic.Properties.READ, Characteristic.READABLE, bytes([87]))
    device.add_service(Service("180F", [battery]))
    await device.power_on()
    await device.start_advertising(
        auto_restart=True, advertising_data=bed.adv_data(name), scan_response_data=bed.scan_response(name),
        advertising_interval_min=100, advertising_interval_max=100)
    transport = await bed.open_controller_transport("vhci")
    kernel_controller = KernelFacingController(
        "hci-vhci-2", host_source=transport.source, host_sink=transport.sink, link=link,
        public_address="F0:E0:D0:00:00:02")
    with open(ready_file, "w") as f:
        f.write(address + "\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    del kernel_controller
    await transport.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
