"""SAELens's HookedSAETransformer methods on every hooked model.

    model.add_sae(sae, hook_name=None, use_error_term=False, positions=None)   -> the hook name
    model.reset_saes(act_names=None)                 remove SAEs (all, one name, or a list)
    with model.saes([sae, ...], use_error_term=None): ...   attached inside, previous ones restored on exit
    model.run_with_saes(tokens, saes=[...])          one forward with them
    model.run_with_cache_with_saes(tokens, saes=[...], names_filter=...)
    model.run_with_hooks_with_saes(tokens, saes=[...], fwd_hooks=[...])
    model.acts_to_saes                               {hook name: SAE}

An SAE is a tap of its hook point (hooked/sae/splice.py): the point's own hooks see the model's
activation, the SAE reads what they leave, and its features are hook points under
`{hook}.sae.` that patching, ablation, attribution and the cache use like any other. Attached SAEs
belong to the model, seen by every caller (as TransformerLens's), until reset_saes().
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor

from hooked.sae.splice import SAESplice, sae_hook_name
from hooked.sae.views import heads_view

TAP = "sae"


class SAEMethods:
    """Mixed into HookedModel (see the module docstring)."""

    def add_sae(self, sae: Any, hook_name: str | None = None, use_error_term: bool = False,
                positions: Sequence[int] | Tensor | None = None, head: int | None = None) -> str:
        """Splice `sae` into hook `hook_name` (default: the hook in its metadata) and return that name.

        An SAE already there is replaced. `positions` restricts the splice to those positions; `head`
        (default: the metadata's hook_head_index) to one head, for an SAE of one head's size.
        """
        name = hook_name or sae_hook_name(sae)
        if name is None:
            raise ValueError("the SAE names no hook (cfg.metadata.hook_name): pass hook_name=")
        point = self._resolve(name)
        if len(point) != 1:
            raise ValueError(f"hook_name must name one hook, {name!r} selects {len(point)}")
        point = point[0]
        splice = SAESplice(sae, point, use_error_term=use_error_term, positions=positions, head=head)
        if TAP in point._modules:
            point.remove_tap(TAP)
        point.add_tap(TAP, splice)
        self.setup()
        return point.name

    def _make_view(self, name: str) -> Any:
        """`{hook}.hook_heads` views (views.py), made the first time they are named."""
        return heads_view(self, name)

    @property
    def acts_to_saes(self) -> dict[str, Any]:
        """{hook name: attached SAE}, in forward order."""
        return {name: p._modules[TAP].sae for name, p in self.hook_dict.items() if TAP in p._modules}

    def reset_saes(self, act_names: str | Sequence[str] | None = None) -> None:
        """Remove the SAEs at these hooks (default: every attached SAE)."""
        names = [act_names] if isinstance(act_names, str) else list(act_names or self.acts_to_saes)
        points = self._module_hooks()
        for name in names:
            if name not in points or TAP not in points[name]._modules:
                raise KeyError(f"no SAE is attached at {name!r}; attached: {list(self.acts_to_saes)}")
        for name in names:
            points[name].remove_tap(TAP)
        self.setup()

    def _splices(self) -> dict[str, SAESplice]:
        return {name: p._modules[TAP] for name, p in self._module_hooks().items() if TAP in p._modules}

    @contextlib.contextmanager
    def saes(self, saes: Any | Sequence[Any] = (), reset_saes_end: bool = True,
             use_error_term: bool | None = None) -> Iterator[Any]:
        """Attach `saes` inside the block; on exit restore exactly the SAEs attached before.
        use_error_term None keeps each SAE's own setting (SAELens's `sae.use_error_term`, else False)."""
        saes = [saes] if not isinstance(saes, (list, tuple)) else list(saes)
        before = self._splices()
        try:
            for sae in saes:
                error = use_error_term if use_error_term is not None else bool(getattr(sae, "use_error_term", False))
                self.add_sae(sae, use_error_term=error)
            yield self
        finally:
            if reset_saes_end:
                now = self._splices()
                points = self._module_hooks()
                for name in now:
                    points[name].remove_tap(TAP)
                for name, splice in before.items():
                    if name in points:
                        points[name].add_tap(TAP, splice)
                self.setup()

    def run_with_saes(self, *args: Any, saes: Any | Sequence[Any] = (), reset_saes_end: bool = True,
                      use_error_term: bool | None = None, **kwargs: Any) -> Any:
        """One forward with `saes` attached (removed after, previous ones restored)."""
        with self.saes(saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            return self(*args, **kwargs)

    def run_with_cache_with_saes(self, *args: Any, saes: Any | Sequence[Any] = (), reset_saes_end: bool = True,
                                 use_error_term: bool | None = None, **kwargs: Any) -> Any:
        """run_with_cache with `saes` attached: their feature hooks are in the cache like any other."""
        with self.saes(saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            return self.run_with_cache(*args, **kwargs)

    def run_with_hooks_with_saes(self, *args: Any, saes: Any | Sequence[Any] = (), reset_saes_end: bool = True,
                                 **kwargs: Any) -> Any:
        """run_with_hooks with `saes` attached (hooks may name their feature points)."""
        with self.saes(saes, reset_saes_end=reset_saes_end):
            return self.run_with_hooks(*args, **kwargs)
