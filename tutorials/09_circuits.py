# %% [markdown]
# # 09: Circuits as edges, on attention and SSMs alike
#
# `analysis.circuits` builds one graph per model: senders (the embedding, every attention or Mamba-2
# head, MLPs) write the residual stream, receivers read it (a head's `.q` / `.k` / `.v`, a Mamba-2
# head's `.x` and its group's `.B` / `.C`, MLPs, the logits). EAP-IG scores every edge from a few
# forwards; exact verification runs the model with only the circuit's edges carrying the clean run.
#
# 1. the KV circuit of a transformer organism (gpt2-kv) and of two SSM organisms (mamba2-kv, zamba2-kv);
# 2. the subject -> last-token circuit of SmolLM2's known facts (`/work/shared/data/known_1000.json`,
#    read by `analysis.tasks.known_facts`).

# %%
import json
import os
from pathlib import Path

from analysis.circuits import edge_attribution, faithfulness_curve, rescore, verify_circuit
from analysis.circuits.plot import draw_circuit
from analysis.circuits.tasks import fact_pairs, kv_pairs
from loaders import from_pretrained

OUT = Path(os.environ.get("HOOKED_TUTORIAL_OUT", "out/tutorials"))
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## 1. KV organisms
# Clean: 16 prompts with 8 key-value pairs; corrupt: the queried key swapped with another pair's key,
# so the answer becomes another value. Metric: logit(clean answer) - logit(corrupt answer).
# EAP-IG screens, `rescore` replaces the scores of its top 20% by exact single-edge effects (a
# first-order estimate can get a sign wrong where attention moves), and the top 5% is verified.

# %%
results = {}
for name, fmt in (("gpt2-kv", "?k"), ("mamba2-kv", "k?"), ("zamba2-kv", "k?")):
    model = from_pretrained(f"organism/{name}")
    clean, corrupt, metric = kv_pairs(8, 16, 0, fmt, "swap")
    scores = edge_attribution(model, clean, corrupt, metric, method="eap-ig", steps=8)
    exact = rescore(model, scores, clean, corrupt, metric, shortlist=int(0.2 * len(scores)))
    top = exact.top(int(0.05 * len(scores)))
    faith = verify_circuit(model, top, clean, corrupt, metric)
    print(name, scores.graph, f"faithfulness of {len(top)} edges: {faith:.3f}")
    print("  ", [str(e) for e in top])
    draw_circuit(top, model.cfg.n_layers, OUT / f"09_{name}_circuit.png", title=f"{name}: top 5%")
    results[name] = {"edges": [str(e) for e in top], "faithfulness": faith, "n_edges": len(scores)}
    assert faith >= 0.8

# %% [markdown]
# gpt2-kv: `embed->L0H3.v` (L0H3 moves each key into its pair), `L0H3->L1H0.k` (L1H0 finds the queried
# pair by that key), `L1H0->logits`, plus a second route. mamba2-kv and zamba2-kv: the conv carries the
# key into the first Mamba-2 layer's B (`embed->L0Hg0.B`) and a few heads write the value to the logits
# (mamba2-kv: L0H0, L0H1, L0H2, L0H4; it was trained with a group lasso on each head's write, and its
# first checkpoint, without it, spread the lookup over all sixteen heads: no 5% circuit held it).
#
# ## 2. SmolLM2's known facts
# Pairs of facts of one relation template and token length (the subject swapped), both answered right.
# EAP (one forward on corrupt, one forward and backward on clean) scores ~70k edges.

# %%
model = from_pretrained("smollm2-135m")
clean, corrupt, metric, facts = fact_pairs(model, n=8)
scores = edge_attribution(model, clean, corrupt, metric)
print(scores)
curve = faithfulness_curve(model, scores, clean, corrupt, metric, [100, 1000, 5000])
for row in curve:
    print(f"top {row['n_edges']:5d} edges ({row['fraction']:.1%}): faithfulness {row['faithfulness']:.3f}")
draw_circuit(scores.top(40), model.cfg.n_layers, OUT / "09_smollm2_facts_circuit.png", title="SmolLM2 facts: top 40")
results["smollm2-135m"] = {"facts": [f.get("subject") for f in facts], "top": [str(e) for e in scores.top(40)],
                           "curve": curve}
(OUT / "09_circuits.json").write_text(json.dumps(results, indent=1))
