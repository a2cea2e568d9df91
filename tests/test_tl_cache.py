"""A TransformerLens user's cache and tokenizer code gives TL's numbers (tokenizer helpers and the
ActivationCache methods), TL 3.9's HookedTransformer on the same weights being the oracle.

Comparisons with apply_ln use weights whose norms have weight 1 (bias 0): TL's apply_ln_to_stack
never applies a norm weight (its defaults fold it into the next matrix), ours does (exact on
unprocessed weights); on such weights both are the same map.
"""

from __future__ import annotations

import pytest
import torch

from tests.tl_oracle import pair

ARCHS = ["gpt2", "llama_gqa"]
REL = 1e-4
_PAIRS: dict = {}


def get_pair(arch: str, unit_norms: bool = True):
    if (arch, unit_norms) not in _PAIRS:
        _PAIRS[arch, unit_norms] = pair(arch, unit_norms=unit_norms)
    return _PAIRS[arch, unit_norms]


def close(ours, theirs, what: str, rel: float = REL) -> None:
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} vs TL {tuple(theirs.shape)}"
    scale = theirs.abs().max().clamp_min(1e-30)
    err = ((ours - theirs).abs().max() / scale).item()
    assert err <= rel, f"{what}: relative error {err:.2e} > {rel}"


def tokens(batch: int = 2, pos: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 48, (batch, pos), generator=torch.Generator().manual_seed(seed))


def caches(arch: str, toks: torch.Tensor, remove_batch_dim: bool = False):
    ours, theirs, _, _ = get_pair(arch)
    with torch.no_grad():
        _, c_ours = ours.run_with_cache(toks, remove_batch_dim=remove_batch_dim)
        _, c_tl = theirs.run_with_cache(toks, remove_batch_dim=remove_batch_dim)
    return ours, theirs, c_ours, c_tl


# ------------------------------------------------------------------------- tokenizer helpers
def test_defect1_to_str_tokens_of_a_list_gives_one_list_per_prompt() -> None:
    ours, theirs, _, _ = get_pair("gpt2")
    prompts = ["w1 w2 w3", "w4"]
    assert ours.to_str_tokens(prompts) == [["w1", "w2", "w3"], ["w4"]] == theirs.to_str_tokens(prompts)


def test_defect2_to_str_tokens_of_a_batch_gives_one_row_per_prompt() -> None:
    ours, _, _, _ = get_pair("gpt2")
    rows = ours.to_str_tokens(ours.to_tokens(["w1 w2 w3", "w4"]))
    assert rows == [["w1", "w2", "w3"], ["w4", "<pad>", "<pad>"]]  # right padding lines up with positions
    assert ours.to_str_tokens(ours.to_tokens("w5 w6")) == ["w5", "w6"]  # one row: a flat list, as TL


@pytest.mark.parametrize("arch", ARCHS)
def test_defect6_to_tokens_of_a_ragged_batch_gives_exact_logits_without_a_mask(arch) -> None:
    ours, theirs, _, _ = get_pair(arch, unit_norms=False)
    long, short = "w1 w2 w3 w4 w5 w6", "w7 w8"
    with torch.no_grad():
        batch = ours(ours.to_tokens([long, short]))
        alone = ours(ours.to_tokens(short))
        tl_batch = theirs(theirs.to_tokens([long, short]))
    close(batch[1, :2], alone[0], "short prompt in a batch vs alone", rel=1e-5)
    close(batch, tl_batch, "batch logits vs TL", rel=1e-5)


# ------------------------------------------------------------------------------ backward hooks
def test_defect7_backward_hooks_of_run_with_hooks_stop_when_it_returns() -> None:
    ours, _, _, _ = get_pair("gpt2", unit_norms=False)
    fired: list[str] = []
    hook = [("blocks.1.hook_resid_pre", lambda g, h: fired.append(h.name))]
    loss = ours.run_with_hooks(tokens(), bwd_hooks=hook, return_type="loss")
    loss.backward()
    assert fired == []  # removed on return, as TL (which warns that they cannot fire)
    loss = ours.run_with_hooks(tokens(), bwd_hooks=hook, return_type="loss", reset_hooks_end=False)
    loss.backward()
    assert fired == ["blocks.1.hook_resid_pre"]
    ours.reset_hooks()
    ours(tokens(), return_type="loss").backward()
    assert fired == ["blocks.1.hook_resid_pre"]
    ours.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------- residual stacks
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layer", [None, -1, 0, 2, 3])
@pytest.mark.parametrize("apply_ln", [False, True])
@pytest.mark.parametrize("mlp_input", [False, True])
def test_defects4_5_accumulated_and_decomposed_resid_are_tls(arch, layer, apply_ln, mlp_input) -> None:
    if mlp_input and layer in (None, -1, 3):
        pytest.skip("mlp_input at the final residual has no MLP")
    ours, theirs, c_ours, c_tl = caches(arch, tokens())
    for method, kwargs in [("accumulated_resid", dict(incl_mid=True)), ("accumulated_resid", {}),
                           ("decompose_resid", {}), ("decompose_resid", dict(mode="attn")),
                           ("decompose_resid", dict(mode="mlp", incl_embeds=False))]:
        a, la = getattr(c_ours, method)(layer, apply_ln=apply_ln, mlp_input=mlp_input, return_labels=True, **kwargs)
        try:
            b, lb = getattr(c_tl, method)(layer, apply_ln=apply_ln, mlp_input=mlp_input, return_labels=True, **kwargs)
        except RuntimeError:  # TL cannot stack zero components; ours returns an empty stack
            assert a.shape[0] == 0 and la == []
            continue
        assert la == lb, f"{method}{kwargs}: labels {la} vs TL {lb}"
        close(a, b, f"{method}(layer={layer}, apply_ln={apply_ln}, {kwargs})")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("remove_batch_dim", [False, True])
@pytest.mark.parametrize("pos_slice", [None, -1, (1, 5), [0, 3]])
def test_defect3_head_results_and_stacks_are_tls(arch, remove_batch_dim, pos_slice) -> None:
    toks = tokens(1 if remove_batch_dim else 2)
    ours, theirs, c_ours, c_tl = caches(arch, toks, remove_batch_dim)
    assert "blocks.0.attn.hook_result" not in c_ours  # bare cache: computed from hook_z
    for layer in (-1, 2):
        for apply_ln in (False, True):
            a, la = c_ours.stack_head_results(layer, return_labels=True, incl_remainder=True,
                                              pos_slice=pos_slice, apply_ln=apply_ln)
            b, lb = c_tl.stack_head_results(layer, return_labels=True, incl_remainder=True,
                                            pos_slice=pos_slice, apply_ln=apply_ln)
            assert la == lb
            close(a, b, f"stack_head_results({layer}, apply_ln={apply_ln})")
        a, la = c_ours.stack_neuron_results(layer, pos_slice=pos_slice, return_labels=True, incl_remainder=True)
        b, lb = c_tl.stack_neuron_results(layer, pos_slice=pos_slice, return_labels=True, incl_remainder=True)
        assert la == lb
        close(a, b, f"stack_neuron_results({layer})")
    for layer in (None, 1):
        for expand in (True, False):
            a, la = c_ours.get_full_resid_decomposition(layer, expand_neurons=expand, pos_slice=pos_slice,
                                                        return_labels=True, apply_ln=True)
            b, lb = c_tl.get_full_resid_decomposition(layer, expand_neurons=expand, pos_slice=pos_slice,
                                                      return_labels=True, apply_ln=True)
            assert la == lb
            close(a, b, f"get_full_resid_decomposition({layer}, expand_neurons={expand})")


@pytest.mark.parametrize("arch", ARCHS)
def test_full_decomposition_sums_to_the_residual_and_logit_attrs_are_tls(arch) -> None:
    ours, theirs, c_ours, c_tl = caches(arch, tokens())
    full = c_ours.get_full_resid_decomposition()
    close(full.sum(0), c_ours["resid_post", -1], "sum of the full decomposition", rel=1e-5)
    answer, wrong = tokens(2, 1, seed=3)[:, 0], tokens(2, 1, seed=4)[:, 0]
    stack = c_ours.decompose_resid(pos_slice=-1)
    a = c_ours.logit_attrs(stack, answer, wrong, pos_slice=-1)
    b = c_tl.logit_attrs(c_tl.decompose_resid(pos_slice=-1), answer, wrong, pos_slice=-1)
    close(a, b, "logit_attrs")
    for layer, mlp_input in [(None, False), (1, True), (2, False)]:
        stack = c_ours.accumulated_resid(2)
        close(c_ours.apply_ln_to_stack(stack, layer, mlp_input=mlp_input),
              c_tl.apply_ln_to_stack(c_tl.accumulated_resid(2), layer, mlp_input=mlp_input), "apply_ln_to_stack")


@pytest.mark.parametrize("arch", ARCHS)
def test_stack_activation_and_batch_slices_are_tls(arch) -> None:
    ours, theirs, c_ours, c_tl = caches(arch, tokens(3))
    for args in [("pattern",), ("resid_post", 2), ("normalized", -1, "ln1")]:  # normalized: unit norms here
        close(c_ours.stack_activation(*args), c_tl.stack_activation(*args), f"stack_activation{args}")
    for batch_slice in (1, (0, 2), [0, 2]):
        a, b = c_ours.apply_slice_to_batch_dim(batch_slice), c_tl.apply_slice_to_batch_dim(batch_slice)
        close(a["resid_pre", 1], b["resid_pre", 1], f"apply_slice_to_batch_dim({batch_slice})")
        close(a.accumulated_resid(apply_ln=True), b.accumulated_resid(apply_ln=True), "accumulated_resid after slicing")


def test_apply_ln_on_unprocessed_weights_applies_the_norm_weight() -> None:
    """Exactness where TL's convention departs: the ln_final of the full residual equals the sum of
    the decomposition after apply_ln (plus the norm's bias)."""
    ours, _, _, _ = get_pair("gpt2", unit_norms=False)
    with torch.no_grad():
        _, cache = ours.run_with_cache(tokens())
    parts = cache.decompose_resid(apply_ln=True)
    close(parts.sum(0) + ours.ln_final.bias, cache["ln_final.hook_normalized"], "apply_ln sum", rel=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_methods_on_processed_weights_equal_tls_defaults(arch) -> None:
    """TL's from_pretrained defaults (fold_ln, centring, value biases) on both sides, norms not unit."""
    from loaders.load import from_hf
    from tests.tl_oracle import tl_model

    _, _, tok, hf = get_pair(arch, unit_norms=False)
    processing = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
    ours, theirs = from_hf(hf, **processing), tl_model(arch, hf, tok, **processing)
    toks = tokens()
    with torch.no_grad():
        _, c_ours = ours.run_with_cache(toks)
        _, c_tl = theirs.run_with_cache(toks)
    for layer in (None, 1):
        close(c_ours.accumulated_resid(layer, apply_ln=True, pos_slice=-1),
              c_tl.accumulated_resid(layer, apply_ln=True, pos_slice=-1), f"accumulated_resid({layer})")
        close(c_ours.decompose_resid(layer, apply_ln=True), c_tl.decompose_resid(layer, apply_ln=True),
              f"decompose_resid({layer})")
        close(c_ours.stack_head_results(layer if layer else -1, apply_ln=True),
              c_tl.stack_head_results(layer if layer else -1, apply_ln=True), f"stack_head_results({layer})")
        close(c_ours.get_full_resid_decomposition(layer, apply_ln=True),
              c_tl.get_full_resid_decomposition(layer, apply_ln=True), f"get_full_resid_decomposition({layer})")
    answer, wrong = tokens(2, 1, seed=3)[:, 0], tokens(2, 1, seed=4)[:, 0]
    close(c_ours.logit_attrs(c_ours.stack_head_results(pos_slice=-1), answer, wrong, pos_slice=-1),
          c_tl.logit_attrs(c_tl.stack_head_results(pos_slice=-1), answer, wrong, pos_slice=-1), "logit_attrs")
