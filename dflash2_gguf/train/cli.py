"""``python -m dflash2_gguf.train``: capture target features, then fit a DFlash 2 drafter.

Two steps, each resumable on its own::

    # 1. target-generated data: greedy responses to GSM8K-train prompts + hidden states
    #    (16 sequences per llama_decode, features captured in the same pass by the native engine)
    python -m dflash2_gguf.train capture --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts gsm8k-train --limit 2000 --max-new-tokens 256 --out feats/ \\
        --batch-size 16 --seqs-per-shard 128 --n-ctx 1024 --resume

    # 2. train (features must come from the same target layers: the layer ids are derived
    #    from --layers exactly as in step 1, or given with --target-layer-ids); on a GPU when
    #    torch sees one, bfloat16 autocast there (--device, --bf16 / --no-bf16)
    python -m dflash2_gguf.train fit --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --shards 'feats/*.safetensors' --out run1 --steps 20000

    # 3. GGUF: python -m convert hf-to-gguf run1/hf --target SmolLM2-135M-Instruct.Q4_1.gguf

    # held-out tau of any exported drafter, per family, over a T=0 decode's passes (bench's figure)
    python -m dflash2_gguf.train eval --target SmolLM2-135M-Instruct.Q4_1.gguf --drafter run1/hf \
        --shards 'held-out/*.safetensors'

``--prompts`` is ``mix`` (:mod:`dflash2_gguf.train.prompt_mix`, disjoint from every benchmark set),
a prompt set of :mod:`dflash2_gguf.bench.prompt_sets` (the one table ``bench`` uses:
gsm8k-train, gsm8k, math500, humaneval, mbpp, mt-bench; asset names such as gsm8k-test work too),
a ``.jsonl`` file (field turns / prompt / question / problem / text / instruction) or a text file
with one prompt per line; each picked row gives its first user turn, the authors' template applied
(GSM8K / MATH: "Please reason step by step, and put your final answer within \\boxed{}.").
"""

from __future__ import annotations

import argparse
import glob
import os
import json
import sys
from pathlib import Path

__all__ = ["main", "load_prompts", "load_prompt_families"]

_DEVICE_HELP = ("torch device: auto (default: cuda when torch sees a GPU, else cpu), cpu, cuda, "
                "cuda:N, mps")


def load_prompt_families(spec: str, limit: int | None = None, seed: int = 42, *, skip: int = 0,
                         until: int | None = None,
                         families: str | None = None) -> tuple[list[str], list[str] | None]:
    """:func:`load_prompts` and the prompt family of each prompt: the mix's (``math`` / ``code`` /
    ``chat``) for ``"mix"``, ``word-math`` for ``"word-math"`` (the word problems beside the mix,
    :func:`dflash2_gguf.train.prompt_mix.word_math_mix`), None for any other ``spec`` (one set:
    no families).

    For the mix only: ``skip`` drops the first ``skip`` prompts of the whole mix and ``until``
    every prompt from mix position ``until`` on (the stream is the mix's positions
    ``[skip, until)``), then ``families`` (comma-separated, e.g. ``"math,code"``) keeps those
    families, the mix's order kept; ``limit`` applies last (a count of the prompts kept, not a
    mix position). A capture that went through the first N prompts of the mix goes on with
    ``skip=N`` into another folder and never repeats one of them (nor any held-out prompt among
    them); ``until=M`` stops it where another stream (``skip=M``) begins.

    Raises:
        SystemExit: ``skip`` / ``until`` / ``families`` given for a spec other than ``"mix"``,
        ``until`` not past ``skip``, or an unknown family.
    """
    if spec == "mix":
        from .prompt_mix import FAMILIES, prompt_mix

        keep = [f.strip() for f in (families or "").split(",") if f.strip()] or list(FAMILIES)
        bad = [f for f in keep if f not in FAMILIES]
        if bad:  # before the mix is built: a typo fails at once
            raise SystemExit(f"--families: unknown family {bad[0]!r}: use some of {', '.join(FAMILIES)}")
        start = max(0, skip)
        if until is not None and until <= start:
            raise SystemExit(f"--until {until} must be past --skip {skip}: the stream is the mix's "
                             f"prompts [skip, until)")
        pairs = [(f, p) for f, p in prompt_mix(seed=seed)[start:until] if f in keep]
    elif skip or families or until is not None:
        raise SystemExit(f"--skip / --until / --families select from the mix: use --prompts mix "
                         f"(not {spec!r})")
    elif spec == "word-math":
        from .prompt_mix import word_math_mix

        pairs = word_math_mix(seed=seed)
    else:
        return load_prompts(spec, limit, seed), None
    pairs = pairs[:limit] if limit else pairs
    return [p for _, p in pairs], [f for f, _ in pairs]


def load_prompts(spec: str, limit: int | None = None, seed: int = 42) -> list[str]:
    """Training prompts: ``"mix"`` (:mod:`dflash2_gguf.train.prompt_mix`: prompt families disjoint
    from every benchmark set), ``"word-math"`` (the word problems beside it), or the first user
    turn of the rows of prompt set ``spec`` (a name of :data:`dflash2_gguf.bench.prompt_sets.DATASETS`,
    an asset name such as ``gsm8k-test``, a ``.jsonl`` file or a text file with one prompt per
    line), with the authors' templates, picked as the benchmark picks them
    (``random.Random(seed).shuffle``) and cut to ``limit`` (None or 0: all).

    Raises:
        SystemExit: an unknown set or a row without a prompt (the message names the sets).
    """
    from ..bench.prompt_sets import first_turns

    if spec in ("mix", "word-math"):
        return load_prompt_families(spec, limit, seed)[0]
    try:
        return first_turns(spec, limit or None, seed=seed)
    except ValueError as e:
        raise SystemExit(f"--prompts: {e}") from e


def _layer_ids(args, n_target_layers: int) -> list[int]:
    from .model import build_target_layer_ids

    if args.target_layer_ids:
        return [int(x) for x in args.target_layer_ids.split(",")]
    return build_target_layer_ids(n_target_layers, args.layers)


def _target_info(path: str):
    from gguf import GGUFReader

    from .target_weights import read_target_info

    return read_target_info(GGUFReader(path))


def cmd_capture(args) -> int:
    from .generate import generate_capture_shards

    info = _target_info(args.target)
    ids = _layer_ids(args, info.n_layers)
    prompts, families = load_prompt_families(args.prompts, args.limit, args.seed, skip=args.skip,
                                             until=args.until, families=args.families)
    out = Path(args.out)
    if args.force and not args.resume:
        for old in list(out.glob("shard-*.safetensors")) + list(out.glob("responses.jsonl")):
            old.unlink()
    elif out.exists() and any(out.glob("shard-*.safetensors")) and not args.resume:
        raise SystemExit(f"{out} already holds shards (use --resume to continue, --force to overwrite)")
    paths = generate_capture_shards(
        args.target, prompts, out, ids, max_new_tokens=args.max_new_tokens,
        seqs_per_shard=args.seqs_per_shard, n_parallel=args.batch_size, n_ctx_seq=args.n_ctx,
        n_threads=args.threads, n_gpu_layers=args.n_gpu_layers, capture=args.capture, families=families,
        responses=args.responses,
        source=f"prompts={args.prompts} skip={args.skip} until={args.until} families={args.families} "
               f"limit={args.limit} "
               f"seed={args.seed} greedy batched "
               f"({args.batch_size} parallel) max_new_tokens={args.max_new_tokens}")
    print(f"{len(paths)} shard(s) in {out} (target layers {ids})")
    return 0


def _device_arg(spec: str):
    """``--device`` as a ``torch.device`` (:func:`~dflash2_gguf.train.loop.resolve_device`);
    SystemExit naming what to give for a device torch does not see."""
    from .loop import resolve_device

    try:
        return resolve_device(spec)
    except ValueError as e:
        raise SystemExit(f"--device: {e}") from None


def cmd_fit(args) -> int:
    from .loop import TrainConfig, resolve_autocast, train
    from .model import DFlash2Config

    if not 0.0 <= args.walk_anchors <= 1.0:
        raise SystemExit(f"--walk-anchors {args.walk_anchors}: a share of the anchors, give a "
                         "number from 0 to 1")
    if not 0.0 <= args.feature_dropout < 1.0:
        raise SystemExit(f"--feature-dropout {args.feature_dropout}: a probability, give a number "
                         "from 0 (off) up to but not including 1")
    device = _device_arg(args.device)
    try:
        autocast = resolve_autocast(device, args.bf16)
    except ValueError as e:
        raise SystemExit(f"--bf16: {e}") from None
    info = _target_info(args.target)
    held = {str(Path(p).resolve()) for pat in args.eval_shards for p in glob.glob(pat)}
    shards = sorted(p for pat in args.shards for p in glob.glob(pat) if str(Path(p).resolve()) not in held)
    if not shards:
        raise SystemExit(f"no shard matches {args.shards}")
    cfg = DFlash2Config.for_target(info, num_hidden_layers=args.layers, block_size=args.block_size,
                                   target_layer_ids=_layer_ids(args, info.n_layers),
                                   mask_token_id=args.mask_token_id, selector_rank=args.selector_rank,
                                   selector_top_k=args.selector_top_k)
    model = None
    if args.init:
        model = _init_model(args.init, cfg)
    tcfg = TrainConfig(shards=shards, out_dir=args.out, target_gguf=args.target, steps=args.steps,
                       lr=args.lr, warmup_steps=args.warmup, weight_decay=args.weight_decay,
                       batch_size=args.batch_size,
                       max_len=args.max_len, anchors_per_seq=args.anchors, gamma=args.gamma,
                       save_every=args.save_every, device=str(device),
                       autocast_dtype=autocast, seed=args.seed,
                       eval_shards=sorted(p for pat in args.eval_shards for p in glob.glob(pat)),
                       eval_every=args.eval_every, vocab=args.vocab, threads=args.threads,
                       lr_total_steps=args.lr_total_steps, shard_globs=list(args.shards),
                       reload_every=args.reload_shards_every, walk_anchor_share=args.walk_anchors,
                       eval_walk_seqs=args.eval_walk_seqs, feature_dropout=args.feature_dropout)
    _, state = train(cfg, tcfg, model=model)
    last = next((h for h in reversed(state.history) if "loss" in h), {})
    tau = next((h for h in reversed(state.history) if "tau" in h), None)
    print(json.dumps({"step": state.step, "last": last, "eval": tau, "hf": str(Path(args.out) / "hf")}))
    return 0


def _init_model(folder: str, cfg):
    """The drafter of an authors'-format folder (``export``'s output, a shipped drafter) as the
    starting weights of a new run; its config must equal the one this command line builds, but
    for more ``--layers`` than the folder's: those are appended as identity layers
    (:func:`~dflash2_gguf.train.model.grow_layers`), so the run starts from the folder's drafter."""
    import dataclasses

    from .export import load_hf
    from .model import grow_layers

    if not (Path(folder) / "config.json").is_file():
        raise SystemExit(f"--init {folder}: no config.json there (give a folder that `export` wrote, "
                         "e.g. models/SmolLM2-135M-DFlash2)")
    model = load_hf(folder)
    n_have = model.config.num_hidden_layers
    if cfg.num_hidden_layers > n_have:
        try:
            model = grow_layers(model, cfg.num_hidden_layers)
        except ValueError as e:
            raise SystemExit(f"--init {folder}: {e}") from None
        print(f"--init {folder}: its {n_have} layers, then {cfg.num_hidden_layers - n_have} "
              "identity layer(s) appended (--layers)", file=sys.stderr)
    have, want = dataclasses.asdict(model.config), dataclasses.asdict(cfg)
    differ = [f"{k}: {have[k]!r} in {folder}, {want[k]!r} here" for k in want if have.get(k) != want[k]]
    if differ:
        raise SystemExit("--init: the checkpoint's shape differs from this run's (" + "; ".join(differ) +
                         "): give the matching --layers / --target-layer-ids / --block-size / "
                         "--selector-rank / --selector-top-k")
    return model


def cmd_eval(args) -> int:
    """Held-out acceptance of a drafter folder on feature shards, per prompt family: tau at
    uniform anchors (what ``fit`` logs) and over the passes of a T = 0 decode (what bench sees)."""
    import torch

    from .data import FeatureShards
    from .export import load_hf
    from .loop import TrainConfig, evaluate_tau, evaluate_walk
    from .target_weights import load_target_weights

    if not Path(args.target).is_file():
        raise SystemExit(f"--target {args.target}: no such file (give the target GGUF the drafter "
                         "was trained for)")
    if not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(f"--drafter {args.drafter}: no config.json there (give a folder that `export` "
                         "wrote, e.g. models/SmolLM2-135M-DFlash2)")
    paths = sorted(p for pat in args.shards for p in glob.glob(pat))
    if not paths:
        raise SystemExit(f"no shard matches {args.shards}")
    device = _device_arg(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_hf(args.drafter)
    data = FeatureShards(paths)
    if tuple(data.meta.target_layer_ids) != tuple(model.config.target_layer_ids):
        raise SystemExit(f"the shards hold target layers {data.meta.target_layer_ids}, the drafter "
                         f"reads {model.config.target_layer_ids}: capture shards for this drafter")
    emb, head = load_target_weights(args.target).torch()
    model.set_target_weights(emb, head)
    model.to(device).eval()
    tcfg = TrainConfig(shards=paths, out_dir="", batch_size=4, max_len=512, anchors_per_seq=16,
                       eval_batches=4, seed=args.seed)
    out = {"drafter": args.drafter, "shards": len(paths), "uniform": evaluate_tau(model, data, tcfg),
           "walk": {f or "all": evaluate_walk(model, data, args.max_seqs, f or None)
                    for f in ([""] + data.families)}}
    for f, w in out["walk"].items():
        uni = out["uniform"]["tau"] if f == "all" else out["uniform"].get("tau_by_family", {}).get(f)
        print(f"{f}: decode-walk tau {w['walk_tau']:.3f} (mean of {w['n_seqs']} sequences; pooled "
              f"{w['walk_tau_pooled']:.3f} over {w['n_passes']} passes); uniform-anchor tau {uni:.3f}",
              file=sys.stderr)
    print(json.dumps(out))
    return 0


def cmd_export(args) -> int:
    """A run folder's checkpoint.pt -> the authors' HF format (any step, training or not)."""
    import torch

    from .export import export_hf
    from .model import DFlash2Config, DFlash2Drafter

    state = torch.load(Path(args.run) / "checkpoint.pt", map_location="cpu", weights_only=False)
    model = DFlash2Drafter(DFlash2Config(**state["model_config"]))
    model.load_state_dict(state["model"])
    out = export_hf(model, args.out or Path(args.run) / "hf", dtype=args.dtype, force=True)
    hist = [h for h in state["history"] if "loss" in h]
    taus = [h for h in state["history"] if "tau" in h]
    print(json.dumps({"step": state["step"], "hf": str(out), "last": hist[-1] if hist else None,
                      "eval": taus[-1] if taus else None}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash2_gguf.train", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--target", required=True, help="target GGUF")
        sp.add_argument("--layers", type=int, default=5, help="drafter layers (default 5)")
        sp.add_argument("--target-layer-ids", default=None,
                        help="comma-separated HF layer ids (default: the authors' rule for --layers)")
        sp.add_argument("--seed", type=int, default=42)

    c = sub.add_parser("capture", help="generate with the target and store its hidden states")
    common(c)
    c.add_argument("--prompts", default="gsm8k-train",
                   help="mix (dflash2_gguf/train/prompt_mix.py: disjoint from every benchmark set), word-math (the "
                        "ASDiv / SVAMP / MAWPS word problems beside it), a prompt set name or a file")
    c.add_argument("--limit", type=int, default=None)
    c.add_argument("--skip", type=int, default=0,
                   help="--prompts mix: leave out the mix's first N prompts (those an earlier capture took)")
    c.add_argument("--until", type=int, default=None,
                   help="--prompts mix: stop before the mix's prompt N (where another capture's --skip N "
                        "begins); with --skip the capture takes the mix's prompts [skip, until)")
    c.add_argument("--families", default=None,
                   help="--prompts mix: only these families, comma-separated (math, code, chat), the mix's order")
    c.add_argument("--max-new-tokens", type=int, default=512)
    c.add_argument("--seqs-per-shard", type=int, default=1000)
    c.add_argument("--n-ctx", type=int, default=4096,
                   help="context per sequence (prompt + response must fit)")
    c.add_argument("--batch-size", type=int, default=16,
                   help="sequences decoded together per llama_decode (continuous batching)")
    c.add_argument("--capture", choices=["auto", "layer_inp", "cb_eval"], default="auto",
                   help="how the target features are read: llama.cpp's layer-input recording "
                        "(auto: where the architecture has it) or the cb_eval callback")
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--n-gpu-layers", type=int, default=0)
    c.add_argument("--out", required=True)
    c.add_argument("--force", action="store_true", help="delete existing shards first")
    c.add_argument("--responses", default=None,
                   help="a responses.jsonl[.gz] of an earlier capture (same --prompts/--seed): its answers "
                        "are teacher-forced (one prefill each) instead of generated again")
    c.add_argument("--resume", action="store_true",
                   help="keep existing shards, make the missing ones (same --prompts/--seed/--seqs-per-shard)")
    c.set_defaults(func=cmd_capture)

    f = sub.add_parser("fit", help="train a DFlash 2 drafter on feature shards")
    common(f)
    f.add_argument("--shards", nargs="+", required=True, help="shard files or globs")
    f.add_argument("--out", required=True, help="run folder (checkpoint.pt, hf/)")
    f.add_argument("--block-size", type=int, default=16)
    f.add_argument("--mask-token-id", type=int, default=None)
    f.add_argument("--selector-rank", type=int, default=256)
    f.add_argument("--selector-top-k", type=int, default=16)
    f.add_argument("--steps", type=int, default=10000)
    f.add_argument("--lr", type=float, default=6e-4)
    f.add_argument("--warmup", type=int, default=200)
    f.add_argument("--weight-decay", type=float, default=0.0,
                   help="AdamW weight decay on the drafter's matrices (norms, biases and the "
                        "frozen embedding / head get none)")
    f.add_argument("--batch-size", type=int, default=8)
    f.add_argument("--max-len", type=int, default=2048)
    f.add_argument("--anchors", type=int, default=64, help="anchors (blocks) per sequence")
    f.add_argument("--gamma", type=float, default=None)
    f.add_argument("--save-every", type=int, default=500)
    f.add_argument("--eval-shards", nargs="*", default=[],
                   help="held-out shards: greedy acceptance length (tau) is logged")
    f.add_argument("--eval-every", type=int, default=0, help="0: evaluate at the end only")
    f.add_argument("--vocab", choices=["full", "data"], default="full",
                   help="softmax over the full vocabulary (the authors' objective) or over the "
                        "token ids present in the shards (much cheaper output head on CPU)")
    f.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    f.add_argument("--reload-shards-every", type=int, default=0,
                   help="re-glob --shards every N steps (data capture still running); the "
                        "--eval-shards files are always left out of training")
    f.add_argument("--lr-total-steps", type=int, default=None,
                   help="steps of the cosine schedule (default --steps); lets --steps stop "
                        "earlier or later without changing the schedule")
    f.add_argument("--init", default=None, metavar="HF_FOLDER",
                   help="start from the weights of this authors'-format folder (export's output, e.g. "
                        "models/SmolLM2-135M-DFlash2) instead of random ones; fresh optimizer and "
                        "schedule; ignored when --out already holds checkpoint.pt (that resumes). "
                        "--layers above the folder's appends identity layers (the run starts from "
                        "exactly the folder's drafter)")
    f.add_argument("--walk-anchors", type=float, default=0.0, metavar="SHARE",
                   help="share (0-1) of each sequence's anchors moved one T=0 decode pass on "
                        "(a + tau(a) under the current weights): the anchors decoding visits "
                        "start after a rejected draft and are harder than uniform ones")
    f.add_argument("--eval-walk-seqs", type=int, default=0, metavar="N",
                   help="also log the decode-walk tau (what bench --temp 0 sees) of the first N "
                        "held-out sequences of each family at every evaluation")
    f.add_argument("--feature-dropout", type=float, default=0.0, metavar="P",
                   help="dropout probability on the fused target features (hidden_norm(fc(.))) "
                        "of the context rows while training; 0 (default): off")
    f.add_argument("--device", default="auto", help=_DEVICE_HELP)
    f.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast (weights, optimizer and checkpoints stay float32); "
                        "default: on for a CUDA device with bfloat16 (compute capability >= 8.0), "
                        "off elsewhere, the CPU included")
    f.set_defaults(func=cmd_fit)

    v = sub.add_parser("eval", help="held-out tau of a drafter folder, per family: uniform anchors "
                                    "and a T=0 decode's passes")
    v.add_argument("--target", required=True, help="target GGUF (the frozen embedding / head)")
    v.add_argument("--drafter", required=True, help="authors'-format folder (export's output)")
    v.add_argument("--shards", nargs="+", required=True, help="held-out shard files or globs")
    v.add_argument("--max-seqs", type=int, default=None,
                   help="decode-walk tau over the first N sequences of each family (default all)")
    v.add_argument("--seed", type=int, default=42,
                   help="seed of the uniform anchors (fit's default: the anchors its held-out "
                        "evaluations draw with --batch-size 4 --max-len 512 --anchors 16)")
    v.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    v.add_argument("--device", default="auto", help=_DEVICE_HELP + " (float32 throughout)")
    v.set_defaults(func=cmd_eval)

    e = sub.add_parser("export", help="checkpoint.pt of a run folder -> HF folder (authors' format)")
    e.add_argument("--run", required=True, help="run folder of `fit`")
    e.add_argument("--out", default=None, help="HF folder (default <run>/hf)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    e.set_defaults(func=cmd_export)
    return p


def main(argv=None) -> int:
    # OpenMP spin barriers: beside another busy process on 2 cores, a 1 ms decode took 250 ms; before libllama loads
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
