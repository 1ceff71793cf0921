"""FLOP counting for MFU and the attention benchmarks: matmul FLOPs only.

Attention is counted per (query, key) pair that a head scores. Two conventions:
  full     every row's whole T x T square (PaLM's model FLOPs, Chowdhery et al. 2022,
           appendix B): what a dense kernel computes, masked or not.
  causal   only the pairs the mask lets attend: T(T+1)/2 per row, or the sum of
           T_i(T_i+1)/2 over the documents of packed rows. The useful work; a kernel
           that skips masked blocks does about this.
"""
from __future__ import annotations

import numpy as np

CONVENTIONS = ("full", "causal")


def attention_pairs(seq_len: int, batch: int = 1, *, convention: str = "causal",
                    segment_ids: np.ndarray | None = None) -> int:
  """(query, key) pairs of one head summed over `batch` rows of `seq_len` (see module doc).

  segment_ids [batch, seq_len] (packed documents) only change the causal count.
  """
  if convention not in CONVENTIONS:
    raise ValueError(f"convention={convention!r} is not known; choose one of {CONVENTIONS}")
  if convention == "full":
    return batch * seq_len * seq_len
  if segment_ids is None:
    return batch * seq_len * (seq_len + 1) // 2
  if np.shape(segment_ids) != (batch, seq_len):
    raise ValueError(f"segment_ids shape {np.shape(segment_ids)} must be (batch, seq_len) = "
                     f"{(batch, seq_len)}")
  seg = np.asarray(segment_ids)
  starts = np.ones(seg.shape, bool)  # every row starts a document; so does every change of id
  starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
  lengths = np.diff(np.append(np.flatnonzero(starts), seg.size)).astype(np.int64)
  return int(np.sum(lengths * (lengths + 1) // 2))


def attention_flops(pairs: float, heads: int, head_dim: int, pass_: str = "fwd") -> float:
  """Matmul FLOPs of attention over `pairs` per query head.

  Forward: 4 * head_dim a pair (2 for q.k, 2 for p.v). "fwd_bwd" is 3.5x that: the
  backward's five matmuls (recomputed scores, dv, dp, dq, dk) are 2.5x the forward's two,
  as FlashAttention-2 counts (a model's 6N rule would say 3x).
  """
  if pass_ not in ("fwd", "fwd_bwd"):
    raise ValueError(f"pass_={pass_!r} is not known; choose fwd or fwd_bwd")
  fwd = 4.0 * head_dim * heads * pairs
  return fwd if pass_ == "fwd" else 3.5 * fwd
