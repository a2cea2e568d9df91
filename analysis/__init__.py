"""Analyses built on the public hook API of `hooked`, one room per concept.

    analysis.interventions  what changes a forward: knockout (attention / SSM edges, conv taps,
                            feature knockout), head ablation and layer skipping, activation and
                            attribution patching with its generic sweep loop
    analysis.tasks          every prompt set and how its choices are scored: text KV retrieval and
                            multiple choice, the organisms' token-level KV task, known facts
                            (known_1000.json), the synthetic facts task; one `Example` and one scoring rule
    analysis.ga             Gather-and-Aggregate: head ranking by ablation, gather / aggregate scores
                            from patterns and kernels, role-aware reads on the KV task, the report
    analysis.info_flow      the knockout information-flow sweep over layer windows and source sets
    analysis.plots          matplotlib figures and CSV / JSON tables
    analysis.cli            the `hooked` console script

Imports point one way: interventions <- tasks <- ga, and interventions, tasks <- info_flow <- cli.
Only the CLI, the G&A report and info_flow's command import `loaders` (to load a model by name);
nothing else in analysis does.
"""
