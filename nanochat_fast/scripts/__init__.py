"""Command-line scripts, each run as `python -m nanochat_fast.scripts.NAME --help`:

prepare_data   text shards from the default corpus or your own files, then token shards;
               --datasets=eval: the benchmark sets
tok_train      trains the BPE tokenizer on the prepared text and tokenizes the datasets
base_train     pretraining                      mid_train   conversations (mid-training)
chat_sft       supervised fine-tuning           base_eval   bits per byte, samples, CORE subset
chat_rl        reinforcement learning (GSM8K)
chat_eval      the chat benchmarks              report      the report card of a pipeline
chat_cli       talk to a model in the terminal  chat_web    talk to a model in the browser
"""
