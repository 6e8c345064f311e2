"""``dflash2-gguf bench --upstream`` / ``--prompt-lookup`` in an installed package: they run from
the package alone, or stop with the reason and the fix (exit code != 0), never an empty result.

"Installed without the repository" is simulated by a fresh interpreter whose working directory
is a temporary folder, whose ``sys.path`` lacks the repository root, and whose imports of
``benchmarks`` / ``scripts`` fail (a wheel carries neither)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash2_gguf.bench import cli as bench
from dflash2_gguf.bench import compare as bc
from dflash2_gguf.bench.stats import RequestResult, summarize

REPO = Path(__file__).resolve().parents[2]

_NO_REPO = textwrap.dedent("""\
    import importlib.abc, os, sys
    repo = {repo!r}
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != repo]

    class NoRepo(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("benchmarks", "scripts"){extra}:
                raise ImportError(f"{{name}} is not installed (simulated wheel install)")
            return None

    sys.meta_path.insert(0, NoRepo())
    """)


def _site(tmp_path: Path) -> dict:
    """Environment of the child: ``dflash2_gguf`` importable as installed, the repo root not on
    the path. An installed package (editable or not) is used as is; a bare checkout gets a folder
    holding only a link to the package, as site-packages would."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([sys.executable, "-c", "import dflash2_gguf"], cwd=tmp_path, env=env,
                           capture_output=True)
    if probe.returncode != 0:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        if not (site / "dflash2_gguf").exists():
            (site / "dflash2_gguf").symlink_to(REPO / "dflash2_gguf")
        env["PYTHONPATH"] = str(site)
    return env


def _run_installed(tmp_path: Path, body: str, *, block: tuple = (), env: dict | None = None):
    """Run ``body`` in a child as described in the module docstring; ``block`` names more
    top-level modules whose import fails."""
    extra = "".join(f" or name == {b!r} or name.startswith({b + '.'!r})" for b in block)
    code = _NO_REPO.format(repo=os.path.realpath(REPO), extra=extra) + textwrap.dedent(body)
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    e = _site(work)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], cwd=work, env=e, capture_output=True, text=True,
                          timeout=600)


def test_upstream_without_tools_fails_loudly(tmp_path):
    """No upstream tools: exit != 0 before anything loads, naming the tools, where they were
    looked for, and both fixes."""
    empty = tmp_path / "no-tools"
    empty.mkdir()
    body = """
        from dflash2_gguf.cli import main
        rc = main(["bench", "-m", "target.gguf", "-md", "drafter.gguf", "--dataset", "gsm8k",
                   "--n-prompts", "1", "--no-progress", "--out", "out", "--upstream"])
        try:
            import benchmarks
            raise SystemExit("benchmarks importable: the simulation does not hold")
        except ImportError:
            pass
        raise SystemExit(rc)
        """
    proc = _run_installed(tmp_path, body, env={"DFLASH2_GGUF_UPSTREAM_BIN": str(empty)})
    assert proc.returncode not in (0, None), proc.stderr
    err = proc.stderr
    assert "dflash2-gguf bench: error: --upstream needs upstream's llama-speculative-simple and llama-completion" in err
    assert str(empty) in err and "python -m benchmarks.upstream_driver" in err and "DFLASH2_GGUF_UPSTREAM_BIN" in err
    assert "Traceback" not in err
    assert not (tmp_path / "cwd" / "out").exists()  # nothing ran, nothing written


def test_prompt_lookup_without_its_decoder_fails_loudly(tmp_path):
    """llama-cpp-python's prompt-lookup decoder not importable: exit != 0 with the pip fix."""
    body = """
        from dflash2_gguf.cli import main
        raise SystemExit(main(["bench", "-m", "target.gguf", "-md", "drafter.gguf", "--dataset", "gsm8k",
                               "--n-prompts", "1", "--no-progress", "--out", "out", "--prompt-lookup"]))
        """
    proc = _run_installed(tmp_path, body, block=("llama_cpp.llama_speculative",))
    assert proc.returncode not in (0, None), proc.stderr
    assert "--prompt-lookup needs llama-cpp-python's LlamaPromptLookupDecoding" in proc.stderr
    assert "pip install 'llama-cpp-python==0.3.36'" in proc.stderr and "Traceback" not in proc.stderr


def test_requested_comparisons_pass_their_checks_without_the_repo(tmp_path):
    """With the tools at hand (here: stand-ins) and llama-cpp-python installed, both checks pass
    in a package that has no benchmarks/ next to it."""
    bins = _fake_tools(tmp_path / "bin")
    body = """
        import json
        from dflash2_gguf.bench.compare import check_side_by_side
        print(json.dumps(str(check_side_by_side(upstream=True, prompt_lookup=True))))
        """
    proc = _run_installed(tmp_path, body, env={"DFLASH2_GGUF_UPSTREAM_BIN": str(bins)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == str(bins)


# ---------------------------------------------------------------------------- the upstream runner

_SPEC_LOG = ("main: decoded   10 tokens in    0.500 seconds, speed:   20.000 t/s\\n"
             "main: n_drafted = 14\\nmain: n_accept  = 6\\n")
_BASE_LOG = ("llama_perf_context_print:        eval time =  400.00 ms /    10 runs   (   40.00 ms per token,"
             "    25.00 tokens per second)\\n")


def _fake_tools(d: Path, *, fail: bool = False) -> Path:
    """Stand-ins for upstream's two tools: print our text on stdout and upstream's summary lines
    on stderr (or fail with rc 3)."""
    d.mkdir(parents=True, exist_ok=True)
    for tool, log in (("llama-speculative-simple", _SPEC_LOG), ("llama-completion", _BASE_LOG)):
        p = d / tool
        body = 'echo "broken build" >&2; exit 3' if fail else f'printf "The answer is 72."; printf "{log}" >&2'
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return d


def _report() -> dict:
    run = dict(n_generated=11, t_total_s=1.0, t_prefill_s=0.1, tokens_per_second=11.0, decode_tokens_per_second=10.0,
               stop_reason="length", n_cycles=10)
    spec = dict(run, n_drafted=14, n_accepted=6, acceptance_length=1.6, pos_reached=[4, 2], pos_accepted=[2, 1],
                committed=[2, 1, 2, 1, 1, 2, 1, 1], n_cycles=8)
    req = RequestResult(0, 0, 12, dict(run, text="The answer is 72."), spec, True, None)
    config = dict(target="t.gguf", drafter="d.gguf", dataset="gsm8k", n_prompts=1, max_new_tokens=11,
                  temperature=0.0, seed=0, n_draft_max=2, block_size=3, drafter_version=2, threads=1, n_ctx=256,
                  capture_path="layer_inp", flash_attn=None, repack=True)
    return dict(config=config, summary=summarize([req], 3), requests=[req.__dict__])


@pytest.mark.skipif(sys.platform == "win32", reason="shell stand-ins")
def test_upstream_runner_reads_the_tools_output(tmp_path):
    side = bc.side_by_side(_report(), ["<prompt>"], "t.gguf", "d.gguf", upstream=True, prompt_lookup=False,
                           bins=_fake_tools(tmp_path / "bin"))
    assert side["errors"] == []
    spec, base = side["rows"]
    assert spec["name"].startswith("llama-speculative-simple") and spec["tokens"] == 10
    assert spec["tokens_per_second"] == pytest.approx(20.0) and spec["text_agrees"] == "1/1"
    assert base["name"].startswith("llama-completion") and base["tokens_per_second"] == pytest.approx(25.0)
    assert side["requests"][0]["upstream_spec"]["n_accepted"] == 6


@pytest.mark.skipif(sys.platform == "win32", reason="shell stand-ins")
def test_a_comparison_failing_midway_is_an_error(tmp_path, monkeypatch, capsys):
    """A tool that fails while running: the report keeps our figures and names the failure, and
    the command exits 1 after writing them."""
    side = bc.side_by_side(_report(), ["<prompt>"], "t.gguf", "d.gguf", upstream=True, prompt_lookup=False,
                           bins=_fake_tools(tmp_path / "bin", fail=True))
    assert side["rows"] == [] and len(side["errors"]) == 1
    assert "upstream side-by-side failed" in side["errors"][0] and "rc 3" in side["errors"][0]
    assert side["errors"][0] in side["notes"]

    rep = dict(_report(), side_by_side=side)

    def failing_run_bench(*a, **k):
        raise bench.ComparisonFailed(rep, side["errors"])

    monkeypatch.setattr(bench, "run_bench", failing_run_bench)
    args = bench_parser().parse_args(["-m", "t.gguf", "-md", "d.gguf", "--dataset", "gsm8k", "--upstream",
                                      "--out", str(tmp_path / "out")])
    assert bench.run_from_args(args) == 1
    out, err = capsys.readouterr()
    assert "| target + drafter |" in out and "upstream side-by-side failed" in out
    assert "dflash2-gguf bench: error: upstream side-by-side failed" in err


def bench_parser():
    import argparse

    p = argparse.ArgumentParser()
    bench.add_bench_args(p)
    return p


# ---------------------------------------------------------------------------- a real run

@pytest.mark.native
@pytest.mark.slow
def test_prompt_lookup_runs_without_the_repo(native_ext, smollm2_gguf, smollm2_drafters, tmp_path):
    """``bench --prompt-lookup`` from an installed package: llama-cpp-python's two rows are there."""
    out = tmp_path / "out"
    body = f"""
        from dflash2_gguf.cli import main
        raise SystemExit(main(["bench", "-m", {str(smollm2_gguf)!r}, "-md", {str(smollm2_drafters[2])!r},
                               "--dataset", "gsm8k", "--n-prompts", "1", "--max-new-tokens", "4", "--temp", "0",
                               "-t", "1", "-c", "512", "--no-progress", "--no-warmup", "--prompt-lookup",
                               "--out", {str(out)!r}]))
        """
    proc = _run_installed(tmp_path, body, env={"OMP_WAIT_POLICY": "passive"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads((out / "bench.json").read_text())["side_by_side"]
    assert side["errors"] == []
    assert [r["name"] for r in side["rows"]] == ["llama-cpp-python Llama (plain)", "llama-cpp-python prompt lookup"]
    assert all(r["tokens"] > 0 for r in side["rows"])


@pytest.mark.native
def test_prompt_lookup_runs_past_n_batch_tokens(smollm2_gguf):
    """llama-cpp-python's prompt lookup on a request longer than its n_batch (512 tokens): with
    ``logits_all=False`` its scores buffer had n_batch rows while the draft model's decode writes
    every row's logits, so the 513th row failed ("could not broadcast input array"; MT-Bench's
    long second turns in BENCHMARKS.md). It runs, and at T = 0 gives the plain ``Llama``'s text."""
    pytest.importorskip("llama_cpp")
    runner = bc.PromptLookupRunner(smollm2_gguf, n_ctx=1024, threads=1, num_pred_tokens=7)
    try:
        story = " ".join(f"Box {i} holds {i * 7 % 13} red apples and {i * 5 % 11} green ones." for i in range(40))
        prompt = (f"<|im_start|>user\n{story}\nList the boxes with more than 10 red apples."
                  f"<|im_end|>\n<|im_start|>assistant\n")
        n_prompt = len(runner.plain.tokenize(prompt.encode(), add_bos=True, special=True))
        assert 512 < n_prompt < 1024 - 48
        plain = runner.run(prompt, lookup=False, n_predict=32)
        lookup = runner.run(prompt, lookup=True, n_predict=32)
    finally:
        runner.close()
    assert plain.n_generated == lookup.n_generated == 32
    assert lookup.text == plain.text
