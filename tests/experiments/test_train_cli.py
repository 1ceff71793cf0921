"""The absl binary end to end, as a user runs it: metrics, checkpoints, SIGTERM, bad input."""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import forked_cli
from jaxsys.checkpoint.manager import Checkpointer

pytestmark = pytest.mark.slow  # starts processes or trains end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cmd(workdir, source, *flags):
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny_lm.py:size=test",
          f"--config.data.source={source}", "--config.data.num_threads=0", f"--workdir={workdir}",
          *flags]


def _rows(workdir):
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


# A metrics row a step, a checkpoint every 2 steps, the last 3 kept.
_EVERY_TWO = ("--config.log_every=1", "--config.checkpoint_every=2", "--config.keep_checkpoints=3")


@pytest.fixture(scope="module")
def four_steps(small_corpus, tmp_path_factory):
  """(process, workdir) of one 4-step run: a metrics row a step, an eval at step 4,
  checkpoints at steps 2 and 4. test_a_corrupt_checkpoint_is_refused_or_skipped goes on
  from a copy (a process start fewer)."""
  workdir = tmp_path_factory.mktemp("four_steps")
  proc = subprocess.run(_cmd(workdir, small_corpus, "--config.total_steps=4",
                             "--config.eval_every=4", *_EVERY_TWO),
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc, workdir


def test_cli_trains_and_reports(four_steps):
  proc, workdir = four_steps
  assert f"metrics:     {workdir / 'metrics.jsonl'}" in proc.stdout
  rows = _rows(workdir)
  assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
  assert [r["step"] for r in rows if "val_bpb" in r] == [4]
  assert Checkpointer(str(workdir / "checkpoints")).all_steps() == [2, 4]
  assert "mesh: data=8" in proc.stderr  # logged devices and mesh


def test_sigterm_saves_and_exits_preempted(small_corpus, tmp_path):
  """SIGTERM: a checkpoint of the last step, its own message and exit status 75, never "done"."""
  proc = subprocess.Popen(_cmd(tmp_path, small_corpus, "--config.total_steps=100000",
                               "--config.log_every=1", "--config.eval_every=0",
                               "--config.checkpoint_every=100000"),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 240
  while not any(r.get("step", 0) >= 3 for r in _rows(tmp_path)):
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 75, stderr[-3000:]
  saved = Checkpointer(str(tmp_path / "checkpoints")).all_steps()
  assert len(saved) == 1 and saved[0] >= 3
  assert saved[0] == max(r["step"] for r in _rows(tmp_path))
  assert f"preempted at step {saved[0]} by SIGTERM" in stdout and "done" not in stdout


BAD_INPUT = [
    (["--config.no_such_field=1"], "unknown config field 'no_such_field'"),
    (["--config.mesh=data=3"], "mesh data=3 needs 3 devices but 8 are available"),
    (["--config.data.source=/no/such/dir"], "data.source='/no/such/dir'"),
    (["--config.total_steps=abc"], "total_steps='abc' is invalid; it must be an int >= 1"),
    (["--workdir="], "workdir='' is invalid; it must be a directory path"),
    (["--config.mesh=stage=2,data=-1"], "mesh axis stage=2 is invalid with "
     "pipeline.schedule='none'; it must be 1 without a pipeline"),
    (["--config.mesh=context=4,data=-1", "--config.data.seq_len=36"],
     "data.seq_len=36 is invalid with mesh axis context=4"),
    (["--config=configs/tiny_lm.py:size=huge"], "--config=configs/tiny_lm.py:size=huge: "
     "configs/tiny_lm.py: size='huge' is unknown; valid: ['small', 'test', 'tiny']"),
    (["--config=configs/nonexistent.py"], "--config=configs/nonexistent.py: no such file "
     "'configs/nonexistent.py' and no packaged config of that name; it must be a config file "
     "such as configs/tiny_lm.py or one of the packaged configs: compare_outer, llama3, qwen2, "
     "tiny_lm"),
    (["--config=tiny"], "--config=tiny: no such file 'tiny' and no packaged config"),
    (["--config.profile.steps=5,3"], "profile.steps='5,3' is invalid with total_steps=20; it "
     "must be 'N,M' with 1 <= N <= M <= total_steps"),
]


@pytest.fixture(scope="module")
def bad_input_runs(small_corpus, tmp_path_factory):
  """Each BAD_INPUT command line run once, all from one start-up of the binary
  (tests/experiments/forked_cli.py: a child forked per command line, ~2 s of CPU less
  each): {flags: (exit status, stderr as the user sees it, workdir)}."""
  root = tmp_path_factory.mktemp("bad_input")
  runs = forked_cli.run("experiments.train", [_cmd(root / f"run{i}", small_corpus, *flags)[3:]
                                              for i, (flags, _) in enumerate(BAD_INPUT)], root)
  return {tuple(flags): (code, err, root / f"run{i}")
          for i, ((flags, _), (code, _, err)) in enumerate(zip(BAD_INPUT, runs))}


@pytest.mark.parametrize("flags, message", BAD_INPUT)
def test_bad_input_gets_one_line_error(bad_input_runs, flags, message):
  returncode, stderr, workdir = bad_input_runs[tuple(flags)]
  assert returncode != 0
  last = stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last, stderr[-2000:]
  # The error is the only line besides absl log lines (e.g. jax's backend probe).
  assert [l for l in stderr.splitlines() if not re.match(r"[IWEF]\d{4} ", l)] == [last]
  assert not (workdir / "checkpoints").exists() or not os.listdir(workdir / "checkpoints")


def test_console_scripts_run_from_any_directory(small_corpus, tmp_path):
  """`jaxsys-train` with a packaged config by name, then `jaxsys-checkpoint-info` and
  `jaxsys-generate`, from an empty directory: nothing there to import from but the
  installed package."""
  scripts = [shutil.which(s) for s in ("jaxsys-train", "jaxsys-checkpoint-info",
                                       "jaxsys-generate")]
  assert all(scripts), "console scripts missing: pip install -e . first"
  empty, workdir = tmp_path / "empty", tmp_path / "run"
  empty.mkdir()
  train = subprocess.run(
      [scripts[0], "--config=tiny_lm:size=test", f"--config.data.source={small_corpus}",
       "--config.data.num_threads=0", "--config.total_steps=2", "--config.eval_every=0",
       f"--workdir={workdir}"], cwd=empty, capture_output=True, text=True, timeout=300)
  assert train.returncode == 0, train.stderr[-3000:]
  assert "done at step 2" in train.stdout
  info = subprocess.run([scripts[1], f"--workdir={workdir}"], cwd=empty, capture_output=True,
                        text=True, timeout=120)
  assert info.returncode == 0 and re.search(r"step\s+2 .* verified", info.stdout), info.stdout
  sample = subprocess.run([scripts[2], f"--workdir={workdir}", "--prompt=def ",
                           "--max_new_tokens=4"], cwd=empty, capture_output=True, text=True,
                          timeout=120)
  assert sample.returncode == 0 and "--- sample 0: 4 new tokens ---" in sample.stdout, (
      sample.stderr[-3000:])
  assert not os.listdir(empty)


def test_a_workdir_in_use_is_refused_and_partial_saves_removed(small_corpus, tmp_path):
  """A second run on a held workdir: one line naming the holder, nothing touched. Once the
  lock is free, a save that never committed is removed and the replayed rows moved aside."""
  from jaxsys.checkpoint import lock
  partial = tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp"  # as orbax 0.12 names it
  partial.mkdir(parents=True)
  (tmp_path / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
  flags = ["--config.total_steps=2", "--config.eval_every=0", "--config.log_every=1",
           "--config.checkpoint_every=0"]
  with lock.WorkdirLock(tmp_path):
    proc = subprocess.run(_cmd(tmp_path, small_corpus, *flags), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: workdir {tmp_path} is in use by pid {os.getpid()}"), \
      proc.stderr[-2000:]
  assert partial.exists() and _rows(tmp_path) == [{"step": 7, "loss": 1.0}]
  proc = subprocess.run(_cmd(tmp_path, small_corpus, *flags), cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not partial.exists() and "a save that never committed" in proc.stderr
  assert [r["step"] for r in _rows(tmp_path) if "loss" in r] == [1, 2]  # step 7 moved aside
  assert '"step": 7' in (tmp_path / "metrics.replayed.jsonl").read_text()
  assert not (tmp_path / lock.LOCK_NAME).exists()


def test_a_corrupt_checkpoint_is_refused_or_skipped(four_steps, small_corpus, tmp_path,
                                                   tmp_path_factory):
  """A flipped bit in the latest step's array data: one line naming the step, the file and
  the step that verifies; with on_corrupt=previous the run resumes from that step."""
  flags = ["--config.eval_every=0", *_EVERY_TWO]
  shutil.copytree(four_steps[1], tmp_path, dirs_exist_ok=True)  # steps 2 and 4 saved
  step_dir = tmp_path / "checkpoints" / "4"
  data = max((p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
             key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  data.write_bytes(bytes(raw))
  # Refused, then resumed with on_corrupt=previous: two command lines forked from one
  # start-up of the binary (tests/experiments/forked_cli.py), the second after the first.
  (code, _, err), (code_previous, _, err_previous) = forked_cli.run("experiments.train", [
      _cmd(tmp_path, small_corpus, "--config.total_steps=6", *flags)[3:],
      _cmd(tmp_path, small_corpus, "--config.total_steps=6",
           "--config.checkpoint.on_corrupt=previous", *flags)[3:]],
      tmp_path_factory.mktemp("corrupt"))
  assert code != 0
  last = err.strip().splitlines()[-1]
  rel = data.relative_to(step_dir)
  assert last == (f"error: checkpoint step 4 in {tmp_path / 'checkpoints'} is corrupt: {rel}: "
                  "checksum mismatch (the file changed after it was saved); step 2 verifies: "
                  "set --config.checkpoint.on_corrupt=previous to resume from it"), err[-2000:]
  assert code_previous == 0, err_previous[-3000:]
  assert "resuming from step 2, which verifies" in err_previous
  assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [2, 4, 6]
  assert (tmp_path / "checkpoints" / "4.corrupt").is_dir()
  assert [r["step"] for r in _rows(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]
  # experiments.checkpoint_info: every step verified, the corrupt one listed as moved aside.
  from experiments import checkpoint_info
  lines = checkpoint_info.describe(str(tmp_path))
  assert lines[0] == f"{tmp_path / 'checkpoints'}:"
  steps = [l for l in lines if l.lstrip().startswith("step")]
  assert [l.split()[1] for l in steps] == ["2", "4", "6"]
  assert all("verified, in ledger; d_model" in l and "one model, mesh data=-1" in l
             for l in steps)
  assert any("4.corrupt" in l and "moved aside as corrupt" in l for l in lines)
