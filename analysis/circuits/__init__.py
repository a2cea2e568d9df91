"""Circuits as edge graphs, on attention and SSMs alike (issue 32): see graph.py for the nodes and edges."""

from analysis.circuits.eap import EdgeScores, edge_attribution
from analysis.circuits.graph import Edge, Graph, graph_of
from analysis.circuits.token_edges import TokenEdge, TokenEdgeScores, cut_token_edges, verify_token_edges
from analysis.circuits.verify import circuit_metric, edge_effects, faithfulness_curve, prune, verify_circuit

__all__ = ["EdgeScores", "edge_attribution", "Edge", "Graph", "graph_of", "TokenEdge", "TokenEdgeScores",
           "cut_token_edges", "verify_token_edges", "circuit_metric", "edge_effects", "faithfulness_curve", "prune",
           "verify_circuit"]
