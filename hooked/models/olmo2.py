"""OLMo 2 (and OLMo 3: olmo3.py's config): Llama whose norms sit after the sublayers, not before, and whose
q and k are RMS-normalised over the whole projection (all heads at once) before rotary.

Glossary (TransformerLens names; HF Olmo2Config names in brackets): as llama.py, plus
    q_norm, k_norm     RMSNorm over n_heads * d_head (q) and n_kv_heads * d_head (k): one statistic per
                       position, a weight per feature (heads_norm.py)
    ln1_post [post_attention_layernorm], ln2_post [post_feedforward_layernorm]   the post-sublayer norms

    resid_0 = W_E[token]                                            hook_embed
    q, k    = q_norm(q_proj(resid)), k_norm(k_proj(resid))          attn.hook_q, hook_k (before the norms),
                                                                    attn.q_norm.hook_normalized, k_norm.*
    resid   = resid + ln1_post(attn(resid))    (rotary q and k)     blocks.{l}.ln1_post.hook_normalized
    resid   = resid + ln2_post(mlp(resid))     (SwiGLU)             blocks.{l}.ln2_post.hook_normalized
    logits  = ln_final(resid) @ W_U^T                               ln_final.hook_normalized

Every norm multiplies its weight in float32 before the cast, as HF's Olmo2RMSNorm (norms.py's
Float32ProductRMSNorm). The sublayers read the residual itself: ln1 and ln2 are identities (no ln1.* /
ln2.* hooks), as on OLMo-hybrid's attention layers. hook_attn_out and hook_mlp_out are after the
post-norms (what is added); the head results sum to ln1_post's input. Other hooks are attention.py's
and mlp.py's.
"""

from __future__ import annotations

from dataclasses import dataclass


from hooked.models.attention import Attention
from hooked.models.block import ResidualBlock, Sublayer
from hooked.models.heads_norm import HeadsRMSNorm
from hooked.models.language_model import LanguageModel
from hooked.models.llama import LlamaConfig
from hooked.models.mlp import GatedMLP
from hooked.models.norms import Float32ProductRMSNorm, NoNorm
from hooked.ops.rotary import Rotary


@dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
    eps: float = 1e-5

    def rotary_of(self, layer: int) -> Rotary:
        return self.rotary


def attention(cfg: Olmo2Config, layer: int) -> Attention:
    return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, qkv_bias=cfg.attention_bias,
                     o_bias=cfg.attention_bias, rotary=cfg.rotary_of(layer), window=cfg.window(layer),
                     q_norm=HeadsRMSNorm(cfg.n_heads, cfg.d_head, cfg.eps),
                     k_norm=HeadsRMSNorm(cfg.n_kv_heads, cfg.d_head, cfg.eps))


def build(cfg: Olmo2Config) -> LanguageModel:
    """OLMo 2 / OLMo 3 with a hook on every quantity; load weights with `loaders.from_hf` / `from_pretrained`."""
    def norm() -> Float32ProductRMSNorm:
        return Float32ProductRMSNorm(cfg.d_model, cfg.eps)

    blocks = [ResidualBlock([
        Sublayer("attn", NoNorm(), attention(cfg, layer), post_norm=norm()),
        Sublayer("mlp", NoNorm(), GatedMLP(cfg.d_model, cfg.d_mlp, cfg.act_fn, bias=cfg.mlp_bias),
                 post_norm=norm()),
    ]) for layer in range(cfg.n_layers)]
    return LanguageModel(cfg, blocks, norm())
