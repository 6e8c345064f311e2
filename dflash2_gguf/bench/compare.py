"""Side-by-side runs of ``dflash2-gguf bench``: upstream's decoders on the same rendered prompts.

- ``--upstream``: ``llama-speculative-simple`` (upstream's C++ DFlash driver; the spec type comes
  from the drafter GGUF's metadata) and ``llama-completion`` (upstream's plain baseline with the
  same flags) of llama.cpp :data:`UPSTREAM_COMMIT`, the commit llama-cpp-python 0.3.36 vendors.
  This module runs the two binaries and parses what they print; it does not build them. They are
  looked up in :func:`upstream_bin_dir` (``$DFLASH2_GGUF_UPSTREAM_BIN``, else
  ``<cache>/upstream-0c1e570/bin``, ``<cache>`` = ``$DFLASH2_GGUF_CACHE`` or
  ``~/.cache/dflash2-gguf``), where ``python -m benchmarks.upstream_driver`` (a clone of this
  repository: fetches the sdist, builds with CMake, about 6 min on 2 cores) puts them.
- ``--prompt-lookup``: llama-cpp-python's ``Llama`` with and without ``LlamaPromptLookupDecoding``
  (:class:`PromptLookupRunner`), the only speculative mode its Python API offers.

A requested comparison that cannot run fails loudly: :func:`check_side_by_side` raises
:class:`ComparisonUnavailable` (the missing piece and how to get it) before anything loads, and
a comparison that fails while it runs makes :func:`side_by_side` report it in ``errors`` (the
bench then exits non-zero after writing its own figures).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from .report import fmt
from .stats import ratio

__all__ = [
    "UPSTREAM_COMMIT", "UPSTREAM_TOOLS", "ComparisonUnavailable", "UpstreamRun", "upstream_bin_dir",
    "default_upstream_bin_dir", "check_side_by_side", "parse_speculative_simple", "parse_completion",
    "run_speculative_simple", "run_completion", "PromptLookupRunner", "side_by_side",
]

#: llama.cpp commit of the upstream tools compared against (vendored by llama-cpp-python 0.3.36).
UPSTREAM_COMMIT = "0c1e570"
#: The upstream binaries ``--upstream`` runs.
UPSTREAM_TOOLS = ("llama-speculative-simple", "llama-completion")
_BUILD_HINT = ("build them once from a clone of the dflash2-gguf repository with "
               "`python -m benchmarks.upstream_driver` (llama.cpp {commit} from the llama-cpp-python 0.3.36 "
               "sdist; needs CMake and a C++ compiler, about 6 min on 2 cores), or set "
               "DFLASH2_GGUF_UPSTREAM_BIN to a folder holding your own build of both tools at that commit")


class ComparisonUnavailable(RuntimeError):
    """A side-by-side run was requested but cannot run; the message names the missing piece and
    how to get it."""


def default_upstream_bin_dir() -> Path:
    """``<cache>/upstream-0c1e570/bin``: where ``python -m benchmarks.upstream_driver`` puts the tools."""
    from ..assets import cache_dir

    return cache_dir() / f"upstream-{UPSTREAM_COMMIT}" / "bin"


def upstream_bin_dir() -> Path:
    """Folder searched for the upstream tools: ``$DFLASH2_GGUF_UPSTREAM_BIN``, else
    :func:`default_upstream_bin_dir`."""
    env = os.environ.get("DFLASH2_GGUF_UPSTREAM_BIN")
    return Path(env) if env else default_upstream_bin_dir()


def check_side_by_side(*, upstream: bool, prompt_lookup: bool) -> Optional[Path]:
    """Check that the requested comparisons can run, before the benchmark loads anything.

    Returns the folder of the upstream tools (None when ``upstream`` is False).

    Raises:
        ComparisonUnavailable: a tool of ``--upstream`` is missing from :func:`upstream_bin_dir`,
            or llama-cpp-python's prompt-lookup decoder is not importable for ``--prompt-lookup``.
    """
    bins = None
    if upstream:
        bins = upstream_bin_dir()
        missing = [t for t in UPSTREAM_TOOLS if not os.access(bins / t, os.X_OK)]
        if missing:
            raise ComparisonUnavailable(
                f"--upstream needs upstream's {' and '.join(missing)} (llama.cpp {UPSTREAM_COMMIT}), not found in "
                f"{bins}: " + _BUILD_HINT.format(commit=UPSTREAM_COMMIT))
    if prompt_lookup:
        try:
            from llama_cpp import Llama  # noqa: F401
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
        except ImportError as e:
            raise ComparisonUnavailable(
                f"--prompt-lookup needs llama-cpp-python's LlamaPromptLookupDecoding ({e}): "
                "pip install 'llama-cpp-python==0.3.36'") from e
    return bins


@dataclass
class UpstreamRun:
    """What one upstream run reported.

    Attributes:
        tool: ``"llama-speculative-simple"``, ``"llama-completion"``, ``"prompt-lookup"`` or
            ``"llama-cpp-python"``.
        n_generated: Tokens generated (as the tool counts them).
        decode_s: Decode time in seconds (prefill excluded where the tool separates it).
        decode_tokens_per_second: ``n_generated / decode_s`` as the tool reports it.
        n_drafted / n_accepted: Draft tokens verified / accepted (speculative tools).
        acceptance_length: Tokens committed per target pass, bonus included:
            ``n_generated / (n_generated - n_accepted)`` for llama-speculative-simple (each of
            its passes commits the accepted drafts + one target token).
        text: The generated text (stdout), when the tool prints it.
        wall_s: Wall time of the whole process/call (model load included for the binaries).
    """

    tool: str
    n_generated: int = 0
    decode_s: float = 0.0
    decode_tokens_per_second: float = 0.0
    n_drafted: int = 0
    n_accepted: int = 0
    acceptance_length: float = 0.0
    text: str = ""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready)."""
        return asdict(self)


_RE_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s")
_RE_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_RE_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_RE_EVAL = re.compile(r"(?<!prompt )eval time\s*=\s*([\d.]+)\s*ms\s*/\s*(\d+)\s*runs.*?([\d.]+)\s*tokens per second")


def parse_speculative_simple(log: str) -> UpstreamRun:
    """Parse the summary that ``llama-speculative-simple`` prints on stderr.

    Raises:
        ValueError: the log has no ``decoded N tokens in S seconds`` line.
    """
    m = _RE_DECODED.search(log)
    if not m:
        raise ValueError("no 'decoded N tokens' line in the llama-speculative-simple output")
    r = UpstreamRun(tool="llama-speculative-simple", n_generated=int(m.group(1)), decode_s=float(m.group(2)),
                    decode_tokens_per_second=float(m.group(3)))
    if (d := _RE_DRAFTED.search(log)) and (a := _RE_ACCEPT.search(log)):
        r.n_drafted, r.n_accepted = int(d.group(1)), int(a.group(1))
        passes = r.n_generated - r.n_accepted
        r.acceptance_length = r.n_generated / passes if passes > 0 else 0.0
    return r


def parse_completion(log: str) -> UpstreamRun:
    """Parse the ``eval time = ... ms / N runs (... tokens per second)`` line of ``common_perf_print``.

    Raises:
        ValueError: the log has no such line.
    """
    m = _RE_EVAL.search(log)
    if not m:
        raise ValueError("no 'eval time' line in the llama-completion output")
    ms, runs, tps = float(m.group(1)), int(m.group(2)), float(m.group(3))
    # The eval runs exclude the token sampled from the prefill logits.
    return UpstreamRun(tool="llama-completion", n_generated=runs, decode_s=ms / 1000.0, decode_tokens_per_second=tps)


def _common_flags(target, prompt_file: Path, n_predict: int, temp: float, seed: int,
                  threads: Optional[int], n_ctx: int) -> list:
    """Flags both upstream tools get: model, prompt file, budget, sampling, context, threads."""
    flags = ["-m", str(target), "-f", str(prompt_file), "-n", str(n_predict), "--temp", str(temp),
             "--seed", str(seed), "-c", str(n_ctx), "--no-escape"]
    if temp > 0:   # plain temperature sampling, as our bench samples (llama.cpp's defaults truncate)
        flags += ["--top-k", "0", "--top-p", "1.0", "--min-p", "0.0"]
    if threads:
        flags += ["-t", str(threads)]
    return flags


def _run(cmd: list, timeout: Optional[float]) -> tuple[str, str, float]:
    env = dict(os.environ)   # the caller's OpenMP settings: the same as our decoder's in the same run
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (rc {proc.returncode}):\n$ {' '.join(cmd)}\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout, proc.stderr, wall


def run_speculative_simple(bins: Path, target, drafter, prompt: str, *, workdir: Path, n_predict: int = 64,
                           temp: float = 0.0, seed: int = 42, threads: Optional[int] = None,
                           n_ctx: int = 4096, n_draft_max: int = 7,
                           timeout: Optional[float] = 600) -> UpstreamRun:
    """Run upstream's ``llama-speculative-simple`` on one rendered prompt (special tokens parsed).

    ``--spec-draft-n-max n_draft_max``; the spec type (``draft-dflash``) is inferred by upstream
    from the drafter GGUF. Returns the parsed :class:`UpstreamRun` (text = its stdout).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    pf = workdir / "prompt.txt"
    pf.write_text(prompt + "\n")  # -f drops one trailing newline
    cmd = [str(Path(bins) / "llama-speculative-simple"), *_common_flags(target, pf, n_predict, temp, seed, threads, n_ctx),
           "-md", str(drafter), "--spec-draft-n-max", str(n_draft_max)]
    if threads:
        cmd += ["-td", str(threads)]
    out, err, wall = _run(cmd, timeout)
    r = parse_speculative_simple(err + out)
    r.text, r.wall_s = out, wall
    return r


def run_completion(bins: Path, target, prompt: str, *, workdir: Path, n_predict: int = 64, temp: float = 0.0,
                   seed: int = 42, threads: Optional[int] = None, n_ctx: int = 4096,
                   timeout: Optional[float] = 600) -> UpstreamRun:
    """Run upstream's ``llama-completion`` (plain decoding, same flags, no conversation mode)."""
    workdir.mkdir(parents=True, exist_ok=True)
    pf = workdir / "prompt.txt"
    pf.write_text(prompt + "\n")  # -f drops one trailing newline
    cmd = [str(Path(bins) / "llama-completion"), *_common_flags(target, pf, n_predict, temp, seed, threads, n_ctx),
           "-no-cnv", "--no-display-prompt", "--perf"]
    out, err, wall = _run(cmd, timeout)
    r = parse_completion(err + out)
    r.text, r.wall_s = out, wall
    return r


class PromptLookupRunner:
    """llama-cpp-python's ``Llama`` with and without ``LlamaPromptLookupDecoding``.

    Two ``Llama`` objects on the same target, built once and reused for every prompt.
    ``num_pred_tokens`` = drafts per pass (llama-cpp-python's default is 10; we pass n_max).
    ``flash_attn`` should match the decoder compared against (llama.cpp's auto = on).
    ``threads=None`` keeps llama-cpp-python's own defaults (``n_threads`` = cores // 2 for
    one-token decodes, ``n_threads_batch`` = cores), so its tokens/s are what its users get, not
    what our decoder (all cores for both) gets: compare its prompt-lookup speedup with its own
    plain run, and pass ``threads`` for like-for-like tokens/s.
    """

    def __init__(self, target, *, n_ctx: int = 4096, threads: Optional[int] = None, num_pred_tokens: int = 7,
                 seed: int = 42, flash_attn: bool = True) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # flash_attn: llama-cpp-python defaults to off, llama.cpp's "auto" (our decoder's and the
        # upstream tools' default) turns it on; at T=0 the two pick different tokens on near-ties.
        kw = dict(n_ctx=n_ctx, seed=seed, verbose=False, flash_attn=bool(flash_attn))
        if threads:
            kw.update(n_threads=threads, n_threads_batch=threads)
        self.plain = Llama(str(target), logits_all=False, **kw)
        # logits_all=True: with a draft model, Llama asks llama.cpp for every row's logits but sizes
        # its scores buffer by the logits_all argument (n_batch rows when False), so any request
        # past n_batch = 512 tokens failed with "could not broadcast input array" (llama-cpp-python
        # 0.3.36; MT-Bench in BENCHMARKS.md). True sizes it n_ctx rows, what the decoder writes.
        self.lookup = Llama(str(target), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens),
                            logits_all=True, **kw)

    def run(self, prompt: str, *, lookup: bool, n_predict: int, temp: float = 0.0, seed: int = 42) -> UpstreamRun:
        """Complete ``prompt`` (special tokens parsed); timing covers the whole call (prefill included)."""
        llm = self.lookup if lookup else self.plain
        llm.reset()
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        t0 = time.perf_counter()
        # T>0: plain temperature sampling like our bench (llama-cpp-python's defaults truncate: top_k
        # 40, top_p 0.95, min_p 0.05)
        trunc = dict(top_k=1) if temp == 0 else dict(top_k=0, top_p=1.0, min_p=0.0)
        out = llm.create_completion(ids, max_tokens=n_predict, temperature=temp, seed=seed, **trunc)
        wall = time.perf_counter() - t0
        n = int(out["usage"]["completion_tokens"])
        return UpstreamRun(tool="prompt-lookup" if lookup else "llama-cpp-python", n_generated=n, decode_s=wall,
                           decode_tokens_per_second=(n / wall) if wall > 0 else 0.0,
                           text=out["choices"][0]["text"], wall_s=wall)

    def close(self) -> None:
        """Free both ``Llama`` objects."""
        for llm in (self.plain, self.lookup):
            try:
                llm.close()
            except Exception:
                pass


def _agrees(ours: str, theirs: str) -> bool:
    """Loose T=0 text check: our output (its first 200 characters, stripped) appears in theirs
    (upstream's tools print the prompt too, and may stop a few tokens later or earlier)."""
    o, t = ours.strip()[:200], theirs.strip()
    return o in t or (bool(t) and t.split("[end of text]")[0].strip() in o and len(t) > 0.5 * len(o))


def side_by_side(report: dict, rendered: list, target: str, drafter: str, *, upstream: bool,
                 prompt_lookup: bool, bins: Optional[Path] = None) -> dict:
    """Run the requested comparisons on the same rendered prompts as ``report``'s requests.

    Args:
        report: The bench report so far (``config``, ``summary``, ``requests``).
        rendered: The prompt text of each request, as our decoder rendered it.
        target / drafter: GGUF paths.
        upstream / prompt_lookup: Which comparisons to run (see the module docstring).
        bins: Folder of the upstream tools (default: :func:`upstream_bin_dir`).

    Returns:
        ``{rows, notes, requests, errors}``: one row per decoder (tokens, tokens/s, tau, ours /
        theirs, T = 0 text agreement), notes with the speedup ratios, per-request runs, and one
        message per comparison that failed while running (empty when all ran).
    """
    c, s = report["config"], report["summary"]
    n, temp, seed, thr, ctx = c["max_new_tokens"], c["temperature"], c["seed"], c["threads"], c["n_ctx"]
    rows, notes, per_req, errors = [], [], [], []
    if upstream:
        try:
            bins = upstream_bin_dir() if bins is None else Path(bins)
            with tempfile.TemporaryDirectory(prefix="dflash2-bench-") as tmp:
                spec_runs, base_runs = [], []
                for i, text in enumerate(rendered):
                    w = Path(tmp) / str(i)
                    spec_runs.append(run_speculative_simple(bins, target, drafter, text, workdir=w, n_predict=n,
                                                            temp=temp, seed=seed, threads=thr, n_ctx=ctx,
                                                            n_draft_max=c["n_draft_max"]))
                    base_runs.append(run_completion(bins, target, text, workdir=w, n_predict=n, temp=temp,
                                                    seed=seed, threads=thr, n_ctx=ctx))
            ns = sum(r.n_generated for r in spec_runs)
            ts = sum(r.decode_s for r in spec_runs)
            na = sum(r.n_accepted for r in spec_runs)
            taus = [r.acceptance_length for r in spec_runs if r.acceptance_length]
            nb = sum(r.n_generated for r in base_runs)
            tb = sum(r.decode_s for r in base_runs)
            up_spec_tps, up_base_tps = ratio(ns, ts), ratio(nb, tb)
            ours_txt = [r["base"]["text"] for r in report["requests"]]
            agree_s = sum(_agrees(o, r.text) for o, r in zip(ours_txt, spec_runs))
            agree_b = sum(_agrees(o, r.text) for o, r in zip(ours_txt, base_runs))
            rows.append(dict(name="llama-speculative-simple (upstream, DFlash)", tokens=ns,
                             tokens_per_second=up_spec_tps,
                             acceptance_length=(sum(taus) / len(taus)) if taus else None,
                             acceptance_length_pooled=ratio(ns, ns - na),
                             ours_over_theirs=ratio(s["spec_decode_tokens_per_second"], up_spec_tps),
                             compared_to="our decode tokens/s with drafter",
                             text_agrees=f"{agree_s}/{len(spec_runs)}" if temp == 0 else None))
            rows.append(dict(name="llama-completion (upstream, plain)", tokens=nb, tokens_per_second=up_base_tps,
                             ours_over_theirs=ratio(s["base_decode_tokens_per_second"], up_base_tps),
                             compared_to="our decode tokens/s, target alone",
                             text_agrees=f"{agree_b}/{len(base_runs)}" if temp == 0 else None))
            up_speedup = ratio(up_spec_tps, up_base_tps)
            notes.append(f"Upstream decode speedup (llama-speculative-simple / llama-completion tokens/s): "
                         f"{fmt(up_speedup)}; ours: {fmt(s['decode_speedup'])} "
                         f"(ratio {fmt(ratio(s['decode_speedup'], up_speedup))}).")
            per_req += [dict(upstream_spec=a.to_dict(), upstream_base=b.to_dict())
                        for a, b in zip(spec_runs, base_runs)]
        except Exception as e:  # keep our own figures; the caller reports the failure
            errors.append(f"upstream side-by-side failed: {type(e).__name__}: {str(e)[:500]}")
    if prompt_lookup:
        try:
            fa = c.get("flash_attn")
            runner = PromptLookupRunner(target, n_ctx=ctx, threads=thr, num_pred_tokens=c["n_draft_max"] or 7,
                                        seed=seed, flash_attn=True if fa is None else bool(fa))
            try:
                if rendered:  # warmup
                    runner.run(rendered[0], lookup=False, n_predict=min(16, n), temp=temp, seed=seed)
                    runner.run(rendered[0], lookup=True, n_predict=min(16, n), temp=temp, seed=seed)
                pl = [(runner.run(t, lookup=False, n_predict=n, temp=temp, seed=seed),
                       runner.run(t, lookup=True, n_predict=n, temp=temp, seed=seed)) for t in rendered]
            finally:
                runner.close()
            nb = sum(a.n_generated for a, _ in pl)
            tb = sum(a.decode_s for a, _ in pl)
            nl = sum(b.n_generated for _, b in pl)
            tl = sum(b.decode_s for _, b in pl)
            notes.append(f"llama-cpp-python prompt-lookup speedup (tokens/s with / without, prefill included): "
                         f"{fmt(ratio(ratio(nl, tl), ratio(nb, tb)))}; ours: {fmt(s['speedup'])}.")
            ours_txt = [r["base"]["text"] for r in report["requests"]]
            agree_p = sum(_agrees(o, a.text) for o, (a, _) in zip(ours_txt, pl))
            agree_l = sum(_agrees(o, b.text) for o, (_, b) in zip(ours_txt, pl))
            rows.append(dict(name="llama-cpp-python Llama (plain)", tokens=nb, tokens_per_second=ratio(nb, tb),
                             ours_over_theirs=ratio(s["base_tokens_per_second"], ratio(nb, tb)),
                             compared_to="our tokens/s, target alone",
                             text_agrees=f"{agree_p}/{len(pl)}" if temp == 0 else None))
            rows.append(dict(name="llama-cpp-python prompt lookup", tokens=nl, tokens_per_second=ratio(nl, tl),
                             ours_over_theirs=ratio(s["spec_tokens_per_second"], ratio(nl, tl)),
                             compared_to="our tokens/s with drafter",
                             text_agrees=f"{agree_l}/{len(pl)}" if temp == 0 else None))
            for i, (a, b) in enumerate(pl):
                if i < len(per_req):
                    per_req[i].update(llama_cpp_python=a.to_dict(), prompt_lookup=b.to_dict())
                else:
                    per_req.append(dict(llama_cpp_python=a.to_dict(), prompt_lookup=b.to_dict()))
        except Exception as e:
            errors.append(f"prompt-lookup side-by-side failed: {type(e).__name__}: {str(e)[:500]}")
    return dict(rows=rows, notes=notes + errors, requests=per_req, errors=errors)
