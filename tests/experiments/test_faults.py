"""Faults a run must survive: SIGKILL at random points (saves included) and a full disk.

The kills come from experiments/fault_injection.py (real processes, real SIGKILL); the
full disk from the kernel: a file-size limit (RLIMIT_FSIZE: EFBIG, for any user), a tmpfs
too small for the next save (ENOSPC, root only), /dev/full (ENOSPC).
"""
import errno
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

import fork_server
from jaxsys import metrics, storage
from jaxsys.checkpoint import integrity, ledger

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """The train binary's runs in this module, each a child forked from one start-up of it
  (tests/experiments/fork_server.py: ~2.5 s of CPU less than a process each). JAXSYS_TEST_CPU
  counts its CPU, its runs' too, at the end of the module's last test, when it ends."""
  with fork_server.Server(tmp_path_factory.mktemp("forked")) as server:
    yield server


def _train(server, workdir, source, *flags, file_limit=None):
  """experiments.train on configs/tiny_lm.py:size=test; `file_limit` caps the size of each
  file it writes (bytes): writes past it fail with EFBIG, as on a full disk with ENOSPC."""
  return server.run(["--config=configs/tiny_lm.py:size=test", f"--config.data.source={source}",
                     "--config.data.num_threads=0", f"--workdir={workdir}",
                     "--config.eval_every=0", "--config.log_every=1", *flags],
                    file_limit=file_limit)


def _one_error_line(proc) -> str:
  """The binary's `error:` line: its last, the only one, with no traceback and a few
  error-level log lines at most (it was 620 lines with 38 tracebacks)."""
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
  assert [l for l in lines if l.startswith("error:")] == lines[-1:], proc.stderr[-5000:]
  assert len([l for l in lines if re.match(r"E\d{4} ", l)]) <= 8, proc.stderr[-5000:]
  return lines[-1]


def _disk_bytes(directory) -> int:
  """What the files under `directory` take on a tmpfs: whole 4 KiB pages."""
  return sum(-(-p.stat().st_size // 4096) * 4096 for p in pathlib.Path(directory).rglob("*")
             if p.is_file())


def _loss_steps(workdir):
  rows = (json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines())
  return [r["step"] for r in rows if "loss" in r]


def test_sigkill_at_random_points_resumes_from_committed_steps(small_corpus, tmp_path):
  """10 SIGKILLs (the binary's default is 20), most with a save in flight: each next run
  resumes from the newest committed step, which always verifies (never a half-written,
  unsealed or corrupt one), and the losses of the finished run equal an uninterrupted
  run's exactly."""
  report = tmp_path / "faults.json"
  t0 = time.monotonic()
  # 20 steps: the ten kills of seed 0 end by step 7-11 on the 2-core VM (each lands in the
  # save of a step 1-3 past the newest); the steps after them only lengthen both runs.
  proc = subprocess.run([sys.executable, "-m", "experiments.fault_injection",
                         f"--workdir={tmp_path / 'runs'}", "--crashes=10", "--total_steps=20",
                         f"--data_source={small_corpus}", f"--json={report}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  print(proc.stdout, f"\n{time.monotonic() - t0:.1f} s")  # the table, with pytest -s
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
  result = json.loads(report.read_text())
  crashes = result["crashes"]
  assert len(crashes) == 10 and result["problems"] == []
  in_flight = [c for c in crashes if c["left"].startswith("step ")]
  # The kills do land inside saves: at least the three planned as a save begins (the
  # others' share depends on how fast this machine saves).
  assert len(in_flight) >= 3, proc.stdout
  for c in crashes:  # the binary's own checks, again from its record
    # A step commits with its checksums: the newest verifies whenever the kill came.
    assert c["newest_problem"] is None, c
    # A next run that got to a save restored before it (one killed before writing anything
    # may not have got that far on a loaded machine).
    if c["next_run"] not in ("start-up", "nothing saved yet"):
      assert c["next_resumed"] == c["newest"], c
    assert not c["next_warned_unverified"], c
  # The losses, read here: every step once, each equal to the uninterrupted run's.
  crashed, reference = (pathlib.Path(result[k]) for k in ("crashed", "reference"))
  read = lambda w: [(r["step"], r["loss"]) for r in metrics.read_metrics(str(w)) if "loss" in r]
  assert read(crashed) == read(reference) and len(read(reference)) == 20
  ckpt = crashed / "checkpoints"
  assert not (crashed / "run.lock").exists()
  entries = ledger.read(str(ckpt))  # its chain verifies
  for step_dir in ckpt.iterdir():
    if step_dir.name == ledger.NAME:
      continue
    assert step_dir.name.isdigit(), step_dir  # no half-written save left at the end
    # Its checksums, and its manifest against the ledger (entered before each commit).
    assert ledger.problem(str(ckpt), int(step_dir.name), entries) is None, step_dir


def test_damaged_checkpoints_are_refused_on_real_runs(small_corpus, tmp_path):
  """--corruption, one trial of each kind: every damaged step 4 refused in one line, then
  resumed from step 3 with the undamaged run's losses (data flipped with the manifest
  recomputed too: by the ledger); the legacy step loaded with a warning; none loaded
  wrong."""
  t0 = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "experiments.fault_injection",
                         f"--workdir={tmp_path / 'runs'}", "--corruption", "--trials=1",
                         f"--data_source={small_corpus}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  print(proc.stdout, f"\n{time.monotonic() - t0:.1f} s")
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
  rows = {l[:40].strip(): l[40:].split() for l in proc.stdout.splitlines()[1:10]}
  assert len(rows) == 9 and "data flipped, manifest recomputed" in rows and rows.pop("legacy step (no manifest, no record)") == ["1", "0", "0",
                                                                                 "1", "0"]
  assert all(r == ["1", "1", "1", "0", "0"] for r in rows.values()), proc.stdout


@pytest.fixture(scope="module")
def two_checkpoints(server, small_corpus, tmp_path_factory):
  """A run of 4 steps with checkpoints at steps 2 and 4 (copied by each test that uses it)."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  proc = _train(server, workdir, small_corpus, "--config.total_steps=4",
                "--config.checkpoint_every=2", "--config.keep_checkpoints=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir


@pytest.mark.parametrize("disk", ["file-size limit", "small tmpfs"])
def test_a_save_on_a_full_disk_stops_in_one_line(server, two_checkpoints, small_corpus, tmp_path,
                                                  disk):
  """The save of step 6 finds the disk full: one `error:` line naming the step, the reason
  and the intact older steps; those verify, and the next run (with space) resumes from 4."""
  workdir = tmp_path / "run"
  step_bytes = _disk_bytes(two_checkpoints / "checkpoints" / "4")
  if disk == "small tmpfs":
    # Room for what is there and half a step more: the save of step 6 runs out of space.
    size_kb = (_disk_bytes(two_checkpoints) + step_bytes // 2) // 1024
    workdir.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs",
                            str(workdir)], capture_output=True, text=True)
    if mount.returncode:
      pytest.skip(f"cannot mount a tmpfs (root only): {mount.stderr.strip()}")
  try:
    shutil.copytree(two_checkpoints, workdir, dirs_exist_ok=True)
    flags = ("--config.total_steps=8", "--config.checkpoint_every=2",
             "--config.keep_checkpoints=2")
    # Files of a step are up to half its size: a limit of a tenth stops the first save.
    proc = _train(server, workdir, small_corpus, *flags,
                  file_limit=step_bytes // 10 if disk == "file-size limit" else None)
    reason = ("File too large (errno 27)" if disk == "file-size limit"
              else "No space left on device (errno 28)")
    assert _one_error_line(proc) == (
        f"error: saving checkpoint step 6 to {workdir / 'checkpoints'} failed: {reason}; "
        "older checkpoints are intact: steps [2, 4]")
    # max_to_keep=2 had dropped step 2 from orbax's list for step 6: it is still there.
    for step in (2, 4):
      assert integrity.problem(str(workdir / "checkpoints" / str(step))) is None
    if disk == "small tmpfs":
      return  # the resume, the same after either, is checked once (the limit needs no root)
    proc = _train(server, workdir, small_corpus, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {workdir / 'checkpoints'} at step 4" in proc.stderr
    assert _loss_steps(workdir) == list(range(1, 9))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["6", "8", ledger.NAME]
  finally:
    if disk == "small tmpfs":
      subprocess.run(["umount", "-l", str(workdir)], check=False)


@pytest.fixture(scope="module")
def disk_full_early(server, small_corpus, tmp_path_factory):
  """The two runs below that find the disk full before their first step is written, each
  with its own file-size limit: {name: (process with returncode and stderr, workdir)}."""
  root = tmp_path_factory.mktemp("disk_full_early")
  lock = json.dumps({"pid": 4194304, "host": socket.gethostname(), "started": time.time()})
  limits = {"start": 1, "first_row": len(lock) + 8}  # nothing; room for run.lock only
  for name in limits:
    (root / name).mkdir()
  return {name: (_train(server, root / name, small_corpus, "--config.total_steps=2",
                        file_limit=limit), root / name) for name, limit in limits.items()}


def test_a_full_disk_at_start_is_one_line_and_leaves_no_lock(disk_full_early):
  """Nothing can be written: the run.lock write fails in one line and leaves no empty
  lock behind, which would refuse every later run as "in use"."""
  proc, workdir = disk_full_early["start"]
  assert _one_error_line(proc) == (f"error: writing {workdir / 'run.lock'} failed: "
                                   "File too large (errno 27)")
  assert not (workdir / "run.lock").exists()


def test_a_full_disk_at_the_first_metrics_row_is_not_masked_by_close(disk_full_early):
  """Room for run.lock, not for a metrics row: the error that stops the run is the row's
  write, not the close of metrics.jsonl after it (which fails too, and is logged)."""
  proc, workdir = disk_full_early["first_row"]
  assert _one_error_line(proc) == (f"error: writing {workdir / 'metrics.jsonl'} failed: "
                                   "File too large (errno 27)")
  assert f"closing {workdir / 'metrics.jsonl'} failed" in proc.stderr
  assert not (workdir / "run.lock").exists()


def test_metric_writer_close_raises_only_when_nothing_else_is(tmp_path):
  """metrics.jsonl on a full device (/dev/full): in a `finally`, close's own failure (the
  unwritten row, flushed again) is logged and the write's error stays the one raised;
  called on its own, close raises it."""
  os.symlink("/dev/full", tmp_path / "metrics.jsonl")
  writer = metrics.MetricWriter(str(tmp_path), tensorboard=False)
  with pytest.raises(storage.WriteError, match=r"^writing .*metrics.jsonl failed: No space") as e:
    try:
      writer.write(1, {"loss": 1.0})
    finally:
      writer.close()
  assert e.value.errno == errno.ENOSPC
  writer = metrics.MetricWriter(str(tmp_path), tensorboard=False)
  with pytest.raises(storage.WriteError, match=r"^writing "):
    writer.write(1, {"loss": 1.0})
  with pytest.raises(storage.WriteError, match=r"^closing .*metrics.jsonl failed: No space"):
    writer.close()


def test_storage_errors_name_the_os_reason():
  """Tensorstore's errors carry the code in their text; Python's in errno."""
  ts = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/w/x\": Failed writing: "
                  "\"/w/x\": No space left on device [os_error_code='28']")
  assert storage.os_errno(ts) == errno.ENOSPC
  wrapped = RuntimeError("save failed")
  wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
  assert storage.os_errno(wrapped) == errno.EDQUOT
  assert storage.os_errno(ValueError("bad value")) is None
  error = storage.WriteError("saving checkpoint step 6 to /w", ts, after="older: [4]")
  assert str(error) == ("saving checkpoint step 6 to /w failed: No space left on device "
                        "(errno 28); older: [4]")
  assert isinstance(error, OSError) and error.errno == errno.ENOSPC
