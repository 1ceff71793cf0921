"""jaxsys.cli.args: a config file that does not parse, cannot be read or defines no
get_config, and an override before --config, each one `error:` line (SystemExit with it),
never a traceback (SyntaxError, PermissionError, ml_collections' FlagOrderError)."""
import os

import pytest

from jaxsys.cli import args


def _exit_line(fn, *a) -> str:
  with pytest.raises(SystemExit) as e:
    fn(*a)
  assert isinstance(e.value.code, str) and "\n" not in e.value.code
  return e.value.code


def test_an_override_before_config_is_one_line():
  argv = ["train", "--config.total_steps=3", "--config=configs/tiny_lm.py", "--workdir=/w"]
  assert _exit_line(args._check_order, argv) == (
      "error: --config.total_steps=3 comes before --config=configs/tiny_lm.py; overrides "
      "apply to the config that --config loads, so they must follow it: put --config=... first")
  args._check_order(["train", "--config=configs/tiny_lm.py", "--config.total_steps=3"])  # fine


@pytest.mark.parametrize("text, says", [
    ("def get_config(:\n  pass\n", "config.py line 1: "),
    ("x = 1\n", "config.py defines no get_config(); a config file must define get_config()"),
])
def test_a_config_file_that_does_not_load_is_one_line(tmp_path, text, says):
  path = tmp_path / "config.py"
  path.write_text(text)
  line = _exit_line(args._check_config_file, ["train", f"--config={path}"])
  assert line.startswith(f"error: --config={path}: {tmp_path}") and says in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file (the binary's "
                    "table, jaxsys/bench/bad_input.py, runs this case without root's powers)")
def test_an_unreadable_config_file_is_one_line(tmp_path):
  path = tmp_path / "config.py"
  path.write_text("def get_config():\n  return None\n")
  path.chmod(0)
  assert _exit_line(args._check_config_file, ["train", f"--config={path}"]) == (
      f"error: --config={path}: cannot read {path}: Permission denied; it must be a Python "
      "file this user can read that defines get_config()")
