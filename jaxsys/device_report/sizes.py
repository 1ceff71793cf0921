"""How big each part of the report is: on a GPU (`FULL`), and in the CPU smoke mode
(`SMOKE`: the same code at sizes an interpreter runs in seconds)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionCase:
  """One attention input: `docs` documents of random lengths a row (1: one causal document)."""
  batch: int
  seq_len: int
  heads: int
  kv_heads: int
  head_dim: int
  docs: int = 1

  @property
  def name(self) -> str:
    layout = "causal" if self.docs == 1 else f"packed {self.docs} docs"
    return (f"{layout}, B={self.batch} T={self.seq_len} H={self.heads}/{self.kv_heads} "
            f"D={self.head_dim}")


@dataclasses.dataclass(frozen=True)
class Sizes:
  name: str
  budget_s: float  # the whole report, compilation included
  caps_s: dict  # part -> the most seconds it may take
  min_s: dict  # part -> the budget left it needs to start (else it is skipped)
  repeats: int  # timed calls a case, after one warm-up
  max_call_s: float  # a case slower than this is not timed at the next larger size
  check_attention: tuple[AttentionCase, ...]
  check_qmatmul_ms: tuple[int, ...]
  check_qmatmul_kn: int
  matmul_n: int  # the square bf16 matmul whose speed MFU is also quoted against
  attention_seq_lens: tuple[int, ...]
  attention_tokens: int  # B * T of a timed attention case
  attention_heads: int
  attention_head_dim: int
  qmatmul_ms: tuple[int, ...]
  qmatmul_kn: int
  # (preset of configs/llama3.py, batch size); `model` overrides every preset's shape
  train_presets: tuple[tuple[str, int], ...]
  train_steps: int
  attention_impls: tuple[str, ...]  # the runner's own, `model.attention_impl`
  generate_preset: str
  generate_batches: tuple[int, ...]
  prompt_len: int
  new_tokens: int
  generate_schemes: tuple[str, ...]  # "float" or a quantization scheme
  model: tuple[tuple[str, object], ...] = ()
  seq_len: int = 0  # replaces each preset's sequence length when > 0


FULL = Sizes(
    name="full", budget_s=450.0,
    caps_s={"checks": 60, "matmul": 15, "attention": 110, "qmatmul": 45, "train": 150,
            "generate": 70},
    min_s={"checks": 10, "matmul": 3, "attention": 20, "qmatmul": 10, "train": 40,
           "generate": 20},
    repeats=5, max_call_s=2.0,
    check_attention=(AttentionCase(2, 1024, 4, 4, 64), AttentionCase(1, 2048, 8, 2, 128),
                     AttentionCase(2, 2048, 4, 2, 128, docs=4),
                     AttentionCase(1, 1536, 4, 1, 64, docs=3)),
    check_qmatmul_ms=(1, 16, 256), check_qmatmul_kn=2048, matmul_n=8192,
    attention_seq_lens=(1024, 2048, 4096, 8192, 16384, 32768), attention_tokens=32768,
    attention_heads=16, attention_head_dim=128,
    qmatmul_ms=(1, 16, 4096), qmatmul_kn=8192,
    train_presets=(("gpt2", 16), ("1b", 2)), train_steps=5, attention_impls=("pallas", "xla"),
    generate_preset="1b", generate_batches=(1, 32), prompt_len=128, new_tokens=128,
    generate_schemes=("float", "w8a8_int8", "w4a16"),
)

# Every part runs: the budget is the test's timeout, not a measurement's.
SMOKE = Sizes(
    name="smoke", budget_s=600.0,
    caps_s={"checks": 120, "matmul": 30, "attention": 120, "qmatmul": 60, "train": 180,
            "generate": 120},
    min_s={},
    repeats=2, max_call_s=30.0,
    check_attention=(AttentionCase(1, 64, 2, 2, 32), AttentionCase(1, 96, 4, 2, 64, docs=3)),
    check_qmatmul_ms=(1, 8), check_qmatmul_kn=256, matmul_n=256,
    attention_seq_lens=(64, 128), attention_tokens=128, attention_heads=2, attention_head_dim=32,
    qmatmul_ms=(1, 64), qmatmul_kn=256,
    train_presets=(("gpt2", 2), ("1b", 2)), train_steps=2, attention_impls=("pallas", "xla"),
    generate_preset="1b", generate_batches=(2,), prompt_len=8, new_tokens=4,
    generate_schemes=("float", "w8a8_int8", "w4a16"),
    model=(("vocab_size", 256), ("d_model", 128), ("n_layers", 2), ("n_heads", 4),
           ("n_kv_heads", 2), ("d_ff", 128)),
    seq_len=64,
)
