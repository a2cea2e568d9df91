"""An independent Llamba, written here from the discrete Mamba-2 recurrence, in Cartesia's checkpoint layout.

`LlambaReference(LlambaReferenceConfig(...))` has Cartesia's parameter names (backbone.embedding,
backbone.layers.{l}.mixer.{in_proj, z_bias, conv1d, D, out_proj}, input_layernorm,
post_attention_layernorm, mlp.{gate,up,down}_proj, backbone.final_layernorm, lm_head), a config with
`to_dict()` (Cartesia's config.json fields) and `save_pretrained(dir)` writing config.json and
model.safetensors, so it stands in for an HF model in `from_hf` and `from_pretrained` tests.
Its forward is a loop over positions (no hooked code, no chunked scan): per head h with group g,
    h_t = exp(dt_t A) h_{t-1} + dt_t (x_t / dt_t) B_t[g],  A = -1,  dt = softplus(dt_raw)
    y_t = C_t[g] . h_t + D x_t;   out = out_proj(y * SiLU(z + z_bias))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn


class LlambaReferenceConfig:
    """Cartesia's LlambaConfig fields (vocab_size as given; the model pads it)."""

    def __init__(self, vocab_size: int = 61, d_model: int = 16, n_layer: int = 2, tie_embeddings: bool = False,
                 pad_vocab_size_multiple: int = 8, norm_epsilon: float = 1e-5, mlp_cfg: dict | None = None,
                 ssm_cfg: dict | None = None, model_type: str | None = "llamba") -> None:
        self.vocab_size, self.d_model, self.n_layer = vocab_size, d_model, n_layer
        self.tie_embeddings, self.pad_vocab_size_multiple = tie_embeddings, pad_vocab_size_multiple
        self.norm_epsilon, self.lm_head_bias, self.resid_dropout = norm_epsilon, False, 0.0
        self.mlp_cfg = mlp_cfg or {"intermediate_size": 24, "bias": False, "act_fn": "silu"}
        self.ssm_cfg = ssm_cfg or {"d_state": 8, "n_v_heads": 4, "n_qk_heads": 2, "expand": 1, "chunk_size": 4,
                                   "activation": "identity", "bias": False}
        self.model_type = model_type

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return d if self.model_type is not None else {k: v for k, v in d.items() if k != "model_type"}


def rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Mixer(nn.Module):
    def __init__(self, d_model: int, ssm: dict) -> None:
        super().__init__()
        self.H, self.G, self.N = ssm["n_v_heads"], ssm["n_qk_heads"], ssm["d_state"]
        self.d_inner = ssm.get("expand", 1) * d_model
        self.W = ssm.get("d_conv", 4)
        conv_dim = self.d_inner + 2 * self.G * self.N
        bias = ssm.get("bias", False)
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * self.G * self.N + self.H, bias=bias)
        if not bias:
            self.z_bias = nn.Parameter(torch.zeros(self.d_inner))
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.W, groups=conv_dim, bias=ssm.get("conv_bias", True))
        self.D = nn.Parameter(torch.ones(self.H))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)

    def forward(self, u: Tensor, h_delta: dict[int, Tensor] | None = None,
                dt_factor: dict[int, Tensor] | None = None) -> Tensor:
        """The mixer's output; h_delta {t: [batch H P N]} is added to the state after position t; dt_factor
        {t: [batch H]} multiplies the step dt_t of the discretisation (exp(dt A), dt B), not the input x / dt."""
        batch, L, _ = u.shape
        H, G, N, d_inner = self.H, self.G, self.N, self.d_inner
        P = d_inner // H
        proj = self.in_proj(u)
        xBC, z, dt_raw = proj[..., : d_inner + 2 * G * N], proj[..., d_inner + 2 * G * N: -H], proj[..., -H:]
        w = self.conv1d.weight[:, 0]  # [conv_dim W]: tap k reads position t - (W - 1) + k
        conv = torch.zeros_like(xBC)
        for t in range(L):
            for k in range(self.W):
                if t - (self.W - 1) + k >= 0:
                    conv[:, t] += w[:, k] * xBC[:, t - (self.W - 1) + k]
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        x = conv[..., :d_inner].reshape(batch, L, H, P)
        B = conv[..., d_inner: d_inner + G * N].reshape(batch, L, G, N)
        C = conv[..., d_inner + G * N:].reshape(batch, L, G, N)
        dt = F.softplus(dt_raw)
        A = -torch.ones(H, dtype=u.dtype)
        group = torch.arange(H) // (H // G)
        h = u.new_zeros(batch, H, P, N)
        ys = []
        for t in range(L):
            scan_in = x[:, t] / dt[:, t, :, None]  # Cartesia feeds the SSD x / dt with step dt
            step = dt[:, t] * (dt_factor[t] if dt_factor is not None and t in dt_factor else 1)
            h = torch.exp(step * A)[..., None, None] * h \
                + (step[..., None] * scan_in)[..., None] * B[:, t, group][:, :, None, :]
            h = h + h_delta[t] if h_delta is not None and t in h_delta else h
            ys.append((h * C[:, t, group][:, :, None, :]).sum(-1))
        y = torch.stack(ys, 1) + self.D[:, None] * x
        gate = z + getattr(self, "z_bias", 0)
        return self.out_proj(y.reshape(batch, L, d_inner) * F.silu(gate))


class Layer(nn.Module):
    def __init__(self, cfg: LlambaReferenceConfig) -> None:
        super().__init__()
        self.mixer = Mixer(cfg.d_model, cfg.ssm_cfg)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(cfg.d_model))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(cfg.d_model))
        m = cfg.mlp_cfg
        self.mlp = nn.Module()
        for name, (i, o) in {"gate_proj": (cfg.d_model, m["intermediate_size"]),
                             "up_proj": (cfg.d_model, m["intermediate_size"]),
                             "down_proj": (m["intermediate_size"], cfg.d_model)}.items():
            setattr(self.mlp, name, nn.Linear(i, o, bias=m.get("bias", False)))

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.mixer(rms(h, self.input_layernorm.weight, 1e-5))
        r = rms(h, self.post_attention_layernorm.weight, 1e-5)
        return h + self.mlp.down_proj(F.silu(self.mlp.gate_proj(r)) * self.mlp.up_proj(r))


class LlambaReference(nn.Module):
    def __init__(self, config: LlambaReferenceConfig) -> None:
        super().__init__()
        self.config = config
        vocab = -(-config.vocab_size // config.pad_vocab_size_multiple) * config.pad_vocab_size_multiple
        self.backbone = nn.Module()
        self.backbone.embedding = nn.Embedding(vocab, config.d_model)
        self.backbone.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layer))
        self.backbone.final_layernorm = nn.Module()
        self.backbone.final_layernorm.weight = nn.Parameter(torch.ones(config.d_model))
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.d_model, vocab, bias=False)

    def resid_posts(self, input_ids: Tensor) -> list[Tensor]:
        h, out = self.backbone.embedding(input_ids), []
        for layer in self.backbone.layers:
            h = layer(h)
            out.append(h)
        return out

    def forward(self, input_ids: Tensor) -> Tensor:
        h = rms(self.resid_posts(input_ids)[-1], self.backbone.final_layernorm.weight, self.config.norm_epsilon)
        W_U = self.backbone.embedding.weight if self.config.tie_embeddings else self.lm_head.weight
        return h @ W_U.T

    def save_pretrained(self, directory: str | Path) -> None:
        """config.json and model.safetensors in Cartesia's layout (the tied lm_head left out)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(self.config.to_dict()))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(d / "model.safetensors"))
