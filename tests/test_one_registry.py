"""One family registry: loaders/registry.py's table is the only list of families; `hooked.models.families.build`
finds a config's builder in the module that defines the config (or its nearest base's), and it is the
builder the loaders' table names, on every family of tests/tiny_families.py."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_families import CONFIGS, FAMILIES

from hooked.models import families
from loaders.registry import find_architecture


@pytest.mark.parametrize("name", FAMILIES)
def test_the_loaders_table_and_build_agree(name):
    _, hf_config = CONFIGS[name]()
    arch = find_architecture({**hf_config.to_dict(), "architectures": None})
    cfg = arch.config_from_hf(hf_config.to_dict())
    assert families.builder_of(type(cfg)) is arch.build


def test_a_config_no_family_defines_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class StrangeConfig:
        n_layers: int = 1

    assert families.builder_of(StrangeConfig) is None
    with pytest.raises(TypeError, match="StrangeConfig"):
        families.build(StrangeConfig())
