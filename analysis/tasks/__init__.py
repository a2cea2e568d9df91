"""Tasks: every prompt set the analyses run on, as `Example`s (prompt, choices, answer, segments).

    text             the G&A paper's KV-retrieval diagnostic (`kv_retrieval`) and MMLU-style
                     `multiple_choice`, tokenisation helpers (`encode_prompts`, `segment_token_spans`)
    scoring          the one scoring rule: a choice's summed log-probability (`ChoiceScorer`,
                     `score_choices` on text; `score_choices_tokens`, `choice_scores` on token ids)
    token_kv         the organisms' token-level key-value task (training batches, prompts, accuracy)
    known_facts      the known_1000.json facts (Meng et al.): loading, subject spans, source sets
    synthetic_facts  the facts organisms' synthetic knowledge base
"""

from analysis.tasks.scoring import ChoiceScorer, answer_logprob, choice_scores, score_choices, score_choices_tokens
from analysis.tasks.text import Example, encode_prompts, kv_retrieval, multiple_choice, tokenizer_of

__all__ = ["ChoiceScorer", "answer_logprob", "choice_scores", "score_choices", "score_choices_tokens",
           "Example", "encode_prompts", "kv_retrieval", "multiple_choice", "tokenizer_of"]
