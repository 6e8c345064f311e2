"""``dflash2-gguf serve`` / ``python -m dflash2_gguf.server``: flags and the uvicorn entry.

Flags are llama-server's names and defaults (tools/server/README.md and common/arg.cpp at
llama.cpp 0c1e570), every spelling of each; a llama-server command line starts this server::

    dflash2-gguf serve -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dflash --spec-draft-n-max 7
    dflash2-gguf serve -m TARGET.gguf                     # target alone (= --spec-type none)
    LLAMA_ARG_MODEL=TARGET.gguf LLAMA_ARG_PORT=9000 dflash2-gguf serve -b 512 -ctk q8_0 --load-mode mlock ...

- Model and context: ``-m``, ``-md``, ``-c`` (not given: the GGUF's training context capped by
  memory, see :mod:`.context`; ``-c 0``: the training context; ``-c N``: N tokens, split across
  the slots as llama-server splits them: ``-c 1024 -np 2`` gives each slot 512),
  ``-kvu/--kv-unified`` (each slot gets the whole ``-c``; here each slot then holds a pool of its
  own), ``--kv-unified-per-slot N`` (a cap per slot; without ``-c``, the pool is ``-np`` x N),
  ``-cd``, ``-t``, ``-td``, ``-ngl``, ``-ngld``, ``-fa``, ``-nr``, ``-v`` (llama.cpp's log and
  llama-server's ``__verbose`` in responses), ``-b`` / ``-ub`` (the target's prefill chunk is
  min(-b, -ub), llama.cpp's physical batch), ``-cram/--cache-ram N`` (each slot's RAM prompt
  cache in MiB; -1 no limit, 0 off; default 1024).
- Request defaults: every generation parameter of :data:`dflash2_gguf.decoder.params.PARAMS` that
  ``serve`` has, under llama.cpp's flags: ``--temp``, ``--top-k``, ``--top-p``, ``--min-p``,
  ``-s/--seed`` (-1 = random), ``--repeat-penalty``, ``--repeat-last-n``, ``--presence-penalty``,
  ``--frequency-penalty``, ``-l/--logit-bias``, ``--grammar`` / ``--grammar-file`` / ``-j`` /
  ``-jf``, ``-n/--predict`` (-1 = until end of generation or a full context), ``--ignore-eos``,
  ``--spec-draft-n-max``, ``--spec-draft-n-min``, ``--spec-draft-p-min``, ``--spec-draft-adaptive
  on|off``. A request's own value wins.
- Speculative: ``--spec-type`` a comma-separated list of ``draft-dflash``, ``ngram-simple``,
  ``ngram-mod``, ``none`` (default: all three with ``-md``, else none; each cycle the source with
  the best expected tokens/s drafts); llama.cpp's other types are not available here: a warning
  names them and they are left out. ``--spec-accept rejection|target-sample`` and the
  ``--spec-ngram-*`` flags set the request defaults.
- Slots: ``-np/--parallel N`` (llama-server's -1 = auto is 4 slots there; here auto = 1, as each
  slot loads its own decoder, see :mod:`.worker`); ``--slots/--no-slots`` (``GET /slots``).
- Web page: ``--ui/--webui`` (default) / ``--no-ui/--no-webui`` (no page: ``GET /`` is a 404, as
  llama-server's); ``--path DIR`` serves the files of DIR at ``/`` instead of the shipped page
  (``/`` is ``DIR/index.html``; like llama-server's mount point, a file shadows an endpoint of
  the same path, and only ``/`` is public with an API key set).
- Chat: ``--jinja`` (default) / ``--no-jinja``, ``--chat-template TEXT``, ``--chat-template-file F``,
  ``--chat-template-kwargs JSON``, ``--reasoning-effort LEVEL``.
- Reasoning: ``--reasoning-format none|auto|deepseek|deepseek-legacy`` (default auto: ``<think>``
  text goes to ``reasoning_content``), ``-rea/--reasoning on|off|auto`` (``enable_thinking`` given to
  the chat template; auto = the template's default).
- HTTP: ``--host`` (comma list of addresses, or UNIX socket paths ending in ``.sock``),
  ``--port``, ``--api-key`` (comma list) / ``--api-key-file``, ``--ssl-key-file`` /
  ``--ssl-cert-file`` (HTTPS), ``--alias`` (comma list, kept sorted as llama-server keeps it:
  the first is the model id; default: the ``-m`` path), ``--tags``,
  ``--cors-origins`` / ``--cors-methods`` / ``--cors-headers`` / ``--cors-credentials`` /
  ``--no-cors-credentials``, ``--metrics`` (accepted: ``/metrics`` is always on), ``--offline``
  (accepted: serve never downloads).
- ``--context-shift`` / ``--keep N``: as llama-server, a slot whose context fills drops half of
  what follows the first N tokens (the target's and the drafter's caches shift) and goes on;
  without it (the default) a full context ends the generation with ``finish_reason`` "length".
- Every other llama-server option, and every ``LLAMA_ARG_*`` variable (the command line wins),
  is accepted: see :mod:`.llama_args` (a warning line for an option without effect here, an
  error for one that would change results).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Optional, Sequence

__all__ = ["add_arguments", "prepare_argv", "settings_from_args", "batch_and_cache", "run", "main", "bind_sockets"]

SPEC_TYPES = ("none", "draft-dflash", "ngram-simple", "ngram-mod")

#: llama-server's ``-b`` / ``-ub`` defaults (common/common.h at llama.cpp 0c1e570).
N_BATCH, N_UBATCH = 2048, 512
#: ``--cache-ram`` when not given: :class:`~dflash2_gguf.decoder.api.DFlashDecoder`'s default, per slot
#: (llama-server's is 8192 MiB for its one cache shared by the slots).
CACHE_RAM_MIB = 1024
#: ``--cache-ram -1`` (no limit): a budget no machine reaches (1 PiB).
CACHE_RAM_NO_LIMIT_MIB = 1 << 30


def batch_and_cache(args: argparse.Namespace) -> dict:
    """``-b``, ``-ub`` and ``--cache-ram`` as :class:`~dflash2_gguf.decoder.api.DFlashDecoder` keywords:
    ``n_batch`` = min(-b, -ub) (the driver's target batch is llama.cpp's physical one, the rows
    of one compute graph; llama.cpp clamps ``n_ubatch`` to ``n_batch`` the same way) and
    ``cache_ram_mib`` (-1 = no limit, 0 = off).

    Raises:
        ValueError: ``-b`` or ``-ub`` below 1, ``--cache-ram`` below -1.
    """
    b = N_BATCH if args.batch_size is None else args.batch_size
    ub = N_UBATCH if args.ubatch_size is None else args.ubatch_size
    if b < 1 or ub < 1:
        raise ValueError(f"-b/--batch-size and -ub/--ubatch-size must be >= 1 (got {b} and {ub})")
    ram = CACHE_RAM_MIB if args.cache_ram is None else args.cache_ram
    if ram < -1:
        raise ValueError(f"--cache-ram must be >= -1 (-1: no limit, 0: off), got {ram}")
    return {"n_batch": min(b, ub), "cache_ram_mib": CACHE_RAM_NO_LIMIT_MIB if ram == -1 else ram}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``p``: the model flags shared with ``generate``, the generation
    parameters of :data:`dflash2_gguf.decoder.params.PARAMS` (request defaults), the server's own, then
    every other llama-server option (:func:`.llama_args.add_remaining`). Every option has all of
    llama.cpp's spellings; build ``p`` with ``allow_abbrev=False`` (``-tb 2`` is llama-server's
    ``--threads-batch``, never ``-t b``)."""
    from ..options import add_model_args, add_sampling_args
    from .llama_args import add_remaining, negations, spellings

    add_model_args(p, drafter_required=False)
    p.set_defaults(ctx_size=None)  # serve: the training context capped by memory (server/context.py)
    add_sampling_args(p, "serve")
    p.add_argument(*spellings("-b"), dest="batch_size", type=int, default=None, metavar="N",
                   help="logical maximum batch size (llama-server's default 2048; the target's prefill chunk is "
                        "min(-b, -ub))")
    p.add_argument(*spellings("-ub"), dest="ubatch_size", type=int, default=None, metavar="N",
                   help="physical maximum batch size (llama-server's default 512)")
    p.add_argument(*spellings("-cram"), dest="cache_ram", type=int, default=None, metavar="N",
                   help=f"RAM prompt cache of each slot in MiB (-1: no limit, 0: off; default {CACHE_RAM_MIB})")
    p.add_argument(*spellings("-np"), dest="parallel", type=int, default=-1,
                   help="slots (each loads its own decoder; -1 = auto = 1)")
    p.add_argument(*spellings("-kvu"), dest="kv_unified", action="store_true", default=False,
                   help="each slot gets the whole -c (default: -c is split across the slots, as llama-server's "
                        "-np N; here each slot then loads a pool of its own)")
    p.add_argument(*negations("-kvu"), dest="kv_unified", action="store_false", help="split -c across the slots")
    p.add_argument(*spellings("--kv-unified-per-slot"), dest="kv_unified_per_slot", type=int, default=0,
                   metavar="N", help="context cap per slot; without -c the pool is -np x N")
    p.add_argument(*spellings("--ui"), dest="ui", action="store_true", default=True,
                   help="serve the web page at / (default)")
    p.add_argument(*negations("--ui"), dest="ui", action="store_false", help="no web page (GET / answers 404)")
    p.add_argument(*spellings("--path"), dest="static_path", default=None, metavar="DIR",
                   help="serve the files of DIR at / instead of the shipped web page")
    p.add_argument(*spellings("--slots"), dest="slots", action="store_true", default=True, help="serve GET /slots (default)")
    p.add_argument(*negations("--slots"), dest="slots", action="store_false", help="GET /slots answers 501")
    p.add_argument(*spellings("--jinja"), dest="jinja", action="store_true", default=True,
                   help="render chats with the Jinja template (default)")
    p.add_argument(*negations("--jinja"), dest="jinja", action="store_false", help="libllama's built-in templates only")
    p.add_argument(*spellings("--chat-template"), default=None, help="chat template text (default: the GGUF's)")
    p.add_argument(*spellings("--chat-template-file"), default=None,
                   help="file with the chat template (default: the GGUF's)")
    p.add_argument(*spellings("--chat-template-kwargs"), default=None, metavar="JSON",
                   help="template variables of every chat, a JSON object (a request's chat_template_kwargs "
                        "override them), e.g. '{\"enable_thinking\": false}'")
    p.add_argument(*spellings("--reasoning-format"), default="auto", choices=("none", "auto", "deepseek", "deepseek-legacy"),
                   help="where thoughts go: none = left in content; deepseek / auto = reasoning_content; "
                        "deepseek-legacy = both (default: auto)")
    p.add_argument(*spellings("-rea"), dest="reasoning", default="auto", choices=("on", "off", "auto"),
                   help="enable_thinking for the chat template: on, off or auto (the template's default)")
    p.add_argument(*spellings("--reasoning-effort"), default=None, metavar="LEVEL",
                   help="reasoning_effort given to the chat template unless the request sets one")
    p.add_argument(*spellings("--context-shift"), dest="context_shift", action="store_true", default=False,
                   help="when a slot's context fills, drop half of what follows --keep and go on (the target's and the "
                        "drafter's caches shift; not for targets with a recurrent state)")
    p.add_argument(*negations("--context-shift"), dest="context_shift", action="store_false",
                   help="a full context ends the generation (the default)")
    p.add_argument(*spellings("--keep"), dest="n_keep", type=int, default=0, metavar="N",
                   help="with --context-shift: tokens at the start never dropped (-1: the whole prompt); a request's "
                        "n_keep wins")
    p.add_argument(*spellings("--host"), default="127.0.0.1",
                   help="listen addresses, comma-separated, or UNIX socket paths ending in .sock (default 127.0.0.1)")
    p.add_argument(*spellings("--port"), type=int, default=8080, help="listen port (default 8080)")
    p.add_argument(*spellings("--api-key"), default=None,
                   help="required key(s), comma-separated: 'Authorization: Bearer KEY' (default: $LLAMA_API_KEY)")
    p.add_argument(*spellings("--api-key-file"), default=None, help="file with API keys, one per line ('#' comments)")
    p.add_argument(*spellings("--ssl-key-file"), default=None, help="PEM private key: serve HTTPS (with --ssl-cert-file)")
    p.add_argument(*spellings("--ssl-cert-file"), default=None, help="PEM certificate: serve HTTPS (with --ssl-key-file)")
    p.add_argument(*spellings("-a"), dest="alias", default=None,
                   help="model name aliases, comma-separated; the first in sorted order is the model id, as "
                        "llama-server's (default: the -m path as given)")
    p.add_argument(*spellings("--tags"), default=None, help="model tags, comma-separated (informational)")
    p.add_argument(*spellings("--cors-origins"), default="*",
                   help="allowed CORS origins, comma-separated; '*' reflects any origin, 'localhost' local ones")
    p.add_argument(*spellings("--cors-methods"), default="GET, POST, DELETE, OPTIONS", help="allowed CORS methods")
    p.add_argument(*spellings("--cors-headers"), default="*", help="allowed CORS headers")
    p.add_argument(*spellings("--cors-credentials"), dest="cors_credentials", action="store_true", default=True,
                   help="allow credentials (default)")
    p.add_argument(*negations("--cors-credentials"), dest="cors_credentials", action="store_false")
    p.add_argument(*spellings("--metrics"), action="store_true", help="accepted: /metrics is always served")
    p.add_argument(*spellings("--offline"), action="store_true", help="accepted: serve never downloads anything")
    have = p._option_string_actions  # noqa: SLF001 - argparse has no public accessor
    missing = [f for f in spellings("-h") if f not in have]
    if missing:
        p.add_argument(*missing, action="help", help="show this help and exit")
    if "--version" not in have:
        from .. import __version__

        p.add_argument("--version", action="version", version=f"dflash2-gguf {__version__} (llama.cpp 0c1e570)")
    p.add_argument("--queue-size", type=int, default=64, help="queued requests beyond this get 503")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_remaining(p)
    p.epilog = ("Every other llama-server option (llama.cpp 0c1e570) and LLAMA_ARG_* variable is accepted: one "
                "warning line names an option without effect here; one that would change results is refused "
                "with the reason (dflash2_gguf/server/llama_args.py).")


def prepare_argv(argv: Sequence[str], environ=None) -> list:
    """The ``serve`` arguments as llama-server reads them: ``--foo_bar`` as ``--foo-bar``, and each
    set ``LLAMA_ARG_*`` variable of an option not on the command line as that option
    (:func:`.llama_args.argv_with_env`; the command line wins)."""
    from .llama_args import argv_with_env

    return argv_with_env(argv, environ)


def _api_keys(args: argparse.Namespace) -> Optional[str]:
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return ",".join(keys) or None


def settings_from_args(args: argparse.Namespace, *, warn=None):
    """:class:`~dflash2_gguf.server.app.ServerSettings` from parsed ``serve`` flags.

    Args:
        args: From a parser built by :func:`add_arguments`.
        warn: Called with each warning line (default: print to stderr): a llama-server option
            given that has no effect here.

    Raises:
        ValueError: a flag value this server refuses (an option that would
            change results, bad ranges, both template flags, a bad generation parameter);
            FileNotFoundError: a model or template file is missing.
    """
    import json

    from ..options import decoder_kwargs
    from ..decoder.params import sampling_from_values, values_from_args
    from .app import ServerSettings
    from .context import read_model_info, resolve_n_ctx, slot_n_ctx
    from .llama_args import check_remaining

    warn = warn or (lambda line: print(f"dflash2-gguf serve: {line}", file=sys.stderr))
    for line in check_remaining(args):
        warn(line)
    md = args.model_draft
    if md is not None and str(md).lower() == "none":
        md = None
    types = [t.strip().lower() for t in (args.spec_type or "").split(",") if t.strip()]
    unknown = [t for t in types if t not in SPEC_TYPES]
    if unknown:
        warn(f"warning: --spec-type {','.join(unknown)}: not available here ({', '.join(SPEC_TYPES[1:])} are): "
             "left out")
    known = [t for t in types if t in SPEC_TYPES and t != "none"]
    if types and "draft-dflash" not in known:
        md = None  # no drafter pass asked for: the drafter is not loaded
    elif "draft-dflash" in known and md is None:
        raise ValueError("--spec-type draft-dflash needs -md DRAFT.gguf")
    gen = values_from_args(args, "serve")
    gen["spec_type"] = (",".join(known) or "none") if types else None
    sampling_from_values(gen)  # a bad value fails here, naming the flag's parameter
    if gen["n_draft_max"] is not None and gen["n_draft_max"] < 0:
        raise ValueError("--spec-draft-n-max must be >= 0")
    if gen["n_draft_min"] < 0:
        raise ValueError("--spec-draft-n-min must be >= 0")
    if not 0.0 <= gen["p_min"] <= 1.0:
        raise ValueError("--spec-draft-p-min must be in [0, 1]")
    if gen["max_tokens"] < -1:
        raise ValueError("-n must be >= -1")
    if args.n_keep < -1:
        raise ValueError("--keep must be >= -1")
    n_slots = 1 if args.parallel in (-1, 0) else args.parallel
    if n_slots < 1:
        raise ValueError("-np/--parallel must be >= 1 (or -1 = auto)")
    if args.chat_template and args.chat_template_file:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    if bool(args.ssl_key_file) != bool(args.ssl_cert_file):
        raise ValueError("HTTPS needs both --ssl-key-file and --ssl-cert-file")
    kwargs = None
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--chat-template-kwargs must be a JSON object: {e}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    for p in (args.model, md):
        if p is not None and not os.path.isfile(p):
            raise FileNotFoundError(f"no such GGUF file: {p}")
    template = args.chat_template
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    if args.kv_unified_per_slot < 0:
        raise ValueError("--kv-unified-per-slot must be >= 0")
    if args.static_path is not None and not os.path.isdir(args.static_path):
        raise FileNotFoundError(f"--path: no such folder: {args.static_path} (static assets path not found)")
    kw = decoder_kwargs(args)
    kw.update(batch_and_cache(args))
    info = read_model_info(args.model)
    if args.ctx_size is None and args.kv_unified_per_slot > 0:  # llama-server: the pool is -np x N
        pool = n_slots * args.kv_unified_per_slot
    else:
        pool = resolve_n_ctx(args.ctx_size, info, n_slots if args.kv_unified else 1)
    kw["n_ctx"] = slot_n_ctx(pool, n_slots, kv_unified=args.kv_unified, n_ctx_train=info.n_ctx_train,
                             per_slot=args.kv_unified_per_slot)
    return ServerSettings(
        model=args.model, model_draft=md, **kw, n_slots=n_slots, **gen,
        api_key=_api_keys(args), alias=args.alias, tags=args.tags, chat_template=template, jinja=args.jinja,
        reasoning_format=args.reasoning_format,
        enable_thinking={"on": True, "off": False}.get(args.reasoning),
        chat_template_kwargs=kwargs, reasoning_effort=args.reasoning_effort,
        cors_origins=args.cors_origins, cors_methods=args.cors_methods, cors_headers=args.cors_headers,
        cors_credentials=args.cors_credentials, endpoint_slots=args.slots, context_shift=args.context_shift,
        n_keep=args.n_keep, max_queue=args.queue_size,
        ui=args.ui, static_path=args.static_path,
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
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                                           ssl_keyfile=args.ssl_key_file, ssl_certfile=args.ssl_cert_file))
    try:
        server.run(sockets=socks)
    finally:
        for s in socks:
            s.close()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dflash2_gguf.server ...`` (same flags as ``dflash2-gguf serve``)."""
    p = argparse.ArgumentParser(prog="dflash2-gguf serve", description="OpenAI-compatible server", allow_abbrev=False,
                                add_help=False)
    add_arguments(p)
    try:
        args = p.parse_args(prepare_argv(sys.argv[1:] if argv is None else argv))
        return run(args)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"dflash2-gguf serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
