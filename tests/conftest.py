"""Test setup: 8 simulated CPU devices, set before jax initialises its backends."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools
import importlib.util
import pathlib
import sysconfig

import pytest


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
  """A directory of ~200 real stdlib source files (a few hundred KB): fast loaders in tests.

  File names keep their stdlib-relative paths, so the hash split is fixed and has val files.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  out = tmp_path_factory.mktemp("corpus")
  files = sorted(p for p in (root / "email").rglob("*.py")) + sorted(root.glob("*.py"))
  for path in files:
    text = path.read_bytes()[:4000]
    dest = out / path.relative_to(root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(text)
  return str(out)


@pytest.fixture
def make_config(small_corpus):
  """Factory: configs/tiny_lm.py:size=test on the small corpus, with dotted-name overrides."""
  return functools.partial(load_test_config, small_corpus)


def load_test_config(source: str, **overrides):
  """configs/tiny_lm.py:size=test on `source`; overrides use '.'-free names like model__d_model."""
  spec = importlib.util.spec_from_file_location(
      "tiny_lm", pathlib.Path(__file__).parent.parent / "configs" / "tiny_lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("size=test")
  config.data.source = source
  config.data.num_threads = 0
  from jaxsys.train.compositions import set_fields  # after XLA_FLAGS is set above
  return set_fields(config, overrides, sep="__")
