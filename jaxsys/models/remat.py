"""What a layer keeps for its backward: rematerialization policies by name, and host offload.

`block` tags the values a backward may want (`checkpoint_name`), and a policy names the
ones to keep; the rest are recomputed from the layer's input in the backward:

| policy  | kept for the backward | recomputed |
|---|---|---|
| none    | everything (no `jax.checkpoint`) | nothing |
| minimal | q, k, v, the attention's output and row statistics, the output projection, SwiGLU's gate and up | norms, RoPE, SiLU: no matmul, no attention forward |
| dots    | every matmul output without batch dims (the flash attention's output is not one) | the attention forward, elementwise ops |
| qkv     | q, k, v | the attention forward, every other matmul |
| full    | the layer's input | the whole layer |

`minimal` is MaxText's `minimal_with_context`, `qkv` its `save_qkv_proj`. Offload
(`remat_offload`, names from OFFLOADABLE) moves the named values to host memory
(`pinned_host`) in the forward and back in the backward instead of holding them in device
memory: MaxText's recipes offload the layer input and q, k, v to fit large models.
"""
from __future__ import annotations

from typing import Callable

import jax

# What `block` tags, in the order it computes them. The attention kernels tag their own
# residuals "attention" and "attention_stats" (kernels/attention_blocks.py, attention_xla.py).
LAYER_INPUT = "layer_input"
NAMES = (LAYER_INPUT, "q", "k", "v", "attention", "attention_stats", "attention_proj",
         "mlp_gate", "mlp_up")
OFFLOADABLE = NAMES

_KEPT = {
    "minimal": ("q", "k", "v", "attention", "attention_stats", "attention_proj", "mlp_gate",
                "mlp_up"),
    "qkv": ("q", "k", "v"),
    "full": (),
}
POLICIES = ("none", "full", "dots", "minimal", "qkv")


def parse_offload(spec: str) -> tuple[str, ...]:
  """'q,k,v' -> ('q', 'k', 'v'); '' -> ()."""
  return tuple(name.strip() for name in spec.split(",") if name.strip())


def check(remat: str, offload: str) -> None:
  """Refuses an unknown policy or offload name in one line naming the field."""
  if remat not in POLICIES:
    raise ValueError(f"model.remat={remat!r} is unknown; valid: {', '.join(POLICIES)}")
  unknown = [n for n in parse_offload(offload) if n not in OFFLOADABLE]
  if unknown:
    raise ValueError(f"model.remat_offload={offload!r}: {unknown[0]!r} is unknown; valid: '' or "
                     f"a comma-separated subset of {', '.join(OFFLOADABLE)}")
  if offload and remat in ("none", "dots"):
    raise ValueError(f"model.remat_offload={offload!r} needs a named policy "
                     f"(model.remat=full, minimal or qkv), not model.remat={remat!r}")


def policy(remat: str, offload: str = ""):
  """The `jax.checkpoint` policy of `remat` with `offload`'s names moved to host; None for
  "none" (no checkpoint at all)."""
  check(remat, offload)
  if remat == "none":
    return None
  if remat == "dots":
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  moved = parse_offload(offload)
  kept = tuple(n for n in _KEPT[remat] if n not in moved)
  if not moved:
    return (jax.checkpoint_policies.save_only_these_names(*kept) if kept
            else jax.checkpoint_policies.nothing_saveable)
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=list(kept), names_which_can_be_offloaded=list(moved),
      offload_src="device", offload_dst="pinned_host")


def checkpointed(layer: Callable, remat: str, offload: str = "") -> Callable:
  """`layer` under `remat`'s policy (unchanged for "none")."""
  chosen = policy(remat, offload)
  return layer if chosen is None else jax.checkpoint(layer, policy=chosen)
