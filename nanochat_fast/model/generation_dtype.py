"""
What a generating command (infer_bench, chat_cli, chat_eval, chat_web) times for its --dtype auto: its own
mix of prefills and decode steps at its batch, in fp32 and under bf16 autocast (kind "generation" in
hardware/precision's cache). Not the training step's choice: a one-row decode step reads the weights
through our packed fp32 kernels, under bf16 the stock matmuls run (docs/measurements.md#generation-dtype).
"""

from dataclasses import asdict, dataclass, replace

import torch

from ..hardware import precision
from .batch_engine import BatchEngine, Request, check_positive_ints
from .loading import config_from_fields, meta_model, new_model

# the budget for timing a mix: these commands start in front of a user (later runs read the cache)
MAX_SECONDS = 10.0
# a chat turn, which a command cannot know in advance: a prompt of the chat template and a short conversation,
# a reply of at most this many tokens (--max-tokens is a cap, not a length: docs/measurements.md#generation-dtype)
CHAT_PROMPT_TOKENS = 64
CHAT_REPLY_TOKENS = 64


@dataclass(frozen=True)
class GenerationMix:  # what a command generates: `batch` rows of a prompt and decode_tokens tokens
    batch: int
    prompt_tokens: int
    decode_tokens: int

    def __post_init__(self):
        check_positive_ints(**asdict(self))


def chat_mix(config, batch: int, max_tokens: int) -> GenerationMix:
    """`batch` rows of a CHAT_PROMPT_TOKENS prompt, replies of max_tokens up to CHAT_REPLY_TOKENS, in context."""
    prompt = max(1, min(CHAT_PROMPT_TOKENS, config.sequence_len // 2))
    return GenerationMix(batch, prompt, max(1, min(max_tokens, CHAT_REPLY_TOKENS, config.sequence_len - prompt)))


def generation_work(model, mix: GenerationMix, device) -> precision.Work:
    """The mix, greedy on random prompts, each dtype with its own engine (a cache takes its first keys' dtype);
    a meta-device model (--tune's) is built only if the timing fits."""
    config, device = model.config, torch.device(device)

    def make():
        net = new_model(config, device) if next(model.parameters()).is_meta else model
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(config.vocab_size, (mix.batch, mix.prompt_tokens), generator=gen).tolist()
        max_len = mix.prompt_tokens + mix.decode_tokens

        def call(dtype):
            engine = BatchEngine(net, None, mix.batch, max_len=max_len)

            def run():
                with precision.autocast(device, dtype):
                    for ids in prompts:
                        engine.add(Request(ids, mix.decode_tokens, use_tools=False))
                    while engine.active:
                        engine.step()

            return run

        return {name: call(dtype) for name, dtype in precision.DTYPES.items()}

    d, rows = config.n_embd, mix.batch * mix.prompt_tokens
    shape = f"{mix.batch} row(s) x ({mix.prompt_tokens} prompt + {mix.decode_tokens} generated tokens)"
    params = sum(p.numel() for p in model.parameters())
    return precision.Work(
        "generation",
        dict(config=asdict(config), **asdict(mix)),
        what=f"this model's generation ({shape})",
        flops=2.0 * params * mix.batch * (mix.prompt_tokens + mix.decode_tokens),
        make=make,
        matmuls=[(rows, d, config.vocab_size), (rows, d, 4 * d), (rows, 4 * d, d)],
    )


def _meta_work(spec: dict, device) -> precision.Work:
    """How --tune re-times a cached generation timing: its model's shapes, random weights."""
    model = meta_model(config_from_fields(spec["config"]))  # of its own family (window_pattern: windowed)
    mix = GenerationMix(spec["batch"], spec["prompt_tokens"], spec["decode_tokens"])
    return generation_work(model, mix, device)


precision.register("generation", _meta_work)


def choose(device, requested: str, model, mix: GenerationMix):
    """The Precision generation runs in, `mix` the work to time."""
    return precision.choose(device, requested, work=generation_work(model, mix, device), max_seconds=MAX_SECONDS)


def for_generation(dev, requested: str, model, mix: GenerationMix):
    """`dev` (a ProcessSetup) with generation's precision; an explicit --dtype, or a GPU, keeps dev's."""
    if dev.device.type != "cpu" or requested != "auto":
        return dev
    return replace(dev, precision=choose(dev.device, requested, model, mix))
