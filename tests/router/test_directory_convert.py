"""StaticDirectory parsing and the proto conversions."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.proto import worker_pb2 as pb
from pdserve.sampling_params import RequestOutput, SamplingParams, TokenLogprob
from pdserve.proto.convert import chunk_to_output, output_to_chunk, params_from_proto, params_to_proto
from pdserve.router.cluster.directory import StaticDirectory, WorkerEndpoint, parse_endpoint


def test_static_directory_parses_entries():
    directory = StaticDirectory.parse([
        "prefill=127.0.0.1:50051",
        "decode@nodeA=host-a:50052",
        " prefill@nodeB=10.0.0.3:6000 ",
        "mixed#m7@node-c=[::1]:7000",
    ])
    assert asyncio.run(directory.endpoints()) == [
        WorkerEndpoint("prefill-0", "prefill", "127.0.0.1:50051", ""),
        WorkerEndpoint("decode-0", "decode", "host-a:50052", "nodeA"),
        WorkerEndpoint("prefill-1", "prefill", "10.0.0.3:6000", "nodeB"),
        WorkerEndpoint("m7", "mixed", "[::1]:7000", "node-c"),
    ]


@pytest.mark.parametrize("entry", [
    "prefill", "prefill=", "router=h:1", "decode=host", "decode=host:0", "decode=host:70000", "decode@=h:1",
    "Decode=h:1", "decode=h:1 x", "=h:1",
])
def test_bad_entries_name_the_entry(entry):
    with pytest.raises(ValueError, match="bad worker entry " + repr(entry).replace("[", r"\[")):
        parse_endpoint(entry)


def test_bad_entry_in_a_list_is_named_and_duplicates_rejected():
    with pytest.raises(ValueError, match="'decode=nope'"):
        StaticDirectory.parse(["prefill=h:1", "decode=nope"])
    with pytest.raises(ValueError, match=r"duplicate worker ids: \['w'\]"):
        StaticDirectory.parse(["prefill#w=h:1", "decode#w=h:2"])
    with pytest.raises(ValueError, match="no worker entries"):
        StaticDirectory.parse([])


def test_params_round_trip():
    for params in (
        SamplingParams(),
        SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, top_k=3, seed=-5, presence_penalty=0.5,
                       frequency_penalty=-1.0, stop=("a", "bc"), stop_token_ids=(2, 9), ignore_eos=True, logprobs=0,
                       min_tokens=2),
        SamplingParams(logprobs=5, seed=0),
    ):
        assert params_from_proto(params_to_proto(params)) == params
    assert not params_to_proto(SamplingParams()).HasField("seed")
    with pytest.raises(ValueError, match="max_tokens"):
        params_from_proto(pb.SamplingParams())


def test_output_round_trip():
    out = RequestOutput("r", [5, 6], "xy", True, "length", 3, 2, 1,
                        [TokenLogprob(5, -0.5, [(5, -0.5), (7, -1.5)]), TokenLogprob(6, -0.25, [])])
    assert chunk_to_output(output_to_chunk(out)) == out
    running = RequestOutput("r", [5], "x", False, None, 3, 1)
    assert chunk_to_output(output_to_chunk(running)) == running
    with pytest.raises(ValueError, match="finish_reason 'eos'"):
        chunk_to_output(pb.TokenChunk(request_id="r", finished=True, finish_reason="eos"))
