"""Sparse autoencoders spliced into hook points: `model.add_sae(sae)` and the SAELens-style methods.

    splice.py   SAESplice: the tap that runs an SAE on one hook point's activation, with its feature
                hook points ({hook}.sae.hook_sae_input / hook_sae_acts_post / hook_sae_recons /
                hook_sae_error / hook_sae_output)
    methods.py  SAEMethods: add_sae, reset_saes, saes(), run_with_saes, run_with_cache_with_saes,
                run_with_hooks_with_saes, acts_to_saes (mixed into every hooked model)
    views.py    `{hook}.hook_heads`: a hook with several axes per head (Mamba-2's hook_h
                [batch pos n_heads d_head d_state]) seen as [batch pos n_heads d_head*d_state]
"""

from hooked.sae.splice import SAESplice, sae_hook_name, sae_sizes
