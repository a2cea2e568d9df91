# %% [markdown]
# # 08: Sparse autoencoders: SAELens trains on hooked models, SAEs splice into any hook
#
# SAELens (the usual tool for training and analysing SAEs) drives a model through TransformerLens's
# interface; a hooked model is that interface, SSMs included. We
# 1. train a small SAE with SAELens's own runner on SmolLM2's `blocks.3.hook_resid_post`;
# 2. load it back with SAELens's loader and splice it in with `model.add_sae` (exact with the error term);
# 3. find a feature that fires on one token, ablate it and patch it like any other hook;
# 4. train an SAE on one head of a Mamba-2 organism's *state* (`hook_h`), and see a splice at
#    position t change every later position through the recurrence, and none before.
#
# Tiny widths and a few hundred steps: this runs in under a minute on a CPU. Requires `sae-lens`
# (`pip install "hooked[sae]"`).

# %%
import os
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from sae_lens import SAE, LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, LoggingConfig
from sae_lens import StandardTrainingSAEConfig

from analysis.interventions import patch
from analysis.tasks import token_kv
from loaders import from_pretrained

OUT = Path(os.environ.get("HOOKED_TUTORIAL_OUT", "out/tutorials"))
torch.manual_seed(0)


def train(model, hook, d_in, dataset, head=None, steps=300, **extra):
    """SAELens's runner with `override_model=` a hooked model; returns the SAE as SAELens's loader reads it."""
    out = tempfile.mkdtemp(dir=OUT if OUT.exists() else None)
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=2 * d_in, l1_coefficient=1.0),
        hook_name=hook, hook_head_index=head, dataset_path="", streaming=False, context_size=24,
        training_tokens=steps * 32, train_batch_size_tokens=32, store_batch_size_prompts=4, n_batches_in_buffer=4,
        device="cpu", logger=LoggingConfig(log_to_wandb=False), output_path=out, checkpoint_path=None,
        n_checkpoints=0, verbose=False, eval_batch_size_prompts=2, n_eval_batches=1, model_from_pretrained_kwargs={},
        **extra)
    LanguageModelSAETrainingRunner(cfg, override_model=model, override_dataset=dataset).run()
    return SAE.load_from_disk(out)


# %% [markdown]
# ## 1. An SAE on SmolLM2's residual stream

# %%
model = from_pretrained("smollm2-135m")
texts = ["The capital of France is Paris, and the capital of Italy is Rome.",
         "When John and Mary went to the shops, John gave the bag to Mary.",
         "The cat sat on the mat while the dog slept by the door."] * 30
sae = train(model, "blocks.3.hook_resid_post", model.cfg.d_model, Dataset.from_dict({"text": texts}),
            is_dataset_tokenized=False, prepend_bos=True)
print(sae.cfg.metadata.hook_name, sae.W_enc.shape)

# %% [markdown]
# ## 2. Splice it in. With `use_error_term=True` the model is exact (the logits are bit-identical):
# the SAE's features are hook points `blocks.3.hook_resid_post.sae.hook_sae_acts_post` and friends.

# %%
tokens = model.to_tokens(["When John and Mary went to the shops, John gave the bag to",
                          "When Tom and Anna went to the park, Tom gave the ball to"])
with torch.no_grad():
    plain = model(tokens)
    model.add_sae(sae, use_error_term=True)
    logits, cache = model.run_with_cache(tokens, names_filter=lambda n: ".sae." in n)
assert torch.equal(logits, plain)
acts = cache["blocks.3.hook_resid_post.sae.hook_sae_acts_post"]  # [batch pos d_sae]
print({k: tuple(v.shape) for k, v in cache.items()})

# %% [markdown]
# ## 3. A feature, ablated and patched
# The feature most specific to the token " John" (active there, quiet elsewhere):

# %%
john = tokens[0] == model.to_single_token(" John")
specificity = acts[0, john].mean(0) - acts[0, ~john].mean(0)
feature = int(specificity.argmax())
print("feature", feature, "mean at ' John'", acts[0, john, feature].mean().item(),
      "elsewhere", acts[0, ~john, feature].mean().item())


def ablate(a, hook):
    a[..., feature] = 0  # in place, as SAELens users write it


with torch.no_grad():
    ablated = model.run_with_hooks(tokens, fwd_hooks=[("blocks.3.hook_resid_post.sae.hook_sae_acts_post", ablate)])
mary = model.to_single_token(" Mary")
print("logit of ' Mary' at the end: plain", plain[0, -1, mary].item(), "feature ablated", ablated[0, -1, mary].item())

# Patching the features of prompt 2 from prompt 1's cache (any hook works with `patch`):
with torch.no_grad():
    patched = patch(model, tokens[1:], cache.apply_slice_to_batch_dim(slice(0, 1)),
                    "blocks.3.hook_resid_post.sae.hook_sae_acts_post")
print("prompt 2, top token after patching prompt 1's features:", model.to_string(patched[0, -1].argmax()))
model.reset_saes()

# %% [markdown]
# ## 4. An SAE on an SSM state
# Mamba-2's state `hook_h` is [batch pos n_heads d_head d_state]; SAELens reads
# `hook_h.hook_heads` ([batch pos n_heads d_head*d_state]) and `hook_head_index` picks one head.

# %%
mamba = from_pretrained("organism/mamba2-kv")
ids = token_kv.prompts(8, 64, seed=3, fmt="k?").tokens[:, :24]
state_sae = train(mamba, "blocks.0.mixer.hook_h.hook_heads", 16 * 32, Dataset.from_dict({"input_ids": ids.tolist()}),
                  head=3)
x = token_kv.prompts(8, 4, seed=9, fmt="k?").tokens
t = 10
with torch.no_grad():
    clean = mamba(x)
    mamba.add_sae(state_sae, positions=[t])  # only head 3's state at position t is replaced
    spliced = mamba(x)
mamba.reset_saes()
change = (spliced - clean).abs().amax(-1)[0]
print("largest logit change per position:", [round(v, 4) for v in change.tolist()])
assert torch.equal(spliced[:, :t], clean[:, :t]) and (change[t:] > 0).all()
# The reconstruction at t is the state the recurrence continues from: every later position moves.
