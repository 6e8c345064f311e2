"""A small DFlash 2 training loop over feature shards.

AdamW, linear warmup then cosine decay to ``min_lr_ratio * lr``, gradient clipping, a tqdm bar
showing the loss and the per-block-position top-1 accuracy (running over the last ``log_every``
steps), checkpoint save/resume (``<out_dir>/checkpoint.pt``: model, optimizer, scheduler, step,
RNG states) and a final export in the authors' HF format (``<out_dir>/hf``).

Example::

    from dflash2_gguf.train.loop import TrainConfig, train
    from dflash2_gguf.train.model import DFlash2Config
    model = train(DFlash2Config(...), TrainConfig(shards=["feats/shard-00000.safetensors"],
                  target_gguf="SmolLM2-135M-Instruct.Q4_1.gguf", out_dir="run1", steps=20000))
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from .data import FeatureShards
from .export import export_hf
from .model import DFlash2Config, DFlash2Drafter
from .objective import dflash2_loss, greedy_acceptance, walk_acceptance, walk_step_anchors

__all__ = ["TrainConfig", "TrainState", "train", "lr_lambda", "evaluate_tau", "evaluate_walk",
           "resolve_device", "resolve_autocast"]


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch device a run trains (or evaluates) on.

    Args:
        spec: ``"auto"`` (``cuda`` when ``torch.cuda.is_available()``, else ``cpu``) or a torch
            device string: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` (case and surrounding
            blanks ignored).
    Returns:
        The ``torch.device``.
    Raises:
        ValueError: ``spec`` is not a device string torch parses, or names a device this torch
        does not see (a CPU build of torch, no GPU, an index past ``torch.cuda.device_count()``);
        the message names what to give instead.
    """
    name = str(spec).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {spec!r} is not a torch device; give auto, cpu, cuda, cuda:N "
                         "or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU build" if torch.version.cuda is None
                   else "torch sees no CUDA device")
            raise ValueError(f"device {spec!r}: {why} (torch {torch.__version__}); give cpu (or "
                             "auto), or install a CUDA build of torch")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"device {spec!r}: torch sees {n} CUDA device(s), give cuda:0 to "
                             f"cuda:{n - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {spec!r}: torch sees no MPS device; give cpu or auto")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {spec!r}: give cpu, cuda, cuda:N or mps (this package's training "
                         "runs on those)")
    return dev


def resolve_autocast(device: torch.device, bf16: bool | None = None) -> str | None:
    """The autocast dtype of a run on ``device``: ``"bfloat16"`` or None (float32 throughout).

    ``bf16`` None (the default): bfloat16 on a CUDA device that supports it
    (``torch.cuda.is_bf16_supported()``: compute capability 8.0 and newer), float32 elsewhere,
    the CPU included (the tested path; bfloat16 matmuls are slower than float32 ones on CPUs
    without AMX-BF16 / AVX512-BF16). True: bfloat16 on any device; False: float32. Parameters,
    optimizer moments and checkpoints stay float32 either way (autocast changes only the dtype
    the matmuls compute in), so a run can resume on another device or precision.

    Raises:
        ValueError: ``bf16`` True on a CUDA device without bfloat16 support.
    """
    if bf16 is None:
        return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{device}: this GPU has no bfloat16 support (compute capability below "
                         "8.0); train in float32 (no --bf16)")
    return "bfloat16" if bf16 else None


@dataclass
class TrainConfig:
    """Loop settings. ``shards``: feature shard files; ``target_gguf``: where the frozen
    embedding / head come from (or pass ``target_weights`` to :func:`train`)."""

    shards: Sequence[str]
    out_dir: str
    target_gguf: str | None = None
    steps: int = 1000
    lr: float = 6e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_size: int = 4
    max_len: int = 2048
    anchors_per_seq: int = 64
    gamma: float | None = None
    selector_weight: float = 1.0
    save_every: int = 500
    log_every: int = 20
    seed: int = 0
    device: str = "cpu"                 # or "auto", "cuda", "cuda:N" (resolve_device)
    autocast_dtype: str | None = None   # "bfloat16" (resolve_autocast); None = full float32
    export_dtype: str = "bfloat16"
    progress: bool = True
    stop_at: int | None = None          # stop early at this step (checkpoint saved, no export)
    eval_shards: Sequence[str] = ()     # held-out shards: greedy acceptance length (tau)
    eval_every: int = 0                 # 0: only at the end (when eval_shards are given)
    eval_batches: int = 4
    eval_walk_seqs: int = 0             # >0: also the decode-walk tau of N held-out sequences per family
    walk_anchor_share: float = 0.0      # share of anchors moved one decode pass on (walk_step_anchors)
    feature_dropout: float = 0.0        # dropout on the fused target features (training only)
    vocab: str = "full"                 # "data": softmax over the token ids present in the shards
    threads: int | None = None          # torch CPU threads (None: torch's default)
    lr_total_steps: int | None = None   # length of the cosine schedule (None: steps)
    shard_globs: Sequence[str] = ()     # with reload_every: re-glob these for new shards
    reload_every: int = 0               # steps between re-globs (0: never; data still growing)
    extra: dict = field(default_factory=dict)


@dataclass
class TrainState:
    """What :func:`train` reports: the last step and a log row per ``log_every`` steps."""

    step: int
    history: list[dict]


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier: ``(s+1)/warmup`` for ``s < warmup``, then cosine from 1 to ``min_ratio``."""

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / max(1, warmup)
        t = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


def _save(path: Path, model, opt, sched, step: int, gen: torch.Generator, history, mcfg, tcfg) -> None:
    tmp = path.with_name(path.name + ".tmp")
    device = next(model.parameters()).device
    extra = {"cuda_rng": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {}
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "step": step, "generator": gen.get_state(),
                "torch_rng": torch.get_rng_state(), "history": history,
                "model_config": asdict(mcfg), "train_config": asdict(tcfg), **extra}, tmp)
    os.replace(tmp, path)


def evaluate_tau(model: DFlash2Drafter, data: FeatureShards, cfg: TrainConfig) -> dict:
    """Mean greedy acceptance length (bonus included) and its histogram over ``eval_batches``
    batches of held-out data, with a fixed seed (comparable across steps).

    Returns:
        ``{"tau", "tau_hist", "n_anchors"}`` over batches drawn from every sequence, plus, when the
        shards record prompt families, ``"tau_by_family": {family: tau}`` from ``eval_batches``
        batches of that family's sequences alone (each with its own fixed seed).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    amp = getattr(torch, cfg.autocast_dtype) if cfg.autocast_dtype else None

    def taus(family: str | None, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(cfg.eval_batches):
            batch = data.sample_batch(cfg.batch_size, cfg.max_len, gen, family=family).to(device)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                out.append(greedy_acceptance(model, batch, cfg.anchors_per_seq, gen).cpu())
        return torch.cat(out)

    t = taus(None, cfg.seed + 1)
    by_family = {f: taus(f, cfg.seed + 2 + i) for i, f in enumerate(data.families)}
    model.train(was_training)
    bs = model.config.block_size

    def mean(x: torch.Tensor) -> float:
        return float(x.float().mean()) if len(x) else float("nan")

    ev = {"tau": mean(t), "tau_hist": torch.bincount(t, minlength=bs + 1)[1:].tolist(), "n_anchors": len(t)}
    if by_family:
        ev["tau_by_family"] = {f: mean(x) for f, x in by_family.items()}
    return ev


def evaluate_walk(model: DFlash2Drafter, data: FeatureShards, max_seqs: int | None = None,
                  family: str | None = None) -> dict:
    """Acceptance length of T = 0 decoding over held-out sequences (:func:`walk_acceptance`):
    what ``dflash2-gguf bench --temp 0 --spec-draft-adaptive off`` reports for the same answers.

    Takes the first ``max_seqs`` sequences (all when None) of ``family`` (every family when
    None), whole (no window). Returns ``{"walk_tau": mean over sequences of each one's passes'
    mean tau (bench's "mean per request"), "walk_tau_pooled": tokens / passes, "n_seqs",
    "n_passes"}`` (tau nan when no sequence has a full block of answer).
    """
    was_training = model.training
    model.eval()
    picks = [i for i, f in enumerate(data.family_of) if family is None or f == family]
    per_seq, passes = [], []
    for i in picks[:max_seqs]:
        si, start, n, plen = data.index[i]
        taus = walk_acceptance(model, data._tokens[si][start:start + n],
                               data._features[si][start:start + n].to(torch.float16), plen)
        if taus:
            per_seq.append(sum(taus) / len(taus))
            passes += taus
    model.train(was_training)
    nan = float("nan")
    return {"walk_tau": sum(per_seq) / len(per_seq) if per_seq else nan,
            "walk_tau_pooled": sum(passes) / len(passes) if passes else nan,
            "n_seqs": len(per_seq), "n_passes": len(passes)}


def train(model_cfg: DFlash2Config, cfg: TrainConfig, *,
          target_weights: tuple[torch.Tensor, torch.Tensor | None] | None = None,
          model: DFlash2Drafter | None = None) -> tuple[DFlash2Drafter, TrainState]:
    """Train (or resume) a drafter; returns it and the log.

    Resumes from ``<out_dir>/checkpoint.pt`` when present (same step, optimizer moments,
    scheduler and RNG), stops at ``cfg.steps`` (or early at ``cfg.stop_at``, without export),
    saves every ``save_every`` steps and at the end, then exports ``<out_dir>/hf`` in the authors' format.
    Trains on ``cfg.device`` (:func:`resolve_device`; ``"auto"`` takes a CUDA GPU when torch sees
    one) with ``cfg.autocast_dtype`` (:func:`resolve_autocast`); a checkpoint resumes on any
    device and in either precision.

    Raises:
        ValueError: a device torch does not see, an autocast dtype other than bfloat16, shards of
        other target layers or hidden size than ``model_cfg``'s, no target weights.
    """
    device = resolve_device(cfg.device)
    if cfg.autocast_dtype not in (None, "bfloat16"):
        raise ValueError(f"autocast_dtype {cfg.autocast_dtype!r}: give 'bfloat16' or None (float16 "
                         "autocast needs a gradient scaler, which this loop does not have)")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = FeatureShards(cfg.shards)
    if tuple(data.meta.target_layer_ids) != tuple(model_cfg.target_layer_ids):
        raise ValueError(f"shards hold target layers {data.meta.target_layer_ids}, the drafter "
                         f"expects {model_cfg.target_layer_ids}")
    if data.meta.hidden_size != model_cfg.hidden_size:
        raise ValueError("shard hidden_size differs from the drafter's")
    if target_weights is None:
        if cfg.target_gguf is None:
            raise ValueError("give target_gguf or target_weights")
        from .target_weights import load_target_weights

        target_weights = load_target_weights(cfg.target_gguf).torch()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.vocab not in ("full", "data"):
        raise ValueError("TrainConfig.vocab must be 'full' or 'data'")

    def data_vocab(d: FeatureShards):
        if cfg.vocab != "data":
            return None
        v = torch.unique(torch.cat([t.long() for t in d._tokens])).to(device)
        print(f"training on {len(d.paths)} shard(s), {len(d)} sequences, {d.n_tokens} tokens; "
              f"vocabulary: {len(v)} token ids present in the shards (of {model_cfg.vocab_size})",
              flush=True)
        return v

    vocab = data_vocab(data)
    torch.manual_seed(cfg.seed)
    model = model if model is not None else DFlash2Drafter(model_cfg)
    model.set_target_weights(target_weights[0], target_weights[1])
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps, cfg.lr_total_steps or cfg.steps,
                                                         cfg.min_lr_ratio))
    gen = torch.Generator().manual_seed(cfg.seed)
    step, history = 0, []
    ckpt = out / "checkpoint.pt"
    resumed_from = None  # the saved run's train_config
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        resumed_from = state.get("train_config", {})
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        opt.param_groups[0]["weight_decay"] = cfg.weight_decay   # this run's value, not the saved one
        sched.load_state_dict(state["scheduler"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and "cuda_rng" in state:  # dropout draws on the GPU
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        step, history = int(state["step"]), list(state["history"])

    amp = getattr(torch, cfg.autocast_dtype) if cfg.autocast_dtype else None
    bs = model_cfg.block_size
    win = {"loss": 0.0, "n": 0, "correct": torch.zeros(bs - 1), "sel": torch.zeros(bs - 1),
           "count": torch.zeros(bs - 1)}
    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="dflash2 train", dynamic_ncols=True)
        gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
        bar.write(f"training on {device}{gpu}, "
                  + ("bfloat16 autocast (float32 weights)" if amp is not None else "float32"))
        if resumed_from is not None:
            bar.write(f"resumed {ckpt} at step {step} (that run: device {resumed_from.get('device')}, "
                      f"autocast {resumed_from.get('autocast_dtype') or 'none, float32'})"
                      + (f"; already at --steps {cfg.steps}, nothing to train" if step >= cfg.steps else ""))
    eval_data = FeatureShards(cfg.eval_shards) if cfg.eval_shards else None

    def log_eval() -> None:
        ev = evaluate_tau(model, eval_data, cfg)
        if cfg.eval_walk_seqs:
            ev["walk_tau_by_family"] = {
                f or "all": evaluate_walk(model, eval_data, cfg.eval_walk_seqs, f or None)["walk_tau"]
                for f in (eval_data.families or [""])}
        history.append({"step": step, **ev})
        fam = "".join(f", {f} {x:.3f}" for f, x in ev.get("tau_by_family", {}).items())
        walk = "".join(f", {f} {x:.3f}" for f, x in ev.get("walk_tau_by_family", {}).items())
        if bar is not None:
            bar.write(f"step {step}: greedy tau {ev['tau']:.3f} over {ev['n_anchors']} anchors{fam}"
                      + (f"; decode-walk tau ({cfg.eval_walk_seqs} sequences each){walk}" if walk else ""))

    if eval_data is not None and cfg.eval_every and step == 0:
        log_eval()  # where the curve starts: random weights, or the drafter a run --init'ed from
    model.train()
    end = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    while step < end:
        if cfg.reload_every and cfg.shard_globs and step % cfg.reload_every == 0:
            import glob

            held = {str(Path(p).resolve()) for p in cfg.eval_shards}
            found = sorted(p for pat in cfg.shard_globs for p in glob.glob(pat)
                           if str(Path(p).resolve()) not in held)
            if len(found) > len(data.paths):
                data = FeatureShards(found)
                vocab = data_vocab(data)
        batch = data.sample_batch(cfg.batch_size, cfg.max_len, gen).to(device)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            anchors = None
            if cfg.walk_anchor_share:
                anchors = walk_step_anchors(model, batch, cfg.anchors_per_seq, cfg.walk_anchor_share,
                                            gen, vocab)
            res = dflash2_loss(model, batch, cfg.anchors_per_seq, gamma=cfg.gamma,
                               selector_weight=cfg.selector_weight, generator=gen, vocab=vocab,
                               anchors=anchors, feature_dropout=cfg.feature_dropout)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        win["loss"] += float(res.loss.detach())
        win["n"] += 1
        win["correct"] += res.correct.cpu().float()
        win["sel"] += res.selector_correct.cpu().float()
        win["count"] += res.count.cpu().float()
        acc = win["correct"] / win["count"].clamp_min(1)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss={win['loss'] / win['n']:.3f} lr={sched.get_last_lr()[0]:.2e} "
                                f"acc={'/'.join(f'{a:.2f}' for a in acc.tolist())}")
        if step % cfg.log_every == 0 or step == cfg.steps:
            history.append({"step": step, "loss": win["loss"] / win["n"], "acc": acc.tolist(),
                            "selector_acc": (win["sel"] / win["count"].clamp_min(1)).tolist(),
                            "lr": sched.get_last_lr()[0]})
            win = {k: (0.0 if k == "loss" else 0 if k == "n" else torch.zeros(bs - 1)) for k in win}
        if eval_data is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps):
            log_eval()
        if step % cfg.save_every == 0 or step == end:
            _save(ckpt, model, opt, sched, step, gen, history, model_cfg, cfg)
    if bar is not None:
        bar.close()
    if step < cfg.steps:
        return model, TrainState(step=step, history=history)
    export_hf(model, out / "hf", dtype=cfg.export_dtype, force=True)
    return model, TrainState(step=step, history=history)
