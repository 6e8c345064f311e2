"""Every llama-server command-line option and ``LLAMA_ARG_*`` variable, accepted by ``serve``.

The options come from ``llama_server_options.json`` (next to this file), which
``scripts/gen_llama_server_options.py`` generates from common/arg.cpp at llama.cpp 0c1e570 (the
commit llama-cpp-python 0.3.36 vendors): each option's spellings, ``--no-...`` negations, value
placeholders, handler kind and variable. ``serve`` (server/__main__.py) declares the options it
implements itself, with every llama.cpp spelling (:func:`spellings`); :func:`add_remaining` then
declares all the others, so that a llama-server command line parses whole. After parsing,
:func:`check_remaining` looks at those others:

- an option in :data:`REFUSED` given a value that would change results (a sampler this server
  does not have, a LoRA adapter, RoPE scaling, a model download, ...) is an error that names
  it and says why (a neutral value, e.g. ``--mirostat 0``, is accepted);
- an option llama.cpp has removed is an error with llama.cpp's own message;
- any other one has no meaning here (web UI, multimodal, RPC, thread placement,
  logging, ...): one warning line names it and it is ignored.

Variables (:func:`argv_with_env`): for each option with a variable that is set and none of
whose spellings is on the command line, the variable's value is used as if given as a flag:
llama.cpp's precedence (command line over variable; ``common_params_parse_ex``), its
``LLAMA_ARG_NO_*`` form for negatable options and its truthy / falsey words. Like llama.cpp,
``--foo_bar`` is read as ``--foo-bar``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["options", "spellings", "negations", "add_remaining", "check_remaining", "argv_with_env",
           "REFUSED", "REASONS", "DATA_FILE"]

#: The generated option list (scripts/gen_llama_server_options.py).
DATA_FILE = Path(__file__).with_name("llama_server_options.json")

_SAMPLER_ORDER = "the sampler chain here is fixed: penalties -> top_k -> top_p -> min_p -> temperature"

#: First spelling -> (values that change nothing, why any other value is refused). For a flag
#: without a value, ``()`` refuses it whenever given; for a negatable flag, the accepted values
#: are the booleans that keep llama-server's default.
REFUSED: Dict[str, Tuple[tuple, str]] = {
    "--samplers": ((), _SAMPLER_ORDER),
    "--sampler-seq": ((), _SAMPLER_ORDER),
    "--top-nsigma": ((-1.0,), "top-n-sigma sampling is not implemented"),
    "--xtc-probability": ((0.0,), "XTC sampling is not implemented"),
    "--typical": ((1.0,), "locally typical sampling is not implemented"),
    "--dry-multiplier": ((0.0,), "DRY sampling is not implemented"),
    "--adaptive-target": ((-1.0,), "adaptive-p sampling is not implemented"),
    "--dynatemp-range": ((0.0,), "dynamic temperature is not implemented"),
    "--mirostat": ((0.0,), "Mirostat sampling is not implemented"),
    "--reasoning-budget": ((-1.0,), "a thinking budget is not implemented (-1 = unrestricted is)"),
    "--lora": ((), "LoRA adapters are not supported"),
    "--lora-scaled": ((), "LoRA adapters are not supported"),
    "--control-vector": ((), "control vectors are not supported"),
    "--control-vector-scaled": ((), "control vectors are not supported"),
    "--override-kv": ((), "model metadata overrides are not supported"),
    "--rope-scaling": ((), "RoPE scaling overrides are not supported (the GGUF's are used)"),
    "--rope-scale": ((), "RoPE scaling overrides are not supported (the GGUF's are used)"),
    "--rope-freq-base": ((), "RoPE overrides are not supported (the GGUF's are used)"),
    "--rope-freq-scale": ((), "RoPE overrides are not supported (the GGUF's are used)"),
    "--yarn-orig-ctx": ((), "YaRN overrides are not supported (the GGUF's are used)"),
    "--yarn-ext-factor": ((), "YaRN overrides are not supported (the GGUF's are used)"),
    "--yarn-attn-factor": ((), "YaRN overrides are not supported (the GGUF's are used)"),
    "--yarn-beta-slow": ((), "YaRN overrides are not supported (the GGUF's are used)"),
    "--yarn-beta-fast": ((), "YaRN overrides are not supported (the GGUF's are used)"),
    "--embedding": ((), "this server has no embeddings endpoint"),
    "--rerank": ((), "this server has no reranking endpoint"),
    "-sp": ((), "special tokens are not rendered in outputs here"),
    "--skip-chat-parsing": ((False,), "chat output is always parsed (tool calls, reasoning) here"),
    "--prefill-assistant": ((True,), "a final assistant message is always continued here"),
    "--api-prefix": (("",), "the endpoints are served at the root; put a reverse proxy in front for a prefix"),
    "-mu": ((), "serve never downloads a model: give -m PATH"),
    "-dr": ((), "serve never downloads a model: give -m PATH"),
    "-hf": ((), "serve never downloads a model: give -m PATH"),
    "-hff": ((), "serve never downloads a model: give -m PATH"),
    "--spec-draft-hf": ((), "serve never downloads a model: give -md PATH"),
}
for _preset in ("--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default",
                "--fim-qwen-7b-default", "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default",
                "--gpt-oss-20b-default", "--gpt-oss-120b-default", "--vision-gemma-4b-default",
                "--vision-gemma-12b-default", "--spec-default"):
    REFUSED[_preset] = ((), "model presets download their models: give -m PATH (and -md DRAFT.gguf)")

#: First spelling (or a prefix of it) -> why it has no effect here (the warning's reason).
REASONS: Dict[str, str] = {
    "--mmproj": "no multimodal input here", "-mm": "no multimodal input here", "--image-": "no multimodal input here",
    "--video-": "no multimodal input here", "--mtmd-": "no multimodal input here", "-mmu": "no multimodal input here",
    "-mmdev": "no multimodal input here",
    "--ui-": "this web page has no settings of its own", "--webui-": "this web page has no settings of its own",
    "--tools": "no built-in tools here",
    "--mcp-": "no MCP here", "-ag": "no agent tools here",
    "--rpc": "no RPC backends here", "--log-": "logging is Python's (--log-level)", "-lv": "logging is Python's",
    "-ctk": "the KV cache is F16", "-ctv": "the KV cache is F16",
    "--spec-draft-type-": "the drafter's KV cache is F16",
    "--models-": "no router mode here: one model per server",
}


@functools.lru_cache(maxsize=1)
def options() -> Tuple[dict, ...]:
    """The llama-server options of :data:`DATA_FILE` (read once)."""
    with open(DATA_FILE, encoding="utf-8") as f:
        return tuple(json.load(f)["options"])


@functools.lru_cache(maxsize=None)
def _by_spelling() -> Dict[str, dict]:
    return {s: o for o in options() for s in list(o["args"]) + list(o["args_neg"])}


def spellings(flag: str) -> Tuple[str, ...]:
    """Every (positive) spelling llama-server has for the option spelled ``flag``.

    Raises:
        KeyError: llama-server has no such option.
    """
    return tuple(_by_spelling()[flag]["args"])


def negations(flag: str) -> Tuple[str, ...]:
    """The ``--no-...`` spellings of the option spelled ``flag`` (empty if it has none)."""
    return tuple(_by_spelling()[flag]["args_neg"])


def _dest(o: dict) -> str:
    return "_llama_" + o["args"][0].lstrip("-").replace("-", "_").replace(".", "_")


def add_remaining(p: argparse.ArgumentParser) -> List[dict]:
    """Declare every llama-server option none of whose spellings ``p`` has (help hidden;
    :func:`check_remaining` handles them after parsing). Returns those options.

    Raises:
        ValueError: ``p`` declares some spellings of an option but not all of them (a llama.cpp
            spelling would then mean something else here).
    """
    declared = set(p._option_string_actions)  # noqa: SLF001 - argparse has no public accessor
    added = []
    for o in options():
        spell = list(o["args"]) + list(o["args_neg"])
        have = [s for s in spell if s in declared]
        if have:
            missing = [s for s in spell if s not in declared]
            if missing:
                raise ValueError(f"serve declares {have} but not {missing} of the same llama-server option")
            continue
        dest = _dest(o)
        if o["handler"] == "bool":
            p.add_argument(*o["args"], dest=dest, action="store_const", const=True, default=None, help=argparse.SUPPRESS)
            if o["args_neg"]:
                p.add_argument(*o["args_neg"], dest=dest, action="store_const", const=False, help=argparse.SUPPRESS)
        elif o["handler"] == "void":
            p.add_argument(*o["args"], dest=dest, action="store_const", const=True, default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(*o["args"], dest=dest, default=None, nargs=max(len(o["values"]), 1) if o["handler"] == "str_str"
                           else None, metavar=tuple(o["values"]) if o["handler"] == "str_str" else None,
                           help=argparse.SUPPRESS)
        added.append(o)
    return added


def _reason(first: str) -> str:
    for key, why in REASONS.items():
        if first == key or (key.endswith("-") and first.startswith(key)):
            return why
    return "not used by this server"


def _neutral(value, allowed: tuple) -> bool:
    for a in allowed:
        if isinstance(a, bool) or isinstance(value, bool):
            if value is a:
                return True
            continue
        try:
            if float(value) == float(a):
                return True
        except (TypeError, ValueError):
            if str(value) == str(a):
                return True
    return False


def check_remaining(args: argparse.Namespace) -> List[str]:
    """The warning lines for the llama-server options given that have no effect here.

    Raises:
        ValueError: an option given that would change results here (:data:`REFUSED`, with the
            reason and what to do), or one llama.cpp has removed (llama.cpp's message).
    """
    warnings = []
    for o in options():
        dest = _dest(o)
        if not hasattr(args, dest):
            continue
        v = getattr(args, dest)
        if v is None:
            continue
        first = o["args"][0]
        name = "/".join(o["args"][:2])
        if o["removed"]:
            raise ValueError(f"{first}: {o['removed']}")
        if first in REFUSED:
            allowed, why = REFUSED[first]
            if not _neutral(v, allowed):
                shown = "" if v is True and o["handler"] == "void" else f" {v}"
                raise ValueError(f"{name}{shown} is not supported by this server: {why}"
                                 + (f"; leave it out or give {allowed[0]}" if allowed else "; leave it out"))
            continue
        warnings.append(f"warning: ignoring llama-server option {name}: {_reason(first)}")
    return warnings


def _truthy(v: str) -> Optional[bool]:
    s = v.strip().lower()
    if s in ("on", "enabled", "true", "1"):
        return True
    if s in ("off", "disabled", "false", "0"):
        return False
    return None


def normalize_argv(argv: Sequence[str]) -> List[str]:
    """llama.cpp reads ``--foo_bar`` as ``--foo-bar`` (the name part only; a ``=value`` is kept)."""
    out = []
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            name, eq, val = a.partition("=")
            a = name.replace("_", "-") + eq + val
        out.append(a)
    return out


def argv_with_env(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None,
                  stderr=None) -> List[str]:
    """``argv`` (normalised) with each set ``LLAMA_ARG_*`` variable of an option not on it
    prepended as that option's flag; a variable whose option is on the command line is ignored
    with llama.cpp's warning.

    Raises:
        ValueError: a negatable option's variable that is not a boolean word (llama.cpp's
            ``invalid boolean value``).
    """
    env = os.environ if environ is None else environ
    err = sys.stderr if stderr is None else stderr
    argv = normalize_argv(argv)
    given = {a.partition("=")[0] for a in argv if a.startswith("-")}
    extra: List[str] = []
    for o in options():
        var = o["env"]
        if not var:
            continue
        neg_var = var.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if o["args_neg"] else None
        if var not in env and not (neg_var and neg_var in env):
            continue
        spell = set(o["args"]) | set(o["args_neg"])
        if spell & given:
            on_cli = sorted(spell & given)[0]
            print(f"warn: {var} environment variable is set, but will be overwritten by command line argument "
                  f"{on_cli}", file=err)
            continue
        if neg_var and neg_var in env:
            extra.append(o["args_neg"][0])
            continue
        value = env[var]
        if o["handler"] == "bool":
            b = _truthy(value)
            if b is None:
                raise ValueError(f"error while handling environment variable \"{var}\": invalid boolean value "
                                 f"{value!r} (use on/off, true/false, 1/0, enabled/disabled)")
            extra.append(o["args"][0] if b else (o["args_neg"][0] if o["args_neg"] else None))
            if extra[-1] is None:
                extra.pop()
        elif o["handler"] == "void":
            if _truthy(value):
                extra.append(o["args"][0])
        elif o["handler"] == "str_str":
            extra += [o["args"][0], *value.split(None, 1)]
        else:
            extra += [o["args"][0], value]
    return extra + argv
