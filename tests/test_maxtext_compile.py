"""experiments/maxtext_compile.py without MaxText: its one-line refusal, and the MaxText
command lines its library (jaxsys/bench/maxtext_compile.py) builds (no compile here; the
compiles are the script's own, by hand)."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

from jaxsys.bench import maxtext_compile as mc

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("maxtext") is not None,
                    reason="maxtext is installed in this python")
def test_without_maxtext_one_line_and_exit_1():
  proc = subprocess.run([sys.executable, "experiments/maxtext_compile.py", "--case=v5p128_full"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stdout.splitlines() == [f"maxtext 0.2.5 is not installed in this python: "
                                      f"{mc.INSTALL}"]


def test_unknown_case_is_refused():
  proc = subprocess.run([sys.executable, "experiments/maxtext_compile.py", "--case=v5p128"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert "--case" in proc.stderr and "v5p128_full" in proc.stderr


def test_argv_v5p128_is_jaxsys_work():
  argv = mc.maxtext_argv("v5p128_full", base="base.yml")
  assert argv[:2] == ["train_compile", "base.yml"]
  # 2 sequences a chip x 64 chips = 128 x 8192 tokens, one fsdp axis over the slice.
  for item in ("compile_topology=v5p-128", "model_name=llama3-8b", "max_target_length=8192",
               "per_device_batch_size=2", "ici_fsdp_parallelism=-1", "remat_policy=full",
               "enable_checkpointing=false", "compile_topology_num_slices=1"):
    assert item in argv
  assert "remat_policy=minimal_with_context" in mc.maxtext_argv("v5p128_minimal", base="b")


def test_recipe_overrides_win_and_its_flags_are_libtpus():
  argv = mc.maxtext_argv("v6e256_recipe", ["gradient_accumulation_steps=4",
                                           "per_device_batch_size=1"], base="b")
  assert "gradient_accumulation_steps=4" in argv
  assert "per_device_batch_size=1" in argv and "per_device_batch_size=4" not in argv
  assert "use_iota_embed=true" in argv  # yaml's spelling of a boolean
  # Without the scoped VMEM limit the recipe does not compile; its --xla_sc_* flags are not
  # compile options, so none goes through train_compile's compile_xla_flags.
  assert "--xla_tpu_scoped_vmem_limit_kib=98304" in mc.LIBTPU_FLAGS["v6e256_recipe"].split()
  assert not any(a.startswith("compile_xla_flags=") for a in argv)


@pytest.mark.parametrize("bad", ["remat_policy", "=full"])
def test_bad_override(bad):
  with pytest.raises(ValueError, match="expected key=value"):
    mc.maxtext_argv("v5p128_full", [bad], base="b")
