"""XLA_FLAGS edits keep the flags they do not change (the suite's cheap-compile flags)."""
import os

from jaxsys import xla_flags


def _without_threads(monkeypatch):
  """PJRT_NPROC unset for the test and as it was after (a delenv of an unset name is not
  undone, and the process's backends would start with what the test set)."""
  monkeypatch.setenv(xla_flags.THREADS, "0")
  monkeypatch.delenv(xla_flags.THREADS)


def test_the_count_is_replaced_or_dropped_and_the_rest_kept():
  flags = "--a=1 --xla_force_host_platform_device_count=8 --b=2"
  assert xla_flags.with_cpu_devices(4, flags) == "--a=1 --b=2 --xla_force_host_platform_device_count=4"
  assert xla_flags.with_cpu_devices(None, flags) == "--a=1 --b=2"
  assert xla_flags.with_cpu_devices(2, "") == "--xla_force_host_platform_device_count=2"


def test_a_default_count_leaves_a_named_one(monkeypatch):
  _without_threads(monkeypatch)  # it sets a default too
  monkeypatch.setenv("XLA_FLAGS", "--a=1 --xla_force_host_platform_device_count=16")
  xla_flags.default_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=16"
  monkeypatch.setenv("XLA_FLAGS", "--a=1")
  xla_flags.default_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=8"


def test_simulated_devices_get_two_threads_each_unless_told(monkeypatch):
  _without_threads(monkeypatch)
  monkeypatch.setenv("XLA_FLAGS", "--a=1 --xla_force_host_platform_device_count=12")
  xla_flags.default_cpu_threads()
  assert int(os.environ[xla_flags.THREADS]) >= 24
  monkeypatch.setenv(xla_flags.THREADS, "5")
  xla_flags.default_cpu_threads()
  assert os.environ[xla_flags.THREADS] == "5"
  monkeypatch.delenv(xla_flags.THREADS)
  monkeypatch.setenv("XLA_FLAGS", "--a=1")
  xla_flags.default_cpu_threads()
  assert xla_flags.THREADS not in os.environ


def test_this_process_runs_its_devices_on_two_threads_each():
  """XLA:CPU's compute pool (threads named tf_XLAEigen*) in the suite's own process: with one
  thread a device, a pipeline tick deadlocked on 2 cores (`default_cpu_threads`)."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.jit(lambda x: x + 1)(jax.numpy.ones(8)).block_until_ready()
  tasks = os.listdir("/proc/self/task")
  names = [open(f"/proc/self/task/{t}/comm", encoding="utf-8").read() for t in tasks]
  assert sum(n.startswith("tf_XLAEigen") for n in names) >= 2 * len(jax.devices())
