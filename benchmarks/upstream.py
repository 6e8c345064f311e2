"""Upstream's converter of record, fetched once and run side by side with ours.

The reference for our GGUF output is ``convert_hf_to_gguf.py`` of llama.cpp at commit 0c1e570,
the copy that the llama-cpp-python 0.3.36 sdist vendors (``vendor/llama.cpp/``; the drafter is
``class DFlashModel`` in ``conversion/qwen.py``). This module:

- downloads that sdist with pip (``pip download --no-deps --no-binary llama-cpp-python``), checks
  its sha256 and extracts ONLY what the converter needs (``convert_hf_to_gguf.py``,
  ``conversion/``, ``gguf-py/``, ``models/templates/``, ``LICENSE``) into
  ``<cache>/upstream-0c1e570/`` (``<cache>`` = ``$DFLASH2_GGUF_CACHE`` or
  ``~/.cache/dflash2-gguf``);
- runs the converter in a subprocess whose ``PYTHONPATH`` is upstream's own ``gguf-py`` (PyPI
  ``gguf`` 0.19.0 lacks the dflash names; upstream's copy never lands on our import path);
- builds the Hugging Face target folder upstream insists on (``--target-model-dir``: it reads the
  target's ``config.json`` and tokenizer files, never its weights) offline from a target GGUF with
  transformers' GGUF loading, cached under ``<cache>/hf-target-<gguf name>/``.

Upstream's converter needs ``torch``, ``transformers``, ``numpy``, ``safetensors`` and
``sentencepiece`` (imported even when the target has no ``tokenizer.model``). Building the HF
target folder needs ``transformers`` and ``gguf`` (plus ``torch``).

Example::

    from benchmarks.upstream import fetch_upstream, hf_target_from_gguf, run_upstream_converter
    target = hf_target_from_gguf(smollm2_gguf_path)
    out = run_upstream_converter(drafter_dir, target, "/tmp/up.gguf", outtype="q8_0")
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from dflash2_gguf.assets import cache_dir, sha256_file  # one cache root, one hasher
from dflash2_gguf.bench.compare import UPSTREAM_COMMIT  # llama.cpp commit vendored by that release

__all__ = [
    "UPSTREAM_COMMIT", "UPSTREAM_OUTTYPES", "UpstreamUnavailable", "cache_dir", "fetch_upstream",
    "upstream_env", "run_upstream_converter", "hf_target_from_gguf", "write_hf_target",
]

#: llama-cpp-python release whose sdist vendors the reference llama.cpp.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: sha256 of ``llama_cpp_python-0.3.36.tar.gz`` as PyPI serves it.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: ``--outtype`` values upstream's converter accepts (besides ``tq1_0``/``tq2_0``/``auto``).
UPSTREAM_OUTTYPES = ("f32", "f16", "bf16", "q8_0")

_SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
_VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
# Paths under vendor/llama.cpp/ that the converter reads (files, or folders ending in "/").
_NEEDED = ("convert_hf_to_gguf.py", "LICENSE", "conversion/", "gguf-py/gguf/", "models/templates/")
_MARKER = ".complete"
_HF_MARKER = ".complete-hf-3"  # bumped when the HF target folder layout changes


class UpstreamUnavailable(RuntimeError):
    """Upstream's converter could not be obtained (registry unreachable, bad download)."""


def _download_sdist(dest: Path, quiet: bool) -> Path:
    """pip-download the sdist into ``dest``; returns its path. Raises UpstreamUnavailable."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "--no-binary", "llama-cpp-python", "-d", str(dest)]
    req = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    # pip prepares the sdist's metadata after downloading it. Without build isolation that takes
    # ~7 s when scikit-build-core is installed (it is: we build with it); with isolation pip first
    # installs the build backend (~30 s). Try the fast way first.
    attempts = [base + ["--no-build-isolation", req], base + [req]]
    errors = []
    for cmd in attempts:
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        path = dest / _SDIST
        if proc.returncode == 0 and path.is_file():
            if not quiet:
                print(f"[upstream] downloaded {_SDIST} in {time.time() - t0:.1f}s", file=sys.stderr)
            return path
        errors.append(f"$ {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    raise UpstreamUnavailable(
        f"could not download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (sdist) from the "
        "package registry:\n" + "\n".join(errors))


def fetch_upstream(*, quiet: bool = True, needed: tuple[str, ...] | None = _NEEDED,
                   root: Path | None = None) -> Path:
    """Return upstream's ``vendor/llama.cpp`` folder (converter only), fetching it once.

    The folder holds ``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/gguf/`` and
    ``models/templates/`` of llama.cpp 0c1e570, extracted from the pinned llama-cpp-python sdist.

    Args:
        quiet: Do not report the download on stderr.
        needed: Paths under ``vendor/llama.cpp/`` to extract (files, or folders ending in
            ``/``); None extracts the whole tree (the C++ sources, for building upstream's tools).
        root: Destination folder (default: ``<cache>/upstream-0c1e570``).

    Raises:
        UpstreamUnavailable: The sdist could not be downloaded or failed its sha256 check.
    """
    root = Path(root) if root is not None else cache_dir() / f"upstream-{UPSTREAM_COMMIT}"
    if (root / _MARKER).is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".upstream-") as tmp:
        tmp_path = Path(tmp)
        sdist = _download_sdist(tmp_path / "dl", quiet)
        digest = sha256_file(sdist)
        if digest != SDIST_SHA256:
            raise UpstreamUnavailable(f"{_SDIST}: sha256 {digest}, expected {SDIST_SHA256}")
        stage = tmp_path / "stage"
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                if not member.name.startswith(_VENDOR) or not (member.isfile() or member.isdir()):
                    continue
                rel = member.name[len(_VENDOR):]
                if needed is not None and not any(
                        rel == n or (n.endswith("/") and rel.startswith(n)) for n in needed):
                    continue
                if member.isdir():
                    continue
                out = stage / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None
                with open(out, "wb") as f:
                    shutil.copyfileobj(src, f)
        if not (stage / "convert_hf_to_gguf.py").is_file():
            raise UpstreamUnavailable(f"{_SDIST} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        (stage / _MARKER).write_text(f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist "
                                     f"{SDIST_SHA256}\n")
        if root.exists():  # a partial folder from an interrupted run
            shutil.rmtree(root)
        os.replace(stage, root)
    return root


def upstream_env(upstream: Path | None = None) -> dict[str, str]:
    """Environment for a subprocess running upstream's converter.

    ``PYTHONPATH`` is upstream's ``gguf-py`` only, so its ``gguf`` (with the dflash names) shadows
    PyPI's and nothing of ours is importable; ``NO_LOCAL_GGUF`` is removed.
    """
    upstream = upstream or fetch_upstream()
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = str(upstream / "gguf-py")
    env.setdefault("OMP_WAIT_POLICY", "passive")
    return env


def run_upstream_converter(src: str | Path, target_dir: str | Path, outfile: str | Path, *,
                           outtype: str = "f16", extra_args: tuple[str, ...] = (),
                           timeout: float | None = None, python: str | None = None) -> Path:
    """Convert the DFlash checkpoint ``src`` with upstream's ``convert_hf_to_gguf.py``.

    Args:
        src: The drafter's HF folder (authors' format).
        target_dir: HF folder of the target (``config.json`` + tokenizer files), passed as
            ``--target-model-dir``; see :func:`hf_target_from_gguf`.
        outfile: GGUF to write (overwritten).
        outtype: One of :data:`UPSTREAM_OUTTYPES` (upstream has no K-quants).
        extra_args: More command-line arguments for the converter.
        timeout: Seconds before the subprocess is killed.
        python: Interpreter to run it with (default: this one).

    Returns:
        ``Path(outfile)``.

    Raises:
        RuntimeError: The converter failed; the message carries the tail of its output.
    """
    upstream = fetch_upstream()
    cmd = [python or sys.executable, str(upstream / "convert_hf_to_gguf.py"), str(src),
           "--target-model-dir", str(target_dir), "--outfile", str(outfile),
           "--outtype", outtype, *extra_args]
    proc = subprocess.run(cmd, env=upstream_env(upstream), cwd=str(upstream), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0 or not Path(outfile).is_file():
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"upstream converter failed (rc {proc.returncode}):\n"
                           f"$ {' '.join(cmd)}\n{tail}")
    return Path(outfile)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                    "added_tokens.json", "generation_config.json")


def write_hf_target(dest: str | Path, tokenizer_from: str | Path, config: dict) -> Path:
    """Write an HF target folder: the tokenizer files of ``tokenizer_from`` + ``config``.

    Enough for upstream's ``--target-model-dir`` (it reads only ``config.json`` and the
    tokenizer). Returns ``Path(dest)``.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        f = Path(tokenizer_from) / name
        if f.is_file():
            shutil.copyfile(f, dest / name)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


# GGUF ``tokenizer.ggml.pre`` values -> the ``tokenizer.json`` pre-tokenizer (and normalizer) of
# the released tokenizers they come from, so upstream's fingerprint (``chkhsh``: the token ids of a
# probe text) of the rebuilt tokenizer names the same ``pre``.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    """(pre_tokenizer, normalizer or None) for a GGUF ``tokenizer.ggml.pre``; None if unknown."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    if pre in ("gpt2", "gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None
    if pre == "smollm":   # SmolLM / StarCoder: single digits, then GPT-2's byte-level regex
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), None
    if pre == "qwen2":    # Qwen2 / 2.5 / 3: one split regex, NFC, byte-level without regex
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC()
    return None


def _gguf_strings(field) -> list[str]:
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _write_bpe_tokenizer(reader, dest: Path) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` for a GGUF ``gpt2`` BPE tokenizer.

    Built with the ``tokenizers`` library straight from ``tokenizer.ggml.{tokens,token_type,
    merges}`` and the special token ids, so the result does not depend on the transformers
    version (transformers 5.15.0's GGUF loader turns SmolLM2's byte-level BPE into a
    byte-fallback model with the wrong eos; 5.24.0's is right).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    f = reader.fields
    tokens = _gguf_strings(f["tokenizer.ggml.tokens"])
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    merges = [tuple(m.split(" ", 1)) for m in _gguf_strings(f["tokenizer.ggml.merges"])]
    # UNUSED (5) ids are padding an older converter wrote up to config.vocab_size: the released
    # tokenizer does not define them
    bpe = models.BPE(vocab={t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty != 5}, merges=merges,
                     byte_fallback=False, fuse_unk=False)
    tok = Tokenizer(bpe)
    pre = bytes(f["tokenizer.ggml.pre"].parts[f["tokenizer.ggml.pre"].data[0]]).decode()
    tok.pre_tokenizer, norm = _pre_tokenizer(pre)
    if norm is not None:
        tok.normalizer = norm
    tok.decoder = decoders.ByteLevel()
    # CONTROL (3) tokens are special; USER_DEFINED (4) are added but not special.
    added = [AddedToken(t, special=(ty == 3), normalized=False)
             for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_tokens(added)
    tok.save(str(dest / "tokenizer.json"))

    def special(name: str) -> str | None:
        fld = f.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[int(fld.parts[fld.data[0]][0])] if fld is not None else None

    tcfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
                  "clean_up_tokenization_spaces": False}
    for name in ("add_bos_token", "add_eos_token"):  # only the flags the GGUF sets
        if (fld := f.get(f"tokenizer.ggml.{name}")) is not None:
            tcfg[name] = bool(fld.parts[fld.data[0]][0])
    for name, hf in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                     ("padding", "pad_token")):
        if (t := special(name)) is not None:
            tcfg[hf] = t
    if "tokenizer.chat_template" in f:
        fld = f["tokenizer.chat_template"]
        tcfg["chat_template"] = bytes(fld.parts[fld.data[0]]).decode("utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")


def hf_target_from_gguf(gguf_path: str | Path, dest: str | Path | None = None) -> Path:
    """Build (once) an HF target folder from a target GGUF, offline, and return it.

    The folder has what upstream's ``--target-model-dir`` reads and nothing else (no weights):

    - ``config.json`` from transformers' GGUF loading
      (``AutoConfig.from_pretrained(dir, gguf_file=...)``), without the GGUF's
      ``quantization_config`` and with ``architectures`` filled in (upstream picks the target's
      vocab handler by it);
    - the tokenizer: for GGUF ``gpt2`` BPE tokenizers whose pre-tokenizer :func:`_pre_tokenizer`
      knows (SmolLM2's ``smollm``, Qwen2.5's ``qwen2``), ``tokenizer.json`` built with ``tokenizers`` from the GGUF's own
      tokens and merges (see :func:`_write_bpe_tokenizer`); other tokenizers go through
      ``AutoTokenizer.from_pretrained(dir, gguf_file=...).save_pretrained`` (its output varies
      with the transformers version).

    Cached under ``<cache>/hf-target-<gguf stem>/`` unless ``dest`` is given.
    """
    gguf_path = Path(gguf_path)
    dest = Path(dest) if dest else cache_dir() / f"hf-target-{gguf_path.stem}"
    if (dest / _HF_MARKER).is_file():
        return dest
    from gguf import GGUFReader
    from transformers import AutoConfig

    reader = GGUFReader(gguf_path)

    def kv_str(name: str) -> str | None:
        fld = reader.fields.get(name)
        return bytes(fld.parts[fld.data[0]]).decode("utf-8") if fld is not None else None

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".hf-target-") as tmp:
        stage = Path(tmp) / "t"
        stage.mkdir()
        if kv_str("tokenizer.ggml.model") == "gpt2" and _pre_tokenizer(kv_str("tokenizer.ggml.pre")):
            _write_bpe_tokenizer(reader, stage)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            tok.save_pretrained(str(stage))
        cfg = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        if not getattr(cfg, "architectures", None):
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
        cfg.save_pretrained(str(stage))
        config = json.loads((stage / "config.json").read_text())
        config.pop("quantization_config", None)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (stage / _HF_MARKER).write_text(f"from {gguf_path.name}\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(stage, dest)
    return dest


if __name__ == "__main__":  # python -m benchmarks.upstream: fetch and print the folder
    print(fetch_upstream(quiet=False))
