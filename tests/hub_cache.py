"""A Hugging Face hub cache on disk, laid out as huggingface_hub lays it out, and tiny HF targets.

``add_repo`` writes one model repository into a cache folder the way ``snapshot_download`` leaves
it (huggingface_hub's "cache-system" layout)::

    <cache>/models--<org>--<name>/
        blobs/<sha256 of the content>             the file's bytes
        refs/main                                  the commit hash (no newline)
        snapshots/<commit>/<path>  -> ../../blobs/<sha256>   (relative symlink)

so that ``HF_HUB_CACHE=<cache> HF_HUB_OFFLINE=1`` makes ``snapshot_download(repo_id)`` return the
snapshot folder without a network. ``train_sentencepiece`` trains a tiny SentencePiece model
in-process (vocab ~325: byte fallback, a control and a user-defined symbol), and
``sentencepiece_target`` / ``bpe_target_files`` make the files of tiny HF targets with those
tokenizers (``config.json`` + tokenizer files, no weights).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path
from typing import Mapping

__all__ = ["add_repo", "train_sentencepiece", "sentencepiece_target", "bpe_target_files", "llama_hf_target",
           "CHAT_TEMPLATE"]

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_repo(cache: str | Path, repo_id: str, files: Mapping[str, bytes | str], *,
             commit: str | None = None) -> Path:
    """Write repository ``repo_id`` with ``files`` ({repo path: content}) into hub cache ``cache``.

    Returns the snapshot folder. ``commit`` defaults to a hash of the contents (40 hex digits).
    """
    org, name = repo_id.split("/")
    root = Path(cache) / f"models--{org}--{name}"
    blobs = {}
    for path, data in files.items():
        raw = data.encode() if isinstance(data, str) else bytes(data)
        blobs[path] = (hashlib.sha256(raw).hexdigest(), raw)
    commit = commit or hashlib.sha1("".join(f"{p}:{h}" for p, (h, _) in sorted(blobs.items())).encode()).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    snap = root / "snapshots" / commit
    for path, (digest, raw) in blobs.items():
        (root / "blobs" / digest).write_bytes(raw)
        link = snap / path
        link.parent.mkdir(parents=True, exist_ok=True)
        rel = Path(*[".."] * (len(Path(path).parts) + 1)) / "blobs" / digest
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(rel)
    (root / "refs" / "main").write_text(commit)
    return snap


_WORDS = ("the a drafter target token block diffusion speculative decoding llama model draft verify "
          "accept reject sample greedy cache layer hidden vocab piece byte fallback sentence unigram "
          "merge rank score type control user special").split()


def train_sentencepiece(vocab_size: int = 400, seed: int = 0) -> bytes:
    """A tiny unigram SentencePiece model (bytes of ``tokenizer.model``), trained in-process.

    ids 0-4: ``<unk> <s> </s>``, control ``<mask>``, user-defined ``<tool>``; then the 256
    ``<0xXX>`` byte pieces (byte fallback), then the learnt pieces (325 in all with the default
    text: ``vocab_size`` is a soft limit).
    """
    import sentencepiece as spm

    rng = random.Random(seed)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) + rng.choice([".", "!", "?", ",", " 42", " 7."])
             for _ in range(400)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="unigram",
        byte_fallback=True, control_symbols=["<mask>"], user_defined_symbols=["<tool>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return buf.getvalue()


def sentencepiece_target(*, arch: str = "LlamaForCausalLM", hidden: int = 288, n_layer: int = 4,
                         extra: int = 3, seed: int = 0) -> tuple[dict[str, bytes | str], int]:
    """Files of a tiny HF target with a SentencePiece ``tokenizer.model``, and its vocab size.

    ``config.json`` (``architectures = [arch]``, sizes, ``vocab_size`` = pieces + ``extra``),
    ``tokenizer.model`` (:func:`train_sentencepiece`), ``tokenizer_config.json`` with
    ``add_bos_token``, the special tokens, a chat template and ``added_tokens_decoder`` entries
    beyond the model's pieces (a special ``<|im_start|>``, ``<|im_end|>`` and a plain ``▁hello``)
    so that padding, CONTROL and USER_DEFINED ids all occur.
    """
    import sentencepiece as spm

    model = train_sentencepiece(seed=seed)
    n_pieces = spm.SentencePieceProcessor(model_proto=model).vocab_size()
    n_vocab = n_pieces + extra
    added = {str(n_pieces): {"content": "<|im_start|>", "special": True, "normalized": False,
                             "lstrip": False, "rstrip": False, "single_word": False},
             str(n_pieces + 1): {"content": "<|im_end|>", "special": True, "normalized": False,
                                 "lstrip": False, "rstrip": False, "single_word": False},
             str(n_pieces + 2): {"content": "\u2581hello", "special": False, "normalized": False,
                                 "lstrip": False, "rstrip": False, "single_word": False}}
    if extra < 3:
        added = dict(list(added.items())[:extra])
    tcfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE, "added_tokens_decoder": added,
            "tokenizer_class": "LlamaTokenizer", "legacy": False}
    config = {"architectures": [arch], "model_type": "llama", "hidden_size": hidden,
              "num_hidden_layers": n_layer, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 2 * hidden, "vocab_size": n_vocab, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}
    files: dict[str, bytes | str] = {"config.json": json.dumps(config, indent=2) + "\n",
                                     "tokenizer.model": model,
                                     "tokenizer_config.json": json.dumps(tcfg, indent=2) + "\n"}
    return files, n_vocab


def bpe_target_files(*, hidden: int = 288, n_layer: int = 4, arch: str = "Qwen3ForCausalLM") -> tuple[dict[str, str], int]:
    """Files of a tiny HF target with a byte-level BPE ``tokenizer.json`` (Qwen2 pre-tokenizer), and
    its vocab size: the 256 byte-level symbols, a few merges, ``<|im_start|>``/``<|im_end|>``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(sorted(alphabet))}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("e", "r")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_start|>", normalized=False, special=True),
                            AddedToken("<|im_end|>", normalized=False, special=True)])
    n_vocab = tok.get_vocab_size() + 2
    tcfg = {"add_bos_token": False, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
            "chat_template": CHAT_TEMPLATE, "tokenizer_class": "Qwen2Tokenizer"}
    config = {"architectures": [arch], "model_type": "qwen3", "hidden_size": hidden,
              "num_hidden_layers": n_layer, "vocab_size": n_vocab, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 2 * hidden, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    return {"config.json": json.dumps(config, indent=2) + "\n", "tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps(tcfg, indent=2) + "\n"}, n_vocab


def llama_hf_target(*, arch: str = "LlamaForCausalLM", hidden: int = 288, n_layer: int = 4) -> tuple[dict[str, str], int]:
    """Files of a tiny HF target whose tokenizer is a SentencePiece-converted ``tokenizer.json``
    (BPE with byte fallback, ``▁`` spaces: the Llama 2 / Mistral / Gemma 4 kind that gguf-py's
    ``LlamaHfVocab`` reads), no ``tokenizer.model``; and its vocab size (one padding id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update((f"<0x{b:02X}>", 3 + b) for b in range(256))
    for piece in ["\u2581", "t", "h", "e", "a", "r", "\u2581t", "th", "\u2581th", "\u2581the", "er"]:
        vocab[piece] = len(vocab)
    merges = [("t", "h"), ("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("e", "r")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>", "<|im_end|>")])
    n_vocab = tok.get_vocab_size() + 1
    tcfg = {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "bos_token": "<s>",
            "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    config = {"architectures": [arch], "hidden_size": hidden, "num_hidden_layers": n_layer, "vocab_size": n_vocab}
    return {"config.json": json.dumps(config, indent=2) + "\n", "tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps(tcfg, indent=2) + "\n"}, n_vocab
