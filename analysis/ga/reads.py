"""Where each head reads from on the organisms' KV task: attention or |kernel| mass by role in the pair.

Glossary
    weights     per head, rows of the [q_pos k_pos] mixing matrix: `hook_pattern` for attention heads,
                |`hook_kernel`| row-normalised for SSM heads (Mamba-2 heads, Mamba-1 channels), as in
                `analysis.ga.scores`; only the readers' rows are built (analysis.kernel_rows for SSMs).
    role        a token's place in its pair `k : v \\n`: "key", "colon", "value", "newline".
    reader      a query position: the prompt's last token ("query", where the answer is predicted),
                or each pair's newline ("newline", the Gather step's destination).
    share       mean weight a reader puts on one role of the *queried* pair (reader "query") or of
                its own pair (reader "newline"); `other` is the mean over the remaining pairs, per pair.
    hit         fraction of prompts whose largest weight among the n tokens of that role lands on
                the queried pair (reader "query"; chance 1/n).

`reads(model, p)` returns one row per (layer, head) with these numbers, so "layer-1 head 2 reads the
queried pair's newline at the query" or "every layer-0 Mamba-2 head reads the queried value" is a
number in a table, not a picture.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from analysis.ga.scores import weight_rows_hooks
from analysis.tasks.token_kv import KVPrompts
from hooked.models.model_map import model_map

ROLES = {"key": 0, "colon": 1, "value": 2, "newline": 3}  # offset inside the pair, after <bos>


def head_weights(model: Any, tokens: Tensor, rows: Tensor) -> dict[str, Tensor]:
    """{module: [batch head row k_pos]} rows of the mixing weights of every attention / SSM head module
    (for SSMs the kernel's rows alone are built, never the pos x pos kernel)."""
    out: dict[str, Tensor] = {}
    hooks = [h for s in model_map(model).mixers()
             for h in weight_rows_hooks(s, rows, lambda x, s=s: out.__setitem__(s.path, s.mixing().weights(x.float())))]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(tokens)
    return out


def role_positions(p: KVPrompts, role: str) -> Tensor:
    """[n] position of `role` in each pair (the same in every row)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {tuple(ROLES)}, got {role!r}")
    return torch.tensor([1 + 4 * i + ROLES[role] for i in range(p.n)])


def reads(model: Any, p: KVPrompts) -> list[dict[str, Any]]:
    """One row per (module, head): share / other / hit per role at the query, and at the newlines."""
    newlines = role_positions(p, "newline")
    weights = head_weights(model, p.tokens, torch.cat([newlines, torch.tensor([p.tokens.shape[1] - 1])]))
    rows_b = torch.arange(p.tokens.shape[0])
    table = []
    for module, w in weights.items():  # w [batch head row k_pos]: rows = the newlines, then the query
        layer = int(module.split(".")[1])
        at_query = w[:, :, -1]  # [batch head k_pos]
        at_newline = w[:, :, : p.n]  # [batch head pair k_pos]
        for h in range(w.shape[1]):
            row: dict[str, Any] = {"module": module, "layer": layer, "head": h}
            for role in ROLES:
                pos = role_positions(p, role)
                q = at_query[:, h][:, pos]  # [batch pair]
                mine = q[rows_b, p.answer]
                row[f"query->{role}"] = mine.mean().item()
                row[f"query->{role} other"] = ((q.sum(1) - mine) / max(p.n - 1, 1)).mean().item()
                row[f"query->{role} hit"] = (q.argmax(1) == p.answer).float().mean().item()
                own = at_newline[:, h][:, torch.arange(p.n), pos]  # [batch pair]: newline i -> role of pair i
                row[f"newline->{role}"] = own.mean().item()
            table.append(row)
    return table
