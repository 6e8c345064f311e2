"""Flags shared by the subcommands (``generate``, ``bench``, ``serve``) and what they map to.

A leaf module: it imports nothing of this package at import time, and only :mod:`.decoder.params`,
:mod:`.decoder.sampling` and :mod:`.chat.grammar` (and :mod:`.decoder.api` in :func:`open_decoder`)
when a helper runs, so :mod:`dflash2_gguf.cli`, :mod:`dflash2_gguf.bench.cli` and
:mod:`dflash2_gguf.server.__main__` all import it without importing one another (``cli`` dispatches to them; nothing imports ``cli``).

- :func:`add_model_args` / :func:`decoder_kwargs` / :func:`open_decoder`: model and context
  flags in llama.cpp's spellings -> :class:`~dflash2_gguf.decoder.api.DFlashDecoder` keywords;
- :func:`add_sampling_args` / :func:`sampling_from_args` / :func:`parse_logit_bias`: the flags
  of the generation parameters (:mod:`dflash2_gguf.decoder.params`, the one table of them);
- :data:`FLASH_ATTN`: the ``-fa`` words (the parser, the decoder keywords and bench's report).
"""

from __future__ import annotations

import argparse

__all__ = ["FLASH_ATTN", "add_model_args", "add_sampling_args", "sampling_from_args", "parse_logit_bias",
           "decoder_kwargs", "open_decoder"]

#: ``-fa`` word -> ``DFlashDecoder(flash_attn=...)`` (None = llama.cpp's auto)
FLASH_ATTN = {"on": True, "off": False, "auto": None}


def _gpu_layers(v: str) -> int:
    """``-ngl`` / ``-ngld``: a number, or llama.cpp's ``all`` / ``auto`` (-1 = every layer)."""
    if str(v).strip().lower() in ("all", "auto"):
        return -1
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers, 'all' or 'auto', got {v!r}") from None


def _fa_word(v: str) -> str:
    """``-fa``: llama.cpp's words (``on``/``enabled``/``true``/``1``, ``off``/``disabled``/
    ``false``/``0``, ``auto``/``-1``) -> a key of :data:`FLASH_ATTN`."""
    s = str(v).strip().lower()
    for word, forms in (("on", ("on", "enabled", "true", "1")), ("off", ("off", "disabled", "false", "0")),
                        ("auto", ("auto", "-1"))):
        if s in forms:
            return word
    raise argparse.ArgumentTypeError(f"expected on, off or auto, got {v!r}")


def add_model_args(p: argparse.ArgumentParser, *, drafter_required: bool = True) -> None:
    """``-m/-md/-c/-cd/-t/-td/-ngl/-ngld/-fa/-nr/-v`` (model and context flags shared by
    subcommands), each with every spelling llama.cpp 0c1e570 has for it (common/arg.cpp;
    tests/decoder/test_params.py checks them against server/llama_server_options.json)."""
    p.add_argument("-m", "--model", required=True, help="target model GGUF")
    p.add_argument("-md", "--model-draft", "--spec-draft-model", required=drafter_required, default=None,
                   help="dflash drafter GGUF, or 'none' for the target alone")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="target context size (tokens)")
    p.add_argument("-cd", "--ctx-size-draft", type=int, default=None, help="drafter context size")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("-td", "--threads-draft", "--spec-draft-threads", type=int, default=None,
                   help="drafter CPU threads")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=_gpu_layers, default=0,
                   help="target layers on GPU (-1 or all = all)")
    p.add_argument("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", "--spec-draft-ngl", type=_gpu_layers,
                   default=None, help="drafter layers on GPU")
    p.add_argument("-fa", "--flash-attn", type=_fa_word, default="auto", metavar="on|off|auto",
                   help="flash attention, both models (default: llama.cpp's auto)")
    p.add_argument("-nr", "--no-repack", dest="no_repack", action="store_true",
                   help="disable CPU weight repacking, both models")
    p.add_argument("--repack", dest="no_repack", action="store_false", help="CPU weight repacking (default)")
    p.add_argument("--capture", choices=("auto", "layer_inp", "cb_eval"), default="auto",
                   help="target feature capture path (default: from the target architecture)")
    p.add_argument("-v", "--verbose", "--log-verbose", dest="verbose", action="store_true",
                   help="print llama.cpp's log to stderr")


def add_sampling_args(p: argparse.ArgumentParser, command: str = "generate", **kw) -> None:
    """The flags of every generation parameter that ``command`` has, from the table
    (:func:`dflash2_gguf.decoder.params.add_arguments`: llama.cpp's spellings, dest = the parameter's
    name, e.g. ``--temp`` -> ``args.temperature``)."""
    from .decoder.params import add_arguments

    add_arguments(p, command, **kw)


def parse_logit_bias(items) -> dict:
    """llama.cpp's ``-l TOKEN_ID(+/-)BIAS`` strings -> ``{token id: bias}`` (``-inf`` bans);
    see :func:`dflash2_gguf.decoder.params.parse_logit_bias`."""
    from .decoder.params import parse_logit_bias as parse

    return parse(items)


def sampling_from_args(args: argparse.Namespace, command: str = "generate"):
    """The :class:`~dflash2_gguf.decoder.sampling.SamplingParams` of :func:`add_sampling_args` flags.

    Raises:
        SystemExit: an unreadable grammar / schema file, a bad logit bias, schema or value.
    """
    from .decoder.params import sampling_from_values, values_from_args

    try:
        return sampling_from_values(values_from_args(args, command))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e


def decoder_kwargs(args: argparse.Namespace) -> dict:
    """:class:`~dflash2_gguf.decoder.api.DFlashDecoder` keywords from :func:`add_model_args` flags (all
    but the two paths)."""
    return dict(n_ctx=args.ctx_size, n_ctx_draft=args.ctx_size_draft, n_threads=args.threads,
                n_threads_draft=args.threads_draft, n_gpu_layers=args.n_gpu_layers,
                n_gpu_layers_draft=args.n_gpu_layers_draft,
                flash_attn=FLASH_ATTN[args.flash_attn], repack=not args.no_repack,
                capture=args.capture, verbose=args.verbose)


def open_decoder(args: argparse.Namespace):
    """Build a :class:`~dflash2_gguf.decoder.api.DFlashDecoder` from :func:`add_model_args` flags."""
    from .decoder.api import DFlashDecoder

    md = args.model_draft
    drafter = None if md is None or str(md).lower() == "none" else md
    return DFlashDecoder(args.model, drafter, **decoder_kwargs(args))
