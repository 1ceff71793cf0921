"""The binaries' `--config` flag parsed: a config file or a packaged config, one-line errors.

Every bad `--config` (a missing file, one that cannot be read or does not parse, an
argument its file refuses, an unknown `--config.` field, an unparsable value, an override
given before the file) ends the binary with one `error:` line.
"""
import importlib.util
import os
import re
import sys

from absl import flags

from jaxsys import configs
from jaxsys import preemption
from jaxsys.train import config_check


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing; a missing config file, a config argument its file refuses, an
  unknown `--config.` field or an unparsable value is one line."""
  preemption.pause_point("flags")
  _check_order(argv)
  _check_config_file(argv)
  try:
    return flags.FLAGS(argv)
  except flags.IllegalFlagValueError as e:  # e.g. --config.total_steps=abc
    sys.exit(f"error: {_illegal_value(e)}")
  except (AttributeError, KeyError):
    config = _load_config([a for a in argv if a.startswith("--config=")][-1][len("--config="):])
    for arg in (a for a in argv[1:] if a.startswith("--config.")):
      path = arg[len("--config."):].split("=", 1)[0].split(".")
      node = config
      for i, key in enumerate(path):
        if not hasattr(node, "keys") or key not in node:
          valid = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "none"
          sys.exit(f"error: {arg}: unknown config field {'.'.join(path)!r}; "
                   f"fields of {'.'.join(path[:i]) or 'config'}: {valid}")
        node = node[key]
    raise


def _check_order(argv: list[str]) -> None:
  """A `--config.` override applies to the config `--config=` loads: it must come after it
  (ml_collections' FlagOrderError, a traceback, otherwise)."""
  first = next((i for i, a in enumerate(argv) if i and a.startswith("--config=")), None)
  early = [a for i, a in enumerate(argv) if i and a.startswith("--config.")
           and (first is None or i < first)]
  if early and first is not None:
    sys.exit(f"error: {early[0]} comes before {argv[first]}; overrides apply to the config "
             f"that --config loads, so they must follow it: put --config=... first")


def _check_config_file(argv: list[str]) -> None:
  """`--config=path[:arg]` or `--config=name[:arg]` of a packaged config (rewritten in
  `argv` to its file): a missing file, or a ValueError of the file's own get_config (its
  refusal of `arg`), exits with one line instead of ml_collections' traceback."""
  at = [i for i, a in enumerate(argv) if i and a.startswith("--config=")]
  if not at:
    return
  spec = argv[at[-1]][len("--config="):]
  path, colon, arg = spec.partition(":")
  if not os.path.isfile(path):
    packaged = configs.path(path)
    if packaged is None:
      sys.exit(f"error: --config={spec}: no such file {path!r} and no packaged config of that "
               f"name; it must be a config file such as configs/tiny_lm.py or one of the "
               f"packaged configs: {', '.join(configs.names())} (e.g. tiny_lm:size=small)")
    spec = argv[at[-1]] = f"--config={packaged}{colon}{arg}"
    spec = spec[len("--config="):]
  try:
    _load_config(spec)
  except ValueError as e:
    sys.exit(f"error: --config={spec}: {e}")
  except SyntaxError as e:
    sys.exit(f"error: --config={spec}: {e.filename or path} line {e.lineno}: {e.msg}; it must "
             "be a Python file that defines get_config()")
  except OSError as e:
    sys.exit(f"error: --config={spec}: cannot read {path}: {e.strerror}; it must be a Python "
             "file this user can read that defines get_config()")
  except AttributeError as e:
    if "get_config" not in str(e):
      raise
    sys.exit(f"error: --config={spec}: {path} defines no get_config(); a config file must "
             "define get_config() returning an ml_collections ConfigDict")


def _illegal_value(error: Exception) -> str:
  """The config field's own one-line error for a value absl could not parse into its type."""
  match = re.match(r"flag --config\.([\w.]+)=(.*?): ", str(error))
  return (match and config_check.field_error(match[1], match[2])) or str(error)


def _load_config(spec: str):
  """`path/to/config.py[:arg]` -> get_config(arg), as config_flags loads it."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_config_module", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


