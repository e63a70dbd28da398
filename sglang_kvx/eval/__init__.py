"""Offline long-context evaluation: RULER's tasks (generated, no downloads), RULER's
scoring, and SCBench-style shared-context sessions.

    from sglang_kvx.eval import TASKS, generate_sample, generate_session, score_samples, metric_table
    sample = generate_sample("niah_multikey_1", target_length=2048, seed=0, index=3)
    prompt = sample.context + sample.question      # the model continues the answer prefix
    session = generate_session("qa_2", 4096, num_questions=4)   # one context, four questions
    print(metric_table(score_samples(samples, predictions)))
"""

from sglang_kvx.eval.length import LENGTH_TOLERANCE, count_tokens, default_tokenizer, encode
from sglang_kvx.eval.scoring import (
    METRICS,
    metric_table,
    postprocess,
    score_samples,
    score_task,
    string_match_all,
    string_match_part,
)
from sglang_kvx.eval.tasks import (
    SESSION_TASKS,
    TASKS,
    Sample,
    Session,
    Turn,
    generate_sample,
    generate_samples,
    generate_session,
)

__all__ = [
    "LENGTH_TOLERANCE",
    "METRICS",
    "SESSION_TASKS",
    "TASKS",
    "Sample",
    "Session",
    "Turn",
    "count_tokens",
    "default_tokenizer",
    "encode",
    "generate_sample",
    "generate_samples",
    "generate_session",
    "metric_table",
    "postprocess",
    "score_samples",
    "score_task",
    "string_match_all",
    "string_match_part",
]
