"""Model organisms: the KV task, the training script, and known answers on the shipped checkpoints.

Glossary
    shipped     every loaders/organisms/<name>/ with a config.json (see loaders/organisms.py) trained on
                the KV task (facts organisms: tests/test_facts_organisms.py)
    card table  accuracy.json beside CARD.md: {n: accuracy} on seeded prompts; reproduced here through
                OUR hooked model organism by name, within 2 points
    HF oracle   the same directory organism by transformers; logits must agree within 1e-4 of max |logit|
    smoke       every KV recipe of scripts/train_organisms.py trained for a few tiny steps and exported
    circuit     Llama-kv and GPT-2-kv: layer-0 heads that copy a pair's key and value into its newline,
                layer-1 heads that read the queried pair's newline at the query (attention mass through
                our hooks); both layer-1 heads ablated together drop accuracy to chance
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from analysis.tasks import scoring
from analysis.tasks import token_kv as kv_task
from analysis.tasks.token_kv import KEY0, NL, VALUE0, make_tokenizer, prompts, to_text, training_batch
from loaders import from_pretrained
from loaders.organisms import accuracy, available_for, organism_path
from scripts.train_organisms import RECIPES, build, export, head_lasso, train

SHIPPED = available_for("kv")  # facts: test_facts_organisms.py
KV_RECIPES = sorted(n for n, r in RECIPES.items() if r.task == "kv")


# ------------------------------------------------------------------------------------ the task
@pytest.mark.parametrize("fmt", ["k?", "?k"])
@pytest.mark.parametrize("n", [1, 5, 12])
def test_training_labels_are_the_queried_values(n, fmt):
    tokens, labels = training_batch(n, 8, torch.Generator().manual_seed(n), fmt)
    assert tokens.shape == (8, 1 + 4 * n + 3 * n)
    for row, lab in zip(tokens.tolist(), labels.tolist()):
        table = {row[1 + 4 * i]: row[3 + 4 * i] for i in range(n)}  # brute force from the context
        assert len(table) == n and all(row[4 + 4 * i] == NL for i in range(n))
        asked = []
        for pos, target in enumerate(lab):
            if target == -100:
                continue
            key = row[pos - 1] if fmt == "k?" else row[pos]
            assert target == table[key] == row[pos + 1]
            asked.append(key)
        assert sorted(asked) == sorted(table)


@pytest.mark.parametrize("answers", [True, False])
@pytest.mark.parametrize("fmt", ["k?", "?k"])
@pytest.mark.parametrize("n_queries", [None, 1, 16])
def test_replacement_queries_are_context_keys_with_their_values(n_queries, fmt, answers):
    n = 3
    tokens, labels = training_batch(n, 64, torch.Generator().manual_seed(0), fmt, "replacement", n_queries, answers)
    asked_per_row = n_queries or n
    width = 3 if answers else 2
    assert tokens.shape == (64, 1 + 4 * n + width * asked_per_row)
    repeats = 0
    for row, lab in zip(tokens.tolist(), labels.tolist()):
        table = {row[1 + 4 * i]: row[3 + 4 * i] for i in range(n)}
        tail = row[1 + 4 * n:]
        queries = [tail[i:i + 2] for i in range(0, len(tail), width)]
        assert all(q[1 if fmt == "?k" else 0] in table and q[0 if fmt == "?k" else 1] == kv_task.QMARK for q in queries)
        if answers:  # each query is followed by its value
            assert [tail[i + 2] for i in range(0, len(tail), 3)] == [table[q[1 if fmt == "?k" else 0]] for q in queries]
        asked = [row[pos] if fmt == "?k" else row[pos - 1] for pos, t in enumerate(lab) if t != -100]
        assert len(asked) == asked_per_row and set(asked) <= set(table)
        assert [t for t in lab if t != -100] == [table[k] for k in asked]
        repeats += len(set(asked)) < len(asked)
    if asked_per_row > 1:
        assert repeats > 0  # with replacement some row asks a key twice (64 rows of 3 draws from 3)


def test_training_batch_rejects_bad_query_options():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="queries must be"):
        training_batch(3, 2, gen, "?k", "sometimes")
    with pytest.raises(ValueError, match="asks each of the n = 3 keys once"):
        training_batch(3, 2, gen, "?k", "permutation", 5)


@pytest.mark.parametrize("queries, answers", [("permutation", True), ("replacement", True), ("replacement", False)])
@pytest.mark.parametrize("fmt", ["k?", "?k"])
def test_queried_newlines_point_at_the_asked_pair(fmt, queries, answers):
    n = 5
    tokens, labels = training_batch(n, 16, torch.Generator().manual_seed(4), fmt, queries, 7 if queries == "replacement"
                                    else None, answers)
    query, newline = kv_task.queried_newlines(tokens, n, fmt, answers)
    for b, (row, lab) in enumerate(zip(tokens.tolist(), labels.tolist())):
        labelled = [pos for pos, t in enumerate(lab) if t != -100]
        assert query.tolist() == labelled
        for q, nl in zip(labelled, newline[b].tolist()):
            asked = row[q - 1] if fmt == "k?" else row[q]
            assert row[nl] == NL and row[nl - 3] == asked and row[nl - 1] == lab[q]
    with pytest.raises(ValueError, match="not a training batch with n = 4|exactly one key of the context"):
        kv_task.queried_newlines(tokens, 4, fmt, answers)


@pytest.mark.parametrize("fmt", ["k?", "?k"])
def test_prompts_answer_and_text_round_trip(fmt):
    p = prompts(6, 20, seed=3, fmt=fmt)
    tok = make_tokenizer()
    for b in range(20):
        row = p.tokens[b].tolist()
        key = row[-2] if fmt == "k?" else row[-1]
        assert KEY0 <= key < VALUE0
        table = {row[1 + 4 * i]: row[3 + 4 * i] for i in range(6)}
        assert table[key] == int(p.choices[b, p.answer[b]])
        assert tok(to_text(row))["input_ids"] == row
    ex = kv_task.examples(6, 2, seed=3, fmt=fmt)
    assert tok(ex[1].prompt)["input_ids"] == prompts(6, 2, seed=3, fmt=fmt).tokens[1].tolist()
    assert [ex[1].prompt[a:b] for a, b in ex[1].segments][0].endswith("\n")


def test_scoring_agrees_with_the_text_kv_scorer():
    """The token form of the scoring rule == its text form (`score_choices`) on the same prompts."""
    ga = pytest.importorskip("analysis.ga")
    from loaders import from_hf

    model = from_hf(build(RECIPES["mamba2-kv"]).eval(), tokenizer=make_tokenizer())
    p = prompts(5, 6, seed=2, fmt="k?")
    with torch.no_grad():
        ours = scoring.choice_scores(model(p.tokens), p.choices)
    theirs = ga.score_choices(model, kv_task.examples(5, 6, seed=2, fmt="k?"))
    torch.testing.assert_close(theirs.float(), ours, rtol=1e-5, atol=1e-5)
    assert len(set(p.choices[0].tolist())) == 5  # evaluation values are distinct: chance is 1/n


def test_batched_and_single_scoring_agree():
    torch.manual_seed(0)
    model = build(dataclasses.replace(RECIPES["llama-kv"])).eval()
    p = prompts(4, 3, seed=1)
    with torch.no_grad():
        batched = scoring.choice_scores(scoring.logits_of(model, p.tokens), p.choices)
        for b in range(3):
            single = scoring.score_choices_tokens(model, p.tokens[b], [[int(c)] for c in p.choices[b]])
            torch.testing.assert_close(single, batched[b], rtol=1e-5, atol=1e-5)
            two = scoring.score_choices_tokens(model, p.tokens[b, :-1], [[int(p.tokens[b, -1]), int(c)]
                                                                          for c in p.choices[b]])
            first = scoring.logits_of(model, p.tokens[b:b + 1, :-1])[0, -1].log_softmax(-1)[p.tokens[b, -1]]
            torch.testing.assert_close(two, batched[b] + first, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ training script
@pytest.mark.parametrize("name", KV_RECIPES)
def test_recipe_trains_a_few_steps_and_exports(name, tmp_path):
    recipe = dataclasses.replace(RECIPES[name], steps=2, steps2=1, batch=4, n_max=3, warmup=1, n_start=2)
    model, summary = train(name, recipe, tmp_path / "work", save_every=2, log=lambda s: None)
    assert summary["steps"] == 3 and (tmp_path / "work" / "state.pt").is_file()
    resumed, again = train(name, recipe, tmp_path / "work", log=lambda s: None)  # resumes at the end
    for a, b in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fresh = build(recipe)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    table = export(name, recipe, model, summary, tmp_path / "out", n_samples=20)
    assert set(table) == {4, 8, 12, 16} and all(0 <= v <= 1 for v in table.values())
    hooked = from_pretrained(tmp_path / "out")
    tokens = prompts(3, 2, seed=0, fmt=recipe.fmt).tokens
    with torch.no_grad():
        ref = model(tokens).logits
        torch.testing.assert_close(hooked(tokens), ref, rtol=0, atol=1e-4 * ref.abs().max().item())
    assert hooked.to_str_tokens(tokens[0])[:2] == ["<bos>", kv_task.WORDS[int(tokens[0, 1])]]


# ---------------------------------------------------------------------------- shipped checkpoints
def test_unknown_organism_lists_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match="no organism 'nope'"):
        from_pretrained("organism/nope")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_accuracy_table_reproduced_by_hooked_model(name, organism):
    card = accuracy(name)
    model = organism(name)
    table = kv_task.accuracy_table(model, tuple(card["accuracy"]), n_samples=card["n_samples"],
                                   seed=card["seed"], fmt=card["fmt"])
    for n, acc in card["accuracy"].items():
        assert abs(table[n] - acc) <= 0.02, (n, table[n], acc)
    text = "K03 : V12 \n ? K03"
    assert model.to_str_tokens(text) == ["<bos>", "K03", ":", "V12", "\n", "?", "K03"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_logits_match_hf(name, organism):
    from transformers import AutoModelForCausalLM

    path = organism_path(name)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    model = organism(name)
    tokens = prompts(10, 4, seed=11, fmt=accuracy(name)["fmt"]).tokens
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
        ours, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(("resid_post", "normalized", "0.hook_resid_pre")))
    torch.testing.assert_close(ours, ref.logits, rtol=0, atol=1e-4 * ref.logits.abs().max().item())
    # HF's hidden states end with the final norm's output; before it, attention models list the
    # embedding (with GPT-2's positions: block 0's resid_pre) and blocks 0..n-2, Mamba models blocks
    # 0..n-1 (no embedding)
    n = model.cfg.n_layers
    blocks = range(n) if hf.config.model_type in ("mamba", "mamba2", "falcon_mamba") else range(-1, n - 1)
    names = [f"blocks.{i}.hook_resid_post" if i >= 0 else "blocks.0.hook_resid_pre" for i in blocks] + ["ln_final.hook_normalized"]
    for name_, h in zip(names, ref.hidden_states, strict=True):
        torch.testing.assert_close(cache[name_], h, rtol=0, atol=1e-4 * h.abs().max().item())


# ------------------------------------------------------------------- attention organisms' circuit
def _trained(name: str, n: int = 8, threshold: float = 0.8) -> bool:
    return name in SHIPPED and accuracy(name)["accuracy"].get(n, 0.0) >= threshold


ATTENTION_KV = [pytest.param(name, marks=pytest.mark.skipif(
    not _trained(name), reason=f"organism/{name} not shipped or not trained (card accuracy at n=8 < 0.8)"))
    for name in ("llama-kv", "gpt2-kv")]


def _patterns(model, n=8, samples=200):
    p = prompts(n, samples, seed=5, fmt="?k")
    _, cache = model.run_with_cache(p.tokens, names_filter=lambda s: s.endswith("hook_pattern"))
    return p, cache["blocks.0.attn.hook_pattern"], cache["blocks.1.attn.hook_pattern"]


@pytest.mark.parametrize("name", ATTENTION_KV)
def test_layer0_heads_move_key_and_value_into_the_newline(name, organism):
    model = organism(name)
    p, pat0, _ = _patterns(model)
    nl = torch.tensor(p.pair_newlines())
    to_key = pat0[:, :, nl, nl - 3].mean((0, 2))  # [n_heads] mean attention newline -> its key
    to_value = pat0[:, :, nl, nl - 1].mean((0, 2))
    k_head, v_head = int(to_key.argmax()), int(to_value.argmax())
    assert k_head != v_head
    assert to_key[k_head] > 0.8 and to_value[v_head] > 0.8, (to_key, to_value)


@pytest.mark.parametrize("name", ATTENTION_KV)
def test_layer1_heads_read_the_queried_newline(name, organism):
    from analysis.interventions.ablation import ablate_heads

    model = organism(name)
    p, _, pat1 = _patterns(model)
    nl = torch.tensor(p.pair_newlines())
    target_nl = nl[p.answer]  # [batch]
    mass = pat1[torch.arange(len(target_nl)), :, -1, target_nl].mean(0)  # [n_heads] at the query
    top2 = mass.topk(2).indices.tolist()
    assert mass[top2].min() > 0.5, mass
    base = kv_task.accuracy(model, 8, 300, seed=21, fmt="?k")
    with ablate_heads(model, [(1, h) for h in top2]):
        both = kv_task.accuracy(model, 8, 300, seed=21, fmt="?k")
    assert base > 0.6 and both < 0.3, (base, both)  # chance at n = 8 is ~0.13


# Measured per organism (reports in docs/results/organisms/): the movers rank within the top
# `movers_in_top` units, the top `layer0_top` units are all in layer 0, and (Llama-kv) the two readers
# together cost more than the sum of their single drops plus `beyond_sum`.
RANKING = {"llama-kv": dict(movers_in_top=3, layer0_top=3, beyond_sum=0.3),
           "gpt2-kv": dict(movers_in_top=4, layer0_top=1, beyond_sum=None)}


@pytest.mark.parametrize("name", ATTENTION_KV)
def test_ga_tooling_finds_the_circuit(name, organism):
    """The movers (layer-0 heads putting > 0.8 attention from each newline on its pair's key or
    value, measured by `kv_reads`) are the best gather scorers and the key mover tops `rank_heads`;
    a mover that costs little alone has a redundant twin, and the pair ablation shows it (chance).
    The two best aggregate scorers are the layer-1 readers; one of them costs nothing alone and
    only the pair ablation that rank_heads offers (pairing the best aggregate scorers) shows them:
    together, chance. Llama-kv: one key and one value mover; GPT-2-kv: one key mover, two value
    movers (each redundant alone)."""
    from analysis.ga.reads import reads

    ga = pytest.importorskip("analysis.ga")
    model = organism(name)
    rows = reads(model, prompts(8, 200, seed=5, fmt="?k"))
    label = {id(r): f"L{r['layer']}H{r['head']}" for r in rows}
    key_mover = label[id(max(rows, key=lambda r: r["newline->key"]))]
    movers = {label[id(r)] for r in rows if max(r["newline->key"], r["newline->value"]) > 0.8}
    assert key_mover in movers and len(movers) >= 2 and all(u.startswith("L0") for u in movers), movers
    examples = kv_task.examples(8, 120, seed=31, fmt="?k")
    scores = ga.ga_scores(model, examples[:40])
    by = {kind: sorted(scores, key=lambda u: -scores[u][kind]) for kind in ("gather", "aggregate")}
    assert set(by["gather"][:len(movers)]) == movers, (movers, by["gather"][:4])
    assert all(scores[u]["gather"] > 0.8 for u in movers)
    layer1 = by["aggregate"][:2]
    assert all(u.startswith("L1") and scores[u]["aggregate"] > 0.5 for u in layer1), {u: scores[u] for u in layer1}
    ranking = ga.rank_heads(model, examples, pairs_top_k=4, progress=False, pair_with=layer1)
    single = {r["unit"]: r for r in ranking.rows}
    pair = {frozenset(p["pair"].split("+")): p for p in ranking.pairs}
    assert ranking.top(1) == [key_mover] and single[key_mover]["drop"] > 0.5, ranking.rows[:4]
    expect = RANKING[name]
    assert movers <= set(ranking.top(expect["movers_in_top"])), (movers, ranking.rows[:4])
    assert {r["layer"] for r in ranking.rows[:expect["layer0_top"]]} == {0}, ranking.rows[:4]
    for mover in movers - {key_mover}:  # costly alone, or to chance with a redundant twin
        twins = [p for k, p in pair.items() if mover in k and k <= movers - {key_mover}]
        assert single[mover]["drop"] > 0.3 or any(p["accuracy"] < 0.3 for p in twins), (mover, single[mover], twins)
    assert min(single[u]["drop"] for u in layer1) < 0.1, [single[u] for u in layer1]  # redundant alone
    readers = pair[frozenset(layer1)]
    assert readers["accuracy"] < 0.3 < ranking.baseline["accuracy"] - 0.3, (readers, ranking.baseline)
    assert readers["drop"] > max(single[u]["drop"] for u in layer1) + 0.2  # the pair costs more than either
    if expect["beyond_sum"] is not None:
        assert readers["drop"] > readers["single_drops"] + expect["beyond_sum"]  # more than the sum of the single drops


def test_guide_loss_is_minus_log_attention_on_the_queried_newline():
    from scripts.train_organisms import guide_loss

    recipe = RECIPES["gpt2-kv"]
    model = build(recipe).eval()
    tokens, labels = training_batch(3, 4, torch.Generator().manual_seed(1), recipe.fmt)
    with torch.no_grad():
        att = model(tokens, output_attentions=True).attentions
    layer, head = recipe.guide
    brute = []
    for b in range(4):
        for q in range(tokens.shape[1]):
            if labels[b, q] == -100:
                continue
            nl = next(i for i in range(4, 13, 4) if tokens[b, i - 3] == tokens[b, q])  # the asked key's pair ("? k")
            assert tokens[b, nl - 1] == labels[b, q]
            brute.append(-torch.log(att[layer][b, head, q, nl] + 1e-9))
    torch.testing.assert_close(guide_loss(att, recipe.guide, tokens, 3, recipe), torch.stack(brute).mean())


def test_guided_steps_pull_the_head_onto_the_queried_newline(tmp_path):
    """A few guided steps raise the guided head's attention on the queried newline (lower its
    guide_loss); the same steps without the guide do not (same seed, same batches)."""
    from scripts.train_organisms import guide_loss

    def guided_head_loss(recipe, steps):
        model, _ = train("gpt2-kv", dataclasses.replace(recipe, steps=steps, steps2=0, warmup=1, n_start=3),
                         tmp_path / f"{recipe.guide}-{steps}", log=lambda s: None)
        tokens, _ = training_batch(3, 32, torch.Generator().manual_seed(9), recipe.fmt)
        with torch.no_grad():
            return float(guide_loss(model(tokens, output_attentions=True).attentions, guided.guide, tokens, 3, recipe))

    guided = RECIPES["gpt2-kv"]
    unguided = dataclasses.replace(guided, guide=None)
    start, after, without = guided_head_loss(guided, 0), guided_head_loss(guided, 30), guided_head_loss(unguided, 30)
    assert after < start - 0.5 < without, (start, after, without)  # measured: 2.88, 1.14, 2.94


@pytest.mark.parametrize("change", [dict(engine="hooked"), dict(task="facts"), dict(config={})])
def test_guide_refuses_what_it_cannot_supervise(change, tmp_path):
    recipe = dataclasses.replace(RECIPES["gpt2-kv"], **change)
    with pytest.raises(ValueError, match="guide needs an attention model"):
        train("gpt2-kv", recipe, tmp_path, log=lambda s: None)
    assert not (tmp_path / "state.pt").exists()


def _head_write_norms(model):
    """[layers heads] Frobenius norm of each SSM head's write (out_proj columns x the gated norm's weight), by loops."""
    out = []
    for layer in model.backbone.layers:
        m = layer.mixer
        w = (m.out_proj.weight * m.norm.weight).detach()
        out.append([float(w[:, h * m.head_dim:(h + 1) * m.head_dim].norm()) for h in range(m.num_heads)])
    return torch.tensor(out)


def test_head_lasso_is_the_sum_of_the_head_write_norms():
    model = build(RECIPES["mamba2-kv"])
    norms = _head_write_norms(model)
    assert float(head_lasso(model)) == pytest.approx(float(norms.sum()), rel=1e-6)
    with torch.no_grad():
        model.backbone.layers[1].mixer.out_proj.weight[:, 3 * 16:4 * 16] = 0.0  # silence L1H3
    assert float(head_lasso(model)) == pytest.approx(float(norms.sum() - norms[1, 3]), rel=1e-6)


def test_head_lasso_steps_shrink_the_head_writes(tmp_path):
    """A few steps with a large lasso weight leave smaller head writes than the same steps without it."""
    base = dataclasses.replace(RECIPES["mamba2-kv"], steps=15, batch=4, n_max=3, warmup=1)
    with_lasso, _ = train("mamba2-kv", dataclasses.replace(base, head_lasso=1.0), tmp_path / "a", log=lambda s: None)
    without, _ = train("mamba2-kv", dataclasses.replace(base, head_lasso=0.0), tmp_path / "b", log=lambda s: None)
    assert float(_head_write_norms(with_lasso).sum()) < 0.9 * float(_head_write_norms(without).sum())


def test_head_lasso_refuses_a_model_without_ssm_heads(tmp_path):
    with pytest.raises(ValueError, match="head_lasso needs an HF Mamba-2 model"):
        train("llama-kv", dataclasses.replace(RECIPES["llama-kv"], head_lasso=0.1), tmp_path, log=lambda s: None)
    assert not (tmp_path / "state.pt").exists()


def test_minutes_budget_stops_training(tmp_path):
    recipe = dataclasses.replace(RECIPES["llama-kv"], steps=1000, steps2=10, batch=2, n_max=2, minutes=1e-5)
    _, summary = train("llama-kv", recipe, tmp_path, log=lambda s: None)
    assert summary["steps"] == 1


# ----------------------------------------------------------------------------- Mamba-2-kv circuit
@pytest.mark.skipif(not _trained("mamba2-kv"), reason="organism/mamba2-kv not shipped or not trained")
def test_mamba2_layer0_mixer_does_the_retrieval(organism):
    """Measured on the shipped checkpoint: layer 0's SSM does the lookup (its whole-mixer ablation
    drops accuracy to chance, layer 1's costs little), and every layer-0 head's kernel row at the
    query puts ~3x more |kernel| on the queried pair's value token than on any other value token."""
    from analysis.interventions.ablation import ablate_heads

    model = organism("mamba2-kv")
    heads = range(model.cfg.n_heads)
    base = kv_task.accuracy(model, 8, 300, seed=21, fmt="k?")
    with ablate_heads(model, [(0, h) for h in heads]):
        no_l0 = kv_task.accuracy(model, 8, 300, seed=21, fmt="k?")
    with ablate_heads(model, [(1, h) for h in heads]):
        no_l1 = kv_task.accuracy(model, 8, 300, seed=21, fmt="k?")
    assert base > 0.9 and no_l0 < 0.2 and no_l1 > base - 0.15, (base, no_l0, no_l1)
    p = prompts(8, 100, seed=5, fmt="k?")
    _, cache = model.run_with_cache(p.tokens, names_filter="blocks.0.mixer.hook_kernel")
    row = cache["blocks.0.mixer.hook_kernel"][:, :, -1].abs()  # [batch head k_pos] at the query
    share = row / row.sum(-1, keepdim=True)
    values = share[:, :, [4 * i + 3 for i in range(8)]]  # value token of each pair
    queried = values[torch.arange(100), :, p.answer]  # [batch head]
    others = (values.sum(-1) - queried) / 7
    assert (queried.mean(0) > 2 * others.mean(0)).all(), (queried.mean(0), others.mean(0))


# ----------------------------------------------------------------- training through our model
@pytest.mark.parametrize("name", ["mamba-kv", "llama-kv"])
def test_hooked_engine_trains_the_hf_tensors_with_hf_gradients(name):
    """engine="hooked": our model's parameters are views of HF's, and a step through ours equals a
    step through HF (same loss, same gradients within float32 noise), landing in the HF model."""
    from scripts.train_organisms import forward_model

    recipe = dataclasses.replace(RECIPES[name], engine="hooked")
    hf_a, hf_b = build(recipe), build(recipe)  # same seed: equal weights
    ours = forward_model(hf_a, recipe)
    tokens, labels = training_batch(4, 8, torch.Generator().manual_seed(0), recipe.fmt)

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    loss_ours, loss_hf = loss_of(ours(tokens)), loss_of(hf_b(tokens).logits)
    torch.testing.assert_close(loss_ours, loss_hf, rtol=1e-5, atol=1e-6)
    loss_ours.backward()
    loss_hf.backward()
    views = dict(ours.named_parameters())
    hf_grads = {n: t.grad for n, t in hf_b.named_parameters()}
    by_ptr = {t.untyped_storage().data_ptr(): n for n, t in hf_a.named_parameters()}
    for our_name, p in views.items():
        hf_name = by_ptr[p.untyped_storage().data_ptr()]
        g = hf_grads[hf_name].reshape(p.shape)
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5 * g.abs().max().item() + 1e-9), our_name
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    before = {n: t.detach().clone() for n, t in hf_a.state_dict().items()}
    opt.step()
    changed = [n for n, t in hf_a.state_dict().items() if not torch.equal(t, before[n])]
    assert len(changed) >= len(views) - 1  # every trained tensor moved in the HF model itself
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf_a(tokens).logits, rtol=0, atol=1e-5)


def test_share_weights_refuses_a_copying_key_map():
    from loaders import from_hf

    with pytest.raises(ValueError, match="cannot share blocks.0.attn.q_proj.weight"):
        from_hf(build(RECIPES["gpt2-kv"]), share_weights=True)
