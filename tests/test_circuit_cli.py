"""`hooked circuit`: scores of every edge, the top ones drawn and verified, on an organism; refusals."""

from __future__ import annotations

import json

from analysis.cli import main


def test_circuit_command_on_an_organism(tmp_path, capsys):
    out = tmp_path / "circuit"
    assert main(["circuit", "organism/llama-kv", "--n", "8", "--steps", "4", "--top", "6", "--out", str(out)]) == 0
    summary = json.loads((out / "circuit.json").read_text())
    scores = json.loads((out / "scores.json").read_text())
    assert (out / "circuit.png").stat().st_size > 0
    assert summary["n_edges"] == scores["n_edges"] == len(scores["edges"]) == 110
    top = [f"{e['sender']}->{e['receiver']}" for e in summary["top"]]
    assert len(top) == 6 and {"embed->L0H3.v", "L0H3->L1H0.k", "L1H0->logits"} <= set(top)
    assert [e["score"] for e in scores["edges"][:6]] == [e["score"] for e in summary["top"]]
    best = max(r["faithfulness"] for r in summary["faithfulness"])
    assert best > 0.8 and "faithfulness" in capsys.readouterr().out


def test_circuit_command_refuses_the_kv_task_on_a_text_model(tmp_path, capsys):
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2))
    hf.save_pretrained(tmp_path / "llama")
    assert main(["circuit", str(tmp_path / "llama"), "--task", "kv", "--out", str(tmp_path / "o")]) == 2
    assert "organisms' token task" in capsys.readouterr().err
    assert main(["circuit", "organism/llama-kv", "--steps", "0"]) == 2
