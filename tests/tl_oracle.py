"""TransformerLens 3.9 on the same weights as ours: the oracle of the TL-surface tests.

`pair(name, unit_norms=False)` -> (ours, tl, tokenizer): a tiny random HF model (GPT-2 with biases,
Llama with GQA), loaded by our `from_hf` and by TL's own weight conversion into a
`HookedTransformer` built from the matching `HookedTransformerConfig` (no hub access needed), both
unprocessed. `unit_norms=True` sets every norm weight to 1 (and LayerNorm biases to 0) first, the
weights on which TL's `apply_ln_to_stack` (which never applies a norm weight) and ours agree without
weight processing. The tokenizer is a word-level toy ("w0" ... "w40", with BOS / EOS / pad).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from loaders.load import from_hf

tl = pytest.importorskip("transformer_lens")

VOCAB = 48
WORDS = [f"w{i}" for i in range(VOCAB - 4)]


def toy_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>"] + WORDS)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    d = tempfile.mkdtemp(prefix="toy_tokenizer_")  # kept: TL reloads tokenizers by name_or_path
    fast.save_pretrained(d)
    return AutoTokenizer.from_pretrained(d)


def _hf(name: str):
    import transformers

    from tests.conftest import build_tiny_hf

    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB,
                                         activation_function="gelu_new")
    elif name == "llama_gqa":
        config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=48, vocab_size=VOCAB,
                                          max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    else:
        raise KeyError(name)
    return build_tiny_hf(config, perturb=0.1, seed=1)


def _tl_config(name: str, hf):
    c = hf.config
    if name == "gpt2":
        return dict(d_model=c.n_embd, d_head=c.n_embd // c.n_head, n_heads=c.n_head, d_mlp=4 * c.n_embd,
                    n_layers=c.n_layer, n_ctx=c.n_positions, eps=c.layer_norm_epsilon, d_vocab=c.vocab_size,
                    act_fn=c.activation_function, normalization_type="LN", original_architecture="GPT2LMHeadModel")
    return dict(d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
                d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings,
                eps=c.rms_norm_eps, d_vocab=c.vocab_size, act_fn=c.hidden_act,
                n_key_value_heads=c.num_key_value_heads, normalization_type="RMS", positional_embedding_type="rotary",
                rotary_adjacent_pairs=False, rotary_dim=c.hidden_size // c.num_attention_heads,
                rotary_base=float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)), final_rms=True, gated_mlp=True, original_architecture="LlamaForCausalLM")


def tl_model(name: str, hf, tokenizer, **processing):
    """TL's HookedTransformer on `hf`'s weights; `processing`: fold_ln, center_writing_weights, ..."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights, convert_llama_weights

    cfg = HookedTransformerConfig(**_tl_config(name, hf), dtype=torch.float32, device="cpu", default_prepend_bos=False)
    model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    convert = convert_gpt2_weights if name == "gpt2" else convert_llama_weights
    flags = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
    model.load_and_process_state_dict(convert(hf, cfg), **(flags | processing))
    return model.eval()


def pair(name: str, unit_norms: bool = False):
    hf = _hf(name)
    if unit_norms:
        with torch.no_grad():
            for module in hf.modules():
                if "Norm" in type(module).__name__:
                    module.weight.fill_(1.0)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
    tokenizer = toy_tokenizer()
    ours = from_hf(hf)
    ours.tokenizer = tokenizer
    return ours, tl_model(name, hf, tokenizer), tokenizer, hf
