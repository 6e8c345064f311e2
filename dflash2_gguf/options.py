"""Flags shared by the subcommands (``generate``, ``bench``, ``serve``) and what they map to.

A leaf module: it imports nothing of this package at import time, and only :mod:`.sampling` and
:mod:`.grammar` (and :mod:`.api` in :func:`open_decoder`) when a helper runs, so
:mod:`dflash2_gguf.cli`, :mod:`dflash2_gguf.bench` and :mod:`dflash2_gguf.server.__main__` all
import it without importing one another (``cli`` dispatches to them; nothing imports ``cli``).

- :func:`add_model_args` / :func:`decoder_kwargs` / :func:`open_decoder`: model and context
  flags in llama.cpp's spellings -> :class:`~dflash2_gguf.api.DFlashDecoder` keywords;
- :func:`add_sampling_args` / :func:`sampling_from_args` / :func:`parse_logit_bias`: every
  :class:`~dflash2_gguf.sampling.SamplingParams` field under llama.cpp's flag name;
- :data:`FLASH_ATTN`: the ``-fa`` words (the parser, the decoder keywords and bench's report).
"""

from __future__ import annotations

import argparse

__all__ = ["FLASH_ATTN", "add_model_args", "add_sampling_args", "sampling_from_args", "parse_logit_bias",
           "decoder_kwargs", "open_decoder"]

#: ``-fa`` word -> ``DFlashDecoder(flash_attn=...)`` (None = llama.cpp's auto)
FLASH_ATTN = {"on": True, "off": False, "auto": None}


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
