"""TransformerLens's `utils` names that a TL user's code imports: `get_act_name`, `lm_cross_entropy_loss`,
`to_numpy`, `get_device`, `get_corner`, `remove_batch_dim`, `lm_accuracy`,
`test_prompt`.

get_act_name(name, layer=None, layer_type=None) builds a hook name the way TL 3.9 does
("pattern", 3) -> "blocks.3.attn.hook_pattern", ("resid_pre", 0) -> "blocks.0.hook_resid_pre",
("scale", 2, "ln1") -> "blocks.2.ln1.hook_scale", ("scale") -> "ln_final.hook_scale", the short
form "pattern3" and TL's aliases ("attn" -> pattern, "attn_logits" -> attn_scores, "a" -> attn,
"m" -> mlp). It adds our SSM mixer hooks ("kernel", "h", "dt", ... -> "blocks.{l}.mixer.hook_*").
"""

from __future__ import annotations

import re

from hooked.models.base import lm_loss as _lm_loss
from hooked.validate import Flag, Integer, Text, WrongType, checked

_ATTN = {"k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores"}
_MLP = {"pre", "post", "mid", "pre_linear"}
_MIXER = {"in", "gate", "conv", "ssm_in", "dt", "B", "C", "A_bar", "B_bar", "h", "kernel", "y", "ssm_out",
          "gated", "head_out"}
_LAYER_TYPE_ALIAS = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}
_NAME_ALIAS = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
               "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}


def get_act_name(name: str, layer: int | str | None = None, layer_type: str | None = None) -> str:
    """The full hook name for a short activation name (TransformerLens's `utils.get_act_name`)."""
    if not isinstance(name, str) or not name:
        raise WrongType(f"get_act_name: name: expected a non-empty string, got {name!r} ({type(name).__name__})")
    if layer is not None and not (isinstance(layer, str) and layer.isdigit()):
        layer = Integer(ge=0).check(layer, "get_act_name: layer")
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name  # already a full name
    match = re.match(r"([a-z_]+)(\d+)([a-z]?.*)", name)
    if match is not None:
        name, layer, layer_type = match.groups()
    name = _NAME_ALIAS.get(name, name)
    full = f"blocks.{layer}." if layer is not None else ""
    if name in _ATTN:
        layer_type = "attn"
    elif name in _MLP:
        layer_type = "mlp"
    elif name in _MIXER:
        layer_type = "mixer"
    elif layer_type in _LAYER_TYPE_ALIAS:
        layer_type = _LAYER_TYPE_ALIAS[layer_type]
    if layer_type:
        full += f"{layer_type}."
    full += f"hook_{name}"
    if name in ("scale", "normalized") and layer is None:
        full = f"ln_final.{full}"
    return full


def lm_cross_entropy_loss(logits, tokens, attention_mask=None, per_token: bool = False):
    """Mean next-token cross-entropy (TL's): over positions whose token and next token are real."""
    mask = None if attention_mask is None else attention_mask.bool()
    return _lm_loss(logits, tokens, mask, per_token)


@checked(prompt=Text(), prepend_space_to_answer=Flag(), print_details=Flag(), prepend_bos=Flag(none=True),
         top_k=Integer(ge=1))
def test_prompt(prompt: str, answer: str | list[str], model, prepend_space_to_answer: bool = True,
                print_details: bool = True, prepend_bos: bool | None = None, top_k: int = 10):
    """TL's `utils.test_prompt`: the rank, logit and probability of the answer's tokens after `prompt`
    (several answers: their first tokens), and the top-k tokens at each answer position. Prints as
    TL does (plain text) and returns [(answer token, rank), ...] per answer position."""
    import torch

    answers = [answer] if isinstance(answer, str) else list(answer)
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    tok = model._need_tokenizer()
    empty = [a for a in answers if not isinstance(a, str) or not tok(a, add_special_tokens=False)["input_ids"]]
    if empty:  # to_tokens would keep a lone BOS, ranked as if it were the answer
        raise ValueError(f"test_prompt: answer {empty[0]!r} tokenizes to no token; give a non-empty answer")
    prompt_tokens = model.to_tokens(prompt, prepend_bos=prepend_bos)
    answer_rows = [model.to_tokens(a, prepend_bos=False)[0] for a in answers]
    length = 1 if len(answers) > 1 else len(answer_rows[0])
    tokens = torch.cat([prompt_tokens.repeat(len(answers), 1),
                        torch.stack([r[:length] for r in answer_rows]).to(prompt_tokens.device)], dim=1)
    n_prompt = prompt_tokens.shape[1]
    if print_details:
        print("Tokenized prompt:", model.to_str_tokens(prompt_tokens[0]))
        print("Tokenized answer" + ("s:" if len(answers) > 1 else ":"),
              [model.to_str_tokens(r[:length]) for r in answer_rows] if len(answers) > 1
              else model.to_str_tokens(answer_rows[0]))
    with torch.no_grad():
        logits = model(tokens)
    probs = logits.softmax(-1)
    ranks = []
    for index in range(n_prompt, n_prompt + length):
        wanted = tokens[:, index]
        order = probs[:, index - 1].argsort(-1, descending=True)
        rank = order.argsort(-1)[torch.arange(len(answers)), wanted].tolist()
        strings = [model.to_single_str_token(int(t)) for t in wanted]
        ranks.append(list(zip(strings, rank)))
        if print_details:
            for i in range(len(answers)):
                print(f"Rank: {rank[i]: <8} Logit: {logits[i, index - 1, wanted[i]].item():5.2f} "
                      f"Prob: {probs[i, index - 1, wanted[i]].item():6.2%} Token: |{strings[i]}|")
            for k in range(top_k):
                t = int(order[0, k])
                print(f"Top {k}th token. Logit: {logits[0, index - 1, t].item():5.2f} "
                      f"Prob: {probs[0, index - 1, t].item():6.2%} Token: |{model.to_single_str_token(t)}|")
    if print_details:
        print("Ranks of the answer tokens:", ranks)
    return ranks


# ------------------------------------------------------------------ TL's array and device helpers
def to_numpy(tensor):
    """A numpy array of a tensor (detached, on the CPU), an array, a list or a number (TL's)."""
    import numpy as np
    import torch

    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, (list, tuple)):
        return np.array(tensor)
    if isinstance(tensor, (torch.Tensor, torch.nn.Parameter)):
        return tensor.detach().cpu().numpy()
    if isinstance(tensor, (int, float, bool, str)):
        return np.array(tensor)
    raise ValueError(f"to_numpy takes a tensor, an array, a list or a number, got {type(tensor).__name__}")


def get_device():
    """The best device here: CUDA, then Apple's MPS, then the CPU (TL's)."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def get_corner(tensor, n: int = 3):
    """The top-left n x n x ... corner of a tensor (or FactoredMatrix) (TL's)."""
    from hooked.factored_matrix import FactoredMatrix

    if isinstance(tensor, FactoredMatrix):
        return tensor.get_corner(n)
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def remove_batch_dim(tensor):
    """Drop a leading batch axis of size 1 (TL's); other tensors unchanged."""
    return tensor.squeeze(0) if tensor.shape[0] == 1 else tensor


def lm_accuracy(logits, tokens, per_token: bool = False):
    """Share of positions whose top-1 prediction is the next token (TL's)."""
    correct = logits[:, :-1].argmax(-1) == tokens[:, 1:]
    return correct if per_token else correct.float().mean()
