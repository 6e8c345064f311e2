"""The ``dflash2-gguf`` console script gathers every command, each with its own --help."""

from __future__ import annotations

import pytest

from dflash2_gguf.cli import SUBCOMMANDS, main

# subcommand -> text that only that command's own help prints
EXPECTED_USAGE = {
    "generate": "--spec-draft-n-max",
    "convert": "hf-to-gguf",
    "inspect": "--target",
    "bench": "--dataset",
    "serve": "--spec-type",
    "train": "capture",
}


def test_all_commands_registered():
    assert set(SUBCOMMANDS) == set(EXPECTED_USAGE)


@pytest.mark.parametrize("command", sorted(EXPECTED_USAGE))
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:")
    assert EXPECTED_USAGE[command] in out


def test_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_model_flags_map_to_decoder_keywords():
    from dflash2_gguf.cli import build_parser, decoder_kwargs

    base = ["generate", "-m", "t.gguf", "-md", "d.gguf", "-p", "x"]
    kw = decoder_kwargs(build_parser().parse_args(base))
    assert kw == dict(n_ctx=4096, n_ctx_draft=None, n_threads=None, n_threads_draft=None, n_gpu_layers=0,
                      n_gpu_layers_draft=None, flash_attn=None, repack=True, capture="auto", verbose=False)
    kw = decoder_kwargs(build_parser().parse_args(base + ["-fa", "off", "--no-repack", "-c", "512", "-t", "3"]))
    assert (kw["flash_attn"], kw["repack"], kw["n_ctx"], kw["n_threads"]) == (False, False, 512, 3)
    assert decoder_kwargs(build_parser().parse_args(base + ["--flash-attn", "on"]))["flash_attn"] is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["-fa", "maybe"])
