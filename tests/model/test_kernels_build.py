"""How the C++ kernels get built: with the ninja installed beside pagedllm, whatever PATH finds first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedllm.model import kernels

# A module with no torch headers (so it compiles in a second), named as torch asks of an extension.
TINY_MODULE = """#include <Python.h>
#define CAT(a, b) a##b
#define NAME(a, b) CAT(a, b)
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny", NULL, -1, NULL};
PyMODINIT_FUNC NAME(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny); }
"""


def test_the_kernels_build_with_pagedllms_own_ninja(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch runs the first ninja on PATH. Where that is another one (the system's, where the venv is not activated)
    the build still runs pagedllm's: another version's build log made ninja rebuild every kernel (~2 min), and
    where PATH had none nothing was built. PATH is left as it was."""
    pytest.importorskip("ninja")
    other = tmp_path / "bin" / "ninja"
    other.parent.mkdir()
    other.write_text(f"#!/bin/sh\necho called >> {tmp_path / 'called'}\nexit 1\n")
    other.chmod(0o755)
    path = f"{other.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    monkeypatch.setenv("PATH", path)
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_MODULE)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(kernels, "_SOURCES", [source])
    monkeypatch.setattr(kernels, "_ext", None)
    monkeypatch.setattr(kernels, "_ext_error", None)
    assert kernels.load() is not None, kernels.build_error()
    assert not (tmp_path / "called").exists()
    assert os.environ["PATH"] == path
