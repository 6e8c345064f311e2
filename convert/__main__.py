"""``python -m convert {hf-to-gguf,inspect} ...``: thin CLI over :mod:`convert`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .errors import ConversionError

OUTTYPE_CHOICES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"]


class _Stderr(logging.Handler):
    """Plain message lines to whatever ``sys.stderr`` is at the time (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(record.getMessage(), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m convert",
                                 description="DFlash / DFlash 2 drafter -> llama.cpp dflash GGUF")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log every tensor")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("hf-to-gguf", parents=[common],
                       help="convert an HF drafter checkpoint (folder or hub id)")
    c.add_argument("src", help="checkpoint folder or Hugging Face hub id (org/name)")
    c.add_argument("--target", default=None,
                   help="the target whose tokenizer the drafter gets: its GGUF, its HF folder (config.json + "
                        "tokenizer files), a hub id org/name (only config and tokenizer fetched) or a hub "
                        "GGUF org/name:QUANT (that file fetched). Default: the target the drafter names "
                        "(config.json target_model..., model card base_model)")
    c.add_argument("--outfile", default=None, help="output .gguf (default: <name>-<OUTTYPE>.gguf, e.g. Qwen3.8-27B-DFlash2-Q4_K_M.gguf, in the checkpoint folder, or in the current folder for a hub id)")
    c.add_argument("--outtype", default="f16", choices=OUTTYPE_CHOICES)
    c.add_argument("--force", action="store_true", help="overwrite an existing output")
    i = sub.add_parser("inspect", parents=[common], help="summarise a drafter GGUF")
    i.add_argument("file", help="the .gguf to inspect")
    i.add_argument("--target", default=None, help="check the pairing against this target")
    return ap


def main(argv=None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 bad input or a failed pairing check)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # the one line that says which target was used, always shown (stderr; stdout is the output path)
    said = logging.getLogger("convert.target")
    if not any(isinstance(h, _Stderr) for h in said.handlers):
        said.addHandler(_Stderr())
        said.setLevel(logging.INFO)
        said.propagate = False
    try:
        if args.command == "hf-to-gguf":
            from . import convert_hf_to_gguf

            out = convert_hf_to_gguf(args.src, args.target, outfile=args.outfile,
                                     outtype=args.outtype, force=args.force)
            print(out)
            return 0
        from . import inspect_gguf

        info = inspect_gguf(args.file, target=args.target)
        info.pop("tensor_types")
        print(json.dumps(info, indent=2, default=str))
        return 0 if info.get("fits", True) else 2
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
