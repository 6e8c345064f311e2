"""The one chat renderer: a GGUF's own Jinja chat template, rendered as Hugging Face does.

Every place that turns chat messages into a prompt (``DFlashDecoder.apply_chat_template`` and
``generate(messages=...)``, ``generate --chat``, ``serve``, ``bench``, training capture) goes
through :class:`ChatRenderer`, so a chat is the same token sequence everywhere and the same as in
``transformers`` and stock llama-server.

How it renders (transformers 5.15.0, ``transformers/utils/chat_template_utils.py``:
``_compile_jinja_template`` and ``render_jinja_template``; ``apply_chat_template`` in
``tokenization_utils_base.py``), with the maintained ``jinja2`` package:

- ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks``, the
  ``loopcontrols`` extension and a ``{% generation %}`` block tag that renders its body (transformers
  uses it to mark assistant tokens; here it only has to parse);
- a ``tojson`` filter that is ``json.dumps`` with ``ensure_ascii=False`` and the ``indent``,
  ``separators`` and ``sort_keys`` arguments (jinja2's own filter escapes ``<``, ``>``, ``&``, ``'``);
- the globals ``raise_exception(msg)`` (raises; reported as :class:`ChatTemplateError`) and
  ``strftime_now(fmt)``;
- variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, ``bos_token``,
  ``eos_token``, plus any ``chat_template_kwargs`` (``enable_thinking``, ...).

Differences from ``transformers``, all on the way in (the template itself runs unchanged):

- bos/eos strings are the GGUF vocabulary's (as llama-server's ``common_chat_templates_init`` in
  ``common/chat.cpp``, llama.cpp 0c1e570); the other special-token variables of a HF tokenizer
  (``pad_token``, ``unk_token``, ...) are not defined;
- content given as a list of parts is flattened to one string: the ``text`` of its ``"text"`` parts
  joined with ``"\\n"`` (llama.cpp ``concat_content_parts``); other keys (``cache_control``) and
  other part types are dropped; null or missing content becomes ``""`` (llama.cpp's
  ``common_chat_msg`` holds a string; transformers would hand the template None);
- an assistant ``tool_calls[].function.arguments`` given as a JSON string (OpenAI's shape) is
  parsed into a dict, which is what transformers' templates expect (``arguments | tojson``) and
  what llama.cpp's ``func_args_not_string`` does;
- the ``developer`` role becomes ``system`` (llama-server does so for every template without
  ``<|channel|>``);
- with ``tools`` and a ``tokenizer.chat_template.tool_use`` template in the GGUF, that template is
  used (both transformers and llama-server pick it).

A GGUF without any template gets ChatML, as llama-server does (its ``CHATML_TEMPLATE_SRC``; the
same text as libllama's ``llama_chat_apply_template`` with ``"chatml"``).

Tokenizing (:meth:`ChatRenderer.prompt_text`): llama-server drops a leading ``bos_token`` from the
rendered text when the vocabulary adds BOS itself, and a trailing ``eos_token`` when it adds EOS
(``common_chat_template_direct_apply_impl``), then tokenizes with ``add_special=True,
parse_special=True``. :func:`chat_prompt_ids` does exactly that, so a template that writes
``{{ bos_token }}`` never yields two BOS tokens.
"""

from __future__ import annotations

import copy
import json
import os
import weakref
from datetime import datetime
from typing import Any, Mapping, Optional, Sequence, Union

__all__ = [
    "ChatRenderer", "ChatTemplateError", "CHATML_TEMPLATE", "normalize_messages", "renderer_for",
    "chat_prompt_ids", "render_builtin", "renderer_for_llama_model",
]

#: ChatML, what llama-server renders for a GGUF without a chat template (llama.cpp 0c1e570,
#: ``common/chat.cpp`` ``CHATML_TEMPLATE_SRC``; libllama's built-in ``"chatml"`` gives the same).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered, or the messages do not fit it.

    ``source`` names the template (e.g. ``"tokenizer.chat_template of model.gguf"``).
    """

    def __init__(self, message: str, source: str = "chat template"):
        super().__init__(message)
        self.source = source


# ----------------------------------------------------------------------------- jinja environment


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter: plain ``json.dumps``, no HTML escaping, non-ASCII kept."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment():
    """The sandboxed jinja2 environment transformers renders chat templates in (built once)."""
    global _ENV
    if _ENV is None:
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _GenerationTag(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV


_ENV = None


# ----------------------------------------------------------------------------- messages


def _flatten_content(content: Any, where: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping):
                if part.get("type", "text") == "text":
                    text = part.get("text", "")
                    if not isinstance(text, str):
                        raise ChatTemplateError(f"{where}: a text part's 'text' must be a string, got {type(text).__name__}")
                    texts.append(text)
                # other part types (image_url, input_audio, ...) have no text: dropped, as llama.cpp does
            else:
                raise ChatTemplateError(f"{where}: content parts must be objects, got {type(part).__name__}")
        return "\n".join(texts)
    raise ChatTemplateError(f"{where}: content must be a string, a list of text parts or null, "
                            f"got {type(content).__name__}")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list:
    """Messages as chat templates expect them (a deep copy; the input is not modified).

    Args:
        messages: OpenAI-shaped chat messages: dicts with ``role`` and ``content`` (a string, None,
            or a list of parts ``{"type": "text", "text": ...}`` with any extra keys), and for
            assistant messages optionally ``tool_calls`` (``[{"id", "type": "function",
            "function": {"name", "arguments"}}]``, arguments a JSON string or a dict), for tool
            messages ``tool_call_id`` / ``name``. Other keys pass through to the template.

    Returns:
        A list of dicts: content parts joined with ``"\\n"`` (text parts only), null or missing
        content -> ``""`` (as llama-server), ``developer`` -> ``system``, tool-call ``arguments``
        strings parsed into dicts.

    Raises:
        ChatTemplateError: a message is not a dict, has no string ``role``, has content of a wrong
            type, or tool-call arguments that are not JSON.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError(f"messages[{i}] has no 'role' string")
        msg = copy.deepcopy(dict(m))
        if role == "developer":
            msg["role"] = "system"
        content = _flatten_content(msg.get("content"), f"messages[{i}].content")
        msg["content"] = "" if content is None else content
        calls = msg.get("tool_calls")
        if calls:
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, dict):
                    continue
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as e:
                        raise ChatTemplateError(
                            f"messages[{i}].tool_calls[{j}].function.arguments is not JSON ({e}): "
                            "send the arguments the model produced, as a JSON object string") from None
        out.append(msg)
    return out


# ----------------------------------------------------------------------------- renderer


class ChatRenderer:
    """A Jinja chat template rendered exactly as ``transformers``' ``apply_chat_template`` does.

    Args:
        template: The template source (GGUF ``tokenizer.chat_template``); empty/None -> ChatML.
        bos_token / eos_token: The strings the template sees as ``bos_token`` / ``eos_token``
            (the GGUF vocabulary's BOS/EOS pieces; "" when the vocabulary has none).
        tool_use_template: GGUF ``tokenizer.chat_template.tool_use``, used when ``tools`` are given.
        add_bos / add_eos: Whether the tokenizer adds BOS / EOS itself (GGUF
            ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``); only :meth:`prompt_text` uses them.
        source: Names the template in error messages.

    Raises:
        ChatTemplateError: the template does not compile (its jinja2 syntax error, with the line).

    Thread-safe: compiled templates are immutable.
    """

    def __init__(self, template: Optional[str], bos_token: str = "", eos_token: str = "", *,
                 tool_use_template: Optional[str] = None, add_bos: bool = False, add_eos: bool = False,
                 source: str = "chat template") -> None:
        self.source = source
        self.has_template = bool(template) or bool(tool_use_template)
        self.template = template or tool_use_template or CHATML_TEMPLATE
        self.tool_use_template = tool_use_template or None
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self._compiled = self._compile(self.template, source)
        self._compiled_tool_use = (self._compile(self.tool_use_template, source + " (tool_use)")
                                   if self.tool_use_template else None)

    @staticmethod
    def _compile(text: str, source: str):
        from jinja2.exceptions import TemplateSyntaxError

        try:
            return _environment().from_string(text)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"cannot compile {source}: {e.message} (template line {e.lineno})", source) from None

    def template_for(self, tools: Optional[Sequence[Any]] = None) -> str:
        """The template source used for a request with (or without) ``tools``."""
        return self.tool_use_template if (tools and self.tool_use_template) else self.template

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Optional[Sequence[Any]] = None,
               documents: Optional[Sequence[Mapping[str, Any]]] = None, add_generation_prompt: bool = True,
               **template_kwargs: Any) -> str:
        """Render ``messages`` to the prompt text (what ``apply_chat_template(..., tokenize=False)``
        returns).

        Args:
            messages: OpenAI-shaped messages (see :func:`normalize_messages`).
            tools: OpenAI tool specs (``[{"type": "function", "function": {"name", "description",
                "parameters"}}]``), passed to the template as they are; None -> ``tools`` is None.
            documents: RAG documents (dicts) for templates that take them.
            add_generation_prompt: End with the assistant turn's opening.
            **template_kwargs: Extra template variables (``chat_template_kwargs``, e.g.
                ``enable_thinking=False``); they may override ``bos_token`` / ``eos_token``.

        Returns:
            The rendered text (special tokens as text; BOS included if the template writes it).

        Raises:
            ChatTemplateError: the messages are malformed, the template raised (its
                ``raise_exception`` message is quoted), or rendering failed (the jinja2 error).
        """
        from jinja2.exceptions import TemplateError

        msgs = normalize_messages(messages)
        if not msgs:
            raise ChatTemplateError("the conversation is empty: give at least one message", self.source)
        if documents is not None and any(not isinstance(d, Mapping) for d in documents):
            raise ChatTemplateError("documents must be a list of objects (e.g. {'title', 'text'})", self.source)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **template_kwargs}
        compiled = self._compiled_tool_use if (tools and self._compiled_tool_use is not None) else self._compiled
        try:
            return compiled.render(messages=msgs, tools=None if tools is None else list(tools),
                                   documents=documents, add_generation_prompt=bool(add_generation_prompt),
                                   **variables)
        except TemplateError as e:
            raise ChatTemplateError(f"{self.source} refused the conversation: {e}", self.source) from None
        except Exception as e:  # a template bug, e.g. 'NoneType' + str
            raise ChatTemplateError(f"rendering {self.source} failed: {type(e).__name__}: {e}", self.source) from None

    def prompt_text(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """:meth:`render` minus a leading ``bos_token`` when the tokenizer adds BOS itself, and a
        trailing ``eos_token`` when it adds EOS (llama.cpp 0c1e570 ``common/chat.cpp``,
        ``common_chat_template_direct_apply_impl``): the text to tokenize with ``add_special=True,
        parse_special=True``. Same arguments as :meth:`render`."""
        text = self.render(messages, **kwargs)
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text

    def generation_prompt_opens_thinking(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> bool:
        """True when the rendered prompt ends inside an open ``<think>`` block (templates such as
        Qwen3's thinking variants write ``<think>\\n`` after the assistant opening), so the model's
        output starts with reasoning. Same arguments as :meth:`render`."""
        text = self.render(messages, **kwargs).rstrip()
        return text.endswith("<think>")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, path: Union[str, "os.PathLike"]) -> "ChatRenderer":
        """The renderer of a GGUF file (cached per path).

        The GGUF's vocabulary is loaded alone (``vocab_only``, under a second for a 150k-token
        vocabulary; no weights) with llama-cpp-python's libllama, and read with the calls
        llama-server's ``common_chat_templates_init`` makes (:func:`renderer_for_llama_model`).

        Raises:
            FileNotFoundError: no such file; ChatTemplateError: libllama cannot read it, or the
                template does not compile.
        """
        key = os.path.abspath(os.fspath(path))
        hit = _BY_PATH.get(key)
        if hit is not None:
            return hit
        if not os.path.isfile(key):
            raise FileNotFoundError(f"no such GGUF file: {path}")
        import llama_cpp as L

        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.vocab_only = True
        model = L.llama_model_load_from_file(key.encode(), params)
        if not model:
            raise ChatTemplateError(f"libllama could not read the vocabulary of {path}", str(path))
        try:
            r = renderer_for_llama_model(model, str(path))
        finally:
            L.llama_model_free(model)
        _BY_PATH[key] = r
        return r


_BY_PATH: dict = {}


def renderer_for_engine(engine: Any, source: str = "the target GGUF") -> ChatRenderer:
    """The :class:`ChatRenderer` of a loaded native engine (``DFlashDecoder.engine``): template(s),
    BOS / EOS pieces and the tokenizer's add-BOS / EOS flags read from the target the engine
    holds (``Engine.chat_info``: the calls llama-server's ``common_chat_templates_init`` makes), so
    no second copy of the vocabulary is loaded.

    Raises:
        ChatTemplateError: the template does not compile.
    """
    ci = engine.chat_info()
    tmpl, tool_use = ci["chat_template"], ci["tool_use_template"]
    return ChatRenderer(tmpl, ci["bos"].decode("utf-8", errors="replace"), ci["eos"].decode("utf-8", errors="replace"),
                        tool_use_template=tool_use, add_bos=bool(ci["add_bos"]), add_eos=bool(ci["add_eos"]),
                        source=f"tokenizer.chat_template of {source}" if tmpl else f"ChatML (no template in {source})")


# ----------------------------------------------------------------------------- decoder glue

_BY_DECODER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def renderer_for(decoder: Any, template: Optional[str] = None) -> ChatRenderer:
    """The :class:`ChatRenderer` of a :class:`~dflash2_gguf.DFlashDecoder`'s target (cached per
    decoder and template).

    Template, bos/eos strings and the tokenizer's add-BOS/EOS flags: read through the decoder's
    loaded engine (:func:`renderer_for_engine`); an object without an ``engine`` (a stand-in with
    only ``target_path``) gets :meth:`ChatRenderer.from_gguf` of that file.

    Args:
        decoder: A :class:`~dflash2_gguf.DFlashDecoder`, or anything with ``target_path`` (and
            ``tokenize`` for :func:`chat_prompt_ids`).
        template: A template text to use instead of the GGUF's (llama-server's ``--chat-template``
            / ``--chat-template-file``), with the same bos/eos strings.

    Raises:
        ChatTemplateError: the template does not compile.
    """
    per = _BY_DECODER.get(decoder)
    if per is None:
        per = _BY_DECODER[decoder] = {}
    r = per.get(template)
    if r is None:
        base = per.get(None)
        if base is None:
            engine = getattr(decoder, "engine", None)
            base = per[None] = (renderer_for_engine(engine, os.path.basename(str(decoder.target_path)))
                                if engine is not None else ChatRenderer.from_gguf(decoder.target_path))
        if template is None:
            r = base
        else:
            r = ChatRenderer(template, base.bos_token, base.eos_token, add_bos=base.add_bos,
                             add_eos=base.add_eos, source="the --chat-template template")
        per[template] = r
    return r


def renderer_for_llama_model(model: Any, source: str = "the target GGUF") -> ChatRenderer:
    """The :class:`ChatRenderer` of a model loaded with llama-cpp-python's low-level API (a
    ``llama_model_p``; :meth:`ChatRenderer.from_gguf` loads one, vocabulary only): the template(s) from
    ``llama_model_chat_template``, bos/eos from ``llama_vocab_bos/eos`` rendered with
    ``llama_token_to_piece(special=True)``, ``llama_vocab_get_add_bos/eos`` -- the same calls
    llama-server's ``common_chat_templates_init`` makes."""
    import ctypes

    import llama_cpp as L

    vocab = L.llama_model_get_vocab(model)

    def piece(tok: int) -> str:
        if tok == L.LLAMA_TOKEN_NULL or tok < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)
        return buf.raw[:n].decode("utf-8", errors="replace")

    tmpl = L.llama_model_chat_template(model, None)
    tool_use = L.llama_model_chat_template(model, b"tool_use")
    tmpl = tmpl.decode("utf-8") if tmpl else None
    tool_use = tool_use.decode("utf-8") if tool_use else None
    return ChatRenderer(tmpl, piece(L.llama_vocab_bos(vocab)), piece(L.llama_vocab_eos(vocab)),
                        tool_use_template=tool_use, add_bos=bool(L.llama_vocab_get_add_bos(vocab)),
                        add_eos=bool(L.llama_vocab_get_add_eos(vocab)),
                        source=f"tokenizer.chat_template of {source}" if tmpl else f"ChatML (no template in {source})")


def chat_prompt_ids(decoder: Any, messages: Sequence[Mapping[str, Any]], *, template: Optional[str] = None,
                    **kwargs: Any) -> list:
    """Token ids of a chat for ``decoder``'s target, as llama-server feeds them: the rendered text
    (:meth:`ChatRenderer.prompt_text`) tokenized with ``add_special=True, parse_special=True``.

    ``template``: as in :func:`renderer_for`; ``kwargs``: ``tools``, ``documents``,
    ``add_generation_prompt``, template variables.
    """
    text = renderer_for(decoder, template).prompt_text(messages, **kwargs)
    return decoder.tokenize(text, add_special=True, parse_special=True)


def render_builtin(template: Optional[str], messages: Sequence[Mapping[str, Any]], *,
                   add_generation_prompt: bool = True) -> str:
    """libllama's built-in template guess (``llama_chat_apply_template``; llama-server's
    ``--no-jinja``): ``template`` is a template text libllama recognises by its markers, or a
    built-in name (``"chatml"``, ``"llama3"``, ...); None -> ``"chatml"``. Only role and string
    content are used (content parts flattened as in :func:`normalize_messages`).

    Raises:
        ChatTemplateError: libllama does not recognise the template, or a message has tool calls.
    """
    import ctypes

    import llama_cpp

    msgs = normalize_messages(messages)
    if any(m.get("tool_calls") for m in msgs):
        raise ChatTemplateError("the built-in (non-Jinja) template cannot render tool calls: use the Jinja template")
    keep = [(str(m["role"]).encode(), (m.get("content") or "").encode()) for m in msgs]
    arr = (llama_cpp.llama_chat_message * max(1, len(keep)))()
    for i, (r, c) in enumerate(keep):
        arr[i].role, arr[i].content = r, c
    t = (template or "chatml").encode()
    size = 4096 + 2 * sum(len(r) + len(c) for r, c in keep)
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(t, arr, len(keep), bool(add_generation_prompt), buf, size)
        if n < 0:
            raise ChatTemplateError("libllama's built-in chat templates do not recognise this template "
                                    "(llama_chat_apply_template returned -1): use the Jinja template")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
    raise ChatTemplateError("llama_chat_apply_template output did not fit")  # pragma: no cover
