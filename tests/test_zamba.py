"""Zamba (v1: grouped Mamba-1 layers, one shared attention + MLP block read by the hybrid layers): parity with HF
transformers 5.24 and the grouped Mamba-1 mixer's invariants (issue 41).

Parity, per variant (GQA with two groups; four groups with in/out_proj biases, no conv bias, silu MLP, an untied
head and a hybrid first layer): float32 logits, the embedding and every resid_post within 1e-4 of HF's max
magnitude (the loop and the chunked scan); float64 within 1e-10 of HF's float64 model with its float32 casts
made float64 (the RMSNorms, the mixer's A, D, dt bias, and the slow scan's B, u; SDPA attention, whose math
kernel keeps float64); each left-padded row == that
prompt alone == HF on the prompt alone; decoding step by step from a DecodeState == the whole sequence == HF;
save_pretrained -> from_pretrained bit for bit; Zamba-7B-v1 (HF's defaults) on meta with HF's shape for every
tensor and its parameter count; configs HF rejects (n_mamba_heads not dividing the channels) or cannot run
(attention_hidden_size != 2 hidden_size) or we do not implement (hidden_mamba_act) refused by name.

The grouped mixer (float64): the per-group ops == an oracle written here with each channel reading its group's
B and C (scan, chunked scan from a state, kernel, rows, columns, pairs); in the model y == K . u and hook_h ==
the brute-force recurrence (1e-12); a state edit == that recurrence continued from the edited state (1e-12);
knockout == zeroing the cut entries of hook_kernel; ablating a channel == zeroing its out_proj column.
The every-family tests (tiny_families.py) add state edits, decode-step knockout, the model map, attribution
and circuits.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import types

import pytest
import torch
import transformers
from einops import einsum
from hybrid_checks import (check_ablation_zeroes_columns, check_against_hf, check_decoding,
                           check_knockout_equals_kernel_zeroing, check_released_on_meta, check_rows_alone,
                           check_save_pretrained, close, left_padded, perturbed)
from transformers.models.zamba import modeling_zamba

from analysis.interventions import ablate_heads, knockout
from hooked import backends
from hooked.ops.grouped_selective import (grouped_kernel, grouped_kernel_cols, grouped_kernel_pairs,
                                          grouped_kernel_rows, grouped_scan, grouped_scan_chunked)
from loaders.load import from_hf
from loaders.registry import REGISTRY

V = 64
M, H = "mamba", "hybrid"
BASE = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4, layers_block_type=[M, H, M, H], n_mamba_heads=2, mamba_d_state=4, mamba_dt_rank=3)
VARIANTS = {
    "gqa_groups2": {},
    "groups4_bias_untied": dict(n_mamba_heads=4, mamba_proj_bias=True, mamba_conv_bias=False, hidden_act="silu",
                                tie_word_embeddings=False, num_key_value_heads=4, num_hidden_layers=3,
                                layers_block_type=[H, M, H], mamba_d_conv=3, mamba_expand=3),
}
RELEASED = {"7b_v1": dict(model_type="zamba", architectures=["ZambaForCausalLM"])}  # HF's defaults: Zamba-7B-v1


def make_hf(variant: str = "gqa_groups2", dtype: torch.dtype = torch.float32, attn: str = "eager"):
    config = transformers.ZambaConfig(**{**BASE, **VARIANTS[variant]})
    config._attn_implementation = attn
    torch.manual_seed(0)
    return perturbed(transformers.ZambaForCausalLM(config), scale=0.2).to(dtype)


@functools.cache
def model64(variant: str = "gqa_groups2"):
    return from_hf(make_hf(variant, torch.float64))


def tokens(batch: int = 2, pos: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, pos), generator=torch.Generator().manual_seed(seed))



# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_logits_and_every_resid_equal_hf(variant):
    hf = make_hf(variant)
    model = from_hf(hf)
    assert model.cfg.n_groups == hf.config.n_mamba_heads
    check_against_hf(hf, model, tokens())
    with backends.use(scan="chunked"):  # the two-level scan: the same numbers to float32's
        check_against_hf(hf, model, tokens(pos=29))


def _in_float64(fn, **names):
    """HF's function `fn` from its own source with its float32 casts made float64; `names` replace globals."""
    source = textwrap.dedent(inspect.getsource(fn))
    source = source[source.index("def "):]  # its decorators left out
    replaced = source.replace(".float()", ".double()").replace("torch.float32", "torch.float64")
    assert replaced != source, f"{fn.__qualname__}: no float32 cast found; HF's source changed"
    namespace = dict(vars(modeling_zamba)) | names
    exec(compile(replaced, f"<{fn.__qualname__}, float64>", "exec"), namespace)
    return namespace[fn.__name__]


def hf_in_float64(hf):
    """`hf` (float64) with its float32 parts computing in float64: the RMSNorms, and the Mamba mixer's casts of
    A_log, dt_proj_bias, D and of the slow scan's B and u (`.float()`)."""
    scan = _in_float64(modeling_zamba.mamba_selective_scan)
    for module in hf.modules():
        if isinstance(module, modeling_zamba.ZambaRMSNorm):
            module.forward = types.MethodType(_in_float64(type(module).forward), module)
        if isinstance(module, modeling_zamba.ZambaMambaMixer):
            forward = _in_float64(type(module).forward, mamba_selective_scan=scan)
            module.forward = types.MethodType(forward, module)
    return hf


def test_float64_equals_hf_with_its_float32_casts_made_float64():
    hf = hf_in_float64(make_hf("gqa_groups2", torch.float64, attn="sdpa"))  # eager's softmax is float32
    model = from_hf(hf)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    check_against_hf(hf, model, tokens(pos=17), rel=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_rows_equal_each_prompt_alone_and_hf_alone(variant):
    hf = make_hf(variant)
    check_rows_alone(hf, from_hf(hf))


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_from_the_state_equals_recompute_and_hf(variant):
    """Prefill 5 tokens, then one at a time: the conv window, h per group and the shared block's keys carried."""
    hf = make_hf(variant)
    model, toks = from_hf(hf), tokens(pos=12)
    check_decoding(hf, model, toks, padded_then_step=False)
    with torch.no_grad():
        hf_steps = hf.generate(toks[:, :5], max_new_tokens=4, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        ours_greedy = model(hf_steps.sequences)
    for k, logits in enumerate(hf_steps.logits):  # HF's own cached decoding agrees with our whole sequence
        close(logits, ours_greedy[:, 4 + k], f"HF cached step {k} vs ours", 1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_loads_like_the_model_in_memory(variant, tmp_path):
    check_save_pretrained(make_hf(variant), tokens(), tmp_path)


@pytest.mark.parametrize("size", RELEASED)
def test_released_config_builds_hf_shapes_on_meta(size):
    cfg, _ = check_released_on_meta(RELEASED[size], "zamba", transformers.ZambaForCausalLM)  # the shared block
    assert cfg.layer_types.count("hybrid") == 13 and cfg.n_groups == 2  # counted once


def test_configs_hf_rejects_or_cannot_run_are_refused_by_name():
    arch = REGISTRY["zamba"]
    with pytest.raises(Exception, match="n_mamba_heads"):  # HF's own refusal
        transformers.ZambaConfig(**dict(BASE, n_mamba_heads=5))
    with pytest.raises(ValueError, match="n_groups .* must divide d_inner"):
        arch.config_from_hf(dict(BASE, n_mamba_heads=5))
    with pytest.raises(ValueError, match="attention_hidden_size"):  # HF builds it, its forward fails
        arch.config_from_hf(dict(BASE, attention_hidden_size=48))
    with pytest.raises(ValueError, match="hidden_mamba_act"):
        arch.config_from_hf(dict(BASE, hidden_mamba_act="gelu"))
    with pytest.raises(ValueError, match="multiple of n_attn_kv_heads"):
        arch.config_from_hf(dict(BASE, num_key_value_heads=3))
    with pytest.raises(ValueError, match="layer types"):
        arch.config_from_hf(dict(BASE, layers_block_type=[M, H, "attention", M]))


# ------------------------------------------------------------------------------------------- ops
def per_channel(t: torch.Tensor, d_inner: int) -> torch.Tensor:
    """B or C [b l G n] -> each channel's [b l d n] (channel d reads group d // (d_inner / G))."""
    return t.repeat_interleave(d_inner // t.shape[2], dim=2)


def oracle(u, dt, A, B, C, h0=None, edit_at=None, delta=None):
    """(h, y) by the recurrence one position at a time, each channel with its group's B and C; `delta` added to
    the state right after position edit_at."""
    Bd, Cd = per_channel(B, u.shape[2]), per_channel(C, u.shape[2])
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1], dtype=u.dtype) if h0 is None else h0
    hs, ys = [], []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * Bd[:, t]
        if t == edit_at:
            h = h + delta
        hs.append(h)
        ys.append((h * Cd[:, t]).sum(-1))
    return torch.stack(hs, 1), torch.stack(ys, 1)


def _ops_inputs(groups=3, d_inner=6, d_state=4, pos=23, batch=2):
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u = torch.randn(batch, pos, d_inner, generator=g, dtype=torch.float64)
    dt = rand(batch, pos, d_inner) * 0.5
    A = -rand(d_inner, d_state) - 0.1
    B, C = (torch.randn(batch, pos, groups, d_state, generator=g, dtype=torch.float64) for _ in range(2))
    return u, dt, A, B, C


def test_grouped_ops_agree_with_the_per_channel_oracle():
    u, dt, A, B, C = _ops_inputs()
    h, y = oracle(u, dt, A, B, C)
    h0 = torch.randn(h[:, 0].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    close(grouped_scan(u, dt, A, B, C)[0], y, "scan")
    close(grouped_scan(u, dt, A, B, C)[1], h[:, -1], "scan's last state")
    close(grouped_scan_chunked(u, dt, A, B, C, h0)[0], oracle(u, dt, A, B, C, h0)[1], "chunked scan from h0")
    K = grouped_kernel(dt, A, B, C)
    Bd, Cd = per_channel(B, 6), per_channel(C, 6)
    brute = torch.zeros_like(K)
    for j in range(K.shape[-1]):
        for i in range(j + 1):
            decay = torch.exp(A * dt[:, i + 1:j + 1, :, None].sum(1))  # [b d n]
            brute[:, :, j, i] = (Cd[:, j] * decay * dt[:, i, :, None] * Bd[:, i]).sum(-1)
    close(K, brute, "kernel vs brute-force products")
    close(einsum(K, u, "b d j i, b i d -> b j d"), y, "K . u vs the recurrence")
    idx = torch.tensor([22, 0, 9, 9, 4])
    close(grouped_kernel_rows(dt, A, B, C, idx, chunk_size=4), K[:, :, idx], "rows")
    close(grouped_kernel_cols(dt, A, B, C, idx, chunk_size=4), K[..., idx], "cols")
    row, j, i = torch.tensor([0, 1, 1, 0]), torch.tensor([22, 9, 3, 5]), torch.tensor([0, 9, 3, 7])
    close(grouped_kernel_pairs(dt, A, B, C, row, j, i), K[row, :, j, i], "pairs")


# ----------------------------------------------------------------------------------------- mixer
SITE = "blocks.3.mixer"


def test_model_y_is_K_u_and_h_the_brute_force_recurrence():
    model = model64()
    names = [f"{SITE}.hook_{n}" for n in ("ssm_in", "dt", "B", "C", "h", "kernel", "y")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(), names_filter=names)
    u, dt, B, C, h, K, y = (cache[n] for n in names)
    assert B.shape == (2, 13, 2, 4)
    h_ref, y_ref = oracle(u, dt, model.get_submodule(SITE).A().detach(), B, C)
    close(h, h_ref, "hook_h vs brute force")
    close(y, y_ref, "y vs brute force")
    close(einsum(K, u, "b d j i, b i d -> b j d"), y, "K . u vs y")


def test_state_edit_equals_the_recurrence_from_the_edited_state():
    model, toks, t = model64(), tokens(), 6
    names = [f"{SITE}.hook_{n}" for n in ("ssm_in", "dt", "B", "C", "y")]
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=names)
    u, dt, B, C, y = (cache[n] for n in names)
    A = model.get_submodule(SITE).A().detach()
    delta = torch.randn(2, 32, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def edit(h, hook):
        h = h.clone()
        h[:, t] += delta
        return h

    with torch.no_grad():
        with model.hooks(fwd_hooks=[(f"{SITE}.hook_h", edit)]):
            _, edited = model.run_with_cache(toks, names_filter=[f"{SITE}.hook_y"])
    h_ref, y_ref = oracle(u, dt, A, B, C, edit_at=t, delta=delta)
    close(edited[f"{SITE}.hook_y"], y_ref, "y after the edit vs the recurrence from the edited state")
    assert not torch.allclose(y_ref[:, t + 1:], y[:, t + 1:]), "the edit must change later outputs"


@pytest.mark.parametrize("layer", [0, 3])
def test_knockout_equals_zeroing_the_kernel_entries(layer):
    """Layer 0: the mixer alone; layer 3 (hybrid): the shared attention's pattern (attention="pattern") too."""
    model = model64()
    assert ("blocks.3.shared.attn.hook_pattern" in model.hook_dict) and "blocks.0.shared.attn.hook_pattern" not in (
        model.hook_dict)
    check_knockout_equals_kernel_zeroing(model, tokens(), layer, [1, 4, 7], [9, 12], knockout)


def test_ablating_a_channel_equals_zeroing_its_out_proj_column():
    check_ablation_zeroes_columns(model64(), tokens(), [(2, 5), (2, 20)], "blocks.2.mixer.out_proj.weight", [5, 20],
                                  ablate_heads)  # one channel of each group


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_gpu_float32(variant):
    hf = make_hf(variant).cuda()
    model = from_hf(hf)
    assert next(model.parameters()).is_cuda
    check_against_hf(hf, model, tokens().cuda())
    toks, mask = left_padded([13, 6], 13, V)
    check_against_hf(hf, model, toks.cuda(), mask.cuda())
