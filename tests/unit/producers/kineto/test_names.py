"""Kineto naming rules: every spelling of a collective, a size and a group onto the wire's."""

from __future__ import annotations

from producers.kineto.names import canonical, comm_event_name, group_name, message_bytes


def test_names_sizes_and_groups():
    assert canonical("allreduce") == "all_reduce"
    assert canonical("_allgather_base") == "all_gather"
    assert canonical("reduce_scatter_tensor_coalesced") == "reduce_scatter"
    assert comm_event_name("c10d::alltoall_base_") == "all_to_all"
    assert comm_event_name("gloo:send") == "send"
    assert comm_event_name("ncclKernel_ReduceScatter_RING_LL_Sum_float(x)") == "reduce_scatter"
    assert comm_event_name("aten::gather") is None
    assert message_bytes({"In msg nelems": 10, "dtype": "Float"}, "all_reduce") == 40
    assert message_bytes({"Input Dims": [[4], [8, 2]], "Input type": ["float", "half"]},
                         "all_gather") == 32
    assert message_bytes({"Input Dims": [[[64, 64]], []], "Input type": ["TensorList", ""]},
                         "all_reduce") == 0  # dtype unknown: 0, as the contract says
    assert group_name({"Process Group Name": "0", "Process Group Description": "default_pg"}) \
        == "world.0"
    assert group_name({"Process Group Name": "7", "Process Group Description": "tp"}) == "tp.7"
    assert group_name({"Process Group Name": "7", "Process Group Description": "undefined"}) \
        == "pg.7"
    assert group_name({}) == "pg.unknown"
