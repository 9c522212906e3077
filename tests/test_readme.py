"""README.md stays true: its Quick start runs verbatim in a fresh venv. The commands are read
from README.md itself, not copied. (The pages under docs/ are checked by test_docs.py.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def section(title_start: str) -> str:
    """The text of the README section whose ``## `` title starts with ``title_start``."""
    text = README.read_text()
    start = text.index(f"\n## {title_start}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def code_blocks(text: str, language: str = "bash") -> list[str]:
    return [m.group(1).strip() for m in re.finditer(rf"```{language}\n(.*?)```", text, re.S)]


def quick_start_commands() -> tuple[str, str]:
    """(set-up and demo, test set-up and tests): the two commands of the Quick start."""
    setup, tests = code_blocks(section("Quick start"))
    return setup, tests


def test_quick_start_has_a_setup_line_and_a_test_line() -> None:
    setup, tests = quick_start_commands()
    assert "\n" not in setup and "\n" not in tests
    assert "pip install -e ." in setup and "[test]" not in setup  # the demo needs no test tools
    assert setup.endswith("python examples/demo.py")
    assert 'pip install -e ".[test]"' in tests and tests.endswith("python -m pytest -q")
    ci = (REPO / ".ci" / "run").read_text()
    assert "python3 -m pytest -q\n" in ci and "python3 -m pytest -q -m slow\n" in ci


def _copy_of_the_working_tree(target: Path) -> None:
    """The files a user's clone would hold (tracked and new, not ignored: no build/)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_start_runs_verbatim_in_a_fresh_venv(tmp_path: Path) -> None:
    """The README's first command, as written, in a fresh venv with the pip it brings.

    It runs in a copy of the working tree with the venv's own interpreter first on PATH, so
    its editable install lives in the venv and points at the copy: the interpreter running
    this test is never touched. Builds the C++ extension: minutes, hence ``slow``.
    """
    setup, _ = quick_start_commands()
    clone, env_dir = tmp_path / "streamcache", tmp_path / "venv"
    _copy_of_the_working_tree(clone)
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    bundled_pip = subprocess.run([bin_dir / "pip", "--version"], capture_output=True, text=True,
                                 check=True).stdout.split()[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(env_dir),
               TMPDIR=str(tmp_path))
    before = _streamcache_location(sys.executable)

    result = subprocess.run(["bash", "-c", setup], cwd=clone, env=env, capture_output=True,
                            text=True, timeout=1700)

    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "exactly once" in result.stdout and "removed the temporary folder" in result.stdout
    assert subprocess.run([bin_dir / "pip", "--version"], capture_output=True, text=True,
                          check=True).stdout.split()[1] == bundled_pip  # pip was not upgraded
    assert _streamcache_location(str(bin_dir / "python")).startswith(str(clone))
    assert _streamcache_location(sys.executable) == before


def _streamcache_location(python: str) -> str:
    return subprocess.run([python, "-c", "import streamcache; print(streamcache.__file__)"],
                          capture_output=True, text=True, check=True, cwd="/").stdout.strip()
