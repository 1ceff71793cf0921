r"""jaxsys's KV-cache greedy decoding against transformers' `generate` on the same model and CPU.

  python -m experiments.bench_generate --out=/tmp/bench_generate.json
  python -m experiments.bench_generate --archs=qwen2,qwen3,llama3 --cores=1,all

For each architecture and size, transformers builds a model with random weights
(`hf_runs.randomize_torch_llama`) and writes it with `save_pretrained`; jaxsys imports those
files (`hf.load`), so both run the same float32 weights. Architectures (--archs): Llama;
Llama 3.x (Llama with Llama 3.2's `llama3` rope scaling); Qwen2 (q/k/v biases); Qwen3 (q/k
norms). For each batch, every row gets its
own random prompt of --prompt_len tokens (no padding) and --new_tokens greedy tokens are
generated with no EOS (neither model config has one, so no row stops early).

1. Same work: both frameworks' greedy tokens are compared, and where a row first differs
   the gap between its best two logits there (a near-tie of random weights, or a bug).
2. Time: one first call each (jaxsys's includes its compile), then --rounds interleaved
   rounds, the order alternating each round; tokens/s counts new tokens over the whole
   call (prefill included) and is reported as median [min, max]. Each timing records
   the load average and the share of the machine's CPU other processes used meanwhile.

--cores: the number of CPU cores each measurement runs on ('all': those this process may use).
The process is pinned to that many cores (`os.sched_setaffinity`, before jax starts its
XLA:CPU thread pool) and torch runs `torch.set_num_threads` of them, so both frameworks get the
same cores; with several values, each runs in a child process of its own (XLA:CPU's pool is
sized once a process), one after the other, and the parent gathers their results. Needs
torch and transformers (the `hf` extra).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
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

# name: transformers architecture, config fields beyond the size's
ARCHS = {
    "llama": ("Llama", dict(rope_theta=500_000.0)),
    "llama3": ("Llama", dict(rope_parameters=dict(  # Llama 3.2's scaling
        rope_type="llama3", rope_theta=500_000.0, factor=32.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131_072)),
    "qwen2": ("Qwen2", dict(rope_theta=1_000_000.0)),  # q/k/v biases by default
    "qwen3": ("Qwen3", dict(rope_theta=1_000_000.0)),  # q/k norms; head_dim set below
}

_SIZES = flags.DEFINE_list("sizes", ["tiny", "125m"], f"Model sizes, of {list(SIZES)}.")
_ARCHS = flags.DEFINE_list("archs", ["llama"], f"Architectures, of {list(ARCHS)}.")
_CORES = flags.DEFINE_list("cores", ["all"], "Core counts to measure on ('all': the cores this "
                           "process may use); several: one child process each.")
_BATCHES = flags.DEFINE_list("batches", ["1", "16"], "Batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Greedy tokens generated per row.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds per framework, interleaved.")
_DIR = flags.DEFINE_string("dir", None, "Where the checkpoints are written (default: a temp dir).")
_OUT = flags.DEFINE_string("out", None, "Also write the results as JSON here.")
_CHILD = flags.DEFINE_bool("child", False, "Set by the parent of --cores' children: no header.")


def import_hf():
  """(torch, transformers); ImportError when either is missing."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  return torch, transformers


def build(size: str, directory: str, seed: int = 0, arch: str = "llama"):
  """(transformers model, jaxsys config, jaxsys params) of one random model of `arch`
  (ARCHS) saved in `directory`."""
  _, transformers = import_hf()
  d, layers, heads, kv, ff, vocab = SIZES[size]
  name, extra = ARCHS[arch]
  extra = {**extra, **({"head_dim": d // heads} if name == "Qwen3" else {})}  # its default: 128
  # No BOS/EOS/pad ids: generate then never stops a row early (min_new_tokens would instead
  # mask the EOS logit, which changes the argmax jaxsys computes).
  config = getattr(transformers, f"{name}Config")(
      vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv, rms_norm_eps=1e-5,
      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
      **{"max_position_embeddings": 1024, **extra})
  model = getattr(transformers, f"{name}ForCausalLM")(config)
  model = hf_runs.randomize_torch_llama(model, seed=seed).eval()
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


def pin(cores: str) -> int:
  """Pins this process to the first `cores` ('all' or a count) of the cores it may use; how many."""
  allowed = sorted(os.sched_getaffinity(0))
  n = len(allowed) if cores == "all" else int(cores) if cores.isdigit() else 0
  if not 1 <= n <= len(allowed):
    raise ValueError(f"--cores={cores!r} is not a core count; use 'all' or an int in "
                     f"[1, {len(allowed)}] (the cores this process may use)")
  os.sched_setaffinity(0, allowed[:n])
  return n


def measure(arch: str, size: str, batch: int, built, cores: int) -> dict[str, Any]:
  """One row: the same-tokens check and the interleaved timings; prints the table row."""
  model, cfg, params = built
  new = _NEW.value
  p = prompts(batch, _PROMPT_LEN.value, cfg.vocab_size, seed=batch)
  same = same_tokens(model, cfg, params, p, new)
  t = timings(model, cfg, params, p, new, _ROUNDS.value)
  mine, theirs = (rate(batch * new, t[k].runs_s) for k in ("jaxsys", "transformers"))
  others = t["jaxsys"].others + t["transformers"].others
  loads = t["jaxsys"].loads + t["transformers"].loads
  agree = f"{same['rows_equal']}/{same['rows']} rows" + (
      "" if same["rows_equal"] == same["rows"] else
      f" (first differs at step {min(same['first_diff'])})")
  print(f"| {arch} | {size} | {transformer.param_count(cfg) / 1e6:.1f}M | {cores} | {batch} | "
        f"{agree} | {mine[0]:,.0f} [{mine[1]:,.0f}, {mine[2]:,.0f}] | "
        f"{theirs[0]:,.0f} [{theirs[1]:,.0f}, {theirs[2]:,.0f}] | "
        f"{mine[0] / theirs[0]:.2f}x | {t['jaxsys'].first_s:.1f} s | "
        f"{np.median(others):.0%} [{min(others):.0%}, {max(others):.0%}] | "
        f"{min(loads):.1f}-{max(loads):.1f} |", flush=True)
  return {"arch": arch, "size": size, "params": transformer.param_count(cfg), "cores": cores,
          "batch": batch, "same_tokens": same, "jaxsys_tokens_per_s": mine,
          "transformers_tokens_per_s": theirs,
          **{k: dataclasses.asdict(v) for k, v in t.items()}}


def _children(argv: list[str]) -> list[dict]:
  """Each --cores value measured by a child process of its own, one after the other."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  passed = [a for a in argv[1:] if not a.startswith(("--cores", "--out", "--child"))]
  runs = []
  for cores in _CORES.value:
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "out.json")
      subprocess.run([sys.executable, "-m", "experiments.bench_generate", *passed, "--child",
                      f"--cores={cores}", f"--out={out}"], cwd=root, check=True)
      with open(out) as f:
        runs.append(json.load(f))
  return [r for run in runs for r in run["results"]]


def main(argv):
  try:
    torch, transformers = import_hf()
  except ImportError:
    print(MISSING, file=sys.stderr)
    sys.exit(1)
  del argv
  for flag, known in ((_ARCHS, ARCHS), (_SIZES, SIZES)):
    if unknown := [v for v in flag.value if v not in known]:
      sys.exit(f"error: --{flag.name}={','.join(flag.value)}: {unknown} not known; choose "
               f"from {list(known)}")
  try:
    cores = pin(_CORES.value[0]) if len(_CORES.value) == 1 else None
  except ValueError as e:
    sys.exit(f"error: {e}")
  if not _CHILD.value:
    print(f"jax {jax.__version__}, transformers {transformers.__version__}, torch "
          f"{torch.__version__}; float32 on {jax.devices()[0].device_kind}; prompt "
          f"{_PROMPT_LEN.value} tokens, {_NEW.value} new tokens greedy, {_ROUNDS.value} rounds; "
          "each row's process pinned to its cores, torch threads = cores\n")
    print("| arch | size | params | cores | batch | same tokens | jaxsys tokens/s | "
          "transformers tokens/s | ratio | jaxsys first call | others' CPU share | load |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|", flush=True)
  if cores is None:
    results = _children(sys.argv)
  else:
    torch.set_num_threads(cores)
    results = []
    with tempfile.TemporaryDirectory(dir=_DIR.value) as tmp:
      for arch in _ARCHS.value:
        for size in _SIZES.value:
          built = build(size, os.path.join(tmp, f"{arch}_{size}"), arch=arch)
          for batch in map(int, _BATCHES.value):
            results.append(measure(arch, size, batch, built, cores))
          del built
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"jax": jax.__version__, "transformers": transformers.__version__,
                 "torch": torch.__version__, "prompt_len": _PROMPT_LEN.value,
                 "new_tokens": _NEW.value, "results": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
