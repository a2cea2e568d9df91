# %% [markdown]
# # 05: Activation patching on SmolLM2
#
# Two prompts that differ in one token: "The capital of France is" (clean, answer " Paris") and
# "The capital of Italy is" (corrupted, answer " Rome"). Patching copies one activation from one run
# into the other and measures how much of the answer moves with it:
#
# - **denoising**: run the corrupted prompt, patch in clean activations (what restores "Paris"?);
# - **noising**: run the clean prompt, patch in corrupted activations (what breaks it?).
#
# The metric is the logit difference `logit(Paris) - logit(Rome)` at the last position, normalised
# so that the clean run scores 1 and the corrupted run 0. `analysis.interventions.patching` has one generic loop
# (`act_patch`) and helpers for the residual stream, block outputs, heads and SSM states.

# %%
import os
from pathlib import Path

import torch

from analysis.interventions import (act_patch, attribution_patch, compare_attribution, logit_diff, normalised_score,
                                     patch, run_patching)
from analysis.plots import heatmap, line_plot
from loaders import from_pretrained

torch.set_grad_enabled(False)
OUT = Path(os.environ.get("HOOKED_TUTORIAL_OUT", "out/tutorials"))
OUT.mkdir(parents=True, exist_ok=True)

model = from_pretrained("smollm2-135m")
clean = model.to_tokens("The capital of France is")
corrupted = model.to_tokens("The capital of Italy is")
assert clean.shape == corrupted.shape, "the two prompts must have the same length"
paris = model.to_tokens(" Paris", prepend_bos=False)[0, 0].item()
rome = model.to_tokens(" Rome", prepend_bos=False)[0, 0].item()
metric = logit_diff(paris, rome)
m_clean, m_corrupted = float(metric(model(clean))), float(metric(model(corrupted)))
print(f"logit(Paris) - logit(Rome): clean {m_clean:.2f}, corrupted {m_corrupted:.2f}")
str_tokens = model.to_str_tokens(clean)

# %% [markdown]
# ## Denoising the residual stream, by layer and position
# `run_patching` caches the clean run and sweeps `blocks.{layer}.hook_resid_pre` over every layer
# and position. Each patched run starts at its layer from the corrupted residual stream computed
# once (`stop_at_layer` / `start_at_layer`): nothing before the patch is recomputed.

# %%
resid = run_patching(model, clean, corrupted, metric, "blocks.{layer}.hook_resid_pre", over=("layer", "pos"))
heatmap(resid, OUT / "05_resid_denoising.png", "resid_pre denoising (1 = clean)", "position", "layer",
        centered=True, xticklabels=str_tokens)
country = 3  # " France" / " Italy"
print("early layers carry the answer at the country token:", resid[:4, country].round(decimals=2).tolist())
print("late layers carry it at the last token:", resid[-4:, -1].round(decimals=2).tolist())

# %% [markdown]
# The information moves from the country's position to the last position somewhere in the middle:
# the layer where the two columns cross.

# %% [markdown]
# ## Noising the attention outputs, by layer
# Same loop, other direction: run the clean prompt and patch in each layer's corrupted attention
# output at every position. A score near 0 means that layer's attention alone breaks the answer.

# %%
attn = run_patching(model, clean, corrupted, metric, "blocks.{layer}.hook_attn_out", over=("layer",),
                    direction="noising")
mlp = run_patching(model, clean, corrupted, metric, "blocks.{layer}.hook_mlp_out", over=("layer",),
                   direction="noising")
line_plot(range(model.cfg.n_layers), {"attn_out": attn, "mlp_out": mlp}, OUT / "05_noising.png",
          "noising one block output (1 = unchanged)", "layer", "normalised logit difference", hline=1.0)
print("most damaging attention layer:", int(attn.argmin()), "score", round(float(attn.min()), 2))

# %% [markdown]
# ## Heads: attribution patching vs exact patching
# Attribution patching estimates every head at once from one forward and one backward pass:
# `metric(base) + (clean - corrupted) . d metric / d z`. Exact patching needs one forward per head;
# we run it on a band of layers around the crossing and compare.

# %%
_, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("attn.hook_z"))
approx = normalised_score(attribution_patch(model, corrupted, cache, metric, "blocks.{layer}.attn.hook_z",
                                            over=("layer", "head")), m_clean, m_corrupted)
crossing = int((resid[:, -1] > resid[:, country]).float().argmax())
band = list(range(max(0, crossing - 3), min(model.cfg.n_layers, crossing + 3)))
exact = normalised_score(act_patch(model, corrupted, cache, metric, "blocks.{layer}.attn.hook_z",
                                   over=("layer", "head"), layers=band), m_clean, m_corrupted)
stats = compare_attribution(exact[band], approx[band])
print(f"layers {band}: Pearson r = {stats['pearson']:.2f}, top-5 overlap {stats['top5_overlap']:.0%}")
heatmap(approx, OUT / "05_heads_attribution.png", "attribution patching of hook_z (denoising)", "head", "layer",
        centered=True)
best = divmod(int(exact.nan_to_num(-1e9).argmax()), model.cfg.n_heads)
print("the head that restores most on its own: L%dH%d" % best, f"score {exact[best].item():.2f}")

# %% [markdown]
# ## One patch by hand
# `patch` returns the logits of one patched run. An `index` picks a slice: here that head at the
# last position only.

# %%
layer, head = best
logits = patch(model, corrupted, cache, f"blocks.{layer}.attn.hook_z", {"pos": -1, "head": head})
print(f"L{layer}H{head} at the last position: logit diff {float(metric(logits)):.2f} "
      f"(corrupted {m_corrupted:.2f}, clean {m_clean:.2f})")
