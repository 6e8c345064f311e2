"""The one table of generation parameters (dflash2_gguf/decoder/params.py) and llama-server's command line
(issue 44 items 1 and 2): every derived place follows the table; ``serve`` parses every option of
the pinned llama-server and reads its ``LLAMA_ARG_*`` variables (command line first)."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash2_gguf.decoder import params as P

pytest.importorskip("fastapi")

from dflash2_gguf.server import llama_args  # noqa: E402
from fakes import FakeDecoder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _serve(argv, environ=None):
    """``dflash2-gguf serve ARGV`` parsed as the console script parses it (variables from
    ``environ`` only)."""
    from dflash2_gguf.cli import build_parser
    from dflash2_gguf.server.__main__ import prepare_argv

    return build_parser().parse_args(["serve", *prepare_argv(argv, environ or {})])


def _settings(argv, environ=None):
    from dflash2_gguf.server.__main__ import settings_from_args

    lines = []
    s = settings_from_args(_serve(argv, environ), warn=lines.append)
    return s, lines


@pytest.fixture
def gguf(tmp_path):
    t = tmp_path / "t.gguf"
    t.write_bytes(b"x")
    return str(t)


# ---------------------------------------------------------------------------- the table itself

def test_table_matches_llama_cpp_spellings_and_variables():
    """Each entry's flags are all of llama.cpp's spellings of that option, and its variable is
    llama.cpp's (server/llama_server_options.json, generated from common/arg.cpp at 0c1e570)."""
    checked = 0
    for p in P.PARAMS:
        if not p.flags:
            continue
        try:
            spell = llama_args.spellings(p.flags[0])
        except KeyError:  # ours (--n-probs, --stop, --spec-draft-adaptive)
            assert p.env is None, p.name
            continue
        opt = next(o for o in llama_args.options() if p.flags[0] in o["args"])
        assert set(p.flags) == set(spell), p.name
        assert p.env == opt["env"], p.name
        checked += 1
    assert checked >= 18


def test_sampling_params_and_native_fields_come_from_the_table():
    from dflash2_gguf.decoder.sampling import SamplingParams

    assert [f.name for f in dataclasses.fields(SamplingParams)] == [p.name for p in P.select(group="sampling")]
    assert SamplingParams().presence_penalty == P.by_name("presence_penalty").default == 0.0
    for p in P.PARAMS:
        assert p.native is None or p.native.split(".")[0] in ("SamplingOptions", "GenParams"), p.name


@pytest.mark.native
def test_native_fields_exist(native_ext):
    from dflash2_gguf._native_loader import native

    n = native()
    for p in P.PARAMS:
        if p.native:
            struct, fld = p.native.split(".")
            assert hasattr(getattr(n, struct)(), fld), p.native


@pytest.mark.native
def test_ngram_defaults_are_the_native_ones(native_ext):
    """generate() leaves the n-gram fields at native NgramParams' defaults unless given: the table
    states the same values (llama.cpp's, except simple_size_n)."""
    from dflash2_gguf._native_loader import native

    ng = native().NgramParams()
    names = [p.name for p in P.PARAMS if p.name.startswith("spec_ngram_")]
    assert len(names) == 5
    for name in names:
        assert P.by_name(name).default == getattr(ng, name[len("spec_ngram_"):]), name


def test_request_names_are_fields_of_the_request_models():
    from dflash2_gguf.server.types import ChatCompletionRequest, CompletionRequest

    def names(model):
        out = set()
        for name, f in model.model_fields.items():
            out |= {name, f.alias or name}
        return out

    for api, model in (("completion", CompletionRequest), ("chat", ChatCompletionRequest)):
        for p in P.select(api=api):
            for name in p.request[api]:
                assert name in names(model), (api, p.name, name)


def test_no_signature_sniffing_left():
    files = ("app.py", "compat.py", "routes_llama.py", "routes_openai.py", "routes_anthropic.py")
    src = "".join((ROOT / "dflash2_gguf" / "server" / f).read_text() for f in files)
    assert "inspect.signature" not in src and "_generate_accepts" not in src and "_template_kwargs(" not in src
    assert "sampling_fields" not in src and "lacks" not in src


# ---------------------------------------------------------------------------- serve's sampling flags (the bug)

def test_serve_sampling_flags_reach_the_settings(gguf, tmp_path):
    g = tmp_path / "g.gbnf"
    g.write_text('root ::= "yes" | "no"')
    s, _ = _settings(["-m", gguf, "--presence-penalty", "1.5", "--frequency-penalty", "0.5", "--repeat-penalty",
                      "1.2", "--repeat-last-n", "32", "-l", "15+2", "-l", "16-inf", "--grammar-file", str(g),
                      "--ignore-eos", "--top-k", "7", "--temperature", "0.25", "-s", "-1", "-n", "12",
                      "--spec-draft-p-min", "0.3", "--spec-draft-adaptive", "off"])
    assert (s.presence_penalty, s.frequency_penalty, s.repeat_penalty, s.repeat_last_n) == (1.5, 0.5, 1.2, 32)
    assert s.logit_bias == {15: 2.0, 16: float("-inf")} and s.grammar == 'root ::= "yes" | "no"'
    assert (s.ignore_eos, s.top_k, s.temperature, s.seed, s.max_tokens) == (True, 7, 0.25, None, 12)
    assert (s.p_min, s.adaptive) == (0.3, False)
    s, _ = _settings(["-m", gguf, "-j", '{"type": "object"}'])
    assert "root" in s.grammar
    with pytest.raises(ValueError, match="top_p"):
        _settings(["-m", gguf, "--top-p", "0"])


def test_serve_defaults_reach_requests_and_props(tmp_path):
    """A request that sets no penalty gets the server's --presence-penalty; one that sets it wins;
    /props reports the server's."""
    from fastapi.testclient import TestClient

    from dflash2_gguf.server.app import ServerSettings, create_app

    dec = FakeDecoder()
    s = ServerSettings(model=str(tmp_path / "none.gguf"), presence_penalty=1.5, logit_bias={3: -1.0}, max_tokens=5)
    with TestClient(create_app(s, load=lambda: dec)) as c:
        assert c.post("/completion", json={"prompt": "hi"}).status_code == 200
        sp = dec.calls[-1]["sampling"]
        assert (sp.presence_penalty, sp.logit_bias, dec.calls[-1]["max_tokens"]) == (1.5, {3: -1.0}, 5)
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.25,
                                             "logit_bias": {"4": 2}})
        assert dec.calls[-1]["sampling"].presence_penalty == 0.25
        assert dec.calls[-1]["sampling"].logit_bias == {3: -1.0, 4: 2.0}
        dp = c.get("/props").json()["default_generation_settings"]["params"]
        assert (dp["presence_penalty"], dp["n_predict"], dp["speculative.adaptive"]) == (1.5, 5, True)


# ---------------------------------------------------------------------------- a new entry reaches everything

_THROWAWAY = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {root!r})
    from dflash2_gguf.decoder import params as P
    P.PARAMS.append(P.Param("zeta_p", float, 0.25, "a throwaway sampling parameter", "sampling",
                            flags=("--zeta-p",), request=P._api("zeta_p"), native="SamplingOptions.zeta_p",
                            props="zeta_p", bounds=dict(ge=0.0, le=1.0)))
    from fastapi.testclient import TestClient
    from dflash2_gguf.cli import build_parser
    from dflash2_gguf.options import sampling_from_args
    from dflash2_gguf.decoder.sampling import SamplingParams
    from dflash2_gguf.server.__main__ import settings_from_args
    from dflash2_gguf.server.app import create_app
    sys.path.insert(0, {tests!r})
    from fakes import FakeDecoder
    out = {{"default": SamplingParams().zeta_p}}
    bp = build_parser()
    out["generate"] = sampling_from_args(bp.parse_args(["generate", "-m", "t", "-md", "none", "-p", "x",
                                                         "--zeta-p", "0.5"])).zeta_p
    out["bench"] = bp.parse_args(["bench", "-m", "t", "-md", "d", "--dataset", "gsm8k", "--zeta-p", "0.6"]).zeta_p
    s = settings_from_args(bp.parse_args(["serve", "-m", {gguf!r}, "--zeta-p", "0.7"]), warn=print)
    out["serve"] = s.zeta_p
    dec = FakeDecoder()
    with TestClient(create_app(s, load=lambda: dec)) as c:
        out["props"] = c.get("/props").json()["default_generation_settings"]["params"]["zeta_p"]
        msgs = [{{"role": "user", "content": "hi"}}]
        for path, body in (("/completion", {{"prompt": "x"}}), ("/v1/completions", {{"prompt": "x", "zeta_p": 0.1}}),
                           ("/v1/chat/completions", {{"messages": msgs, "zeta_p": 0.2}}),
                           ("/v1/responses", {{"input": "hi", "zeta_p": 0.3}}),
                           ("/v1/messages", {{"messages": msgs, "max_tokens": 4, "zeta_p": 0.4}})):
            r = c.post(path, json=body)
            out[path] = [r.status_code, dec.calls[-1]["sampling"].zeta_p]
        r = c.post("/completion", json={{"prompt": "x", "zeta_p": 2}})
        out["out_of_range"] = [r.status_code, r.json()["error"].get("param")]
        out["slot_params"] = c.get("/slots").json()[0]["params"]["zeta_p"]
    print(json.dumps(out))
''')


def test_a_new_table_entry_reaches_flags_requests_and_props(gguf):
    code = _THROWAWAY.format(root=str(ROOT), tests=str(ROOT / "tests"), gguf=gguf)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["default"] == 0.25
    assert (got["generate"], got["bench"], got["serve"], got["props"]) == (0.5, 0.6, 0.7, 0.7)
    assert got["/completion"] == [200, 0.7]  # a request without it: the server's flag
    assert got["/v1/completions"] == [200, 0.1] and got["/v1/chat/completions"] == [200, 0.2]
    assert got["/v1/responses"] == [200, 0.3] and got["/v1/messages"] == [200, 0.4]
    assert got["out_of_range"] == [400, "zeta_p"] and got["slot_params"] == 0.4  # /slots: the last request's


# ---------------------------------------------------------------------------- every llama-server option

#: A value per option that takes one, where "1" / "x" would not do.
_VALUES = {
    "-fa": "on", "--spec-type": "none", "-rea": "on", "--reasoning-format": "none", "--spec-draft-model": "none",
    "--chat-template": "{{ messages }}", "--chat-template-kwargs": '{"enable_thinking": false}',
    "--grammar": 'root ::= "a"', "-j": "{}", "-l": "15+1", "--temp": "0.5", "--top-p": "0.9", "--min-p": "0.1",
    "--repeat-penalty": "1.1", "--presence-penalty": "0.5", "--frequency-penalty": "0.5",
    "--spec-draft-p-min": "0.5", "-ngl": "all", "--spec-draft-ngl": "auto", "--spec-draft-adaptive": "on",
}
_FILES = {"--chat-template-file": "{{ messages }}", "--api-key-file": "k1\n", "--grammar-file": 'root ::= "a"',
          "-jf": "{}"}


def _argv_for(o, flag, tmp_path, gguf):
    if not o["values"]:
        return [flag]
    first = o["args"][0]
    if first == "-m":
        return [flag, gguf]
    if first in _FILES:
        f = tmp_path / ("f" + str(abs(hash(first))))
        f.write_text(_FILES[first])
        return [flag, str(f)]
    if first in ("--ssl-key-file", "--ssl-cert-file"):
        return ["--ssl-key-file", "k.pem", "--ssl-cert-file", "c.pem"] if flag != "--ssl-cert-file" else \
            ["--ssl-cert-file", "c.pem", "--ssl-key-file", "k.pem"]
    if first in _VALUES:
        return [flag, _VALUES[first]]
    if first == "--path":  # a folder that exists (llama-server refuses a missing one too)
        return [flag, str(tmp_path)]
    return [flag, *(["1"] * len(o["values"]))]


def test_every_llama_server_option_is_accepted(gguf, tmp_path, capsys):
    """Each spelling of each option of the pinned llama-server (server/llama_server_options.json)
    parses; each either works, is ignored with one warning line naming it, or (a value that
    would change results here, an option llama.cpp removed) is refused with the reason."""
    opts = llama_args.options()
    assert len(opts) > 200 and any(o["args"][0] == "-tb" for o in opts)
    n_warn = n_refused = 0
    for o in opts:
        first = o["args"][0]
        for flag in list(o["args"]) + list(o["args_neg"]):
            argv = ["-m", gguf] + _argv_for(o, flag, tmp_path, gguf)
            if flag in ("-h", "--help", "--usage", "--version"):
                with pytest.raises(SystemExit) as e:
                    _serve(argv)
                assert e.value.code == 0
                continue
            args = _serve(argv)  # never an argparse error
            try:
                _, lines = _settings(argv)
            except ValueError as e:
                assert o["removed"] or first in llama_args.REFUSED, (flag, str(e))
                assert (o["removed"] or "not supported") in str(e) or "removed" in str(e)
                n_refused += 1
                continue
            assert args is not None
            named = [ln for ln in lines if f" {o['args'][0]}" in ln]
            assert len(named) <= 1, lines
            n_warn += bool(named)
    assert n_warn > 100 and n_refused > 20


def test_refused_options_accept_their_neutral_value(gguf):
    _, lines = _settings(["-m", gguf, "--mirostat", "0", "--top-nsigma", "-1", "--reasoning-budget", "-1",
                          "--no-skip-chat-parsing", "--prefill-assistant"])
    assert lines == []
    for argv, msg in ((["--mirostat", "2"], "Mirostat"), (["--lora", "a.gguf"], "LoRA"),
                      (["--no-prefill-assistant"], "continued"), (["-hf", "x/y"], "never downloads"),
                      (["--draft-max", "4"], "removed")):
        with pytest.raises(ValueError, match=msg):
            _settings(["-m", gguf, *argv])


def test_multi_letter_short_options_are_not_prefixes(gguf):
    """argparse would read ``-tb 2`` as ``-t b`` and ``-ctk q8_0`` as ``-c tk``: every llama.cpp
    spelling is declared and abbreviations are off."""
    a = _serve(["-m", gguf, "-tb", "2", "-ctk", "q8_0", "-t", "3", "-np", "2", "-ngld", "5"])
    assert (a._llama_tb, a._llama_ctk, a.threads, a.parallel, a.n_gpu_layers_draft) == ("2", "q8_0", 3, 2, 5)
    with pytest.raises(SystemExit):
        _serve(["-m", gguf, "--presence-pen", "1.5"])  # no abbreviations
    assert _serve(["-m", gguf, "--presence_penalty", "1.5"]).presence_penalty == 1.5  # llama.cpp's _ -> -


def test_llama_arg_variables_and_precedence(gguf):
    env = {"LLAMA_ARG_MODEL": gguf, "LLAMA_ARG_PRESENCE_PENALTY": "1.5", "LLAMA_ARG_TEMPERATURE": "0.1",
           "LLAMA_ARG_CTX_SIZE": "256", "LLAMA_ARG_NO_JINJA": "1", "LLAMA_ARG_BATCH": "64",
           "LLAMA_ARG_CONT_BATCHING": "off", "LLAMA_API_KEY": "k", "LLAMA_ARG_SPEC_DRAFT_N_MAX": "3",
           "LLAMA_ARG_ENDPOINT_SLOTS": "false", "LLAMA_ARG_N_PARALLEL": "2"}
    err = io.StringIO()
    from dflash2_gguf.server.__main__ import settings_from_args

    argv = llama_args.argv_with_env(["--temp", "0.5"], env, stderr=err)
    from dflash2_gguf.cli import build_parser

    lines = []
    s = settings_from_args(build_parser().parse_args(["serve", *argv]), warn=lines.append)
    assert s.model == gguf and s.temperature == 0.5  # the command line wins ...
    assert "LLAMA_ARG_TEMPERATURE environment variable is set, but will be overwritten" in err.getvalue()
    assert (s.presence_penalty, s.n_ctx, s.jinja, s.api_key, s.n_draft_max) == (1.5, 256, False, "k", 3)
    assert (s.endpoint_slots, s.n_slots) == (False, 2)
    assert s.n_batch == 64 and not any("-b/--batch-size" in ln for ln in lines)  # LLAMA_ARG_BATCH is used
    assert any("-cb/--cont-batching" in ln for ln in lines)
    with pytest.raises(ValueError, match="invalid boolean"):
        llama_args.argv_with_env([], {"LLAMA_ARG_JINJA": "maybe"})


def test_batch_sizes_and_cache_ram_reach_the_decoder(gguf, monkeypatch):
    """``-b``, ``-ub`` and ``--cache-ram`` work as in llama-server: the target's prefill chunk is
    min(-b, -ub) (defaults 2048 and 512), ``--cache-ram`` is each slot's RAM prompt cache in MiB
    (-1 no limit, 0 off); no "ignoring" warning; the values are the decoder's keywords."""
    from dflash2_gguf.server.__main__ import CACHE_RAM_NO_LIMIT_MIB

    s, lines = _settings(["-m", gguf])
    assert (s.n_batch, s.cache_ram_mib) == (512, 1024)
    s, lines = _settings(["-m", gguf, "-b", "256", "--ubatch-size", "1024", "--cache-ram", "64"])
    assert (s.n_batch, s.cache_ram_mib) == (256, 64) and lines == []
    s, lines = _settings(["-m", gguf, "--batch-size", "4096", "-ub", "128", "-cram", "-1"])
    assert (s.n_batch, s.cache_ram_mib) == (128, CACHE_RAM_NO_LIMIT_MIB) and lines == []
    s, _ = _settings(["-m", gguf, "-ub", "32", "-cram", "0"], {"LLAMA_ARG_BATCH": "16"})
    assert (s.n_batch, s.cache_ram_mib) == (16, 0)
    for bad, match in ((["-b", "0"], "batch-size"), (["-ub", "-3"], "ubatch-size"), (["--cache-ram", "-2"], "cache-ram")):
        with pytest.raises(ValueError, match=match):
            _settings(["-m", gguf, *bad])

    got = {}

    class Recorder:
        def __init__(self, target, drafter=None, **kw):
            got.update(kw, target=target, drafter=drafter)

    import dflash2_gguf.decoder.api

    monkeypatch.setattr(dflash2_gguf.decoder.api, "DFlashDecoder", Recorder)
    s, _ = _settings(["-m", gguf, "-b", "100", "-ub", "200", "--cache-ram", "48"])
    s.load_decoder()
    assert (got["target"], got["n_batch"], got["cache_ram_mib"]) == (gguf, 100, 48)


def test_console_script_reads_variables(gguf, monkeypatch, capsys):
    """``dflash2-gguf serve`` reads the variables (here one with a value refused before anything
    loads; LLAMA_ARG_CONTEXT_SHIFT=1 is read as --context-shift)."""
    from dflash2_gguf.cli import build_parser, main
    from dflash2_gguf.server.__main__ import prepare_argv

    monkeypatch.setenv("LLAMA_ARG_CONTEXT_SHIFT", "1")
    assert build_parser().parse_args(["serve", *prepare_argv(["-m", gguf])]).context_shift is True
    monkeypatch.setenv("LLAMA_ARG_CONTEXT_SHIFT", "sometimes")
    assert main(["serve", "-m", gguf]) == 2
    assert "LLAMA_ARG_CONTEXT_SHIFT" in capsys.readouterr().err


def test_generator_reproduces_the_committed_file(tmp_path):
    """scripts/gen_llama_server_options.py on the pinned arg.cpp writes the committed JSON (when
    the pinned source is at hand: the one `python -m benchmarks.upstream_driver` builds from)."""
    from benchmarks.upstream_driver import build_dir

    src = build_dir() / "llama.cpp" / "common" / "arg.cpp"
    if not src.is_file():
        pytest.skip("llama.cpp 0c1e570's common/arg.cpp not at hand")
    out = tmp_path / "o.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_llama_server_options.py"), "--arg-cpp", str(src),
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    assert json.loads(out.read_text()) == json.loads(llama_args.DATA_FILE.read_text())


def test_bench_flags_reach_run_bench(monkeypatch, capsys):
    """bench's sampling and draft flags come from the table and reach the run (default: temperature
    only, as before); a side-by-side comparison refuses sampling it cannot reproduce."""
    from dflash2_gguf.bench import cli as bench
    from dflash2_gguf.cli import main

    seen = {}

    class _Stop(Exception):
        pass

    def fake_run_bench(*a, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    base = ["bench", "-m", "t.gguf", "-md", "d.gguf", "--dataset", "gsm8k"]
    with pytest.raises(_Stop):
        main(base + ["--max-new-tokens", "9", "--presence-penalty", "0.5", "--spec-draft-p-min", "0.2"])
    sp = seen["sampling"]
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.presence_penalty) == (0.0, 0, 1.0, 0.0, 0.5)
    assert seen["max_new_tokens"] == 9 and seen["generate_kwargs"]["p_min"] == 0.2 and seen["seed"] == 0
    assert main(base + ["--upstream", "--top-k", "5"]) == 2
    assert "--temp alone" in capsys.readouterr().err
