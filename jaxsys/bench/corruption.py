r"""Damaged checkpoints on real runs: the `--corruption` mode of experiments/fault_injection.py.

  python -m experiments.fault_injection --workdir=/tmp/jaxsys_corrupt --corruption --trials=2

Trains configs/tiny_lm.py:size=test to step 4 with a checkpoint every step (steps 2, 3,
4 kept), and once to step 6 without damage (the reference). Each trial of each kind
copies the 4-step run, damages its step 4 (seeded by --seed) and resumes it to step 6
with checkpoint.on_corrupt=error; when that is refused, once more with
on_corrupt=previous. A new kind is one row of KINDS. Counted per kind: refused (the one `error:` line naming step 4),
resumed from an earlier step (and every loss then equals the reference's), loaded with a
warning (a step of a version before checksums: nothing to verify it by), loaded wrong
(damaged step 4 taken as good, or a loss that differs from the reference's). "data
flipped, manifest recomputed" verifies by the step's own checksums: the ledger beside the
steps (jaxsys/checkpoint/ledger.py) refuses it.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil

from jaxsys.bench import faults  # no jax
from jaxsys.checkpoint import integrity, ledger  # files only: no jax

STEP, END = 4, 6  # the step damaged, the step the resumed runs end at
LEGACY_KIND = "legacy step (no manifest, no record)"


def _files(step_dir: str, arrays_only: bool = False) -> list[str]:
  files = integrity._files(step_dir)  # pylint: disable=protected-access
  return [f for f in files if f.startswith("state/") and "/d/" in f] if arrays_only else files


def _flip(step_dir: str, rel: str, rng: random.Random) -> str:
  path = os.path.join(step_dir, rel)
  data = bytearray(open(path, "rb").read())
  at = rng.randrange(len(data))
  data[at] ^= 1 << rng.randrange(8)
  with open(path, "wb") as f:
    f.write(bytes(data))
  return f"{rel} byte {at}"


def _edit_json(path: str, edit) -> None:
  with open(path, encoding="utf-8") as f:
    value = json.load(f)
  edit(value)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f)


def _manifest(step_dir: str, listed: dict) -> None:
  with open(os.path.join(step_dir, integrity.MANIFEST), "w", encoding="utf-8") as f:
    json.dump({"crc32": listed}, f)


def _listed(step_dir: str) -> dict:
  with open(os.path.join(step_dir, integrity.MANIFEST), encoding="utf-8") as f:
    return json.load(f)["crc32"]


def _position(step_dir: str, rng: random.Random, in_meta: bool) -> str:
  """next_index moved by a few batches in the data item (and meta's copy), then the
  manifest recomputed: a rewrite that keeps the checksums consistent."""
  moved = STEP + rng.choice([-3, -2, -1, 1, 2, 3])

  def move(position):
    position["grain"]["next_index"] = moved
  _edit_json(os.path.join(step_dir, "data", "metadata"), move)
  if in_meta:
    _edit_json(os.path.join(step_dir, "meta", "metadata"),
               lambda meta: move(meta[integrity.RECORD]["data"]))
  integrity.seal(step_dir)
  return f"next_index {STEP} -> {moved}"


def _unlisted(step_dir: str, rng: random.Random) -> str:
  listed = _listed(step_dir)
  rel = rng.choice(_files(step_dir, arrays_only=True))
  del listed[rel]
  _manifest(step_dir, listed)
  return f"no entry for {_flip(step_dir, rel, rng)}"


def _emptied(step_dir: str, rng: random.Random) -> str:
  flipped = _flip(step_dir, rng.choice(_files(step_dir, arrays_only=True)), rng)
  _manifest(step_dir, {})
  return f"manifest lists nothing; {flipped}"


def _legacy(step_dir: str, rng: random.Random) -> str:
  """As a version before checksums saved it: no manifest, no record, and no ledger (a
  ledger's entry for the step would tell the rewrite: test_ledger.py)."""
  del rng
  os.remove(os.path.join(step_dir, integrity.MANIFEST))
  _edit_json(os.path.join(step_dir, "meta", "metadata"), lambda m: m.pop(integrity.RECORD))
  os.remove(ledger.path(os.path.dirname(step_dir)))
  return "as saved before checksums"


def _resealed(step_dir: str, rng: random.Random) -> str:
  """A byte of the largest state `d/` file flipped, then the manifest recomputed over the
  files: the step vouches for itself; only the ledger outside it (integrity's) tells."""
  rel = max(_files(step_dir, arrays_only=True),
            key=lambda f: os.path.getsize(os.path.join(step_dir, f)))
  flipped = _flip(step_dir, rel, rng)
  integrity.seal(step_dir)
  return f"{flipped}, manifest recomputed"


def _deleted(step_dir: str, rng: random.Random) -> str:
  del rng
  os.remove(os.path.join(step_dir, integrity.MANIFEST))
  return "checksums.json deleted"


# kind -> damage(step_dir, rng) -> what it did
KINDS = {
    "flipped byte, state d/ file": lambda d, rng: _flip(d, rng.choice(_files(d, True)), rng),
    "flipped byte, any file": lambda d, rng: _flip(d, rng.choice(_files(d)), rng),
    'manifest {"crc32": {}} + flipped byte': _emptied,
    "manifest deleted": _deleted,
    "manifest lacks one entry (+ its byte)": _unlisted,
    "data flipped, manifest recomputed": _resealed,
    "position rewritten, manifest redone": lambda d, rng: _position(d, rng, in_meta=False),
    "position + meta copy rewritten, redone": lambda d, rng: _position(d, rng, in_meta=True),
    LEGACY_KIND: _legacy,
}


def _resumed(log: str) -> int | None:
  found = re.search(r"resumed from \S+ at step (\d+)", log)
  return int(found[1]) if found else None


def _trial(config, base: str, workdir: str, damage, rng: random.Random,
           reference: dict) -> dict:
  """One damaged copy of `base`, resumed (then with on_corrupt=previous if refused)."""
  shutil.copytree(base, workdir)
  logs = os.path.join(workdir, "logs")
  os.makedirs(logs)
  did = damage(os.path.join(workdir, "checkpoints", str(STEP)), rng)
  code = faults.run_to_end(config, workdir, os.path.join(logs, "error.log"))
  log = open(os.path.join(logs, "error.log"), encoding="utf-8").read()
  last = log.strip().splitlines()[-1] if log.strip() else ""
  refused = code != 0 and last.startswith(f"error: checkpoint step {STEP} in ") and (
      "is corrupt: " in last)
  out = {"did": did, "refused": refused, "error": last if refused else "",
         "loaded": _resumed(log), "warned": "restoring it unverified" in log, "earlier": None}
  if refused:
    config.checkpoint.on_corrupt = "previous"
    try:
      code = faults.run_to_end(config, workdir, os.path.join(logs, "previous.log"))
    finally:
      config.checkpoint.on_corrupt = "error"
    resumed = _resumed(open(os.path.join(logs, "previous.log"), encoding="utf-8").read())
    out["earlier"] = resumed if resumed is not None and resumed < STEP else None
  losses = dict(faults.logged_losses(workdir)) if code == 0 else {}
  out["losses_equal"] = losses == reference
  out["exit"] = code
  return out


def run(workdir: str, trials: int, seed: int, source: str) -> dict:
  """Every kind `trials` times (see the module docstring)."""
  config = faults.config_for(source, END)
  config.optimizer.schedule_steps = END  # the 4-step base run's schedule is the 6-step one's
  logs = os.path.join(workdir, "logs")
  os.makedirs(logs)
  reference = os.path.join(workdir, "reference")
  codes = [faults.run_to_end(config, reference, os.path.join(logs, "reference.log"))]
  base = os.path.join(workdir, "base")
  config.total_steps = STEP
  codes.append(faults.run_to_end(config, base, os.path.join(logs, "base.log")))
  config.total_steps = END
  if any(codes):
    return {"kinds": {}, "problems": [f"the undamaged runs exited {codes} (see {logs})"]}
  want = dict(faults.logged_losses(reference))
  rng, kinds, problems = random.Random(seed), {}, []
  for k, (kind, damage) in enumerate(KINDS.items()):
    kinds[kind] = [_trial(config, base, os.path.join(workdir, f"kind{k}_trial{t}"), damage,
                          rng, want) for t in range(trials)]
    for t, r in enumerate(kinds[kind]):
      ok = (r["loaded"] == STEP and r["warned"] and r["losses_equal"] if kind == LEGACY_KIND
            else r["refused"] and r["earlier"] is not None and r["losses_equal"])
      if not ok:
        problems.append(f"{kind}, trial {t} ({r['did']}): {r}")
  return {"kinds": kinds, "problems": problems}


def summary(result: dict) -> str:
  rows = [f"{'kind':<40} {'trials':>6} {'refused':>8} {'resumed earlier':>16} "
          f"{'loaded, warned':>15} {'loaded wrong':>13}"]
  examples = []
  for kind, trials in result["kinds"].items():
    wrong = sum((r["loaded"] == STEP and not r["warned"]) or not r["losses_equal"]
                for r in trials)
    rows.append(f"{kind:<40} {len(trials):>6} {sum(r['refused'] for r in trials):>8} "
                f"{sum(r['earlier'] is not None and r['losses_equal'] for r in trials):>16} "
                f"{sum(r['loaded'] == STEP and r['warned'] for r in trials):>15} {wrong:>13}")
    examples += [f"  {kind}: {r['did']}: {r['error']}" for r in trials[:1] if r["error"]]
  rows += ["the refusals (first trial of each kind):"] + examples
  rows += [f"FAIL: {p}" for p in result["problems"]] or [
      "OK: every damaged step refused, then resumed from step 3 with the reference's losses; "
      "the legacy step loaded with a warning"]
  return "\n".join(rows)
