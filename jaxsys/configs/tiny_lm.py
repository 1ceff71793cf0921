"""A small decoder-only LM on the Python standard library's source, byte-level.

Run:
  python -m experiments.train --config=configs/tiny_lm.py --workdir=/tmp/jaxsys_tiny
  python -m experiments.train --config=configs/tiny_lm.py:size=small --workdir=/tmp/jaxsys_small
  python -m experiments.train --config=configs/tiny_lm.py --config.total_steps=30 --workdir=...

Sizes: `tiny` (default, about 8 minutes on a 2-core CPU), `small` (a longer CPU
or a short GPU run) and `test` (seconds; for the test suite).
"""
import ml_collections

from jaxsys import config as config_lib

SIZES = {
    #        d_model layers heads kv  d_ff  seq  batch steps
    "test": (64, 2, 4, 2, 128, 64, 16, 20),
    "tiny": (256, 4, 4, 2, 768, 256, 16, 300),
    "small": (512, 8, 8, 4, 1536, 512, 32, 2000),
}


def parse_args(arg: str | None, config: str, valid: tuple[str, ...]) -> dict[str, str]:
  """'size=small' or 'small' -> {'size': 'small'}; a name not in `valid` is refused."""
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.rpartition("=")
    out[key or "size"] = value
  unknown = set(out) - set(valid)
  if unknown:
    raise ValueError(f"configs/{config}.py: unknown argument(s) {sorted(unknown)}; valid: "
                     f"{', '.join(valid)}")
  return out


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = parse_args(arg, "tiny_lm", ("size",))
  size = args.get("size", "tiny")
  if size not in SIZES:
    raise ValueError(f"configs/tiny_lm.py: size={size!r} is unknown; valid: {sorted(SIZES)}")
  d_model, n_layers, n_heads, n_kv, d_ff, seq_len, batch, steps = SIZES[size]

  # Every field has its default, doc and rule in jaxsys/config.py (the model's in
  # jaxsys/models/transformer.py); a run is checked against them before it starts. This
  # file sets what differs for the size.
  c = config_lib.defaults()
  c.total_steps = steps
  c.log_every = max(1, steps // 30)
  c.eval_every = max(1, steps // 3)
  c.checkpoint_every = max(1, steps // 3)
  c.model.update(dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                      d_ff=d_ff))
  c.data.update(dict(seq_len=seq_len, batch_size=batch, max_len=4 * seq_len))
  # warmup_steps follows total_steps (5%, rounded up) unless set; it must not exceed the
  # schedule, so --config.total_steps=2 alone stays valid.
  c.optimizer.warmup_steps = (c.get_ref("total_steps") + 19) // 20
  return c
