"""The configs shipped with jaxsys (the repository's `configs/` is this directory).

A binary's `--config` takes a config file's path or one of these by name
(`--config=tiny_lm:size=small`), so an installed jaxsys runs from any directory.
"""
from __future__ import annotations

import pathlib

_HERE = pathlib.Path(__file__).parent


def names() -> list[str]:
  """The packaged configs' names: their files without `.py`."""
  return sorted(p.stem for p in _HERE.glob("*.py") if p.stem != "__init__")


def path(name: str) -> str | None:
  """The file of packaged config `name` (`tiny_lm` or `tiny_lm.py`), None if there is none."""
  stem = name[:-3] if name.endswith(".py") else name
  return str(_HERE / f"{stem}.py") if stem in names() else None
