"""Argument checks at the public entry points, in one voice: rules.py (scalar arguments and `@checked`) and
indices.py (the index grammar: layers, positions, heads, units, token ids, metric values). Every entry point
of hooked, analysis, the circuits and the SAEs checks its arguments with these; see each file's glossary."""

from hooked.validate.indices import (IndexOutOfRange, NotAnIndex, as_index, axis_index, check_positions, head_index, index_list,
                                     index_mask, is_mask, layer_bound, layer_index, layer_list, metric_name,
                                     metric_tensor, metric_value, nonempty, not_a_01_mask, pos_index, position_list,
                                     position_mask, positive_int, resid_layer, token_edge, token_ids)
from hooked.validate.rules import (RULES, AnyOf, Device, Flag, Instance, Integer, Number, OneOf, Rule, Seq, Text,
                                   WrongType, check, checked, checked_fields)

__all__ = ["RULES", "AnyOf", "Device", "Flag", "IndexOutOfRange", "Instance", "Integer", "NotAnIndex", "Number",
           "OneOf", "Rule", "Seq", "Text", "WrongType", "as_index", "axis_index", "check", "check_positions", "checked", "checked_fields",
           "head_index", "index_list", "index_mask", "is_mask", "layer_bound", "layer_index", "layer_list",
           "metric_name", "metric_tensor", "metric_value", "nonempty", "not_a_01_mask", "pos_index", "position_list",
           "position_mask", "positive_int", "resid_layer", "token_edge", "token_ids"]
