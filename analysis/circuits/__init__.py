"""Circuits as edge graphs, on attention and SSMs alike.

    graph         one graph per model from the block and mixer protocols: senders (embed, heads, SSM heads,
                  MLPs, experts, side blocks), receivers (heads' q/k/v, SSM heads' inputs, MLPs, logits),
                  edges through the residual stream (`graph_of`, `Graph`, `Edge`)
    eap           edge attribution patching, EAP and EAP-IG (`edge_attribution` -> `EdgeScores`)
    prompts       prompts of different lengths (lists of strings / 1-D token tensors, a batch with its mask)
                  as one left-padded batch, each clean prompt with a corrupt of its length
    baselines     what an ablated edge carries: the corrupt run, zeros, a reference batch's mean (`intervention=`)
    integrated    EAP-IG's step placement (`steps_at=`), "eap-ig-activations" and "clean-corrupted"
    attribution   the one chunked estimate loop (prompts, baseline, the method's gradients, metric values)
                  that edges, position edges and neurons share; each keeps only its score product
    metrics       `AnswerDiff`, `KL` (a metric reading the clean logits), how metrics follow chunks
    verify        exact verification by edge patching: `verify_circuit` (faithfulness), `circuit_metric`,
                  `faithfulness_curve`, `edge_effects`, `prune`, `rescore`
    token_edges   (unit, target <- source) edges inside mixers: estimates (edge_attribution(token_edges=True)),
                  exact knockout (`cut_token_edges`, `verify_token_edges`)
    positions     per-position graphs: residual edges at each position joined by the token edges
                  (`position_attribution` -> `PositionScores`, exact: `position_effects`, `verify_positions`)
    paths         path patching (`path_patch`, `path_patch_sweep`), TL's direct path patching included
    transplant    SSM state transplants and patchscopes through the decoding state
    nodes         node scores (a sender's edges summed: `node_scores`, `node_attribution`) and exact node
                  patching (`verify_nodes`)
    neurons       MLP neurons and SSM channels: `neuron_attribution` (EAP, EAP-IG), `verify_neurons`
    select        circuits by top-n, threshold or greedy, pruned to paths from embed to the logits (`select`,
                  `select_circuit` -> `Selection`, `on_paths`)
    store         `EdgeScores.save(path)` / `EdgeScores.load(path, model=None)`: JSON with the graph
    dot           `to_dot`: a circuit as Graphviz dot text
    plot          the graph's top edges drawn over layers
"""

from analysis.circuits.eap import EdgeScores, edge_attribution
from analysis.circuits.dot import to_dot
from analysis.circuits.graph import Edge, Graph, graph_of
from analysis.circuits.metrics import KL
from analysis.circuits.neurons import Neuron, NeuronScores, neuron_attribution, verify_neurons
from analysis.circuits.nodes import NodeScores, node_attribution, node_scores, verify_nodes
from analysis.circuits.paths import path_patch, path_patch_sweep
from analysis.circuits.positions import (PositionEdge, PositionScores, position_attribution, position_effects,
                                         verify_positions)
from analysis.circuits.select import Selection, on_paths, select, select_circuit
from analysis.circuits.token_edges import TokenEdge, TokenEdgeScores, cut_token_edges, verify_token_edges
from analysis.circuits.transplant import generate_from, patchscope, read, ssm_sites, transplant, transplant_state
from analysis.circuits.verify import circuit_metric, edge_effects, faithfulness_curve, prune, rescore, verify_circuit

__all__ = ["EdgeScores", "edge_attribution", "Edge", "Graph", "graph_of", "KL", "path_patch", "path_patch_sweep",
           "PositionEdge", "PositionScores", "position_attribution", "position_effects", "verify_positions",
           "TokenEdge", "TokenEdgeScores", "cut_token_edges", "verify_token_edges", "generate_from", "patchscope",
           "read", "ssm_sites", "transplant", "transplant_state", "circuit_metric", "edge_effects",
           "faithfulness_curve", "prune", "rescore", "verify_circuit", "to_dot", "Neuron", "NeuronScores",
           "neuron_attribution", "verify_neurons", "NodeScores", "node_attribution", "node_scores", "verify_nodes",
           "Selection", "on_paths", "select", "select_circuit"]
