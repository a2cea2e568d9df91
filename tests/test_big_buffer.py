"""big_zeros: a zero tensor of the asked shape/dtype/device; large CPU ones are huge-page mappings
that the tensor alone keeps alive (unmapped when it and its views die) where huge pages pay (the
HUGE_PAGES policy, free page reporting read from the balloon's features); elsewhere torch.zeros."""

import subprocess
import sys
import textwrap

import pytest
import torch

from hooked.ops import big_buffer
from hooked.ops.big_buffer import big_zeros

needs_thp = pytest.mark.skipif(not big_buffer.thp_offered(), reason="no transparent huge pages to advise here")


def mapped(ptr: int) -> bool:
    """Whether address ptr lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


@pytest.fixture
def force_mapping(monkeypatch):
    """Every CPU tensor takes the mapped path, however small."""
    monkeypatch.setattr(big_buffer, "MIN_BYTES", 0)
    monkeypatch.setattr(big_buffer, "HUGE_PAGES", True)


CASES = {  # shape, dtype
    "float32": ((2, 3, 5, 7), torch.float32),
    "float64": ((4, 1, 9), torch.float64),
    "bfloat16": ((3, 11), torch.bfloat16),
    "int64_scalar_like": ((1,), torch.int64),
}


@needs_thp
@pytest.mark.parametrize("case", CASES)
def test_mapped_is_zeros_of_shape_and_dtype(case, force_mapping):
    shape, dtype = CASES[case]
    t = big_zeros(shape, dtype=dtype, device="cpu")
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert (t == 0).all()
    assert not t.untyped_storage().resizable()  # a mapping, not torch's allocator
    t.fill_(3)
    assert (t == 3).all()


@needs_thp
def test_mapping_lives_with_the_tensor_and_its_views(force_mapping):
    before = big_buffer.mapped_bytes()
    t = big_zeros((1024, 1024), dtype=torch.float32, device="cpu")
    ptr = t.data_ptr()
    assert big_buffer.mapped_bytes() == before + 4 * 2**20  # two whole huge pages
    view = t[10:20].T
    del t
    assert mapped(ptr) and big_buffer.mapped_bytes() == before + 4 * 2**20
    view.fill_(1)
    assert view.sum() == 10 * 1024
    del view
    assert not mapped(ptr) and big_buffer.mapped_bytes() == before


@needs_thp
def test_no_leak_under_an_address_space_limit():
    """64 tensors of 256 MiB (16 GiB) made and dropped in a process limited to its size + 1 GiB."""
    code = textwrap.dedent("""
        import resource, torch
        from hooked.ops import big_buffer
        from hooked.ops.big_buffer import big_zeros
        big_buffer.HUGE_PAGES = True
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
        for k in range(64):
            t = big_zeros((64, 2**20), dtype=torch.float32, device="cpu")
            t[k, :1024] = 1.0  # touches one huge page
            assert t.untyped_storage().nbytes() == 2**28
            del t
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_elsewhere_it_is_torch_zeros(monkeypatch):
    """Small CPU tensors, other devices, and a platform without huge pages get plain torch.zeros."""
    small = big_zeros((3, 4), dtype=torch.float16, device="cpu")
    assert small.untyped_storage().resizable()  # torch's allocator, not a mapping
    assert small.dtype == torch.float16 and (small == 0).all()
    meta = big_zeros((2**20, 2**10), dtype=torch.float32, device="meta")  # 4 GiB, never allocated
    assert meta.device.type == "meta" and meta.shape == (2**20, 2**10)
    monkeypatch.setattr(big_buffer, "MIN_BYTES", 0)
    monkeypatch.setattr(big_buffer, "HUGE_PAGES", True)
    monkeypatch.setattr(big_buffer, "thp_offered", lambda: False)
    plain = big_zeros((5,), dtype=torch.float32, device="cpu")
    assert plain.untyped_storage().resizable() and (plain == 0).all()


BALLOONS = {  # features of each virtio balloon device (bit k = character k), reported?
    "none": ([], False),
    "reporting": (["0110010100000000"], True),  # this VM's: stats, deflate on OOM, reporting
    "no_reporting": (["0110000000000000"], False),
    "second_device": (["0100000000000000", "0000010000000000"], True),
}


@pytest.mark.parametrize("name", BALLOONS)
def test_free_page_reporting_is_read_from_the_balloon_features(name, tmp_path, monkeypatch):
    features, reported = BALLOONS[name]
    for k, bits in enumerate(features):
        (tmp_path / f"virtio{k}").mkdir()
        (tmp_path / f"virtio{k}" / "features").write_text(bits + "\n")
    monkeypatch.setattr(big_buffer, "_BALLOONS", tmp_path)
    big_buffer.free_pages_reported.cache_clear()
    try:
        assert big_buffer.free_pages_reported() is reported
    finally:
        big_buffer.free_pages_reported.cache_clear()


POLICY = {  # HUGE_PAGES, offered, reported -> advise?
    "auto_bare_metal": (None, True, False, True),
    "auto_reporting_vm": (None, True, True, False),
    "auto_not_offered": (None, False, False, False),
    "forced_on_reporting_vm": (True, True, True, True),
    "forced_on_not_offered": (True, False, False, False),
    "forced_off": (False, True, False, False),
}


@pytest.mark.parametrize("name", POLICY)
def test_huge_pages_policy(name, monkeypatch):
    setting, offered, reported, advise = POLICY[name]
    monkeypatch.setattr(big_buffer, "HUGE_PAGES", setting)
    monkeypatch.setattr(big_buffer, "thp_offered", lambda: offered)
    monkeypatch.setattr(big_buffer, "free_pages_reported", lambda: reported)
    assert big_buffer.huge_pages_pay() is advise
    monkeypatch.setattr(big_buffer, "MIN_BYTES", 0)
    t = big_zeros((4, 4), dtype=torch.float32, device="cpu")
    assert t.untyped_storage().resizable() is not advise and (t == 0).all()
