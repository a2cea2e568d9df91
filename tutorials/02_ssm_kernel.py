# %% [markdown]
# # 02: The SSM kernel, checked by hand
#
# An SSM layer is a causal, input-dependent linear map from its input `u` to its output `y`:
# `y[b, :, j] = sum_i kernel[b, :, j, i] * u[b, i]` (before the D skip). `hooked` exposes that map
# as `blocks.{l}.mixer.hook_kernel`, row = target position `j`, column = source position `i`.
# This tutorial validates the index convention on a model instead of trusting it:
#
# 1. build the kernel and reconstruct `y` from it;
# 2. cut one edge (target j, source i) by editing the kernel, and compare with a brute-force
#    recurrence that never feeds source `i` into the state read at `j`;
# 3. do the same on a Mamba-2 head;
# 4. plot one channel's kernel as a heatmap (the "hidden attention" of the G&A paper, min-max normalised).

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import transformers

from loaders import from_hf

torch.manual_seed(0)
OUT = Path(os.environ.get("HOOKED_TUTORIAL_OUT", "out/tutorials"))
OUT.mkdir(parents=True, exist_ok=True)

hf = transformers.MambaForCausalLM(transformers.MambaConfig(
    vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)).eval()
model = from_hf(hf.double())  # float64: the identities below hold to 1e-10
tokens = torch.randint(0, 64, (1, 12))
layer = 1
mixer = f"blocks.{layer}.mixer"
_, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith(mixer))
K, u, y = cache[f"{mixer}.hook_kernel"], cache[f"{mixer}.hook_ssm_in"], cache[f"{mixer}.hook_y"]
print("kernel", tuple(K.shape), "= [batch, d_inner, target j, source i]")

# %% [markdown]
# ## 1. Reconstruct y from the kernel

# %%
y_from_kernel = torch.einsum("bdji,bid->bjd", K, u)
err = (y_from_kernel - y).abs().max().item()
print(f"max |K·u - y| = {err:.2e}")
assert err < 1e-10
assert torch.count_nonzero(torch.triu(K[0, 0], diagonal=1)) == 0, "a source after its target would break causality"

# %% [markdown]
# ## 2. Cut one edge and compare with a brute-force recurrence
#
# The recurrence is `h_t = exp(Δ_t A) * h_{t-1} + Δ_t B_t u_t`, `y_t = C_t · h_t`. To cut the
# edge (j, i) by brute force we rerun it with source `i`'s input left out, and read target `j`.

# %%
j, i = 9, 4
A = -torch.exp(model.blocks[layer].mixer.A_log.double())
dt, B, C = cache[f"{mixer}.hook_dt"][0], cache[f"{mixer}.hook_B"][0], cache[f"{mixer}.hook_C"][0]


def recurrence_without(source: int) -> torch.Tensor:
    h = torch.zeros_like(A)
    ys = []
    for t in range(tokens.shape[1]):
        feed = 0.0 if t == source else 1.0
        h = torch.exp(dt[t, :, None] * A) * h + feed * dt[t, :, None] * B[t][None, :] * u[0, t, :, None]
        ys.append(h @ C[t])
    return torch.stack(ys)


def cut_edge(kernel, hook):
    kernel = kernel.clone()
    kernel[:, :, j, i] = 0
    return kernel


with model.hooks(fwd_hooks=[(f"{mixer}.hook_kernel", cut_edge)]):
    _, cut_cache = model.run_with_cache(tokens, names_filter=f"{mixer}.hook_y")
y_cut = cut_cache[f"{mixer}.hook_y"][0]
brute = recurrence_without(i)
err = (y_cut[j] - brute[j]).abs().max().item()
print(f"edge ({j}<-{i}) cut: |hooked - brute force| at the target = {err:.2e}")
assert err < 1e-10
other = [t for t in range(tokens.shape[1]) if t != j]
assert torch.equal(y_cut[other], y[0, other]), "only the target row changes"

# %% [markdown]
# ## 3. The same on a Mamba-2 head
#
# For Mamba-2 the kernel is per head: `(C_j · B_i) exp(sum_{t=i+1..j} Δ_t A) Δ_i`.

# %%
hf2 = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
    vocab_size=64, hidden_size=32, state_size=8, num_heads=8, head_dim=8, n_groups=1, expand=2,
    num_hidden_layers=2, chunk_size=4)).eval()
model2 = from_hf(hf2.double())
_, c2 = model2.run_with_cache(tokens, names_filter=lambda n: n.startswith(mixer))
K2, u2, y2 = c2[f"{mixer}.hook_kernel"], c2[f"{mixer}.hook_ssm_in"], c2[f"{mixer}.hook_y"]
print("Mamba-2 kernel", tuple(K2.shape), "= [batch, n_heads, target j, source i]")
err = (torch.einsum("bhji,bihp->bjhp", K2, u2) - y2).abs().max().item()
print(f"max |K·u - y| = {err:.2e}")
assert err < 1e-10

# %% [markdown]
# ## 4. Look at it
#
# One channel's kernel |K|, min-max normalised, as the G&A paper plots "hidden attention".

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 4))
for ax, kern, title in ((axes[0], K[0, 0], "Mamba-1, channel 0"), (axes[1], K2[0, 0], "Mamba-2, head 0")):
    k = kern.abs()
    k = (k - k.min()) / (k.max() - k.min())
    ax.imshow(k.numpy(), cmap="viridis")
    ax.set(title=title, xlabel="source i", ylabel="target j")
fig.tight_layout()
fig.savefig(OUT / "ssm_kernel.png", dpi=100)
print("saved", OUT / "ssm_kernel.png")
