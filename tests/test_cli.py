"""``python -m asyncgen``, the README's first command, on the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from asyncgen.__main__ import main

PROMPT = "Name three colours."


def test_cli_streams_transformers_greedy_reply(smollm2_path, hf_smollm2, capsys):
    model, tok = hf_smollm2
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    expected = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)

    main([PROMPT, "--model", str(smollm2_path), "--device", "cpu", "--temperature", "0", "--max-tokens", "12"])
    out, err = capsys.readouterr()
    assert out == expected
    assert "[12 tokens in" in err and "finish: length]" in err


def test_cli_runs_in_bfloat16(smollm2_path, capsys):
    main(["Hi", "--model", str(smollm2_path), "--device", "cpu", "--dtype", "bfloat16", "--max-tokens", "4", "--seed", "1"])
    out, err = capsys.readouterr()
    assert out.strip() and "[4 tokens in" in err


def test_cli_rejects_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["Hi", "--dtype", "float8"])
    assert "--dtype" in capsys.readouterr().err
