"""
Pretrain a GPT on the prepared text corpus (the nanochat base_train, runnable anywhere).

    python -m nanochat_fast.scripts.base_train --depth=4 --max-seq-len=256 --device-batch-size=8 \\
        --total-batch-size=8192 --num-iterations=200
    torchrun --standalone --nproc_per_node=8 -m nanochat_fast.scripts.base_train -- --depth=20

Two loops, as in nanochat: each optimizer step accumulates gradients over
grad_accum_steps = total_batch_size // (device_batch_size * max_seq_len * world_size) micro-steps.
The horizon comes from --num-iterations, else --target-flops, else --target-param-data-ratio
(Chinchilla-style tokens:params). Outputs go to NANOCHAT_FAST_HOME/runs/<run>/ (or --out-dir):
checkpoints, metrics.jsonl, loss.png and report.md. Stop it any time with Ctrl-C or SIGTERM: it
finishes the step, saves, and says how to resume (--resume auto; bit for bit on one CPU process
with --deterministic).
"""
from .. import checkpoint, cli, generation, runs
from ..cli import UserError
from ..common import compute_cleanup, compute_init, print0
from ..dataloader import TokenRowLoader
from ..gpt import GPT, config_from_depth
from ..tokenizer import get_token_bytes, get_tokenizer
from ..runs import add_loop_args, add_optim_args, add_run_args

DEFAULT_PROMPTS = ["The king said", "In the beginning", "To be, or not to be", "The whale"]


def build_parser():
    p = cli.ArgumentParser(prog="python -m nanochat_fast.scripts.base_train", description=__doc__)
    g = p.add_argument_group("model")
    g.add_argument("--depth", type=cli.positive_int, default=20, help="transformer layers; sets width and heads")
    g.add_argument("--aspect-ratio", type=cli.positive_int, default=64, help="n_embd ~= aspect_ratio * depth")
    g.add_argument("--head-dim", type=cli.positive_int, default=128, help="attention head dimension")
    g.add_argument("--max-seq-len", type=cli.positive_int, default=2048, help="context length (tokens)")
    g = p.add_argument_group("data and batch")
    g.add_argument("--dataset", default="base", help="dataset name under NANOCHAT_FAST_HOME/tokens/")
    g.add_argument("--device-batch-size", type=cli.positive_int, default=32, help="rows per micro-step per process")
    g.add_argument("--total-batch-size", type=cli.positive_int, default=524288, help="tokens per optimizer step, all processes")
    g = p.add_argument_group("horizon (first one set wins)")
    g.add_argument("--num-iterations", type=int, default=-1, help="optimizer steps (-1: use the next option)")
    g.add_argument("--target-flops", type=float, default=-1.0, help="training FLOPs budget (-1: use the next option)")
    g.add_argument("--target-param-data-ratio", type=float, default=20.0, help="tokens per parameter (Chinchilla ~20)")
    add_optim_args(p)
    add_loop_args(p, eval_every=250, sample_every=2000)
    add_run_args(p)
    return p


def horizon(args, model, tokens_per_step) -> int:
    if args.num_iterations > 0:
        return args.num_iterations
    if args.target_flops > 0:
        return max(1, round(args.target_flops / (model.estimate_flops() * tokens_per_step)))
    if args.target_param_data_ratio > 0:
        return max(1, round(args.target_param_data_ratio * model.num_scaling_params() / tokens_per_step))
    raise UserError("no training horizon: pass --num-iterations N (> 0), --target-flops F or "
                    "--target-param-data-ratio R")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    ddp, rank, local_rank, world_size, device = compute_init(args.device_type, seed=args.seed,
                                                             deterministic=args.deterministic)
    loader = None
    try:
        grad_accum_steps = runs.grad_accum_steps(args, world_size)
        tokenizer = get_tokenizer()
        run_name = args.run or f"base_d{args.depth}"
        run_dir, ckpt, meta = runs.open_run_dir(args, run_name, rank, phase="base", device=device)
        config = config_from_depth(args.depth, tokenizer.get_vocab_size(), args.max_seq_len,
                                   aspect_ratio=args.aspect_ratio, head_dim=args.head_dim)
        model_state = None
        if ckpt is not None:
            runs.check_compatible(meta, ckpt, config, tokenizer)
            model_state = checkpoint.load_model_state(ckpt, device)
        model, orig_model, optimizers = runs.build_model(GPT, config, device, args, model_state)
        token_bytes = get_token_bytes(device=device)

        tokens_per_step = args.total_batch_size
        num_iterations = horizon(args, orig_model, tokens_per_step)
        loader = TokenRowLoader(dataset=args.dataset, split="train", device_batch_size=args.device_batch_size,
                                seq_len=args.max_seq_len, rank=rank, world_size=world_size, device=device)
        runs.check_shards(loader, tokenizer)

        def val_batches():
            return runs.val_batches(TokenRowLoader, dataset=args.dataset, eval_tokens=args.eval_tokens,
                                    device_batch_size=args.device_batch_size, seq_len=args.max_seq_len,
                                    rank=rank, world_size=world_size, device=device)

        def sample():
            return [prompt + generation.complete(orig_model, tokenizer, prompt, 16) for prompt in DEFAULT_PROMPTS]

        run = runs.make_run(
            args, model=model, orig_model=orig_model, optimizers=optimizers, loader=loader,
            val_batches=val_batches, token_bytes=token_bytes, run_dir=run_dir,
            grad_accum_steps=grad_accum_steps, tokens_per_step=tokens_per_step,
            num_iterations=num_iterations, progress=lambda step: step / num_iterations,
            epoch_done=lambda: False, sample=sample, config=config, tokenizer=tokenizer, phase="base",
            device=device, rank=rank, world_size=world_size, argv=argv)
        print0(runs.summary(run, config, orig_model, extra={
            "horizon": f"{num_iterations:,} steps = {num_iterations * tokens_per_step:,} tokens "
                       f"({num_iterations * tokens_per_step / orig_model.num_scaling_params():.2f} tokens/param)"}))
        return runs.train_and_report(run, ckpt, meta, title=f"base training: {run_name}")
    finally:
        if loader is not None:
            loader.close()
        compute_cleanup()


if __name__ == "__main__":
    cli.run(main)
