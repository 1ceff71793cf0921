"""Every notebook in colab/ executes top to bottom without error."""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(ROOT)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
