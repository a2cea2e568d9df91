"""Every family: a frozen config plus its `build(cfg)`; `build(cfg)` here picks the builder by config type."""

from __future__ import annotations

from typing import Any

from hooked.models import (bamba, falcon_h1, gemma2, gpt2, granitemoehybrid, jamba, kimi_linear, lfm2, llama, llamba,
                           mamba, mamba2, nemotron_h, olmo_hybrid, qwen3_next, zamba2)
from hooked.models import bailing_hybrid, lfm2_moe  # issue 41's families on mixers we have
from hooked.models import recurrent_gemma  # issue 41's new mixer kinds
from hooked.models import minimax  # issue 41's new mixer kinds
from hooked.models import gemma, gpt_neox, olmo2
from hooked.models import gpt_oss, mixtral, olmoe, qwen3_moe  # issue 42's mixtures of experts
from hooked.models.gemma3 import Gemma3Config
from hooked.models.language_model import LanguageModel
from hooked.models.mistral import MistralConfig
from hooked.models.olmo3 import Olmo3Config
from hooked.models.phi3 import Phi3Config
from hooked.models.qwen2 import Qwen2Config
from hooked.models.qwen3 import Qwen3Config
from hooked.models.qwen3_5 import Qwen3_5Config

BUILDERS = {
    gpt2.GPT2Config: gpt2.build,
    llama.LlamaConfig: llama.build,
    MistralConfig: llama.build,
    Qwen2Config: llama.build,
    Qwen3Config: llama.build,
    gemma2.Gemma2Config: gemma2.build,
    Gemma3Config: gemma2.build,
    gpt_neox.GPTNeoXConfig: gpt_neox.build,
    gemma.GemmaConfig: gemma.build,
    Phi3Config: llama.build,
    olmo2.Olmo2Config: olmo2.build,
    Olmo3Config: olmo2.build,
    mamba.MambaConfig: mamba.build,
    mamba2.Mamba2Config: mamba2.build,
    zamba2.Zamba2Config: zamba2.build,
    bamba.BambaConfig: bamba.build,
    granitemoehybrid.GraniteMoeHybridConfig: granitemoehybrid.build,
    falcon_h1.FalconH1Config: falcon_h1.build,
    nemotron_h.NemotronHConfig: nemotron_h.build,
    jamba.JambaConfig: jamba.build,
    qwen3_next.Qwen3NextConfig: qwen3_next.build,
    Qwen3_5Config: qwen3_next.build,
    olmo_hybrid.OlmoHybridConfig: olmo_hybrid.build,
    kimi_linear.KimiLinearConfig: kimi_linear.build,
    lfm2.Lfm2Config: lfm2.build,
    mixtral.MixtralConfig: mixtral.build,
    olmoe.OlmoeConfig: olmoe.build,
    qwen3_moe.Qwen3MoeConfig: qwen3_moe.build,
    gpt_oss.GptOssConfig: gpt_oss.build,
    llamba.LlambaConfig: llamba.build,
    lfm2_moe.Lfm2MoeConfig: lfm2_moe.build,
    bailing_hybrid.BailingHybridConfig: bailing_hybrid.build,
    recurrent_gemma.RecurrentGemmaConfig: recurrent_gemma.build,
    minimax.MiniMaxConfig: minimax.build,
}


def build(cfg: Any) -> LanguageModel:
    """The hooked model of `cfg` (random weights: load a checkpoint with `loaders.from_pretrained`)."""
    builder = BUILDERS.get(type(cfg))
    if builder is None:
        known = ", ".join(sorted(c.__name__ for c in BUILDERS))
        raise TypeError(f"no family is built from a {type(cfg).__name__}; known configs: {known}")
    return builder(cfg)
