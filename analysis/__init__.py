"""Analyses built on the public hook API of `hooked`, one room per concept.

    analysis.interventions  what changes a forward: knockout (attention / SSM edges, conv taps,
                            feature knockout), head and expert ablation, layer skipping, activation
                            and attribution patching with its generic sweep loop (TL's names too)
    analysis.tasks          every prompt set and how its choices are scored: text KV retrieval and
                            multiple choice, the organisms' token-level KV task, known facts
                            (known_1000.json), the synthetic facts task; one `Example` and one scoring rule
    analysis.ga             Gather-and-Aggregate: head ranking by ablation, gather / aggregate scores
                            from patterns and kernels, role-aware reads on the KV task, attribution
                            screening with exact verification, the report
    analysis.info_flow      the knockout information-flow sweep over layer windows and source sets
    analysis.kernel_rows    rows / columns of an SSM kernel without the pos x pos matrix
    analysis.intervals      Clopper-Pearson, bootstrap and t intervals, separability statements
    analysis.validate       one validation layer for positions, layers, heads and channels
    analysis.plots          matplotlib figures and CSV / JSON tables
    analysis.cli            the `hooked` console script

Imports point one way: interventions <- tasks <- ga, and interventions, tasks <- info_flow <- cli.
Only the CLI, the G&A report and info_flow's command import `loaders` (to load a model by name);
nothing else in analysis does.
"""
