"""Gather-and-Aggregate tooling: task format, choice scoring against per-choice forwards, head ranking
with and without prefix reuse, G&A scores against hand computation, masking contexts, the CLI."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import transformers
from conftest import build_tiny_hf

from analysis.interventions.ablation import ablate_heads
from analysis.ga.ranking import head_units, rank_heads
from analysis.tasks.scoring import ChoiceScorer, accuracy, answer_logprob, common_prefix, score_choices
from analysis.ga.scores import aggregate_only, ga_scores, gather_only, masked_accuracy, restrict_heads
from analysis.tasks.text import (Example, char_tokenizer, encode, encode_prompts, kv_retrieval, load_words,
                                 multiple_choice, segment_token_spans)
from loaders.load import from_hf

TOK = char_tokenizer()
V = 128  # >= both test tokenizers' vocabularies
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "llama": lambda: transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                              num_attention_heads=4, num_key_value_heads=2),
    "mamba": lambda: transformers.MambaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, state_size=4,
                                              expand=2),
    "mamba2": lambda: transformers.Mamba2Config(vocab_size=V, hidden_size=16, num_hidden_layers=2, state_size=8,
                                                expand=2, head_dim=8, num_heads=4, n_groups=1, chunk_size=16),
    "zamba2": lambda: transformers.Zamba2Config(hidden_size=16, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"],
                                                mamba_d_state=8, n_mamba_heads=4, mamba_ngroups=1, mamba_expand=2,
                                                num_attention_heads=4, intermediate_size=24, vocab_size=V,
                                                chunk_size=16, max_position_embeddings=256),
}


def _model(arch: str, tokenizer=TOK, seed: int = 0):
    model = from_hf(build_tiny_hf(CONFIGS[arch](), seed=seed, perturb=0.1))
    model.tokenizer = tokenizer
    return model


def test_design_names_import():
    from analysis.ga import ga_scores as scores, kv_retrieval as kv, rank_heads as rank, score_choices as score

    assert (scores, kv, rank, score) == (ga_scores, kv_retrieval, rank_heads, score_choices)


# ------------------------------------------------------------------------------------ tasks
def test_kv_retrieval_exact_format():
    [ex] = kv_retrieval(3, 1, seed=0, words=("lantern", "orchid", "ballot"))
    keys, values = ex.meta["keys"], ex.meta["values"]
    expected = ("Memorize the following dictionary:\n" + "".join(f"{k}:{v}\n" for k, v in zip(keys, values))
                + f"The value of the key '{keys[ex.answer]}' is")
    assert ex.prompt == expected
    assert ex.choices == [str(v) for v in values] and ex.meta["query"] == keys[ex.answer]
    assert sorted(keys) == ["ballot", "lantern", "orchid"]
    assert (ex.prompt + ex.choices[ex.answer]).endswith(f"' is{values[ex.answer]}")  # no leading space
    assert [ex.prompt[a:b] for a, b in ex.segments] == [f"{k}:{v}\n" for k, v in zip(keys, values)]


@pytest.mark.parametrize("n_pairs", [1, 10, 50])
def test_kv_retrieval_invariants_and_seeding(n_pairs):
    a, b, c = kv_retrieval(n_pairs, 20, seed=3), kv_retrieval(n_pairs, 20, seed=3), kv_retrieval(n_pairs, 20, seed=4)
    assert [e.prompt for e in a] == [e.prompt for e in b] and [e.answer for e in a] == [e.answer for e in b]
    assert n_pairs == 1 or [e.prompt for e in a] != [e.prompt for e in c]
    words = set(load_words())
    line = re.compile(r"([a-z]+):(\d{1,2})\n")
    for e in a:
        body = e.prompt[len("Memorize the following dictionary:\n"):]
        pairs = line.findall(body)
        assert len(pairs) == n_pairs and re.fullmatch(r"(?:[a-z]+:\d{1,2}\n)+The value of the key '[a-z]+' is", body)
        keys, values = [k for k, _ in pairs], [int(v) for _, v in pairs]
        assert len(set(keys)) == n_pairs and set(keys) <= words
        assert len(set(values)) == n_pairs and all(0 <= v < 100 for v in values)
        assert e.choices[e.answer] == str(values[keys.index(e.meta["query"])])


def test_word_list_is_clean():
    words = load_words()
    assert len(words) >= 100 and len(set(words)) == len(words)
    assert all(re.fullmatch(r"[a-z]+", w) for w in words)


def test_multiple_choice_format():
    ex = multiple_choice("What is 2 + 2?", ["3", "4", "5", "22"], answer=1)
    assert ex.prompt == "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer:"
    assert ex.choices == [" A", " B", " C", " D"] and ex.answer == 1
    assert [ex.prompt[a:b] for a, b in ex.segments] == ["A. 3\n", "B. 4\n", "C. 5\n", "D. 22\n"]


class _NoOffsets:
    """A tokenizer without offsets (a slow tokenizer): the prefix re-tokenisation path."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        if return_offsets_mapping:
            raise NotImplementedError
        return self.tok(text, add_special_tokens=add_special_tokens)


def test_segment_token_spans_point_at_the_newlines():
    [ex] = kv_retrieval(4, 1, seed=1)
    ids = encode(TOK, ex.prompt)
    spans = segment_token_spans(TOK, ex)
    assert spans == segment_token_spans(_NoOffsets(TOK), ex)
    for (first, last), (a, b) in zip(spans, ex.segments):
        assert TOK.decode(ids[last]) == "\n" and TOK.decode(ids[first: last + 1]) == ex.prompt[a:b]


# ---------------------------------------------------------------------------------- scoring
def _bpe_with_boundary_merges():
    """Characters plus merges "i"+"s" -> "is", "is"+digit -> "is4": the prompt's last token "is"
    merges with a choice's first digit ("...is" + "42" -> "is4", "2")."""
    import string

    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    for piece in list(dict.fromkeys(string.printable)) + ["is"] + [f"is{d}" for d in string.digits]:
        vocab[piece] = len(vocab)
    merges = [("i", "s")] + [("is", d) for d in string.digits]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def _hand_scores(model, examples):
    """One forward per (prompt, choice); the choice tokens follow the common prefix with the prompt."""
    out = torch.full((len(examples), max(len(e.choices) for e in examples)), float("-inf"), dtype=torch.float64)
    with torch.no_grad():
        for i, e in enumerate(examples):
            prompt = encode(model.tokenizer, e.prompt)
            for c, choice in enumerate(e.choices):
                joint = encode(model.tokenizer, e.prompt + choice)
                k = common_prefix(prompt, joint)
                logp = model(torch.tensor([joint]))[0].double().log_softmax(-1)
                out[i, c] = sum(logp[p, joint[p + 1]] for p in range(k - 1, len(joint) - 1))
    return out


@pytest.mark.parametrize("arch, tokenizer", [("gpt2", "char"), ("llama", "char"), ("llama", "bpe"),
                                             ("mamba", "char"), ("mamba2", "bpe")])
def test_score_choices_equals_per_choice_forwards(arch, tokenizer):
    tok = TOK if tokenizer == "char" else _bpe_with_boundary_merges()
    model = _model(arch, tok)
    examples = kv_retrieval(3, 3, seed=2) + kv_retrieval(5, 2, seed=5)
    examples.append(multiple_choice("Pick one", ["red", "green", "blue"], 2))
    if tokenizer == "bpe":  # the boundary case must occur for this test to mean anything
        merged = [e for e in examples for ch in e.choices
                  if common_prefix(encode(tok, e.prompt), encode(tok, e.prompt + ch)) < len(encode(tok, e.prompt))]
        assert merged, "no merge across the prompt/choice boundary"
    got = score_choices(model, examples, batch_size=3)  # several batches, left padding
    expected = _hand_scores(model, examples)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got[-1, 3:].eq(float("-inf")).all() and got.shape == (len(examples), 5)
    assert accuracy(got, examples) == (got.argmax(-1) == torch.tensor([e.answer for e in examples])).double().mean()
    ref = expected.log_softmax(-1)[torch.arange(len(examples)), [e.answer for e in examples]].mean()
    assert answer_logprob(got, examples) == pytest.approx(ref.item(), abs=1e-5)


def test_choices_that_share_a_context_cost_one_row():
    model = _model("gpt2")
    single = [Example("Memorize:\na:1\nThe value is", ["1", "2", "3", "4"], 0)]
    assert sum(b.tokens.shape[0] for b in ChoiceScorer(model, single).batches) == 1
    two_digit = [Example("x is", ["12", "13", "24"], 0)]  # contexts "x is1" (serves 12 and 13) and "x is2"
    assert sum(b.tokens.shape[0] for b in ChoiceScorer(model, two_digit).batches) == 2


def test_choice_without_tokens_is_refused():
    with pytest.raises(ValueError, match="adds no token"):
        ChoiceScorer(_model("gpt2"), [Example("abc", ["", "d"], 1)])


# ---------------------------------------------------------------------------------- ranking
def _same_rows(a: list[dict], b: list[dict], tol: float = 1e-6) -> None:
    """Same units in the same order, same accuracies; other numbers within tol (interval bounds may move
    by one bootstrap step when a per-example value moves by rounding, so they are left out)."""
    assert [r.get("unit", r.get("pair")) for r in a] == [r.get("unit", r.get("pair")) for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if k.endswith(("_lo", "_hi")):
                continue
            if isinstance(x[k], float) and not k.startswith(("accuracy", "drop", "single_drops")):
                assert x[k] == pytest.approx(y[k], abs=tol, nan_ok=True), k
            else:
                assert x[k] == y[k], k


@pytest.mark.parametrize("arch", ["llama", "mamba", "mamba2", "zamba2"])
def test_rank_heads_prefix_reuse_gives_the_same_numbers(arch):
    model = _model(arch)
    examples = kv_retrieval(3, 4, seed=1)
    units = head_units(model, channel_group=8)
    fast = rank_heads(model, examples, units, batch_size=8, pairs_top_k=3, progress=False)
    slow = rank_heads(model, examples, units, batch_size=8, pairs_top_k=3, reuse_prefix=False, progress=False)
    # resumed runs read a clean prefix computed untiled: float32 rounding may differ (shared prefix, SSD scan)
    _same_rows(fast.rows, slow.rows)
    _same_rows(fast.pairs, slow.pairs)
    assert len(fast.rows) == len(units) and len(fast.pairs) == 3
    # one row by hand: ablate that unit and score from scratch
    row = fast.rows[-1]
    unit = next(u for u in units if u.label == row["unit"])
    with ablate_heads(model, unit.specs()):
        scores = score_choices(model, examples, batch_size=8)
    assert row["accuracy"] == accuracy(scores, examples)
    # the ranking tiles units per forward (replicas): a larger matmul rounds differently in float32
    assert row["logprob"] == pytest.approx(answer_logprob(scores, examples), abs=1e-6)
    assert row["drop"] == fast.baseline["accuracy"] - row["accuracy"]
    drops = [(r["drop"], r["logprob_drop"]) for r in fast.rows]
    assert drops == sorted(drops, reverse=True)
    assert len({r["logprob_drop"] for r in fast.rows}) > 1


def test_rank_heads_pairs_the_extra_units_too():
    model = _model("llama")
    examples = kv_retrieval(3, 4, seed=1)
    units = head_units(model)
    plain = rank_heads(model, examples, units, pairs_top_k=2, progress=False)
    last = plain.rows[-1]["unit"]  # the least important unit: never paired by the top-k rule
    extra = rank_heads(model, examples, units, pairs_top_k=2, progress=False, pair_with=[last])
    top = plain.top(2)
    assert [p["pair"] for p in plain.pairs] == [f"{top[0]}+{top[1]}"]
    assert [p["pair"] for p in extra.pairs] == [f"{top[0]}+{top[1]}", f"{top[0]}+{last}", f"{top[1]}+{last}"]
    unit = {u.label: u for u in units}
    with ablate_heads(model, unit[top[1]].specs() + unit[last].specs()):
        assert extra.pairs[2]["accuracy"] == accuracy(score_choices(model, examples), examples)
    with pytest.raises(KeyError, match="not one of the ranked units"):
        rank_heads(model, examples, units[:2], progress=False, pair_with=["L1H3"])


def test_head_units_cover_every_head():
    assert [u.label for u in head_units(_model("llama"))][:5] == ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"]
    mamba = head_units(_model("mamba"), channel_group=8)  # d_inner 32: 4 groups per layer
    assert [u.label for u in mamba][:4] == ["L0C0-7", "L0C8-15", "L0C16-23", "L0C24-31"]
    assert sorted(h for u in mamba if u.layer == 1 for h in u.heads) == list(range(32))
    assert len(head_units(_model("mamba2"))) == 2 * 4
    zamba = [u.label for u in head_units(_model("zamba2"))]  # mixer heads, then each invocation's shared heads
    assert zamba[:5] == ["L0H0", "L0H1", "L0H2", "L0H3", "L1SH0"] and "L2SH3" in zamba and len(zamba) == 3 * 4 + 2 * 4


# ------------------------------------------------------------------------------- G&A scores
def _by_hand(weights, batch, b, head, kernel):
    w = weights[b, head].double()
    if kernel:
        w = w.abs() / w.abs().sum(-1, keepdim=True)
    spans = batch.segments[b]
    gather = sum(w[last, first:last].sum() for first, last in spans) / len(spans)
    aggregate = sum(w[-1, last] for _, last in spans)
    return gather.item(), aggregate.item()


@pytest.mark.parametrize("arch", ["gpt2", "mamba2", "mamba", "zamba2"])
def test_ga_scores_equal_hand_computation(arch):
    model = _model(arch)
    examples = kv_retrieval(3, 3, seed=4)
    units = head_units(model, channel_group=1)
    scores = ga_scores(model, examples, units, batch_size=2)
    batch = encode_prompts(model, examples)
    with torch.no_grad():
        _, cache = model.run_with_cache(batch.tokens, batch.attention_mask,
                                        names_filter=lambda n: n.endswith(("hook_kernel", "hook_pattern")))
    for unit in units[:: max(1, len(units) // 6)] + units[-1:]:
        kernel = unit.module.endswith("mixer")
        w = cache[f"{unit.module}.{'hook_kernel' if kernel else 'hook_pattern'}"]
        hand = [_by_hand(w, batch, b, unit.heads[0], kernel) for b in range(len(examples))]
        assert scores[unit.label]["gather"] == pytest.approx(sum(g for g, _ in hand) / len(hand), abs=1e-6)
        assert scores[unit.label]["aggregate"] == pytest.approx(sum(a for _, a in hand) / len(hand), abs=1e-6)
        assert 0 <= scores[unit.label]["gather"] <= 1 and 0 <= scores[unit.label]["aggregate"] <= 1


@pytest.mark.parametrize("arch, head", [("llama", (1, 2)), ("mamba2", (1, 3))])
def test_aggregate_only_makes_a_pure_aggregate_head(arch, head):
    model = _model(arch)
    examples = kv_retrieval(3, 2, seed=4)
    batch = encode_prompts(model, examples)
    label = f"L{head[0]}H{head[1]}"
    with aggregate_only(model, [head], batch):
        scores = ga_scores(model, examples, batch_size=2)
    assert scores[label]["aggregate"] == pytest.approx(1.0, abs=1e-6)
    plain = ga_scores(model, examples, batch_size=2)
    assert plain[label]["aggregate"] < 0.99


def test_masking_equals_hand_written_edits():
    """scores mode == dtype-min on the cut scores by hand; pattern mode == zeroing the pattern by hand."""
    model = _model("llama")
    examples = kv_retrieval(3, 2, seed=6)
    batch = encode_prompts(model, examples)
    layer, h = 1, 3
    pos = batch.tokens.shape[1]
    cut = torch.zeros(len(examples), pos, pos, dtype=torch.bool)
    for b, spans in enumerate(batch.segments):
        for first, last in spans:
            cut[b, last] = True
            cut[b, last, first: last + 1] = False

    def by_hand(x, hook, value):
        x = x.clone()
        x[:, h][cut] = value
        return x

    name = f"blocks.{layer}.attn."
    with torch.no_grad():
        for mode, hook, value in (("scores", "hook_attn_scores", torch.finfo(torch.float32).min),
                                  ("pattern", "hook_pattern", 0.0)):
            with gather_only(model, [(layer, h)], batch, mode=mode):
                got = model(batch.tokens, batch.attention_mask)
            expected = model.run_with_hooks(batch.tokens, batch.attention_mask,
                                            fwd_hooks=[(name + hook, lambda x, hook: by_hand(x, hook, value))])
            assert torch.equal(got, expected), mode
            assert not torch.equal(got, model(batch.tokens, batch.attention_mask))


def test_ssm_masking_zeroes_kernel_entries():
    model = _model("mamba")
    examples = kv_retrieval(3, 2, seed=6)
    batch = encode_prompts(model, examples)
    rows = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    rows[:, -1] = True
    allowed = torch.zeros(*batch.tokens.shape, batch.tokens.shape[1], dtype=torch.bool)
    allowed[:, -1, :3] = True

    def by_hand(k, hook):
        k = k.clone()
        k[:, 5, -1, 3:] = 0
        return k

    with torch.no_grad():
        with restrict_heads(model, [(0, 5)], rows, allowed):
            got = model(batch.tokens, batch.attention_mask)
        expected = model.run_with_hooks(batch.tokens, batch.attention_mask,
                                        fwd_hooks=[("blocks.0.mixer.hook_kernel", by_hand)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(got, model(batch.tokens, batch.attention_mask), atol=1e-6)


def test_masked_accuracy_runs_and_restores():
    model = _model("gpt2")
    examples = kv_retrieval(3, 3, seed=2)
    with torch.no_grad():
        before = score_choices(model, examples)
        for pattern in ("gather", "aggregate"):
            m = masked_accuracy(model, examples, [(1, 0), (1, 1)], pattern)
            assert 0 <= m["accuracy"] <= 1 and m["logprob"] <= 0
        assert torch.equal(score_choices(model, examples), before)


# --------------------------------------------------------------------------------------- CLI
def test_cli_ga_writes_its_files(tmp_path):
    from analysis.cli import main

    hf = build_tiny_hf(CONFIGS["llama"](), perturb=0.1)
    hf.save_pretrained(tmp_path / "model")
    TOK.save_pretrained(tmp_path / "model")
    out = tmp_path / "ga"
    assert main(["ga", str(tmp_path / "model"), "--pairs", "3,4", "--n", "3", "--top-k", "2", "--out", str(out),
                 "--no-progress"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"accuracy.csv", "ranking.csv", "ranking.json", "pairs.csv", "summary.json", "drop_heatmap.png",
            "logprob_drop_heatmap.png"} <= names
    assert sum(n.startswith(("top1_", "top2_")) for n in names) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert [r["pairs"] for r in summary["sizes"]] == [3, 4] and summary["n_units"] == 12
    assert {"gather", "aggregate", "gather_pct", "aggregate_pct"} <= set(summary["top"][0])
    assert set(summary["control"]) == {"baseline", "top2", "random2"}
    assert "scores_vs_drop.png" in names and set(summary["agreement"]) >= {"gather~drop", "aggregate~logprob_drop"}
    top2 = summary["control"]["top2"]["units"]
    draws = summary["control"]["random2"]["draws"]
    assert len(draws) == 5 and all(len(d["units"]) == 2 and not set(d["units"]) & set(top2) for d in draws)
    layer = {r["unit"]: r["layer"] for r in json.loads((out / "ranking.json").read_text())["rows"]}
    assert all(sorted(layer[u] for u in d["units"]) == sorted(layer[u] for u in top2) for d in draws)
    accs = [d["accuracy"] for d in draws]
    assert summary["control"]["random2"]["mean_accuracy"] == pytest.approx(sum(accs) / len(accs))


def test_control_reads_the_top_pair_from_the_ranking():
    from analysis.ga.report import control

    model = _model("llama")
    examples = kv_retrieval(3, 6, seed=2)
    units = head_units(model)
    ranking = rank_heads(model, examples, units, batch_size=8, pairs_top_k=2, progress=False)
    fresh = control(model, examples, ranking, units, n_random=1)
    reused = control(model, examples, ranking, units, n_random=1, reuse_pairs=True)
    assert reused["top2"]["units"] == fresh["top2"]["units"] == ranking.top(2) and len(ranking.pairs) == 1
    assert reused["top2"]["accuracy"] == fresh["top2"]["accuracy"]
    assert reused["top2"]["logprob"] == pytest.approx(fresh["top2"]["logprob"], abs=1e-6)
    assert reused["random2"] == fresh["random2"]
    ranking.pairs[0]["accuracy"] = -1.0  # read, not recomputed
    assert control(model, examples, ranking, units, n_random=1, reuse_pairs=True)["top2"]["accuracy"] == -1.0


def test_control_needs_a_random_draw():
    from analysis.ga.ranking import HeadRanking
    from analysis.ga.report import control

    model = _model("llama")
    with pytest.raises(ValueError, match=r"control: n_random=0: must be >= 1"):
        control(model, kv_retrieval(3, 2, seed=0), HeadRanking({"accuracy": 1.0}, []), head_units(model), n_random=0)


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    from analysis.ga.report import spearman

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (40,), generator=gen).double().tolist()  # many ties
    y = (torch.tensor(x) + torch.randn(40, generator=gen, dtype=torch.float64)).tolist()
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="equal-length"):
        spearman([1, 2], [1])


def test_organisms_get_their_own_kv_prompts():
    from analysis.tasks import token_kv as kv_task
    from analysis.ga.report import task_for
    from loaders.organisms import accuracy, available_for

    assert task_for("smollm2-135m") is kv_retrieval
    for name in available_for("kv"):
        fmt = accuracy(name)["fmt"]
        got = task_for(f"organism/{name}")(4, 3, 7)
        want = kv_task.examples(4, 3, 7, fmt=fmt)
        assert [(e.prompt, e.choices, e.answer) for e in got] == [(e.prompt, e.choices, e.answer) for e in want]
    for name in available_for("facts"):
        with pytest.raises(ValueError, match="KV retrieval needs one of organism/"):
            task_for(f"organism/{name}")
