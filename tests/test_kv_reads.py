"""analysis.ga.reads: per-head read shares on the KV task equal a brute-force loop over the cache."""

from __future__ import annotations

import pytest
import torch

from analysis.ga.reads import ROLES, reads, role_positions
from analysis.tasks.token_kv import prompts
from loaders import from_hf
from scripts.train_organisms import RECIPES, build


def _brute(weights, p, layer_head):
    """The same numbers from explicit loops over prompts and pairs."""
    w = weights  # [batch k_pos] at the query, or the full [batch q k]
    out = {}
    for role, off in ROLES.items():
        mine, other, hit, own = [], [], [], []
        for b in range(p.tokens.shape[0]):
            vals = [float(w[b, -1, 1 + 4 * i + off]) for i in range(p.n)]
            a = int(p.answer[b])
            mine.append(vals[a])
            other.append((sum(vals) - vals[a]) / (p.n - 1))
            hit.append(float(max(range(p.n), key=lambda i: vals[i]) == a))
            own += [float(w[b, 1 + 4 * i + 3, 1 + 4 * i + off]) for i in range(p.n)]
        for key, xs in ((f"query->{role}", mine), (f"query->{role} other", other), (f"query->{role} hit", hit),
                        (f"newline->{role}", own)):
            out[key] = sum(xs) / len(xs)
    return out


@pytest.mark.parametrize("name", ["llama-kv", "gpt2-kv", "mamba2-kv"])
def test_reads_equal_brute_force(name):
    torch.manual_seed(0)
    model = from_hf(build(RECIPES[name]))
    p = prompts(5, 6, seed=3, fmt=RECIPES[name].fmt)
    rows = reads(model, p)
    kind = "mixer.hook_kernel" if name == "mamba2-kv" else "attn.hook_pattern"
    _, cache = model.run_with_cache(p.tokens, names_filter=lambda n: n.endswith(kind))
    assert len(rows) == sum(cache[n].shape[1] for n in cache.keys())
    for row in rows:
        w = cache[f"{row['module']}.{kind.split('.')[1]}"][:, row["head"]].float()
        if kind.endswith("kernel"):
            w = w.abs() / w.abs().sum(-1, keepdim=True)
        want = _brute(w, p, (row["layer"], row["head"]))
        for key, value in want.items():
            assert row[key] == pytest.approx(value, abs=1e-6), (row["module"], row["head"], key)


def test_role_positions_and_bad_role():
    p = prompts(3, 1, seed=0)
    assert role_positions(p, "newline").tolist() == p.pair_newlines()
    assert p.tokens[0, role_positions(p, "colon")].tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="role must be one of"):
        role_positions(p, "answer")
