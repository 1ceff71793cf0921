"""A shaped link: a network namespace whose loopback carries a run's traffic at a set rate.

Every process of a lab run lives in one namespace and talks over its loopback, so every
byte its collectives send (jax's CPU collectives are TCP, gloo) crosses that loopback's
queueing discipline: a token bucket (`tc-tbf(8)`) at the link's rate, shared by all the
run's traffic, as if every process sat on one link of that speed. The kernel's counters on
the shaper (`tc -s`) are the bytes the link carried.

Needs root and iproute2's `ip` and `tc`. Loopback's 64 KiB MTU is set to 1500, as on an
Ethernet link: a token bucket stalls on packets larger than its burst.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
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


@dataclasses.dataclass(frozen=True)
class Link:
  """A namespace `name` whose loopback runs at `rate_bps` bits/s (None: unshaped)."""
  name: str
  rate_bps: float | None

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

  def up(self) -> "Link":
    """Creates the namespace and shapes its loopback."""
    _run("ip", "netns", "add", self.name)
    try:
      _run("ip", "-n", self.name, "link", "set", "lo", "mtu", str(MTU), "up")
      if self.rate_bps:
        _run("tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "tbf",
             "rate", f"{int(self.rate_bps)}bit", "burst", str(self.burst_bytes),
             "limit", str(self.queue_bytes))
    except LabError:
      self.down()
      raise
    return self

  def down(self) -> None:
    """Removes the namespace and its shaper (nothing if already gone)."""
    subprocess.run(["ip", "netns", "delete", self.name], capture_output=True, check=False)

  def prefix(self) -> list[str]:
    """The command prefix that runs a program inside the namespace."""
    return ["ip", "netns", "exec", self.name]

  def counters(self) -> dict[str, int]:
    """The shaper's counters since it was made: bytes and packets sent, drops (`tc -s`);
    unshaped, the loopback device's own transmit counters."""
    if self.rate_bps:
      (qdisc,) = [q for q in json.loads(_run("tc", "-n", self.name, "-s", "-j", "qdisc", "show",
                                                "dev", "lo")) if q.get("root")]
      return {"bytes": qdisc["bytes"], "packets": qdisc["packets"], "drops": qdisc["drops"]}
    (dev,) = json.loads(_run("ip", "-n", self.name, "-s", "-j", "link", "show", "lo"))
    tx = dev["stats64"]["tx"]
    return {"bytes": tx["bytes"], "packets": tx["packets"], "drops": tx["dropped"]}
