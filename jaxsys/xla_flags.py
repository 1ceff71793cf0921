"""XLA_FLAGS edits that keep the other flags: the simulated CPU device count.

Imports nothing from jax: a script edits the environment before jax starts its backends.
"""
import os
import re

DEVICE_COUNT = "xla_force_host_platform_device_count"


def with_cpu_devices(n: int | None, flags: str | None = None) -> str:
  """`flags` (default: the environment's XLA_FLAGS) with n simulated CPU devices, or with no
  count when n is None; every other flag kept."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  rest = re.sub(rf"\s*--{DEVICE_COUNT}=\S*", "", flags).strip()
  return rest if n is None else f"{rest} --{DEVICE_COUNT}={n}".strip()


def default_cpu_devices(n: int) -> None:
  """Sets n simulated CPU devices in the environment unless XLA_FLAGS names a count."""
  if DEVICE_COUNT not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = with_cpu_devices(n)
