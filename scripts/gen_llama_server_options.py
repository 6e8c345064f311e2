"""Write ``dflash2_gguf/server/llama_server_options.json``: every command-line option that
llama-server accepts at the pinned llama.cpp commit, read from that commit's ``common/arg.cpp``.

    python scripts/gen_llama_server_options.py                    # arg.cpp from the pinned sdist
    python scripts/gen_llama_server_options.py --arg-cpp PATH     # a local copy of it

Which options llama-server has (``common_params_parser_init``, common/arg.cpp at 0c1e570): every
``add_opt(common_arg(...))`` whose ``set_examples({...})`` contains ``LLAMA_EXAMPLE_SERVER``, or
contains ``LLAMA_EXAMPLE_COMMON`` (the default when an option calls no ``set_examples``: all tools
inherit it), and whose ``set_excludes({...})`` does not name ``LLAMA_EXAMPLE_SERVER``. One option
is declared twice under ``if (ex == LLAMA_EXAMPLE_SERVER) {...} else {...}`` (``-np``); the first
declaration (the server's) is kept.

Each option records: ``args`` (its spellings), ``args_neg`` (``--no-...`` spellings of a boolean
option), ``values`` (the value placeholders: 0 = a flag, 1, or 2 for the two-value options),
``handler`` (``void``, ``bool``, ``int``, ``string``, ``str_str``: how llama.cpp converts the
value), ``env`` (its ``LLAMA_ARG_*`` variable, or None), ``removed`` (llama.cpp's message when the
handler only calls ``arg_removed``: llama-server refuses the option), ``sampling`` / ``spec``
(llama.cpp's help sections) and the first line of its ``help``.

Parsing is a small tokenizer for the C++ this file is written in (string and character literals,
comments, bracket depth); it fails loudly on a construct it does not know, rather than skipping it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "dflash2_gguf" / "server" / "llama_server_options.json"
COMMIT = "0c1e570"
SERVER, COMMON = "LLAMA_EXAMPLE_SERVER", "LLAMA_EXAMPLE_COMMON"


def _strip_comments(src: str) -> str:
    """``src`` with // and /* */ comments blanked (string and char literals kept)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            i = n if j < 0 else j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _match(src: str, i: int) -> int:
    """Index just past the bracket closing the one at ``src[i]`` (literals skipped)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[src[i]]]
    j = i + 1
    while stack:
        c = src[j]
        if c in "\"'":
            k = j + 1
            while src[k] != c:
                k += 2 if src[k] == "\\" else 1
            j = k + 1
            continue
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")}]":
            if c != stack.pop():
                raise ValueError(f"unbalanced {c!r} at offset {j}")
        j += 1
    return j


def _split_top(s: str) -> list[str]:
    """Split at commas outside brackets and literals."""
    parts, depth, start, j = [], 0, 0, 0
    while j < len(s):
        c = s[j]
        if c in "\"'":
            k = j + 1
            while s[k] != c:
                k += 2 if s[k] == "\\" else 1
            j = k + 1
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:j].strip())
            start = j + 1
        j += 1
    parts.append(s[start:].strip())
    return [p for p in parts if p]


_LIT = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _literals(expr: str) -> list[str]:
    return [bytes(m, "utf-8").decode("unicode_escape") for m in _LIT.findall(expr)]


def _string_list(expr: str) -> list[str]:
    expr = expr.strip()
    if not (expr.startswith("{") and expr.endswith("}")):
        raise ValueError(f"expected a {{...}} list of strings, got {expr[:60]!r}")
    return _literals(expr)


def _help(expr: str) -> str:
    """First line of the help text (a literal, literals concatenated, or string_format's format)."""
    m = re.match(r"\s*string_format\s*\(", expr)
    body = expr[m.end():] if m else expr
    if m:
        body = _split_top(body[: _match(expr, m.end() - 1) - m.end() - 1])[0]
    text = "".join(_literals(body))
    return text.strip().split("\n")[0].strip()


def _handler(lam: str) -> str:
    m = re.match(r"\s*\[[^\]]*\]\s*\(([^)]*)\)", lam)
    if not m:
        raise ValueError(f"expected a lambda handler, got {lam[:80]!r}")
    ps = [p.strip() for p in m.group(1).split(",") if p.strip()]
    kinds = []
    for p in ps[1:]:
        if "std::string" in p:
            kinds.append("string")
        elif re.match(r"(const\s+)?int\b", p):
            kinds.append("int")
        elif re.match(r"(const\s+)?bool\b", p):
            kinds.append("bool")
        else:
            raise ValueError(f"unknown handler parameter {p!r}")
    if not kinds:
        return "void"
    if kinds == ["string", "string"]:
        return "str_str"
    if len(kinds) != 1:
        raise ValueError(f"unknown handler signature {m.group(1)!r}")
    return kinds[0]


def parse_arg_cpp(src: str) -> list[dict]:
    """Every option of ``common_params_parser_init`` with the examples it applies to."""
    src = _strip_comments(src)
    lists = {m.group(1): [e.strip() for e in m.group(2).split(",") if e.strip()]
             for m in re.finditer(r"static\s+std::initializer_list<enum\s+llama_example>\s+(\w+)\s*=\s*\{([^}]*)\}", src)}
    start = src.index("common_params_context common_params_parser_init(")
    body_open = src.index("{", src.index(")", start))
    body = src[body_open: _match(src, body_open)]
    opts = []
    for m in re.finditer(r"\badd_opt\s*\(\s*common_arg\s*\(", body):
        ca_open = m.end() - 1
        ca_close = _match(body, ca_open)
        call_end = _match(body, m.start() + body[m.start():].index("("))
        cargs = _split_top(body[ca_open + 1: ca_close - 1])
        chain = body[ca_close: call_end - 1]
        lam = cargs[-1]
        handler = _handler(lam)
        args = _string_list(cargs[0])
        args_neg, values = [], []
        if len(cargs) == 3:        # (args, help, handler_void)
            help_expr = cargs[1]
        elif len(cargs) == 4 and cargs[1].lstrip().startswith("{"):   # (args, args_neg, help, handler_bool)
            args_neg, help_expr = _string_list(cargs[1]), cargs[2]
        elif len(cargs) == 4:      # (args, value_hint, help, handler_string / handler_int)
            values, help_expr = ["".join(_literals(cargs[1]))], cargs[2]
        elif len(cargs) == 5:      # (args, value_hint, value_hint_2, help, handler_str_str)
            values, help_expr = ["".join(_literals(cargs[1])), "".join(_literals(cargs[2]))], cargs[3]
        else:
            raise ValueError(f"common_arg with {len(cargs)} arguments: {args}")
        examples, excludes = [COMMON], []
        env = None
        for cm in re.finditer(r"\.\s*(set_examples|set_excludes|set_env|set_sampling|set_spec|set_preset_only)\s*\(", chain):
            inner = chain[cm.end(): _match(chain, cm.end() - 1) - 1].strip()
            if cm.group(1) in ("set_examples", "set_excludes"):
                names = ([e.strip() for e in inner.strip("{} ").split(",") if e.strip()] if inner.startswith("{")
                         else lists[inner])
                if cm.group(1) == "set_examples":
                    examples = names
                else:
                    excludes = names
            elif cm.group(1) == "set_env":
                lit = _literals(inner)
                if not lit:
                    raise ValueError(f"set_env without a literal: {inner!r}")
                env = lit[0]
        removed = re.search(r"\barg_removed\s*\(\s*\"((?:[^\"\\]|\\.)*)\"", lam)
        opts.append({
            "args": args, "args_neg": args_neg, "values": values, "handler": handler, "env": env,
            "removed": ("the argument has been removed. " + removed.group(1)) if removed else None,
            "sampling": ".set_sampling(" in chain.replace(" ", ""), "spec": ".set_spec(" in chain.replace(" ", ""),
            "examples": examples, "excludes": excludes, "help": _help(help_expr),
        })
    return opts


def server_options(opts: list[dict]) -> list[dict]:
    """The options llama-server accepts (see the module docstring); first declaration wins."""
    out, seen = [], set()
    for o in opts:
        if not ((SERVER in o["examples"] or COMMON in o["examples"]) and SERVER not in o["excludes"]):
            continue
        spell = set(o["args"]) | set(o["args_neg"])
        if spell & seen:
            if not spell <= seen:
                raise ValueError(f"options overlap partly: {sorted(spell)}")
            continue
        seen |= spell
        out.append({k: v for k, v in o.items() if k not in ("examples", "excludes")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arg-cpp", default=None, help="common/arg.cpp to read (default: the pinned sdist's, fetched once)")
    ap.add_argument("--out", default=str(OUT), help=f"output JSON (default: {OUT.relative_to(ROOT)})")
    a = ap.parse_args(argv)
    if a.arg_cpp:
        path = Path(a.arg_cpp)
    else:
        sys.path.insert(0, str(ROOT))
        from benchmarks.upstream import fetch_upstream

        path = fetch_upstream(needed=("common/arg.cpp", "LICENSE", "convert_hf_to_gguf.py"),
                              root=None) / "common" / "arg.cpp"
        if not path.is_file():
            raise SystemExit(f"{path} missing: the upstream cache predates arg.cpp; remove its folder and rerun, "
                             "or pass --arg-cpp vendor/llama.cpp/common/arg.cpp of llama-cpp-python 0.3.36's sdist")
    raw = path.read_bytes()
    opts = server_options(parse_arg_cpp(raw.decode("utf-8")))
    doc = {
        "source": {"llama.cpp": COMMIT, "file": "common/arg.cpp", "sha256": hashlib.sha256(raw).hexdigest(),
                   "generator": "scripts/gen_llama_server_options.py"},
        "options": opts,
    }
    Path(a.out).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(opts)} llama-server options -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
