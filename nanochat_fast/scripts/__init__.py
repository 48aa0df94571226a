"""Command-line scripts, each run as `python -m nanochat_fast.scripts.NAME --help`:

    prepare_data   text shards from the default corpus or your own files, then token shards
    tok_train      trains the BPE tokenizer on the prepared text and tokenizes the datasets
    base_train     pretraining                      mid_train   conversations (mid-training)
    base_eval      bits per byte and samples        chat_cli    talk to a model
"""
