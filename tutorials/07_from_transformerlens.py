# %% [markdown]
# # 07: From TransformerLens
#
# The steps of TransformerLens's *Exploratory Analysis Demo* (indirect object identification),
# written the way a TL user writes them, on SmolLM2-135M. Only the imports differ: `from_pretrained`
# comes from `loaders`, the patching functions from `analysis.interventions.tl_patching`, and TL's
# default weight processing is asked for by name (here it is never on by default).
#
# Steps: load with weight processing; logit difference; logit lens over the residual stream; direct
# logit attribution per layer and per head; the top heads' attention patterns; activation patching
# of the residual stream and of heads; greedy generation.

# %%
import os
from pathlib import Path

import torch

from analysis.interventions.tl_patching import get_act_patch_attn_head_out_all_pos, get_act_patch_resid_pre
from analysis.plots import heatmap, line_plot, plot_pattern
from hooked import utils
from loaders import from_pretrained

torch.set_grad_enabled(False)
OUT = Path(os.environ.get("HOOKED_TUTORIAL_OUT", "out/tutorials"))
OUT.mkdir(parents=True, exist_ok=True)

# TL: HookedTransformer.from_pretrained(name) folds the norms and centres by default; here it is asked for.
# (center_writing_weights is skipped with a warning: SmolLM2's RMSNorm keeps the mean, as in TL.)
model = from_pretrained("smollm2-135m", fold_ln=True, center_writing_weights=False, center_unembed=True,
                        fold_value_biases=True)
print(model.cfg.n_layers, "layers,", model.cfg.n_heads, "heads;", model.cfg.normalization_type,
      model.cfg.positional_embedding_type)

# %% [markdown]
# ## The task and the logit difference
# Each prompt names two people; the model should complete with the one not repeated. The metric is
# logit(correct) - logit(incorrect) at the last position. The prompts have the same length, so
# `to_tokens` pads nothing (with a ragged batch it pads on the right, as TL does).

# %%
prompts = ["When John and Mary went to the shops, John gave the bag to",
           "When Tom and James went to the park, James gave the ball to"]
answers = [(" Mary", " John"), (" Tom", " James")]  # TL's demo has 8 prompts; 2 keep this tutorial quick
tokens = model.to_tokens(prompts)
answer_tokens = torch.tensor([[model.to_single_token(a) for a in pair] for pair in answers])
print(model.to_str_tokens(tokens[0]))

original_logits, cache = model.run_with_cache(tokens)


def logits_to_ave_logit_diff(logits, answer_tokens=answer_tokens, per_prompt=False):
    final_logits = logits[:, -1, :]
    answer_logits = final_logits.gather(dim=-1, index=answer_tokens)
    diff = answer_logits[:, 0] - answer_logits[:, 1]
    return diff if per_prompt else diff.mean()


original_average_logit_diff = logits_to_ave_logit_diff(original_logits)
print("per prompt logit difference:", logits_to_ave_logit_diff(original_logits, per_prompt=True).round(decimals=2))
print(f"average logit difference: {original_average_logit_diff:.3f}")

# %% [markdown]
# ## Logit lens: where does the difference appear?
# The logit-difference direction in the residual stream is W_U[:, correct] - W_U[:, incorrect].
# `accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)` gives the residual at every layer's
# input and middle (and the final one); `apply_ln_to_stack` applies the final norm's scale.

# %%
answer_residual_directions = model.tokens_to_residual_directions(answer_tokens)  # [batch 2 d_model]
logit_diff_directions = answer_residual_directions[:, 0] - answer_residual_directions[:, 1]


def residual_stack_to_logit_diff(residual_stack, cache):
    scaled_residual_stack = cache.apply_ln_to_stack(residual_stack, layer=-1, pos_slice=-1)
    return torch.einsum("...bd,bd->...", scaled_residual_stack, logit_diff_directions) / len(prompts)


accumulated_residual, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
logit_lens_logit_diffs = residual_stack_to_logit_diff(accumulated_residual, cache)
line_plot(range(len(labels)), {"logit diff": logit_lens_logit_diffs}, OUT / "07_logit_lens.png",
          "logit difference from the accumulated residual stream", "component (0_pre, 0_mid, ...)", "logit diff")
print("the last component is the model's own logit difference:",
      f"{logit_lens_logit_diffs[-1]:.3f} vs {original_average_logit_diff:.3f}")
assert torch.allclose(logit_lens_logit_diffs[-1], original_average_logit_diff, rtol=1e-3, atol=1e-3)

# %% [markdown]
# ## Direct logit attribution per layer and per head
# `decompose_resid` splits the final residual into the embedding and each block's attention and
# MLP outputs; `stack_head_results` splits the attention outputs into heads (computed from
# `hook_z`, which a bare cache holds: `hook_result` is a lazy hook and is not cached by default).

# %%
per_layer_residual, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
per_layer_logit_diffs = residual_stack_to_logit_diff(per_layer_residual, cache)
attn_dla = per_layer_logit_diffs[1::2]
print("largest attention-layer contributions:",
      [(labels[1 + 2 * int(i)], round(float(attn_dla[i]), 2)) for i in attn_dla.abs().argsort(descending=True)[:3]])

per_head_residual, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
per_head_logit_diffs = residual_stack_to_logit_diff(per_head_residual, cache)
per_head_logit_diffs = per_head_logit_diffs.reshape(model.cfg.n_layers, model.cfg.n_heads)
heatmap(per_head_logit_diffs, OUT / "07_dla_heads.png", "direct logit attribution per head", "head", "layer",
        centered=True)
top = per_head_logit_diffs.flatten().argsort(descending=True)[:3].tolist()
top_heads = [divmod(i, model.cfg.n_heads) for i in top]
print("heads writing the most logit difference:", [f"L{l}H{h}" for l, h in top_heads])

# %% [markdown]
# ## Their attention patterns
# `cache["pattern", layer]` is [batch head query key]; row = destination, column = source.

# %%
str_tokens = model.to_str_tokens(tokens[0])
for layer, head in top_heads:
    pattern = cache["pattern", layer][0, head]
    plot_pattern(pattern, OUT / f"07_pattern_L{layer}H{head}.png", str_tokens, f"L{layer}H{head}")
    print(f"L{layer}H{head}: the last token attends most to {str_tokens[int(pattern[-1].argmax())]!r}")

# %% [markdown]
# ## Activation patching
# Corrupted prompts repeat the other name, which flips the answer. Patching clean activations into
# the corrupted run (denoising) and normalising (clean -> 1, corrupted -> 0) shows what carries the
# information. `get_act_patch_resid_pre` and `get_act_patch_attn_head_out_all_pos` are TL's
# functions, here thin calls of `analysis.interventions.act_patch`.

# %%
corrupted_prompts = [p.replace(f", {a[1].strip()} gave", f", {a[0].strip()} gave") for p, a in zip(prompts, answers)]
corrupted_tokens = model.to_tokens(corrupted_prompts)
assert corrupted_tokens.shape == tokens.shape
corrupted_average_logit_diff = logits_to_ave_logit_diff(model(corrupted_tokens))
print(f"corrupted average logit difference: {corrupted_average_logit_diff:.3f}")


def ioi_metric(logits):
    return (logits_to_ave_logit_diff(logits) - corrupted_average_logit_diff) / (
        original_average_logit_diff - corrupted_average_logit_diff)


resid_pre_act_patch_results = get_act_patch_resid_pre(model, corrupted_tokens, cache, ioi_metric)
heatmap(resid_pre_act_patch_results, OUT / "07_patch_resid_pre.png", "resid_pre activation patching", "position",
        "layer", centered=True, xticklabels=str_tokens)
name_pos = 9  # the repeated name
print("early layers: the information sits at the repeated name:",
      resid_pre_act_patch_results[:3, name_pos].round(decimals=2).tolist())
print("last layers: it has moved to the last token:", resid_pre_act_patch_results[-3:, -1].round(decimals=2).tolist())

attn_head_out_all_pos_act_patch_results = get_act_patch_attn_head_out_all_pos(model, corrupted_tokens, cache,
                                                                              ioi_metric)
heatmap(attn_head_out_all_pos_act_patch_results, OUT / "07_patch_heads.png", "head output patching (all positions)",
        "head", "layer", centered=True)
best = divmod(int(attn_head_out_all_pos_act_patch_results.argmax()), model.cfg.n_heads)
print("the head that restores most on its own: L%dH%d" % best)

# %% [markdown]
# ## Hooks by TL's names, and generation
# `utils.get_act_name` builds hook names as TL does; `generate` continues text with an incremental
# key/value cache (greedy here).

# %%
print(utils.get_act_name("pattern", 3), utils.get_act_name("resid_pre", 0), utils.get_act_name("scale", 2, "ln1"))
print(model.generate("The capital of France is", max_new_tokens=8, do_sample=False))
