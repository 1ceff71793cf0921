"""init_from: a fresh run starts from another run's latest parameters."""
import os

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxsys.checkpoint.manager import Checkpointer
from jaxsys.train import loop

pytestmark = pytest.mark.slow

DILOCO = dict(mesh="replica=2,data=-1", outer__name="diloco", outer__sync_every=2)


def _latest_state(workdir):
  directory = os.path.join(workdir, "checkpoints")
  step = Checkpointer(directory).latest_step()
  with ocp.CheckpointManager(directory, item_names=("state",)) as m:
    return m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


@pytest.fixture(scope="module")
def source(tmp_path_factory, small_corpus):
  """A 3-step data-parallel run and a 4-step DiLoCo run to start from."""
  from conftest import load_test_config  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp("source")
  dp, dl = str(root / "dp"), str(root / "diloco")
  loop.train_and_evaluate(load_test_config(small_corpus, total_steps=3, eval_every=0), dp)
  loop.train_and_evaluate(load_test_config(small_corpus, total_steps=4, eval_every=0, **DILOCO),
                          dl)
  return dp, dl


def _start(make_config, workdir, init_from, **kw):
  """One step at learning rate 0 (the warmup's first), so the saved parameters are the loaded ones."""
  config = make_config(total_steps=1, eval_every=0, init_from=init_from,
                       optimizer__warmup_steps=5, optimizer__schedule_steps=10, **kw)
  result = loop.train_and_evaluate(config, workdir)
  return result, _latest_state(workdir)


@pytest.mark.parametrize("src", ["dp", "diloco"])
@pytest.mark.parametrize("outer", ["none", "diloco"])
def test_params_equal_source(make_config, tmp_path, source, src, outer):
  dp, dl = source
  src_dir = dp if src == "dp" else os.path.join(dl, "checkpoints")  # workdir or checkpoints dir
  src_params = _latest_state(dp if src == "dp" else dl)["params"]
  if src == "diloco":
    src_params = jax.tree.map(lambda x: x[0], src_params)
  kw = DILOCO if outer == "diloco" else {}
  _, state = _start(make_config, str(tmp_path / "run"), src_dir, **kw)
  assert int(state["step"]) == 1  # the step counter starts fresh
  params = state["params"]
  if outer == "diloco":  # every replica starts from the source's parameters
    for r in range(2):
      chex.assert_trees_all_close(jax.tree.map(lambda x: x[r], params), src_params, atol=0)
  else:
    chex.assert_trees_all_close(params, src_params, atol=0)

def test_outer_anchor_starts_at_source(make_config, tmp_path, source):
  dp, _ = source
  src_params = _latest_state(dp)["params"]
  _, state = _start(make_config, str(tmp_path / "run"), dp, **DILOCO)
  outer = state["outer"]
  anchor = outer["anchor"] if "anchor" in outer else jax.tree.leaves(outer)[0]
  chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], anchor), src_params, atol=0)


def test_resume_ignores_init_from(make_config, tmp_path, source):
  dp, _ = source
  run = str(tmp_path / "run")
  loop.train_and_evaluate(make_config(total_steps=2, eval_every=0), run)
  own = _latest_state(run)["params"]
  loop.train_and_evaluate(make_config(total_steps=2, eval_every=0, init_from=dp), run)
  chex.assert_trees_all_close(_latest_state(run)["params"], own, atol=0)


def test_mismatched_model_refused(make_config, tmp_path, source):
  dp, _ = source
  with pytest.raises(ValueError, match=r"different model: model\.d_model=64 there but 32"):
    loop.train_and_evaluate(make_config(total_steps=1, eval_every=0, init_from=dp,
                                        model__d_model=32), str(tmp_path))


def test_bad_path_one_line_error(make_config, tmp_path):
  missing = str(tmp_path / "nowhere")
  with pytest.raises(ValueError, match=r"^init_from='.*nowhere' holds no checkpoint[^\n]*$"):
    loop.train_and_evaluate(make_config(total_steps=1, eval_every=0, init_from=missing),
                            str(tmp_path / "run"))
