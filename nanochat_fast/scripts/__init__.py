"""The commands, each `python -m nanochat_fast.scripts.NAME` (--help says what it does): the pipeline prepare_data,
tok_train, base_train, base_eval, mid_train, chat_sft, chat_rl, chat_eval and report; chat_cli and chat_web to talk
to a model; infer_bench for serving speed; export_checkpoint, import_nanochat and export_nanochat for checkpoints."""
