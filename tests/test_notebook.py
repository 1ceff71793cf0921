"""A notebook's first cell: the accelerator if there is one, else simulated CPU devices."""
import os
import subprocess
import sys

import pytest

from jaxsys import notebook


def test_a_tpu_runtime_is_seen_before_jax_starts(monkeypatch):
  monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
  assert notebook.accelerator() == "tpu"


def test_without_an_accelerator_eight_simulated_cpu_devices():
  """In a fresh process with no XLA flags: 8 CPU devices, said to be simulated."""
  if notebook.accelerator():
    pytest.skip("this machine has an accelerator: the notebooks use it")
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "COLAB_TPU_ADDR", "TPU_NAME")}
  out = subprocess.run([sys.executable, "-c",
                        "from jaxsys import notebook; print(notebook.use_devices())"],
                       env=env, capture_output=True, text=True, timeout=120, check=True).stdout
  assert out.strip().endswith("8 cpu devices (simulated; no TPU or GPU found)"), out
