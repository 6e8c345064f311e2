"""``dflash2-gguf serve`` / ``python -m dflash2_gguf.server``: flags and the uvicorn entry.

Flags are llama-server's names and defaults (``--host 127.0.0.1``, ``--port 8080``, ``-c 4096``
(llama-server's default is the model's training context; 4096 here), ``-ngl``, ``-ngld``, ``-t``,
``--api-key``, ``--alias``)::

    dflash2-gguf serve -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dflash --spec-draft-n-max 7
    dflash2-gguf serve -m TARGET.gguf                     # target alone (= --spec-type none)

``--spec-type`` defaults to ``draft-dflash`` when ``-md`` is given, else ``none``; ``none``
ignores ``-md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

__all__ = ["add_arguments", "settings_from_args", "run", "main"]

SPEC_TYPES = ("none", "draft-dflash")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``p`` (model flags shared with ``generate``)."""
    from ..cli import add_model_args

    add_model_args(p, drafter_required=False)
    p.add_argument("--spec-type", choices=SPEC_TYPES, default=None,
                   help="speculative decoding type (default: draft-dflash with -md, else none)")
    p.add_argument("--spec-draft-n-max", type=int, default=None,
                   help="drafts verified per cycle (default: block size - 1)")
    p.add_argument("--spec-draft-p-min", type=float, default=0.0, help="stop reading drafts below this probability")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $LLAMA_API_KEY, else none)")
    p.add_argument("--alias", default=None, help="model id in responses (default: the target file name)")
    p.add_argument("--queue-size", type=int, default=64, help="queued requests beyond this get 503")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def settings_from_args(args: argparse.Namespace):
    """:class:`~dflash2_gguf.server.app.ServerSettings` from parsed ``serve`` flags."""
    from ..cli import decoder_kwargs
    from .app import ServerSettings

    md = args.model_draft
    if md is not None and str(md).lower() == "none":
        md = None
    spec = args.spec_type or ("draft-dflash" if md else "none")
    if spec == "none":
        md = None
    elif md is None:
        raise ValueError("--spec-type draft-dflash needs -md DRAFT.gguf")
    if args.spec_draft_n_max is not None and args.spec_draft_n_max < 0:
        raise ValueError("--spec-draft-n-max must be >= 0")
    if args.ctx_size < 1:
        raise ValueError("-c must be >= 1")
    for p in (args.model, md):
        if p is not None and not os.path.isfile(p):
            raise FileNotFoundError(f"no such GGUF file: {p}")
    return ServerSettings(
        model=args.model, model_draft=md, **decoder_kwargs(args), n_draft_max=args.spec_draft_n_max,
        p_min=args.spec_draft_p_min, api_key=args.api_key or None, alias=args.alias, max_queue=args.queue_size,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (the ``serve`` subcommand). Returns the exit code."""
    import uvicorn

    from .app import create_app

    settings = settings_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dflash2_gguf.server ...`` (same flags as ``dflash2-gguf serve``)."""
    p = argparse.ArgumentParser(prog="dflash2-gguf serve", description="OpenAI-compatible server")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"dflash2-gguf serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
