"""The latency tools that measure the links across a round trip: the netfilter-queue delay
(bench/nfq_delay.py), the hosts' deployment settings (bench/netns.py) and the exchange benchmark
(bench/exchange.py)."""

from __future__ import annotations

import subprocess

import pytest

from fusion_compute.bench.netns import TUNED_ROUTE, TUNED_SYSCTLS, Hosts, available

REASON = available(netem=True, delay="nfqueue")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"nfqueue delays unavailable: {REASON}")


@pytest.mark.slow
def test_the_delay_tool_delays_and_loses_nothing():
    """A 4 ms round trip made by the netfilter queue: the round trip measured is at least what was
    asked (the tool may add, never take away), a 1-byte exchange costs about one one-way delay, and
    messages of up to 128 KB (whole segmentation-offload packets in the queue) all arrive."""
    from fusion_compute.bench.exchange import run

    r = run(4.0, [1024, 131072], repeats=8, gap_ms=5.0, backend="tls", delay="nfqueue")
    # Upper bound: the tool wakes late by 0.1-0.5 ms idle, more on a loaded machine (docs/performance.md).
    assert 4.0 <= r["rtt_measured_ms"] < 8.0, r
    one_byte = r["rows"][0]
    assert one_byte["bytes"] == 1 and 0.4 <= one_byte["per_rtt"] < 1.5, one_byte
    assert [row["bytes"] for row in r["rows"]] == [1, 1024, 131072] and all(row["mean_ms"] > 0 for row in r["rows"])


def test_the_delay_is_at_the_receiver():
    """Packets wait where they arrive (PREROUTING on the receiving host), not where they leave: a
    packet held on its sender's egress still counts against the sending socket (TCP Small Queues), so
    the next bytes would wait for it, which no real network does (docs/performance.md)."""
    with Hosts(["10.79.1.1", "10.79.1.2"], one_way_ms=1.0, delay="nfqueue") as hosts:
        ns = hosts.ns["10.79.1.1"]
        rules = subprocess.run(
            ["ip", "netns", "exec", ns, "iptables", "-t", "mangle", "-S"], capture_output=True, text=True
        ).stdout
    assert "-A PREROUTING -i eth0 -j NFQUEUE" in rules and "POSTROUTING -o eth0 -j NFQUEUE" not in rules, rules


def test_tuned_hosts_get_the_deployment_settings():
    with Hosts(["10.79.2.1", "10.79.2.2"], delay=None, tuned=True) as hosts:
        ns = hosts.ns["10.79.2.1"]
        route = subprocess.run(["ip", "-n", ns, "route"], capture_output=True, text=True).stdout
        values = {
            k: subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-n", k], capture_output=True, text=True
            ).stdout.strip()
            for k in TUNED_SYSCTLS
        }
    assert " ".join(TUNED_ROUTE) in route, route
    assert values == TUNED_SYSCTLS
