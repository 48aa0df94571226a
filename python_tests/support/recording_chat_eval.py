"""
chat_eval with the categorical tasks' per-example records kept, for evals/test_chat_eval.py's comparison
of 1 and 2 processes (the counts alone can agree while the examples' answers differ). Under
    python -m torch.distributed.run --standalone --nproc_per_node=N python_tests/support/recording_chat_eval.py -- ARGS
each rank runs chat_eval.main(ARGS) and writes the records of the examples it scored (the task, the
example's id, the letters' logits, the chosen letter) to $RECORDS_DIR/rank<R>.jsonl.
"""

import json
import os
import sys
from pathlib import Path

from nanochat_fast.evals import scoring
from nanochat_fast.scripts import chat_eval


def recording(categorical_counts, sink):
    """scoring.categorical_counts, also handing each example's record (with its task's name) to sink."""

    def counts_and_records(model, tokenizer, task, examples, *args, **kwargs):
        counts = categorical_counts(model, tokenizer, task, examples, *args, **kwargs)
        for record in counts.records:
            sink(dict(record, task=task.name))
        return counts

    return counts_and_records


if __name__ == "__main__":
    path = Path(os.environ["RECORDS_DIR"]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    with open(path, "w") as f:
        # chat_eval reaches categorical_counts through the scoring module (evals/task_runner.chat_task)
        scoring.categorical_counts = recording(scoring.categorical_counts, lambda r: f.write(json.dumps(r) + "\n"))
        args = sys.argv[1:]
        code = chat_eval.main(args[1:] if args[:1] == ["--"] else args)
    sys.exit(code)
