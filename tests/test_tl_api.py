"""TL's everyday model API on ours, against TL 3.9 on the same weights: cfg fields, utils.get_act_name,
tokens helpers, run_with_cache(incl_bwd=, pos_slice=, return_type=), permanent hooks, hook.layer/ctx."""

from __future__ import annotations

import pytest
import torch

from hooked import utils
from tests.tl_oracle import pair

ARCHS = ["gpt2", "llama_gqa"]
_PAIRS: dict = {}


def get(arch: str):
    if arch not in _PAIRS:
        _PAIRS[arch] = pair(arch)
    return _PAIRS[arch]


def tokens(batch: int = 2, pos: int = 8) -> torch.Tensor:
    return torch.randint(4, 48, (batch, pos), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("args", [("pattern", 3), ("resid_pre", 0), ("scale", 2, "ln1"), ("scale",), ("pattern3",),
                                  ("attn", 1), ("embed",), ("mlp_out", 1), ("normalized", 2, "ln2"), ("q", 0),
                                  ("rot_k", 1), ("post", 2), ("pre_linear", 0), ("attn_logits", 2), ("z2",),
                                  ("blocks.0.hook_resid_pre",), ("attn_out", 1, "a")])
def test_get_act_name_equals_tls(args) -> None:
    from transformer_lens import utils as tl_utils

    assert utils.get_act_name(*args) == tl_utils.get_act_name(*args)


def test_get_act_name_names_ssm_hooks() -> None:
    assert utils.get_act_name("kernel", 4) == "blocks.4.mixer.hook_kernel"
    assert utils.get_act_name("h", 0) == "blocks.0.mixer.hook_h"
    assert utils.get_act_name("resid_mid2") == "blocks.2.hook_resid_mid"  # TL gives "hook_resid_mid2"


@pytest.mark.parametrize("arch", ARCHS)
def test_cfg_has_tls_fields(arch) -> None:
    ours, theirs, _, _ = get(arch)
    for field in ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx", "device", "dtype",
                  "normalization_type", "positional_embedding_type", "default_prepend_bos", "n_key_value_heads",
                  "d_vocab_out"):
        theirs_value = getattr(theirs.cfg, field)
        if field == "device":  # TL keeps a str, we the torch.device
            theirs_value = torch.device(theirs_value)
        assert getattr(ours.cfg, field) == theirs_value, field


@pytest.mark.parametrize("arch", ARCHS)
def test_token_helpers_equal_tls(arch) -> None:
    ours, theirs, _, _ = get(arch)
    assert ours.to_single_token("w7") == theirs.to_single_token("w7")
    text = "w3 w4 w5 w4 w9"
    for mode in ("first", "last"):
        assert ours.get_token_position("w4", text, mode=mode) == theirs.get_token_position("w4", text, mode=mode)
    with pytest.raises(ValueError, match="not one"):
        ours.to_single_token("w1 w2")
    assert torch.equal(ours.to_tokens(["w1 w2 w3", "w4"]), theirs.to_tokens(["w1 w2 w3", "w4"]))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pos_slice", [-1, (1, 4), [0, 5]])
def test_run_with_cache_pos_slice_and_gradients_equal_tls(arch, pos_slice) -> None:
    ours, theirs, _, _ = get(arch)
    toks = tokens()
    with torch.no_grad():
        _, a = ours.run_with_cache(toks, pos_slice=pos_slice)
        # TL slices the head axis of hook_rot_q / hook_rot_k (its pos-axis rule lists q, k, v, z, result only)
        _, b = theirs.run_with_cache(toks, pos_slice=pos_slice, names_filter=lambda n: "hook_rot_" not in n)
    common = [k for k in a.keys() if k in b.cache_dict and not k.endswith("hook_normalized")]  # TL: before the weight
    assert len(common) > 10
    for k in common:
        theirs_k = b[k]
        if k.endswith("hook_attn_scores"):  # masked scores: TL -inf, ours finfo.min (DESIGN.md, attention)
            theirs_k = theirs_k.masked_fill(theirs_k == float("-inf"), torch.finfo(theirs_k.dtype).min)
        torch.testing.assert_close(a[k], theirs_k, rtol=1e-4, atol=1e-5, msg=k)
    loss_a, ga = ours.run_with_cache(toks, return_type="loss", incl_bwd=True, names_filter=lambda n: "resid" in n)
    loss_b, gb = theirs.run_with_cache(toks, return_type="loss", incl_bwd=True, names_filter=lambda n: "resid" in n)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    grads = [k for k in ga.keys() if k.endswith("_grad")]
    assert grads and all(k in gb.cache_dict for k in grads)
    for k in grads:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-4, atol=1e-7, msg=k)
    ours.zero_grad(set_to_none=True)


def test_permanent_hooks_layer_and_ctx() -> None:
    ours, _, _, _ = get("gpt2")
    seen: list[int] = []

    def count(x, hook):
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1
        seen.append(hook.layer())

    ours.add_hook("blocks.1.hook_resid_post", count, is_permanent=True)
    ours.add_hook("blocks.2.hook_resid_post", count)
    ours.reset_hooks()  # the temporary one goes, the permanent one stays
    ours(tokens())
    assert seen == [1] and ours.hook_dict["blocks.1.hook_resid_post"].ctx == {"calls": 1}
    ours.reset_hooks(including_permanent=True)
    ours(tokens())
    assert seen == [1] and ours.hook_dict["blocks.1.hook_resid_post"].ctx == {}
    with pytest.raises(ValueError, match="not inside a block"):
        ours.hook_dict["hook_embed"].layer()


@pytest.mark.parametrize("arch", ARCHS)
def test_model_helpers_and_switches_equal_tls(arch) -> None:
    ours, theirs, _, _ = get(arch)
    for layer, mlp_input, incl in [(0, False, True), (2, True, True), (3, False, False)]:
        torch.testing.assert_close(ours.accumulated_bias(layer, mlp_input, incl),
                                   theirs.accumulated_bias(layer, mlp_input, incl))
    assert ours.to_single_str_token(9) == theirs.to_single_str_token(9)
    with torch.no_grad():
        assert "blocks.0.attn.hook_result" not in ours.run_with_cache(tokens())[1]
        ours.set_use_attn_result(True)
        _, cache = ours.run_with_cache(tokens())
        ours.set_use_attn_result(False)
        theirs.set_use_attn_result(True)
        _, tl_cache = theirs.run_with_cache(tokens())
        theirs.set_use_attn_result(False)
    torch.testing.assert_close(cache["blocks.1.attn.hook_result"], tl_cache["blocks.1.attn.hook_result"],
                               rtol=1e-4, atol=1e-5)
    assert "blocks.0.attn.hook_result" not in ours.run_with_cache(tokens())[1]


def test_test_prompt_ranks_equal_tls(capsys) -> None:
    from transformer_lens import utils as tl_utils

    ours, theirs, _, _ = get("llama_gqa")
    for answer in ("w5 w6", ["w5", "w7", "w9"]):
        ranks = utils.test_prompt("w1 w2 w3", answer, ours, print_details=True, top_k=3)
        assert "Rank:" in capsys.readouterr().out
        tl_utils.test_prompt("w1 w2 w3", answer, theirs, print_details=True, top_k=3)
        tl_out = capsys.readouterr().out
        for position in ranks:
            for token, rank in position:
                assert f"Rank: {rank: <8}" in tl_out and f"|{token}|" in tl_out


@pytest.mark.parametrize("arch", ARCHS)
def test_return_types_equal_tls(arch) -> None:
    ours, theirs, _, _ = get(arch)
    toks = tokens()
    with torch.no_grad():
        assert ours(toks, return_type=None) is None
        logits, loss = ours(toks, return_type="both")
        tl_logits, tl_loss = theirs(toks, return_type="both")
        torch.testing.assert_close(logits, tl_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(loss, tl_loss, rtol=1e-5, atol=1e-6)
        out = ours.run_with_hooks(toks, return_type="loss", fwd_hooks=[("blocks.0.hook_resid_post", lambda x, h: None)])
        torch.testing.assert_close(out, tl_loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="return_type"):
        ours(toks, return_type="logit")
