"""A shaped link: a network namespace whose loopback carries a run's traffic at a set rate.

Shared (the default): every process of a lab run lives in one namespace and talks over
its loopback, so every byte its collectives send (jax's CPU collectives are TCP, gloo)
crosses that loopback's queueing discipline: a token bucket (`tc-tbf(8)`) at the link's
rate, shared by all the run's traffic, as if every process sat on one link of that speed.
Switched: each process in a namespace of its own with a link of that rate each way to a
switch (see `Link`). The kernel's counters on the shapers (`tc -s`) are the bytes the
links carried.

Needs root and iproute2's `ip` and `tc`. Loopback's 64 KiB MTU is set to 1500, as on an
Ethernet link: a token bucket stalls on packets larger than its burst.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess

MTU = 1500
# Bytes a packet carries beyond TCP's payload on this link: Ethernet's header as loopback
# writes it (14), IPv4 (20) and TCP with the timestamp option Linux sends (32).
HEADER_BYTES = 14 + 20 + 32
UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class LabError(Exception):
  """Bad input or a failed run: its message is the one `error:` line a user sees."""


def parse_rate(text: str, *, field: str = "--bandwidth") -> float | None:
  """'100mbit' -> 1e8 bits/s; 'none' -> None (unshaped). Anything else is a LabError."""
  found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
  if text.strip().lower() == "none":
    return None
  if not found or found.group(2) not in UNITS or float(found.group(1)) <= 0:
    raise LabError(f"{field}={text!r} is not a rate: use a positive number with one of the "
                   f"units {', '.join(UNITS)} (bits per second), e.g. 100mbit or 1gbit, or "
                   f"'none' for an unshaped link")
  return float(found.group(1)) * UNITS[found.group(2)]


def missing_privileges() -> list[str]:
  """What a shaped link needs that this machine lacks (empty: nothing)."""
  missing = [] if os.geteuid() == 0 else ["root (this process runs as uid %d)" % os.geteuid()]
  return missing + [f"the `{tool}` command (iproute2)" for tool in ("ip", "tc")
                    if shutil.which(tool) is None]


def _run(*cmd: str) -> str:
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise LabError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")
  return proc.stdout


def namespaces() -> list[str]:
  """The names of this machine's network namespaces."""
  out = _run("ip", "-j", "netns", "list").strip()
  return [ns["name"] for ns in json.loads(out)] if out else []


TOPOLOGIES = ("shared", "switched")


@dataclasses.dataclass(frozen=True)
class Link:
  """The run's network, named `name`, at `rate_bps` bits/s (None: unshaped).

  `shared`: one namespace whose loopback carries every process's traffic through one
  bucket. `switched`: each of `hosts` processes in a namespace of its own, its `eth0` (a
  veth pair) on a bridge in a switch namespace, each direction of each link shaped at the
  rate: hosts with full-duplex links on a switch. Hosts take 127.1.0.<i+1> (loopback
  addresses, routed on the veths: the traffic never leaves these namespaces), and each
  namespace's /etc/hosts maps this machine's hostname to its own address, which is where
  gloo listens.
  """
  name: str
  rate_bps: float | None
  topology: str = "shared"
  hosts: int = 1

  @property
  def burst_bytes(self) -> int:
    # What the bucket may send at once: at least 4 ms of the rate (the kernel's timer
    # granularity; less throttles fast links below their rate) and 32 KiB.
    return max(32 * 1024, int(self.rate_bps / 8 * 0.004)) if self.rate_bps else 0

  @property
  def queue_bytes(self) -> int:
    # A queue of a second at the rate (at least 4 MiB): TCP backs off on delay, not on
    # drops, so no retransmission inflates what the counters see.
    return max(4 << 20, int(self.rate_bps / 8)) if self.rate_bps else 0

  @property
  def switched(self) -> bool:
    return self.topology == "switched"

  @property
  def device(self) -> str:
    """The device whose transmit counters are the link's bytes (each byte counted once: a
    host's uplink when switched)."""
    return "eth0" if self.switched else "lo"

  def namespace(self, host: int) -> str:
    """The namespace process `host` runs in."""
    return f"{self.name}-h{host}" if self.switched else self.name

  @property
  def namespaces(self) -> list[str]:
    return [self.namespace(i) for i in range(self.hosts if self.switched else 1)]

  def address(self, host: int) -> str:
    return f"127.1.0.{host + 1}" if self.switched else "127.0.0.1"

  def up(self) -> "Link":
    """Creates the namespaces, links and shapers."""
    if self.topology not in TOPOLOGIES:
      raise LabError(f"--topology={self.topology!r}: use one of {', '.join(TOPOLOGIES)}")
    try:
      if self.switched:
        self._up_switched()
      else:
        _run("ip", "netns", "add", self.name)
        _run("ip", "-n", self.name, "link", "set", "lo", "mtu", str(MTU), "up")
        self._shape(self.name, "lo")
    except LabError:
      self.down()
      raise
    return self

  def _up_switched(self) -> None:
    switch = f"{self.name}-sw"
    _run("ip", "netns", "add", switch)
    _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", switch, "link", "set", "br0", "up")
    for i in range(self.hosts):
      ns, port = self.namespace(i), f"p{i}"
      _run("ip", "netns", "add", ns)
      _run("ip", "link", "add", "eth0", "netns", ns, "mtu", str(MTU), "type", "veth", "peer",
           "name", port, "netns", switch, "mtu", str(MTU))
      _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
      _run("ip", "-n", ns, "link", "set", "lo", "up")
      _run("ip", "-n", ns, "link", "set", "eth0", "up")
      # 127/8 is the loopback's unless told otherwise: keep 127.0.0.1 there, route the
      # hosts' own 127.1.0.x over eth0.
      _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
           "net.ipv4.conf.eth0.route_localnet=1")
      _run("ip", "-n", ns, "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local")
      _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
      os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
      with open(f"/etc/netns/{ns}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost\n{self.address(i)} {socket.gethostname()}\n")
      self._shape(ns, "eth0")  # its uplink
      self._shape(switch, port)  # its downlink

  def _shape(self, ns: str, dev: str) -> None:
    if self.rate_bps:
      _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
           "rate", f"{int(self.rate_bps)}bit", "burst", str(self.burst_bytes),
           "limit", str(self.queue_bytes))

  def down(self) -> None:
    """Removes the namespaces, links and shapers (nothing if already gone)."""
    names = [*self.namespaces, f"{self.name}-sw"] if self.switched else [self.name]
    for ns in names:
      subprocess.run(["ip", "netns", "delete", ns], capture_output=True, check=False)
      shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

  def prefix(self, host: int = 0) -> list[str]:
    """The command prefix that runs a program as process `host`, in its namespace."""
    return ["ip", "netns", "exec", self.namespace(host)]

  def counters(self) -> dict[str, int]:
    """The shapers' counters since they were made, summed over the links' sending sides:
    bytes and packets sent, drops (`tc -s`); unshaped, the devices' own counters."""
    total = {"bytes": 0, "packets": 0, "drops": 0}
    for ns in self.namespaces:
      if self.rate_bps:
        (q,) = [q for q in json.loads(_run("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev",
                                           self.device)) if q.get("root")]
        got = {"bytes": q["bytes"], "packets": q["packets"], "drops": q["drops"]}
      else:
        (dev,) = json.loads(_run("ip", "-n", ns, "-s", "-j", "link", "show", self.device))
        tx = dev["stats64"]["tx"]
        got = {"bytes": tx["bytes"], "packets": tx["packets"], "drops": tx["dropped"]}
      total = {k: total[k] + got[k] for k in total}
    return total
