"""config_check: every field and relation of the training config, refused in one line up front."""
import importlib.util
import pathlib

import pytest
from absl.testing import absltest, parameterized

from conftest import load_test_config
from jaxsys.train import config_check, loop

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(**overrides):
  return load_test_config("stdlib", **overrides)


def _assert_refused(test, overrides, message):
  """check_config refuses `overrides` with one line starting with `message`."""
  with test.assertRaises(ValueError) as cm:
    config_check.check_config(_config(**overrides))
  test.assertStartsWith(str(cm.exception), message)
  test.assertNotIn("\n", str(cm.exception))


def _tiny_lm(size):
  spec = importlib.util.spec_from_file_location("tiny_lm", ROOT / "configs" / "tiny_lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(f"size={size}")


class FieldsTest(parameterized.TestCase):

  @parameterized.parameters("test", "tiny", "small")
  def test_shipped_sizes_are_valid_and_every_field_has_a_rule(self, size):
    config = _tiny_lm(size)
    config_check.check_config(config)
    self.assertCountEqual(config_check._flatten(config.to_dict()), config_check.FIELDS)

  @parameterized.parameters(*[("llama3", s) for s in ("gpt2", "1b", "3b", "8b", "70b",
                                                      "mistral-7b")],
                            *[("qwen2", s) for s in ("0.5b", "1.5b", "3b", "7b")])
  def test_published_presets_are_valid(self, name, size):
    """Every field of a published model's preset passes its rule and the relations (its
    memory is the compile's to judge: experiments.compile for a slice)."""
    module = importlib.import_module(f"jaxsys.configs.{name}")
    config = module.get_config(f"size={size}")
    config.check_memory = False
    run = config_check.check_config(config)
    self.assertEqual(run.model.qkv_bias, name == "qwen2")
    self.assertEqual(run.model.rope_scaling.startswith("llama3:"),
                     name == "llama3" and size in ("1b", "3b", "8b", "70b"))

  @parameterized.named_parameters(
      ("eval_never", dict(eval_every=0)),
      ("checkpoint_at_end", dict(checkpoint_every=0)),
      ("head_dim_set", dict(model__head_dim=32)),
      ("bpe", dict(data__tokenizer="bpe", data__vocab_size=512, model__vocab_size=512)),
      ("outer", dict(mesh="replica=2,data=-1", outer__name="diloco")),
      ("noloco_all", dict(mesh="replica=4,data=-1", outer__name="noloco",
                          outer__group_size=4)),
      ("warmup_is_schedule", dict(total_steps=4, optimizer__warmup_steps=4)),
      ("size_one_stage", dict(mesh="stage=1,data=-1")),
      ("pipeline", dict(mesh="stage=2,data=-1", pipeline__schedule="1f1b",
                        pipeline__vocab_parallel=True)),
      ("interleaved", dict(mesh="stage=2,tensor=2,data=2", pipeline__schedule="interleaved_1f1b",
                           pipeline__virtual_stages=2, model__n_layers=4)),
      ("all_sharded", dict(mesh="replica=2,fsdp=2,tensor=2", outer__name="co2")),
      ("fewer_kv_heads_than_tensor", dict(mesh="data=2,tensor=4")),  # K/V heads replicated
      ("context", dict(mesh="data=2,context=-1")),
      ("context_contiguous", dict(mesh="context=8", data__seq_len=72,
                                  parallel__context_layout="contiguous")),
      ("hdp", dict(data__variable_length=True, parallel__hdp=True, data__max_len=512)),
      # The batch axes need not be side by side: HDP's pool regroups them.
      ("hdp_over_pipelines", dict(mesh="data=2,stage=2,fsdp=2", data__variable_length=True,
                                  parallel__hdp=True,
                                  pipeline__schedule="1f1b", pipeline__microbatches=2)),
      ("hdp_any_axis_order", dict(mesh="data=2,tensor=2,fsdp=2", data__variable_length=True,
                                  parallel__hdp=True)),
  )
  def test_valid(self, overrides):
    config_check.check_config(_config(**overrides))

  def test_a_saved_config_with_a_removed_field_parses_if_its_value_still_runs(self):
    """A checkpoint's config from before lock-step HDP went: 'per_rank' (what runs) parses;
    'lockstep' is refused in one line that names the field and why."""
    saved = _config().to_dict()
    saved["parallel"]["hdp_schedule"] = "per_rank"
    self.assertEqual(config_check.parse(saved), config_check.parse(_config()))
    saved["parallel"]["hdp_schedule"] = "lockstep"
    with self.assertRaises(ValueError) as cm:
      config_check.parse(saved)
    self.assertStartsWith(str(cm.exception), "parallel.hdp_schedule='lockstep': lock-step HDP "
                          "was removed")
    self.assertNotIn("\n", str(cm.exception))

  def test_warmup_follows_total_steps(self):
    config = _tiny_lm("tiny")
    self.assertEqual(config.optimizer.warmup_steps, 15)
    config.total_steps = 2
    self.assertEqual(config.optimizer.warmup_steps, 1)
    config_check.check_config(config)

  @parameterized.named_parameters(
      ("steps_zero", dict(total_steps=0), "total_steps=0 is invalid; it must be an int >= 1"),
      ("steps_negative", dict(total_steps=-5), "total_steps=-5 is invalid; it must be an int >= 1"),
      ("eval_every", dict(eval_every=-1),
       "eval_every=-1 is invalid; it must be an int >= 0 (0: never evaluate)"),
      ("checkpoint_every", dict(checkpoint_every=-5),
       "checkpoint_every=-5 is invalid; it must be an int >= 0 (0: save only at the end)"),
      ("log_every", dict(log_every=0), "log_every=0 is invalid; it must be an int >= 1"),
      ("eval_steps", dict(eval_steps=0), "eval_steps=0 is invalid; it must be an int >= 1"),
      ("keep", dict(keep_checkpoints=-1), "keep_checkpoints=-1 is invalid; it must be an int >= 1"),
      ("warmup", dict(optimizer__warmup_steps=-3),
       "optimizer.warmup_steps=-3 is invalid; it must be an int >= 0"),
      ("seed", dict(seed=2**32), "seed=4294967296 is invalid; it must be an int >= 0 and <= "),
      ("bool_is_not_int", dict(model__n_layers=True), "model.n_layers=True is invalid"),
      ("head_dim", dict(model__head_dim=1), "model.head_dim=1 is invalid; it must be an int >= 2, "
       "or None (model.d_model // model.n_heads)"),
      ("rope_theta", dict(model__rope_theta=0.0), "model.rope_theta=0.0 is invalid; it must be a "
       "number > 0"),
      ("rope_scaling_type", dict(model__rope_scaling="longrope:factor=4"),
       "model.rope_scaling='longrope:factor=4': rope type 'longrope' is not supported (its "
       "per-dimension factors switch with the sequence length); valid: '' or "
       "'linear:factor=<number>' or 'llama3:factor=<number>,low_freq_factor=<number>,"
       "high_freq_factor=<number>,original_max_position_embeddings=<number>' or "
       "'yarn:factor=<number>,original_max_position_embeddings=<number>' (optional: "
       "attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate)"),
      ("rope_scaling_keys", dict(model__rope_scaling="linear:factor=4,low_freq_factor=1"),
       "model.rope_scaling='linear:factor=4,low_freq_factor=1': linear must set the keys factor;"),
      ("rope_scaling_value", dict(model__rope_scaling="linear:factor=x"),
       "model.rope_scaling='linear:factor=x': 'factor=x' is not <key>=<number>;"),
      ("rope_scaling_range", dict(model__rope_scaling="linear:factor=0"),
       "model.rope_scaling='linear:factor=0': factor and original_max_position_embeddings must "
       "be > 0"),
      ("dtype", dict(model__dtype="int8"),
       "model.dtype='int8' is unknown; valid: float32, bfloat16, float16"),
      ("remat", dict(model__remat="some"),
       "model.remat='some' is unknown; valid: none, full, dots, minimal, qkv"),
      ("remat_offload", dict(model__remat="full", model__remat_offload="q,attn"),
       "model.remat_offload='q,attn' is invalid; it must be '' or a comma-separated subset of "
       "layer_input, q, k, v, attention, attention_stats, attention_proj, mlp_gate, mlp_up"),
      ("vocab_tiles", dict(model__vocab_tiles=0), "model.vocab_tiles=0 is invalid; it must be an "
       "int >= 1 (1: the output layer untiled)"),
      ("context_algorithm", dict(parallel__context_algorithm="striped"),
       "parallel.context_algorithm='striped' is unknown; valid: ring, all_gather, ulysses"),
      ("impl", dict(model__attention_impl="cudnn"), "model.attention_impl='cudnn' is unknown"),
      ("source", dict(data__source=" "), "data.source=' ' is invalid"),
      ("tokenizer", dict(data__tokenizer="char"), "data.tokenizer='char' is unknown; valid: byte, bpe"),
      ("seq_len", dict(data__seq_len=0), "data.seq_len=0 is invalid; it must be an int >= 1"),
      ("threads", dict(data__num_threads=-1), "data.num_threads=-1 is invalid"),
      ("max_len", dict(data__max_len=0), "data.max_len=0 is invalid; it must be an int >= 1"),
      ("lr", dict(optimizer__learning_rate=0.0),
       "optimizer.learning_rate=0.0 is invalid; it must be a number > 0"),
      ("b2", dict(optimizer__b2=1.0), "optimizer.b2=1.0 is invalid; it must be a number >= 0 and < 1"),
      ("final_lr", dict(optimizer__final_lr_fraction=1.5),
       "optimizer.final_lr_fraction=1.5 is invalid; it must be a number >= 0 and <= 1"),
      ("nan", dict(optimizer__weight_decay=float("nan")), "optimizer.weight_decay=nan is invalid"),
      ("grad_clip", dict(optimizer__grad_clip=0.0), "optimizer.grad_clip=0.0 is invalid"),
      ("accum", dict(optimizer__grad_accum_steps=0), "optimizer.grad_accum_steps=0 is invalid"),
      ("schedule_offset", dict(optimizer__schedule_offset=-1),
       "optimizer.schedule_offset=-1 is invalid"),
      ("outer", dict(outer__name="dilcoo"),
       "outer.name='dilcoo' is unknown; valid: none, diloco, noloco, co2"),
      ("outer_lr", dict(outer__lr=-0.5), "outer.lr=-0.5 is invalid; it must "
       "be a number > 0, or None (the algorithm's published default)"),
      ("compression", dict(outer__compression="int4"),
       "outer.compression='int4' is unknown; valid: none, bf16, int8, fp8"),
      ("group_size", dict(outer__group_size=1), "outer.group_size=1 is invalid"),
      ("layout", dict(parallel__context_layout="striped"),
       "parallel.context_layout='striped' is unknown; valid: contiguous, zigzag"),
      ("schedule", dict(pipeline__schedule="zb-h1"), "pipeline.schedule='zb-h1' is unknown; valid: "
       "none, gpipe, 1f1b, eager_1f1b, interleaved_1f1b"),
      ("microbatches", dict(pipeline__microbatches=0), "pipeline.microbatches=0 is invalid"),
      ("vocab_algorithm", dict(pipeline__vocab_algorithm=3), "pipeline.vocab_algorithm=3 is "
       "invalid; it must be 1 or 2"),
      ("allow_change", dict(allow_model_change="rope_theta,d_model"),
       "allow_model_change='rope_theta,d_model' is invalid; it must be '' or a comma-separated "
       "subset of rope_theta, rope_scaling, sliding_window, norm_eps, dtype"),
      ("mesh_parse", dict(mesh="data=0"), "mesh: axis 'data' has size 0"),
      ("mesh_empty", dict(mesh=""), "mesh='' is invalid; it must be a mesh spec such as"),
  )
  def test_bad_field(self, overrides, message):
    _assert_refused(self, overrides, message)

  def test_plain_dict_config(self):
    # A notebook's dict (or a type_safe=False ConfigDict) can hold a float where an int goes.
    config = _config().to_dict()
    config["model"]["d_model"] = 12.5
    with self.assertRaisesRegex(ValueError, r"^model.d_model=12.5 is invalid; it must be an int "
                                r">= 1$"):
      config_check.check_config(config)

  def test_unknown_and_missing_fields(self):
    """An unknown field is refused; a missing one takes its default."""
    config = _config()
    config.eval_evry = 5
    with self.assertRaisesRegex(ValueError, r"^config field 'eval_evry' is unknown; fields of "
                                r"config: seed, total_steps, .*eval_every"):
      config_check.check_config(config)
    config = _config()
    config.model.remat = "full"
    self.assertEqual(config_check.check_config(config).model.remat, "full")
    del config.model["remat"]
    self.assertEqual(config_check.check_config(config).model.remat, "none")

  def test_flag_value_error_names_the_field(self):
    # What the CLI reports for --config.total_steps=abc (absl could not parse the string).
    self.assertEqual(config_check.field_error("total_steps", "abc"),
                     "total_steps='abc' is invalid; it must be an int >= 1")
    self.assertIsNone(config_check.field_error("total_steps", 3))
    self.assertIsNone(config_check.field_error("no.such_field", 3))


class RelationsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("gqa", dict(model__n_kv_heads=3),
       "model.n_heads=4 is invalid with model.n_kv_heads=3; it must be a multiple of "
       "model.n_kv_heads"),
      ("heads", dict(model__d_model=66), "model.d_model=66 is invalid with model.n_heads=4, "
       "model.head_dim=None; it must divide by model.n_heads"),
      ("odd_head_dim", dict(model__head_dim=7), "model.head_dim=7 is invalid with "
       "model.d_model=64, model.n_heads=4; it must give an even head dim"),
      ("byte_vocab", dict(data__vocab_size=300), "data.vocab_size=300 is invalid with "
       "data.tokenizer='byte'; it must be 256 for the byte tokenizer, >= 257 for bpe"),
      ("bpe_vocab", dict(data__tokenizer="bpe"), "data.vocab_size=256 is invalid with "
       "data.tokenizer='bpe'"),
      ("model_vocab", dict(data__tokenizer="bpe", data__vocab_size=512),
       "model.vocab_size=256 is invalid with data.vocab_size=512; it must be >= data.vocab_size"),
      ("offload_needs_names", dict(model__remat_offload="q"), "model.remat_offload='q' is "
       "invalid with model.remat='none'; it must be '' unless model.remat names what it keeps"),
      ("offload_on_cpu", dict(model__remat="full", model__remat_offload="q"),
       "model.remat_offload='q' is invalid with the devices' host memory='none'; it must be '' "
       "on devices without a host memory of their own to offload to (TPU, GPU)"),
      ("vocab_tiles_divide", dict(model__vocab_tiles=3), "model.vocab_tiles=3 is invalid with "
       "model.vocab_size=256; it must divide model.vocab_size"),
      ("warmup_total", dict(total_steps=2, optimizer__warmup_steps=5),
       "optimizer.warmup_steps=5 is invalid with total_steps=2, optimizer.schedule_steps=0; it "
       "must be <= the schedule's length"),
      ("warmup_schedule", dict(optimizer__schedule_steps=4, optimizer__warmup_steps=5),
       "optimizer.warmup_steps=5 is invalid with total_steps=20, optimizer.schedule_steps=4"),
      ("accum", dict(optimizer__grad_accum_steps=3), "data.batch_size=16 is invalid with "
       "optimizer.grad_accum_steps=3; it must divide into optimizer.grad_accum_steps equal "
       "microbatches"),
      ("shards", dict(optimizer__grad_accum_steps=4), "data.batch_size=16 is invalid with "
       "optimizer.grad_accum_steps=4, mesh shards of 'batch'=8; it must give microbatches"),
      # Fewer K/V heads than tensor are replicated (data=2,tensor=4 passes: see below);
      # query heads are not.
      ("heads_over_tensor", dict(mesh="tensor=8"), "model.n_heads=4 is invalid with mesh "
       "shards of 'heads'=8; it must divide over the mesh axes that shard 'heads'"),
      ("d_model", dict(mesh="fsdp=-1", model__d_model=36, model__head_dim=8),
       "model.d_model=36 is invalid with mesh shards of 'embed'=8"),
      ("stage_without_pipeline", dict(mesh="stage=2,data=-1"), "mesh axis stage=2 is invalid "
       "with pipeline.schedule='none'; it must be 1 without a pipeline"),
      ("stage_layers", dict(mesh="stage=4,data=-1", pipeline__schedule="1f1b"),
       "model.n_layers=2 is invalid with mesh axis stage=4, pipeline.virtual_stages=1, "
       "pipeline.schedule='1f1b'; it must split evenly into (mesh axis stage) x "
       "pipeline.virtual_stages chunks"),
      ("virtual_layers", dict(mesh="stage=2,data=-1", pipeline__schedule="interleaved_1f1b",
                              pipeline__virtual_stages=2),
       "model.n_layers=2 is invalid with mesh axis stage=2, pipeline.virtual_stages=2"),
      ("microbatches_1f1b", dict(mesh="stage=2,data=-1", pipeline__schedule="1f1b",
                                 pipeline__microbatches=1),
       "pipeline.microbatches=1 is fewer than the 2 stages; 1f1b needs microbatches >= stages"),
      ("microbatch_shards", dict(mesh="stage=2,data=-1", pipeline__schedule="gpipe",
                                 pipeline__microbatches=8),
       "data.batch_size=16 is invalid with pipeline.microbatches=8, optimizer.grad_accum_steps=1, "
       "mesh shards of 'batch'=4, pipeline.schedule='gpipe'; it must split into "
       "optimizer.grad_accum_steps x pipeline.microbatches equal microbatches that divide over "
       "the mesh axes that shard the batch"),
      ("pipeline_accum_shards", dict(mesh="stage=2,data=-1", pipeline__schedule="gpipe",
                                     pipeline__microbatches=2, optimizer__grad_accum_steps=4),
       "data.batch_size=16 is invalid with pipeline.microbatches=2, optimizer.grad_accum_steps=4, "
       "mesh shards of 'batch'=4"),
      ("vocab_parallel_without_stage", dict(pipeline__vocab_parallel=True),
       "pipeline.vocab_parallel=True is invalid with mesh axis stage=1, "
       "pipeline.schedule='none'; it must be False without a pipeline"),
      ("vocab_overlap_without_vp", dict(mesh="stage=2,data=-1", pipeline__schedule="1f1b",
                                        pipeline__vocab_overlap=True),
       "pipeline.vocab_overlap=True is invalid with pipeline.vocab_parallel=False; it must be "
       "False without pipeline.vocab_parallel=True"),
      ("vocab_overlap_beyond_1f1b", dict(mesh="stage=2,data=-1", pipeline__schedule="gpipe",
                                         pipeline__vocab_parallel=True,
                                         pipeline__vocab_overlap=True),
       "pipeline.vocab_overlap=True is invalid with pipeline.schedule=gpipe; valid: 1f1b"),
      ("gather_once_without_fsdp", dict(mesh="stage=2,data=-1", pipeline__schedule="1f1b",
                                        pipeline__gather_once=True),
       "pipeline.gather_once=True is invalid with mesh axis fsdp=1, pipeline.schedule='1f1b'; "
       "it must be False without a pipeline over a mesh whose fsdp axis is larger than 1"),
      ("virtual_gpipe", dict(mesh="stage=2,data=-1", pipeline__schedule="gpipe",
                             pipeline__virtual_stages=2, model__n_layers=4),
       "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved_1f1b"),
      ("context_chunks", dict(mesh="data=2,context=-1", data__seq_len=36),
       "data.seq_len=36 is invalid with mesh axis context=4, parallel.context_layout='zigzag'; "
       "it must divide into the layout's chunks: 2 x (mesh axis context) for zigzag"),
      ("context_gather_budget", dict(mesh="data=2,context=4", data__seq_len=8192,
                                     parallel__context_algorithm="all_gather",
                                     parallel__context_gather_mib=1),
       "parallel.context_algorithm='all_gather' is invalid with parallel.context_gather_mib=1, "
       "MiB of K/V gathered per device=16.0; it must hold the K/V it gathers"),
      ("ulysses_heads", dict(mesh="data=2,context=4", parallel__context_algorithm="ulysses"),
       "parallel.context_algorithm='ulysses' is invalid with model.n_heads=4, mesh shards of "
       "'heads'=1, model.n_kv_heads=2, mesh shards of 'kv_heads'=1, mesh axis context=4; it "
       "must be ring or all_gather unless"),
      ("hdp_packed", dict(parallel__hdp=True), "parallel.hdp=True is invalid with "
       "data.variable_length=False; it must equal data.variable_length"),
      ("hdp_context", dict(mesh="data=4,context=2", data__variable_length=True,
                           parallel__hdp=True),
       "parallel.hdp=True is invalid with mesh axis context=2; it must be False with a context "
       "axis: HDP makes its own context rings"),
      ("window_context", dict(mesh="data=2,context=4", model__sliding_window=16),
       "model.sliding_window=16 is invalid with mesh axis context=4; it must be 0 with a "
       "context axis larger than 1: the context-parallel kernels (ring, all_gather, ulysses) "
       "have no sliding window"),
      ("window_hdp", dict(data__variable_length=True, parallel__hdp=True, data__max_len=512,
                          model__sliding_window=16),
       "model.sliding_window=16 is invalid with parallel.hdp=True; it must be 0 with HDP"),
      ("hdp_pool", dict(mesh="data=4,tensor=2", data__variable_length=True, parallel__hdp=True,
                        data__max_len=257),
       "data.max_len=257 is invalid with data.seq_len=64, mesh axes data x fsdp=4, "
       "parallel.hdp=True; it must fit a replica's device pool: at most (data x fsdp) x "
       "data.seq_len"),
      ("profile_form", dict(profile__steps="3-5"), "profile.steps='3-5' is invalid; it must be "
       "'N,M' (trace steps N to M, e.g. '3,5') or '' (no profile)"),
      ("profile_order", dict(profile__steps="5,3"), "profile.steps='5,3' is invalid with "
       "total_steps=20; it must be 'N,M' with 1 <= N <= M <= total_steps"),
      ("profile_outside", dict(profile__steps="3,25"), "profile.steps='3,25' is invalid with "
       "total_steps=20"),
      ("profile_zero", dict(profile__steps="0,2"), "profile.steps='0,2' is invalid with "
       "total_steps=20"),
      ("hdp_replica_pool", dict(mesh="replica=2,data=4", data__variable_length=True,
                                parallel__hdp=True, outer__name="diloco",
                                data__max_len=257),
       "data.max_len=257 is invalid with data.seq_len=64, mesh axes data x fsdp=4"),
      ("replica_without_outer", dict(mesh="replica=2,data=-1"), "mesh axis replica=2 is invalid "
       "with outer.name='none'; it must be 1 without an outer optimizer"),
      ("outer_without_replica", dict(outer__name="co2"), "outer.name='co2' needs a mesh "
       "with a 'replica' axis of size >= 2, but the mesh is data=8 (8 cpu devices)"),
      ("noloco_groups", dict(mesh="replica=4,data=-1", outer__name="noloco",
                             outer__group_size=3),
       "outer.group_size=3 is invalid with outer.name='noloco', "
       "mesh axis replica=4; it must be 2 (random pairs, for an even replica count) or the "
       "replica count (one group)"),
      ("noloco_odd", dict(mesh="replica=8", outer__name="noloco",
                          outer__group_size=4),
       "outer.group_size=4 is invalid with outer.name='noloco', "
       "mesh axis replica=8"),
      ("mesh_devices", dict(mesh="data=3"), "mesh data=3 needs 3 devices but 8 are available"),
      ("co2_unstable", dict(mesh="replica=2,data=-1", outer__name="co2",
                            outer__staleness_penalty=1.0),
       "outer.staleness_penalty=1.0 is invalid with outer.lr=None, outer.momentum=None"),
  )
  def test_bad_relation(self, overrides, message):
    _assert_refused(self, overrides, message)


def test_a_jsonl_source_trains_packed_rows_only(tmp_path):
  """Whole documents (HDP) read a file a document: a JSONL source there is refused in one
  line; packed rows take it, with its text field named."""
  (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
  with pytest.raises(ValueError) as e:
    config_check.check_config(_config(data__source=str(tmp_path), data__variable_length=True,
                                      parallel__hdp=True, data__max_len=512))
  assert str(e.value) == (f"data.variable_length=True is invalid with data.source="
                          f"{str(tmp_path)!r}; it must be False for a JSONL source or a "
                          "mixture: whole documents are read a file a document from one "
                          "source (packed rows read both)")
  config_check.check_config(_config(data__source=str(tmp_path)))
  with pytest.raises(ValueError, match=r"^data.text_field='' is invalid; it must be the name"):
    config_check.check_config(_config(data__source=str(tmp_path), data__text_field=""))


@pytest.mark.parametrize("where, message", [
    ("", "workdir='' is invalid; it must be a directory path"),
    ("a_file", "workdir='{tmp}/a_file' is a file; it must be a directory"),
    ("a_file/run", "workdir='{tmp}/a_file/run' is not writable (Not a directory)"),
])
def test_bad_workdir(tmp_path, where, message):
  (tmp_path / "a_file").touch()
  with pytest.raises(ValueError) as err:
    config_check.check_workdir(str(tmp_path / where) if where else "")
  assert str(err.value).startswith(message.format(tmp=tmp_path))


def test_creates_a_new_workdir(tmp_path):
  config_check.check_config(_config(), str(tmp_path / "new" / "run"))
  assert (tmp_path / "new" / "run").is_dir()


def test_train_and_evaluate_checks_before_any_work(tmp_path):
  with pytest.raises(ValueError, match=r"^total_steps=0 is invalid"):
    loop.train_and_evaluate(_config(total_steps=0), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


if __name__ == "__main__":
  absltest.main()
