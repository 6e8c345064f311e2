"""Training data through the native engine (``native/capture_batch.h``,
:mod:`dflash2_gguf.train.generate`) on the real SmolLM2-135M Q4_1 target: batched greedy answers
equal the engine's one-sequence greedy text, features equal the engine's own capture, shards
round-trip and resume.

Exactness (README, "Exactness at T = 0"): a row of a batched pass has the values of a one-row
pass on ggml's CPU kernels while (a) a decode call has fewer than 64 rows (from 64 query rows on,
flash attention takes a tiled kernel) and (b) a sequence stays within 256 KV cells (beyond, a
one-token decode of the one-sequence reference takes a split-KV kernel). Hence ``n_batch=48``
and 24 new tokens after chat prompts of about 40 tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

PROMPTS = ["What is 2+3?", "Name a colour.", "Write one sentence about the sea."]
IDS = [1, 14, 27]
N_NEW = 24
H = 576
FEATURE_RTOL = 1e-3  # float16 rounding is 2^-11 = 4.9e-4 (measured here: 4.8e-4)
SMALL = dict(n_parallel=2, n_ctx_seq=256, n_batch=48, n_threads=2)  # 2 slots for 3 prompts


@pytest.fixture(scope="module")
def engine_reference(native_ext, smollm2_gguf, smollm2_drafters):
    """Per prompt: the serving renderer's ids, the engine's one-sequence greedy answer
    (target alone, T = 0) and the engine's features of prompt + answer (one teacher-forced
    prefill by the driver's capture, float32)."""
    from dflash2_gguf import DFlashDecoder
    from dflash2_gguf.chat.templates import chat_prompt_ids

    out = []
    with DFlashDecoder(smollm2_gguf, smollm2_drafters[2], n_ctx=512, n_threads=2) as dec:
        assert list(dec.engine.target_layers) == [k + 1 for k in IDS]  # layer-input indices
        for p in PROMPTS:
            ids = chat_prompt_ids(dec, [{"role": "user", "content": p}])
            res = dec.generate(ids, max_tokens=N_NEW, temperature=0.0, use_drafter=False, cache_prompt=False)
            feats = dec.engine.capture_features(ids + list(res.tokens))
            out.append((ids, list(res.tokens), np.asarray(feats)))
    return out


def _run(smollm2_gguf, prompts_ids, **kw):
    from dflash2_gguf.train.generate import BatchedCapture

    opts = {**SMALL, **kw}
    with BatchedCapture(smollm2_gguf, IDS, **opts) as g:
        got = {s.key: s for s in g.generate(prompts_ids, N_NEW)}
        stats = g.stats
        path = g.capture_path
    return got, stats, path


def _feature_error(f, ref):
    """Per target layer: the largest |f - ref| relative to |ref| + the layer's RMS / 100 (a few
    channels carry values 1000x the RMS: a bound scaled by the largest value would hide errors
    in all the others)."""
    out = []
    for j in range(len(IDS)):
        sl = slice(j * H, (j + 1) * H)
        r = ref[:, sl].astype(np.float64)
        floor = 0.01 * np.sqrt((r ** 2).mean())
        out.append(float((np.abs(f[:, sl].astype(np.float64) - r) / (np.abs(r) + floor)).max()))
    return out


def _feature_gap(f, ref):
    """Per target layer: (largest, mean) |f - ref| in units of the layer's RMS. float16 rounding
    of the largest channels (~25000) alone reaches 0.05."""
    out = []
    for j in range(len(IDS)):
        sl = slice(j * H, (j + 1) * H)
        r = ref[:, sl].astype(np.float64)
        d = np.abs(f[:, sl].astype(np.float64) - r) / np.sqrt((r ** 2).mean())
        out.append((float(d.max()), float(d.mean())))
    return out


def _check_features(seq, ref_feats, n_rows=None):
    """Native float16 features = the engine's float32 features (one teacher-forced prefill) up
    to float16 rounding (2^-11 relative) and kernel order, on the first ``n_rows`` rows."""
    f = seq.features
    assert f.dtype == np.float16 and f.shape == (len(seq.prompt) + len(seq.response), len(IDS) * H)
    n = len(f) if n_rows is None else n_rows
    err = _feature_error(f[:n], ref_feats[:n])
    assert max(err) <= FEATURE_RTOL, err


@pytest.mark.parametrize("n_ubatch", [512, 16])
def test_batched_greedy_and_features_equal_engine(smollm2_gguf, engine_reference, n_ubatch):
    """2 slots for 3 prompts (continuous batching: the third prompt is prefilled into the slot
    the first answer frees while the second is mid-answer): every answer is the engine's
    one-sequence greedy answer token for token, and every row's features are the engine's.
    n_ubatch=16 splits each ~40-token prompt over several compute graphs (libllama puts the
    layer inputs back in batch order)."""
    got, stats, path = _run(smollm2_gguf, [ids for ids, _, _ in engine_reference], n_ubatch=n_ubatch)
    assert path == "layer_inp" and sorted(got) == [0, 1, 2]
    for i, (ids, resp, feats) in enumerate(engine_reference):
        assert got[i].prompt == ids
        assert got[i].response == resp, (n_ubatch, i, got[i].response, resp)
        assert got[i].stop_reason == ("length" if len(resp) == N_NEW else "eog")
        _check_features(got[i], feats)
    assert stats["n_generated"] == sum(len(r) for _, r, _ in engine_reference)
    assert stats["n_prompt"] == sum(len(p) for p, _, _ in engine_reference)
    # 48-row batches hold one ~40-token prompt: prompts enter in three different calls, the
    # third while the second sequence is still running (fewer calls than three answers in turn)
    assert stats["n_decode"] < sum(len(r) + 1 for _, r, _ in engine_reference)


def test_cb_eval_path_with_unified_kv(smollm2_gguf, engine_reference):
    """The cb_eval path (targets whose graph does not record layer inputs) keeps the batch's
    row order through a unified KV cache, with prompts split over 16-row ubatches. All
    sequences then share one attention window: llama.cpp's CPU flash attention sums over
    another KV view than the one-sequence reference, and greedy answers part at near-ties (the
    second answer at its 15th token here), and features differ in the last digits (see
    _feature_gap; a neighbouring layer is 8x further on average). Compared: the first 8 tokens, and
    features on every row up to where the texts part."""
    got, _, path = _run(smollm2_gguf, [ids for ids, _, _ in engine_reference], capture="cb_eval", n_ubatch=16)
    assert path == "cb_eval"
    for i, (ids, resp, feats) in enumerate(engine_reference):
        r = got[i].response
        assert r[:8] == resp[:8], (i, r, resp)
        same = next((k for k, (x, y) in enumerate(zip(r, resp)) if x != y), min(len(r), len(resp)))
        # rows up to the first differing token hold the same text
        gap = _feature_gap(got[i].features[:len(ids) + same], feats[:len(ids) + same])
        assert all(mx <= 0.08 and mean <= 1e-3 for mx, mean in gap), gap  # measured: 0.057, 6e-4


def test_features_are_not_a_neighbouring_layer(smollm2_gguf, engine_reference):
    """Negative control of the feature check: layers (2, 15, 28) fail it by far."""
    from dflash2_gguf.train.generate import BatchedCapture

    ids, _, ref = engine_reference[0]
    with BatchedCapture(smollm2_gguf, [k + 1 for k in IDS], **SMALL) as g:
        seq = next(iter(g.generate([ids], 1)))
    err = _feature_error(seq.features, ref[: len(seq.features)])
    assert min(err) > 100 * FEATURE_RTOL, err
    gap = _feature_gap(seq.features, ref[: len(seq.features)])
    assert all(mean > 5e-3 for _, mean in gap), gap  # 5x the cb_eval test's bound (layer 14 -> 15: 7.8e-3)


def test_capture_refuses_bad_requests(smollm2_gguf):
    from dflash2_gguf.errors import DFlashError
    from dflash2_gguf.train.generate import BatchedCapture

    with pytest.raises(DFlashError, match="outside HF ids 0..28"):
        BatchedCapture(smollm2_gguf, [1, 29], **SMALL)  # the last layer's output is pruned
    with BatchedCapture(smollm2_gguf, IDS, **SMALL) as g:
        with pytest.raises(ValueError, match="n_ctx_seq"):
            list(g.generate([[1] * 256], 4))
        with pytest.raises(ValueError, match="n_batch"):
            list(g.generate([[1] * 49], 4))
        assert [s.key for s in g.generate([[1, 2, 3]], 2, keys=["a"])] == ["a"]  # usable after


def test_shards_round_trip_and_resume(tmp_path, smollm2_gguf, engine_reference):
    """Shards hold the serving renderer's prompt ids, the greedy answers and their features
    exactly as BatchedCapture returns them, with each prompt's family; a rerun keeps finished
    shards; a lost one is made again; shards of other layers refuse to be resumed."""
    from dflash2_gguf.train.data import FeatureShards
    from dflash2_gguf.train.generate import generate_capture_shards

    fams = ["math", "chat", "code"]
    kw = dict(max_new_tokens=N_NEW, seqs_per_shard=2, progress=False, families=fams, **SMALL)
    out = tmp_path / "feats"
    paths = generate_capture_shards(smollm2_gguf, PROMPTS, out, IDS, **kw)
    assert [p.name for p in paths] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    got, _, _ = _run(smollm2_gguf, [ids for ids, _, _ in engine_reference])
    data = FeatureShards(paths)
    assert data.meta.target_layer_ids == tuple(IDS) and data.meta.hidden_size == H
    assert data.meta.vocab_size == 49152 and "capture=layer_inp" in data.meta.source
    assert len(data) == 3 and data.family_of == fams
    for i, (si, start, n, plen) in enumerate(data.index):
        ids, resp, _ = engine_reference[i]
        assert plen == len(ids) and data._tokens[si][start:start + n].tolist() == ids + resp
        stored = data._features[si][start:start + n].numpy()
        assert np.array_equal(stored, got[i].features)
    rows = [json.loads(x) for x in (out / "responses.jsonl").read_text().splitlines()]
    assert sorted(r["i"] for r in rows) == [0, 1, 2]
    assert all(r["response"] == engine_reference[r["i"]][1] and r["family"] == fams[r["i"]] for r in rows)
    with pytest.raises(ValueError, match="one per prompt"):
        generate_capture_shards(smollm2_gguf, PROMPTS, tmp_path / "other", IDS, **{**kw, "families": fams[:1]})
    assert not (tmp_path / "other").exists()

    mtimes = [p.stat().st_mtime_ns for p in paths]
    assert generate_capture_shards(smollm2_gguf, PROMPTS, out, IDS, **kw) == paths
    assert [p.stat().st_mtime_ns for p in paths] == mtimes
    # a lost shard is made again from its recorded answer (teacher-forced, not generated): the
    # same tokens, the same features (< 64 rows per call, < 256 cells: batched rows are exact)
    before = FeatureShards([paths[1]])
    t_before, f_before = before._tokens[0].tolist(), before._features[0][:].numpy()
    paths[1].unlink()
    forced_kw = {**kw, "n_batch": 63}  # prompt + answer in one call, still under 64 rows
    generate_capture_shards(smollm2_gguf, PROMPTS, out, IDS, **forced_kw)
    assert paths[1].exists() and paths[0].stat().st_mtime_ns == mtimes[0]
    assert len((out / "responses.jsonl").read_text().splitlines()) == 3  # nothing generated again
    again = FeatureShards([paths[1]])
    assert again._tokens[0].tolist() == t_before and again.family_of == ["code"]
    np.testing.assert_allclose(again._features[0][:].numpy(), f_before, rtol=FEATURE_RTOL, atol=1e-3)
    # another machine: only responses.jsonl survives (gzipped); the shards are rebuilt from it
    import gzip
    import shutil

    kept = tmp_path / "responses.jsonl.gz"
    with open(out / "responses.jsonl", "rb") as src, gzip.open(kept, "wb") as dst:
        shutil.copyfileobj(src, dst)
    fresh = tmp_path / "fresh"
    rebuilt = generate_capture_shards(smollm2_gguf, PROMPTS, fresh, IDS, **forced_kw, responses=kept)
    assert [FeatureShards([p])._tokens[0].tolist() for p in rebuilt] == \
        [FeatureShards([p])._tokens[0].tolist() for p in paths]
    assert sorted(json.loads(x)["i"] for x in (fresh / "responses.jsonl").read_text().splitlines()) == [0, 1, 2]
    # a recorded answer whose last token the target does not pick again: the shard has features
    # for one token fewer, but the answer is recorded as it was (keeping it never shortens it)
    answers = [json.loads(x) for x in (out / "responses.jsonl").read_text().splitlines()]
    changed = next(r for r in answers if r["i"] == 0)
    changed["response"] = changed["response"][:-1] + [(changed["response"][-1] + 1) % 49152]
    odd = tmp_path / "odd.jsonl"
    odd.write_text("".join(json.dumps(r) + "\n" for r in answers))
    redone = generate_capture_shards(smollm2_gguf, PROMPTS, tmp_path / "odd", IDS, **forced_kw, responses=odd)
    first = FeatureShards([redone[0]])
    si, start, n, plen = first.index[0]
    assert first._tokens[si][start:start + n].tolist() == engine_reference[0][0] + changed["response"][:-1]
    lines = (tmp_path / "odd" / "responses.jsonl").read_text().splitlines()
    listed = {r["i"]: r["response"] for r in map(json.loads, lines)}
    assert listed == {r["i"]: r["response"] for r in answers}
    with pytest.raises(ValueError, match="other target layers"):
        generate_capture_shards(smollm2_gguf, PROMPTS, out, [2, 14, 27], **kw)


def test_cli_eval_of_the_shipped_drafter_on_captured_shards(tmp_path, smollm2_gguf, capsys):
    """``train eval``: the shipped drafter (target layers 1/14/27) on freshly captured shards,
    uniform-anchor and decode-walk tau per family; ``train fit --device cpu --bf16`` on those
    shards exports a drafter that ``eval`` reads; a folder without config.json is refused."""
    from dflash2_gguf.train.cli import main
    from dflash2_gguf.train.generate import generate_capture_shards

    out = tmp_path / "feats"
    generate_capture_shards(smollm2_gguf, PROMPTS, out, IDS, max_new_tokens=N_NEW, seqs_per_shard=2,
                            progress=False, families=["math", "chat", "code"], **SMALL)
    capsys.readouterr()
    assert main(["eval", "--target", str(smollm2_gguf), "--drafter", "models/SmolLM2-135M-DFlash2",
                 "--shards", str(out / "shard-*.safetensors"), "--threads", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    walk = res["walk"]
    assert set(walk) == {"all", "math", "chat", "code"} and res["shards"] == 2
    assert walk["all"]["n_seqs"] == 3
    assert walk["all"]["n_passes"] == sum(walk[f]["n_passes"] for f in ("math", "chat", "code"))
    # every pass commits 1..8 tokens and the passes cover each answer but its last block
    assert all(1.0 <= w["walk_tau"] <= 8.0 for w in walk.values())
    assert 1.0 <= res["uniform"]["tau"] <= 8.0
    assert set(res["uniform"]["tau_by_family"]) == {"math", "chat", "code"}
    # fit --device cpu --bf16 on the same shards (2 steps of a 1-layer drafter of the shipped
    # one's block size, reading 1/14/27); its export is evaluated like the shipped drafter
    run = tmp_path / "run"
    fit_args = ["fit", "--target", str(smollm2_gguf), "--shards", str(out / "shard-*.safetensors"),
                "--out", str(run), "--layers", "1", "--target-layer-ids", "1,14,27", "--block-size", "8",
                "--steps", "2", "--warmup", "1", "--batch-size", "2", "--max-len", "128", "--anchors", "4",
                "--vocab", "data", "--device", "cpu", "--bf16", "--threads", "2"]
    assert main(fit_args) == 0
    fit_out = capsys.readouterr().out
    assert "training on cpu, bfloat16 autocast (float32 weights)" in fit_out
    fit = json.loads(fit_out.splitlines()[-1])
    assert fit["step"] == 2 and np.isfinite(fit["last"]["loss"]) and fit["hf"] == str(run / "hf")
    # the same command again: the checkpoint is at --steps already; it says so and where it ran
    assert main(fit_args) == 0
    assert (f"resumed {run / 'checkpoint.pt'} at step 2 (that run: device cpu, autocast bfloat16); "
            "already at --steps 2, nothing to train") in capsys.readouterr().out
    assert main(["eval", "--target", str(smollm2_gguf), "--drafter", str(run / "hf"), "--device", "cpu",
                 "--shards", str(out / "shard-*.safetensors"), "--threads", "2", "--max-seqs", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["walk"]["all"]["n_seqs"] == 1 and 1.0 <= res["walk"]["all"]["walk_tau"] <= 8.0
    with pytest.raises(SystemExit, match="no config.json"):
        main(["eval", "--target", str(smollm2_gguf), "--drafter", str(tmp_path), "--shards", str(out / "*")])
    with pytest.raises(SystemExit, match="no such file"):
        main(["eval", "--target", str(tmp_path / "none.gguf"), "--drafter", "models/SmolLM2-135M-DFlash2",
              "--shards", str(out / "*")])
    with pytest.raises(SystemExit, match="from 0 to 1"):
        main(["fit", "--target", str(smollm2_gguf), "--shards", str(out / "*"), "--out", str(tmp_path / "r"),
              "--walk-anchors", "1.5"])


def test_prompts_too_long_are_skipped(tmp_path, smollm2_gguf, engine_reference, capsys):
    """A prompt that leaves no room for a full answer (here: longer than n_batch = 48 tokens) is
    skipped, not fatal: its shard holds the rest of its range, a shard of skipped prompts only is
    not written, the run logs how many and how to keep them, and a rerun has nothing left to do."""
    from dflash2_gguf.train.data import FeatureShards
    from dflash2_gguf.train.generate import generate_capture_shards

    long_prompt = "Summarise: " + "the quick brown fox jumps over the lazy dog " * 8
    prompts = PROMPTS + [long_prompt, long_prompt + "again"]
    kw = dict(max_new_tokens=N_NEW, seqs_per_shard=2, progress=False, **SMALL)
    out = tmp_path / "feats"
    paths = generate_capture_shards(smollm2_gguf, prompts, out, IDS, **kw)
    assert [p.name for p in paths] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert not (out / "shard-00002.safetensors").exists()
    assert "skipping 2 of 5 prompts longer than 48 tokens" in capsys.readouterr().err
    data = FeatureShards(paths)
    assert len(data) == 3 and [n for _, _, n, _ in data.index][-1] == \
        len(engine_reference[2][0]) + len(engine_reference[2][1])
    rows = [json.loads(x) for x in (out / "responses.jsonl").read_text().splitlines()]
    assert sorted(r["i"] for r in rows) == [0, 1, 2]
    mtimes = [p.stat().st_mtime_ns for p in paths]
    assert generate_capture_shards(smollm2_gguf, prompts, out, IDS, **kw) == paths
    assert [p.stat().st_mtime_ns for p in paths] == mtimes


def test_cli_capture_writes_and_resumes(tmp_path, smollm2_gguf):
    """``python -m dflash2_gguf.train capture`` runs the native path; an existing output needs
    --resume (nothing left to do then) or --force."""
    from dflash2_gguf.train.cli import main
    from dflash2_gguf.train.data import read_shard_meta

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2+3?\nName a colour.\n")
    out = tmp_path / "feats"
    argv = ["capture", "--target", str(smollm2_gguf), "--target-layer-ids", "1,14,27", "--prompts", str(prompts),
            "--max-new-tokens", "4", "--seqs-per-shard", "2", "--n-ctx", "256", "--batch-size", "2",
            "--threads", "2", "--out", str(out)]
    assert main(argv) == 0
    shard = out / "shard-00000.safetensors"
    meta = read_shard_meta(shard)
    assert meta.target_layer_ids == (1, 14, 27) and "prompts=" in meta.source
    with pytest.raises(SystemExit, match="--resume"):
        main(argv)
    mtime = shard.stat().st_mtime_ns
    assert main(argv + ["--resume"]) == 0 and shard.stat().st_mtime_ns == mtime
