"""What a step should take on a link, from its compiled collectives and the link's rate.

The lab's link is one token bucket shared by every process: all the bytes a step's
collectives send, from every process, queue for the same rate. A step whose collectives
do not overlap its compute (XLA:CPU runs a program's collectives in line) then takes

    compute + wire bytes / rate,  wire bytes = collective payload x (1 + headers / MSS)

where the payload is what the compiled program's collectives send from every process
(for data parallelism over P processes, P x 2(P-1)/P x the gradients' bytes: a ring
all-reduce), and each MSS of payload travels with HEADER_BYTES of Ethernet, IP and TCP
headers (ACKs, at most one per two segments, are the rest and are not predicted).

On a switched network (a link each way per process) the bottleneck is each process's
uplink instead, which carries that process's own sends: 1/P of the payload when every
process sends alike (`link_payload`).

The rate is the smaller of the shaper's and what the loopback carries unshaped: the
kernel's TCP stack runs on the same cores as the processes, so a small machine's loopback
has a ceiling of its own (`capacity_bps`, measured on the unshaped link).
"""
from __future__ import annotations

from jaxsys.lab.link import HEADER_BYTES, MTU

MSS = MTU - 20 - 32  # TCP's payload per packet: the MTU less IPv4 and TCP (timestamps)


def link_payload(payload: float, processes: int, topology: str) -> float:
  """The payload the busiest link carries: all of it on the shared link, one process's
  share on a switched network (collectives that send alike from every process)."""
  return payload / processes if topology == "switched" else payload


def wire_bytes(payload: float) -> float:
  """Bytes on the link for `payload` bytes of TCP payload in full segments."""
  return payload * (1 + HEADER_BYTES / MSS)


def step_time(compute_s: float, payload: float, rate_bps: float | None,
              capacity_bps: float | None = None) -> float:
  """Predicted seconds of a step: its compute, then its payload through the shared link at
  the smaller of `rate_bps` and `capacity_bps` (None: no limit)."""
  rate = min(r for r in (rate_bps, capacity_bps, float("inf")) if r)
  return compute_s + wire_bytes(payload) * 8 / rate


def capacity(wire_bytes_per_step: float, step_s: float, compute_s: float) -> float:
  """The unshaped link's rate, bits/s: a step's wire bytes over its time beyond compute."""
  return wire_bytes_per_step * 8 / max(step_s - compute_s, 1e-9)
