"""The progress bar of long steps (writing and tokenizing datasets, scoring benchmarks)."""


def progress_bar(**kwargs):
    """A tqdm bar as wide as the terminal (a widget in a notebook); `kwargs` are tqdm's."""
    from tqdm.auto import tqdm

    return tqdm(dynamic_ncols=True, **kwargs)
