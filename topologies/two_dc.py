"""Two datacenters joined by a WAN, as a Mininet topology.

Per datacenter: a gateway host that routes (`{dc}-gw`), one Linux bridge (no SDN controller) joining the
gateway and the hosts of `DatacenterSpec.host_names()`. The WAN is one veth pair between the two
gateways built with `WanLink`/`WanIntf`: they configure only addresses; rate, delay and loss are put on
by `testbed.net.wan` over netlink (never TCLink's capped, both-ends tc strings).

Names of bridges live in the root namespace, so each Network gets its own short `tag`
(``br{f|d}{tag}``: `testbed.net.state.bridge_name`, which `prfaas clean` knows them by; ports ``br{f|d}{tag}-eth{n}``)
and several networks can run side by side. The bridge gets an explicit dpid, since Mininet otherwise derives it from
digits in the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network

from mininet.link import Intf, Link
from mininet.nodelib import LinuxBridge
from mininet.topo import Topo

from testbed.net.state import bridge_name
from testbed.scenario import TopologySpec

SUBNETS = {"prfaas": IPv4Network("10.1.0.0/24"), "pd": IPv4Network("10.2.0.0/24")}
WAN_SUBNET = IPv4Network("10.0.0.0/30")
WAN_IPS = {"prfaas": "10.0.0.1", "pd": "10.0.0.2"}
FIRST_HOST_OFFSET = 10  # .1 is the gateway, hosts from .10


def gateway_name(dc: str) -> str:
    return f"{dc}-gw"


def wan_ifname(dc: str) -> str:
    return f"{dc}-gw-wan"


def lan_ifname(dc: str) -> str:
    return f"{dc}-gw-lan"


@dataclass(frozen=True)
class Addressing:
    """Every host's address and the gateway each one routes through."""

    ips: dict[str, str]  # host -> address (no prefix length)
    datacenter: dict[str, str]  # host -> "prfaas" | "pd"


def addressing(spec: TopologySpec) -> Addressing:
    """prfaas 10.1.0.0/24, pd 10.2.0.0/24: gateway .1 on the LAN, hosts from .10 in host_names() order."""
    ips: dict[str, str] = {}
    dcs: dict[str, str] = {}
    for dc in ("prfaas", "pd"):
        net = SUBNETS[dc]
        ips[gateway_name(dc)] = str(net.network_address + 1)
        dcs[gateway_name(dc)] = dc
        names = spec.datacenter(dc).host_names()
        if len(names) + FIRST_HOST_OFFSET >= net.num_addresses - 1:
            raise ValueError(f"topology.{dc}: {len(names)} hosts do not fit in {net}")
        for i, name in enumerate(names):
            ips[name] = str(IPv4Address(int(net.network_address) + FIRST_HOST_OFFSET + i))
            dcs[name] = dc
    return Addressing(ips, dcs)


class WanIntf(Intf):
    """A WAN end: address and link state only; qdiscs come from testbed.net.wan over netlink."""


class WanLink(Link):
    """The veth pair between the gateways, with `WanIntf` on both ends."""

    def __init__(self, node1, node2, **params) -> None:  # type: ignore[no-untyped-def]
        params.setdefault("intfName1", wan_ifname(node1.name.split("-")[0]))
        params.setdefault("intfName2", wan_ifname(node2.name.split("-")[0]))
        params["intf"] = WanIntf
        super().__init__(node1, node2, **params)


class NetlinkBridge(LinuxBridge):
    """Mininet's LinuxBridge, but built over netlink (pyroute2) rather than brctl/ifconfig,
    which minimal hosts lack; no STP, so the bridge forwards at once."""

    @classmethod
    def setup(cls) -> None:
        """Nothing to check: no brctl needed."""

    def start(self, _controllers) -> None:  # type: ignore[no-untyped-def]
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            if ipr.link_lookup(ifname=self.name):
                ipr.link("del", ifname=self.name)
            ipr.link("add", ifname=self.name, kind="bridge", br_stp_state=0, br_forward_delay=0)
            br = ipr.link_lookup(ifname=self.name)[0]
            for intf in self.intfList():
                if self.name in intf.name:
                    idx = ipr.link_lookup(ifname=intf.name)[0]
                    ipr.link("set", index=idx, master=br, state="up")
            ipr.link("set", index=br, state="up")

    def stop(self, deleteIntfs: bool = True) -> None:  # noqa: N803 (Mininet's name)
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            if ipr.link_lookup(ifname=self.name):
                ipr.link("del", ifname=self.name)
        super(LinuxBridge, self).stop(deleteIntfs)


class TwoDatacenterTopo(Topo):
    """Mininet Topo from a `TopologySpec`; `tag` makes the root-namespace bridge names unique."""

    def build(self, spec: TopologySpec, tag: str = "0") -> None:  # type: ignore[override]
        plan = addressing(spec)
        for n, dc in enumerate(("prfaas", "pd"), start=1):
            prefixlen = SUBNETS[dc].prefixlen
            sw = self.addSwitch(bridge_name(dc, tag), cls=NetlinkBridge, dpid=f"{int(tag, 16) * 4 + n:016x}")
            gw = self.addHost(gateway_name(dc), ip=f"{plan.ips[gateway_name(dc)]}/{prefixlen}")
            self.addLink(gw, sw, intfName1=lan_ifname(dc))
            for host in spec.datacenter(dc).host_names():
                h = self.addHost(host, ip=f"{plan.ips[host]}/{prefixlen}", defaultRoute=f"via {plan.ips[gateway_name(dc)]}")
                self.addLink(h, sw)
        self.addLink(
            gateway_name("prfaas"), gateway_name("pd"), cls=WanLink,
            params1={"ip": f"{WAN_IPS['prfaas']}/{WAN_SUBNET.prefixlen}"},
            params2={"ip": f"{WAN_IPS['pd']}/{WAN_SUBNET.prefixlen}"},
        )
