"""Hooks scoped to their caller: nested contexts restore by handle, threads never see each other's
hooks or caches, and loading a model changes nothing another thread builds.

Two threads share one tiny Llama; every result they get while looping concurrently must equal,
bit for bit, the same call made alone before the threads start.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from torch import nn

from hooked.hook_points import scoped_hooks
from loaders import from_pretrained

P = "blocks.0.hook_resid_pre"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    d = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def model(llama_dir):
    return from_pretrained(llama_dir)


TOKENS = torch.tensor([[3, 5, 7, 11, 13]])


def add1(x, hook):
    return x + 1


def mul2(x, hook):
    return x * 2


def seen_by(model, point=P):
    """The value the hooks at `point` leave, for a ones input, read by a trailing scoped hook."""
    got = {}
    with scoped_hooks([(model.hook_dict[point], lambda x, h: got.setdefault("x", x.clone()), False)]):
        model(TOKENS)
    return got["x"]


# ---------------------------------------------------------------------------- nested hook contexts
def test_nested_context_with_an_equal_fn_restores_the_outer_order(model):
    with model.hooks(fwd_hooks=[(P, lambda x, h: torch.ones_like(x)), (P, add1), (P, mul2)]):
        before = seen_by(model)
        with model.hooks(fwd_hooks=[(P, add1)]):
            assert torch.equal(seen_by(model), before + 1)
        after = seen_by(model)
    assert torch.equal(before, torch.full_like(before, 4.0))  # 2 * (1 + 1)
    assert torch.equal(after, before)  # not 2 * 1 + 1


def test_model_hook_removed_by_handle_not_by_equality(model):
    point = model.hook_dict[P]
    remove_first = point.add_hook(add1)
    remove_second = point.add_hook(add1)
    try:
        remove_second()
        assert point._hooks and point._hooks[0].fn is add1 and len(point._hooks) == 1
        remove_second()  # a second call removes nothing
        assert len(point._hooks) == 1
    finally:
        remove_first()
    assert not point._hooks


def test_scopes_left_out_of_order_remove_only_their_own(model):
    point = model.hook_dict[P]
    outer = scoped_hooks([(point, add1, False)])
    inner = scoped_hooks([(point, add1, False)])
    outer_hooks = outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # the outer leaves first: the inner's add1 stays
    assert [h.fn for h in point.visible_hooks()] == [add1]
    assert point.visible_hooks()[0] is not outer_hooks[0]
    inner.__exit__(None, None, None)
    assert not point.has_hooks


def test_prepended_scoped_hook_runs_first(model):
    point = model.hook_dict[P]
    order = []
    with scoped_hooks([(point, lambda x, h: order.append("back"), False),
                       (point, lambda x, h: order.append("front"), True)]):
        remove = point.add_hook(lambda x, h: order.append("model"))
        try:
            model(TOKENS)
        finally:
            remove()
    assert order == ["front", "model", "back"]


# ------------------------------------------------------------------------------------ threads
def _alone(model):
    """Reference results of each call made alone: (plain, with hooks, cache of one hook)."""
    plain = model(TOKENS)
    hooked = model.run_with_hooks(TOKENS, fwd_hooks=[(P, mul2)])
    _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_resid_post"))
    return plain, hooked, dict(cache.items())


def _loop(seconds, body, errors):
    def run():
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                body()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
    return threading.Thread(target=run)


def test_two_threads_each_see_only_their_own_hooks_and_caches(model):
    plain, hooked, cache_ref = _alone(model)
    assert not torch.equal(plain, hooked)
    errors: list[BaseException] = []
    counts = {"a": 0, "b": 0}

    def a():  # temporary hooks and a cache with another filter
        out = model.run_with_hooks(TOKENS, fwd_hooks=[(P, mul2)])
        assert torch.equal(out, hooked), "thread A: run_with_hooks differs from the same call alone"
        _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_resid_post"))
        assert set(cache.keys()) == set(cache_ref), "thread A: cache holds another caller's activations"
        assert all(torch.equal(cache[k], v) for k, v in cache_ref.items())
        counts["a"] += 1

    def b():  # plain forwards and full caches, never A's hooks
        assert torch.equal(model(TOKENS), plain), "thread B: a plain forward ran another thread's hook"
        out, cache = model.run_with_cache(TOKENS, incl_lazy=True)
        assert torch.equal(out, plain)
        assert all(torch.equal(cache[k], v) for k, v in cache_ref.items())
        assert len(cache) == len(model.hook_dict)
        counts["b"] += 1

    threads = [_loop(2.0, a, errors), _loop(2.0, b, errors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert counts["a"] > 5 and counts["b"] > 5, counts
    assert not any(p.has_hooks for p in model.hook_dict.values())


def test_plain_forward_in_another_thread_while_a_hook_waits(model):
    """Deterministic interleaving: thread B runs while thread A is inside its hook."""
    plain = model(TOKENS)
    inside, release = threading.Event(), threading.Event()
    got = {}

    def blocking(x, hook):
        inside.set()
        release.wait(10)
        return x * 3

    a = threading.Thread(target=lambda: got.setdefault("a", model.run_with_hooks(TOKENS, fwd_hooks=[(P, blocking)])))
    a.start()
    assert inside.wait(10)
    got["b"] = model(TOKENS)
    _, got["b_cache"] = model.run_with_cache(TOKENS, names_filter=P)
    release.set()
    a.join()
    assert torch.equal(got["b"], plain)
    assert not torch.equal(got["a"], plain)
    assert torch.equal(got["b_cache"][P], model.run_with_cache(TOKENS, names_filter=P)[1][P])


def test_asyncio_tasks_scope_their_hooks(model):
    plain = model(TOKENS)

    async def with_hook():
        with model.hooks(fwd_hooks=[(P, mul2)]):
            await asyncio.sleep(0.01)
            return model(TOKENS)

    async def without():
        await asyncio.sleep(0.005)  # runs while the other task holds its hook
        return model(TOKENS)

    async def both():
        return await asyncio.gather(with_hook(), without())

    hooked_out, plain_out = asyncio.run(both())
    assert torch.equal(plain_out, plain)
    assert not torch.equal(hooked_out, plain)


def test_loading_leaves_modules_built_by_another_thread_real(llama_dir):
    errors: list[BaseException] = []
    built = {"n": 0}

    def build():
        layer = nn.Linear(16, 16)
        assert layer.weight.device.type == "cpu" and layer.bias.device.type == "cpu", "meta parameters"
        assert layer.weight.abs().sum() > 0, "parameters left uninitialised"
        emb = nn.Embedding(8, 4)
        assert emb.weight.device.type == "cpu" and emb.weight.std() > 0.1
        built["n"] += 1

    def load():
        assert next(from_pretrained(llama_dir).parameters()).device.type == "cpu"

    from torch.nn.modules import module as torch_module

    hooks_before = dict(torch_module._global_parameter_registration_hooks)
    patched_before = (nn.Module.register_parameter, {n: f for n, f in vars(nn.init).items() if callable(f)})
    threads = [_loop(2.0, load, errors), _loop(2.0, build, errors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert built["n"] > 10
    # nothing process-wide changed: no torch function replaced, no global hook added or removed
    assert dict(torch_module._global_parameter_registration_hooks) == hooks_before
    assert patched_before == (nn.Module.register_parameter, {n: f for n, f in vars(nn.init).items() if callable(f)})
