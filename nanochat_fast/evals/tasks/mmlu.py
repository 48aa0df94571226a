"""MMLU: four-choice questions in 57 subjects. Evaluated on test (14,042); dev (5 per subject, the
few-shot pool) and validation may be trained on."""

from .task_types import MultipleChoiceTask


class MMLU(MultipleChoiceTask):
    name, folder = "MMLU", "mmlu"
    chance = 0.25
    eval_split = "test"
    train_splits = ("dev", "validation")
