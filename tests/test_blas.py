"""The worker's BLAS choice on Linux CPUs."""

from __future__ import annotations

import sys

import pytest

from runtime.scheduler import blas


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD of OpenBLAS is Linux-only")
def test_auto_preloads_openblas_when_installed(monkeypatch):
    monkeypatch.setattr(blas, "find_openblas", lambda: "/opt/libopenblas.so.0")
    env = blas.worker_env("auto", {"LD_PRELOAD": "/x/other.so"})
    assert env["LD_PRELOAD"] == "/opt/libopenblas.so.0:/x/other.so"
    assert int(env["OPENBLAS_NUM_THREADS"]) >= 1  # a core left to the scheduler
    assert blas.worker_env("auto", {"OPENBLAS_NUM_THREADS": "3"})["OPENBLAS_NUM_THREADS"] == "3"
    assert blas.worker_env("bundled", {}) == {}


def test_auto_without_openblas_changes_nothing(monkeypatch):
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    assert blas.worker_env("auto", {"A": "1"}) == {"A": "1"}
