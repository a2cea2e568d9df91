# %% [markdown]
# # 06: Model organisms: small trained models whose circuits we know
#
# No SSM weights can be downloaded here, and random weights have no mechanisms to find. So we
# train tiny models on a synthetic key-value task (`analysis/kv_task.py`) and ship them as HF
# checkpoints under `loaders/organisms/` (`scripts/train_organisms.py` reproduces them; each has a
# CARD.md). They load by name and run every analysis of the library in seconds.
#
# 1. the task and the shipped accuracy tables;
# 2. Llama-kv: the G&A circuit, found by the tooling (`rank_heads`, `ga_scores`, pair ablation), and
#    GPT-2-kv, whose learnt positions do not reach past the trained length;
# 3. Mamba-2-kv: one layer of SSM heads that read the queried value straight from the kernel;
# 4. the facts organisms: knockout on SSMs, and why the conv matters there.

# %%
import os
from pathlib import Path

import torch

from analysis.ga import ga_scores, rank_heads, reads
from analysis.interventions import ablate_heads
from analysis.tasks import choice_scores
from analysis.tasks import token_kv as kv_task
from analysis.plots import heatmap, plot_pattern
from loaders import from_pretrained
from loaders.organisms import accuracy, available, available_for, card

torch.set_grad_enabled(False)
OUT = Path(os.environ.get("HOOKED_TUTORIAL_OUT", "out/tutorials"))
OUT.mkdir(parents=True, exist_ok=True)
print("shipped organisms:", available())

# %% [markdown]
# ## The task
# `<bos> (k : v \n) x n` then a query; the next token is the queried key's value. Attention organisms
# use the query `? k` (predicted at k), SSM organisms `k ?` (predicted at ?). Accuracy scores the n
# context values as choices (chance 1/n), the rule the text KV task of tutorial 04 uses.

# %%
p = kv_task.prompts(n=4, n_samples=1, seed=0, fmt="?k")
print(kv_task.to_text(p.tokens[0]), "->", kv_task.WORDS[int(p.choices[0, p.answer[0]])])
for name in available_for("kv"):
    print(name, accuracy(name)["fmt"], {n: round(a, 3) for n, a in accuracy(name)["accuracy"].items()})

# %% [markdown]
# ## Llama-kv: Gather and Aggregate, by construction
# A two-layer Llama. `reads` says, per head, how much attention goes to each role of a pair: the
# newline reading its own pair's key and value is the Gather step; the query reading the queried
# pair's newline is the Aggregate step.

# %%
llama_trained = "llama-kv" in available_for("kv") and accuracy("llama-kv")["accuracy"][8] > 0.8
if llama_trained:
    llama = from_pretrained("organism/llama-kv")
    p = kv_task.prompts(8, 200, seed=5, fmt="?k")
    for r in reads(llama, p):
        print(f"L{r['layer']}H{r['head']}: newline->key {r['newline->key']:.2f}  newline->value "
              f"{r['newline->value']:.2f}  query->queried newline {r['query->newline']:.2f} "
              f"(hit {r['query->newline hit']:.2f})")
else:
    print("organism/llama-kv is not trained (see its CARD.md); skipping its section")

# %% [markdown]
# The tooling finds this circuit without being told: `ga_scores` scores every head's pattern,
# `rank_heads` ablates every head, then pairs the top two with the two best aggregate scorers: the two
# aggregate heads are redundant (one costs nothing alone), so only the pair shows them. The organism's examples are ordinary `Example`s, so this is the same call as on SmolLM2.

# %%
if llama_trained:
    examples = kv_task.examples(8, 60, seed=31, fmt="?k")
    scores = ga_scores(llama, examples[:30])
    readers = sorted(scores, key=lambda u: -scores[u]["aggregate"])[:2]  # the two best aggregate scorers
    ranking = rank_heads(llama, examples, pairs_top_k=2, progress=False, pair_with=readers)
    for row in ranking.rows:
        s = scores[row["unit"]]
        print(f"{row['unit']}: accuracy {row['accuracy']:.2f} (drop {row['drop']:+.2f})  gather {s['gather']:.2f}  "
              f"aggregate {s['aggregate']:.2f}")
    for pair in ranking.pairs:
        print(f"{pair['pair']}: accuracy {pair['accuracy']:.2f} (sum of single drops {pair['single_drops']:.2f}, "
              f"pair drop {pair['drop']:.2f})")
    _, cache = llama.run_with_cache(p.tokens[:1], names_filter=lambda n: n.endswith("hook_pattern"))
    strs = llama.to_str_tokens(p.tokens[0])
    for layer in range(2):
        plot_pattern(cache[f"blocks.{layer}.attn.hook_pattern"][0].mean(0), OUT / f"06_llama_L{layer}.png", strs,
                     f"llama-kv layer {layer}, mean over heads")

# %% [markdown]
# ## GPT-2-kv: the same circuit, with positions that do not extrapolate
# GPT-2 learnt the task only with one layer-1 head's attention guided in training (its CARD.md says
# why); the key mover, two redundant value movers and a second aggregate head were learnt. Its gather
# heads find "3 tokens back" through learnt absolute positions, which exist only where training put
# context newlines (n <= 12): at n = 16 the last four pairs are never retrieved.

# %%
if "gpt2-kv" in available_for("kv"):
    gpt2 = from_pretrained("organism/gpt2-kv")
    p16 = kv_task.prompts(16, 200, seed=16, fmt="?k")
    logits, cache = gpt2.run_with_cache(p16.tokens, names_filter="blocks.0.attn.hook_pattern")
    right = kv_task.correct(choice_scores(logits, p16.choices), p16).float()
    nl = torch.tensor(p16.pair_newlines())
    key_mover = cache["blocks.0.attn.hook_pattern"][:, :, nl, nl - 3].mean(0)  # [head pair]
    head = int(key_mover[:, :4].mean(1).argmax())
    for i in (0, 11, 12, 15):
        print(f"pair {i:2d} (newline at {int(nl[i])}): accuracy {right[p16.answer == i].mean():.2f}, "
              f"L0H{head} newline->key {key_mover[head, i]:.2f}")

# %% [markdown]
# ## Mamba-2-kv: the lookup is one layer of SSM heads
# Layer 0's whole mixer is the lookup: ablating its eight heads takes accuracy to chance, layer 1's
# barely matters. The kernel (DESIGN.md section 4) shows why: at the query `?`, each layer-0 head's
# |kernel| row puts four to five times more weight on the queried pair's *value* token than on any
# other value. The conv (width 4) has already mixed the pair's key into the value's position, so the
# SSM matches keys without a separate Gather step.

# %%
mamba2 = from_pretrained("organism/mamba2-kv")
base = kv_task.accuracy(mamba2, 8, 200, seed=21, fmt="k?")
for layer in range(2):
    with ablate_heads(mamba2, [(layer, h) for h in range(mamba2.cfg.n_heads)]):
        print(f"layer {layer} ablated: {kv_task.accuracy(mamba2, 8, 200, seed=21, fmt='k?'):.2f} (clean {base:.2f})")
rows = reads(mamba2, kv_task.prompts(8, 200, seed=5, fmt="k?"))
share = torch.tensor([[r["query->value"], r["query->value other"]] for r in rows])
heatmap(share.view(2, -1, 2)[..., 0] / share.view(2, -1, 2)[..., 1], OUT / "06_mamba2_value_ratio.png",
        "queried value / other value, |kernel| at the query", "head", "layer")
for r in rows[:8]:
    print(f"L{r['layer']}H{r['head']}: query->queried value {r['query->value']:.2f} vs other "
          f"{r['query->value other']:.2f}, top-1 on the queried value {r['query->value hit']:.2f}")
p = kv_task.prompts(8, 1, seed=5, fmt="k?")
_, cache = mamba2.run_with_cache(p.tokens, names_filter="blocks.0.mixer.hook_kernel")
plot_pattern(cache["blocks.0.mixer.hook_kernel"][0].abs().mean(0), OUT / "06_mamba2_kernel_L0.png",
             mamba2.to_str_tokens(p.tokens[0]), "mamba2-kv layer 0, mean |kernel| (min-max)", normalise=True)
print(card("mamba2-kv").splitlines()[0])

# %% [markdown]
# ## Facts organisms: knockout on a 4-layer Mamba-2
# `organism/mamba2-facts` memorised 1,200 synthetic facts (`analysis/facts_task.py`: subjects of 2-3
# name tokens inside templates like `the R2 of N15 N05 is in`). The facts are known_1000-style dicts,
# so `info_flow` runs unchanged. The last token is within the conv's reach of the subject, so cutting
# only the SSM kernel (the paper's knockout) leaves the conv path open; `cut_conv=True` closes it.

# %%
if "mamba2-facts" in available_for("facts"):
    from analysis.tasks.synthetic_facts import facts
    from analysis.info_flow import info_flow

    facts_model = from_pretrained("organism/mamba2-facts")
    for cut_conv in (False, True):
        flow = info_flow(facts_model, facts()[:48], window=1, sources=("subject", "relation", "last"),
                         cut_conv=cut_conv, progress=False)
        print(f"cut_conv={cut_conv}, subject -> last by layer:", [round(row["mean"], 1) for row in flow.summary()
                                                                  if row["source"] == "subject"])
    flow.plot(OUT / "06_mamba2_facts_flow.png", title="mamba2-facts, conv cut too")
