"""The note a multi-node job that can restart gets when a node that leaves could not rejoin: the worker
environment torch 2.13's agent writes (local_elastic_agent.py), with and without the shared store."""

import pytest

from nanochat_fast.core import distributed

AGENT = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}


@pytest.mark.parametrize(
    "env, noted",
    [
        ({**AGENT, "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),  # torch's default: the store shared
        ({**AGENT, "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        ({**AGENT, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),
        ({**AGENT, "TORCHELASTIC_USE_AGENT_STORE": "True", "LOCAL_WORLD_SIZE": "4"}, False),  # one node
        ({"WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),  # no agent's restart count
    ],
)
def test_the_note_names_only_a_job_whose_lost_node_could_not_rejoin(monkeypatch, env, noted):
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed._node_cannot_rejoin() is noted
