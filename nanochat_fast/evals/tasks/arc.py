"""ARC (AI2 Reasoning Challenge): grade-school science questions with 3-5 choices, Easy and
Challenge sets. Evaluated on test; validation may be trained on."""

from .task_types import MultipleChoiceTask


class ARC(MultipleChoiceTask):
    chance = 0.25  # almost all questions have four choices
    eval_split = "test"
    train_splits = ("validation",)

    def __init__(self, subset: str):
        if subset not in ("ARC-Easy", "ARC-Challenge"):
            raise ValueError(f"ARC subset must be ARC-Easy or ARC-Challenge, got {subset!r}")
        self.name, self.folder = subset, subset.lower()
