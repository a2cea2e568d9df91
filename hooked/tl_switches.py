"""TransformerLens's model switches: which hooks a name filter selects; weight processing in place.

Glossary
    gated hook     a hook TL fires only behind a switch: blocks.{l}.hook_attn_in (`set_use_attn_in`),
                   blocks.{l}.hook_mlp_in (`set_use_hook_mlp_in`), attn.hook_result
                   (`set_use_attn_result`). With `tl_gating` on (TL-style models: loaders.tl), a
                   callable names filter and a bare run_with_cache() skip a gated hook until its switch
                   is on, as TL's do; a hook named explicitly (a str or a list) always fires. With
                   `tl_gating` off (hooked's default) every hook a filter selects fires.
    ungrouped      TL's `set_ungroup_grouped_query_attention(True)` shows hook_k / hook_v with n_heads
                   (the kv heads repeated). Here hook_k / hook_v keep n_kv_heads (the model's own
                   numbers, edits exact); model.W_K / W_V are the repeated weights. True is refused.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

GATED = {"hook_attn_in": "use_attn_in", "hook_mlp_in": "use_hook_mlp_in", "attn.hook_result": "use_attn_result"}


class TLSwitches:
    """Mixed into HookedModel (see the module docstring)."""

    tl_gating: bool = False
    use_attn_in: bool = False
    use_hook_mlp_in: bool = False
    use_attn_result: bool = False
    use_split_qkv_input: bool = False

    def _gated(self, name: str) -> bool:
        """True when a filter should skip `name`: TL would not fire it with the switches as they are."""
        if not self.tl_gating:
            return False
        return any(name.endswith(suffix) and not getattr(self, switch) for suffix, switch in GATED.items())

    def set_use_attn_result(self, use: bool) -> None:
        """TL's switch for hook_result (each head's write): on, it is part of a bare run_with_cache()
        and of callable filters; off, it is lazy (built only when named) and, with tl_gating, skipped
        by callable filters."""
        self.use_attn_result = bool(use)
        for name, point in self._module_hooks().items():
            if name.endswith("attn.hook_result"):
                point.lazy = not use

    def set_use_attn_in(self, use: bool) -> None:
        """TL's switch for blocks.{l}.hook_attn_in. Ours is [batch pos d_model], shared by the heads
        (TL's is per head); with tl_gating off it always fires."""
        self.use_attn_in = bool(use)

    def set_use_hook_mlp_in(self, use: bool) -> None:
        """TL's switch for blocks.{l}.hook_mlp_in; with tl_gating off it always fires."""
        self.use_hook_mlp_in = bool(use)

    def set_use_split_qkv_input(self, use: bool) -> None:
        """TL's switch for hook_q_input / hook_k_input / hook_v_input, which hooked does not have:
        True is refused (blocks.{l}.hook_attn_in is the attention's input, shared by q, k and v)."""
        if use:
            raise ValueError("split q/k/v inputs (hook_q_input, ...) are not hooked: edit blocks.{l}.hook_attn_in, "
                             "the input shared by q, k and v, or hook_q / hook_k / hook_v after the projections")
        self.use_split_qkv_input = False

    def set_ungroup_grouped_query_attention(self, ungroup: bool) -> None:
        """TL's switch; see the module docstring (True is refused: hook_k / hook_v keep n_kv_heads)."""
        if ungroup:
            raise ValueError("hook_k / hook_v keep the model's n_kv_heads (GQA as computed); model.W_K / W_V are "
                             "repeated per query head as TL's ungrouped weights")

    def process_weights_(self, fold_ln: bool = True, center_writing_weights: bool = True, center_unembed: bool = True,
                         refactor_factored_attn_matrices: bool = False, fold_value_biases: bool = True) -> Any:
        """TL's in-place weight processing (hooked.processing.process_weights); returns the model."""
        from hooked.processing import process_weights

        if refactor_factored_attn_matrices:
            raise ValueError("refactor_factored_attn_matrices is not supported: it changes W_Q/W_K/W_V/W_O "
                             "without changing the function, which hooked's weight names would then not show")
        return process_weights(self, fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                               center_unembed=center_unembed, fold_value_biases=fold_value_biases)
