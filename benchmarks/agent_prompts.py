"""Build ``data/agent/agent_prompts.jsonl``: agent-shaped prompts made here (issue 43, Deliver 5).

Not drawn from any benchmark set. Four kinds, each row ``{"id", "kind", "messages", "turns",
"source"}`` (``messages``: the chat to render with the GGUF's template, ending with a user
message; ``turns``: the last user message alone, so that ``dflash2-gguf bench --dataset
data/agent/agent_prompts.jsonl`` can read the file as a prompt set; ``source``: where a code file
came from):

- ``code-edit``: a whole Python source file of 50-200 lines in the prompt, with an instruction
  (rename X to Y, fix this bug, add a method / docstrings / logging) and "print the whole file".
  The files are real source files: four of this repository (MIT), read from git at
  :data:`REPO_COMMIT`, and four of permissively licensed packages installed here (idna 3.21
  BSD-3-Clause, click 8.5.1 BSD-3-Clause, jinja2 3.1.6 BSD-3-Clause, requests 2.34.2 Apache-2.0),
  checked by sha256 (another installed version fails loudly rather than giving other prompts).
  Two of them get a bug put in by one exact string replacement, and the prompt describes the
  symptom.
- ``json-tool``: a tool call round trip: a system prompt that lists tools, the user's request,
  the assistant's tool call (JSON), the tool's result (a JSON object of 15-40 lines, its values
  drawn by ``random.Random(seed)``), and a request to call another tool with the same object and
  one field changed, JSON only.
- ``transcript``: one multi-turn coding-agent session (system prompt with tools; the assistant's
  tool calls and the tool results scripted here), replayed turn by turn: row ``i`` is the
  transcript up to the i-th tool result or user message, and the model writes the next assistant
  turn. History turns are scripted (not the model's own answers), so every configuration and
  both servers see exactly the same prompts.
- ``prose``: open questions whose answers do not copy the prompt (the control).

Usage::

    python -m benchmarks.agent_prompts            # (re)writes data/agent/agent_prompts.jsonl
    python -m benchmarks.agent_prompts --check    # exit 1 if the committed file differs
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import random
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "agent" / "agent_prompts.jsonl"
#: The commit of this repository whose files the code-edit prompts show.
REPO_COMMIT = "007f1e3"

SYSTEM_CODER = ("You are a careful coding assistant. When asked to change a file, apply exactly the change "
                "asked for and print the whole updated file in a single ```python block, with no explanation.")


def _fence(path: str, code: str) -> str:
    return f"Here is the file `{path}`:\n\n```python\n{code.rstrip()}\n```\n\n"


# ---------------------------------------------------------------------------- code edits

# (origin, path, instruction, bug): origin "repo" (git show REPO_COMMIT:path) or "pkg:<module>"
# (the installed package's file); bug: (old, new) replaced exactly once before the file is shown.
CODE_EDITS = [
    ("repo", "dflash2_gguf/stops.py",
     "Rename the class `StopStringBuffer` to `StopBuffer` everywhere in this file (the class, `__all__`, "
     "the docstrings and the example). Print the whole updated file.", None),
    ("repo", "dflash2_gguf/detok.py",
     "There is a bug: `StreamingDetokenizer(detok, window=0)` is accepted, and later calls then detokenize "
     "the whole output at every step. Fix the check in `__init__` so that a window below 1 raises. "
     "Print the whole fixed file.", ("if window < 1:", "if window < 0:")),
    ("repo", "dflash2_gguf/errors.py",
     "Add a new exception class `GrammarError(DFlashError, ValueError)` with the docstring \"A grammar "
     "could not be parsed.\" right after `UnsupportedError`, and add it to `__all__`. Print the whole "
     "updated file.", None),
    ("repo", "benchmarks/rollback_cost.py",
     "Replace every `print(...)` call with a call to a module-level `logging` logger "
     "(`log = logging.getLogger(__name__)`, `log.info`), keeping the messages. Print the whole updated file.",
     None),
    ("pkg:idna", "intranges.py",
     "Rename the function `intranges_contain` to `intranges_contains` and `_encode_range` to "
     "`_pack_range` everywhere in this file. Print the whole updated file.", None),
    ("pkg:click", "globals.py",
     "Rename `get_current_context` to `current_context` everywhere in this file (the overloads, the "
     "definition, the calls and the docstrings). Print the whole updated file.", None),
    ("pkg:jinja2", "visitor.py",
     "Add a method `visit_list(self, nodes, *args, **kwargs)` to `NodeVisitor`, after `visit`, that visits "
     "every node of a list and returns the list of results, with type hints and a docstring. Print the whole "
     "updated file.", None),
    ("pkg:requests", "structures.py",
     "There is a bug: `LookupDict.get(key, default)` returns None instead of `default` for a missing key. "
     "Fix it. Print the whole fixed file.",
     ("return self.__dict__.get(key, default)", "return self.__dict__.get(key)")),
]

#: sha256 of the installed files the prompts were made from (another version: other prompts).
PKG_SHA256 = {
    "idna/intranges.py": "838f6c70b4a4a89b4084b98e3836bb8551eb8928e66fad2d893b04a287097412",
    "click/globals.py": "80cf8d87a0383341c1fd2824685e4ce2770618c0c773f7e51d7bbdfe88781845",
    "jinja2/visitor.py": "11c9cbd4f2307ffe1154238cc6c44db91f005c76d2d6a7c074c384da780a273e",
    "requests/structures.py": "ba9460c39078f25e6f1d2a24ac941ac6f8d2ee97197fa8c8d0c262d8a1e67a02",
}
_PKG_META = {"idna": ("idna", "BSD-3-Clause"), "click": ("click", "BSD-3-Clause"),
             "jinja2": ("Jinja2", "BSD-3-Clause"), "requests": ("requests", "Apache-2.0")}


def _read_source(origin: str, path: str) -> tuple[str, dict]:
    if origin == "repo":
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{REPO_COMMIT}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        return text, dict(origin="dflash2-gguf (this repository)", commit=REPO_COMMIT, path=path, license="MIT")
    mod = origin.split(":", 1)[1]
    m = importlib.import_module(mod)
    text = (Path(m.__file__).parent / path).read_text(encoding="utf-8")
    dist, lic = _PKG_META[mod]
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != PKG_SHA256[f"{mod}/{path}"]:
        raise RuntimeError(f"{mod}/{path} of {dist} {version(dist)}: sha256 {digest}, not the file the committed "
                           "prompts were made from (install the versions named in the module docstring)")
    return text, dict(origin=f"{dist} {version(dist)} (installed package)", path=f"{mod}/{path}", license=lic,
                      sha256=digest)


def code_edit_rows() -> list:
    rows = []
    for i, (origin, path, instruction, bug) in enumerate(CODE_EDITS):
        text, src = _read_source(origin, path)
        if bug is not None:
            old, new = bug
            if text.count(old) != 1:
                raise RuntimeError(f"{path}: the bug's string {old!r} occurs {text.count(old)} times, not once")
            text = text.replace(old, new)
            src["bug"] = f"{old!r} -> {new!r}"
        n_lines = text.count("\n")
        if not 50 <= n_lines <= 200:
            raise RuntimeError(f"{path}: {n_lines} lines, not 50-200")
        src["lines"] = n_lines
        user = _fence(src["path"], text) + instruction
        msgs = [{"role": "system", "content": SYSTEM_CODER}, {"role": "user", "content": user}]
        rows.append(dict(id=f"code-edit-{i}", kind="code-edit", messages=msgs, source=src))
    return rows


# ---------------------------------------------------------------------------- JSON tool round trips

TOOLS_SYSTEM = """You are an assistant that acts by calling tools. To call a tool, answer with one JSON object \
{"name": <tool name>, "arguments": {...}} and nothing else. Tools:
- get_issue(repo: string, number: integer): an issue of a repository.
- update_issue(repo: string, number: integer, issue: object): replace an issue with the given object.
- get_order(order_id: string): an order of the shop.
- update_order(order_id: string, order: object): replace an order with the given object.
- get_user(user_id: integer): a user account.
- update_user(user_id: integer, user: object): replace a user account with the given object.
- get_deployment(service: string): the deployment settings of a service.
- update_deployment(service: string, deployment: object): replace a service's deployment settings."""

_FIRST = ["Ada", "Grace", "Linus", "Barbara", "Ken", "Margaret", "Dennis", "Frances", "Edsger", "Radia"]
_LAST = ["Lovelace", "Hopper", "Torvalds", "Liskov", "Thompson", "Hamilton", "Ritchie", "Allen", "Dijkstra",
         "Perlman"]
_WORDS = ["cache", "parser", "server", "token", "stream", "kernel", "buffer", "socket", "thread", "index",
          "schema", "router", "queue", "worker", "config", "session", "layout", "render", "budget", "window"]


def _issue(r: random.Random) -> dict:
    n = r.randint(100, 999)
    return {"number": n, "title": f"{r.choice(_WORDS).capitalize()} {r.choice(_WORDS)} fails when the "
            f"{r.choice(_WORDS)} is empty", "state": "open",
            "author": {"login": f"{r.choice(_FIRST).lower()}{r.randint(1, 99)}", "id": r.randint(10000, 99999)},
            "labels": [{"name": r.choice(["bug", "enhancement", "performance"]), "color": f"{r.randrange(16**6):06x}"},
                       {"name": r.choice(["server", "cli", "docs", "native"]), "color": f"{r.randrange(16**6):06x}"}],
            "assignees": [f"{r.choice(_FIRST).lower()}-{r.choice(_LAST).lower()}"],
            "milestone": {"title": f"v0.{r.randint(2, 9)}.0", "due_on": f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"},
            "comments": r.randint(0, 30), "created_at": f"2025-0{r.randint(1, 9)}-1{r.randint(0, 9)}T0{r.randint(0, 9)}:12:44Z",
            "body": f"Steps: start the {r.choice(_WORDS)} with an empty {r.choice(_WORDS)}, then call "
                    f"`{r.choice(_WORDS)}_{r.choice(_WORDS)}()`. Expected: no error. Actual: KeyError."}


def _order(r: random.Random) -> dict:
    items = [{"sku": f"SKU-{r.randint(1000, 9999)}", "name": f"{r.choice(_WORDS).capitalize()} {r.choice(['kit', 'cable', 'board', 'case'])}",
              "quantity": r.randint(1, 5), "unit_price": round(r.uniform(3, 120), 2)} for _ in range(r.randint(2, 4))]
    return {"order_id": f"ORD-{r.randint(100000, 999999)}", "status": "processing",
            "customer": {"name": f"{r.choice(_FIRST)} {r.choice(_LAST)}", "email": f"{r.choice(_FIRST).lower()}@example.com"},
            "shipping_address": {"street": f"{r.randint(1, 200)} {r.choice(_LAST)} Street", "city": r.choice(["Lyon", "Porto", "Leeds", "Graz"]),
                                 "postal_code": f"{r.randint(10000, 99999)}", "country": r.choice(["FR", "PT", "GB", "AT"])},
            "items": items, "currency": "EUR", "total": round(sum(i["quantity"] * i["unit_price"] for i in items), 2),
            "express": False, "notes": ""}


def _user(r: random.Random) -> dict:
    first, last = r.choice(_FIRST), r.choice(_LAST)
    return {"user_id": r.randint(1000, 9999), "username": f"{first.lower()}.{last.lower()}", "display_name": f"{first} {last}",
            "email": f"{first.lower()}.{last.lower()}@example.org", "role": "developer", "active": True,
            "preferences": {"theme": r.choice(["dark", "light"]), "language": r.choice(["en", "fr", "de"]),
                            "notifications": {"email": True, "push": r.choice([True, False]), "digest": "weekly"}},
            "teams": [r.choice(["core", "infra", "web", "ml"]), r.choice(["docs", "release", "triage"])],
            "last_login": f"2025-0{r.randint(1, 9)}-2{r.randint(0, 8)}T1{r.randint(0, 9)}:0{r.randint(0, 9)}:00Z",
            "quota": {"storage_gb": r.choice([10, 50, 100]), "used_gb": round(r.uniform(0, 10), 1)}}


def _deployment(r: random.Random) -> dict:
    svc = f"{r.choice(_WORDS)}-{r.choice(_WORDS)}"
    return {"service": svc, "image": f"registry.example.com/{svc}:1.{r.randint(0, 20)}.{r.randint(0, 9)}",
            "replicas": r.randint(2, 6), "region": r.choice(["eu-west-1", "us-east-2", "ap-south-1"]),
            "resources": {"cpu": f"{r.choice([250, 500, 1000])}m", "memory": f"{r.choice([256, 512, 1024])}Mi"},
            "env": {"LOG_LEVEL": "info", "WORKERS": str(r.randint(2, 8)), "TIMEOUT_S": str(r.choice([30, 60, 120]))},
            "healthcheck": {"path": "/health", "interval_s": 10, "timeout_s": 2, "retries": 3},
            "autoscaling": {"enabled": False, "min": 2, "max": 10, "target_cpu": 70},
            "ports": [{"name": "http", "port": 8080}, {"name": "metrics", "port": 9090}]}


# (getter, get tool + args, update tool, key of the id, object name, change request, the user's first ask)
JSON_CASES = [
    (_issue, "get_issue", "update_issue", "issue", "Set \"state\" to \"closed\".", "Show me issue {n} of acme/widgets."),
    (_issue, "get_issue", "update_issue", "issue", "Change the milestone title to \"v1.0.0\".", "Fetch acme/widgets issue {n}."),
    (_order, "get_order", "update_order", "order", "Set \"express\" to true.", "Look up my order {n}."),
    (_order, "get_order", "update_order", "order", "Change the shipping city to \"Bordeaux\".", "What is in order {n}?"),
    (_user, "get_user", "update_user", "user", "Set the theme to \"high-contrast\".", "Get the account of user {n}."),
    (_user, "get_user", "update_user", "user", "Set \"role\" to \"maintainer\".", "Show user {n}."),
    (_deployment, "get_deployment", "update_deployment", "deployment", "Set \"replicas\" to 8.",
     "How is {n} deployed?"),
    (_deployment, "get_deployment", "update_deployment", "deployment", "Turn autoscaling on (\"enabled\": true).",
     "Get the deployment settings of {n}."),
]


def json_tool_rows() -> list:
    rows = []
    for i, (make, get_tool, upd_tool, obj, change, ask) in enumerate(JSON_CASES):
        r = random.Random(4300 + i)
        data = make(r)
        if obj == "issue":
            ident, args = data["number"], {"repo": "acme/widgets", "number": data["number"]}
            upd_args = '"repo": "acme/widgets", "number": %d' % ident
        elif obj == "order":
            ident, args = data["order_id"], {"order_id": data["order_id"]}
            upd_args = f'"order_id": "{ident}"'
        elif obj == "user":
            ident, args = data["user_id"], {"user_id": data["user_id"]}
            upd_args = f'"user_id": {ident}'
        else:
            ident, args = data["service"], {"service": data["service"]}
            upd_args = f'"service": "{ident}"'
        call = json.dumps({"name": get_tool, "arguments": args})
        result = json.dumps(data, indent=2)
        msgs = [{"role": "system", "content": TOOLS_SYSTEM},
                {"role": "user", "content": ask.format(n=ident)},
                {"role": "assistant", "content": call},
                {"role": "user", "content": f"Tool result of {get_tool}:\n```json\n{result}\n```\n\n"
                 f"{change} Call {upd_tool} with {upd_args} and the whole {obj} object above with only that "
                 f"field changed; keep every other field and the order of the keys. Answer with the JSON tool "
                 f"call only."}]
        rows.append(dict(id=f"json-tool-{i}", kind="json-tool", messages=msgs, source=dict(seed=4300 + i)))
    return rows


# ---------------------------------------------------------------------------- the agent transcript

AGENT_SYSTEM = """You are a coding agent working in a Python repository. Act by calling tools: answer with \
one JSON object {"name": <tool>, "arguments": {...}} and nothing else, or, when the task is done, with a \
short summary for the user. Tools:
- search(query: string): file:line matches of a string in the repository.
- read_file(path: string): the text of a file.
- write_file(path: string, text: string): replace a file with the given text (the whole file).
- run(command: string): run a shell command in the repository root; stdout and stderr."""


def transcript_rows() -> list:
    """One session, scripted: rename ``parse_seed`` to ``parse_random_seed`` in a small module and its
    caller, run the tests, fix what they report. Row i asks for the assistant turn after the i-th
    user / tool message."""
    seeds = '''"""Seeds of sampled requests."""

import random
from typing import Any, Optional

__all__ = ["parse_seed", "request_seed"]

#: llama.cpp's "random seed" value.
RANDOM_SEED = 0xFFFFFFFF


def parse_seed(value: Any) -> Optional[int]:
    """A request's seed: None for a random one (absent, -1 or 0xFFFFFFFF), else an int >= 0.

    Raises:
        ValueError: not an integer, or negative other than -1.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"seed must be an integer, got {value!r}")
    if value in (-1, RANDOM_SEED):
        return None
    if value < 0:
        raise ValueError(f"seed must be >= 0 or -1, got {value}")
    return value


def request_seed(value: Any, base: int, index: int) -> int:
    """The seed of request ``index`` of a run whose base seed is ``base``: the request's own seed
    when it gives one, else ``base + index``; a random base draws one."""
    seed = parse_seed(value)
    if seed is not None:
        return seed
    if base < 0:
        base = random.randrange(2**31)
    return base + index
'''
    caller = '''"""Turn request bodies into sampling settings."""

from .seeds import parse_seed, request_seed
from .sampling import SamplingParams


def sampling_from_body(body: dict, index: int = 0) -> SamplingParams:
    """The sampling settings of one request body (OpenAI and llama-server names)."""
    temperature = float(body.get("temperature", 0.8))
    top_k = int(body.get("top_k", 40))
    top_p = float(body.get("top_p", 0.95))
    seed = request_seed(body.get("seed"), base=int(body.get("base_seed", 0)), index=index)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def check_seed(body: dict) -> None:
    """Raise ValueError early for a bad seed, before the request is queued."""
    parse_seed(body.get("seed"))
'''
    test_out = '''============================= test session starts ==============================
collected 14 items

tests/test_seeds.py ......F.                                             [ 57%]
tests/test_requests.py ......                                            [100%]

=================================== FAILURES ===================================
__________________________ test_parse_seed_rejects_bool __________________________

    def test_parse_seed_rejects_bool():
>       from pkg.seeds import parse_seed
E       ImportError: cannot import name 'parse_seed' from 'pkg.seeds'

tests/test_seeds.py:41: ImportError
=========================== short test summary info ============================
FAILED tests/test_seeds.py::test_parse_seed_rejects_bool - ImportError: cannot import name 'parse_seed'
========================= 1 failed, 13 passed in 0.42s =========================
'''
    new_seeds = seeds.replace("parse_seed", "parse_random_seed")
    new_caller = caller.replace("parse_seed", "parse_random_seed")
    test_file = '''import pytest

from pkg.seeds import RANDOM_SEED, parse_seed, request_seed


def test_parse_seed_none():
    assert parse_seed(None) is None
    assert parse_seed(-1) is None
    assert parse_seed(RANDOM_SEED) is None


def test_parse_seed_values():
    assert parse_seed(0) == 0
    assert parse_seed(42) == 42


def test_parse_seed_rejects_negative():
    with pytest.raises(ValueError):
        parse_seed(-2)


def test_request_seed():
    assert request_seed(None, base=10, index=3) == 13
    assert request_seed(7, base=10, index=3) == 7


def test_parse_seed_rejects_bool():
    from pkg.seeds import parse_seed
    with pytest.raises(ValueError):
        parse_seed(True)
'''

    def call(name: str, **args) -> str:
        return json.dumps({"name": name, "arguments": args})

    def tool(name: str, out: str) -> str:
        return f"Tool result of {name}:\n{out}"

    conv = [
        ("user", "Rename the function `parse_seed` to `parse_random_seed` in pkg/seeds.py and update every "
                 "caller. Then run the tests and fix anything that fails."),
        ("assistant", call("search", query="parse_seed")),
        ("user", tool("search", "pkg/seeds.py:6: __all__ = [\"parse_seed\", \"request_seed\"]\n"
                                "pkg/seeds.py:12: def parse_seed(value: Any) -> Optional[int]:\n"
                                "pkg/seeds.py:34:     seed = parse_seed(value)\n"
                                "pkg/requests.py:3: from .seeds import parse_seed, request_seed\n"
                                "pkg/requests.py:20:     parse_seed(body.get(\"seed\"))\n"
                                "tests/test_seeds.py:3: from pkg.seeds import RANDOM_SEED, parse_seed, request_seed")),
        ("assistant", call("read_file", path="pkg/seeds.py")),
        ("user", tool("read_file", "```python\n" + seeds + "```")),
        ("assistant", call("write_file", path="pkg/seeds.py", text=new_seeds)),
        ("user", tool("write_file", "wrote pkg/seeds.py (38 lines)")),
        ("assistant", call("read_file", path="pkg/requests.py")),
        ("user", tool("read_file", "```python\n" + caller + "```")),
        ("assistant", call("write_file", path="pkg/requests.py", text=new_caller)),
        ("user", tool("write_file", "wrote pkg/requests.py (21 lines)")),
        ("assistant", call("run", command="python -m pytest -q tests")),
        ("user", tool("run", test_out)),
        ("assistant", call("read_file", path="tests/test_seeds.py")),
        ("user", tool("read_file", "```python\n" + test_file + "```")),
        ("assistant", call("write_file", path="tests/test_seeds.py",
                           text=test_file.replace("parse_seed", "parse_random_seed"))),
        ("user", tool("write_file", "wrote tests/test_seeds.py (31 lines)")),
        ("assistant", call("run", command="python -m pytest -q tests")),
        ("user", tool("run", "14 passed in 0.39s")),
        ("assistant", "Renamed `parse_seed` to `parse_random_seed` in pkg/seeds.py, pkg/requests.py and "
                      "tests/test_seeds.py; the 14 tests pass."),
        ("user", "Thanks. Now also add a module docstring line to pkg/requests.py saying that seeds go through "
                 "`parse_random_seed`, and show me the whole file as you would write it."),
        ("assistant", call("write_file", path="pkg/requests.py", text=new_caller.replace(
            '"""Turn request bodies into sampling settings."""',
            '"""Turn request bodies into sampling settings (seeds go through `parse_random_seed`)."""'))),
        ("user", tool("write_file", "wrote pkg/requests.py (21 lines)") + "\n\nNow show me the final "
                 "pkg/seeds.py as well, the whole file, in a ```python block, not as a tool call."),
    ]
    rows = []
    msgs = [{"role": "system", "content": AGENT_SYSTEM}]
    turn = 0
    for role, content in conv:
        msgs.append({"role": role, "content": content})
        if role == "user":
            rows.append(dict(id=f"transcript-{turn}", kind="transcript", messages=[dict(m) for m in msgs],
                             source=dict(turn=turn)))
            turn += 1
    return rows


# ---------------------------------------------------------------------------- prose

PROSE = [
    "Write a short story, about 200 words, about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky is blue and why sunsets are red.",
    "What are the main causes of inflation? Give a balanced explanation in a few paragraphs.",
    "Describe a walk through a market in a coastal town in early morning, with sounds and smells.",
    "Compare trains and planes for a 600 km trip in Europe: time, cost, comfort and climate.",
    "Write a letter to a friend recommending a book you loved, without naming its author.",
    "Why do some bridges sway in the wind? Explain resonance and how engineers prevent it.",
    "Give advice to someone starting to learn the piano as an adult: habits, pitfalls, motivation.",
]


def prose_rows() -> list:
    return [dict(id=f"prose-{i}", kind="prose", messages=[{"role": "user", "content": q}], source=None)
            for i, q in enumerate(PROSE)]


def build() -> list:
    rows = code_edit_rows() + json_tool_rows() + transcript_rows() + prose_rows()
    for r in rows:
        r["turns"] = [r["messages"][-1]["content"]]
    return rows


def dumps(rows: list) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=False) + "\n" for r in rows)


def load(path: Path = OUT) -> list:
    """The rows of the committed prompt file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    a = p.parse_args(argv)
    text = dumps(build())
    out = Path(a.out)
    if a.check:
        same = out.is_file() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'up to date' if same else 'DIFFERS'}")
        return 0 if same else 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    kinds = {}
    for r in build():
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {out}: {kinds}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
