"""Run every tutorial notebook top to bottom, in its short smoke mode, and fail with the failing cell's error.

The notebooks read ``SMOKE = "CI" in os.environ``; the kernel here is started with ``CI=1`` so each one runs in well
under a minute. The kernel is ipykernel on *this* interpreter (``sys.executable``), whatever kernelspecs are
installed, so the notebooks see the package and the dependencies under test. Needs ``nbclient``, ``nbformat`` and
``ipykernel`` (the ``test`` extra); without them the test fails with an ImportError instead of being skipped.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

TUTORIALS_DIR = Path(__file__).resolve().parents[1] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds per cell
_REQUIRED = ("nbclient", "nbformat", "ipykernel")


def _import_notebook_tools() -> None:
    missing = []
    for name in _REQUIRED:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(
            f"executing the tutorials needs {', '.join(_REQUIRED)}; missing from {sys.executable}: "
            f'{", ".join(missing)}. Install the test extra (pip install -e ".[test]") or pip install '
            + " ".join(_REQUIRED)
        )


def _run_notebook(path: Path) -> None:
    _import_notebook_tools()
    import nbformat
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    class CurrentPythonKernelManager(KernelManager):
        """An ipykernel on the interpreter running the tests, in the notebooks' smoke mode (``CI=1``)."""

        @property
        def kernel_spec(self) -> KernelSpec:
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                display_name=f"Python {sys.version_info.major} (tests)",
                language="python",
                env={"CI": "1"},
            )

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        kernel_manager_class=CurrentPythonKernelManager,
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute(env={**os.environ, "CI": "1"})
    except CellExecutionError as err:
        pytest.fail(f"{path.name} failed in smoke mode:\n{err}", pytrace=False)


def test_tutorials_exist() -> None:
    assert NOTEBOOKS, f"no notebooks found in {TUTORIALS_DIR}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_runs(path: Path) -> None:
    _run_notebook(path)
