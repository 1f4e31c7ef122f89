"""PyTorch kept out of the service's processes (``runtime.import_guard``): where it is
installed, transformers (which mlx-lm imports) would import it, seconds of start-up for nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the worker and the scheduler import that pulls in transformers, and a tokenizer class.
IMPORTS = "import runtime.worker.loader, mlx_lm.utils; from transformers import PreTrainedTokenizerFast; print('ok')"


@pytest.fixture
def torch_that_fails(tmp_path: Path) -> dict[str, str]:
    """An environment with an installed-looking ``torch`` (version 2.11) whose import fails."""
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('torch was imported')\n")
    info = tmp_path / "torch-2.11.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    (info / "RECORD").write_text("")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def test_the_fake_torch_would_be_imported_without_the_guard(torch_that_fails) -> None:
    ran = _run(IMPORTS, torch_that_fails)
    assert ran.returncode != 0 and "torch was imported" in ran.stderr


def test_the_guard_keeps_torch_out_of_mlx_lm_and_transformers(torch_that_fails) -> None:
    code = ("from runtime.import_guard import keep_torch_out; assert keep_torch_out(); "
            "import importlib.util; assert importlib.util.find_spec('torch') is None; " + IMPORTS)
    ran = _run(code, torch_that_fails)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip().endswith("ok")
    assert "PyTorch was not found" not in ran.stderr + ran.stdout  # no advice about what we hid


def test_an_imported_torch_is_left_alone(monkeypatch) -> None:
    from runtime.import_guard import keep_torch_out

    sentinel = object()
    monkeypatch.setitem(sys.modules, "torch", sentinel)
    assert keep_torch_out() is False
    assert sys.modules["torch"] is sentinel


def test_the_worker_and_runtime_up_keep_torch_out() -> None:
    # Both entry points call the guard before their heavy imports.
    for path, before in (("runtime/worker/main.py", "signal.signal(signal.SIGINT"),
                         ("runtime/up.py", "from runtime.scheduler.server import Server")):
        text = (ROOT / path).read_text()
        assert "keep_torch_out()" in text and text.index("keep_torch_out()") < text.rindex(before), path
