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
