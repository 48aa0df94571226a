"""
Evaluate a trained checkpoint: validation bits per byte, a subset of the CORE benchmark, and a few
sample completions.

    python -m nanochat_fast.scripts.base_eval                      # newest base run, newest checkpoint
    python -m nanochat_fast.scripts.base_eval --run=base_d4 --step=200 --eval-tokens=65536 --max-examples=500
    torchrun --nproc_per_node=8 -m nanochat_fast.scripts.base_eval -- --run=base_d20

Bits per byte (bpb) is the next-token loss in bits divided by the UTF-8 bytes of the predicted
tokens, so it compares models with different tokenizers; it is measured on the val split of the
run's dataset (a mid-trained checkpoint on the conversations, assistant tokens only), the same rows
on any number of processes. The CORE subset is the 10 of CORE's 22 tasks we have offline
(prepare_data --datasets=eval; without it, CORE is skipped with a note), not comparable with
published CORE scores (docs/measurements.md#core-subset). Results go to the run's evals.json for the report card.
"""

import torch

from .. import checkpoints
from ..core import cli
from ..core.distributed import print0
from ..data.dataloader import ConversationRowLoader, TokenRowLoader
from ..data.tokenizer import get_token_bytes, get_tokenizer
from ..evals import prepared_benchmarks, task_runner, tasks
from ..evals.task_runner import evaluate_bpb_each
from ..model import generation, loading
from ..train.stage_data import val_batches
from ..train.training_config import DeviceConfig, evaluation_process
from .base_train import DEFAULT_PROMPTS


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.base_eval", description=__doc__)
    cli.add_checkpoint_flags(p, newest="the newest base run")
    p.add_argument(
        "--dataset",
        type=cli.plain_name,
        default="",
        help="dataset to evaluate on (default: the one the run trained on)",
    )
    p.add_argument("--eval-tokens", type=cli.positive_int, default=20 * 2048 * 8, help="validation tokens")
    p.add_argument("--device-batch-size", type=cli.positive_int, default=8, help="rows per forward pass per process")
    p.add_argument(
        "--max-examples",
        type=cli.non_negative_int,
        help="CORE items per task, a fixed random sample (default: all; 0: skip CORE)",
    )
    p.add_argument("--samples", type=cli.non_negative_int, default=len(DEFAULT_PROMPTS), help="completions to print")
    p.add_argument("--max-tokens", type=cli.positive_int, default=24, help="tokens per completion")
    DeviceConfig.add_flags(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with evaluation_process(args) as dev:
        tokenizer = get_tokenizer()
        run_dir = checkpoints.run_dir_of(args.run, ("base",))
        model, ckpt, meta = loading.load_model(run_dir, args.step, dev.device, tokenizer)
        seq_len, chat = model.config.sequence_len, meta["phase"] != "base"
        dataset = args.dataset or meta["args"].get("dataset") or ("chat" if chat else "base")
        Loader, extra = (ConversationRowLoader, {"tokenizer": tokenizer}) if chat else (TokenRowLoader, {})

        def make_loader(split, rank, world_size):
            return Loader(dataset, split, args.device_batch_size, seq_len, rank, world_size, dev.device, **extra)

        batches = val_batches(make_loader, args.eval_tokens, args.device_batch_size, seq_len, dev.rank, dev.world_size)
        tables = [get_token_bytes(device=dev.device)]
        old_bytes = meta.get("imported_from", {}).get("nanochat_token_bytes")
        if old_bytes:  # nanochat's token_bytes.pt computed the old way: its figure beside the true one
            tables.append(tables[0].clone())
            tables[1][[int(i) for i in old_bytes]] = torch.tensor(list(old_bytes.values()), dtype=tables[0].dtype)
        bpbs = evaluate_bpb_each(model, batches, tables, dev.autocast())
        bpb = bpbs[0]
        print0(f"checkpoint: {ckpt}")
        print0(f"val bpb ({dataset} val split, up to {args.eval_tokens:,} tokens): {bpb:.4f}")
        results = {"val_bpb": {"value": bpb, "dataset": dataset, "eval_tokens": args.eval_tokens}}
        if old_bytes:
            print0(
                f"val bpb with nanochat's token_bytes.pt ({len(old_bytes)} tokens counted the old way, as "
                f"nanochat's own figures are): {bpbs[1]:.4f}"
            )
            results["val_bpb"]["with_nanochat_token_bytes"] = bpbs[1]
        results.update(core_subset_if_prepared(model, tokenizer, args, dev))
        if dev.rank == 0:
            print(f"results: {task_runner.record(run_dir, meta['step'], 'base_eval', results)}")
            with dev.autocast():
                for prompt in DEFAULT_PROMPTS[: args.samples]:
                    print(f"  {prompt!r} -> {generation.complete(model, tokenizer, prompt, args.max_tokens)!r}")
        return 0


def core_subset_if_prepared(model, tokenizer, args, dev) -> dict:
    """{"core_subset": results} on the tasks whose data is prepared, printed task by task; {} when skipped."""
    if args.max_examples == 0:
        return {}
    available = [t for t in tasks.CORE_SUBSET if prepared_benchmarks.read_task_manifest(t.folder) is not None]
    if not available:
        print0(f"{tasks.SUBSET_NAME}: skipped, no evaluation data ({prepared_benchmarks.PREPARE_HINT})")
        return {}

    def show(label, c):
        cut = f" | {task_runner.truncated_note(c['truncated'], c['total'])}" if c["truncated"] else ""
        print0(
            f"  {label:<20} {100 * c['accuracy']:6.2f}% ({c['correct']}/{c['total']}) | centred {c['centred']:+.4f} "
            f"| {c['seconds']:.1f} s{cut}",
            flush=True,
        )

    sample = f"{args.max_examples} items per task" if args.max_examples else "every item"
    print0(f"CORE subset ({len(available)} of the {len(tasks.CORE_SUBSET)} tasks we have offline, {sample}):")
    with dev.autocast():
        summary = task_runner.core_subset(
            model, tokenizer, available, args.max_examples, dev.rank, dev.world_size, args.device_batch_size, True, show
        )
    print0(f"{summary['name']}: {summary['core_subset']:.4f} (mean centred accuracy; not comparable with full CORE)")
    return {"core_subset": {**summary, "max_examples": args.max_examples}}


if __name__ == "__main__":
    cli.run(main)
