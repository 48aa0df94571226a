"""What the tests share: tiny pipelines and models, stub engines, multi-process workers, fixtures.

Imported by name (`from support.tiny_gpt import random_model`): pytest puts python_tests/ on sys.path
(pyproject.toml), and importing this package puts it on PYTHONPATH too, so the workers and fault
injectors the tests start as scripts import it the same way."""

import os
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_TESTS, os.environ.get("PYTHONPATH")]))
