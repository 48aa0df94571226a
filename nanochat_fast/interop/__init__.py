"""
nanochat's own file formats, read and written, so a model moves between nanochat and nanochat_fast
(scripts/import_nanochat.py and scripts/export_nanochat.py are the commands):

    nanochat_checkpoint.py   its checkpoint folder: model_NNNNNN.pt and meta_NNNNNN.json to ours and back
    nanochat_optimizer.py    its per-rank optimizer files in our world-size independent optimizer state
    nanochat_tokenizer.py    its tokenizer.pkl, read through a restricted unpickler, and written

Only this folder knows those formats (python_tests/test_architecture.py checks it). Tensor files
are read and written through the checkpoint home (nanochat_fast.checkpoints).
"""
