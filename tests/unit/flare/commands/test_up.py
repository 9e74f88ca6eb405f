"""`flare up`'s incident line: the culprit, what it costs so far, and the summary."""

from flare.commands.up import cost_phrase, incident_line


def test_an_incident_line_says_what_it_costs_in_gpu_hours_once_there_are_some() -> None:
    inc = {"culprit": "rank:3", "kind": "gpu", "job": "j", "opened_step": 42,
           "summary": "rank 3 computes 50% slower", "slowdown": 1.314,
           "lost_gpu_seconds": 4320.0, "lost_gpu_seconds_per_step": 38.2}
    assert incident_line(inc) == (
        "INCIDENT rank:3 [gpu] costs 1.2 GPU-h so far (38 GPU-s/step, job ×1.31)  "
        "job j, step 42: rank 3 computes 50% slower")


def test_a_small_cost_is_in_gpu_seconds_and_a_record_without_cost_says_zero() -> None:
    assert cost_phrase({"lost_gpu_seconds": 95.0, "lost_gpu_seconds_per_step": 9.5,
                        "slowdown": 1.1}) == "costs 95 GPU-s so far (9.5 GPU-s/step, job ×1.10)"
    assert cost_phrase({}) == "costs 0 GPU-s so far (0.0 GPU-s/step, job ×1.00)"
