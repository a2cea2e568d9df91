"""A careless or hostile user's inputs at the public entry points: each gives the right answer or an
error naming the argument, the value and what is allowed; never a silent reinterpretation. Every
case is listed with what it now does in notes/issue28_cases.md.

A refused call leaves no hook behind and the model unchanged.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch

from analysis.cli import main
from loaders import from_pretrained

TOKENS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])  # 10 positions


def either(ours: str, arg: str, value: str) -> str:
    """Our message, or (under pytest, where jaxtyping + beartype check annotations before a function's
    body runs) the type checker's, which names the same parameter and value."""
    return rf"(?:{ours})|(?:parameter '?{re.escape(arg)}'?[\s\S]*?{re.escape(value)})"


@pytest.fixture(scope="module")
def model():
    return from_pretrained("organism/llama-kv")  # a tokenizer that adds BOS; d_vocab 101


def unchanged(model, reference):
    assert torch.equal(model(TOKENS), reference)
    assert not any(p.has_hooks for p in model.hook_dict.values())


# ---------------------------------------------------------------------------------- generate
GENERATE = {  # kwargs -> (error, message)
    "max_new_tokens=-1": ({"max_new_tokens": -1}, ValueError, r"generate: max_new_tokens=-1: must be >= 0"),
    "max_new_tokens=True": ({"max_new_tokens": True}, TypeError, r"max_new_tokens: expected an integer >= 0, got True"),
    "max_new_tokens='3'": ({"max_new_tokens": "3"}, TypeError, r"max_new_tokens: expected an integer >= 0, got '3'"),
    "eos_token_id=-1": ({"eos_token_id": -1}, ValueError, r"eos_token_id=-1: must be in \[0, 101\)"),
    "eos_token_id=10**6": ({"eos_token_id": 10**6}, ValueError, r"eos_token_id=1000000: must be in \[0, 101\)"),
    "eos_token_id=[1, 200]": ({"eos_token_id": [1, 200]}, ValueError, r"eos_token_id\[1\]=200: must be in \[0, 101\)"),
    "eos_token_id=[]": ({"eos_token_id": []}, ValueError, r"eos_token_id=\[\]: must be a non-empty list"),
    "temperature=-1": ({"temperature": -1}, ValueError, r"temperature=-1.0: must be >= 0"),
    "temperature='1'": ({"temperature": "1"}, TypeError, r"temperature: expected a finite number >= 0, got '1'"),
    "top_p=1.5": ({"top_p": 1.5}, ValueError, r"top_p=1.5: must be in \(0, 1\]"),
    "top_p=nan": ({"top_p": math.nan}, ValueError, r"top_p=nan: must be a finite number in \(0, 1\]"),
    "top_p=0": ({"top_p": 0.0}, ValueError, r"top_p=0.0: must be in \(0, 1\]"),
    "top_k=0": ({"top_k": 0}, ValueError, r"top_k=0: must be >= 1"),  # TL asserts top_k > 0 too
    "top_k=-1": ({"top_k": -1}, ValueError, r"top_k=-1: must be >= 1"),
    "top_k=2.5": ({"top_k": 2.5}, TypeError, r"top_k: expected an integer >= 1 or None, got 2.5"),
    "freq_penalty=-1": ({"freq_penalty": -1}, ValueError, r"freq_penalty=-1.0: must be >= 0"),
    "do_sample='no'": ({"do_sample": "no"}, TypeError, r"do_sample: expected True or False, got 'no'"),
    "stop_at_eos=None": ({"stop_at_eos": None}, TypeError, r"stop_at_eos: expected True or False, got None"),
    "seed=1.5": ({"seed": 1.5}, TypeError, r"seed: expected an integer"),
    "return_type='text'": ({"return_type": "text"}, ValueError, r"return_type='text': must be one of 'input'"),
    "an empty prompt list": ({"input": []}, ValueError, r"input=\[\]: must be a non-empty list"),
    "a non-string prompt": ({"input": ["K03", 5]}, TypeError, r"input\[1\]: expected a string, got 5"),
    "an empty row without BOS": ({"input": ["K03", ""], "prepend_bos": False}, ValueError,
                                 r"input\[1\] tokenizes to no token"),
}


@pytest.mark.parametrize("case", list(GENERATE))
def test_generate_refuses(model, case):
    kw, error, message = GENERATE[case]
    reference = model(TOKENS)
    with pytest.raises(error, match=message):
        model.generate(**{"input": TOKENS, "max_new_tokens": 2, **kw})
    unchanged(model, reference)


def test_generate_accepts_tls_edge_values(model):
    greedy = model.generate(TOKENS, max_new_tokens=3, do_sample=False, stop_at_eos=False)
    assert torch.equal(model.generate(TOKENS, max_new_tokens=3, temperature=0, stop_at_eos=False), greedy)  # TL: greedy
    assert torch.equal(model.generate(TOKENS, max_new_tokens=3, top_k=1, stop_at_eos=False, seed=0), greedy)
    assert torch.equal(model.generate(TOKENS, max_new_tokens=3, top_k=10**6, top_p=1.0, seed=5, stop_at_eos=False),
                       model.generate(TOKENS, max_new_tokens=3, seed=5, stop_at_eos=False))  # k clamped, p=1 keeps all
    assert torch.equal(model.generate(TOKENS, max_new_tokens=0), TOKENS)
    assert model.generate(["K03", ""], max_new_tokens=2, do_sample=False)  # "" is BOS alone here, as TL


def test_an_empty_row_from_a_tokenizer_without_bos_is_refused():
    from tests.tl_oracle import pair

    ours, theirs, _, _ = pair("gpt2")  # a word-level tokenizer that adds no BOS
    with pytest.raises(ValueError, match=r"input\[1\] tokenizes to no token"):
        ours.generate(["w1 w2", ""], max_new_tokens=2)  # TL generates from a row of padding


@pytest.mark.parametrize("which", [0, 1, "both", "absent"])
def test_an_eos_list_stops_as_tls_does(which):
    from tests.tl_oracle import pair

    ours, theirs, _, _ = pair("gpt2")
    prompt = torch.randint(4, 48, (2, 5), generator=torch.Generator().manual_seed(7))
    free = ours.generate(prompt, max_new_tokens=6, do_sample=False, stop_at_eos=False)
    firsts = [int(free[0, 7]), int(free[1, 9])]  # each row's own stop token, at different steps
    stops = {0: [firsts[0], 47], 1: [47, firsts[1]], "both": firsts, "absent": [46, 47]}[which]
    mine = ours.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=stops)
    tl = theirs.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=stops, verbose=False)
    assert torch.equal(mine, tl)


# ------------------------------------------------------------------------- forwards, caches
def test_loss_of_one_token_is_refused(model):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model(TOKENS[:, :1], return_type="loss")
    with pytest.raises(ValueError, match="no position has a real token followed by a real token"):
        model(TOKENS[:, :2], attention_mask=torch.tensor([[0, 1]]), return_type="loss")
    assert model(TOKENS[:, :1], return_type="loss", loss_per_token=True).shape == (1, 0)  # nothing to average


CACHE = {  # run_with_cache kwargs -> (error, message)
    "pos_slice=100": ({"pos_slice": 100}, ValueError, r"pos_slice=100: must be in \[-10, 10\)"),
    "pos_slice=-11": ({"pos_slice": -11}, ValueError, r"pos_slice=-11: must be in \[-10, 10\)"),
    "pos_slice=True": ({"pos_slice": True}, TypeError, r"pos_slice: expected None, an integer .* got True"),
    "pos_slice=1.0": ({"pos_slice": 1.0}, TypeError, r"pos_slice: expected .* got 1.0"),
    "pos_slice=slice(100, None)": ({"pos_slice": slice(100, None)}, ValueError, r"selects none of the 10 positions"),
    "pos_slice=[0, 10]": ({"pos_slice": [0, 10]}, ValueError, r"pos_slice\[1\]=10: must be in \[-10, 10\)"),
    "max_cache_bytes=-5": ({"max_cache_bytes": -5}, ValueError, r"max_cache_bytes=-5: must be >= 0"),
    "max_cache_bytes=inf": ({"max_cache_bytes": math.inf}, TypeError, r"max_cache_bytes: expected an integer >= 0 or None, got inf"),
    "max_cache_bytes=nan": ({"max_cache_bytes": math.nan}, TypeError, r"max_cache_bytes: expected an integer >= 0 or None, got nan"),
    "max_cache_bytes='1GiB'": ({"max_cache_bytes": "1GiB"}, TypeError, r"max_cache_bytes: .* got '1GiB'"),
    "device='gpu'": ({"device": "gpu"}, ValueError, r"run_with_cache: device='gpu': not a device"),
    "names_filter=5": ({"names_filter": 5}, TypeError, either(r"names_filter: expected None, a hook name", "names_filter", "5")),
    "remove_batch_dim='yes'": ({"remove_batch_dim": "yes"}, TypeError, r"remove_batch_dim: expected True or False"),
}


@pytest.mark.parametrize("case", list(CACHE))
def test_run_with_cache_refuses(model, case):
    kw, error, message = CACHE[case]
    reference = model(TOKENS)
    with pytest.raises(error, match=message):
        model.run_with_cache(TOKENS, **kw)
    unchanged(model, reference)


def test_pos_slices_select_what_they_say(model):
    _, full = model.run_with_cache(TOKENS)
    name = "blocks.1.hook_resid_post"
    for pos_slice, index in ((3, [3]), (-1, [9]), (slice(2, 5), [2, 3, 4]), (slice(None, None, -3), [9, 6, 3, 0]),
                             ([0, -1, 4], [0, 9, 4]), ((1, 3), [1, 2])):
        _, cache = model.run_with_cache(TOKENS, pos_slice=pos_slice)
        assert torch.equal(cache[name], full[name][:, index]), pos_slice


# ------------------------------------------------------------------------------ TL surface
def tl_cases(model, cache):
    from hooked import utils
    from hooked.processing import process_weights

    stack = lambda: cache.accumulated_resid()  # noqa: E731  (lazy: the names are listed without a model)
    return {  # name -> (call, error, message)
        "get_token_position 3-D": (lambda: model.get_token_position(5, torch.zeros(1, 2, 5, dtype=torch.long)),
                                   TypeError, r"get_token_position: input must be a str or tokens .* \(1, 2, 5\)"),
        "get_token_position id 200": (lambda: model.get_token_position(200, TOKENS), ValueError,
                                      r"single_token=200: must be in \[0, 101\)"),
        "process_weights fold_ln='no'": (lambda: process_weights(copy.deepcopy(model), fold_ln="no"), TypeError,
                                         r"process_weights: fold_ln: expected True or False, got 'no'"),
        "get_act_name layer 1.5": (lambda: utils.get_act_name("resid_pre", 1.5), TypeError,
                                   either(r"get_act_name: layer", "layer", "1.5")),
        "get_act_name layer -1": (lambda: utils.get_act_name("resid_pre", -1), ValueError, r"layer=-1: must be >= 0"),
        "to_single_token(5)": (lambda: model.to_single_token(5), TypeError, r"to_single_token: string"),
        "to_tokens(5)": (lambda: model.to_tokens(5), TypeError, r"text: expected a string or a non-empty list"),
        "to_tokens padding_side": (lambda: model.to_tokens("K03", padding_side="middle"), ValueError,
                                   r"padding_side='middle': must be one of 'left', 'right'"),
        "to_tokens prepend_bos='no'": (lambda: model.to_tokens("K03", prepend_bos="no"), TypeError, r"prepend_bos"),
        "to_str_tokens float tensor": (lambda: model.to_str_tokens(torch.tensor([1.5])), TypeError, r"token ids"),
        "to_string(5.5)": (lambda: model.to_string(5.5), TypeError,  # one int id is TL's to_string(256): allowed
                           either(r"to_string: tokens must be token ids", "tokens", "5.5")),
        "accumulated_resid layer=True": (lambda: cache.accumulated_resid(layer=True), TypeError, r"layer: expected an integer"),
        "accumulated_resid incl_mid='yes'": (lambda: cache.accumulated_resid(incl_mid="yes"), TypeError,
                                             r"accumulated_resid: incl_mid: expected True or False"),
        "accumulated_resid pos_slice=100": (lambda: cache.accumulated_resid(pos_slice=100), ValueError,
                                            r"pos_slice=100: must be in \[-10, 10\)"),
        "apply_ln_to_stack width": (lambda: cache.apply_ln_to_stack(torch.zeros(3, 1, 10, 16), layer=1), ValueError,
                                    r"residual_stack must be \[..., pos, d_model=64\], got \(3, 1, 10, 16\)"),
        "logit_attrs tokens 99999": (lambda: cache.logit_attrs(stack(), tokens=99999), ValueError,
                                     r"logit_attrs: tokens=99999: must be in \[0, 101\)"),
        "logit_attrs tokens shape": (lambda: cache.logit_attrs(stack(), tokens=torch.tensor([1, 2, 3])), ValueError,
                                     r"logit_attrs: tokens of shape \(3,\) do not match"),
        "logit_attrs incorrect 2.5": (lambda: cache.logit_attrs(stack(), tokens=3, incorrect_tokens=2.5), TypeError,
                                      r"incorrect_tokens: expected an integer"),
        "tokens_to_residual_directions 999": (lambda: model.tokens_to_residual_directions(999), ValueError,
                                              r"tokens_to_residual_directions: tokens=999"),
        "run_with_hooks a string": (lambda: model.run_with_hooks(TOKENS, fwd_hooks="blocks.0.hook_resid_pre"),
                                    TypeError, either(r"fwd_hooks: expected a list of \(hook name or filter, function\) pairs",
                                                      "fwd_hooks", "blocks.0.hook_resid_pre")),
        "run_with_hooks a 1-tuple": (lambda: model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_resid_pre",)]),
                                     TypeError, either(r"fwd_hooks\[0\]: expected a \(hook name or filter, function\) pair",
                                                       "fwd_hooks", "blocks.0.hook_resid_pre")),
        "loss_per_token='yes'": (lambda: model(TOKENS, return_type="loss", loss_per_token="yes"), TypeError,
                                 either(r"loss_per_token: expected True or False", "loss_per_token", "yes")),
        "attention_mask of an empty row": (lambda: model(TOKENS.expand(2, -1), attention_mask=torch.tensor([[1] * 10, [0] * 10])),
                                           ValueError, r"attention_mask: rows \[1\] have no real token"),
        "test_prompt flag": (lambda: utils.test_prompt("K03", "V12", model, prepend_space_to_answer="x"), TypeError,
                             r"prepend_space_to_answer: expected True or False"),
    }


@pytest.mark.parametrize("case", list(tl_cases(None, None)))
def test_tl_surface_refuses(model, case):
    _, cache = model.run_with_cache(TOKENS)
    cases = tl_cases(model, cache)
    call, error, message = cases[case]
    reference = model(TOKENS)
    with pytest.raises(error, match=message):
        call()
    unchanged(model, reference)


# --------------------------------------------------------------------------------- analyses
def test_info_flow_confidence(model):
    from analysis.info_flow import info_flow

    for bad, message in ((1.5, r"confidence=1.5: must be in \(0, 1\)"), (0, r"confidence=0.0"),
                         ("95%", r"confidence: expected a finite number")):
        with pytest.raises((TypeError, ValueError), match=message):
            info_flow(model, [], confidence=bad)


def test_act_patch_metric_must_give_one_number(model):
    from analysis.interventions import act_patch

    tokens = TOKENS.expand(2, -1)
    _, cache = model.run_with_cache(tokens)
    with pytest.raises(ValueError, match=r"metric must return one number per run .* shape \(2,\)"):
        act_patch(model, tokens, cache, lambda logits: logits[:, -1, 0], "blocks.{layer}.hook_resid_pre")
    grid = act_patch(model, tokens, cache, lambda logits: logits[:, -1, 0].mean(), "blocks.{layer}.hook_resid_pre")
    assert grid.shape == (2, 10) and not grid.isnan().any()


def test_ga_needs_examples(model):
    from analysis.ga import ga_scores, rank_heads

    with pytest.raises(ValueError, match=r"rank_heads: examples=\[\]: must be a non-empty list"):
        rank_heads(model, [])
    with pytest.raises(ValueError, match=r"ga_scores: examples=\[\]: must be a non-empty list"):
        ga_scores(model, [])
    with pytest.raises(ValueError, match=r"rank_heads: n_control=-3: must be >= 0"):
        rank_heads(model, [object()], n_control=-3)


# --------------------------------------------------------------- a second careless pass
def second_pass(model):
    from analysis.interventions import ablate_heads, knockout
    from analysis.tasks.scoring import score_choices
    from analysis.tasks.text import kv_retrieval

    def within(context):
        with context:
            pass

    return {  # new cases, found after the first list: name -> (call, error, message)
        "knockout cut_conv='yes'": (lambda: within(knockout(model, [0], [-1], [0], cut_conv="yes")), TypeError,
                                    r"knockout: cut_conv: expected True or False, got 'yes'"),
        "ablate_heads keep='yes'": (lambda: within(ablate_heads(model, [(0, 1)], keep="yes")), TypeError,
                                    r"ablate_heads: keep: expected True or False, got 'yes'"),
        "kv_retrieval seed=1.5": (lambda: kv_retrieval(3, 2, seed=1.5), TypeError, r"kv_retrieval: seed: expected an integer"),
        "score_choices([])": (lambda: score_choices(model, []), ValueError, r"examples is empty"),
        "cache.to('gpu')": (lambda: model.run_with_cache(TOKENS)[1].to("gpu"), ValueError,
                            r"ActivationCache.to: device='gpu': not a device"),
        "accumulated_bias(99)": (lambda: model.accumulated_bias(99), ValueError, r"accumulated_bias: layer=99: must be in \[0, 2\]"),
        "accumulated_bias(1.5)": (lambda: model.accumulated_bias(1.5), TypeError, r"accumulated_bias: layer: expected an integer"),
    }


@pytest.mark.parametrize("case", list(second_pass(None)))
def test_second_pass_refuses(model, case):
    call, error, message = second_pass(model)[case]
    reference = model(TOKENS)
    with pytest.raises(error, match=message):
        call()
    unchanged(model, reference)


# --------------------------------------------------------------------- loading and placement
PLACEMENT = {  # from_pretrained kwargs -> message
    "max_memory without device_map": ({"max_memory": {"cpu": 10**9}},
                                      r"max_memory=\{'cpu': 1000000000\}: only used with device_map="),
    "offload_folder without device_map": ({"offload_folder": "/tmp/x"}, r"offload_folder='/tmp/x': only used with"),
    "device_map mps": ({"device_map": {"": "mps"}}, r"device_map\[''\]='mps': device maps place modules on CUDA"),
    "device_map meta": ({"device_map": {"": "meta"}}, r"device_map\[''\]='meta'"),
    "device_map GPU 7": ({"device_map": {"": 7}}, r"device_map\[''\]=7: this machine has \d+ CUDA GPU"),
    "device_map unknown module": ({"device_map": {"": "cpu", "blocks.9": "cpu"}},
                                  r"device_map names no module of the model: 'blocks.9'"),
    "device_map planner name": ({"device_map": "fastest"}, r"device_map='fastest': expected one of auto"),
    "negative memory": ({"device_map": "auto", "max_memory": {"cpu": -5}}, r"max_memory\['cpu'\]=-5: expected bytes >= 0"),
    "memory string": ({"device_map": "auto", "max_memory": {"cpu": "lots"}}, r"max_memory\['cpu'\]='lots'"),
    "memory device": ({"device_map": "auto", "max_memory": {"mps": 10}}, r"max_memory key 'mps'"),
    "max_memory with a dict map": ({"device_map": {"": "cpu"}, "max_memory": {"cpu": 10}}, r"drop max_memory"),
    "device gpu": ({"device": "gpu"}, r"from_pretrained: device='gpu': not a device"),
    "device meta": ({"device": "meta"}, r"device='meta': the meta device holds no data"),
    "mmap='yes'": ({"mmap": "yes"}, r"from_pretrained: mmap: expected True or False or None"),
    "fold_ln='no'": ({"fold_ln": "no"}, r"from_pretrained: fold_ln: expected True or False"),
}


@pytest.mark.parametrize("case", list(PLACEMENT))
def test_from_pretrained_refuses(case):
    kw, message = PLACEMENT[case]
    with pytest.raises((TypeError, ValueError), match=message):
        from_pretrained("organism/llama-kv", **kw)


# ------------------------------------------------------------------------------ configs
def saved(tmp_path, hf, **edits):
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(edits)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def tiny_jamba():
    import transformers

    return transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, mamba_d_state=4, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1))


def tiny_nemotron():
    import transformers

    return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        vocab_size=64, hidden_size=16, hybrid_override_pattern="M*E", num_attention_heads=4, num_key_value_heads=2,
        head_dim=4, mamba_num_heads=4, mamba_head_dim=8, n_groups=1, ssm_state_size=8, chunk_size=16,
        intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        moe_shared_expert_intermediate_size=10))


CONFIG_FILES = {  # model, config.json edits -> message
    "jamba top_k > n_experts": (tiny_jamba, {"num_experts_per_tok": 3}, r"top_k=3: must be in \[1, n_experts=2\]"),
    "jamba attn_layer_period=0": (tiny_jamba, {"attn_layer_period": 0}, r"attn_layer_period=0 must be >= 1"),
    "nemotron top_k > n_experts": (tiny_nemotron, {"num_experts_per_tok": 9}, r"top_k=9: must be in \[1, n_experts=4\]"),
    "nemotron bad pattern": (tiny_nemotron, {"hybrid_override_pattern": "MX*", "layers_block_type": None},
                             r"hybrid_override_pattern='MX\*' must be a non-empty string .* unknown: \['X'\]"),
}


@pytest.mark.parametrize("case", list(CONFIG_FILES))
def test_config_errors_are_refused_at_build(case, tmp_path):
    make, edits, message = CONFIG_FILES[case]
    torch.manual_seed(0)
    d = saved(tmp_path, make(), **edits)
    with pytest.raises(ValueError, match=message):
        from_pretrained(d)


def test_config_dataclasses_refuse_at_construction():
    from hooked.models.gemma2 import Gemma2Config
    from hooked.models.jamba import JambaConfig
    from hooked.models.nemotron_h import NemotronHConfig

    with pytest.raises(ValueError, match=r"query_pre_attn_scalar=0.0: must be > 0"):
        Gemma2Config(n_layers=2, d_model=16, n_heads=4, d_mlp=24, d_vocab=64, query_pre_attn_scalar=0.0)
    with pytest.raises(ValueError, match=r"top_k=3: must be in \[1, n_experts=2\]"):
        JambaConfig(2, 16, 64, 24, ["mamba", "attention"], ["mlp", "moe"], n_experts=2, top_k=3, n_attn_heads=4)
    with pytest.raises(ValueError, match=r"pattern 'MX\*' has unknown symbols \['X'\]"):
        NemotronHConfig.layer_types_of("MX*")
    with pytest.raises(ValueError, match=r"top_k=0: must be in \[1, n_experts=8\]"):
        NemotronHConfig(16, 64, ("mamba", "moe"), n_heads=4, d_head=8, top_k=0)


# ---------------------------------------------------------------------------------- the CLI
CLI = {  # argv (after the missing model) -> message; every one before the model is loaded
    "hooks --prompt ''": (["hooks"], ["--prompt", ""], r"--prompt='': must be a non-empty string"),
    "parity --tol -1": (["parity"], ["--tol=-1"], r"--tol=-1.0: must be >= 0"),
    "parity --prompts ''": (["parity"], ["--prompts", "a", ""], r"--prompts\[1\]='': must be a non-empty string"),
    "ga --verify-top -1": (["ga"], ["--verify-top=-1"], r"--verify-top=-1: must be >= 1"),
    "ga --replicas 0": (["ga"], ["--replicas=0"], r"--replicas=0: must be >= 1"),
    "ga --controls -3": (["ga"], ["--controls=-3"], r"--controls=-3: must be >= 0"),
    "knockout --screen 0": (["knockout"], ["--screen=0"], r"--screen=0: must be >= 1"),
    "knockout --facts missing": (["knockout"], ["--facts", "/nonexistent/facts.json"],
                                 r"--facts '/nonexistent/facts.json': no such file"),
    "ga --seed -1": (["ga"], ["--seed=-1"], r"--seed=-1: must be >= 0"),  # Python's random seeds -1 as 1
}


@pytest.mark.parametrize("case", list(CLI))
def test_cli_options_are_checked_before_the_model_loads(case, tmp_path, capsys):
    command, options, message = CLI[case]
    out = [] if command == ["hooks"] else ["--out", str(tmp_path / "out")]
    assert main(command + [str(tmp_path / "no_model")] + options + out) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "no_model" not in err, err


@pytest.mark.parametrize("command", ["parity", "knockout", "ga"])
def test_cli_checks_the_output_directory_before_the_work(command, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main([command, str(tmp_path / "no_model"), "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a writable directory" in err and "no_model" not in err, err


# ------------------------------------------------------------------ a third careless pass
# New cases (notes/issue28_careless_pass2.md); the decoding ones with a knockout are in test_decode_knockout.py.
def _tiny(name):
    from tests.tiny_families import tiny

    return tiny(name)  # no tokenizer; d_vocab 64; Mamba-1: 32 channels, 2 layers


def third_pass(model):
    from analysis.ga.ranking import head_units
    from analysis.interventions import decay_split, knockout, prune_from_end, remove_and_restore
    from analysis.kernel_rows import kernel_rows
    from analysis.tasks.text import Example, kv_retrieval
    from hooked import utils
    from hooked.models.decode_state import DecodeState, StateMismatch
    from loaders import from_hf

    def within(context, run=None):
        with context:
            if run is not None:
                run()

    def prefilled():
        state = DecodeState()
        model(TOKENS.expand(2, -1), state=state)
        return state

    def lower_blocks_skipped():
        state = DecodeState()
        resid = model(TOKENS[:, :6], stop_at_layer=1)
        model(resid, start_at_layer=1, tokens=TOKENS[:, :6], state=state)  # block 0 never reads the prefix
        model(TOKENS[:, 6:7], state=state)

    mamba = _tiny("mamba") if model is not None else None
    ids = TOKENS % 64
    return {  # name -> (call, error, message)
        "knockout channels, no SSM mixer": (
            lambda: within(knockout(model, [1], [5], [0], channels=[0])), ValueError,
            r"channels restricts the cut of SSM mixers, and layers \[0\] have none"),
        "knockout a 0/1 list as positions": (
            lambda: within(knockout(model, [0, 1, 1, 0, 0], [5], [0])), ValueError, r"reads as a 0/1 mask"),
        "knockout a uint8 mask": (
            lambda: within(knockout(model, torch.ones(10, dtype=torch.uint8), [5], [0])), ValueError,
            r"a uint8 tensor is ambiguous"),
        "knockout channels for a layer not cut": (
            lambda: within(knockout(mamba, [1], [5], [0], channels={0: [1], 1: [2]})), ValueError,
            r"channels has entries for layers \[1\], which are not in layers=\[0\]"),
        "two knockouts sharing an SSM edge": (
            lambda: within(knockout(mamba, [1, 2], [5], [0]), lambda: within(knockout(mamba, [2], [5, 6], [0]),
                                                                           lambda: mamba(ids))),
            ValueError, r"blocks.0.mixer is cut by two active knockouts that share edges \(target 5"),
        "decay_split fraction=True": (lambda: decay_split(mamba, 0, fraction=True), TypeError,
                                      r"decay_split: fraction: expected a finite number in \(0, 1\], got True"),
        "select rows outside the state": (lambda: prefilled().select(torch.tensor([0, 2])), ValueError,
                                          r"select: rows \[2\] are outside the state's 2 rows"),
        "select a negative row": (lambda: prefilled().select(torch.tensor([-1])), ValueError, r"rows \[-1\]"),
        "select float rows": (lambda: prefilled().select(torch.tensor([0.0])), TypeError,
                              r"select: index must be a 1-D integer tensor"),
        "select no row": (lambda: prefilled().select([]), ValueError, r"select: index is empty"),
        "decode after start_at_layer on a fresh state": (
            lower_blocks_skipped, StateMismatch, r"has read 6 positions, but blocks.0.attn holds 0 of them"),
        "kv_retrieval seed=-1": (lambda: kv_retrieval(3, 2, seed=-1), ValueError, r"kv_retrieval: seed=-1: must be >= 0"),
        "Example answer=True": (lambda: Example("x", ["a", "b"], True), TypeError, r"Example: answer: expected an integer in \[0, 2\), got True"),
        "Example choices a string": (lambda: Example("x", "ab", 0), TypeError, r"choices must be a list of strings"),
        "generate text without a tokenizer": (
            lambda: mamba.generate(ids, max_new_tokens=1, return_type="str"), ValueError,
            r"generate: return_type='str' needs text, and this model has no tokenizer"),
        "generate verbose without a tokenizer": (
            lambda: mamba.generate(ids, max_new_tokens=1, verbose=True), ValueError, r"verbose=True needs text"),
        "head_units channel_group=0": (lambda: head_units(mamba, channel_group=0), ValueError,
                                       r"head_units: channel_group=0: must be >= 1"),
        "prune_from_end keep past n_layers": (lambda: prune_from_end(model, lambda m: 0.0, keep=[5], progress=False),
                                              ValueError, r"prune_from_end: keep=5: must be in \[0, 2\]"),
        "prune_from_end keep=-1": (lambda: prune_from_end(model, lambda m: 0.0, keep=[-1], progress=False),
                                   ValueError, r"keep=-1"),
        "remove_and_restore layer 9": (lambda: remove_and_restore(model, lambda m: 0.0, layers=[9], progress=False),
                                       ValueError, r"remove_and_restore: layers=9: must be in \[-2, 2\)"),
        "hook_shape pos=0": (lambda: model.hook_shape("blocks.0.hook_resid_pre", batch=1, pos=0), ValueError,
                             r"hook_shape: pos=0: must be >= 1"),
        "hook_shape batch=-1": (lambda: model.hook_shape("blocks.0.hook_resid_pre", batch=-1), ValueError,
                                r"hook_shape: batch=-1"),
        "run_with_hooks reset_hooks_end='no'": (lambda: model.run_with_hooks(TOKENS, reset_hooks_end="no"), TypeError,
                                                either(r"run_with_hooks: reset_hooks_end: expected True or False",
                                                       "reset_hooks_end", "no")),
        "from_pretrained device and device_map": (
            lambda: from_pretrained("organism/llama-kv", device="cpu", device_map="auto"), ValueError,
            r"device='cpu' and device_map='auto': a device map places every module"),
        "from_hf of a name": (lambda: from_hf("gpt2"), TypeError, r"from_hf takes an in-memory Hugging Face model"),
        "to_str_tokens id 500": (lambda: model.to_str_tokens(torch.tensor([3, 500])), ValueError,
                                 r"to_str_tokens: tokens: token ids outside the vocabulary \[0, 101\): \[500\]"),
        "to_string id -3": (lambda: model.to_string(torch.tensor([-3])), ValueError, r"to_string: tokens: .*\[-3\]"),
        "test_prompt answer of no token": (lambda: utils.test_prompt("K03", "", model, print_details=False), ValueError,
                                           r"test_prompt: answer ' ' tokenizes to no token"),
        "get_neuron_results neuron_slice=[999]": (
            lambda: model.run_with_cache(TOKENS)[1].get_neuron_results(0, neuron_slice=[999]), ValueError,
            r"neuron_slice=999: must be in \[-128, 128\) \(the 128 neurons\)"),
        "kernel_rows no rows": (lambda: kernel_rows(mamba, ids, []), ValueError, r"rows: no position given"),
        "info_flow channels, no SSM mixer": (lambda: __import__("analysis.info_flow", fromlist=["x"]).info_flow(
            model, [], channels=[0]), ValueError, r"info_flow: channels restricts the cut of SSM mixers"),
    }


@pytest.mark.parametrize("case", list(third_pass(None)))
def test_third_pass_refuses(model, case):
    call, error, message = third_pass(model)[case]
    reference = model(TOKENS)
    with pytest.raises(error, match=message):
        call()
    unchanged(model, reference)


def test_third_pass_right_answers(model):
    from analysis.interventions import knockout
    from analysis.kernel_rows import kernel_rows
    from hooked.models.decode_state import DecodeState

    for dtype in (torch.int8, torch.int16, torch.int32, torch.uint8):  # small integer ids are ids
        assert torch.equal(model(TOKENS.to(dtype)), model(TOKENS)), dtype
    mamba = _tiny("mamba")
    ids = TOKENS % 64
    one, listed = kernel_rows(mamba, ids, [3], sites="blocks.0.mixer"), kernel_rows(mamba, ids, [3], sites=["blocks.0.mixer"])
    assert one.keys() == listed.keys() == {"blocks.0.mixer"} and torch.equal(one["blocks.0.mixer"], listed["blocks.0.mixer"])
    state = DecodeState()
    with torch.no_grad():
        model(TOKENS.expand(2, -1), state=state)
        assert torch.equal(model(TOKENS[:, :1].expand(2, -1), state=state.select([1, 0])),
                           model(TOKENS[:, :1].expand(2, -1), state=state.select(torch.tensor([1, 0]))))
    # two knockouts on one SSM layer with disjoint edges: exactly the two kernel entries removed
    with torch.no_grad():
        _, cache = mamba.run_with_cache(ids, names_filter=lambda n: n == "blocks.0.mixer.hook_kernel")

        def zero_edges(kernel, hook):
            kernel = kernel.clone()
            kernel[:, :, 5, 1] = 0
            kernel[:, :, 6, 2] = 0
            return kernel

        want = mamba.run_with_hooks(ids, fwd_hooks=[("blocks.0.mixer.hook_kernel", zero_edges)])
        with knockout(mamba, [1], [5], [0]), knockout(mamba, [2], [6], [0]):
            got = mamba(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - mamba(ids)).abs().max() > 1e-4
