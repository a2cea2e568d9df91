"""The pure backend rules (hooked/backend_rules.py), as a table: exact hooks win, then forcing, then the device."""

import pytest

from hooked.backend_rules import choose_attention, choose_scan, needs_exact


@pytest.mark.parametrize("names, want", [
    ([], False),
    (["blocks.0.mixer.hook_y", "blocks.0.mixer.hook_dt", "blocks.1.attn.hook_z"], False),
    (["blocks.3.mixer.hook_h"], True),
    (["hook_kernel"], True),
    (["blocks.0.mixer.hook_A_bar"], True),
    (["blocks.2.shared.attn.hook_pattern"], True),
    (["blocks.1.attn.hook_attn_scores"], True),
    (["blocks.1.attn.softcap.hook_out"], True),
    (["blocks.1.attn.hook_patternx", "blocks.1.mixer.xhook_h"], False),  # whole names only
])
def test_needs_exact(names, want):
    assert needs_exact(names) is want


@pytest.mark.parametrize("kw, want", [
    (dict(exact=True, forced="fused", on_cuda=True, fused_importable=True), "chunked"),
    (dict(exact=True, forced="fused"), "loop"),
    (dict(exact=True), "loop"),
    (dict(exact=True, on_cuda=True, fused_importable=True), "chunked"),  # states in few launches
    (dict(exact=True, forced="chunked"), "chunked"),  # hook_h on the two-level scan
    (dict(exact=True, forced="loop", on_cuda=True), "loop"),
    (dict(exact=False, forced="fused", kernel_dtype=False), "loop"),  # float64: the kernels take none
    (dict(exact=False, on_cuda=True, fused_importable=True, kernel_dtype=False), "chunked"),
    (dict(exact=False, forced="fused", has_initial_state=True, on_cuda=True), "chunked"),
    (dict(exact=False), "loop"),
    (dict(exact=False, forced="chunked"), "chunked"),
    (dict(exact=False, forced="fused"), "fused"),  # on CPU: the caller passes the stand-ins
    (dict(exact=False, on_cuda=True), "chunked"),
    (dict(exact=False, on_cuda=True, fused_importable=True), "fused"),
    (dict(exact=False, on_cuda=True, fused_importable=True, has_initial_state=True), "chunked"),
    (dict(exact=False, forced="loop", on_cuda=True, fused_importable=True), "loop"),
])
def test_choose_scan(kw, want):
    assert choose_scan(**kw) == want


@pytest.mark.parametrize("kw, want", [
    (dict(exact=False), "sdpa"),
    (dict(exact=True, forced="sdpa"), "eager"),
    (dict(exact=False, softcap=True, forced="sdpa"), "eager"),
    (dict(exact=False, shared_past=True), "eager"),
    (dict(exact=False, forced="eager"), "eager"),
])
def test_choose_attention(kw, want):
    assert choose_attention(**kw) == want


def test_unknown_backends_are_refused():
    with pytest.raises(ValueError, match="scan backend must be one of"):
        choose_scan(exact=True, forced="flash")
    with pytest.raises(ValueError, match="attention backend must be one of"):
        choose_attention(exact=False, forced="flash")


def test_a_sliding_window_runs_eager_on_cpu_and_sdpa_on_cuda():
    assert choose_attention(exact=False, windowed=True, on_cuda=False) == "eager"
    assert choose_attention(exact=False, windowed=True, on_cuda=True) == "sdpa"
    assert choose_attention(exact=False, windowed=False, on_cuda=False) == "sdpa"
    assert choose_attention(exact=False, windowed=True, on_cuda=False, forced="sdpa") == "sdpa"
