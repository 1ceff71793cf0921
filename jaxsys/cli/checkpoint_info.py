r"""What a run's checkpoints hold: each step, its layout, size and integrity.

  jaxsys-checkpoint-info --workdir=/tmp/jaxsys_tiny     # from any directory
  python -m experiments.checkpoint_info --workdir=/tmp/jaxsys_tiny

One line per step directory: "verified" when the checksums written with it list every file
and each matches (and its loader position is the one saved), then whether the ledger beside
the steps vouches for its manifest: "in ledger", "no ledger" (a run of a version before
it, or the ledger deleted), "not in ledger (saved before it)"; "legacy, unverified" for a
step saved before checksums; "CORRUPT: <file>: <what>" otherwise, e.g. "checksums.json
differs from the ledger: ..." for a step rewritten with its manifest
(`jaxsys/checkpoint/integrity.py`, `ledger.py`). A ledger whose chain does not verify is
named in one line above the steps, which then show their own checksums only. Its size, the model, and how its state is
laid out (one model, or replicas stacked on a leading axis, and the mesh it was saved
under). Steps moved aside as corrupt and saves that never committed are listed too.
Reads files only: no accelerator, nothing restored.
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from jaxsys.checkpoint import integrity, ledger
from jaxsys.checkpoint.reader import checkpoints_dir


def _size(path: str) -> int:
  return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(path) for n in ns)


def _layout(meta: dict) -> str:
  config, outer = meta.get("config") or {}, meta.get("outer")
  where = f"mesh {config.get('mesh', '?')}"
  if "layout" in meta:  # recorded by jaxsys.checkpoint.layouts.describe
    layout = meta["layout"]
    form, run = layout["form"], layout["run"]
    saved = (f"{form['replicas']} replicas stacked [replica, ...] (outer {form['outer']})"
             if form["replicas"] else "one model")
    pipe = run.get("pipeline")
    trained = (f", trained as {pipe['stages']} stages x {pipe['virtual']} ({pipe['schedule']}, "
               f"vocab {pipe['padded_vocab']}), saved canonical" if pipe else "")
    return f"{saved}, mesh {run['mesh']}{trained}; {len(layout['arrays'])} arrays described"
  if outer:
    return (f"{outer.get('replicas')} replicas stacked [replica, ...] "
            f"(outer {outer.get('name')}), {where}")
  schedule = (config.get("pipeline") or {}).get("schedule", "none")
  pipeline = f", pipeline {schedule} saved canonical [layers, ...]" if schedule != "none" else ""
  return f"one model, {where}{pipeline}"


def _model(meta: dict) -> str:
  m = meta.get("model") or {}
  return f"d_model {m.get('d_model')}, {m.get('n_layers')} layers, vocab {m.get('vocab_size')}"


def _status(directory: str, step: int, entries, broken: bool) -> str:
  """The step's integrity, and what the ledger says of it."""
  if broken:
    bad = integrity.problem(os.path.join(directory, str(step)))
    return ("verified, ledger broken" if bad is None else "legacy, unverified" if
            bad == integrity.LEGACY else f"CORRUPT: {bad}")
  bad = ledger.problem(directory, step, entries)
  return {None: "verified, in ledger", ledger.NO_LEDGER: "verified, no ledger",
          ledger.UNLEDGERED: "verified, not in ledger (saved before it)",
          integrity.LEGACY: "legacy, unverified"}.get(bad, f"CORRUPT: {bad}")


def describe(path: str) -> list[str]:
  """The report's lines for the run at `path` (its workdir or checkpoints dir)."""
  directory = checkpoints_dir(path)
  if not os.path.isdir(directory):
    raise ValueError(f"--workdir={path!r} holds no checkpoints directory")
  names = sorted(os.listdir(directory), key=lambda n: (not n.isdigit(), int(n) if n.isdigit()
                                                        else 0, n))
  lines = [f"{directory}:"]
  try:
    entries = ledger.read(directory)
    lines.append(f"  {ledger.NAME}: " + ("absent: steps verified by their own checksums only"
                                          if entries is None else
                                          f"{len(entries)} entries, chain verifies"))
    broken = False
  except ledger.CorruptLedger as e:
    entries, broken = None, True
    lines.append(f"  BROKEN LEDGER: {e}")
  for name in names:
    full = os.path.join(directory, name)
    if not os.path.isdir(full):
      continue
    size = f"{_size(full) / 2**20:9.1f} MiB"
    if not name.isdigit():
      kind = ("moved aside as corrupt" if name.endswith(".corrupt") else
              "a save that never committed" if ".orbax-checkpoint-tmp" in name else "not a step")
      lines.append(f"  {name:>10}  {size}  {kind}")
      continue
    status = _status(directory, int(name), entries, broken)
    try:
      with open(os.path.join(full, "meta", "metadata"), encoding="utf-8") as f:
        meta = json.load(f)
      about = f"{_model(meta)}; {_layout(meta)}"
    except (OSError, ValueError) as e:
      about = f"meta unreadable ({type(e).__name__})"
    lines.append(f"  step {name:>5}  {size}  {status}; {about}")
  if len(lines) == 2:
    lines.append("  (no checkpoints)")
  return lines


def main(argv):
  del argv
  try:
    print("\n".join(describe(flags.FLAGS.workdir)))
  except ValueError as e:
    sys.exit(f"error: {e}")


def run() -> None:
  """The binary. Its flag is defined only here: tests import describe() beside other
  binaries' flags."""
  flags.DEFINE_string("workdir", None, "A run's workdir or its checkpoints dir.")
  flags.mark_flags_as_required(["workdir"])
  app.run(main)


if __name__ == "__main__":
  run()
