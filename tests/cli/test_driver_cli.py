"""``dflash2-gguf generate`` / ``convert`` through ``dflash2_gguf.cli.main(argv)``."""

from __future__ import annotations

import json

import pytest


pytestmark = pytest.mark.native


def test_generate_json_with_and_without_drafter(native_ext, smollm2_gguf, smollm2_drafters, capsys):
    from dflash2_gguf.cli import main

    outs = {}
    for md in (str(smollm2_drafters[2]), "none"):
        rc = main(["generate", "-m", str(smollm2_gguf), "-md", md, "-p", "The capital of France is", "-n", "12",
                   "--temp", "0", "--ignore-eos", "--json", "-t", "2", "-c", "256"])
        assert rc == 0
        obj = json.loads(capsys.readouterr().out)
        for k in ("text", "tokens", "n_drafted", "n_accepted", "acceptance_length", "tokens_per_second"):
            assert k in obj
        assert len(obj["tokens"]) == 12
        outs[md] = obj
    assert outs["none"]["n_drafted"] == 0 and outs[str(smollm2_drafters[2])]["n_drafted"] > 0
    assert "Paris" in outs["none"]["text"]


def test_generate_streams_text_and_reports_errors(native_ext, smollm2_gguf, smollm2_drafters, tiny_llama,
                                                 tiny_drafters, capsys):
    from dflash2_gguf.cli import main

    rc = main(["generate", "-m", str(smollm2_gguf), "-md", str(smollm2_drafters[1]), "-p", "Hi", "-n", "5",
               "--seed", "3", "--spec-draft-n-max", "2", "--chat", "-t", "2", "-c", "256"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "acceptance length" in cap.err
    rc = main(["generate", "-m", str(tiny_llama), "-md", str(tiny_drafters[1]), "-p", "text the tiny vocab lacks",
               "-n", "5", "-t", "1"])
    assert rc == 2 and "cannot encode" in capsys.readouterr().err
    rc = main(["generate", "-m", str(tiny_llama), "-md", str(tiny_llama), "-p", "_a", "-n", "5", "-t", "1"])
    assert rc == 2 and "expected 'dflash'" in capsys.readouterr().err


def test_convert_subcommand_delegates(tiny_dir, tiny_llama):
    from checkpoints import make_dflash_checkpoint
    from dflash2_gguf.cli import main

    ck = make_dflash_checkpoint(tiny_dir / "cli_ck", version=1, hidden_size=288, intermediate_size=576,
                                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=72, vocab_size=48,
                                target_layer_ids=(0, 2), num_target_layers=4, block_size=4, mask_token_id=3)
    out = tiny_dir / "cli_conv.gguf"
    rc = main(["convert", "hf-to-gguf", str(ck), "--target", str(tiny_llama), "--outfile", str(out),
               "--outtype", "f16", "--force"])
    assert rc == 0 and out.is_file()
