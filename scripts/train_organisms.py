"""Train the model organisms: tiny HF transformers models on the synthetic KV task (analysis/kv_task.py).

Glossary
    recipe      one organism: an HF config class and its kwargs, the query format, the learning rate,
                the step budget, the range of n (pairs per sequence) and whether to use a curriculum.
    step        one AdamW update on a batch of 64 sequences, all with the same n (drawn per step).
    curriculum  start with n <= `n_start`; raise the maximum by one when training accuracy over the
                last 50 steps passes 0.9, up to `n_max` (attention models need it to leave chance).
    guide       (layer, head) of one attention head whose attention from each query to the queried
                pair's newline is supervised for the first `guide_steps` steps (`guide_loss`, added to
                the task loss); GPT-2-kv needs it (its recipe's notes say why).
    phase 2     optional extra steps at a lower learning rate (`--steps2`, `--lr2`).
    work dir    /tmp/organisms/<name>: `state.pt` (model, optimizer, step, curriculum, generator) is
                saved every `--save-every` steps, so a killed job resumes where it stopped.
    out dir     loaders/organisms/<name>: config.json, model.safetensors, tokenizer files, CARD.md.

Optimiser (measured in issue 7): AdamW betas (0.9, 0.98), weight decay 0.01, linear warmup over 200
steps then constant lr, gradient clip 1.0, loss on every answer of the n queries per sequence.
One thread per job (2 threads were 9x slower per step on the shared machine).

    python scripts/train_organisms.py mamba2-kv                       # full recipe, then export
    python scripts/train_organisms.py llama-kv --steps 200 --no-export # a quick check
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from analysis.tasks import synthetic_facts as facts_task
from analysis.tasks.scoring import logits_of
from analysis.tasks.token_kv import D_VOCAB, PAD, accuracy_table, make_tokenizer, queried_newlines, training_batch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "loaders" / "organisms"
WORK = Path("/tmp/organisms")


@dataclass
class Recipe:
    config_class: str  # transformers class name of the config
    model_class: str  # transformers class name of the causal LM
    config: dict[str, Any]
    fmt: str = "?k"
    lr: float = 3e-3
    steps: int = 800
    n_min: int = 2
    n_max: int = 12
    curriculum: bool = False
    n_start: int = 3
    queries: str = "permutation"  # or "replacement" (see kv_task.training_batch)
    engine: str = "hf"  # "hooked": train through our model, which shares the HF model's tensors
    n_queries: int | None = None  # queries per sequence with "replacement" (default n)
    answers: bool = True  # False: answers left out of the training sequence (see kv_task.training_batch)
    steps2: int = 0
    lr2: float = 1e-3
    batch: int = 64
    warmup: int = 200
    seed: int = 0
    minutes: float | None = None  # wall-clock budget: phase 2 takes its last 15%, then training stops
    task: str = "kv"  # or "facts" (analysis/facts_task.py; n, fmt and queries unused)
    stop_acc: float | None = None  # stop once the last 50 steps' training accuracy reaches this
    guide: tuple[int, int] | None = None  # (layer, head): attention supervised onto the queried newline
    guide_steps: int = 0  # ... for the first guide_steps steps (see guide_loss)
    head_lasso: float = 0.0  # weight of the group-lasso penalty on each SSM head's write (see head_lasso)
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_COMMON = dict(vocab_size=D_VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=PAD)
_FACTS = dict(vocab_size=facts_task.D_VOCAB, pad_token_id=facts_task.PAD, bos_token_id=facts_task.BOS,
              eos_token_id=facts_task.PAD)
_FACTS_RUN = dict(n_min=1, n_max=1, lr=3e-3, steps=20000, steps2=2000, lr2=1e-3, stop_acc=0.99, minutes=15)
_ATTENTION_NOTES = """
What it took (measured on this machine, 1 thread): nine Llama runs stayed at chance for 3,000-10,500
steps: tied embeddings with every key asked once (10,500 steps, stuck on the elimination shortcut:
0.75 at n = 2, 0.61 at n = 3), tied with keys asked with replacement and/or answers left out of the
sequence (also at batch 256, lr 1e-2, init std 0.1, hidden 128), and untied with replacement and
answers left out (3,200 steps). In all of them layer 0 learnt to avoid attending to key tokens.
The run that worked, this recipe (untied, as HF's LlamaConfig default; every key asked once, answers
in the sequence), left n <= 3 at step 1,188 and reached n = 12 at step 7,373.
"""

RECIPES: dict[str, Recipe] = {
    "mamba2-kv": Recipe("Mamba2Config", "Mamba2ForCausalLM", dict(
        _COMMON, hidden_size=64, num_hidden_layers=2, state_size=32, head_dim=16, num_heads=8, expand=2,
        n_groups=1, chunk_size=16, conv_kernel=4, tie_word_embeddings=True), fmt="k?", lr=3e-3, steps=3000,
        head_lasso=0.05, notes="""
Trained with a group lasso on each SSM head's write (`head_lasso`: 0.05 x the sum over heads of the
Frobenius norm of the head's out_proj columns scaled by the gated norm's weight), so that the lookup
sits in few heads and reads as a circuit of few edges (issue 32). The first recipe (800 steps, no
penalty; 0.958 at n = 12) spread the lookup over all sixteen heads' writes: no head's write to the
logits carried an eighth of the logit difference, and no 5-edge circuit reached 0.3 of it.
Measured (1 thread; faithfulness of the 5-edge circuit of tests/test_circuit_organisms.py): with the
penalty on out_proj alone (the norm's weight left out), 800 steps: 0.02 -> 0.79, 0.05 -> 0.84, 0.1 ->
0.63; as here (norm's weight included), 800 steps: 0.02 -> 0.64, 0.05 -> 0.81; 3,000 steps: 0.1 ->
0.55 (layer 1 kept writing), 0.05 (this recipe) -> 0.91: layer-0 heads 6 and 7 silent (out_proj
column norm < 0.05), layer 1 nearly so, and the 5-edge circuit (embed->L0Hg0.B, L0H{0,1,2,4}->logits)
carries 0.9 of the logit difference.
"""),
    "llama-kv": Recipe("LlamaConfig", "LlamaForCausalLM", dict(
        _COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
        attn_implementation="eager"), fmt="?k", lr=3e-3, steps=9000, curriculum=True, steps2=1500, lr2=1e-3,
        notes=_ATTENTION_NOTES),
    "gpt2-kv": Recipe("GPT2Config", "GPT2LMHeadModel", dict(
        _COMMON, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256, tie_word_embeddings=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"), fmt="?k", lr=3e-3,
        steps=6000, curriculum=True, steps2=1000, lr2=1e-3, guide=(1, 0), guide_steps=3000, notes="""
Guided: for the first 3,000 steps the attention of L1H0 from each query's last token is supervised
onto the queried pair's newline (`guide_loss`, added to the task loss); nothing else is supervised,
and after step 3,000 the task loss alone trains. The gather heads of layer 0 (a key mover and value
movers) and a second aggregate head (L1H1) were learnt by the task loss.
Why (measured this way, 1 thread): unguided, GPT-2 never left the elimination plateau at n <= 3
(training accuracy ~0.75 at n = 2, ~0.62 at n = 3): the Llama-kv recipe for 10,500-13,000 steps
(seeds 0-3, lr 3e-3 and 1e-3), and for 6,000-10,500 steps each: positions initialised as scaled
sinusoids (0.03, 0.1), 3 layers, width 128, 8 heads, dropout off, keys asked with replacement,
answers left out. Supervising layer 0 instead (the key mover alone, for 500, 2,000 or all steps; key
and value movers for all steps) did not help either: the aggregate head's match is the obstacle.
Llama-kv's own recipe with RoPE removed (no positions, or learnt absolute positions as GPT-2's)
stayed on the plateau for 3,400 steps, where with RoPE it leaves at step 1,188: GPT-2's learnt
absolute positions are what makes the difference. With this guide, n_max reached 12 at step ~1,400.
"""),
    "zamba2-kv": Recipe("Zamba2Config", "Zamba2ForCausalLM", dict(
        _COMMON, hidden_size=64, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        mamba_d_state=32, mamba_headdim=16, n_mamba_heads=8, mamba_expand=2, mamba_ngroups=1, chunk_size=16,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, num_mem_blocks=1,
        use_shared_attention_adapter=False, use_mem_rope=True, max_position_embeddings=256,
        tie_word_embeddings=True, attn_implementation="eager"), fmt="k?", lr=3e-3, steps=2300, curriculum=True,
        engine="hooked", notes="""
What it took: without a curriculum (n uniform in [2, 12]) two runs stayed at chance: 4,000 steps through
HF (~35 min) and 3,000 through our model, although Mamba-2-kv, whose mixer has the same sizes, learns
that way in 800 steps. With the curriculum (n <= 3 first, as for Llama-kv), through our model (its loss
equals HF's; 3.5-10 steps/s vs ~2 on HF's path), n_max reached 12 at step 1,593; stopped at 2,300.
"""),
    "falcon-h1-kv": Recipe("FalconH1Config", "FalconH1ForCausalLM", dict(
        _COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=32, mamba_n_groups=1, mamba_chunk_size=16,
        mamba_rms_norm=True, intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=True,
        attn_implementation="eager"), fmt="k?", lr=3e-3, steps=5200, engine="hooked", minutes=46, notes="""
A parallel hybrid (Falcon-H1's layer: attention and Mamba-2 side by side on the same normalised input,
their outputs summed, then a SwiGLU MLP), every muP multiplier 1, trained through our model (engine
"hooked"), to ask which branch aggregates when both could.
What it took (1 thread, machine load ~9): with Zamba2-kv's curriculum (n <= 3 first) and no norm
before out_proj (HF's default mamba_rms_norm=False), 1,500 steps stayed on the elimination plateau
(0.75 at n = 2, 0.62 at n = 3). This recipe (gated RMSNorm, n uniform in [2, 12] as Mamba-2-kv) sat
near 0.35 at n ~ 9 until step ~3,300, then left the plateau (0.9 at n = 6 by step 3,950). The run was
stopped and resumed with larger budgets (12, then 35, then 46 minutes); the result is what one
uninterrupted run of this recipe gives, as the state (model, optimizer, data generator) is restored.
"""),
    "gdn-kv": Recipe("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        _COMMON, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=128,
        max_position_embeddings=256, tie_word_embeddings=True, attn_implementation="eager"), fmt="k?", lr=3e-3,
        steps=5200, engine="hooked", minutes=60, notes="""
A Gated DeltaNet + attention hybrid (OLMo-hybrid's layers: a pre-norm Gated DeltaNet layer, beta in
[0, 2], then a post-norm RoPE attention layer; SwiGLU MLPs), trained through our model (engine
"hooked": the delta rule in its chunked form), to ask which branch gathers and which aggregates,
as Zamba2-kv (SSM then attention) and Falcon-H1-kv (side by side) ask it.
What it took: this first recipe (n uniform in [2, 12], no curriculum, as Mamba-2-kv) left chance by
step ~500 and passed 0.9 training accuracy by step ~1,000; 5,200 steps took 11 min (the chunked rule
through our model, about 8 steps/s at batch 64).
"""),
    "mamba-kv": Recipe("MambaConfig", "MambaForCausalLM", dict(
        _COMMON, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4,
        tie_word_embeddings=True), fmt="k?", lr=3e-3, steps=5200, engine="hooked", notes="""
Trained through hooked's own Mamba-1 (engine "hooked": `from_hf(model, share_weights=True)`, so the
optimizer updates the HF tensors that are saved): a training step on HF's slow path took 3.7x as long
(7.8 s vs 2.1 s at n = 8, batch 64, on the loaded machine). Learning was slow: training accuracy sat
near the elimination level (answering with a value not yet asked) until step ~3,000, then rose to
0.99 by step ~4,700. The run was stopped at step 5,200 (57 min on one shared thread).
"""),
    "griffin-kv": Recipe("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(
        _COMMON, hidden_size=64, num_hidden_layers=2, block_types=["recurrent", "attention"], num_attention_heads=4,
        num_key_value_heads=1, lru_width=64, intermediate_size=256, attention_window_size=128, conv1d_width=4,
        tie_word_embeddings=False, attn_implementation="eager"), fmt="k?", lr=3e-3, steps=11200, engine="hooked",
        notes="""
RecurrentGemma's layers (Griffin): an RG-LRU recurrent block (conv, input and recurrence gates, one decaying
state per channel), then local multi-query attention (4 query heads, 1 key-value head; its 128-token window
is longer than every training sequence, so it sees the whole prompt), GeGLU MLPs, trained through our model
(engine "hooked": the RG-LRU as a linear scan; its gradients equal HF's within 1e-6 relative), to ask which
layer gathers and which aggregates, as gdn-kv (Gated DeltaNet then attention) and Zamba2-kv ask it.
What it took (1 thread, shared machine): with tied embeddings (RecurrentGemma's default) the model stayed on
the elimination plateau (training accuracy ~0.75 at n = 2, ~0.6 at n = 3, ~0.3 at n = 12) for 16,000 steps
(34 min; choice accuracy at chance after it: 0.228 / 0.130 / 0.082 / 0.046 at n = 4 / 8 / 12 / 16), and
with the curriculum (n <= 3 first) for 8,850 steps. Untied (this recipe, as Llama-kv's notes found for
attention), n uniform in [2, 12]: it left the plateau between steps 8,000 and 8,500 and passed 0.9 training
accuracy at n = 9 by step ~10,500; 11,200 steps took 14.6 min. (A first untied run went NaN at step ~11,550:
a decay rounding to 1 gave the multiplier sqrt(1 - a^2) an infinite gradient; the RG-LRU now clips it at
1000, as HF does, and this run is that one's trajectory up to there, step for step.)
"""),
    "mamba2-facts": Recipe("Mamba2Config", "Mamba2ForCausalLM", dict(
        _FACTS, hidden_size=64, num_hidden_layers=4, state_size=32, head_dim=16, num_heads=8, expand=2,
        n_groups=1, chunk_size=16, conv_kernel=4, tie_word_embeddings=True), task="facts", **_FACTS_RUN),
    "mamba-facts": Recipe("MambaConfig", "MambaForCausalLM", dict(
        _FACTS, hidden_size=64, num_hidden_layers=4, state_size=16, expand=2, conv_kernel=4,
        tie_word_embeddings=True), task="facts", **_FACTS_RUN),
}


def build(recipe: Recipe) -> torch.nn.Module:
    """A freshly initialised HF model (seeded) for the recipe."""
    import transformers

    cfg_kwargs = dict(recipe.config)
    attn = cfg_kwargs.pop("attn_implementation", None)
    config = getattr(transformers, recipe.config_class)(**cfg_kwargs)
    if attn is not None:
        config._attn_implementation = attn
    torch.manual_seed(recipe.seed)
    return getattr(transformers, recipe.model_class)(config)


def forward_model(model: torch.nn.Module, recipe: Recipe) -> torch.nn.Module:
    """What the training step runs: the HF model, or (engine "hooked") our model whose parameters
    are views of the HF model's tensors, so the optimizer trains the HF checkpoint through our
    faster scans (Mamba-1: HF's slow path loops over positions in Python)."""
    if recipe.engine == "hf":
        return model
    if recipe.engine != "hooked":
        raise ValueError(f"engine must be 'hf' or 'hooked', got {recipe.engine!r}")
    from loaders import from_hf

    return from_hf(model, share_weights=True).train()


def guide_loss(attentions: tuple[torch.Tensor, ...], guide: tuple[int, int], tokens: torch.Tensor, n: int,
               recipe: Recipe) -> torch.Tensor:
    """Mean -log attention of head `guide` = (layer, head) from each query's last token to the
    queried pair's newline: supervises where one aggregate head reads, nothing else (the gather
    heads that must fill the newline are left to the task loss). `attentions`: HF's per-layer
    [batch head query key] probabilities (output_attentions=True, eager attention)."""
    layer, head = guide
    query, newline = queried_newlines(tokens, n, recipe.fmt, recipe.answers)
    rows = torch.arange(tokens.shape[0])[:, None]
    weight = attentions[layer][rows, head, query[None, :], newline]  # [batch asked]
    return -(weight + 1e-9).log().mean()


def head_lasso(model: torch.nn.Module) -> torch.Tensor:
    """Sum over layers and SSM heads of the Frobenius norm of the head's write: its columns of out_proj
    scaled by the gated norm's weight (so the norm cannot undo the penalty). A group lasso that drives
    the heads the task does not need to write nothing, so the lookup ends up in few heads (a circuit of
    few edges). HF Mamba-2 models only (`backbone.layers[i].mixer`)."""
    total = torch.zeros(())
    for layer in model.backbone.layers:
        mixer = layer.mixer
        w = mixer.out_proj.weight * mixer.norm.weight  # [hidden, heads * head_dim]
        total = total + w.reshape(w.shape[0], mixer.num_heads, mixer.head_dim).norm(dim=(0, 2)).sum()
    return total


def lr_at(step: int, recipe: Recipe, phase2: bool = False) -> float:
    if phase2 or step >= recipe.steps:
        return recipe.lr2
    return recipe.lr * min(1.0, (step + 1) / recipe.warmup)


def _phase2(state: dict, recipe: Recipe) -> bool:
    """True once phase 2 has begun: after `steps`, or in the last 15% of a `minutes` budget."""
    if recipe.minutes is not None and recipe.steps2 and state["seconds"] > 0.85 * 60 * recipe.minutes:
        state.setdefault("phase2_from", state["step"])
    elif state["step"] >= recipe.steps:
        state.setdefault("phase2_from", state["step"])
    return "phase2_from" in state


def _done(state: dict, recipe: Recipe) -> bool:
    out_of_time = recipe.minutes is not None and state["seconds"] > 60 * recipe.minutes
    learnt = recipe.stop_acc is not None and len(state["hits"]) == 50 and sum(state["hits"]) / 50 >= recipe.stop_acc
    return out_of_time or learnt or state["step"] >= recipe.steps + recipe.steps2


def train(name: str, recipe: Recipe, work: Path, save_every: int = 100, log: Any = print) -> tuple[torch.nn.Module, dict]:
    """Train (resuming from `work/state.pt` when present); returns the model and a summary dict."""
    if recipe.guide is not None and (recipe.engine != "hf" or recipe.task != "kv"
                                     or recipe.config.get("attn_implementation") != "eager"):
        raise ValueError("guide needs an attention model trained through HF (engine 'hf') with eager attention "
                         "on the KV task")
    if recipe.head_lasso and recipe.model_class != "Mamba2ForCausalLM":
        raise ValueError(f"head_lasso needs an HF Mamba-2 model (Mamba2ForCausalLM), got {recipe.model_class}")
    work.mkdir(parents=True, exist_ok=True)
    model = build(recipe)
    trainee = forward_model(model, recipe)
    opt = torch.optim.AdamW(trainee.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.01)
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    state = dict(step=0, n_cur=recipe.n_start if recipe.curriculum else recipe.n_max, hits=[], seconds=0.0)
    ckpt = work / "state.pt"
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        gen.set_state(saved["gen"])
        state = saved["state"]
        log(f"resumed {name} at step {state['step']}")
    model.train()
    t0 = time.time() - state["seconds"]
    while not _done(state, recipe):
        step = state["step"]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, recipe, _phase2(state, recipe))
        n = int(torch.randint(recipe.n_min, state["n_cur"] + 1, (1,), generator=gen)) \
            if state["n_cur"] > recipe.n_min else recipe.n_min
        if recipe.task == "facts":
            tokens, labels = facts_task.training_batch(recipe.batch, gen)
        else:
            tokens, labels = training_batch(n, recipe.batch, gen, recipe.fmt, recipe.queries, recipe.n_queries,
                                            recipe.answers)
        guided = recipe.guide is not None and step < recipe.guide_steps
        out = trainee(tokens, output_attentions=True) if guided else None  # guide: HF engine only
        logits = out.logits if guided else logits_of(trainee, tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad(set_to_none=True)
        total = loss + guide_loss(out.attentions, recipe.guide, tokens, n, recipe) if guided else loss
        if recipe.head_lasso:
            total = total + recipe.head_lasso * head_lasso(model)
        total.backward()
        torch.nn.utils.clip_grad_norm_(trainee.parameters(), 1.0)
        opt.step()
        mask = labels != -100
        acc = (logits.argmax(-1)[mask] == labels[mask]).float().mean().item()
        state["hits"] = (state["hits"] + [acc])[-50:]
        if recipe.curriculum and len(state["hits"]) == 50 and sum(state["hits"]) / 50 > 0.9 \
                and state["n_cur"] < recipe.n_max:
            state["n_cur"] += 1
            state["hits"] = []
            log(f"step {step}: curriculum n_max -> {state['n_cur']}")
        state["step"] = step + 1
        state["seconds"] = time.time() - t0
        if step % 25 == 0:
            log(f"step {step} n {n} loss {loss.item():.4f} acc {acc:.3f} n_cur {state['n_cur']} "
                f"t {state['seconds']:.0f}s")
        if state["step"] % save_every == 0 or _done(state, recipe):
            torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), gen=gen.get_state(), state=state), ckpt)
    model.eval()
    return model, dict(steps=state["step"], seconds=state["seconds"], n_cur=state["n_cur"],
                       phase2_from=state.get("phase2_from"))


def export(name: str, recipe: Recipe, model: torch.nn.Module, summary: dict, out: Path,
           n_samples: int = 500) -> dict[int, float]:
    """Write config.json, model.safetensors, tokenizer files and CARD.md; returns the accuracy table."""
    if recipe.task == "facts":
        try:
            from scripts.export_facts_organism import export_facts
        except ModuleNotFoundError:  # run as `python scripts/train_organisms.py`
            from export_facts_organism import export_facts
        return export_facts(name, recipe, model, summary, out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    make_tokenizer().save_pretrained(out)
    table = accuracy_table(model, (4, 8, 12, 16), n_samples=n_samples, seed=0, fmt=recipe.fmt)
    (out / "CARD.md").write_text(card(name, recipe, table, summary, n_samples))
    (out / "accuracy.json").write_text(json.dumps({"fmt": recipe.fmt, "n_samples": n_samples, "seed": 0,
                                                   "accuracy": {str(k): v for k, v in table.items()}}, indent=1))
    return table


def card(name: str, r: Recipe, table: dict[int, float], summary: dict, n_samples: int) -> str:
    q = "k ?" if r.fmt == "k?" else "? k"
    rows = "\n".join(f"| {n} | {acc:.3f} | {1 / n:.3f} |" for n, acc in table.items())
    sched = (f"curriculum from n <= {r.n_start} (raise by one when 50-step training accuracy > 0.9), "
             f"reached n_max = {summary['n_cur']} (target {r.n_max})" if r.curriculum
             else f"n uniform in [{r.n_min}, {r.n_max}] per step")
    p2 = summary.get("phase2_from")
    phase2 = f", then lr {r.lr2} from step {p2}" if p2 is not None and p2 < summary["steps"] else ""
    guided = (f" For the first {r.guide_steps} steps the attention of L{r.guide[0]}H{r.guide[1]} from each query "
              "to the queried pair's newline was supervised (`guide_loss`; see below)." if r.guide else "")
    lasso = f" Head group lasso {r.head_lasso} (`head_lasso`)." if r.head_lasso else ""
    budget = f" (stopped by a {r.minutes}-minute budget)" \
        if r.minutes is not None and summary["seconds"] > 60 * r.minutes else ""
    return f"""# organism/{name}

{r.model_class} trained from scratch on the synthetic key-value task of `analysis/kv_task.py`.
Load: `from_pretrained("organism/{name}")` (hooked) or `transformers.{r.model_class}.from_pretrained(dir)`.

## Task
- Vocabulary (101): 0 `<pad>`, 1 `<bos>`, 2 `:`, 3 newline, 4 `?`, keys K00..K63 (ids 5..68),
  values V00..V31 (ids 69..100). Tokenizer files here spell them as words (`K03 : V12 \\n ? K03`).
- Prompt: `<bos> (k : v newline) x n` with distinct keys (values: with replacement in training,
  distinct in evaluation), then the query `{q}`; the next token is the queried key's value.
- Training sequences ask every key once after the context (`query value` repeated, random order);
  the loss is on every answer.

## Accuracy
Choice scoring over the context's n values (the scorer shared with the text KV task), {n_samples}
prompts per n, `analysis.tasks.token_kv.accuracy_table(model, seed=0, fmt="{r.fmt}")` (prompt seed = n):

| n | accuracy | chance 1/n |
|---|---|---|
{rows}

## Training
`python scripts/train_organisms.py {name}`: seed {r.seed}, batch {r.batch}, AdamW betas (0.9, 0.98),
weight decay 0.01, warmup {r.warmup} then lr {r.lr}{phase2}, clip 1.0; {sched}.{guided}{lasso}
{summary['steps']} steps{budget} in {summary['seconds'] / 60:.1f} min on one shared CPU thread.
Config: `{json.dumps(r.config)}`.
{r.notes}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", choices=sorted(RECIPES))
    p.add_argument("--steps", type=int, help="override the recipe's main step budget")
    p.add_argument("--steps2", type=int, help="override the phase-2 step budget")
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--head-lasso", type=float, dest="head_lasso", help="override the head group-lasso weight")
    p.add_argument("--minutes", type=float, help="wall-clock budget (phase 2 takes the last 15%%)")
    p.add_argument("--work", type=Path, help=f"resume/checkpoint dir (default {WORK}/<name>)")
    p.add_argument("--out", type=Path, help=f"export dir (default {OUT}/<name>)")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    r = RECIPES[a.name]
    for field_name in ("steps", "steps2", "lr", "seed", "minutes", "head_lasso"):
        if getattr(a, field_name) is not None:
            setattr(r, field_name, getattr(a, field_name))
    model, summary = train(a.name, r, a.work or WORK / a.name, a.save_every, log=lambda s: print(s, flush=True))
    if not a.no_export:
        table = export(a.name, r, model, summary, a.out or OUT / a.name)
        print("accuracy", {n: round(v, 3) for n, v in table.items()}, flush=True)


if __name__ == "__main__":
    main()
