"""A node's own address on a real VM: the source address of its route to the run's Redis,
and the interface gloo must bind to (by default it takes what the hostname resolves to:
127.0.1.1 on many images, or nothing at all, and then every peer is refused). Checked in a
network namespace of the test's own, with an address that is not loopback."""

from __future__ import annotations

import subprocess
import sys

from box.network import GATEWAY, BoxNetwork


def test_a_vm_finds_its_own_address_and_interface_from_its_route_to_redis() -> None:
    net = BoxNetwork()
    net.create()
    try:
        vm = net.add_vm("a", 1)
        code = (
            "from spottrain.agent.config import interface_of, own_address\n"
            f"a = own_address('rediss://{GATEWAY}:6380/0')\n"
            "print(a, interface_of(a), interface_of('127.0.0.1'), interface_of('192.0.2.9'))\n"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", vm.netns, sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert out == [vm.address, "eth0", "lo", "None"]
    finally:
        net.close()
