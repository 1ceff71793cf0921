r"""jaxsys's KV-cache greedy decoding against transformers' `generate` on the same model and CPU.

  python -m experiments.bench_generate --out=/tmp/bench_generate.json

For each size, transformers builds a `LlamaForCausalLM` with random weights
(`hf_runs.randomize_torch_llama`) and writes it with `save_pretrained`; jaxsys imports those
files (`hf.load`), so both run the same float32 weights. For each batch, every row gets its
own random prompt of --prompt_len tokens (no padding) and --new_tokens greedy tokens are
generated with no EOS (neither model config has one, so no row stops early).

1. Same work: both frameworks' greedy tokens are compared, and where a row first differs
   the gap between its best two logits there (a near-tie of random weights, or a bug).
2. Time: one first call each (jaxsys's includes its compile), then --rounds interleaved
   rounds, the order alternating each round; tokens/s counts new tokens over the whole
   call (prefill included) and is reported as median [min, max]. Each timing records
   the load average and the share of the machine's CPU other processes used meanwhile.

torch runs with `torch.set_num_threads` = the cores this process may use (--threads), the
size of the thread pool XLA:CPU starts. Needs torch and transformers (the `hf` extra).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np
from absl import app, flags

from jaxsys.checkpoint import hf
from jaxsys.cli import hf_runs
from jaxsys.models import generate, transformer

MISSING = "error: bench_generate needs transformers and torch: pip install -e '.[hf]'"

# name: hidden, layers, heads, kv heads, intermediate, vocab
SIZES = {
    "test": (64, 2, 4, 2, 96, 256),
    "tiny": (256, 4, 4, 2, 768, 256),  # configs/tiny_lm.py's shape, byte vocabulary
    "125m": (768, 12, 12, 4, 2048, 32000),  # GPT-2-small-sized Llama (Llama 2's vocabulary)
}

_SIZES = flags.DEFINE_list("sizes", ["tiny", "125m"], f"Model sizes, of {list(SIZES)}.")
_BATCHES = flags.DEFINE_list("batches", ["1", "16"], "Batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Greedy tokens generated per row.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds per framework, interleaved.")
_THREADS = flags.DEFINE_integer("threads", 0, "torch threads; 0: the cores this process may use.")
_DIR = flags.DEFINE_string("dir", None, "Where the checkpoints are written (default: a temp dir).")
_OUT = flags.DEFINE_string("out", None, "Also write the results as JSON here.")


def import_hf():
  """(torch, transformers); ImportError when either is missing."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  return torch, transformers


def build(size: str, directory: str, seed: int = 0):
  """(transformers model, jaxsys config, jaxsys params) of one random Llama saved in `directory`."""
  _, transformers = import_hf()
  d, layers, heads, kv, ff, vocab = SIZES[size]
  # No BOS/EOS/pad ids: generate then never stops a row early (min_new_tokens would instead
  # mask the EOS logit, which changes the argmax jaxsys computes).
  config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv, rope_theta=500_000.0, rms_norm_eps=1e-5,
      tie_word_embeddings=False, max_position_embeddings=1024, bos_token_id=None,
      eos_token_id=None, pad_token_id=None)
  model = hf_runs.randomize_torch_llama(transformers.LlamaForCausalLM(config), seed=seed).eval()
  model.save_pretrained(directory)
  cfg, params = hf.load(directory)
  return model, cfg, params


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
  """int32 [batch, length] random prompts, one per row."""
  return np.random.RandomState(seed).randint(0, vocab, (batch, length)).astype(np.int32)


def jaxsys_generate(cfg, params, prompts_BT: np.ndarray, new: int, return_logits: bool = False):
  """jaxsys's greedy KV-cache decoding: (tokens int [B, new], logits f32 [B, new, V] or None)."""
  lengths = np.full(prompts_BT.shape[0], prompts_BT.shape[1], np.int32)
  out = generate.generate(cfg, params, prompts_BT, lengths, max_new_tokens=new, eos_id=None,
                          return_logits=return_logits)
  out = jax.block_until_ready(out)
  return np.asarray(out.tokens), None if out.logits is None else np.asarray(out.logits)


def hf_generate(model, prompts_BT: np.ndarray, new: int, return_logits: bool = False):
  """transformers' greedy `generate` (its default dynamic KV cache): (tokens, logits or None)."""
  torch, _ = import_hf()
  ids = torch.from_numpy(prompts_BT.astype(np.int64))
  with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, return_dict_in_generate=True, output_logits=return_logits)
  tokens = out.sequences[:, prompts_BT.shape[1]:].numpy()
  if tokens.shape[1] != new:
    raise RuntimeError(f"transformers generated {tokens.shape[1]} tokens, not {new}")
  logits = torch.stack(out.logits, 1).float().numpy() if return_logits else None
  return tokens, logits


def same_tokens(model, cfg, params, prompts_BT: np.ndarray, new: int) -> dict[str, Any]:
  """Both frameworks' greedy tokens compared: rows equal, where each other row first differs,
  and the top-1/top-2 logit gap there (transformers' logits) against the logits' difference."""
  mine, my_logits = jaxsys_generate(cfg, params, prompts_BT, new, return_logits=True)
  theirs, their_logits = hf_generate(model, prompts_BT, new, return_logits=True)
  top2 = np.sort(their_logits, axis=-1)[..., -2:]
  gap = top2[..., 1] - top2[..., 0]  # [B, new]
  first = [int(np.argmax(m != t)) if (m != t).any() else new for m, t in zip(mine, theirs)]
  # Logits are comparable up to and including a row's first differing step (same prefix).
  upto = [min(f + 1, new) for f in first]
  diff = max(float(np.abs(my_logits[b, :n] - their_logits[b, :n]).max()) for b, n in enumerate(upto))
  return {"rows": len(first), "rows_equal": sum(f == new for f in first), "first_diff": first,
          "gap_at_first_diff": [float(gap[b, f]) for b, f in enumerate(first) if f < new],
          "min_gap_on_equal_steps": float(min(gap[b, :f].min() for b, f in enumerate(first) if f)
                                          if any(first) else np.nan),
          "max_logit_diff": diff, "max_logit": float(np.abs(their_logits).max())}


class CpuShare:
  """The load average and the share of the machine's CPU time that other processes used
  while the block ran (from /proc/stat, less this process's own CPU time)."""

  def __enter__(self):
    self._stat, self._own, self._wall = _busy_total(), _own_cpu(), time.perf_counter()
    return self

  def __exit__(self, *exc):
    busy, total = (a - b for a, b in zip(_busy_total(), self._stat))
    own = _own_cpu() - self._own
    ticks = os.sysconf("SC_CLK_TCK")
    self.others = max(0.0, busy / ticks - own) / (total / ticks) if total else 0.0
    self.load = float(open("/proc/loadavg").read().split()[0])


def _busy_total() -> tuple[int, int]:
  fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
  idle = fields[3] + fields[4]  # idle + iowait
  return sum(fields[:8]) - idle, sum(fields[:8])


def _own_cpu() -> float:
  t = os.times()
  return t.user + t.system


@dataclasses.dataclass
class Timing:
  first_s: float  # the first call (jaxsys: with its compile)
  runs_s: list[float]
  others: list[float]  # other processes' share of the CPU during each run
  loads: list[float]


def timings(model, cfg, params, prompts_BT: np.ndarray, new: int, rounds: int
            ) -> dict[str, Timing]:
  """{'jaxsys' | 'transformers': Timing} of interleaved rounds, the order alternating."""
  calls = {"jaxsys": lambda: jaxsys_generate(cfg, params, prompts_BT, new),
           "transformers": lambda: hf_generate(model, prompts_BT, new)}
  out = {}
  for name, call in calls.items():
    start = time.perf_counter()
    call()
    out[name] = Timing(time.perf_counter() - start, [], [], [])
  for r in range(rounds):
    for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
      with CpuShare() as share:
        start = time.perf_counter()
        calls[name]()
        seconds = time.perf_counter() - start
      out[name].runs_s.append(seconds)
      out[name].others.append(share.others)
      out[name].loads.append(share.load)
  return out


def rate(tokens: int, seconds: list[float]) -> tuple[float, float, float]:
  """tokens/s: (median, min, max) over the runs."""
  r = tokens / np.asarray(seconds)
  return float(np.median(r)), float(r.min()), float(r.max())


def main(argv):
  del argv
  try:
    torch, transformers = import_hf()
  except ImportError:
    print(MISSING, file=sys.stderr)
    sys.exit(1)
  threads = _THREADS.value or len(os.sched_getaffinity(0))
  torch.set_num_threads(threads)
  new = _NEW.value
  print(f"jax {jax.__version__}, transformers {transformers.__version__}, torch "
        f"{torch.__version__}; torch threads {threads}; float32 on {jax.devices()[0].device_kind}; "
        f"prompt {_PROMPT_LEN.value} tokens, {new} new tokens greedy, {_ROUNDS.value} rounds\n")
  print("| model | params | batch | same tokens | jaxsys tokens/s | transformers tokens/s | "
        "ratio | jaxsys first call | others' CPU share |")
  print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
  results = []
  with tempfile.TemporaryDirectory(dir=_DIR.value) as tmp:
    for size in _SIZES.value:
      model, cfg, params = build(size, os.path.join(tmp, size))
      for batch in map(int, _BATCHES.value):
        p = prompts(batch, _PROMPT_LEN.value, cfg.vocab_size, seed=batch)
        same = same_tokens(model, cfg, params, p, new)
        t = timings(model, cfg, params, p, new, _ROUNDS.value)
        mine, theirs = (rate(batch * new, t[k].runs_s) for k in ("jaxsys", "transformers"))
        others = t["jaxsys"].others + t["transformers"].others
        agree = f"{same['rows_equal']}/{same['rows']} rows" + (
            "" if same["rows_equal"] == same["rows"] else
            f" (first differs at step {min(same['first_diff'])})")
        print(f"| {size} | {transformer.param_count(cfg) / 1e6:.1f}M | {batch} | {agree} | "
              f"{mine[0]:,.0f} [{mine[1]:,.0f}, {mine[2]:,.0f}] | "
              f"{theirs[0]:,.0f} [{theirs[1]:,.0f}, {theirs[2]:,.0f}] | "
              f"{mine[0] / theirs[0]:.2f}x | {t['jaxsys'].first_s:.1f} s | "
              f"{np.median(others):.0%} [{min(others):.0%}, {max(others):.0%}] |", flush=True)
        results.append({"size": size, "params": transformer.param_count(cfg), "batch": batch,
                        "same_tokens": same, "jaxsys_tokens_per_s": mine,
                        "transformers_tokens_per_s": theirs,
                        **{k: dataclasses.asdict(v) for k, v in t.items()}})
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"jax": jax.__version__, "transformers": transformers.__version__,
                 "torch": torch.__version__, "torch_threads": threads, "prompt_len":
                 _PROMPT_LEN.value, "new_tokens": new, "results": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
