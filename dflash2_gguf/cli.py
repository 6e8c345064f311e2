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

# The shared flags live in the leaf module .options (bench and serve import them from there);
# re-exported here for callers of the first round's ``dflash2_gguf.cli.decoder_kwargs`` & co.
from .options import (FLASH_ATTN, add_model_args, add_sampling_args, decoder_kwargs, open_decoder,
                      parse_logit_bias, sampling_from_args)

__all__ = ["main", "SUBCOMMANDS", "build_parser", "add_model_args", "add_sampling_args", "sampling_from_args",
           "parse_logit_bias", "decoder_kwargs", "open_decoder", "FLASH_ATTN"]


# ---------------------------------------------------------------------------- generate

def _generate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text (the user message with --chat)")
    add_sampling_args(p, "generate")  # sampling, limits, draft settings: dflash2_gguf/decoder/params.py
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the GGUF's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _generate_run(args: argparse.Namespace) -> int:
    from .decoder.params import sampling_from_values, select, values_from_args

    if args.max_tokens < 1:
        raise SystemExit("error: -n must be >= 1")
    try:
        vals = values_from_args(args, "generate")
        sp = sampling_from_values(vals)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    sampling_names = {p.name for p in select(group="sampling")}
    kw = {k: v for k, v in vals.items() if k not in sampling_names}
    kw["sampling"] = sp
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
                "k_hist": st.k_hist,
                "n_drafter_skipped": st.n_drafter_skipped,
                "predicted_tokens_per_second": st.predicted_tokens_per_second,
                "measured_tokens_per_second": st.measured_tokens_per_second,
                "cost_model": dec.cost_model,
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
                "rollback": st.rollback,
                "n_rollbacks": st.n_rollbacks,
                "n_redecoded": st.n_redecoded,
                "t_rollback_s": st.t_rollback_s,
                "sources": st.sources,
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
                if st.k_hist and dec.has_drafter:
                    print(f"[dflash2-gguf] drafts per cycle (k: cycles) "
                          f"{ {k: n for k, n in enumerate(st.k_hist) if n} }, drafter skipped in "
                          f"{st.n_drafter_skipped} of {st.n_cycles} cycles", file=sys.stderr)
                if dec.has_drafter and (args.verbose or st.rollback != "kv"):
                    print(f"[dflash2-gguf] rollback {st.rollback}: {st.n_rollbacks} cycles rolled back, "
                          f"{st.n_redecoded} tokens decoded again, {1000 * st.t_rollback_s:.1f} ms", file=sys.stderr)
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
    from .bench.cli import add_bench_args  # light: no native code, no llama_cpp at import

    add_bench_args(p)


def _bench_run(args: argparse.Namespace) -> int:
    from .bench.cli import run_from_args

    return run_from_args(args)


#: name -> (help, add_arguments(parser), run(args) -> exit code).
SUBCOMMANDS: dict = {
    "generate": ("generate text with a target GGUF and a dflash drafter GGUF", _generate_args, _generate_run),
    "convert": ("convert an HF DFlash/DFlash 2 checkpoint to GGUF (python -m convert)", _passthrough_args, _convert_run),
    "bench": ("acceptance length and speedup of a drafter on a prompt set", _bench_args, _bench_run),
    "serve": ("OpenAI-compatible HTTP server (llama-server flags)", _serve_args, _serve_run),
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
        p = sub.add_parser(name, help=help_, description=help_, add_help=add_args is not _passthrough_args,
                           allow_abbrev=False)
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
        if argv and argv[0] == "serve":  # llama-server's LLAMA_ARG_* variables and --foo_bar spellings
            from .server.__main__ import prepare_argv

            try:
                argv = ["serve", *prepare_argv(argv[1:])]
            except ValueError as e:
                print(f"dflash2-gguf serve: error: {e}", file=sys.stderr)
                return 2
        args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # RuntimeError: DFlashError and friends
        print(f"dflash2-gguf {args.command}: error: {e}", file=sys.stderr)
        if getattr(args, "json", None) is True:  # `generate --json`: one JSON object on stdout, failures too
            print(json.dumps({"error": {"message": str(e), "type": type(e).__name__}}))
        return 2 if isinstance(e, (FileNotFoundError, ValueError)) else 1


if __name__ == "__main__":
    sys.exit(main())
