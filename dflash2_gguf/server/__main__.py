"""``dflash2-gguf serve`` / ``python -m dflash2_gguf.server``: flags and the uvicorn entry.

Flags are llama-server's names and defaults (tools/server/README.md at llama.cpp 0c1e570)::

    dflash2-gguf serve -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dflash --spec-draft-n-max 7
    dflash2-gguf serve -m TARGET.gguf                     # target alone (= --spec-type none)

- Model and context: ``-m``, ``-md``, ``-c`` (not given: the GGUF's training context capped by
  memory, see :mod:`.context`; ``-c 0``: the training context; ``-c N``: N tokens per slot),
  ``-cd``, ``-t``, ``-td``, ``-ngl``, ``-ngld``, ``-fa``, ``-nr``, ``-v`` (llama.cpp's log and
  llama-server's ``__verbose`` in responses).
- Speculative: ``--spec-type none|draft-dflash`` (default: draft-dflash with ``-md``, else none),
  ``--spec-draft-n-max``, ``--spec-draft-n-min`` (a floor under the adaptive choice), ``--spec-draft-adaptive on|off``,
  ``--spec-draft-p-min``.
- Request defaults: ``--temp``, ``--top-k``, ``--top-p``, ``--min-p``, ``-s/--seed`` (-1 =
  random), ``-n/--predict/--n-predict`` (-1 = until end of generation or a full context).
- Slots: ``-np/--parallel N`` (llama-server's -1 = auto is 4 slots there; here auto = 1, as each
  slot loads its own decoder, see :mod:`.worker`); ``--slots/--no-slots`` (``GET /slots``).
- Chat: ``--jinja`` (default) / ``--no-jinja``, ``--chat-template TEXT``, ``--chat-template-file F``.
- Reasoning: ``--reasoning-format none|auto|deepseek|deepseek-legacy`` (default auto: ``<think>``
  text goes to ``reasoning_content``), ``-rea/--reasoning on|off|auto`` (``enable_thinking`` given to
  the chat template; auto = the template's default).
- HTTP: ``--host`` (comma list of addresses, or UNIX socket paths ending in ``.sock``),
  ``--port``, ``--api-key`` (comma list) / ``--api-key-file``, ``--alias`` (comma list: the first
  is the model id), ``--tags``, ``--cors-origins`` / ``--cors-methods`` / ``--cors-headers`` /
  ``--cors-credentials`` / ``--no-cors-credentials``, ``--metrics`` (accepted: ``/metrics`` is
  always on), ``--offline`` (accepted: serve never downloads).
- ``--context-shift``: refused with an error (the driver cannot shift its context; a full
  context ends the generation with ``finish_reason`` "length", llama-server's behaviour with the
  default ``--no-context-shift``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Optional, Sequence

__all__ = ["add_arguments", "settings_from_args", "run", "main", "bind_sockets"]

SPEC_TYPES = ("none", "draft-dflash")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``p`` (model flags shared with ``generate``)."""
    from ..options import add_model_args, add_sampling_args

    add_model_args(p, drafter_required=False)
    p.set_defaults(ctx_size=None)  # serve: the training context capped by memory (server/context.py)
    add_sampling_args(p)
    p.set_defaults(seed=-1)
    p.add_argument("-s", dest="seed", type=int, help="RNG seed (-1 = random; same as --seed)")
    p.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=-1,
                   help="default tokens to predict per request (-1 = until end of generation or a full context)")
    p.add_argument("--spec-type", choices=SPEC_TYPES, default=None,
                   help="speculative decoding type (default: draft-dflash with -md, else none)")
    p.add_argument("--spec-draft-n-max", type=int, default=None,
                   help="drafts verified per cycle (default: block size - 1)")
    p.add_argument("--spec-draft-adaptive", choices=("on", "off"), default="on",
                   help="choose the drafts verified per cycle from a measured cost model and the drafter's "
                        "confidence (default on); off: always --spec-draft-n-max")
    p.add_argument("--spec-draft-n-min", type=int, default=0,
                   help="when the drafter runs, verify at least this many drafts (a floor under the adaptive choice)")
    p.add_argument("--spec-draft-p-min", type=float, default=0.0, help="stop reading drafts below this probability")
    p.add_argument("-np", "--parallel", type=int, default=-1,
                   help="slots (each loads its own decoder; -1 = auto = 1)")
    p.add_argument("--slots", dest="slots", action="store_true", default=True, help="serve GET /slots (default)")
    p.add_argument("--no-slots", dest="slots", action="store_false", help="GET /slots answers 501")
    p.add_argument("--jinja", dest="jinja", action="store_true", default=True,
                   help="render chats with the Jinja template (default)")
    p.add_argument("--no-jinja", dest="jinja", action="store_false", help="libllama's built-in templates only")
    p.add_argument("--chat-template", default=None, help="chat template text (default: the GGUF's)")
    p.add_argument("--chat-template-file", default=None, help="file with the chat template (default: the GGUF's)")
    p.add_argument("--reasoning-format", default="auto", choices=("none", "auto", "deepseek", "deepseek-legacy"),
                   help="where thoughts go: none = left in content; deepseek / auto = reasoning_content; "
                        "deepseek-legacy = both (default: auto)")
    p.add_argument("-rea", "--reasoning", default="auto", choices=("on", "off", "auto"),
                   help="enable_thinking for the chat template: on, off or auto (the template's default)")
    p.add_argument("--context-shift", dest="context_shift", action="store_true", default=False,
                   help="not supported (refused); a full context ends the generation")
    p.add_argument("--no-context-shift", dest="context_shift", action="store_false", help="the default")
    p.add_argument("--host", default="127.0.0.1",
                   help="listen addresses, comma-separated, or UNIX socket paths ending in .sock (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"),
                   help="required key(s), comma-separated: 'Authorization: Bearer KEY' (default: $LLAMA_API_KEY)")
    p.add_argument("--api-key-file", default=None, help="file with API keys, one per line ('#' comments)")
    p.add_argument("-a", "--alias", default=None,
                   help="model name aliases, comma-separated; the first is the model id (default: the file name)")
    p.add_argument("--tags", default=None, help="model tags, comma-separated (informational)")
    p.add_argument("--cors-origins", default="*",
                   help="allowed CORS origins, comma-separated; '*' reflects any origin, 'localhost' local ones")
    p.add_argument("--cors-methods", default="GET, POST, DELETE, OPTIONS", help="allowed CORS methods")
    p.add_argument("--cors-headers", default="*", help="allowed CORS headers")
    p.add_argument("--cors-credentials", dest="cors_credentials", action="store_true", default=True,
                   help="allow credentials (default)")
    p.add_argument("--no-cors-credentials", dest="cors_credentials", action="store_false")
    p.add_argument("--metrics", action="store_true", help="accepted: /metrics is always served")
    p.add_argument("--offline", action="store_true", help="accepted: serve never downloads anything")
    p.add_argument("--queue-size", type=int, default=64, help="queued requests beyond this get 503")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _api_keys(args: argparse.Namespace) -> Optional[str]:
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return ",".join(keys) or None


def settings_from_args(args: argparse.Namespace):
    """:class:`~dflash2_gguf.server.app.ServerSettings` from parsed ``serve`` flags.

    Raises:
        ValueError: a flag value this server refuses (``--context-shift``, bad ranges, both
            template flags); FileNotFoundError: a model or template file is missing.
    """
    from ..options import decoder_kwargs
    from .app import ServerSettings
    from .context import read_model_info, resolve_n_ctx

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
    if args.spec_draft_n_min < 0:
        raise ValueError("--spec-draft-n-min must be >= 0")
    if args.context_shift:
        raise ValueError("--context-shift is not supported: the DFlash driver cannot shift its KV cache; a "
                         "generation that fills the context ends with finish_reason 'length' (use a larger -c)")
    n_slots = 1 if args.parallel in (-1, 0) else args.parallel
    if n_slots < 1:
        raise ValueError("-np/--parallel must be >= 1 (or -1 = auto)")
    if args.n_predict < -1:
        raise ValueError("-n must be >= -1")
    if args.chat_template and args.chat_template_file:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    for p in (args.model, md):
        if p is not None and not os.path.isfile(p):
            raise FileNotFoundError(f"no such GGUF file: {p}")
    template = args.chat_template
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    kw = decoder_kwargs(args)
    kw["n_ctx"] = resolve_n_ctx(args.ctx_size, read_model_info(args.model), n_slots)
    return ServerSettings(
        model=args.model, model_draft=md, **kw, n_draft_max=args.spec_draft_n_max,
        spec_adaptive=args.spec_draft_adaptive == "on",
        n_draft_min=args.spec_draft_n_min, p_min=args.spec_draft_p_min, n_slots=n_slots,
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        seed=-1 if args.seed is None else args.seed, n_predict=args.n_predict,
        api_key=_api_keys(args), alias=args.alias, tags=args.tags, chat_template=template, jinja=args.jinja,
        reasoning_format=args.reasoning_format,
        enable_thinking={"on": True, "off": False}.get(args.reasoning),
        cors_origins=args.cors_origins, cors_methods=args.cors_methods, cors_headers=args.cors_headers,
        cors_credentials=args.cors_credentials, endpoint_slots=args.slots, max_queue=args.queue_size,
    )


def bind_sockets(hosts: str, port: int) -> list:
    """Listening sockets for llama-server's ``--host`` list (comma-separated addresses; a path
    ending in ``.sock`` is a UNIX socket). An IPv6 socket binds IPv6 only, as llama-server's.

    Raises:
        OSError: an address cannot be bound.
    """
    socks = []
    try:
        for h in [x.strip() for x in hosts.split(",") if x.strip()]:
            if h.endswith(".sock"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                if os.path.exists(h):
                    os.unlink(h)
                s.bind(h)
            else:
                fam, typ, proto, _, addr = socket.getaddrinfo(h, port, type=socket.SOCK_STREAM)[0]
                s = socket.socket(fam, typ, proto)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if fam == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(addr)
            s.listen(128)
            socks.append(s)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (the ``serve`` subcommand). Returns the exit code."""
    import uvicorn

    from .app import create_app

    settings = settings_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("dflash2_gguf.server").info(
        "serving %s (n_ctx %d per slot, %d slot(s)) on %s port %d", settings.model_id, settings.n_ctx,
        settings.n_slots, args.host, args.port)
    app = create_app(settings)
    socks = bind_sockets(args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=socks)
    finally:
        for s in socks:
            s.close()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dflash2_gguf.server ...`` (same flags as ``dflash2-gguf serve``)."""
    p = argparse.ArgumentParser(prog="dflash2-gguf serve", description="OpenAI-compatible server")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"dflash2-gguf serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
