"""The hook's settings from a training process's environment, and its public surface."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from producers import torch_hook
from producers.torch_hook.hook import HookSettings


def test_settings_come_from_the_environment():
    s = HookSettings.from_env({})
    assert (s.agent, s.resolved_job(), s.local_rank) == (False, "torch-job", None)
    env = {"FLARE_AGENT": "1", "TORCHELASTIC_RUN_ID": "run-42", "LOCAL_RANK": "3",
           "FLARE_AGENT_SOCKET": "/run/x.sock", "FLARE_AGENT_INTERVAL_S": "0.5"}
    s = HookSettings.from_env(env)
    assert (s.agent, s.resolved_job(), s.local_rank, s.agent_socket, s.agent_interval_s) == (
        True, "run-42", 3, "/run/x.sock", 0.5)
    # Flare's own names win over the launcher's
    s = HookSettings.from_env({**env, "FLARE_JOB": "job-7", "FLARE_LOCAL_RANK": "5"})
    assert (s.resolved_job(), s.local_rank) == ("job-7", 5)
    assert HookSettings.from_env({"FLARE_JOB": "none"}).resolved_job() == "torch-job"


def test_under_slurm_the_node_and_the_jobs_nodes_come_from_slurm():
    env = {"SLURMD_NODENAME": "gpu-07", "SLURM_JOB_NODELIST": "gpu-[05-08]"}
    s = HookSettings.from_env(env)
    assert (s.node, s.job_nodes) == ("gpu-07", "gpu-[05-08]")
    s = HookSettings.from_env({**env, "FLARE_NODE": "n7", "FLARE_JOB_NODES": "n[1-2]"})
    assert (s.node, s.job_nodes) == ("n7", "n[1-2]")


@pytest.mark.parametrize("value, on", [("true", True), ("yes", True), ("0", False),
                                       ("off", False)])
def test_the_switch_reads_like_a_boolean(value, on):
    assert HookSettings.from_env({"FLARE_AGENT": value}).agent is on
    assert HookSettings.from_env({"flare_agent": value}).agent is on  # names in any case


def test_a_bad_value_says_which_setting():
    with pytest.raises(ValidationError, match="local_rank"):
        HookSettings.from_env({"LOCAL_RANK": "x"})


def test_the_package_is_the_user_api():
    assert torch_hook.install is torch_hook.hook.install
    assert torch_hook.active() is None  # nothing installed in the test process
    with torch_hook.phase("fwd"):  # a no-op without a hook
        torch_hook.step()
