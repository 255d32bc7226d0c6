"""The wheel a user installs: every module of the source tree, the ``py.typed`` marker
that lets type checkers read asyncgen's annotations, and nothing from tests/."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_every_module_and_the_typing_marker(tmp_path):
    # Built from a copy of the sources: an in-tree build would reuse what an earlier one
    # left in build/.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    shutil.copytree(ROOT / "asyncgen", src / "asyncgen", ignore=ignore)
    shutil.copytree(ROOT / "csrc", src / "csrc", ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        check=True, capture_output=True, timeout=600,
    )
    (wheel,) = tmp_path.glob("asyncgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "asyncgen").rglob("*.py")}
    assert len(sources) > 40 and sources <= names, sorted(sources - names)
    assert "asyncgen/py.typed" in names
    assert not [n for n in names if n.startswith("tests/")]
