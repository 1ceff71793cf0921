"""The backends a binary starts: only the machine's own, chosen before jax starts, so a run's
first line is its own and not libtpu's or the CUDA plugin's (issue 48)."""
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from jaxsys import platforms, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
_ENV = ("JAX_PLATFORMS", platforms.CHOSEN, *platforms._TPU_ENV)  # pylint: disable=protected-access

# What libtpu writes starting on a host with no TPU, and jax's CUDA plugin on one with no
# CUDA driver.
NOISE = ("Failed to find host bounds", "Logging before InitGoogle", "unexpected worker hostname",
         "Source Location Trace", "Unable to initialize backend", "TPU initialization failed",
         "cudart_stub", "Could not find cuda drivers", "Jax plugin configuration error",
         "cuda_plugin_extension", "CUDA backend failed")


@pytest.fixture
def machine(monkeypatch, tmp_path):
  """A machine with nothing attached (no TPU or GPU hints, no nvidia-smi, JAX_PLATFORMS
  unset), both plugins installed; returns a function that attaches 'tpu' or 'gpu'."""
  for name in _ENV:
    monkeypatch.setenv(name, "")  # so that the deletion, and what choose() sets, is undone
    monkeypatch.delenv(name)
  monkeypatch.setattr(platforms, "_TPU_HINTS", (str(tmp_path / "accel0"),))
  monkeypatch.setattr(platforms, "_GPU_HINTS", (str(tmp_path / "nvidia0"),))
  monkeypatch.setattr(shutil, "which", lambda name: None)
  monkeypatch.setattr(platforms, "has_plugin", lambda found: True)

  def attach(kind):
    (tmp_path / {"tpu": "accel0", "gpu": "nvidia0"}[kind]).touch()
  return attach


def test_no_accelerator_only_the_cpu(machine):  # pylint: disable=unused-argument
  assert platforms.accelerator() is None
  assert platforms.choose() == "cpu" == os.environ["JAX_PLATFORMS"]


@pytest.mark.parametrize("kind, chosen", [("tpu", "tpu,cpu"), ("gpu", "cuda,cpu")])
def test_an_accelerator_and_the_cpu(machine, kind, chosen):
  machine(kind)
  assert platforms.accelerator() == kind
  assert platforms.choose() == chosen == os.environ["JAX_PLATFORMS"]


def test_seen_by_environment_or_nvidia_smi(machine, monkeypatch):  # pylint: disable=unused-argument
  monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi"
                      else None)
  assert platforms.accelerator() == "gpu"
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
  assert platforms.accelerator() == "tpu"


def test_an_accelerator_jax_has_no_plugin_for_is_not_named(machine, monkeypatch):
  """Naming it would stop the run; jax alone would fall back to the CPU."""
  machine("gpu")
  monkeypatch.setattr(platforms, "has_plugin", lambda found: False)
  assert platforms.choose() == "cpu"


@pytest.mark.parametrize("users", ["cpu", "tpu", ""])
def test_the_user_s_choice_is_kept(machine, monkeypatch, users):
  machine("tpu")
  monkeypatch.setenv("JAX_PLATFORMS", users)
  assert platforms.choose() == users and platforms.choose("cpu") == users
  assert os.environ["JAX_PLATFORMS"] == users


def test_a_binary_s_own_choice_replaces_the_machine_s(machine):
  """jaxsys-compile compiles on the host: "cpu" on a TPU machine too, also in a process
  started by one that chose (the choice travels in the environment, marked as ours)."""
  machine("tpu")
  assert platforms.choose() == "tpu,cpu"
  assert platforms.choose("cpu") == "cpu" == os.environ["JAX_PLATFORMS"]
  assert platforms.choose() == "tpu,cpu"


def test_the_plugins_are_found_without_importing_them():
  assert platforms.has_plugin("tpu") == (_installed("libtpu") or "TPU_LIBRARY_PATH" in os.environ)
  assert platforms.has_plugin("gpu") == (_installed("jax_plugins.xla_cuda12")
                                         or _installed("jax_plugins.xla_cuda13"))


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # no parent package
    return False


def test_importing_the_binaries_packages_chooses_before_jax():
  """`python -m experiments.X` and the console scripts import these packages first: they
  choose this machine's backends, and import no jax."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", platforms.CHOSEN)}
  code = ("import os, sys, experiments, jaxsys.cli, jaxsys.notebook; "
          "print(os.environ['JAX_PLATFORMS'], 'jax' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60, check=True).stdout.split()
  found = platforms.accelerator()
  on = found if found and platforms.has_plugin(found) else None
  assert out == [{"tpu": "tpu,cpu", "gpu": "cuda,cpu", None: "cpu"}[on], "False"]


def test_a_run_s_first_line_is_its_own(small_corpus, tmp_path):
  """The quickstart's command, JAX_PLATFORMS left to the binary: stderr starts with the
  run's own first line, nothing from libtpu or the CUDA plugin before or after it."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", platforms.CHOSEN)}
  env["JAXSYS_HUGE_PAGES"] = "0"  # no re-exec: one interpreter start
  env["XLA_FLAGS"] = xla_flags.with_cpu_devices(1)  # the quickstart's one device compiles sooner
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=configs/tiny_lm.py:size=test",
       "--config.total_steps=1", "--config.eval_every=0", "--config.checkpoint_every=0",
       # a schedule that decays (the config check builds it, before the run's first line;
       # one step of warm-up and no decay is optax's own warning line)
       "--config.optimizer.warmup_steps=1", "--config.optimizer.schedule_steps=4",
       f"--config.data.source={small_corpus}", "--config.data.num_threads=0",
       f"--workdir={tmp_path}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.match(r"I\d{4} [\d:.]+ +\d+ train\.py:\d+\] jax \S+, backend ", proc.stderr), \
      proc.stderr[:2000]
  assert not [n for n in NOISE if n in proc.stderr], proc.stderr[:2000]
