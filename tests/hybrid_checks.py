"""Checks the hybrid and recurrent families' tests share (Bamba, Granite 4, Falcon-H1, NemotronH, Jamba,
RecurrentGemma, RWKV, Zamba, Qwen4-Exp, xLSTM, MiniMax, LFM2-MoE, Bailing-hybrid).

    perturbed(hf)               every HF parameter + 0.2 N(0, 1) (HF's init hides misplaced weights)
    close                       a == b within tol times max(1, the reference's max magnitude) (float64 checks)
    check_against_hf            logits and every residual within `rel` of the reference's max magnitude;
                                HF's hidden_states are [embedding, outputs of layers 0 .. n-2, final norm]
    left_padded                 left-padded random tokens and their mask
    check_padding               padded run == HF padded run, and each row == that prompt alone (HF and ours)
    check_rows_alone            each left-padded row == that prompt alone (ours) == HF on the prompt alone
                                (for HF models that read no mask or count positions over padding)
    check_decoding              decoding from a DecodeState == the whole sequence == HF's whole forward; a
                                left-padded prompt, then a step == the prompt alone, then that token
    check_save_pretrained       save_pretrained -> from_pretrained == from_hf (config, logits bit for bit)
    check_released_on_meta      a released config on meta: HF's shape for every tensor, every parameter read,
                                HF's parameter count
    check_ssm_invariants        float64, one SSM mixer: chunked y == C.h (scan) == kernel @ u; an edit of h
                                == a brute-force recurrence written here; knockout == zeroing kernel entries
    check_knockout_equals_kernel_zeroing / check_knockout_zeroes_head_entries
                                knockout == zeroing the cut entries of hook_kernel (and attention patterns)
    check_heads_are_map_units   a multi-head mixer's heads are its map units; their writes sum to the mixer's
    check_ablation_zeroes_columns
                                ablate_heads == zeroing those channels' input columns of the output projection
"""

from __future__ import annotations

import copy

import torch
import transformers
from einops import einsum, repeat

from hooked.models.decode_state import DecodeState
from hooked.models.model_map import model_map
from loaders.load import from_hf, from_pretrained, normalise_config
from loaders.meta import on_meta
from loaders.registry import REGISTRY, find_architecture

RTOL = 1e-4


def perturbed(hf, scale: float = 0.2, seed: int = 0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(scale * torch.randn_like(p))
    return hf.eval()


def close(a: torch.Tensor, b: torch.Tensor, what: str = "", tol: float = 1e-12) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=tol * max(1.0, b.abs().max().item()), msg=lambda m: f"{what}: {m}")


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, what: str, rel: float = RTOL) -> None:
    torch.testing.assert_close(ours.double(), ref.double(), rtol=0, atol=rel * ref.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def check_against_hf(hf, model, tokens, attention_mask=None, rel: float = RTOL) -> None:
    """Logits and every residual; with a mask, at the real positions of each row only."""
    with torch.no_grad():
        out = hf(tokens, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        logits, cache = model.run_with_cache(tokens, attention_mask=attention_mask, names_filter=lambda n: (
            n == "hook_embed" or "resid_post" in n or n.startswith("ln_final")))
    n = model.cfg.n_layers
    ours = [cache["hook_embed"]] + [cache[f"blocks.{l}.hook_resid_post"] for l in range(n - 1)]
    ours += [cache["ln_final.hook_normalized"], logits]
    refs = list(out.hidden_states) + [out.logits]
    assert len(refs) == len(ours) == n + 2
    names = ["embed"] + [f"resid_post {l}" for l in range(n - 1)] + ["ln_final", "logits"]
    real = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    for what, a, b in zip(names, ours, refs):
        assert_rel_close(a.float()[real], b.float()[real], what, rel)


def left_padded(lengths: list[int], width: int, vocab: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        tokens[b, : width - n] = 0
    return tokens, mask


def check_padding(hf, model, lengths=(19, 11, 8, 1), rel: float = RTOL) -> None:
    width = max(lengths)
    tokens, mask = left_padded(list(lengths), width, hf.config.vocab_size)
    check_against_hf(hf, model, tokens, mask, rel)
    with torch.no_grad():
        padded = hf(tokens, attention_mask=mask, use_cache=False).logits
        ours = model(tokens, attention_mask=mask)
        for b, n in enumerate(lengths):
            alone = hf(tokens[b:b + 1, width - n:], use_cache=False).logits
            assert_rel_close(padded[b:b + 1, width - n:], alone, f"HF row {b} vs alone", rel)
            assert_rel_close(ours[b:b + 1, width - n:], alone, f"our row {b} vs alone", rel)


def check_rows_alone(hf, model, lengths=(19, 11, 8, 1), rel: float = RTOL, rel_alone: float = RTOL) -> None:
    """Each row of a left-padded batch == that prompt alone through our model (rel_alone) and through HF (rel)."""
    tokens, mask = left_padded(list(lengths), max(lengths), hf.config.vocab_size)
    with torch.no_grad():
        ours = model(tokens, attention_mask=mask)
        for b, n in enumerate(lengths):
            alone = tokens[b:b + 1, tokens.shape[1] - n:]
            assert_rel_close(ours[b:b + 1, -n:], model(alone), f"row {b} vs alone", rel_alone)
            assert_rel_close(ours[b:b + 1, -n:], hf(alone, use_cache=False).logits, f"row {b} vs HF alone", rel)


def check_decoding(hf, model, tokens, steps=None, padded_then_step: bool = True) -> torch.Tensor:
    """Our model fed `tokens` in pieces of `steps` sizes (None: 5, then one at a time) with a DecodeState ==
    the whole sequence (1e-5) == HF's whole forward (1e-4); with padded_then_step, a left-padded batch of
    prompts of 9 and 4 tokens, then one step == the short prompt alone, then that token (1e-5). Returns the
    stepped logits."""
    steps = steps if steps is not None else [5] + [1] * (tokens.shape[1] - 5)
    assert sum(steps) == tokens.shape[1]
    state, outs, at = DecodeState(), [], 0
    with torch.no_grad():
        for n in steps:
            outs.append(model(tokens[:, at:at + n], state=state))
            at += n
        whole, theirs = model(tokens), hf(tokens, use_cache=False).logits
    stepped = torch.cat(outs, 1)
    assert_rel_close(stepped, whole, "stepped vs whole", 1e-5)
    assert_rel_close(stepped, theirs, "stepped vs HF", 1e-4)
    if padded_then_step:
        padded, mask = left_padded([9, 4], 9, hf.config.vocab_size)
        state = DecodeState()
        with torch.no_grad():
            first = model(padded, attention_mask=mask, state=state)
            nxt = model(tokens[:, :1], state=state)
            alone = model(torch.cat([padded[1:, 5:], tokens[1:, :1]], 1))
        assert_rel_close(torch.cat([first[1:, 5:], nxt[1:]], 1), alone, "padded prompt then a step vs alone", 1e-5)
    return stepped


def check_save_pretrained(hf, tokens, path) -> None:
    """hf.save_pretrained(path), then from_pretrained(path) == from_hf(hf): the config, and the logits of a
    batch whose row 1 is left-padded by 4, bit for bit."""
    hf.save_pretrained(path)
    loaded, direct = from_pretrained(path), from_hf(hf)
    assert loaded.cfg == direct.cfg
    mask = torch.ones_like(tokens)
    mask[1, :4] = 0
    with torch.no_grad():
        assert torch.equal(loaded(tokens, attention_mask=mask), direct(tokens, attention_mask=mask))


def check_released_on_meta(fields: dict, name: str, hf_class, *, read: str = "hf", stored_buffers: bool = False):
    """The config.json `fields` of a released checkpoint: found as REGISTRY[name]; HF's model (hf_class) and ours
    built on meta; HF's shape (after the key's transform) for every tensor of ours, every parameter of ours read,
    and HF's parameter count (plus, with stored_buffers, HF's buffers in its state dict: parameters here). `read`:
    our config from HF's config as built ("hf", its defaults filled in) or from the normalised fields ("raw").
    Returns (our config, our model on meta)."""
    raw = normalise_config(dict(fields))
    arch = find_architecture(raw)
    assert arch is REGISTRY[name]
    with torch.device("meta"):
        hf = hf_class(transformers.AutoConfig.for_model(**fields))
    assert read in ("hf", "raw"), read
    cfg = arch.config_from_hf(hf.config.to_dict() if read == "hf" else raw)
    with on_meta():
        model = arch.build(cfg)
    theirs, ours = hf.state_dict(), dict(model.named_parameters())
    mapped = arch.key_map(cfg)
    for param, key in mapped.items():
        source = theirs[next(n for n in key.names if n in theirs)]
        shape = key.transform(source).shape if key.transform is not None else source.shape
        assert tuple(ours[param].shape) == tuple(shape), param
    assert set(mapped) == set(ours)  # every parameter of ours is read
    count = sum(p.numel() for p in hf.parameters())
    if stored_buffers:
        count += sum(b.numel() for n, b in hf.named_buffers() if n in theirs)
    assert sum(p.numel() for p in model.parameters()) == count
    return cfg, model


# ------------------------------------------------------------------------------ SSM invariants
def _per_channel(t: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Mamba-2 B or C [b l g n] -> each head's [b l h n]; Mamba-1 [b l n] unchanged."""
    if A.ndim == 1:
        return repeat(t, "b l g n -> b l (g r) n", r=A.shape[0] // t.shape[2])
    return t


def brute_states(u, dt, B, C, A, edit_at: int | None = None, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y) by the recurrence one position at a time, adding `delta` to h right after position edit_at.

    Mamba-2: u [b l h p], dt [b l h], B, C [b l g n], A [h]; h [b l h p n].
    Mamba-1: u [b l d], dt [b l d], B, C [b l n], A [d n]; h [b l d n].
    """
    Bh, Ch = _per_channel(B, A), _per_channel(C, A)
    hs, ys = [], []
    h = None
    for t in range(u.shape[1]):
        if A.ndim == 1:
            decay = torch.exp(dt[:, t] * A)[..., None, None]
            inp = einsum(dt[:, t, :, None] * u[:, t], Bh[:, t], "b h p, b h n -> b h p n")
        else:
            decay = torch.exp(dt[:, t, :, None] * A)
            inp = (dt[:, t] * u[:, t])[..., None] * Bh[:, t, None, :]
        h = inp if h is None else decay * h + inp
        if t == edit_at:
            h = h + delta
        hs.append(h)
        ys.append(einsum(h, Ch[:, t], "b h p n, b h n -> b h p") if A.ndim == 1 else einsum(h, Ch[:, t], "b d n, b n -> b d"))
    return torch.stack(hs, 1), torch.stack(ys, 1)


def check_ssm_invariants(model, tokens, site: str, tol: float = 1e-10) -> None:
    """float64 model; `site` = "blocks.{l}.mixer"."""
    mixer = model.get_submodule(site)
    A = mixer.A().detach()
    names = [f"{site}.hook_{n}" for n in ("ssm_in", "dt", "B", "C", "h", "kernel", "y")]
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=names)
    u, dt, B, C, h, K, y = (cache[n] for n in names)
    Ch = _per_channel(C, A)
    close = lambda a, b, what: torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=lambda m: f"{what}: {m}")  # noqa: E731
    mamba2 = A.ndim == 1
    y_scan = einsum(h, Ch, "b l h p n, b l h n -> b l h p") if mamba2 else einsum(h, Ch, "b l d n, b l n -> b l d")
    y_kernel = einsum(K, u, "b h j i, b i h p -> b j h p") if mamba2 else einsum(K, u, "b d j i, b i d -> b j d")
    h_ref, y_ref = brute_states(u, dt, B, C, A)
    close(y_scan, y, "C.h (scan) vs chunked y")
    close(y_kernel, y, "kernel @ u vs chunked y")
    close(h, h_ref, "hook_h vs brute-force recurrence")
    close(y, y_ref, "y vs brute-force recurrence")

    # an edit of h at position t continues the recurrence from the edited state
    t = tokens.shape[1] // 2
    delta = torch.randn(h[:, t].shape, generator=torch.Generator().manual_seed(5), dtype=h.dtype)

    def edit(hh, hook):
        hh = hh.clone()
        hh[:, t] += delta
        return hh

    with torch.no_grad():
        with model.hooks(fwd_hooks=[(f"{site}.hook_h", edit)]):
            _, edited = model.run_with_cache(tokens, names_filter=[f"{site}.hook_y", f"{site}.hook_h"])
    h_ed, y_ed = brute_states(u, dt, B, C, A, edit_at=t, delta=delta)
    # the cache holds what the hook returned (the edit at t); the later states live in y
    close(edited[f"{site}.hook_h"][:, : t + 1], h_ed[:, : t + 1], "edited state vs brute force")
    close(edited[f"{site}.hook_y"], y_ed, "y after the edit vs brute force")
    assert not torch.allclose(y_ed[:, t + 1:], y[:, t + 1:]), "the edit must change later outputs"


def check_knockout_equals_kernel_zeroing(model, tokens, layer: int, sources, targets, knockout, tol: float = 1e-10):
    """knockout(sources -> targets) at SSM layer `layer` == zeroing those entries of its hook_kernel
    (and, where the layer also has attention, Falcon-H1's own or Zamba's shared block, of its pattern:
    attention="pattern")."""
    site = f"blocks.{layer}.mixer"
    hooks = [(f"{site}.hook_kernel", None)]
    for attn in ("attn", "shared.attn"):
        if f"blocks.{layer}.{attn}.hook_pattern" in model.hook_dict:
            hooks.append((f"blocks.{layer}.{attn}.hook_pattern", None))

    def zero(K, hook):
        K = K.clone()
        for j in targets:
            for i in sources:
                if i <= j % K.shape[-1]:
                    K[..., j, i] = 0
        return K

    with torch.no_grad():
        plain = model(tokens)
        with knockout(model, sources=list(sources), targets=list(targets), layers=[layer], attention="pattern"):
            cut = model(tokens)
        ref = model.run_with_hooks(tokens, fwd_hooks=[(name, zero) for name, _ in hooks])
    torch.testing.assert_close(cut, ref, rtol=0, atol=tol)
    assert not torch.allclose(cut, plain), "the cut must change the logits"


def check_knockout_zeroes_head_entries(model, tokens, layers, sources, targets, channels, n_heads: int, knockout,
                                       rel: float = 1e-12) -> None:
    """A multi-head mixer's knockout(sources -> targets) at `layers` on the heads `channels` (None: all) ==
    zeroing those entries (i <= j) of each layer's dense hook_kernel [batch head pos pos] on those heads, within
    `rel` of the logits' max magnitude; the cut changes the logits by more than 1e-6."""
    pos = tokens.shape[1]
    heads = torch.zeros(n_heads, dtype=torch.bool)
    heads[channels if channels is not None else slice(None)] = True
    cut = torch.zeros(pos, pos, dtype=torch.bool)
    cut[torch.tensor(targets)[:, None], torch.tensor(sources)] = True

    def zero_entries(kernel, hook):
        return kernel.masked_fill(heads[:, None, None] & cut & torch.ones(pos, pos, dtype=torch.bool).tril(), 0.0)

    with torch.no_grad():
        plain = model(tokens)
        with knockout(model, sources=sources, targets=targets, layers=layers, channels=channels):
            got = model(tokens)
        want = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{l}.mixer.hook_kernel", zero_entries) for l in layers])
    assert_rel_close(got, want, "knockout vs zeroed kernel entries", rel)
    assert (got - plain).abs().max() > 1e-6


def check_heads_are_map_units(model, n_heads: int, tokens, scale: float = 1.0) -> None:
    """Layer 0's mixer in the model map: one unit per head labelled L0H{h}, recurrent; the units' writes ==
    hook_head_out, and their sum times `scale` (a family's stream weight on the mixer) == hook_mixer_out."""
    mixer = {s.path: s for s in model_map(model)}["blocks.0.mixer"]
    assert mixer.labels() == [f"L0H{h}" for h in range(n_heads)] and mixer.recurrent  # a block's own heads: "H"
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0."), incl_lazy=True)
    writes = mixer.writes_from(cache.cache_dict)
    torch.testing.assert_close(writes, cache["blocks.0.mixer.hook_head_out"], rtol=0, atol=1e-12)
    torch.testing.assert_close(writes.sum(-2) * scale, cache["blocks.0.hook_mixer_out"], rtol=0, atol=1e-12)


def check_ablation_zeroes_columns(model, tokens, units, weight: str, columns, ablate_heads, keep: bool = False,
                                  rel: float = 1e-12) -> None:
    """ablate_heads(units) (keep: every unit but them) == zeroing the input columns `columns` (keep: all others)
    of the parameter `weight` (the mixer's output projection), on a copy of the model, within `rel`."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        with ablate_heads(model, units, keep=keep):
            ablated = model(tokens)
        W = model.get_parameter(weight)
        for c in range(W.shape[1]):
            if (c in columns) != keep:
                W[:, c] = 0
        zeroed = model(tokens)
    assert_rel_close(ablated, zeroed, "ablated vs zeroed columns", rel)
