"""Command line: ``dflash2-gguf <subcommand> ...`` (console script, ``main(argv=None)``).

Subcommands are registered in :data:`SUBCOMMANDS` (name -> (help, add_arguments, run)); each
imports its heavy modules only when it runs. Flags equal the library's keywords where one exists
(llama.cpp spellings for the model flags: ``-m``, ``-md``, ``-c``, ``-t``, ``-ngl``).

    dflash2-gguf generate -m TARGET.gguf -md DRAFT.gguf -p "Hello" -n 64 --temp 0 --json
    dflash2-gguf generate -m TARGET.gguf -md none -p "Hello" -n 64        # target alone
    dflash2-gguf convert ...                                              # = python -m convert
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

__all__ = ["main", "SUBCOMMANDS", "build_parser", "add_model_args", "add_sampling_args", "sampling_from_args", "parse_logit_bias", "decoder_kwargs", "FLASH_ATTN"]


# ---------------------------------------------------------------------------- shared helpers

def add_model_args(p: argparse.ArgumentParser, *, drafter_required: bool = True) -> None:
    """``-m/-md/-c/-cd/-t/-td/-ngl/-ngld/-fa/-nr`` (model and context flags shared by subcommands)."""
    p.add_argument("-m", "--model", required=True, help="target model GGUF")
    p.add_argument("-md", "--model-draft", required=drafter_required, default=None,
                   help="dflash drafter GGUF, or 'none' for the target alone")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="target context size (tokens)")
    p.add_argument("-cd", "--ctx-size-draft", type=int, default=None, help="drafter context size")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("-td", "--threads-draft", type=int, default=None, help="drafter CPU threads")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="target layers on GPU (-1 = all)")
    p.add_argument("-ngld", "--n-gpu-layers-draft", type=int, default=None, help="drafter layers on GPU")
    p.add_argument("-fa", "--flash-attn", choices=tuple(FLASH_ATTN), default="auto",
                   help="flash attention, both models (default: llama.cpp's auto)")
    p.add_argument("-nr", "--no-repack", action="store_true", help="disable CPU weight repacking, both models")
    p.add_argument("--capture", choices=("auto", "layer_inp", "cb_eval"), default="auto",
                   help="target feature capture path (default: from the target architecture)")
    p.add_argument("-v", "--verbose", action="store_true", help="print llama.cpp's log to stderr")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Every :class:`~dflash2_gguf.sampling.SamplingParams` option under llama.cpp's flag names:
    the scalar ones from the fields' metadata (one place to add a knob), plus ``-l/--logit-bias``,
    ``--grammar``, ``--grammar-file``, ``-j/--json-schema`` and ``-jf/--json-schema-file``.
    Defaults: the dataclass's (llama-cpp-python's)."""
    import dataclasses

    from .sampling import SamplingParams

    for f in dataclasses.fields(SamplingParams):
        meta = f.metadata
        if "flag" in meta:
            typ = float if f.type in ("float", float) else int
            p.add_argument(meta["flag"], dest=meta["flag"].lstrip("-").replace("-", "_"), type=typ,
                           default=f.default, help=f"{meta['help']} (default: {f.default})")
    p.add_argument("-l", "--logit-bias", action="append", default=None, metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to the logit of TOKEN_ID, e.g. '15043+1' or '15043-inf' (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--grammar", default=None, help="GBNF grammar the output must follow (root rule 'root')")
    g.add_argument("--grammar-file", default=None, help="file with a GBNF grammar")
    g.add_argument("-j", "--json-schema", default=None, help="JSON schema the output must follow (e.g. '{}' = any JSON)")
    g.add_argument("-jf", "--json-schema-file", default=None, help="file with a JSON schema")


def parse_logit_bias(items) -> dict:
    """llama.cpp's ``-l TOKEN_ID(+/-)BIAS`` strings -> ``{token id: bias}`` (``-inf`` bans).

    Raises:
        ValueError: an item that is not of that form (the message shows the expected one).
    """
    import re

    out = {}
    for it in items or []:
        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*", str(it))
        if not m:
            raise ValueError(f"logit bias {it!r}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf")
        v = float(m.group(3))
        out[int(m.group(1))] = -v if m.group(2) == "-" else v
    return out


def sampling_from_args(args: argparse.Namespace):
    """The :class:`~dflash2_gguf.sampling.SamplingParams` of :func:`add_sampling_args` flags.

    Raises:
        SystemExit: an unreadable grammar / schema file, a bad logit bias or schema.
    """
    import dataclasses

    from .grammar import json_schema_to_grammar
    from .sampling import SamplingParams

    kw = {}
    for f in dataclasses.fields(SamplingParams):
        if "flag" in f.metadata:
            kw[f.name] = getattr(args, f.metadata["flag"].lstrip("-").replace("-", "_"))
    try:
        kw["logit_bias"] = parse_logit_bias(args.logit_bias) or None
        if args.grammar_file:
            kw["grammar"] = open(args.grammar_file, encoding="utf-8").read()
        elif args.grammar:
            kw["grammar"] = args.grammar
        schema = args.json_schema
        if args.json_schema_file:
            schema = open(args.json_schema_file, encoding="utf-8").read()
        if schema is not None:
            kw["grammar"] = json_schema_to_grammar(schema)
        return SamplingParams(**kw)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from e


#: ``-fa`` word -> ``DFlashDecoder(flash_attn=...)`` (None = llama.cpp's auto)
FLASH_ATTN = {"on": True, "off": False, "auto": None}


def decoder_kwargs(args: argparse.Namespace) -> dict:
    """:class:`~dflash2_gguf.api.DFlashDecoder` keywords from :func:`add_model_args` flags (all
    but the two paths)."""
    return dict(n_ctx=args.ctx_size, n_ctx_draft=args.ctx_size_draft, n_threads=args.threads,
                n_threads_draft=args.threads_draft, n_gpu_layers=args.n_gpu_layers,
                n_gpu_layers_draft=args.n_gpu_layers_draft,
                flash_attn=FLASH_ATTN[args.flash_attn], repack=not args.no_repack,
                capture=args.capture, verbose=args.verbose)


def open_decoder(args: argparse.Namespace):
    """Build a :class:`~dflash2_gguf.api.DFlashDecoder` from :func:`add_model_args` flags."""
    from .api import DFlashDecoder

    md = args.model_draft
    drafter = None if md is None or str(md).lower() == "none" else md
    return DFlashDecoder(args.model, drafter, **decoder_kwargs(args))


# ---------------------------------------------------------------------------- generate

def _generate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text (the user message with --chat)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="maximum new tokens")
    add_sampling_args(p)
    p.add_argument("--spec-draft-n-max", type=int, default=None,
                   help="drafts verified per cycle (default: block size - 1; the full block is always drafted)")
    p.add_argument("--spec-draft-p-min", type=float, default=0.0, help="stop reading drafts below this probability")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the GGUF's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _generate_run(args: argparse.Namespace) -> int:
    if args.n_predict < 1:
        raise SystemExit("error: -n must be >= 1")
    sp = sampling_from_args(args)
    kw = dict(max_tokens=args.n_predict, sampling=sp, stop=args.stop, n_draft_max=args.spec_draft_n_max,
              p_min=args.spec_draft_p_min, ignore_eos=args.ignore_eos)
    if args.chat:
        kw["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    with open_decoder(args) as dec:
        if args.json:
            res = dec.generate(prompt, **kw)
            st = res.stats
            out = {
                "text": res.text,
                "tokens": res.tokens,
                "from_draft": res.from_draft,
                "n_prompt": st.n_prompt,
                "n_generated": st.n_generated,
                "n_cycles": st.n_cycles,
                "n_drafted": st.n_drafted,
                "n_accepted": st.n_accepted,
                "acceptance_length": st.acceptance_length,
                "per_position_acceptance": [None if x != x else x for x in st.per_position_acceptance],
                "tokens_per_second": st.tokens_per_second,
                "decode_tokens_per_second": st.decode_tokens_per_second,
                "t_prefill_s": st.t_prefill_s, "t_target_s": st.t_target_s, "t_draft_s": st.t_draft_s,
                "t_inject_s": st.t_inject_s, "t_total_s": st.t_total_s,
                "stop_reason": st.stop_reason,
                "n_cached": st.n_cached,
                "logprobs": None if res.logprobs is None else [
                    {"token": lp.token, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]} for lp in res.logprobs],
                "drafter_version": dec.drafter_version,
                "capture_path": dec.capture_path,
            }
            print(json.dumps(out))
        else:
            st = None
            for ch in dec.generate(prompt, stream=True, **kw):
                sys.stdout.write(ch.text)
                sys.stdout.flush()
                st = ch.stats
            sys.stdout.write("\n")
            if st is not None:
                print(f"[dflash2-gguf] {st.n_generated} tokens, {st.tokens_per_second:.2f} tok/s, "
                      f"acceptance length {st.acceptance_length:.3f}, accepted {st.n_accepted}/{st.n_drafted}",
                      file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- convert

def _convert_run(args: argparse.Namespace) -> int:
    from convert.__main__ import main as convert_main

    rc = convert_main(list(args.rest))
    return int(rc or 0)


def _inspect_run(args: argparse.Namespace) -> int:
    from convert.__main__ import main as convert_main

    return int(convert_main(["inspect", *args.rest]) or 0)


# ---------------------------------------------------------------------------- train

def _train_run(args: argparse.Namespace) -> int:
    from .train.cli import main as train_main

    return int(train_main(list(args.rest)) or 0)


def _passthrough_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the delegated command (see its --help)")


# ---------------------------------------------------------------------------- serve

def _serve_args(p: argparse.ArgumentParser) -> None:
    from .server.__main__ import add_arguments

    add_arguments(p)


def _serve_run(args: argparse.Namespace) -> int:
    from .server.__main__ import run

    return run(args)


# ---------------------------------------------------------------------------- bench

def _bench_args(p: argparse.ArgumentParser) -> None:
    from .bench import add_bench_args  # light: no native code, no llama_cpp at import

    add_bench_args(p)


def _bench_run(args: argparse.Namespace) -> int:
    from .bench import run_from_args

    return run_from_args(args)


#: name -> (help, add_arguments(parser), run(args) -> exit code).
SUBCOMMANDS: dict = {
    "generate": ("generate text with a target GGUF and a dflash drafter GGUF", _generate_args, _generate_run),
    "convert": ("convert an HF DFlash/DFlash 2 checkpoint to GGUF (python -m convert)", _passthrough_args, _convert_run),
    "bench": ("acceptance length and speedup of a drafter on a prompt set", _bench_args, _bench_run),
    "serve": ("OpenAI-compatible HTTP server (llama-server flags; needs the server extra)", _serve_args, _serve_run),
    "train": ("train a DFlash 2 drafter for a GGUF target (python -m dflash2_gguf.train; needs torch)",
              _passthrough_args, _train_run),
    "inspect": ("summarise a drafter GGUF and check it against a target (python -m convert inspect)",
                _passthrough_args, _inspect_run),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    ap = argparse.ArgumentParser(prog="dflash2-gguf", description="DFlash / DFlash 2 speculative decoding on GGUF")
    ap.add_argument("--version", action="version", version=f"dflash2-gguf {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add_args, run) in SUBCOMMANDS.items():
        # Delegating subcommands hand every argument, --help included, to the delegate.
        p = sub.add_parser(name, help=help_, description=help_, add_help=add_args is not _passthrough_args)
        add_args(p)
        p.set_defaults(_run=run)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``dflash2-gguf`` console script. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in SUBCOMMANDS and SUBCOMMANDS[argv[0]][1] is _passthrough_args:
        # argparse's REMAINDER cannot capture a leading "--help": hand the raw arguments over.
        args = argparse.Namespace(command=argv[0], rest=argv[1:], _run=SUBCOMMANDS[argv[0]][2])
    else:
        args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"dflash2-gguf {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # DFlashError and friends
        print(f"dflash2-gguf {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
