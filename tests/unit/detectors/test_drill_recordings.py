"""Recordings of real training with a real fault (`flare drill`), diagnosed as the worker would.

Each is what a drill's broker received: eight gloo ranks of a small tensor-, pipeline- and
data-parallel transformer on four network namespaces, with only some ranks running the hook
(`--traced tp0`: one per node, as production tracers often record only tensor-parallel rank
0; `half`: rank 0 and a random half), and one real fault from step 27: a rank's CPU held to a
tenth of a core by a cgroup quota, the rank frozen by the cgroup freezer, or killed.
Simulated jobs never showed the failures below: they are large enough for every group to
have stage peers, their traced ranks' residuals are never each other's mirror, their ranks
report each step the moment it ends and never die of a peer's lost connection, and their
frozen ranks are never caught inside a collective or behind untraced peers only.
"""

from __future__ import annotations

from pathlib import Path

from flare.offline import diagnose_messages, recording_messages

DRILLS = Path(__file__).resolve().parents[2] / "data" / "drills"
ONSET = 27  # the first step wholly under the fault
DEFAULT_ONSET = 42  # the same, in drills run with the command's default 40 steps before it


def _device_incidents(name: str) -> list[tuple[int, str, str]]:
    res = diagnose_messages(recording_messages(str(DRILLS / name)))
    return sorted((i.opened_step, i.kind, i.culprit) for i in res.incidents.values()
                  if i.kind != "job")


def test_a_slow_rank_that_is_not_traced_is_named_by_its_node():
    """Rank 3 is not traced; rank 2, on its node, waits for it at every tensor-parallel
    all-reduce. With two nodes per stage there are no stage peers to compare the wait with:
    it was a "job-wide shift, no device to blame"."""
    [(opened, kind, culprit)] = _device_incidents("tp0-slow-untraced-rank3.jsonl.gz")
    assert (kind, culprit) == ("gpu", "node:node-1")
    assert ONSET - 1 <= opened <= ONSET + 3


def test_a_throttled_rank_is_one_incident_while_it_shows_through_its_host():
    """Rank 2 is its stage's only traced rank beside rank 0, whose residual mirrors its own
    and widened the noise: its evidence as a slow GPU faded after six steps while its node's
    host kept showing idle gaps every few steps. That opened a second incident, a second
    page for the one fault."""
    [(opened, kind, culprit)] = _device_incidents("tp0-throttled-rank2.jsonl.gz")
    assert (kind, culprit) == ("gpu", "rank:2")
    assert ONSET - 1 <= opened <= ONSET + 3


def test_a_throttled_rank_whose_gaps_stand_out_more_than_its_compute_is_its_gpu():
    """Rank 6 held to a tenth of a CPU: its compute ×3 (0.3 s per step) and its gaps +87 ms.
    Both readings confirmed in the same step, and the gaps' higher z (11 against 10) paged a
    host stall; the compute costs the step three times as much."""
    [(opened, kind, culprit)] = _device_incidents("all-throttled-rank6-gaps-and-compute.jsonl.gz")
    assert (kind, culprit) == ("gpu", "rank:6")
    assert DEFAULT_ONSET - 1 <= opened <= DEFAULT_ONSET + 3


def test_the_partner_of_a_rank_that_ran_fast_is_not_a_slow_gpu():
    """Before the fault, on a machine loaded by other work, rank 5 computed 5× faster than
    usual for a few steps (its phases 11 ms instead of 55) and waited for its TP partner,
    rank 4, at every all-reduce. Against the pair rank 4 read +80%, against its stage -6%:
    a GPU incident opened on it, saying it computed -6% slower. Then rank 2 was throttled."""
    [(opened, kind, culprit)] = _device_incidents("all-throttled-rank2-partner-fast.jsonl.gz")
    assert (kind, culprit) == ("gpu", "rank:2")
    assert DEFAULT_ONSET - 1 <= opened <= DEFAULT_ONSET + 3


def test_a_nic_that_costs_within_the_jobs_noise_waits_for_one_more_step():
    """Eight ranks on two cores beside other work: in steps 9-12 node-1's tiny transfers took
    ×10 on 3 steps of 5, and its NIC opened as slow, costing ×1.05 in steps that vary by
    about 6%. A link or switch whose cost is within the job's own noise needs a fourth
    significant step. Then rank 4 was killed."""
    [(opened, kind, culprit)] = _device_incidents("all-killed-rank4-early-nic.jsonl.gz")
    assert (kind, culprit) == ("hang", "rank:4")
    assert opened == DEFAULT_ONSET - 1


def _hangs(name: str) -> list[tuple[int, str, str, str]]:
    res = diagnose_messages(recording_messages(str(DRILLS / name)))
    return sorted((i.opened_step, i.kind, i.culprit, i.summary) for i in res.incidents.values()
                  if i.kind != "job")


def test_a_killed_rank_died_in_the_step_after_the_newest_it_finished():
    """Its last table was two steps old, and its last finished steps were read but not yet
    assembled when its peers' wait turned into a hang: it was placed in step 24, before the
    fault (the drill's judge called the right incident a false alarm)."""
    [(opened, kind, culprit, summary)] = _hangs("tp0-killed-rank2.jsonl.gz")
    assert (opened, kind, culprit) == (ONSET - 1, "hang", "rank:2")
    assert "died in step 26" in summary


def test_a_rank_that_died_of_its_untraced_peers_lost_connection_names_the_peers_node():
    """Rank 3 is not traced; rank 2 beside it, the first traced rank to die, died of
    "Connection reset by peer" in their tensor-parallel all-reduce: a victim, not the cause."""
    [(opened, kind, culprit, summary)] = _hangs("tp0-killed-untraced-rank3.jsonl.gz")
    assert (kind, culprit) == ("hang", "node:node-1") and opened == ONSET - 1
    assert "not traced" in summary and "peer rank 2" in summary


def test_a_rank_frozen_inside_an_all_reduce_is_the_hang_not_its_untraced_peer():
    """Rank 2 froze inside its tensor-parallel all-reduce; its only peer there is untraced,
    so nothing showed the peer done with it. Its node says its process cannot run: it waits
    on nobody (read as a hang of the untraced peer's node before)."""
    [(opened, kind, culprit, summary)] = _hangs("tp0-frozen-rank2-in-all-reduce.jsonl.gz")
    assert (opened, kind, culprit) == (ONSET - 1, "hang", "rank:2")
    assert "inside all_reduce of tp.1, its process" in summary


def test_a_frozen_rank_whose_peers_are_all_untraced_is_still_the_hang():
    """A random half traced (ranks 0, 3, 4, 6): rank 3 froze between ops, and every peer it
    shares a group with is untraced, so the traced ranks wait on untraced ones only (rank 0
    in a data-parallel all-reduce). Its node says its process cannot run: that is where
    the waits end (it read as a hang of the data-parallel group before)."""
    [(opened, kind, culprit, summary)] = _hangs("half-frozen-rank3-peers-untraced.jsonl.gz")
    assert (opened, kind, culprit) == (ONSET - 1, "hang", "rank:3")
    assert "through peers that are not traced" in summary


def test_a_significant_slowdown_that_costs_nothing_opens_no_incident():
    """Every rank traced, rank 2 throttled from step 27. On a loaded machine the tiny
    transfers through node-2 ran 4-10 ms long on four steps before the fault, significant
    enough to confirm a NIC ("the job loses 0.00 s per step"): a false page one step before
    the right one. The job would be no faster without it, so it is no incident."""
    assert [(k, c) for _o, k, c in _device_incidents("all-throttled-rank2-nic-noise.jsonl.gz")
            ] == [("gpu", "rank:2")]


def test_a_link_significant_on_steps_the_job_ran_faster_than_usual_waits():
    """Every rank traced on a machine running 8 ranks on 2 cores, rank 2 throttled from step
    27 (CI's live slow-rank drill). Before the fault the tiny pipeline sends between node-0
    and node-2 took ×5.6 their usual on steps 7, 10 and 11 (z 8.6, 4.5, 6.7; 5-18 ms of
    0.32 s steps), while the job's steps ran faster than its usual: three significant steps
    in five confirmed the link and paged it at step 11. The job never felt it, so it waits
    for one more significant step, which never came."""
    [(opened, kind, culprit)] = _device_incidents("all-throttled-rank2-link-wakeups.jsonl.gz")
    assert (kind, culprit) == ("gpu", "rank:2")
    assert ONSET - 1 <= opened <= ONSET + 3


def test_a_nic_is_named_when_each_step_runs_two_of_each_transfer():
    """Node-1's NIC held to 20 Mbit/s, one rank per node traced: a step has two traced
    data-parallel all-reduces across nodes and two of each pipeline send, too few to tell
    within the step which is slow. Every traced transfer through node-1 ran ×50–500 its own
    usual, and it read as a "job-wide shift, no device to blame"."""
    [(opened, kind, culprit)] = _device_incidents("tp0-nic-node-1.jsonl.gz")
    assert (kind, culprit) == ("link", "node:node-1")
    assert ONSET - 1 <= opened <= ONSET + 3


def test_a_nic_whose_every_traced_transfer_is_lone_is_named_and_not_before():
    """The same fault with half the ranks traced: the only transfers seen from both ends all
    pass through node-1, and the second micro-batch's pipeline send is ×10 its peers in every
    healthy step. Judged by the kind's usual transfer it paged for node-1 at step 9, 18 steps
    before the fault; each transfer is now held to its own past."""
    [(opened, kind, culprit)] = _device_incidents("half-nic-node-1.jsonl.gz")
    assert (kind, culprit) == ("link", "node:node-1")
    assert ONSET - 1 <= opened <= ONSET + 3


def test_a_throttled_rank_whose_stage_is_a_lone_pair_is_named():
    """Half the ranks traced: rank 2's stage has one other traced rank (rank 0) and no other
    stage of the job compares the same way, so leaving the pair out of the noise pool left
    nobody. The throttle's own residuals then widened the σ it was judged by (z 6.0, 4.7,
    3.9, then nothing) and it was never confirmed: a "job-wide shift"."""
    [(opened, kind, culprit)] = _device_incidents("half-throttled-rank2-lone-pair.jsonl.gz")
    assert (kind, culprit) == ("gpu", "rank:2")
    assert ONSET - 1 <= opened <= ONSET + 3


def test_a_nic_of_a_two_node_job_is_named_as_the_link_between_them():
    """Two nodes, one pipeline stage each (TP4·PP2) and node-0's NIC held to 20 Mbit/s; then
    the same with the two nodes as data-parallel replicas (TP4·DP2). Every transfer across
    nodes goes through both NICs and the path between, so the step has no other transfer to
    compare one with, and which NIC it is, nothing in the timing says. Both read as a
    "job-wide shift, no device to blame" with the step ×6-8; the narrowest entity the data
    supports is the link, and its summary says that the two ends cannot be told apart."""
    for name in ("two-nodes-pp2-nic-node-0.jsonl.gz", "two-nodes-dp-nic-node-0.jsonl.gz"):
        [(opened, kind, culprit, summary)] = _hangs(name)
        assert (kind, culprit) == ("link", "link:node-0~node-1")
        assert ONSET - 1 <= opened <= ONSET + 3
        assert "cannot tell which" in summary


FLAP_ONSET = DEFAULT_ONSET  # the flapping drills' first step under the limit (2 s on, 2 s off)
# (the limit begins during the step before: its first burst may page in it, latency -1)


def test_a_flapping_nic_is_its_nic_not_the_link_its_queued_sends_took():
    """Node-3's NIC held to 20 Mbit/s 2 s in every 4, every rank traced. A burst stalls one
    step's all-reduces and transfers through node-3 (the NIC), and in the next only the
    pipeline sends still queued behind it, which name the link node-1~node-3. Its bursts read
    as NIC, link, NIC, link, with the NIC's first step just under the bar (z 3.99): the page
    named the link."""
    [(opened, kind, culprit)] = _device_incidents("flapping-nic-node-3-burst-as-link.jsonl.gz")
    assert (kind, culprit) == ("link", "node:node-3")
    assert FLAP_ONSET <= opened <= FLAP_ONSET + 6  # its second burst (52 before bursts)


def test_a_flapping_nic_is_named_on_its_first_burst_when_it_stalls_two_steps():
    """Node-1's NIC flapping: its first burst more than tripled two steps, the first naming
    node-1's NIC, the second the link from node-1 its queued sends took (a buffered send
    returns at once, so the step's transfers show little of what it lost). Its bursts then
    went unnamed or named one step each, 27 steps apart: it was never paged."""
    [(opened, kind, culprit)] = _device_incidents("flapping-nic-node-1.jsonl.gz")
    assert (kind, culprit) == ("link", "node:node-1")
    assert FLAP_ONSET - 1 <= opened <= FLAP_ONSET + 2


def test_a_flapping_nic_seen_as_its_pipeline_link_bursts_later_is_still_its_nic():
    """Node-1's NIC flapping, every rank traced: its bursts were named as its NIC at steps 48
    and (under the bar) 41, then as its pipeline link to node-3 at 55 and 67, 7 and more
    steps after the NIC was last a suspect, past the evidence window of 5 steps; the page
    named the link. An intermittent fault's significant steps are remembered for 25.

    Its first burst (step 41, 1.37 s against 0.33) was z 3.8 by its transfers: each stalled
    all-reduce and send is only 4-5σ of the loaded host's noise, and node-1's transfers
    outside the burst were on time. Read as a burst (`network_suspects.burst_of`), node-1's
    transfers carry the second the step lost: paged at the second burst (48), not the
    fourth. The step after the first burst took 1.07 s against 0.33 with no suspect at all,
    the pipeline draining the stall: that is the burst's tail, charged to node-1
    (`burst_evidence.burst_tail`), and the first burst pages: in the step it began, as its
    NIC alone cost the job over a usual step there (`evidence.LONE_STALL`)."""
    [(opened, kind, culprit)] = _device_incidents("flapping-nic-node-1-bursts-apart.jsonl.gz")
    assert (kind, culprit) == ("link", "node:node-1")
    assert FLAP_ONSET - 1 <= opened <= FLAP_ONSET
    [summary] = [i.summary for i in diagnose_messages(recording_messages(
        str(DRILLS / "flapping-nic-node-1-bursts-apart.jsonl.gz"))).incidents.values()
        if i.kind == "link"]
    assert "loses 0.00 s" not in summary, summary  # what a burst costs, not a step between


def test_a_burst_whose_data_arrived_late_is_named_by_what_the_receivers_waited():
    """Node-0's NIC flapping: its bursts stalled the buffered pipeline sends to node-2,
    whose copies returned at once. By the copies the bursts at steps 48, 61 and 67 were
    0.3 s of the 1.2 s each step lost, node-0 and node-2 alike: nothing was paged in 40
    steps. As the data arrived they carry the loss, and the pair's link counts for the NIC
    that was a suspect just before (paged at 47). The first burst's step 41 and the step
    after it both more than tripled, the second with no network suspect of its own: the
    first burst pages."""
    [(opened, kind, culprit)] = _device_incidents("flapping-nic-node-0-burst-data-late.jsonl.gz")
    assert (kind, culprit) == ("link", "node:node-0")
    assert FLAP_ONSET - 1 <= opened <= FLAP_ONSET


def test_a_throttled_rank_on_a_dark_node_of_two_is_named_by_that_node():
    """Two nodes in two pipeline stages (`--nodes 2 --pp 2 --traced node_dark`): node-1's
    agent is down, and the job start names it. Every traced group is complete, so nothing
    misses members; what shows is the traced stage waiting on node-1 at every pipeline
    transfer, ×4 its usual share of their step, while its own work does not change. The
    code before it opened nothing but a job-wide shift; a reading of the quickest transfers
    that the simulator supports named the link (a starved receiver blocks the sends too)."""
    [(opened, kind, culprit)] = _device_incidents(
        "node-dark-two-nodes-throttled-dark-rank7.jsonl.gz")
    assert (kind, culprit) == ("gpu", "node:node-1")
    assert DEFAULT_ONSET - 1 <= opened <= DEFAULT_ONSET + 2


def test_a_throttled_ranks_doubled_steps_are_not_a_flapping_links_bursts():
    """Rank 2 held to a tenth of a core (all ranks traced, a CI machine under load): its
    steps ran ×2.5–3.7 the usual, and on one of them a pipeline link it sends on was barely
    significant (z 5.7, behind the rank's 15.7). That step's lost seconds were charged to the
    link as a burst, the next doubled step as its tail, and two such steps confirmed a
    "flapping" link beside the rank. A step that doubled with a device suspect showing half
    of its loss is that device's, not a burst of the network's."""
    assert [(k, c) for _o, k, c in _device_incidents("all-throttled-rank2-link-bursts.jsonl.gz")
            ] == [("gpu", "rank:2")]


SHARE_ONSET = 22  # the same, in drills run with 20 steps before it (`--cpu-share`)


def test_a_throttled_ranks_own_slow_sends_are_not_its_nics():
    """Every rank in a cgroup CPU share of its own (`--cpu-share`), rank 5 held to a tenth
    of a core from step 22. gloo moves a rank's bytes on its own CPU, so its sends through
    node-2's NIC ran ×9 while its node partner's, through the same NIC, kept their usual.
    The step doubled, and node-2's NIC took it as a burst and opened instead of the rank."""
    assert [(k, c) for o, k, c in _device_incidents("share-throttled-rank5-sends-slow.jsonl.gz")
            if SHARE_ONSET - 1 <= o <= SHARE_ONSET + 3] == [("gpu", "rank:5")]
    assert len(_device_incidents("share-throttled-rank5-sends-slow.jsonl.gz")) == 1


def test_a_throttled_ranks_slow_pipeline_sends_open_no_link_later():
    """Rank 2 throttled the same way was named in one step; six steps later its own
    pipeline sends to node-3 (×53 on two of the link's eight transfers, the other ranks'
    on time) opened the link between node-1 and node-3 as a second incident."""
    [(opened, kind, culprit)] = _device_incidents("share-throttled-rank2-link-later.jsonl.gz")
    assert (kind, culprit) == ("gpu", "rank:2")
    assert SHARE_ONSET - 1 <= opened <= SHARE_ONSET + 3


def test_a_flapping_nic_is_not_read_in_one_ranks_noisy_sends_before_it():
    """Node-2's NIC flapping from step 22, every rank in a CPU share at the usual 100 ms
    period (a rank that waited bursts through its budget, and one that did not starves).
    Before the fault rank 3, starved between its ops (a host suspect), sent its pipeline
    transfers to node-3 slow on several steps while the other ranks' on that link were on
    time; node-3's NIC read significant on steps 8 and 11-13 and opened at step 13, costing
    ×1.00: a false page, and the flapping NIC was then read as its spread, never paged."""
    [(opened, kind, culprit)] = _device_incidents(
        "share-flapping-nic-node-2-noisy-sends.jsonl.gz")
    assert (kind, culprit) == ("link", "node:node-2")
    assert SHARE_ONSET - 1 <= opened <= SHARE_ONSET + 3


def test_a_pipeline_link_at_a_throttled_ranks_node_is_that_ranks_incident():
    """Rank 2 throttled again (`--cpu-share`), named at step 23. From step 31 the link from
    its node to node-3 read slow on most steps: rank 2's own sends ×30-100, and its node
    partner rank 3's ×9-65 on half of its own, so neither rank alone carried them, and the
    link opened at step 35 as a second incident. Why rank 3's sends slowed too the
    recording does not say (the two share node-1's network stack); a link at the node of
    an open GPU incident is evidence of that incident, and stays one of its suspects."""
    [(opened, kind, culprit)] = _device_incidents("share-throttled-rank2-both-sends-slow.jsonl.gz")
    assert (kind, culprit) == ("gpu", "rank:2")
    assert SHARE_ONSET - 1 <= opened <= SHARE_ONSET + 3
