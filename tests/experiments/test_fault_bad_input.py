"""Bad input a user can give the train binary (jaxsys/bench/bad_input.py's table, the
`experiments.fault_injection --bad_input` mode): one `error:` line each naming the path
or field, exit 1, no traceback, nothing of the workdir changed."""
import sys
import types

import pytest

import fork_server
from jaxsys.bench import bad_input

pytestmark = pytest.mark.slow  # starts processes


def test_every_bad_input_is_one_error_line(small_corpus, tmp_path, monkeypatch):
  """A run.lock that is a directory (fresh or old) or unreadable; a dangling or looping
  symlink in checkpoints/, or checkpoints/ a file; a checkpoint file unreadable or a
  directory; metrics.jsonl a directory; a config file that does not parse, cannot be read
  or defines no get_config; an override before --config (each a traceback, or a failure
  later that named nothing, before). The table's own runner and checks, each run of the
  binary forked from one start-up (tests/experiments/fork_server.py) instead of a process
  of its own: their CPU was nearly all start-up (~2.5 s each)."""
  with fork_server.Server(tmp_path / "forked") as server:
    # bad_input's subprocess.run([*setpriv, python, -m, experiments.train, ...]), forked
    def run(cmd, timeout=None, **unused_kwargs):
      setpriv = bad_input._unprivileged()  # pylint: disable=protected-access
      unprivileged = bool(setpriv) and cmd[:len(setpriv)] == setpriv
      cmd = cmd[len(setpriv):] if unprivileged else cmd
      assert cmd[:3] == [sys.executable, "-m", "experiments.train"], cmd
      return server.run(cmd[3:], timeout=timeout, unprivileged=unprivileged)
    monkeypatch.setattr(bad_input, "subprocess", types.SimpleNamespace(run=run))
    (tmp_path / "runs").mkdir()
    result = bad_input.run(str(tmp_path / "runs"), small_corpus)
  print(bad_input.summary(result))  # the table, with pytest -s
  assert result["problems"] == [], result["problems"]
  assert [r["case"] for r in result["rows"]] == list(bad_input.CASES)
  assert all(r["exit"] == 1 and r["line"].startswith("error: ") for r in result["rows"])
