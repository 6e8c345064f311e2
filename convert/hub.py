"""Where the drafter and its target come from: local paths, Hugging Face hub ids, GGUFs on the hub.

A drafter checkpoint carries no tokenizer; the target's is copied into the drafter GGUF. The
target is given as (:func:`resolve_target`):

- nothing: it is read from the drafter's own metadata (:func:`target_from_drafter`): config.json
  fields that name the target (``dflash_config`` first, then the top level, as
  :mod:`convert.config` reads every DFlash setting), else the model card's ``base_model``
  (``README.md`` YAML front matter, read with huggingface_hub's ``metadata_load``);
- a local ``.gguf`` file or an HF folder (``config.json`` + tokenizer files);
- a hub id ``org/name``: only ``config.json`` and the tokenizer files are fetched
  (:data:`TARGET_FILES`, huggingface_hub ``snapshot_download(allow_patterns=...)``), never the
  weights;
- a GGUF on the hub as ``org/name:QUANT`` (llama.cpp's ``-hf`` form): the one ``.gguf`` whose
  name holds ``QUANT`` (case-insensitive) is fetched (:func:`fetch_hub_gguf`).

Everything goes through huggingface_hub's cache, so ``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE`` and
``HF_HOME`` work as for any hub client. A repository that is neither cached nor reachable gives a
:class:`~convert.errors.ConversionError` of one line that says what to pass instead.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import ConversionError, read_json

__all__ = ["TARGET_FILES", "TargetChoice", "is_hub_id", "parse_hub_gguf", "fetch_snapshot",
           "fetch_hub_gguf", "target_from_drafter", "resolve_target", "CONFIG_TARGET_KEYS"]

#: Logger of the one line that says which target was used (the CLI always shows it).
report = logging.getLogger("convert.target")
logger = logging.getLogger(__name__)

#: What a target's vocab handlers read (upstream ``conversion/base.py`` ``_set_vocab_*`` and
#: gguf-py's ``SpecialVocab``): the config and every tokenizer file kind; no weights.
TARGET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                "chat_template.json", "generation_config.json", "vocab.json", "merges.txt",
                "*.tiktoken", "tekken.json")

#: config.json fields that name the drafter's target, read from ``dflash_config`` first, then the
#: top level. A value is a hub id / local path string, or an object holding one under
#: :data:`_NESTED_ID_KEYS`.
CONFIG_TARGET_KEYS = ("target_model", "target_model_id", "target_model_name",
                      "target_model_name_or_path", "target_model_path", "target_name_or_path")
#: Weaker hints (the drafter's base, which for these drafters is the target): config.json fields,
#: and the model card's ``base_model``.
CONFIG_BASE_KEYS = ("base_model", "base_model_name_or_path")
_NESTED_ID_KEYS = ("name_or_path", "repo_id", "model_id", "id", "path")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_HUB_GGUF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+):(?P<quant>[\w.\-]+)$")


@dataclass(frozen=True)
class TargetChoice:
    """The target a conversion uses.

    ``path`` is a local ``.gguf`` file or HF folder; ``spec`` is what it was named as (hub id,
    ``repo:QUANT``, path); ``origin`` says where that name came from (``"--target"``,
    ``"config.json dflash_config.target_model"``, ``"model card base_model"``, ...).
    """

    path: Path
    spec: str
    origin: str

    def describe(self) -> str:
        where = "" if self.spec == str(self.path) else f" -> {self.path}"
        return f"target: {self.spec} (from {self.origin}){where}"


def is_hub_id(s: str) -> bool:
    """True for ``org/name`` strings that huggingface_hub accepts as a repo id."""
    if not _HUB_ID.match(s):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(s)
    except HFValidationError:
        return False
    return True


def parse_hub_gguf(s: str) -> tuple[str, str] | None:
    """``"org/name:QUANT"`` (llama.cpp's ``-hf`` form) -> ``(repo id, QUANT)``; else None."""
    m = _HUB_GGUF.match(s)
    if m is None or not is_hub_id(m["repo"]):
        return None
    return m["repo"], m["quant"]


def _offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover
        return False


def _why(e: Exception, repo_id: str) -> str:
    """One line on why ``repo_id`` could not be had (huggingface_hub's exception -> words)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    name = type(e).__name__
    if isinstance(e, GatedRepoError):
        return f"{repo_id} is gated on the hub: accept its terms on huggingface.co and log in (`hf auth login`)"
    if isinstance(e, RepositoryNotFoundError):
        return f"{repo_id} is not on the hub (or is private: log in with `hf auth login`)"
    if isinstance(e, LocalEntryNotFoundError) or name in ("OfflineModeIsEnabled", "IncompleteSnapshotError"):
        how = "HF_HUB_OFFLINE=1" if _offline() else "no network"
        part = "only partly" if name == "IncompleteSnapshotError" else "not"
        return (f"{repo_id} is {part} in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
                f"hub cannot be reached ({how})")
    first = str(e).splitlines()[0] if str(e) else ""
    return f"could not fetch {repo_id} from the Hugging Face hub ({name}: {first})"


def fetch_snapshot(repo_id: str, allow_patterns: list[str] | tuple[str, ...], *, fix: str) -> Path:
    """The files of ``repo_id`` matching ``allow_patterns``, fetched (or found) in the hub cache.

    Args:
        repo_id: ``org/name``.
        allow_patterns: huggingface_hub ``allow_patterns`` (fnmatch on repo paths).
        fix: What the user can do instead, appended to the error (e.g. "pass --target ...").

    Returns:
        The snapshot folder (``<cache>/models--org--name/snapshots/<commit>``).

    Raises:
        ConversionError: not cached and not reachable (offline, no network), not on the hub,
            gated; one line: the reason, then ``fix``.
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - a dependency
        raise ConversionError(f"hub ids need huggingface_hub ({e}); {fix}") from None
    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=list(allow_patterns)))
    except Exception as e:  # noqa: BLE001 - every failure means "cannot have it": say why, say the fix
        raise ConversionError(f"{_why(e, repo_id)}; {fix}") from None


# --------------------------------------------------------------------------------------------
# a GGUF on the hub: repo:QUANT


def pick_gguf(files: list[str], quant: str, repo_id: str) -> str:
    """The one ``.gguf`` of ``files`` (repo paths) that ``quant`` names (case-insensitive).

    A file whose name holds ``quant`` as a whole token (between non-word characters:
    ``-Q4_K_M.gguf`` for ``q4_k_m``) wins over one that merely contains it (``Q4_K`` in
    ``Q4_K_M``); ``mmproj`` files are skipped; of a split GGUF (``-00001-of-00003``) the first
    part is taken (it carries the metadata). Raises ConversionError naming the candidates when
    none or several fit.
    """
    q = quant.lower()
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower().rsplit("/", 1)[-1]]
    hits = [f for f in ggufs if q in f.lower().rsplit("/", 1)[-1]]
    whole = re.compile(rf"(?<![a-z0-9_]){re.escape(q)}(?![a-z0-9_])")
    best = [f for f in hits if whole.search(f.lower().rsplit("/", 1)[-1])] or hits
    split = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
    firsts = [f for f in best if not split.search(f) or split.search(f).group(1) == "00001"]
    if len(firsts) == 1:
        return firsts[0]
    names = ", ".join(sorted(ggufs)[:12]) or "none"
    if not firsts:
        raise ConversionError(f"{repo_id} has no .gguf whose name contains {quant!r} (its GGUFs: "
                              f"{names}); pass --target {repo_id}:<one of those quants>")
    raise ConversionError(f"{repo_id}:{quant} is ambiguous ({', '.join(sorted(firsts))}); pass a "
                          "longer quant name or the file itself")


def _cached_files(repo_id: str) -> tuple[Path, list[str]] | None:
    """(snapshot folder, repo paths in it) of the cached ``main`` of ``repo_id``, or None."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id=repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or an incomplete cached listing)
        return None
    return folder, [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]


def fetch_hub_gguf(repo_id: str, quant: str, *, fix: str) -> Path:
    """Fetch (or find in the cache) the one GGUF of ``repo_id`` that ``quant`` names.

    Online, the repository's file list comes from the hub (``HfApi.list_repo_files``) and only
    the chosen file is downloaded (``hf_hub_download``). Offline or without network, the cached
    snapshot of ``main`` is searched instead.

    Returns:
        Local path of the ``.gguf`` (in the hub cache).

    Raises:
        ConversionError: no match / several matches (see :func:`pick_gguf`), or neither cached nor
            reachable (one line, ending with ``fix``).
    """
    from huggingface_hub import HfApi, hf_hub_download

    try:
        files = HfApi().list_repo_files(repo_id)
    except Exception as e:  # noqa: BLE001
        cached = _cached_files(repo_id)
        if cached is None:
            raise ConversionError(f"{_why(e, repo_id)}; {fix}") from None
        folder, files = cached
        return folder / pick_gguf(files, quant, repo_id)
    name = pick_gguf(files, quant, repo_id)
    logger.info("fetching %s from %s", name, repo_id)
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=name))
    except Exception as e:  # noqa: BLE001
        raise ConversionError(f"{_why(e, repo_id)}; {fix}") from None


# --------------------------------------------------------------------------------------------
# the drafter's own word on its target


def _id_of(value: Any) -> str | None:
    """A target name from a metadata value: a non-empty string, or an object holding one."""
    if isinstance(value, Mapping):
        value = next((value[k] for k in _NESTED_ID_KEYS if isinstance(value.get(k), str)), None)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _candidates(folder: Path, config: Mapping[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(strong, weak) lists of (name, origin): config target fields; base_model hints."""
    dcfg = config.get("dflash_config") if isinstance(config.get("dflash_config"), Mapping) else {}
    strong, weak = [], []
    for keys, out in ((CONFIG_TARGET_KEYS, strong), (CONFIG_BASE_KEYS, weak)):
        for k in keys:
            for scope, where in ((dcfg, f"config.json dflash_config.{k}"), (config, f"config.json {k}")):
                if (v := _id_of(scope.get(k))) is not None:
                    out.append((v, where))
    card = folder / "README.md"
    if card.is_file():
        from huggingface_hub.repocard import metadata_load

        try:
            meta = metadata_load(card) or {}
        except Exception as e:  # noqa: BLE001 - a broken card is a hint lost, not a failure
            logger.warning("%s: unreadable YAML front matter (%s); ignoring it", card, e)
            meta = {}
        base = meta.get("base_model")
        for v in base if isinstance(base, list) else [base]:
            if (name := _id_of(v)) is not None:
                weak.append((name, "model card base_model"))
    return strong, weak


def _usable(name: str) -> bool:
    return is_hub_id(name) or parse_hub_gguf(name) is not None or Path(name).expanduser().exists()


def target_from_drafter(folder: str | Path, config: Mapping[str, Any]) -> tuple[str, str]:
    """The target a drafter names for itself: ``(hub id or path, origin)``.

    Looks at, in order: config.json fields naming the target (:data:`CONFIG_TARGET_KEYS`,
    ``dflash_config`` first, then the top level); then the weaker hints, the model card's
    ``base_model`` (string or list) and config.json ``base_model`` fields. The first group that
    holds a usable name (a hub id, or a path that exists here) decides; names that are neither
    (a path on the authors' machine) are skipped with a log line.

    Raises:
        ConversionError: no usable name; or several different ones in the deciding group
            (the message lists them with where each was found, and says to pass ``--target``).
    """
    folder = Path(folder)
    fix = ("pass --target with the target's GGUF, its HF folder (config.json + tokenizer files), "
           "its hub id or a hub GGUF as org/name:QUANT")
    seen: list[tuple[str, str]] = []
    for group in _candidates(folder, config):
        usable = []
        for name, origin in group:
            seen.append((name, origin))
            if _usable(name):
                usable.append((name, origin))
            else:
                logger.info("%s = %r is neither a hub id nor a path here; skipped", origin, name)
        distinct: dict[str, tuple[str, str]] = {}
        for name, origin in usable:
            distinct.setdefault(name.lower(), (name, origin))
        if len(distinct) == 1:
            name, origin = next(iter(distinct.values()))
            others = {n for n, _ in seen if n.lower() != name.lower()}
            if others:
                logger.warning("the drafter also names %s; using %s (%s)", sorted(others), name, origin)
            return name, origin
        if len(distinct) > 1:
            listed = "; ".join(f"{n} ({o})" for n, o in usable)
            raise ConversionError(f"the drafter names several targets: {listed}; {fix}")
    if seen:
        listed = "; ".join(f"{o} = {n!r}" for n, o in seen)
        raise ConversionError(f"the drafter's target ({listed}) is neither a hub id nor a path here; {fix}")
    raise ConversionError(
        f"the drafter does not say which target it was trained for (no {', '.join(CONFIG_TARGET_KEYS[:2])} "
        f"in config.json, no base_model in its model card README.md); {fix}")


def _fetch_target_files(repo_id: str, fix: str) -> Path:
    folder = fetch_snapshot(repo_id, TARGET_FILES, fix=fix)
    if not (folder / "config.json").is_file():
        gguf = [p.name for p in folder.glob("*.gguf")]
        hint = f" (a GGUF repository? pass --target {repo_id}:Q4_K_M)" if gguf or repo_id.lower().endswith("gguf") else ""
        raise ConversionError(f"target {repo_id} has no config.json{hint}; {fix}")
    cfg = read_json(folder / "config.json")
    from .config import ARCHITECTURES

    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if archs and archs[0] in ARCHITECTURES:
        raise ConversionError(f"{repo_id} is a DFlash drafter ({archs[0]}), not a target; {fix}")
    return folder


def resolve_target(target: str | Path | None, *, drafter_folder: str | Path,
                   drafter_config: Mapping[str, Any]) -> TargetChoice:
    """Turn ``--target`` (or its absence) into a local GGUF file or HF folder.

    Args:
        target: None (read the drafter's metadata, :func:`target_from_drafter`), a local
            ``.gguf`` / HF folder, a hub id ``org/name`` (config + tokenizer files fetched) or
            ``org/name:QUANT`` (that GGUF fetched).
        drafter_folder: The drafter checkpoint folder (its ``README.md`` is read).
        drafter_config: Its parsed ``config.json``.

    Returns:
        :class:`TargetChoice`. Where the target was found rather than given as a local path,
        its :meth:`~TargetChoice.describe` line is logged on ``convert.target`` (INFO), which
        the CLI prints on stderr.

    Raises:
        ConversionError: nothing usable named, a local path that does not exist and is no hub id,
            a hub repository that is neither cached nor reachable, a hub target without
            config.json, a drafter named as target.
    """
    fix = ("pass --target with the target's GGUF, its HF folder (config.json + tokenizer files), "
           "or go online once")
    if target is None:
        spec, origin = target_from_drafter(drafter_folder, drafter_config)
        fix = f"pass --target with {spec}'s GGUF or its HF folder (config.json + tokenizer files), or go online once"
    else:
        spec, origin = str(target), "--target"
    p = Path(spec).expanduser()
    if p.exists():
        choice = TargetChoice(p, spec, origin)
    elif (hub_gguf := parse_hub_gguf(spec)) is not None:
        repo, quant = hub_gguf
        choice = TargetChoice(fetch_hub_gguf(repo, quant, fix=fix), spec, origin)
    elif is_hub_id(spec):
        choice = TargetChoice(_fetch_target_files(spec, fix), spec, origin)
    else:
        raise ConversionError(
            f"target {spec!r} is neither a GGUF file nor a folder with config.json (and not a hub "
            "id org/name or org/name:QUANT)")
    if origin == "--target" and spec == str(choice.path):
        logger.info("%s", choice.describe())  # the user's own file or folder: nothing to report
    else:
        report.info("%s", choice.describe())
    return choice
