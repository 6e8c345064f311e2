"""DFlash 2 training objective: many random anchors per sequence in one forward pass.

Inference drafts a block ``[anchor, MASK x (bs-1)]`` at positions ``P .. P+bs-1`` from the target
features of the committed tokens ``0 .. P-1`` (context rows) and the anchor (the last committed
token, not yet seen by the target). Training imitates exactly that, for many anchors at once:

For one sequence of tokens ``x_0 .. x_{N-1}`` with target features ``f_0 .. f_{N-1}`` (``f_i`` =
the target's hidden states at the chosen layers after reading ``x_0..x_i``):

- pick ``A`` anchors ``p_1..p_A`` at random in ``[max(1, start), N-2]`` (``start`` = the first
  response token when the shard gives prompt lengths: the first real anchor is the target's first
  generated token);
- block ``a`` = rows ``[x_{p_a}, MASK, ..., MASK]`` at positions ``p_a .. p_a+bs-1``; its row
  ``k`` (1..bs-1) is trained to predict ``x_{p_a+k}`` (ignored past the end of the sequence);
- all blocks are laid side by side as one query of ``A*bs`` rows; the keys are the ``N`` context
  rows (``fc``/``hidden_norm`` of ``f``, computed ONCE and shared) followed by the ``A*bs`` block
  rows. The attention mask (bool, True = visible) of query row ``(a, k)`` over key column ``j``::

        context column j (0 <= j < N):        visible  iff  j < p_a
        block column (a', k') (0 <= k' < bs): visible  iff  a' == a

  i.e. each block sees the features of the committed tokens before its anchor, and its own rows
  (bidirectionally; the config's causal / sliding-window limits are ANDed in by the model from
  positions). Padding columns (j >= N for a shorter sequence) are never visible because
  ``p_a < N``. This equals ``A`` separate reference passes (tested against ``dflash==0.1.0``).
  Cost: the mask is ``[B, 1, A*bs, N + A*bs]``; SDPA on it is O(A*bs*(N+A*bs)) per head.

Losses (DFlash / DFlash 2 papers; ``gamma`` per :func:`default_gamma`):

- cross-entropy of the (scaled, softcapped) draft logits of row ``k`` against ``x_{p+k}``,
  weighted ``w_k = exp(-(k-1)/gamma)``, normalised by the sum of weights of the counted rows;
- selector: over the top-k candidates of row ``k`` (ids from the detached logits; their logits
  keep their gradient as the unary term), scores ``S_k(x_{p+k-1}, .)`` with the TRUE previous
  token as predecessor (``x_p``, the anchor, for ``k = 1``); cross-entropy towards the index of
  ``x_{p+k}``; rows whose true token is not among the candidates are left out (the selector
  cannot pick it); same weights ``w_k``. ``loss = ce + selector_weight * selector``.

Accuracy: per block position ``k``, top-1 of the logits equals ``x_{p+k}`` (``correct``/``count``)
and the teacher-forced selector's argmax equals it (``selector_correct``).
:func:`greedy_acceptance` measures the acceptance length tau that greedy speculative decoding
would get at random anchors (exact when the responses are the target's greedy output);
:func:`walk_acceptance` the tau of the anchors a T = 0 decode actually visits, which are harder
(each pass starts at the target's correction of a rejected draft). :func:`walk_step_anchors`
moves a share of the training anchors one such pass on, towards the anchors decoding visits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .model import DFlash2Drafter

__all__ = ["Batch", "LossOutput", "default_gamma", "sample_anchors", "block_inputs",
           "block_attention_mask", "dflash2_loss", "anchor_acceptance", "greedy_acceptance",
           "walk_acceptance", "walk_step_anchors"]


def default_gamma(block_size: int) -> float:
    """Loss decay ``gamma`` of ``exp(-(k-1)/gamma)``: 7 for block 16, 5 for 10, 4 for 8 (the
    values the DFlash paper lists; others interpolate as ``7 * (bs-1) / 15``). A tunable."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 7.0 * (block_size - 1) / 15.0)


@dataclass
class Batch:
    """A padded batch of sequences (one window of each).

    tokens: int64 [B, L] (padding arbitrary); features: float [B, L, n_feat*H] (f16 ok);
    positions: int64 [B, L] absolute positions of the rows (window start + index);
    lengths: int64 [B] valid rows; anchor_min: int64 [B] first row index allowed as an anchor.
    """

    tokens: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    anchor_min: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.tokens, self.features, self.positions,
                                               self.lengths, self.anchor_min)))


@dataclass
class LossOutput:
    """loss (scalar, with grad); ce / selector (detached scalars); per block position k=1..bs-1:
    correct, selector_correct, count (int64 [bs-1])."""

    loss: torch.Tensor
    ce: torch.Tensor
    selector: torch.Tensor
    correct: torch.Tensor
    selector_correct: torch.Tensor
    count: torch.Tensor


def sample_anchors(lengths: torch.Tensor, anchor_min: torch.Tensor, n_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct anchors per sequence in ``[max(1, anchor_min), length-2]``.

    Returns (anchors int64 [B, A] sorted, valid bool [B, A]); invalid slots hold anchor 0.
    """
    b = lengths.shape[0]
    anchors = torch.zeros(b, n_anchors, dtype=torch.long)
    valid = torch.zeros(b, n_anchors, dtype=torch.bool)
    for i in range(b):
        lo = max(1, int(anchor_min[i]))
        hi = int(lengths[i]) - 2
        if hi < lo:
            continue
        span = hi - lo + 1
        pick = torch.randperm(span, generator=generator)[:n_anchors] + lo
        pick, _ = pick.sort()
        anchors[i, : len(pick)] = pick
        valid[i, : len(pick)] = True
    return anchors.to(lengths.device), valid.to(lengths.device)


def block_inputs(tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                 anchors: torch.Tensor, valid: torch.Tensor, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block rows for every anchor.

    Returns (ids int64 [B, A*bs] = anchor then masks, block positions int64 [B, A*bs],
    labels int64 [B, A, bs] (-100 = ignored; column 0 always ignored),
    predecessors int64 [B, A, bs] (true token before row k: ``x_{p+k-1}``)).
    """
    b, a = anchors.shape
    k = torch.arange(block_size, device=tokens.device)
    idx = anchors[..., None] + k                                      # [B, A, bs]
    in_seq = (idx < lengths[:, None, None]) & valid[..., None]
    safe = idx.clamp(max=tokens.shape[1] - 1)
    gathered = tokens.gather(1, safe.view(b, -1)).view(b, a, block_size)
    labels = torch.where(in_seq, gathered, torch.full_like(gathered, -100))
    labels[..., 0] = -100
    ids = torch.full_like(gathered, mask_token_id)
    ids[..., 0] = gathered[..., 0]
    pred = tokens.gather(1, (idx - 1).clamp(min=0, max=tokens.shape[1] - 1).view(b, -1)).view(b, a, block_size)
    pos = positions.gather(1, anchors) [..., None] + k                 # [B, A, bs]
    return ids.view(b, -1), pos.view(b, -1), labels, pred


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """bool [B, 1, A*bs, ctx_len + A*bs]: context column j visible to block a iff j < anchor_a;
    block columns visible iff same block (see the module docstring)."""
    b, a = anchors.shape
    dev = anchors.device
    j = torch.arange(ctx_len, device=dev)
    ctx = (j[None, None, :] < anchors[..., None])                        # [B, A, C]
    ctx = ctx[:, :, None, :].expand(b, a, block_size, ctx_len).reshape(b, a * block_size, ctx_len)
    blk = torch.arange(a, device=dev).repeat_interleave(block_size)
    own = (blk[:, None] == blk[None, :])[None].expand(b, -1, -1)
    return torch.cat([ctx, own], dim=-1)[:, None]


def dflash2_loss(model: DFlash2Drafter, batch: Batch, n_anchors: int, *, gamma: float | None = None,
                 selector_weight: float = 1.0, generator: torch.Generator | None = None,
                 anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
                 vocab: torch.Tensor | None = None, feature_dropout: float = 0.0) -> LossOutput:
    """The DFlash 2 loss of one batch (see the module docstring).

    Args:
        model: the drafter, with target weights attached.
        batch: padded sequences with features.
        n_anchors: anchors (blocks) per sequence.
        gamma: position decay; default :func:`default_gamma` of the block size.
        selector_weight: weight of the selector loss.
        generator: RNG of the anchor sampling (CPU generator).
        anchors: (anchors [B, A], valid [B, A]) to use instead of sampling (tests).
        vocab: sorted int64 token ids: softmax (and the selector's top-k) over these head rows
            only (a restricted-vocabulary approximation that makes the output head, the
            dominant CPU cost, ``V / len(vocab)`` times cheaper; labels outside it are ignored).
            None: the full vocabulary (the authors' objective).
        feature_dropout: dropout probability on the fused target features of the context rows
            (:meth:`DFlash2Drafter.forward`; only while the model is in training mode).
    """
    cfg = model.config
    bs = cfg.block_size
    gamma = default_gamma(bs) if gamma is None else gamma
    if anchors is None:
        anchors = sample_anchors(batch.lengths.cpu(), batch.anchor_min.cpu(), n_anchors, generator)
    anc, valid = (t.to(batch.tokens.device) for t in anchors)
    b, a = anc.shape
    ids, bpos, labels, pred = block_inputs(batch.tokens, batch.positions, batch.lengths, anc, valid,
                                           bs, cfg.mask_token_id)
    ctx_len = batch.tokens.shape[1]
    mask = block_attention_mask(anc, ctx_len, bs)
    pos = torch.cat([batch.positions, bpos], dim=1)
    emb = model.embed(ids)
    hidden = model(emb, batch.features, pos, attention_mask=mask, block_len=bs,
                   feature_dropout=feature_dropout)
    hidden = hidden.view(b, a, bs, -1)[:, :, 1:]                        # rows 1..bs-1
    labels, pred = labels[:, :, 1:], pred[:, :, 1:]
    labels_full = labels
    if vocab is not None:
        vocab = vocab.to(labels.device)
        lut = torch.full((cfg.vocab_size,), -100, dtype=torch.long, device=labels.device)
        lut[vocab] = torch.arange(len(vocab), device=labels.device)
        labels = torch.where(labels >= 0, lut[labels.clamp(min=0)], labels)
    logits = model.compute_logits(hidden, vocab).float()               # [B, A, bs-1, V or |vocab|]

    w = torch.exp(-torch.arange(bs - 1, device=logits.device, dtype=torch.float32) / gamma)
    counted = labels >= 0
    wk = w.expand_as(labels) * counted
    denom = wk.sum().clamp_min(1e-9)
    ce_rows = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                              ignore_index=-100, reduction="none").view_as(labels)
    ce = (ce_rows * wk).sum() / denom

    sel = model.candidate_selector
    cand = torch.topk(logits.detach(), sel.top_k, dim=-1, sorted=False).indices
    unary = logits.gather(-1, cand)
    cand_ids = cand if vocab is None else vocab[cand]
    scores = sel.scores(hidden, unary, cand_ids, pred.clamp(min=0)).float()
    hit = cand == labels[..., None]
    in_top = hit.any(-1) & counted
    target = hit.float().argmax(-1)
    sel_rows = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), target.reshape(-1),
                               reduction="none").view_as(labels)
    ws = w.expand_as(labels) * in_top
    selector = (sel_rows * ws).sum() / ws.sum().clamp_min(1e-9)
    loss = ce + selector_weight * selector

    with torch.no_grad():
        correct = ((logits.argmax(-1) == labels) & counted).sum((0, 1))
        sel_pick = cand_ids.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        sel_correct = ((sel_pick == labels_full) & counted).sum((0, 1))
        count = (labels_full >= 0).sum((0, 1))
    if not math.isfinite(float(loss.detach())):
        raise FloatingPointError("non-finite DFlash 2 loss")
    return LossOutput(loss=loss, ce=ce.detach(), selector=selector.detach(), correct=correct,
                      selector_correct=sel_correct, count=count)


@torch.no_grad()
def anchor_acceptance(model: DFlash2Drafter, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor,
                      vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Acceptance length (tau, bonus included) of greedy drafting at the given anchors.

    The selector's greedy walk (first predecessor = the anchor) is compared with the true next
    tokens; ``tau = 1 + number of leading matches`` (rows past the end of a sequence never match).

    Args:
        anchors: int64 [B, A] row indices; valid: bool [B, A] (invalid slots get tau 0).
        vocab: sorted int64 token ids: the head rows drafted over (as :func:`dflash2_loss`'s
            ``vocab``); None: the full vocabulary, as inference drafts.
    Returns int64 [B, A].
    """
    cfg = model.config
    bs = cfg.block_size
    anc, valid = anchors.to(batch.tokens.device), valid.to(batch.tokens.device)
    b, a = anc.shape
    ids, bpos, labels, _ = block_inputs(batch.tokens, batch.positions, batch.lengths, anc, valid,
                                        bs, cfg.mask_token_id)
    mask = block_attention_mask(anc, batch.tokens.shape[1], bs)
    hidden = model(model.embed(ids), batch.features, torch.cat([batch.positions, bpos], 1),
                   attention_mask=mask, block_len=bs)
    hidden = hidden.view(b * a, bs, -1)[:, 1:]
    vocab = None if vocab is None else vocab.to(hidden.device)
    logits = model.compute_logits(hidden, vocab).float()
    path, _, _ = model.candidate_selector.select(hidden, logits, ids.view(b * a, bs)[:, 0], 0.0, vocab=vocab)
    match = (path == labels.view(b * a, bs)[:, 1:]).long().cumprod(-1).sum(-1) + 1
    return (match * valid.view(-1)).view(b, a)


@torch.no_grad()
def greedy_acceptance(model: DFlash2Drafter, batch: Batch, n_anchors: int,
                      generator: torch.Generator | None = None,
                      anchors: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Acceptance length (tau, bonus included) of greedy drafting at random anchors.

    For sequences whose responses are the target's GREEDY output (what
    :func:`~dflash2_gguf.train.generate.generate_capture_shards` stores), this is exactly what
    speculative decoding at T=0 would commit per target pass from that anchor
    (:func:`anchor_acceptance`). Only anchors with a full block of labels are drawn. Anchors
    drawn uniformly over a response are easier than the ones a decode visits (each pass starts
    at the target's correction of a rejected draft): :func:`walk_acceptance` measures those.

    Returns int64 [n] of tau values, one per valid anchor (row-major over [B, A]).
    """
    bs = model.config.block_size
    if anchors is None:
        eff = (batch.lengths - bs + 2).cpu()
        anchors = sample_anchors(eff, batch.anchor_min.cpu(), n_anchors, generator)
    anc, valid = anchors
    taus = anchor_acceptance(model, batch, anc, valid)
    return taus.view(-1)[valid.to(taus.device).view(-1)]


@torch.no_grad()
def walk_acceptance(model: DFlash2Drafter, tokens: torch.Tensor, features: torch.Tensor, prompt_len: int,
                    *, chunk: int = 128) -> list[int]:
    """The target passes of greedy speculative decoding (T = 0) over one recorded sequence.

    The first pass drafts from the first response token (the target's first generated token is
    the first anchor); a pass that commits ``tau`` tokens moves the next anchor ``tau`` rows on
    (the bonus token, the target's own pick after the last accepted draft, is the next anchor),
    while a full block of labels is left. For a sequence that is the target's greedy answer
    with its features, these are the per-pass acceptance lengths ``dflash2-gguf bench --temp 0
    --spec-draft-adaptive off`` would see on its prompt (up to the numerics of the two engines);
    their mean is the request's tau. Every anchor's tau is computed first, ``chunk`` anchors per
    forward pass (memory: the block rows attend over the whole sequence).

    Args:
        tokens: int64 [N]; features: [N, n_feat*H] (f16 ok); prompt_len: rows of the prompt.
    Returns the tau of each pass, in order (empty when the answer is shorter than a block).
    """
    bs = model.config.block_size
    n = tokens.shape[0]
    last = n - bs  # the last anchor with labels for all bs-1 draft rows
    if last < prompt_len:
        return []
    dev = next(model.parameters()).device
    batch = Batch(tokens[None].long(), features[None], torch.arange(n)[None], torch.tensor([n]),
                  torch.tensor([prompt_len])).to(dev)
    tau: list[int] = []
    for lo in range(prompt_len, last + 1, chunk):
        anc = torch.arange(lo, min(lo + chunk, last + 1))[None]
        tau += anchor_acceptance(model, batch, anc, torch.ones_like(anc, dtype=torch.bool))[0].tolist()
    passes, p = [], prompt_len
    while p <= last:
        passes.append(tau[p - prompt_len])
        p += tau[p - prompt_len]
    return passes


@torch.no_grad()
def walk_step_anchors(model: DFlash2Drafter, batch: Batch, n_anchors: int, share: float,
                      generator: torch.Generator | None = None, vocab: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Training anchors, ``share`` of them where a T = 0 decode would start its next pass.

    A decode's passes start right after a rejected draft (:func:`walk_acceptance`), not uniformly:
    on the SmolLM2 drafter of stage 3 and held-out math, uniform anchors accept 2.90 tokens per
    pass, a decode's anchors 2.64 (docs/TRAINING.md, "4. Evaluate"). Here
    ``round(share * n_anchors)`` uniform anchors ``a`` are drafted with the current weights (no
    gradient) and replaced by ``a + tau(a)`` (one pass of the walk from ``a``); the other slots
    are uniform anchors. Landings past the last labelled row, or on a row already taken, are
    dropped (fewer valid slots).

    Returns (anchors int64 [B, A] sorted per row, valid bool [B, A]) like :func:`sample_anchors`;
    ``share`` 0 returns exactly :func:`sample_anchors`' draw. Raises ValueError for a share
    outside [0, 1]. Measured at share 0.5 (docs/TRAINING.md, "What moved acceptance"): the
    uniform-anchor tau rose, the decode walk's did not, at ~45% more time per training step.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"walk anchor share must be in [0, 1], got {share}")
    lengths, amin = batch.lengths.cpu(), batch.anchor_min.cpu()
    anc, valid = sample_anchors(lengths, amin, n_anchors, generator)
    k = round(share * n_anchors)
    if k == 0:
        return anc, valid
    # which slots walk: a random k of each row's (sorted) anchors
    order = torch.argsort(torch.rand(anc.shape, generator=generator), dim=1)
    walks = torch.zeros_like(valid)
    walks.scatter_(1, order[:, :k], True)
    walks &= valid
    tau = anchor_acceptance(model, batch, anc, walks, vocab).cpu()
    land = anc + tau
    out = torch.zeros_like(anc)
    ok = torch.zeros_like(valid)
    for i in range(anc.shape[0]):
        top = int(lengths[i]) - 2
        keep = sorted(set(land[i][walks[i] & (land[i] <= top)].tolist())
                      | set(anc[i][valid[i] & ~walks[i]].tolist()))
        out[i, :len(keep)] = torch.tensor(keep, dtype=torch.long)
        ok[i, :len(keep)] = True
    return out.to(batch.lengths.device), ok.to(batch.lengths.device)
