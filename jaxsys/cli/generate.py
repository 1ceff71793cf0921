r"""Samples text from a training run's checkpoint or a Hugging Face one, float or quantized:
`jaxsys-generate` (installed), `python -m experiments.generate` in the repository.

  python -m experiments.generate --workdir=/tmp/jaxsys_tiny --prompt='def main(' \
      --prompt='import ' --max_new_tokens=64 --temperature=0.8 --top_p=0.95
  python -m experiments.generate --workdir=/tmp/jaxsys_tiny --prompt='class ' --quant=w4a16
  python -m experiments.generate --hf=/ckpt/Qwen2.5-0.5B --prompt='The capital of France is'
  python -m experiments.generate --hf=/ckpt/Qwen2.5-0.5B-Instruct --chat --prompts_file=q.txt

Loads the latest (or --step) checkpoint of --workdir (the model config from its meta) and
the run's tokenizer (byte, or the BPE the run saved as <workdir>/tokenizer.json), or with
--hf a Hugging Face checkpoint directory as it is (jaxsys/checkpoint/hf.py: its config.json,
safetensors and tokenizer.json; a row stops at its EOS unless --eos_id says otherwise);
optionally quantizes the layer matmuls with round-to-nearest (--quant; the embedding and
LM head stay float), and decodes every --prompt as one batch with the KV cache
(jaxsys/models/generate.py). --chat renders each prompt as one user message through the
tokenizer's chat template (jaxsys/data/chat.py) first. Prints each prompt (with --chat: the
rendered text) and its continuation, then the decoding rate. --timing decodes --repeat more times and reports their median tokens/s (the first
run compiles); --no_cache decodes greedily by re-running the model on the whole prefix at
every step (the baseline; a row's tokens after its EOS are EOS again, as the cached
decoder writes them). --mesh splits the batch over `data` and the heads over
`tensor`. Bad input exits 1 with one "error:" line.
"""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxsys import mesh as mesh_lib
from jaxsys import metrics as metrics_lib
from jaxsys.checkpoint import hf
from jaxsys.data import chat
from jaxsys.data import tokenizer as tokenizer_lib
from jaxsys.kernels.backends import IMPLS
from jaxsys.kernels.quant_matmul import SCHEMES
from jaxsys.models import generate
from jaxsys.cli import quant_runs
from jaxsys.quant import ptq, rules
from jaxsys import fields

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a training run (experiments.train).")
_HF = flags.DEFINE_string("hf", None, "A Hugging Face checkpoint directory, instead of --workdir.")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt; repeat the flag for a batch.")
_PROMPTS = flags.DEFINE_string("prompts_file", None, "A UTF-8 file of prompts, one a line (blank "
                               "lines skipped), after any --prompt.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.")
_MAX_LEN = flags.DEFINE_integer("max_len", None, "KV cache length (default: the longest "
                                "prompt + max_new_tokens).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1] (1: off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_EOS = flags.DEFINE_integer("eos_id", None, "Stop a row at this token; -1: never (default: the "
                            "--hf checkpoint's eos_token_id; none for a run's byte or BPE "
                            "tokenizer, which define no EOS).")
_QUANT = flags.DEFINE_string("quant", "none", f"none or one of {', '.join(SCHEMES)}.")
_GROUP = flags.DEFINE_integer("group_size", 128, "w4a16 group size (rows of K per scale).")
_IMPL = flags.DEFINE_string("qmatmul_impl", "auto", f"Quantized matmul: {', '.join(IMPLS)}.")
_MESH = flags.DEFINE_string("mesh", "", "e.g. data=2,tensor=2 (default: one device).")
_TIMING = flags.DEFINE_bool("timing", False, "Decode again after the first (compiling) run; "
                            "report the median rate of --repeat such runs.")
_REPEAT = flags.DEFINE_integer("repeat", 3, "Timed runs with --timing.")
_NO_CACHE = flags.DEFINE_bool("no_cache", False, "Greedy, re-running the whole prefix each step.")
_CHAT = flags.DEFINE_bool("chat", False, "Render each prompt as a user message with the "
                          "tokenizer's chat template (and the assistant's generation prompt).")
_FLAG_RULES = ((_STEP, fields.integer(0)), (_NEW, fields.integer(1)),
               (_MAX_LEN, fields.integer(1)), (_GROUP, fields.integer(1)),
               (_REPEAT, fields.integer(1)))


def _check_flags():
  """Everything that needs no checkpoint, before one is read."""
  for flag, rule in _FLAG_RULES:
    error = flag.value is not None and rule.error(f"--{flag.name}", flag.value)
    if error:
      raise ValueError(error)
  if _QUANT.value not in ("none", *SCHEMES):
    raise ValueError(f"--quant={_QUANT.value!r} is not known; choose one of "
                     f"{('none', *SCHEMES)}")
  if _IMPL.value not in IMPLS:
    raise ValueError(f"--qmatmul_impl={_IMPL.value!r} is not known; choose one of {IMPLS}")
  if (_WORKDIR.value is None) == (_HF.value is None):
    raise ValueError("give exactly one of --workdir (a training run) and --hf (a Hugging Face "
                     "checkpoint directory)")
  if _HF.value is not None and _STEP.value is not None:
    raise ValueError("--step picks a training run's checkpoint; a --hf checkpoint has one")
  if _EOS.value is not None and _EOS.value < -1:
    raise ValueError(f"--eos_id={_EOS.value} is invalid; it must be a token id >= 0, or -1 "
                     "(never stop)")
  if any(not p for p in _PROMPT.value):
    raise ValueError("--prompt='' is empty; every prompt needs at least one character")
  if not _PROMPT.value and _PROMPTS.value is None:
    raise ValueError("no prompt: give --prompt (repeat it for a batch) or --prompts_file")
  if _NO_CACHE.value and (_TEMPERATURE.value or _MESH.value):
    raise ValueError("--no_cache decodes greedily on one device; drop --temperature and --mesh")
  try:
    return generate.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  except ValueError as e:
    raise ValueError(str(e).replace("sampling: ", "--", 1)) from None


def _tokenizer(data_cfg, workdir):
  """The run's tokenizer: the BPE it trained and saved in its workdir, or the byte one."""
  if data_cfg.tokenizer == "bpe":
    path = os.path.join(workdir, "tokenizer.json")
    if not os.path.exists(path):
      raise ValueError(f"{path}: the run's BPE tokenizer is missing; pass the --workdir the "
                       "run trained in")
    return tokenizer_lib.make_tokenizer("bpe", vocab_size=data_cfg.vocab_size, cache_path=path)
  return tokenizer_lib.make_tokenizer(data_cfg.tokenizer)


def _template(data_cfg, workdir):
  """With --chat, the chat template of a run's tokenizer (only a Hugging Face one has one)."""
  directory = tokenizer_lib.hf_directory(data_cfg.tokenizer)
  if directory is None:
    raise ValueError(f"--chat: {workdir}: the run's tokenizer (data.tokenizer="
                     f"{data_cfg.tokenizer!r}) has no chat_template; --chat needs a Hugging Face "
                     "tokenizer with one (--hf=<dir>, or a run with data.tokenizer='hf:<dir>')")
  return chat.load_template(directory)


def _load():
  """(model config, parameters, tokenizer, EOS id or None, chat template or None, what was
  loaded)."""
  if _HF.value is not None:
    eos = hf.read_config(_HF.value).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos  # Llama 3 instruct lists several
    template = chat.load_template(_HF.value) if _CHAT.value else None  # before the weights
    cfg, params = hf.load(_HF.value)
    return (cfg, params, tokenizer_lib.make_tokenizer(f"{hf.PREFIX}{_HF.value}"), eos, template,
            f"{_HF.value} (Hugging Face)")
  run = quant_runs.load_run(_WORKDIR.value, _STEP.value)
  template = _template(run.config.data, _WORKDIR.value) if _CHAT.value else None
  return (run.config.model, run.params, _tokenizer(run.config.data, _WORKDIR.value), None,
          template, f"step {run.step}")


def _encode(tokenizer, template, texts):
  """(the texts the model reads, their ids): with a chat template, each prompt rendered as a
  user message and encoded without the tokenizer's own special tokens (the template wrote
  them: a BOS would otherwise come twice)."""
  if template is None:
    return texts, [tokenizer.encode(t) for t in texts]
  rendered = [template.render_user(t) for t in texts]
  return rendered, [tokenizer.encode(t, add_special_tokens=False) for t in rendered]


def stop_at_eos(out: generate.Generation, eos_id: int | None) -> generate.Generation:
  """The no-cache decoder's tokens as the cached one returns them: after a row's first EOS,
  EOS again, and its length up to and including that EOS (the tokens before it are the
  same: greedy decoding never looks ahead)."""
  if eos_id is None:
    return out
  n = out.tokens.shape[1]
  is_eos = out.tokens == eos_id
  seen = jnp.cumsum(is_eos, axis=1) > 0
  tokens = jnp.where(seen, eos_id, out.tokens)
  lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, n).astype(jnp.int32)
  return generate.Generation(tokens, lengths, out.logits)


def _prompts() -> list[str]:
  """--prompt's, then --prompts_file's lines."""
  if _PROMPTS.value is None:
    return list(_PROMPT.value)
  try:
    with open(_PROMPTS.value, encoding="utf-8") as f:
      lines = [line.rstrip("\n") for line in f if line.strip()]
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"--prompts_file={_PROMPTS.value!r} cannot be read ({e}); it must be a "
                     "UTF-8 file of prompts, one a line") from None
  if not lines:
    raise ValueError(f"--prompts_file={_PROMPTS.value!r} holds no prompt; write one a line")
  return [*_PROMPT.value, *lines]


def main(argv):
  del argv
  metrics_lib.quiet_library_logs()
  try:
    sampling = _check_flags()
    mesh = mesh_lib.make_mesh(_MESH.value) if _MESH.value else None
    cfg, params, tokenizer, eos_id, template, source = _load()
    if _EOS.value is not None:
      eos_id = None if _EOS.value == -1 else _EOS.value
    if _NO_CACHE.value and eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
      # as generate() says it for the cached decoder, which checks its eos_id itself
      raise ValueError(f"generate: eos_id={eos_id} must be an int in [0, {cfg.vocab_size - 1}]")
    texts, encoded = _encode(tokenizer, template, _prompts())
    prompts, lengths = generate.pad_prompts(encoded)
    if _QUANT.value != "none":
      params = ptq.quantize_params(cfg, params, rules.default_rules(_QUANT.value,
                                                                    group_size=_GROUP.value))
    if mesh is not None:
      params = generate.shard_params(cfg, params, mesh)

    def decode():
      if _NO_CACHE.value:
        return stop_at_eos(generate.greedy_without_cache(
            cfg, params, prompts, lengths, max_new_tokens=_NEW.value,
            qmatmul_impl=_IMPL.value), eos_id)
      return generate.generate(cfg, params, prompts, lengths, jax.random.key(_SEED.value),
                               max_new_tokens=_NEW.value, max_len=_MAX_LEN.value,
                               sampling=sampling, eos_id=eos_id, qmatmul_impl=_IMPL.value,
                               mesh=mesh)
    t0 = time.perf_counter()
    out = jax.block_until_ready(decode())
    seconds = time.perf_counter() - t0
  except ValueError as e:
    sys.exit(f"error: {e}")
  if _TIMING.value:
    times = []
    for _ in range(_REPEAT.value):
      t0 = time.perf_counter()
      out = jax.block_until_ready(decode())
      times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
  tokens, counts = jax.device_get((out.tokens, out.lengths))
  for i, (prompt, ids, row, n) in enumerate(zip(texts, encoded, tokens, counts)):
    print(f"--- sample {i}: {n} new tokens ---")
    print(prompt + tokenizer_lib.decode_continuation(tokenizer, ids, row[:n]))
  new = int(counts.sum())
  what = ("including compilation" if not _TIMING.value
          else f"median of {_REPEAT.value} compiled runs")
  print(f"--- {cfg.n_layers}-layer model, {source}, "
        f"{'float' if _QUANT.value == 'none' else _QUANT.value}, "
        f"{'no cache' if _NO_CACHE.value else 'KV cache'}, batch {len(tokens)}: {new} tokens in "
        f"{seconds:.3f} s = {new / seconds:.1f} tokens/s ({what}) ---")


def run() -> None:
  app.run(main)
