"""XLA_FLAGS edits that keep the other flags: the simulated CPU device count, and enough
threads for that many devices.

Imports nothing from jax: a script edits the environment before jax starts its backends.
"""
import os
import re

DEVICE_COUNT = "xla_force_host_platform_device_count"
THREADS = "PJRT_NPROC"  # XLA:CPU's thread pools have max(this or the cores, devices) threads


def with_cpu_devices(n: int | None, flags: str | None = None) -> str:
  """`flags` (default: the environment's XLA_FLAGS) with n simulated CPU devices, or with no
  count when n is None; every other flag kept."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  rest = re.sub(rf"\s*--{DEVICE_COUNT}=\S*", "", flags).strip()
  return rest if n is None else f"{rest} --{DEVICE_COUNT}={n}".strip()


def cpu_devices(flags: str | None = None) -> int | None:
  """The simulated CPU device count `flags` (default: XLA_FLAGS) names, if any."""
  found = re.findall(rf"--{DEVICE_COUNT}=(\d+)", os.environ.get("XLA_FLAGS", "")
                     if flags is None else flags)
  return int(found[-1]) if found else None


def default_cpu_threads() -> None:
  """Two threads per simulated CPU device unless PJRT_NPROC is set.

  A device waiting in a collective holds a pool thread, and XLA:CPU runs a collective inside
  a conditional beside the program's others. So when every device has two ready at once (a
  pipeline tick's head all-reduce and its ring permute), 8 devices on 2 cores (8 threads)
  can block all 8 threads, half in each collective: a rendezvous abort after 40 s, seen in
  CI. Twice the devices leaves each device a thread for its second collective.
  """
  devices = cpu_devices()
  if devices and THREADS not in os.environ:
    os.environ[THREADS] = str(max(os.cpu_count() or 1, 2 * devices))


def default_cpu_devices(n: int) -> None:
  """Sets n simulated CPU devices in the environment unless XLA_FLAGS names a count, and
  threads enough for the devices (`default_cpu_threads`)."""
  if DEVICE_COUNT not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = with_cpu_devices(n)
  default_cpu_threads()
