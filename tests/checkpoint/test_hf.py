"""jaxsys.checkpoint.hf: import and export against transformers' own LlamaForCausalLM (CPU
torch, the `hf` extra: skipped without it); sharded import, refusals, the checkpoint's
tokenizer and init_from=hf:<dir> on the committed fixture (tests/data/hf_fixture, no torch).
test_hf_fixture.py checks the fixture against transformers' recorded numbers."""
import copy
import dataclasses
import importlib
import importlib.util
import json
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxsys import mesh as mesh_lib
from jaxsys.checkpoint import hf
from jaxsys.cli import hf_runs
from jaxsys.data import tokenizer as tokenizer_lib
from jaxsys.models import transformer



class _OnFirstUse:
  """A module imported when first used: importing torch and transformers costs each xdist
  worker seconds while it collects, whether or not it runs these tests."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str):
    return getattr(importlib.import_module(self._name), attr)


torch, transformers = _OnFirstUse("torch"), _OnFirstUse("transformers")
needs_transformers = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    reason="transformers and torch are not installed: pip install -e '.[hf]'")
# Checkpoints transformers saved (experiments/make_hf_fixture.py): untied float32 in shards;
# tied bfloat16 with head_dim 16 (hidden 32, 4 heads) and 296 rows for its tokenizer's 280 ids.
FIXTURE = {kind: os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "hf_fixture",
                              kind) for kind in ("untied", "tied", "qwen2", "qwen3")}

TOKENS = np.random.RandomState(0).randint(0, 256, (2, 16))
# Untied with the default head dim and a sharded save; tied with head_dim 8 != 64 / 4 and
# room for its tokenizer's 280 ids (the untied one's 256 rows are too few for them).
MODELS = {
    "untied": dict(tie_word_embeddings=False, vocab_size=256, shard="20KB"),
    "tied": dict(tie_word_embeddings=True, vocab_size=320, head_dim=8, shard=None),
}


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def _assert_close(got, want, rtol=1e-4):
  err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
  assert err < rtol, f"max |diff| / max |logit| = {err:.2e}"
  return err


def _tokenizer_json(path, vocab_size=280):
  """A byte-level BPE with a <s> BOS its post-processor adds and a </s> EOS."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(["def f(x):\n  return x + 1\n", "héllo wörld, hello world"] * 50,
                          trainer=trainer)
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
  tok.save(str(path))
  return tok


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """{kind: (directory, transformers model)} of tiny random Llamas saved by save_pretrained."""
  out = {}
  for i, (kind, kw) in enumerate(MODELS.items()):
    kw = dict(kw)
    shard = kw.pop("shard")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=50_000.0, rms_norm_eps=1e-5,
        **kw)
    model = hf_runs.randomize_torch_llama(transformers.LlamaForCausalLM(config), seed=i).eval()
    directory = str(tmp_path_factory.mktemp(kind))
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    _tokenizer_json(os.path.join(directory, "tokenizer.json"))
    out[kind] = directory, model
  return out


@needs_transformers
@pytest.mark.parametrize("kind", list(MODELS))
def test_import_equals_transformers(checkpoints, kind):
  directory, model = checkpoints[kind]
  if kind == "untied":  # the sharded save: shards and their index
    assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
  cfg, params = hf.load(directory)
  assert (cfg.norm_eps, cfg.rope_theta, cfg.hd) == (1e-5, 50_000.0, 16 if kind == "untied" else 8)
  _assert_close(transformer.apply(cfg, params, TOKENS), _torch_logits(model, TOKENS))


@needs_transformers
@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers(tmp_path, tie):
  cfg = transformer.TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                      n_kv_heads=2, d_ff=96, rope_theta=30_000.0, norm_eps=1e-5,
                                      tie_embeddings=tie)
  params = transformer.init_params(cfg, jax.random.key(1))
  params["layers"]["attn_norm"] = params["layers"]["attn_norm"] * 1.5  # not all ones
  hf.save(str(tmp_path), cfg, params, tokenizer_lib.ByteTokenizer(),
          max_shard_bytes=None if tie else 40_000)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  _assert_close(_torch_logits(model, TOKENS), np.asarray(transformer.apply(cfg, params, TOKENS)))
  # The byte tokenizer's tokenizer.json gives transformers the same ids.
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
  text = "héllo\n\tx"
  assert tok(text)["input_ids"] == list(tokenizer_lib.ByteTokenizer().encode(text))


@needs_transformers
def test_bf16_files_in_and_out(checkpoints, tmp_path):
  """bfloat16 safetensors (how real checkpoints ship) read exactly into f32 params, and
  written in bfloat16 for transformers."""
  _, model = checkpoints["tied"]
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
  cfg, params = hf.load(str(tmp_path / "bf16"))
  # transformers in f32 on the bf16 weights (its RoPE frequencies made in f32 on load)
  f32 = dict(dtype=torch.float32)
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), **f32)
  want = model.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
  np.testing.assert_array_equal(np.asarray(params["embedding"]), want)
  ref = _torch_logits(ref_model.eval(), TOKENS)
  _assert_close(transformer.apply(cfg, params, TOKENS), ref)
  hf.save(str(tmp_path / "out"), cfg, params, dtype="bfloat16")
  # pylint: disable-next=protected-access
  header = hf._Tensors._header(str(tmp_path / "out" / "model.safetensors"))
  assert {t["dtype"] for t in header.values()} == {"BF16"}
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), **f32)
  _assert_close(_torch_logits(back.eval(), TOKENS), ref)


@needs_transformers
def test_export_of_quantized_params_is_dequantized(checkpoints, tmp_path):
  from jaxsys.quant import ptq, rules  # pylint: disable=import-outside-toplevel
  cfg, params = hf.load(checkpoints["untied"][0])
  q = ptq.quantize_params(cfg, params, rules.default_rules("w4a16", group_size=32))
  hf.save(str(tmp_path), cfg, q)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  _, deq = hf.load(str(tmp_path))  # float weights equal to the QWeights' values
  _assert_close(_torch_logits(model, TOKENS), np.asarray(transformer.apply(cfg, deq, TOKENS)))
  assert not np.allclose(deq["layers"]["wq"], params["layers"]["wq"])


# data=2,tensor=4: 4 query heads split, the 2 K/V heads whole on every tensor shard.
@pytest.mark.parametrize("spec", ["fsdp=4,tensor=2", "data=2,fsdp=4", "data=2,tensor=4"])
def test_sharded_import_equals_unsharded(spec, monkeypatch):
  directory = FIXTURE["untied"]
  _, ref = hf.load(directory)
  mesh = mesh_lib.make_mesh(spec)
  blocks = []  # the shape of every host block read: one device's shard of one layer
  block = hf._block  # pylint: disable=protected-access
  monkeypatch.setattr(hf, "_block", lambda *a: blocks.append(block(*a).shape) or block(*a))
  cfg, params = hf.load(directory, mesh=mesh)
  wq_shard = params["layers"]["wq"].addressable_shards[0].data.shape
  assert wq_shard[1:] in blocks and max(map(np.prod, blocks)) <= cfg.vocab_size * cfg.d_model // 4
  want = mesh_lib.logical_to_sharding(transformer.param_axes(cfg), mesh, shapes=ref)
  jax.tree.map(lambda x, sh: x.sharding.is_equivalent_to(sh, x.ndim) or pytest.fail(
      f"{x.sharding} != {sh}"), params, want)
  kv_whole = cfg.n_kv_heads % dict(mesh.shape).get("tensor", 1) != 0  # replicated, not split
  assert (params["layers"]["wk"].addressable_shards[0].data.shape[2] == cfg.n_kv_heads) == (
      kv_whole or "tensor" not in spec)
  assert len(params["layers"]["wq"].sharding.device_set) == 8
  assert params["layers"]["wq"].addressable_shards[0].data.size < params["layers"]["wq"].size
  chex.assert_trees_all_equal(jax.device_get(params), jax.device_get(ref))


def _edited(src, tmp_path, **fields):
  out = tmp_path / "edited"
  shutil.copytree(src, out)
  with open(out / "config.json") as f:
    config = json.load(f)
  config.update(fields)
  with open(out / "config.json", "w") as f:
    json.dump(config, f)
  return str(out)


@pytest.mark.parametrize("fields, message", [
    (dict(architectures=["GemmaForCausalLM"]),
     "architectures=['GemmaForCausalLM'] is not supported (Gemma's (1 + w) RMSNorm"),
    (dict(architectures=["Gemma2ForCausalLM"]),
     "it also soft-caps its logits and alternates local (sliding-window) and global attention"),
    (dict(architectures=["Qwen3MoeForCausalLM"]),
     "(a mixture of experts: jaxsys.models.transformer has no expert layers); valid: "
     "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=4096,
          max_window_layers=1),
     "layer_types=['full_attention', 'sliding_attention'] (max_window_layers=1) is not "
     "supported; valid: every layer full_attention, or every layer sliding_attention"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=4,
          layer_types=["full_attention", "full_attention"]),
     "layer_types=['full_attention', 'sliding_attention'] (max_window_layers=None) is not"),
    (dict(sliding_window=4096), "sliding_window=4096 is not supported for model_type 'llama'; "
     "valid: null (a window is read for mistral, qwen2, qwen3)"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=0),
     "sliding_window=0 is not supported; valid: null or an int >= 1"),
    (dict(architectures=["Qwen3ForCausalLM"], attention_bias=True),
     "attention_bias=True is not supported; valid: False (jaxsys.models.transformer's attention "
     "and MLP: q/k/v biases only as Qwen2's, no o_proj bias)"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0, rope_theta=5e5)),  # no keys
     "rope_parameters.rope_type='llama3' is not supported; valid: 'default', 'linear' (with "
     "factor), 'llama3' (with factor, low_freq_factor, high_freq_factor, "
     "original_max_position_embeddings), 'yarn' (with factor, original_max_position_embeddings)"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0, rope_theta=5e5,
                               low_freq_factor=4.0, high_freq_factor=1.0,
                               original_max_position_embeddings=8192)),
     "rope_parameters: model.rope_scaling='llama3:factor=8,low_freq_factor=4,"
     "high_freq_factor=1,original_max_position_embeddings=8192': factor and"),
    (dict(rope_scaling=dict(type="dynamic", factor=4.0)),
     "rope_scaling.rope_type='dynamic' is not supported (transformers recomputes dynamic NTK "
     "frequencies from the longest sequence the model instance has run so far"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, truncate=3)),
     "rope_parameters: model.rope_scaling='yarn:factor=4,original_max_position_embeddings=256,"
     "truncate=3': yarn's truncate must be 0 or 1"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(intermediate_size=128), "tensor 'model.layers.0.mlp.down_proj.weight' has "
     "shape (32, 64) but config.json gives (32, 128)"),
])
def test_refusals_name_the_field(tmp_path, fields, message):
  with pytest.raises(ValueError) as e:
    hf.load(_edited(FIXTURE["untied"], tmp_path, **fields))
  assert message in str(e.value) and "\n" not in str(e.value)


def test_mistral_without_a_window_is_a_llama(tmp_path):
  """Mistral 7B v0.2/v0.3's config (sliding_window null) over the fixture's Llama weights
  loads as that Llama: the same model config and parameters."""
  directory = _edited(FIXTURE["untied"], tmp_path, architectures=["MistralForCausalLM"],
                      model_type="mistral", sliding_window=None)
  (cfg, params), (want_cfg, want) = hf.load(directory), hf.load(FIXTURE["untied"])
  assert cfg == want_cfg
  chex.assert_trees_all_equal(params, want)


@pytest.mark.parametrize("fields, window", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096), 4096),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=6,
          max_window_layers=0), 6),
    # max_window_layers defaults to 28 (transformers' Qwen2Config): no layer of 2 slides
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=6), 0),
    (dict(architectures=["Qwen3ForCausalLM"], use_sliding_window=False, sliding_window=6,
          max_window_layers=0), 0),
])
def test_sliding_window_as_transformers_applies_it(tmp_path, fields, window):
  assert hf.model_config(_edited(FIXTURE["untied"], tmp_path, **fields)).sliding_window == window


@pytest.mark.parametrize("kind, arch", [("qwen2", "Qwen2ForCausalLM"),
                                        ("qwen3", "Qwen3ForCausalLM"),
                                        ("untied", "MistralForCausalLM")])
def test_a_window_exports_to_a_class_that_applies_it(tmp_path, kind, arch):
  """A Qwen keeps its class with use_sliding_window on every layer; a Llama becomes a
  Mistral; each re-imports with its window (transformers' logits checked by hand: hf.md)."""
  cfg, params = hf.load(FIXTURE[kind])
  cfg = dataclasses.replace(cfg, sliding_window=4)
  hf.save(str(tmp_path), cfg, params)
  assert hf.read_config(str(tmp_path))["architectures"] == [arch]
  assert hf.model_config(str(tmp_path)) == cfg


@pytest.mark.parametrize("fields, spec", [
    (dict(rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768)),
     "yarn:factor=4,original_max_position_embeddings=32768"),  # Qwen2.5's, transformers 4 form
    # the original context from max_position_embeddings (256), DeepSeek's null factor from it
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=None,
                               original_max_position_embeddings=64, mscale=0.707,
                               mscale_all_dim=1.0, beta_fast=0, truncate=False)),
     "yarn:factor=4,original_max_position_embeddings=64,mscale=0.707,mscale_all_dim=1,truncate=0"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0)),
     "yarn:factor=2,original_max_position_embeddings=256"),
])
def test_rope_scaling_as_transformers_reads_it(tmp_path, fields, spec):
  assert hf.model_config(_edited(FIXTURE["untied"], tmp_path, **fields)).rope_scaling == spec


@needs_transformers
def test_mistral_import_equals_transformers(tmp_path):
  config = transformers.MistralConfig(
      vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-5,
      sliding_window=None, tie_word_embeddings=False)
  model = hf_runs.randomize_torch_llama(transformers.MistralForCausalLM(config), seed=3).eval()
  model.save_pretrained(str(tmp_path))
  cfg, params = hf.load(str(tmp_path))
  _assert_close(transformer.apply(cfg, params, TOKENS), _torch_logits(model, TOKENS))


def test_refusals_of_missing_files(tmp_path):
  with pytest.raises(ValueError, match=r"config.json is missing"):
    hf.load(str(tmp_path))
  src = FIXTURE["tied"]
  shutil.copy(os.path.join(src, "config.json"), tmp_path)
  with pytest.raises(ValueError, match=r"has no model.safetensors nor model.safetensors.index"):
    hf.load(str(tmp_path))
  cfg = hf.model_config(src)
  with pytest.raises(ValueError, match=r"gives model.d_ff=64 but the run has model.d_ff=48; "):
    hf.load(src, transformer.TransformerConfig(**{**cfg.__dict__, "d_ff": 48}))


def _spoiled(how: str, tmp_path) -> str:
  """The untied fixture (4 shards and their index) with one shard or the index damaged."""
  out = tmp_path / how
  shutil.copytree(FIXTURE["untied"], out)
  with open(out / "model.safetensors.index.json") as f:
    index = json.load(f)
  shard = out / index["weight_map"]["model.norm.weight"]
  if how == "index points elsewhere":
    index["weight_map"]["model.norm.weight"] = next(
        v for v in index["weight_map"].values() if v != shard.name)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
  elif how == "shard truncated":
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
  else:  # the header's JSON spoiled
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{]"
    shard.write_bytes(bytes(data))
  return str(out)


@pytest.mark.parametrize("how, message", [
    ("index points elsewhere", r"model-0000\d-of-00004.safetensors has no tensor "
     r"'model.norm.weight', though model.safetensors.index.json maps it there"),
    ("shard truncated", r"model-0000\d-of-00004.safetensors: tensor '.*' ends at byte \d+, "
     r"past the file's \d+ bytes; the file is truncated"),
    ("header spoiled", r"model-0000\d-of-00004.safetensors: its safetensors header is not "
     r"valid JSON"),
])
def test_damaged_shards_are_named_in_one_line(tmp_path, how, message):
  with pytest.raises(ValueError, match=message) as e:
    hf.load(_spoiled(how, tmp_path))
  assert "\n" not in str(e.value)


def test_tokenizer(tmp_path):
  _tokenizer_json(tmp_path / "tokenizer.json")
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}}, f)
  tok = tokenizer_lib.make_tokenizer(f"hf:{tmp_path}")
  assert isinstance(tok, tokenizer_lib.HFTokenizer)
  assert (tok.vocab_size, tok.bos_token, tok.eos_token) == (280, "<s>", "</s>")
  text = "def héllo(x):\n  return wörld  \n"
  ids = tok.encode(text)
  assert ids[0] == tok.hf_tokenizer.token_to_id("<s>")  # the BOS its post-processor adds
  assert tok.decode(ids) == "<s>" + text
  [batch] = tok.encode_batch([text.encode()])
  np.testing.assert_array_equal(batch, ids)
  table = tok.token_bytes()
  assert table[ids[0]] == 0 and table.sum() > 256  # specials 0 bytes; merges > 1
  assert table[ids].sum() == len(text.encode("utf-8"))  # bits per byte count every byte once


def test_sentencepiece_token_bytes(tmp_path):
  """Llama 2 style: '▁' word starts, <0xNN> byte fallback."""
  vocab = {"<s>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "▁": 258,
           "▁hé": 259, "llo": 260}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
  tok.add_special_tokens(["<s>", "</s>"])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  tok.save(str(tmp_path / "tokenizer.json"))
  table = tokenizer_lib.HFTokenizer.load(tmp_path).token_bytes()
  assert list(table[[0, 1, 2, 258, 259, 260]]) == [0, 0, 1, 1, 4, 3]


def test_init_from_hf_takes_model_and_tokenizer(make_config, tmp_path):
  from jaxsys.train import config_check  # pylint: disable=import-outside-toplevel
  directory = FIXTURE["tied"]
  run = config_check.check_config(make_config(init_from=f"hf:{directory}", model__n_layers=7))
  assert run.model == hf.model_config(directory, run.model)  # n_layers=7 replaced by 2
  assert (run.model.n_layers, run.model.head_dim, run.model.tie_embeddings) == (2, 16, False)
  assert (run.data.tokenizer, run.data.vocab_size) == (f"hf:{directory}", 280)
  # A tokenizer with more ids (280) than the model's embedding rows (256): one line.
  small = _edited(directory, tmp_path, vocab_size=256)
  with pytest.raises(ValueError, match=r"^model.vocab_size=256 is invalid with "
                     r"data.vocab_size=280; it must be >= data.vocab_size"):
    config_check.check_config(make_config(init_from=f"hf:{small}"))
  shutil.copytree(directory, tmp_path / "bare")
  os.remove(tmp_path / "bare" / "tokenizer.json")
  with pytest.raises(ValueError, match=r"bare/tokenizer.json is missing; data.tokenizer="):
    config_check.check_config(make_config(init_from=f"hf:{tmp_path / 'bare'}"))


def test_quant_eval_loads_hf(make_config):
  from jaxsys.cli import hf_runs  # pylint: disable=import-outside-toplevel
  directory = FIXTURE["tied"]
  run = hf_runs.ptq_run(make_config(), f"hf:{directory}")
  assert run.config.model == hf.model_config(directory, run.config.model)
  assert run.config.data.tokenizer == f"hf:{directory}"
  chex.assert_trees_all_equal(run.params, jax.device_get(hf.load(directory)[1]))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_corpus):
  """A run started with init_from=hf:<tied fixture> on a sharded mesh, one step at learning
  rate 0 (the warmup's first): (its workdir, the parameters of its checkpoint)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from jaxsys.checkpoint.manager import Checkpointer  # pylint: disable=import-outside-toplevel
  from jaxsys.train import loop  # pylint: disable=import-outside-toplevel
  from conftest import load_test_config  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path_factory.mktemp("run") / "run")
  config = load_test_config(
      small_corpus, init_from=f"hf:{FIXTURE['tied']}", total_steps=1, eval_every=1,
      eval_steps=1, mesh="data=2,fsdp=2,tensor=2", optimizer__warmup_steps=5,
      optimizer__schedule_steps=10)
  loop.train_and_evaluate(config, workdir)
  ckpts = os.path.join(workdir, "checkpoints")
  with ocp.CheckpointManager(ckpts, item_names=("state",)) as m:
    state = m.restore(Checkpointer(ckpts).latest_step(),
                      args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  return workdir, jax.device_get(state["params"])


@pytest.mark.slow  # a training run: about 15 s on 2 cores
def test_run_starts_from_hf_and_exports(trained_run, tmp_path):
  """The run saves the checkpoint's parameters and trains on its tokenizer; exported
  (hf_runs.export_run, experiments/hf_export.py's), float and --quantize=w4a16, it re-imports
  to the same (dequantized) parameters with the fixture's tokenizer."""
  from jaxsys.cli import hf_runs  # pylint: disable=import-outside-toplevel
  workdir, params = trained_run
  directory = FIXTURE["tied"]
  chex.assert_trees_all_equal(params, jax.device_get(hf.load(directory)[1]))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert any(np.isfinite(r.get("val_bpb", np.nan)) for r in rows), rows
  out = str(tmp_path / "export")
  hf_runs.export_run(workdir, out)
  chex.assert_trees_all_equal(jax.device_get(hf.load(out)[1]), params)
  # The source's context (256), not the run's data.seq_len (64).
  assert hf.read_config(out)["max_position_embeddings"] == 256
  text = "def f(x):\n  return wörld\n"
  assert (list(tokenizer_lib.make_tokenizer(f"hf:{out}").encode(text))
          == list(tokenizer_lib.make_tokenizer(f"hf:{directory}").encode(text)))
  hf_runs.export_run(workdir, out + "_w4", quantize="w4a16", group_size=32)  # --quantize
  _, deq = hf.load(out + "_w4")
  assert not np.allclose(deq["layers"]["w_up"], params["layers"]["w_up"])


@needs_transformers
@pytest.mark.slow  # the training run of test_run_starts_from_hf_and_exports
def test_run_export_loads_in_transformers(trained_run, tmp_path):
  """The exported run (float and w4a16) in transformers: its logits, its tokenizer's ids."""
  from jaxsys.cli import hf_runs  # pylint: disable=import-outside-toplevel
  workdir, params = trained_run
  directory = FIXTURE["tied"]
  out = str(tmp_path / "export")
  hf_runs.export_run(workdir, out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  cfg = hf.model_config(directory)
  tokens = TOKENS % cfg.vocab_size
  _assert_close(_torch_logits(model, tokens), np.asarray(transformer.apply(cfg, params, tokens)))
  text = "def f(x):\n  return wörld\n"
  assert (transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"]
          == list(tokenizer_lib.make_tokenizer(f"hf:{directory}").encode(text)))
  hf_runs.export_run(workdir, out + "_w4", quantize="w4a16", group_size=32)
  _, deq = hf.load(out + "_w4")
  model = transformers.AutoModelForCausalLM.from_pretrained(out + "_w4").eval()
  _assert_close(_torch_logits(model, tokens), np.asarray(transformer.apply(cfg, deq, tokens)))
