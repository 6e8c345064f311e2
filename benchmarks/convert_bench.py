"""Conversion speed and memory at real size: ours against upstream's converter of record.

A random checkpoint with Qwen3.8-27B-DFlash2's shapes (authors' format, bf16, ~1.9 B params:
hidden 5120, 5 layers, ffn 17408, 32/8 heads of 128, vocab 248320, block 8, target layer ids
[5, 19, 33, 47, 61] of a 64-layer target, selector rank 256 / top-k 16, conv kernel 2 / group 16,
SWA 2048; the drafter has no embedding or LM head) is written once into
``<cache>/bench-qwen3.8-27b-dflash2/`` (``<cache>`` = ``$DFLASH2_GGUF_CACHE`` or
``~/.cache/dflash2-gguf``) and converted:

- by ours (``python -m convert hf-to-gguf``) to bf16, q8_0 and q4_k_m;
- by upstream's ``convert_hf_to_gguf.py`` (llama.cpp 0c1e570, see ``benchmarks/upstream.py``) to
  bf16 and q8_0. Upstream has no K-quants: ours' q4_k_m is set against upstream's q8_0, its
  closest (smallest) quantized outtype.

Each conversion runs in a fresh subprocess; wall time and peak RSS (``/usr/bin/time -v``, see
:func:`measure`) are printed with the ratios ours/upstream. bf16 and q8_0 outputs of both are then compared
tensor by tensor (names, types, bytes) unless ``--no-compare``.

Fake targets (neither converter reads the target's weights):
- upstream needs an HF folder (``--target-model-dir``): ``config.json`` claiming a
  ``Qwen3ForCausalLM`` with hidden 5120, 64 layers, vocab 248320, plus SmolLM2's tokenizer files
  (49152 tokens). Upstream's ``set_vocab`` takes the vocab size from the DRAFTER's config and pads
  the missing ids with ``[PAD{i}]`` tokens (type UNUSED), so a small real tokenizer is enough.
- ours needs a GGUF: ``general.architecture = qwen3``, ``qwen3.embedding_length = 5120``,
  ``qwen3.block_count = 64`` and no tensors, with the same tokenizer upstream derives (SmolLM2's
  tokens padded with ``[PAD{i}]`` to 248320, its 48900 merges, special ids, chat template).
  A real Qwen3.5 tokenizer has ~247k merges instead of 48900: tokenizer copying costs a bit more
  in real life.

Usage::

    python -m benchmarks.convert_bench            # all conversions (about 15-25 min on 2 cores)
    python -m benchmarks.convert_bench --only ours --outtypes bf16

Needs ~20 GB of free disk (checkpoint 3.9 GB, outputs deleted after each comparison; ours'
q4_k_m writes a ~7.7 GB F32 temp file) and ~12 GB RAM to write the checkpoint once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import upstream as up  # noqa: E402

#: Qwen3.8-27B-DFlash2's sizes (the config.json of incoai/Qwen3.8-27B-DFlash2), as make_dflash_checkpoint keywords.
SHAPES = dict(
    version=2, hidden_size=5120, intermediate_size=17408, num_layers=5, num_heads=32,
    num_kv_heads=8, head_dim=128, vocab_size=248320, target_layer_ids=(5, 19, 33, 47, 61),
    num_target_layers=64, block_size=8, mask_token_id=248070, dtype="bfloat16", shards=1,
    seed=0, conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
    config_overrides={"use_sliding_window": True, "sliding_window": 2048,
                      "layer_types": ["sliding_attention"] * 4 + ["full_attention"]},
)
TARGET_LAYERS = 64
OURS_OUTTYPES = ("bf16", "q8_0", "q4_k_m")
#: ours' outtype -> upstream's outtype it is compared with.
UPSTREAM_FOR = {"bf16": "bf16", "q8_0": "q8_0", "q4_k_m": "q8_0"}


def bench_dir() -> Path:
    """Cache folder of this benchmark's inputs."""
    return up.cache_dir() / "bench-qwen3.8-27b-dflash2"


def ensure_checkpoint() -> Path:
    """Write the synthetic drafter once (in a subprocess, ~12 GB peak) and return its folder."""
    path = bench_dir() / "drafter"
    marker = path / ".complete"
    if marker.is_file():
        return path
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); "
        "from checkpoints import make_dflash_checkpoint; "
        "kw = json.loads(sys.argv[3]); kw['target_layer_ids'] = tuple(kw['target_layer_ids']); "
        "make_dflash_checkpoint(sys.argv[2], **kw)"
    )
    t0 = time.time()
    subprocess.run([sys.executable, "-c", code, str(REPO / "tests"), str(path), json.dumps(SHAPES)],
                   check=True)
    marker.write_text(json.dumps(SHAPES) + "\n")
    print(f"wrote synthetic checkpoint {path} in {time.time() - t0:.0f}s", flush=True)
    return path


def ensure_targets() -> tuple[Path, Path]:
    """Return (fake target GGUF for ours, fake HF target folder for upstream), built once."""
    from dflash2_gguf import assets

    smol = assets.fetch("smollm2-135m-instruct-q4_1")
    hf_smol = up.hf_target_from_gguf(smol)
    hf = bench_dir() / "target-hf"
    if not (hf / "config.json").is_file():
        up.write_hf_target(hf, hf_smol, {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "hidden_size": SHAPES["hidden_size"], "num_hidden_layers": TARGET_LAYERS,
            "vocab_size": SHAPES["vocab_size"], "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        })
    gg = bench_dir() / "target.gguf"
    if not gg.is_file():
        _write_fake_target_gguf(smol, gg)
    return gg, hf


def _write_fake_target_gguf(smol: Path, out: Path) -> None:
    """A tensor-less ``qwen3`` GGUF with SmolLM2's tokenizer padded to the drafter's vocab."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(smol)
    f = r.fields

    def strs(name):
        return [bytes(f[name].parts[i]).decode("utf-8") for i in f[name].data]

    def scalar(name):
        return f[name].parts[f[name].data[0]][0]

    tokens = strs("tokenizer.ggml.tokens")
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    n = SHAPES["vocab_size"]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n)]
    types += [int(gguf.TokenType.UNUSED)] * (n - len(types))
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(tmp, "qwen3")
    w.add_type("model")
    w.add_name("fake Qwen3.5-27B-like target (tokenizer only)")
    w.add_embedding_length(SHAPES["hidden_size"])
    w.add_block_count(TARGET_LAYERS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(bytes(f["tokenizer.ggml.pre"].parts[f["tokenizer.ggml.pre"].data[0]]).decode())
    w.add_token_list(tokens)
    w.add_token_types(np.asarray(types, dtype=np.int32).tolist())
    w.add_token_merges(strs("tokenizer.ggml.merges"))
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("unknown", w.add_unk_token_id), ("padding", w.add_pad_token_id)):
        if f"tokenizer.ggml.{key}_token_id" in f:
            add(int(scalar(f"tokenizer.ggml.{key}_token_id")))
    w.add_add_bos_token(bool(scalar("tokenizer.ggml.add_bos_token")))
    w.add_chat_template(bytes(f["tokenizer.chat_template"].parts[f["tokenizer.chat_template"].data[0]]).decode())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)


def measure(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> dict:
    """Run ``cmd`` in a fresh subprocess; return wall seconds, peak RSS (GiB), user/sys seconds.

    The command runs under ``/usr/bin/time -v`` when it exists, and peak RSS is the "Maximum
    resident set size" it reports. Not ``os.wait4`` / ``RUSAGE_CHILDREN`` of this process: Linux
    carries the forking process's RSS high-water mark into the child's ``ru_maxrss`` across
    ``exec``, so a child forked from a big benchmark process reports the parent's RSS (an early
    version of this script reported 8.3 GiB for a conversion that peaks at 1.2 GiB). Without
    ``/usr/bin/time`` it falls back to ``os.wait4`` and says so. Raises ``RuntimeError`` with
    the output tail if the command fails.
    """
    timer = Path("/usr/bin/time")
    full = [str(timer), "-v", *cmd] if timer.is_file() else cmd
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = b""
    # Drain the pipe (upstream prints progress bars) while waiting, then reap with wait4.
    assert proc.stdout is not None
    for chunk in iter(lambda: proc.stdout.read(1 << 16), b""):
        out = (out + chunk)[-20000:]
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"rc {proc.returncode}: {' '.join(cmd)}\n{text[-4000:]}")
    peak_kib, how = ru.ru_maxrss, "wait4 (may include this process's RSS)"
    if timer.is_file():
        for line in text.splitlines():
            if "Maximum resident set size (kbytes):" in line:
                peak_kib, how = int(line.rsplit(":", 1)[1]), "/usr/bin/time -v"
    return {"wall_s": wall, "peak_rss_gib": peak_kib / 2**20, "rss_source": how,
            "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "load_after": load}


def run_ours(src: Path, target: Path, outfile: Path, outtype: str) -> dict:
    """Time our converter's CLI on ``src`` (fresh subprocess)."""
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return measure([sys.executable, "-m", "convert", "hf-to-gguf", str(src), "--target", str(target),
                    "--outfile", str(outfile), "--outtype", outtype, "--force"], env=env, cwd=str(REPO))


def run_upstream(src: Path, target_dir: Path, outfile: Path, outtype: str) -> dict:
    """Time upstream's ``convert_hf_to_gguf.py`` on ``src`` (fresh subprocess)."""
    root = up.fetch_upstream()
    return measure([sys.executable, str(root / "convert_hf_to_gguf.py"), str(src),
                    "--target-model-dir", str(target_dir), "--outfile", str(outfile),
                    "--outtype", outtype], env=up.upstream_env(root), cwd=str(root))


def compare_tensors(a: Path, b: Path) -> str:
    """'identical' when both GGUFs hold the same tensors (names, types, shapes, bytes)."""
    import numpy as np
    from gguf import GGUFReader

    ra, rb = GGUFReader(a), GGUFReader(b)
    ta = {t.name: t for t in ra.tensors}
    tb = {t.name: t for t in rb.tensors}
    if set(ta) != set(tb):
        return f"names differ: only ours {sorted(set(ta) - set(tb))[:5]}, only upstream {sorted(set(tb) - set(ta))[:5]}"
    bad = [n for n, t in ta.items()
           if t.tensor_type != tb[n].tensor_type or list(t.shape) != list(tb[n].shape)
           or not np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(tb[n].data).view(np.uint8))]
    del ra, rb, ta, tb  # drop the memory maps before the next conversion
    return "identical" if not bad else f"{len(bad)} tensors differ, e.g. {bad[:5]}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table (and optionally JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("ours", "upstream"), default=None)
    ap.add_argument("--outtypes", nargs="+", default=list(OURS_OUTTYPES), choices=OURS_OUTTYPES)
    ap.add_argument("--no-compare", action="store_true", help="skip the tensor-by-tensor comparison")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--workdir", type=Path, default=None, help="where outputs go (default: cache)")
    args = ap.parse_args(argv)

    src = ensure_checkpoint()
    target_gguf, target_hf = ensure_targets()
    work = args.workdir or bench_dir() / "out"
    work.mkdir(parents=True, exist_ok=True)
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"input: {src} ({src_bytes / 2**30:.2f} GiB), {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} (other processes skew the times)", flush=True)

    results: dict[str, dict] = {}
    up_needed = sorted({UPSTREAM_FOR[o] for o in args.outtypes}, key=["bf16", "q8_0"].index)
    # Upstream first for each of its outtypes, then ours; keep an output only until compared.
    for ut in up_needed if args.only != "ours" else []:
        out = work / f"upstream-{ut}.gguf"
        print(f"upstream {ut} ...", flush=True)
        r = run_upstream(src, target_hf, out, ut)
        r["size_gib"] = out.stat().st_size / 2**30
        results[f"upstream/{ut}"] = r
        print(f"  {r['wall_s']:.1f}s  peak {r['peak_rss_gib']:.2f} GiB  ({r['size_gib']:.2f} GiB)"
              f"  load {r['load_after']:.1f}", flush=True)
    for ot in args.outtypes if args.only != "upstream" else []:
        out = work / f"ours-{ot}.gguf"
        print(f"ours {ot} ...", flush=True)
        r = run_ours(src, target_gguf, out, ot)
        r["size_gib"] = out.stat().st_size / 2**30
        ref = work / f"upstream-{UPSTREAM_FOR[ot]}.gguf"
        if not args.no_compare and UPSTREAM_FOR[ot] == ot and ref.is_file():
            r["vs_upstream"] = compare_tensors(out, ref)
        results[f"ours/{ot}"] = r
        print(f"  {r['wall_s']:.1f}s  peak {r['peak_rss_gib']:.2f} GiB  ({r['size_gib']:.2f} GiB)"
              f"  load {r['load_after']:.1f}"
              + (f"  tensors vs upstream: {r['vs_upstream']}" if "vs_upstream" in r else ""), flush=True)
        out.unlink()
    for p in work.glob("upstream-*.gguf"):
        p.unlink()

    print("\n| converter | outtype | wall s | peak RSS GiB | user s | size GiB | ours/upstream wall | ours/upstream RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        who, ot = name.split("/")
        ratio_w = ratio_m = ""
        ref = results.get(f"upstream/{UPSTREAM_FOR[ot]}") if who == "ours" else None
        if ref:
            note = "" if UPSTREAM_FOR[ot] == ot else f" (vs upstream {UPSTREAM_FOR[ot]})"
            ratio_w = f"{r['wall_s'] / ref['wall_s']:.2f}{note}"
            ratio_m = f"{r['peak_rss_gib'] / ref['peak_rss_gib']:.2f}{note}"
        print(f"| {who} | {ot} | {r['wall_s']:.1f} | {r['peak_rss_gib']:.2f} | {r['user_s']:.1f} | "
              f"{r['size_gib']:.2f} | {ratio_w} | {ratio_m} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
