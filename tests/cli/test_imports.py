"""Imports run one way: ``cli`` dispatches to the subcommands and nothing imports it back; the
shared flags (:mod:`dflash2_gguf.options`) and the prompt sets (:mod:`dflash2_gguf.bench.prompt_sets`)
are leaves; the package never reaches into the repository's ``benchmarks/`` or ``scripts/``
(a wheel has neither)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "dflash2_gguf"

#: The modules of the command layer, each imported first in its own interpreter.
MODULES = ["dflash2_gguf.cli", "dflash2_gguf.bench.cli", "dflash2_gguf.bench.run", "dflash2_gguf.bench.compare",
           "dflash2_gguf.bench.report", "dflash2_gguf.bench.stats", "dflash2_gguf.server.__main__",
           "dflash2_gguf.options", "dflash2_gguf.decoder.params", "dflash2_gguf.bench.prompt_sets", "dflash2_gguf.train.cli"]


def _python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned parsed."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", MODULES)
def test_any_module_imports_first(first):
    """No import cycle: each module imports cleanly as the first one, then all the others."""
    rest = [m for m in MODULES if m != first]
    got = _python(f"import importlib, json\nimportlib.import_module({first!r})\n"
                  f"for m in {rest!r}: importlib.import_module(m)\nprint(json.dumps('ok'))")
    assert got == "ok"


def test_leaves_and_subcommands_do_not_import_cli():
    """The leaves pull in only sampling/grammar when their helpers run; bench and serve build
    their parsers without importing ``dflash2_gguf.cli`` (nor anything native)."""
    got = _python(
        "import argparse, json, sys\n"
        "from dflash2_gguf import options\nfrom dflash2_gguf.bench import prompt_sets\n"
        "p = argparse.ArgumentParser(); options.add_model_args(p); options.add_sampling_args(p)\n"
        "a = p.parse_args(['-m', 't.gguf', '-md', 'd.gguf']); options.decoder_kwargs(a); options.sampling_from_args(a)\n"
        "leaf = sorted(m for m in sys.modules if m.startswith('dflash2_gguf'))\n"
        "from dflash2_gguf.bench import cli as bench\n"
        "from dflash2_gguf.server.__main__ import add_arguments\n"
        "bench.add_bench_args(argparse.ArgumentParser()); add_arguments(argparse.ArgumentParser())\n"
        "print(json.dumps(dict(leaf=leaf, after=sorted(m for m in sys.modules if m.startswith(('dflash2_gguf', "
        "'llama_cpp', 'benchmarks'))))))")
    assert set(got["leaf"]) <= {"dflash2_gguf", "dflash2_gguf.options", "dflash2_gguf.bench", "dflash2_gguf.bench.prompt_sets",
                                "dflash2_gguf.decoder", "dflash2_gguf.decoder.params", "dflash2_gguf.decoder.sampling",
                                "dflash2_gguf.chat", "dflash2_gguf.chat.grammar"}, got["leaf"]
    after = set(got["after"])
    assert "dflash2_gguf.cli" not in after, after
    assert not {m for m in after if m.startswith(("llama_cpp", "benchmarks", "dflash2_gguf._native"))}, after


def _imports(tree: ast.AST, module: str) -> list:
    """Every absolute module name ``module``'s source imports, function-local imports included."""
    pkg = module.rsplit(".", 1)[0]  # the package a relative import starts from (also for __init__)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append(name)
            out += [f"{name}.{a.name}" for a in node.names]  # "from . import cli"
    return out


def test_nothing_imports_cli_benchmarks_or_scripts():
    """Static check over every module of the package (function-local imports too): nothing
    imports ``dflash2_gguf.cli``; nothing imports ``benchmarks``/``scripts`` or edits sys.path."""
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts)
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
        for name in _imports(tree, module):
            top = name.split(".")[0]
            if module != "dflash2_gguf.cli" and (name == "dflash2_gguf.cli" or name.startswith("dflash2_gguf.cli.")):
                offenders.append(f"{module} imports {name}")
            if top in ("benchmarks", "scripts"):
                offenders.append(f"{module} imports {name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                offenders.append(f"{module} touches sys.path (line {node.lineno})")
    assert not offenders, offenders


def test_windows_adds_llama_cpp_lib_to_the_dll_search_path(tmp_path, monkeypatch):
    """Windows has no rpath: the loader adds llama-cpp-python's llama_cpp/lib to the DLL search
    path (once) before the extension is imported; on Linux and macOS it adds nothing."""
    import os
    import types

    from dflash2_gguf import _native_loader as loader

    (tmp_path / "llama_cpp" / "lib").mkdir(parents=True)
    fake = types.ModuleType("llama_cpp")
    fake.__file__ = str(tmp_path / "llama_cpp" / "__init__.py")
    added = []
    monkeypatch.setattr(os, "add_dll_directory", lambda p: added.append(p) or object(), raising=False)
    monkeypatch.setattr(loader, "_dll_dir", None)
    monkeypatch.setattr(loader.sys, "platform", "linux")
    loader._add_llama_dll_directory(fake)
    assert added == []
    monkeypatch.setattr(loader.sys, "platform", "win32")
    loader._add_llama_dll_directory(fake)
    loader._add_llama_dll_directory(fake)
    assert added == [str((tmp_path / "llama_cpp" / "lib").resolve())]
