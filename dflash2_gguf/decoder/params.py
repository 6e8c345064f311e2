"""The generation parameters, each declared once (:data:`PARAMS`); everything else is derived.

One :class:`Param` per parameter of a generation (sampling, draft settings, limits, stop strings,
grammar / JSON schema, logprobs), with its type, default, command-line flags in llama.cpp's
spellings (common/arg.cpp at 0c1e570), request field names per HTTP API, its ``LLAMA_ARG_*``
variable, its native field (``native/sampling.h`` ``SamplingOptions`` / ``native/driver.h``
``GenParams``) and its key in llama-server's ``generation_settings``. From the table come:

- the fields of :class:`~dflash2_gguf.decoder.sampling.SamplingParams` (``group == "sampling"``) and of
  the server's :class:`~dflash2_gguf.server.app.ServerSettings` (``"serve" in commands``), with
  :func:`table_fields`;
- the flags of ``generate``, ``bench`` and ``serve`` (:func:`add_arguments`) and their values
  (:func:`values_from_args`, :func:`sampling_from_values`);
- the request fields of the server's models (:func:`request_fields`), the mapping of a request
  onto a generation (``server/compat.py``: :func:`scalar_params`), the ``/props`` and ``/slots``
  ``generation_settings`` (:attr:`Param.props`), and the Responses / Messages renames
  (:func:`rename_request`);
- :meth:`SamplingParams.to_native` (:attr:`Param.native`).

Adding a sampling parameter = one :class:`Param` here (``group="sampling"``) plus one line in
``DFLASH2_SAMPLING_FIELDS`` (native/sampling.h) and its use in native/sampling.cpp; the flags,
the request field, the server default and ``/props`` follow (tests/decoder/test_params.py adds a
throwaway entry and follows it through).

Entries marked ``custom`` need code beyond the generic path (a logit-bias string, a grammar file,
the OpenAI aliases of the token limit, llama-server's nested ``speculative`` object); their flags
and request names are still declared here, and tests/decoder/test_params.py checks every declared request
name is a field of the request models.

A leaf module: it imports nothing of this package.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Param", "PARAMS", "APIS", "COMMANDS", "by_name", "select", "table_fields", "add_arguments",
           "values_from_args", "sampling_from_values", "parse_logit_bias", "request_fields", "scalar_params",
           "rename_request", "parse_seed", "SPEC_TYPE_NAMES", "parse_spec_types",
           "effective_spec_types"]

#: The HTTP APIs whose request field names an entry declares.
APIS = ("completion", "chat", "responses", "messages")
#: The subcommands whose flags come from the table.
COMMANDS = ("generate", "bench", "serve")


def parse_seed(v: Any) -> Optional[int]:
    """A seed from a flag, variable or request: ``None`` or a negative number (llama.cpp's -1 /
    ``LLAMA_DEFAULT_SEED``) = random; else the int.

    Raises:
        ValueError: not an integer.
    """
    if v is None:
        return None
    i = int(v)
    return None if i < 0 or i == 0xFFFFFFFF else i


def _on_off(v: str) -> bool:
    """llama.cpp's on/off words (``is_truthy`` / ``is_falsey``, common/arg.cpp)."""
    s = str(v).strip().lower()
    if s in ("on", "enabled", "true", "1"):
        return True
    if s in ("off", "disabled", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")


@dataclass(frozen=True)
class Param:
    """One generation parameter.

    Attributes:
        name: The Python name: the :class:`SamplingParams` field (``group == "sampling"``), the
            :meth:`DFlashDecoder.generate` keyword, the ``ServerSettings`` field and argparse dest.
        type: ``float``, ``int``, ``bool``, ``str``, ``list`` (repeatable strings) or ``dict``.
        default: Value when nothing sets it (the library's default).
        help: One line for ``--help``.
        group: ``"sampling"`` (a :class:`SamplingParams` field, native ``SamplingOptions``),
            ``"draft"``, ``"limits"``, ``"output"``, or ``"input"`` (a flag or request field
            that becomes another parameter, e.g. a JSON schema becomes ``grammar``).
        flags: Command-line spellings, llama.cpp's first (every spelling llama-server has for it).
        env: The ``LLAMA_ARG_*`` variable llama-server reads for it (None: it has none).
        request: API (:data:`APIS`) -> request field names, first given wins.
        native: ``"SamplingOptions.<field>"`` or ``"GenParams.<field>"`` (None: not passed on).
        props: Key in llama-server's ``generation_settings`` (None: not reported).
        bounds: pydantic ``Field`` bounds of the request field (``ge``, ``gt``, ``le``, ``lt``).
        commands: Subcommands that get the flags (:data:`COMMANDS`).
        cmd_defaults: Default per subcommand where it differs from ``default``.
        cmd_flags: Extra spellings per subcommand (kept for scripts that use them).
        choices: Flag words -> values (``on``/``off``); None: a plain value of ``type``.
        parse: Converts a flag's / variable's text (default: ``type``).
        norm: Normalises a value from any source (e.g. seed -1 -> None = random).
        custom: Needs code beyond the generic paths (see the module docstring).
        metavar: Value placeholder in ``--help``.
    """

    name: str
    type: type
    default: Any
    help: str
    group: str
    flags: Tuple[str, ...] = ()
    env: Optional[str] = None
    request: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    native: Optional[str] = None
    props: Optional[str] = None
    bounds: Mapping[str, float] = field(default_factory=dict)
    commands: Tuple[str, ...] = COMMANDS
    cmd_defaults: Mapping[str, Any] = field(default_factory=dict)
    cmd_flags: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    choices: Optional[Mapping[str, Any]] = None
    parse: Optional[Callable[[str], Any]] = None
    norm: Optional[Callable[[Any], Any]] = None
    custom: bool = False
    metavar: Optional[str] = None

    def default_for(self, command: Optional[str] = None) -> Any:
        """The default under ``command`` (``cmd_defaults``, else ``default``)."""
        return self.cmd_defaults.get(command, self.default) if command else self.default

    def flags_for(self, command: str) -> Tuple[str, ...]:
        """The spellings ``command`` declares (``flags`` plus ``cmd_flags[command]``)."""
        return tuple(self.flags) + tuple(self.cmd_flags.get(command, ()))

    @property
    def native_field(self) -> Optional[str]:
        """The native struct's field name (after the dot of :attr:`native`)."""
        return self.native.split(".", 1)[1] if self.native else None

    def normalize(self, v: Any) -> Any:
        """``v`` through :attr:`norm` (unchanged without one)."""
        return self.norm(v) if self.norm is not None and v is not None else v


def _api(*names: str, only: Iterable[str] = APIS) -> Dict[str, Tuple[str, ...]]:
    return {a: tuple(names) for a in only}


_OAI = ("completion", "chat", "responses", "messages")
_LLAMA = ("completion", "chat")  # llama-server's extensions: its /completion and the OpenAI endpoints

#: The table. Defaults of the sampling entries are llama-cpp-python's ``create_completion`` ones
#: (llama-server's where it has no such option); bench samples with temperature only.
PARAMS: List[Param] = [
    # ---------------------------------------------------------------- sampling (SamplingParams)
    Param("temperature", float, 0.8, "temperature (0 = greedy)", "sampling",
          flags=("--temp", "--temperature"), env="LLAMA_ARG_TEMPERATURE", request=_api("temperature"),
          native="SamplingOptions.temperature", props="temperature", bounds=dict(ge=0.0, le=100.0),
          cmd_defaults={"bench": 0.0}, metavar="N"),
    Param("top_k", int, 40, "top-k (0 = off)", "sampling",
          flags=("--top-k",), env="LLAMA_ARG_TOP_K", request=_api("top_k", only=("completion", "chat", "messages")),
          native="SamplingOptions.top_k", props="top_k", bounds=dict(ge=0), cmd_defaults={"bench": 0}, metavar="N"),
    Param("top_p", float, 0.95, "top-p (1 = off)", "sampling",
          flags=("--top-p",), env="LLAMA_ARG_TOP_P", request=_api("top_p"),
          native="SamplingOptions.top_p", props="top_p", bounds=dict(gt=0.0, le=1.0), cmd_defaults={"bench": 1.0},
          metavar="N"),
    Param("min_p", float, 0.05, "min-p (0 = off)", "sampling",
          flags=("--min-p",), env="LLAMA_ARG_MIN_P", request=_api("min_p", only=_LLAMA),
          native="SamplingOptions.min_p", props="min_p", bounds=dict(ge=0.0, le=1.0), cmd_defaults={"bench": 0.0},
          metavar="N"),
    Param("seed", int, None, "RNG seed (-1 = random)", "sampling",
          flags=("-s", "--seed"), request=_api("seed", only=_LLAMA), native="SamplingOptions.seed", props="seed",
          bounds=dict(ge=-1, lt=2**64), cmd_defaults={"bench": 0}, norm=parse_seed, metavar="SEED"),
    Param("repeat_penalty", float, 1.0, "repetition penalty (1 = off)", "sampling",
          flags=("--repeat-penalty",), env="LLAMA_ARG_REPEAT_PENALTY", request=_api("repeat_penalty", only=_LLAMA),
          native="SamplingOptions.repeat_penalty", props="repeat_penalty", bounds=dict(ge=0.0, le=10.0), metavar="N"),
    Param("repeat_last_n", int, 64, "penalty window in tokens (0 = off, -1 = context size)", "sampling",
          flags=("--repeat-last-n",), request=_api("repeat_last_n", only=_LLAMA),
          native="SamplingOptions.repeat_last_n", props="repeat_last_n", bounds=dict(ge=-1), metavar="N"),
    Param("presence_penalty", float, 0.0, "presence penalty (0 = off)", "sampling",
          flags=("--presence-penalty",), env="LLAMA_ARG_PRESENCE_PENALTY",
          request=_api("presence_penalty", only=("completion", "chat")),
          native="SamplingOptions.presence_penalty", props="presence_penalty", bounds=dict(ge=-2.0, le=2.0),
          metavar="N"),
    Param("frequency_penalty", float, 0.0, "frequency penalty (0 = off)", "sampling",
          flags=("--frequency-penalty",), env="LLAMA_ARG_FREQUENCY_PENALTY",
          request=_api("frequency_penalty", only=("completion", "chat")),
          native="SamplingOptions.frequency_penalty", props="frequency_penalty", bounds=dict(ge=-2.0, le=2.0),
          metavar="N"),
    Param("penalize_prompt", bool, True, "prompt tokens enter the penalty window (llama-server's behaviour)",
          "sampling", native="SamplingOptions.penalize_prompt", commands=()),
    Param("logit_bias", dict, None, "add BIAS to the logit of TOKEN_ID, e.g. '15043+1' or '15043-inf' (repeatable)",
          "sampling", flags=("-l", "--logit-bias"), request=_api("logit_bias", only=_LLAMA),
          native="SamplingOptions.logit_bias", props="logit_bias", custom=True, metavar="TOKEN_ID(+/-)BIAS"),
    Param("grammar", str, None, "GBNF grammar the output must follow (root rule 'root')", "sampling",
          flags=("--grammar",), request=_api("grammar", only=_LLAMA), native="SamplingOptions.grammar",
          props="grammar", custom=True, metavar="GRAMMAR"),
    Param("n_probs", int, 0, "report logprobs of the N most likely tokens", "sampling",
          flags=("--n-probs",), request={"completion": ("n_probs", "logprobs"), "chat": ("n_probs", "top_logprobs")},
          native="SamplingOptions.n_probs", props="n_probs", commands=("generate",), custom=True, metavar="N"),
    # ---------------------------------------------------------------- inputs that become another parameter
    Param("grammar_file", str, None, "file with a GBNF grammar", "input", flags=("--grammar-file",),
          custom=True, metavar="FNAME"),
    Param("json_schema", str, None, "JSON schema the output must follow (e.g. '{}' = any JSON)", "input",
          flags=("-j", "--json-schema"), request={"completion": ("json_schema",),
                                                  "chat": ("json_schema", "response_format")},
          custom=True, metavar="SCHEMA"),
    Param("json_schema_file", str, None, "file with a JSON schema", "input", flags=("-jf", "--json-schema-file"),
          custom=True, metavar="FILE"),
    # ---------------------------------------------------------------- limits and stops (generate keywords)
    Param("max_tokens", int, 128, "tokens to predict (serve: -1 = until end of generation or a full context)",
          "limits", flags=("-n", "--predict", "--n-predict"), env="LLAMA_ARG_N_PREDICT",
          request={"completion": ("n_predict", "max_tokens"),
                   "chat": ("n_predict", "max_completion_tokens", "max_tokens"),
                   "responses": ("max_output_tokens",), "messages": ("max_tokens",)},
          native="GenParams.n_predict", props="n_predict", cmd_defaults={"serve": -1, "bench": 256},
          cmd_flags={"bench": ("--max-new-tokens",)}, custom=True, metavar="N"),
    Param("stop", list, None, "stop string (repeatable)", "limits", flags=("--stop",),
          request={"completion": ("stop",), "chat": ("stop",), "messages": ("stop_sequences",)},
          native="GenParams.stop", props="stop", commands=("generate",), custom=True, metavar="STRING"),
    Param("ignore_eos", bool, False, "do not stop at end-of-generation tokens", "limits",
          flags=("--ignore-eos",), request=_api("ignore_eos", only=_LLAMA), native="GenParams.ignore_eog",
          props="ignore_eos"),
    # ---------------------------------------------------------------- draft settings (generate keywords)
    Param("n_draft_max", int, None, "drafts verified per cycle (default: block size - 1)", "draft",
          flags=("--spec-draft-n-max",), env="LLAMA_ARG_SPEC_DRAFT_N_MAX",
          request=_api("speculative.n_max", "n_draft_max", only=_LLAMA), native="GenParams.n_draft_max",
          props="speculative.n_max", bounds=dict(ge=0, le=256), custom=True, metavar="N"),
    Param("n_draft_min", int, 0, "when the drafter runs, verify at least this many drafts (a floor under the "
          "adaptive choice)", "draft", flags=("--spec-draft-n-min",), env="LLAMA_ARG_SPEC_DRAFT_N_MIN",
          request=_api("speculative.n_min", only=_LLAMA), native="GenParams.n_draft_min", props="speculative.n_min",
          bounds=dict(ge=0, le=256), custom=True, metavar="N"),
    Param("p_min", float, 0.0, "stop reading drafts below this probability", "draft",
          flags=("--spec-draft-p-min", "--draft-p-min"), env="LLAMA_ARG_SPEC_DRAFT_P_MIN",
          request=_api("speculative.p_min", only=_LLAMA), native="GenParams.p_min", props="speculative.p_min",
          bounds=dict(ge=0.0, le=1.0), custom=True, metavar="P"),
    Param("adaptive", bool, True, "choose the drafts verified per cycle from a measured cost model and the "
          "drafter's confidence (default on); off: always --spec-draft-n-max", "draft",
          flags=("--spec-draft-adaptive",), native="GenParams.adaptive", props="speculative.adaptive",
          choices={"on": True, "off": False},
          metavar="on|off"),
    Param("spec_type", str, None, "speculative types, comma-separated: draft-dflash (the -md drafter), ngram-simple "
          "(prompt lookup), ngram-mod (n-gram pool shared across requests), none; each cycle the one with the "
          "best expected tokens/s drafts (default: all three with -md, none without)", "draft",
          flags=("--spec-type",), env="LLAMA_ARG_SPEC_TYPE", request=_api("speculative.type", only=_LLAMA),
          native="GenParams.spec_types", props="speculative.types", custom=True, metavar="TYPES"),
    Param("spec_accept", str, "rejection", "how drafts are accepted at T > 0: rejection (rejection sampling with the "
          "drafts' probabilities: the target's distribution, most drafts accepted) or target-sample (llama-server's "
          "rule: the target's own draw per position, a draft kept when equal: for a seed, the text of the target "
          "alone)", "draft", flags=("--spec-accept",), request=_api("spec_accept", only=_LLAMA),
          native="GenParams.accept_mode", props="speculative.accept",
          choices={"rejection": "rejection", "target-sample": "target-sample"}, metavar="rejection|target-sample"),
    Param("context_shift", bool, False, "when the context fills, drop half of what follows --keep and go on "
          "(llama-server's --context-shift)", "limits", flags=("--context-shift",), env="LLAMA_ARG_CONTEXT_SHIFT",
          native="GenParams.context_shift",
          commands=("generate",)),
    Param("n_keep", int, 0, "with --context-shift: tokens at the start never dropped (-1: the whole prompt; a BOS "
          "is kept on top)", "limits", flags=("--keep",), native="GenParams.n_keep", bounds=dict(ge=-1),
          commands=("generate",), metavar="N"),
    Param("spec_ngram_simple_size_n", int, 2, "ngram-simple: the shortest context suffix looked up",
          "draft", flags=("--spec-ngram-simple-size-n",), request=_api("speculative.ngram_size_n", only=_LLAMA),
          native="GenParams.ngram", bounds=dict(ge=1, le=1024), custom=True, metavar="N"),
    Param("spec_ngram_simple_size_m", int, 48, "ngram-simple: the most drafts per cycle", "draft",
          flags=("--spec-ngram-simple-size-m",), request=_api("speculative.ngram_size_m", only=_LLAMA),
          native="GenParams.ngram", bounds=dict(ge=1, le=1024), custom=True, metavar="N"),
    Param("spec_ngram_mod_n_match", int, 24, "ngram-mod: the n-gram length of the pool", "draft",
          flags=("--spec-ngram-mod-n-match",), native="GenParams.ngram", bounds=dict(ge=1, le=1024), custom=True,
          metavar="N"),
    Param("spec_ngram_mod_n_max", int, 64, "ngram-mod: the most drafts per cycle", "draft",
          flags=("--spec-ngram-mod-n-max",), native="GenParams.ngram", bounds=dict(ge=1, le=1024), custom=True,
          metavar="N"),
    Param("spec_ngram_mod_n_min", int, 48, "ngram-mod: fewer chained drafts than this are not used", "draft",
          flags=("--spec-ngram-mod-n-min",), native="GenParams.ngram", bounds=dict(ge=0, le=1024), custom=True,
          metavar="N"),
]

#: ``--spec-type`` names this driver implements (llama.cpp's spellings, common/speculative.cpp).
SPEC_TYPE_NAMES = ("none", "draft-dflash", "ngram-simple", "ngram-mod")


def parse_spec_types(value: Any) -> Optional[Tuple[str, ...]]:
    """``--spec-type`` / ``speculative.type``: a comma-separated string or a list of names ->
    the names in order without repeats (``()`` for ``none``); None: unset (the default applies).

    Raises:
        ValueError: a name this driver does not implement (llama.cpp's other types included),
            naming the ones it has.
    """
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    out: List[str] = []
    for n in (str(x).strip().lower() for x in names):
        if not n:
            continue
        if n not in SPEC_TYPE_NAMES:
            raise ValueError(f"speculative type {n!r} is not available here; use a comma-separated list of "
                             f"{', '.join(SPEC_TYPE_NAMES)}")
        if n != "none" and n not in out:
            out.append(n)
    return tuple(out)


def effective_spec_types(value: Any, has_drafter: bool) -> Tuple[str, ...]:
    """The draft sources a generation uses: :func:`parse_spec_types` of ``value``, or when unset
    the default: all three with a drafter, none without."""
    names = parse_spec_types(value)
    if names is None:
        names = ("draft-dflash", "ngram-simple", "ngram-mod") if has_drafter else ()
    return names


def by_name(name: str) -> Param:
    """The entry called ``name``.

    Raises:
        KeyError: no such entry.
    """
    for p in PARAMS:
        if p.name == name:
            return p
    raise KeyError(f"no generation parameter {name!r}")


def select(*, group: Optional[str] = None, command: Optional[str] = None, api: Optional[str] = None,
           custom: Optional[bool] = None) -> List[Param]:
    """Entries filtered by group, subcommand (has flags there), API (has request names there) and
    ``custom``; the table's order."""
    out = []
    for p in PARAMS:
        if group is not None and p.group != group:
            continue
        if command is not None and (command not in p.commands or not p.flags_for(command)):
            continue
        if api is not None and not p.request.get(api):
            continue
        if custom is not None and p.custom != custom:
            continue
        out.append(p)
    return out


def table_fields(*, group: Optional[str] = None, command: Optional[str] = None):
    """Class decorator (apply before ``@dataclass``): add a field per selected entry that the
    class does not declare itself, with the entry's default (under ``command``), after the
    class's own fields. ``command`` selects entries whose ``commands`` contain it."""

    def deco(cls):
        ann = dict(cls.__dict__.get("__annotations__", {}))
        for p in PARAMS:
            if (group is not None and p.group != group) or (command is not None and command not in p.commands):
                continue
            if p.group == "input" or p.name in ann:
                continue
            ann[p.name] = "Any"
            setattr(cls, p.name, field(default=p.default_for(command), metadata={"param": p}))
        cls.__annotations__ = ann
        return cls

    return deco


# ---------------------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser, command: str, *, defaults: Optional[Mapping[str, Any]] = None,
                  skip: Sequence[str] = ()) -> None:
    """Add the flags of every entry that ``command`` has (dest = the entry's name).

    Args:
        p: The parser (or group).
        command: ``generate``, ``bench`` or ``serve``.
        defaults: Overrides of the entries' defaults.
        skip: Entry names to leave out (the command declares them itself).

    The grammar inputs (``--grammar``, ``--grammar-file``, ``-j``, ``-jf``) are mutually exclusive.
    """
    defaults = dict(defaults or {})
    exclusive = None
    for prm in select(command=command):
        if prm.name in skip:
            continue
        dflt = defaults.get(prm.name, prm.default_for(command))
        target: Any = p
        if prm.name in ("grammar", "grammar_file", "json_schema", "json_schema_file"):
            exclusive = exclusive or p.add_mutually_exclusive_group()
            target = exclusive
        kw: Dict[str, Any] = dict(dest=prm.name, default=dflt, help=f"{prm.help} (default: {_show(dflt)})")
        if prm.type is bool and prm.choices is None:
            kw.update(action="store_true")
        elif prm.type in (list, dict):
            kw.update(action="append", metavar=prm.metavar)
            kw["default"] = None
        elif prm.choices is not None:
            kw.update(type=_choice(prm), metavar=prm.metavar or "|".join(prm.choices))
        else:
            kw.update(type=prm.parse or _typed(prm.type), metavar=prm.metavar)
        target.add_argument(*prm.flags_for(command), **kw)


def _show(v: Any) -> str:
    return {True: "on", False: "off", None: "unset"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)


def _typed(t: type) -> Callable[[str], Any]:
    def conv(s: str) -> Any:
        try:
            return t(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {t.__name__}, got {s!r}") from None

    conv.__name__ = t.__name__
    return conv


def _choice(prm: Param) -> Callable[[str], Any]:
    def conv(s: str) -> Any:
        key = str(s).strip().lower()
        if key in prm.choices:
            return prm.choices[key]
        if set(prm.choices) == {"on", "off"}:
            return _on_off(s)
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(prm.choices)}, got {s!r}")

    conv.__name__ = prm.name
    return conv


def parse_logit_bias(items: Optional[Iterable[str]]) -> Dict[int, float]:
    """llama.cpp's ``-l TOKEN_ID(+/-)BIAS`` strings -> ``{token id: bias}`` (``-inf`` bans).

    Raises:
        ValueError: an item that is not of that form (the message shows the expected one).
    """
    out: Dict[int, float] = {}
    for it in items or []:
        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*", str(it))
        if not m:
            raise ValueError(f"logit bias {it!r}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf")
        v = float(m.group(3))
        out[int(m.group(1))] = -v if m.group(2) == "-" else v
    return out


def values_from_args(args: argparse.Namespace, command: str) -> Dict[str, Any]:
    """``{entry name: value}`` of the flags :func:`add_arguments` added for ``command``, the
    inputs resolved: ``-l`` strings -> a dict, ``--grammar-file`` / ``-j`` / ``-jf`` -> ``grammar``
    (a JSON schema converted with :func:`dflash2_gguf.chat.grammar.json_schema_to_grammar`).

    Raises:
        ValueError: an unreadable grammar / schema file, a bad logit bias or schema.
    """
    out: Dict[str, Any] = {}
    for prm in select(command=command):
        if not hasattr(args, prm.name):
            continue
        out[prm.name] = prm.normalize(getattr(args, prm.name))
    if "logit_bias" in out:
        out["logit_bias"] = parse_logit_bias(out["logit_bias"]) or None
    gfile, schema, sfile = out.pop("grammar_file", None), out.pop("json_schema", None), out.pop("json_schema_file", None)
    try:
        if gfile:
            with open(gfile, encoding="utf-8") as f:
                out["grammar"] = f.read()
        if sfile:
            with open(sfile, encoding="utf-8") as f:
                schema = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {e.filename}: {e.strerror}") from None
    if schema is not None:
        from ..chat.grammar import json_schema_to_grammar

        out["grammar"] = json_schema_to_grammar(schema)
    return out


def sampling_from_values(values: Mapping[str, Any]):
    """The :class:`~dflash2_gguf.decoder.sampling.SamplingParams` of the sampling entries in ``values``
    (others ignored; missing ones keep the dataclass defaults).

    Raises:
        ValueError: a value the dataclass refuses.
    """
    from .sampling import SamplingParams

    names = {p.name for p in select(group="sampling")}
    return SamplingParams(**{k: v for k, v in values.items() if k in names})


# ---------------------------------------------------------------------------- requests

def request_fields(api: str) -> List[Tuple[str, Param]]:
    """``(request field name, entry)`` of the generic (not ``custom``) entries for ``api``: the
    fields the server's request models get from the table (``server/types.py``)."""
    return [(name, p) for p in select(api=api, custom=False) for name in p.request[api]]


def scalar_params(api: str = "chat") -> List[Param]:
    """The generic (not ``custom``) entries with request fields in ``api``; a request's value is
    its first request field that is set (``server/compat.py``)."""
    return select(api=api, custom=False)


def rename_request(body: Mapping[str, Any], api: str) -> Dict[str, Any]:
    """``body`` of the ``api`` (``responses`` / ``messages``) with each generic entry's field
    renamed to its chat name (the Responses and Messages endpoints run as chat requests)."""
    out = dict(body)
    for p in select(api=api, custom=False):
        chat = p.request.get("chat")
        if not chat:
            continue
        for name in p.request[api]:
            if name in out and name != chat[0]:
                out.setdefault(chat[0], out.pop(name))
    return out
