"""XLA_FLAGS edits keep the flags they do not change (the suite's cheap-compile flags)."""
import os

from jaxsys import xla_flags


def test_the_count_is_replaced_or_dropped_and_the_rest_kept():
  flags = "--a=1 --xla_force_host_platform_device_count=8 --b=2"
  assert xla_flags.with_cpu_devices(4, flags) == "--a=1 --b=2 --xla_force_host_platform_device_count=4"
  assert xla_flags.with_cpu_devices(None, flags) == "--a=1 --b=2"
  assert xla_flags.with_cpu_devices(2, "") == "--xla_force_host_platform_device_count=2"


def test_a_default_count_leaves_a_named_one(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--a=1 --xla_force_host_platform_device_count=16")
  xla_flags.default_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=16"
  monkeypatch.setenv("XLA_FLAGS", "--a=1")
  xla_flags.default_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=8"
