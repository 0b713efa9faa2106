"""Packet sizes on the testbed's links, each spelled once: Ethernet over Mininet's veths (MTU 1500), IPv4, and
Linux TCP with timestamps (the default); the other sizes are derived from these. Foundation layer, no imports:
the delay line, the shaper, `testbed.units`, calibrate and the analysis read them alike."""

from __future__ import annotations

MTU_BYTES = 1500  # a Mininet veth's, the IP packet's most
ETHERNET_HEADER_BYTES = 14  # what a frame adds to the IP packet, as the interface counters count it (no FCS)
TCP_IPV4_HEADER_BYTES = 52  # IPv4 20 + TCP 20 + timestamps 12: what Linux TCP puts before each segment's payload

TCP_MSS_BYTES = MTU_BYTES - TCP_IPV4_HEADER_BYTES  # 1448: a full segment's payload (iperf3's UDP datagram too)
FRAME_BYTES = MTU_BYTES + ETHERNET_HEADER_BYTES  # 1514: a full frame on the wire, the unit of the configured rate
GOODPUT_MAX = TCP_MSS_BYTES / FRAME_BYTES  # 0.956: TCP goodput's ceiling over a held rate (payload per frame)
