"""What a user can leave in a workdir that no run could read, named in one line: a step's
file or directory that cannot be read, a FIFO or a directory where a file belongs, a
broken link or a file in checkpoints/ (integrity.problem, manager.check_entries)."""
import os
import subprocess
import sys
import textwrap

import pytest

from jaxsys.checkpoint import integrity
from jaxsys.checkpoint.manager import BadCheckpointDir, check_entries


def _step(tmp_path):
  """A sealed step directory of this version (its files, a record in meta, the manifest)."""
  step = tmp_path / "checkpoints" / "3"
  for rel, text in {"meta/metadata": f'{{"{integrity.RECORD}": {{"format": 1, "step": 3, '
                                      '"data": {"grain": {"next_index": 3}}}}',
                    "data/metadata": '{"grain": {"next_index": 3}}',
                    "state/_METADATA": "{}", "state/d/0123": "x" * 1000}.items():
    (step / rel).parent.mkdir(parents=True, exist_ok=True)
    (step / rel).write_text(text)
  integrity.seal(str(step))
  assert integrity.problem(str(step)) is None
  return step


def _problem_without_root_powers(step) -> str:
  """integrity.problem in a process that, even as root, cannot read a chmod 000 file."""
  prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"] if os.geteuid() == 0 else []
  code = textwrap.dedent("""
      import sys
      from jaxsys.checkpoint import integrity
      print(integrity.problem(sys.argv[1]))
  """)
  proc = subprocess.run([*prefix, sys.executable, "-c", code, str(step)], capture_output=True,
                        text=True, timeout=60,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert proc.returncode == 0, proc.stderr  # it was a PermissionError traceback from _crc32
  return proc.stdout.strip()


@pytest.mark.parametrize("rel", ["meta/metadata", "state/d/0123", integrity.MANIFEST])
def test_an_unreadable_file_is_named(tmp_path, rel):
  step = _step(tmp_path)
  (step / rel).chmod(0)
  assert _problem_without_root_powers(step) == f"{rel}: unreadable (Permission denied)"


def test_a_directory_that_cannot_be_listed_is_named(tmp_path):
  step = _step(tmp_path)
  (step / "state" / "d").chmod(0)
  try:
    assert _problem_without_root_powers(step) == "state/d: unreadable (Permission denied)"
  finally:
    (step / "state" / "d").chmod(0o755)


@pytest.mark.parametrize("rel", ["meta/metadata", integrity.MANIFEST])
def test_a_fifo_is_never_opened(tmp_path, rel):
  """Opening a FIFO for reading waits for a writer forever: a step holding one is named."""
  step = _step(tmp_path)
  (step / rel).unlink()
  os.mkfifo(step / rel)
  problem = integrity.problem(str(step))
  assert problem in (f"{rel}: not a regular file (a directory, FIFO or broken link)",
                     f"{rel}: unreadable (not a regular file)")


def test_a_directory_where_a_file_was_is_named(tmp_path):
  step = _step(tmp_path)
  (step / "meta" / "metadata").unlink()
  (step / "meta" / "metadata").mkdir()
  assert integrity.problem(str(step)) == (
      "meta/metadata: not a regular file (a directory, FIFO or broken link)")


@pytest.mark.parametrize("kind, says", [
    ("dangling", "is a symbolic link to '/nonexistent', which does not exist"),
    ("looping", "is a symbolic link to '10', which loops (too many levels of symbolic links)"),
    ("file", "is a file, not a directory"),
    ("link to a file", "which is not a directory"),
])
def test_a_step_entry_that_is_no_directory_is_refused(tmp_path, kind, says):
  """`ln -s /nonexistent checkpoints/10` let a run train to step 10, then fail the save
  with errno 20 naming nothing: refused before the run starts, naming the entry."""
  ckpt = tmp_path / "checkpoints"
  ckpt.mkdir()
  (ckpt / "4").mkdir()
  (ckpt / "notes.txt").write_text("a user's file, not a step")
  entry = ckpt / "10"
  if kind == "dangling":
    os.symlink("/nonexistent", entry)
  elif kind == "looping":
    os.symlink("10", entry)
  elif kind == "file":
    entry.write_text("x")
  else:
    os.symlink(ckpt / "notes.txt", entry)
  with pytest.raises(BadCheckpointDir) as e:
    check_entries(str(ckpt))
  assert str(e.value).startswith(f"{entry} {says}" if kind != "link to a file"
                                 else f"{entry} is a symbolic link to ")
  assert says in str(e.value) and "\n" not in str(e.value)
  assert os.path.lexists(entry)


def test_checkpoints_itself_must_be_a_directory(tmp_path):
  check_entries(str(tmp_path / "checkpoints"))  # absent: created by the first save
  os.symlink("/nonexistent", tmp_path / "checkpoints")
  with pytest.raises(BadCheckpointDir, match="checkpoints is a symbolic link to '/nonexistent', "
                     "which does not exist; it must be a directory"):
    check_entries(str(tmp_path / "checkpoints"))
