"""The wire format: typed, tagged, versioned msgpack; bad frames are typed errors."""

from __future__ import annotations

import msgpack
import pytest
from aegaeon_common.messages.decode import DECODE_CHANNEL, EnqueueDecode
from aegaeon_common.messages.prefill import PREFILL_CHANNEL, CancelRequest, EnqueuePrefill
from aegaeon_common.messages.report import REPORT_CHANNEL, StepTokens, TokenItem
from aegaeon_common.messages.structs import (
    EventSpec,
    KVHandoff,
    KVShapeSpec,
    RequestTimings,
    SamplingParams,
)
from aegaeon_common.wire import WIRE_VERSION, WireError, encode


def _enqueue_decode() -> EnqueueDecode:
    shape = KVShapeSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16")
    handoff = KVHandoff(
        shape=shape,
        block_offsets=[0, 8192],
        num_tokens=20,
        event=EventSpec(kind="cpu", table="aegaeon-x-events", slot=3, value=17),
    )
    return EnqueueDecode(
        request_id="r1",
        model="m",
        batch_id=2,
        prompt_len=20,
        first_token_id=5,
        num_generated=1,
        sampling=SamplingParams(max_tokens=8, temperature=0.0, seed=7, stop_token_ids=(2, 3)),
        handoff=handoff,
        arrival_s=12.5,
    )


def test_round_trip_nested_structs() -> None:
    msg = _enqueue_decode()
    assert DECODE_CHANNEL.decode(encode(msg)) == msg


def test_report_round_trip_with_optional_fields() -> None:
    msg = StepTokens(
        index=0,
        items=[TokenItem("a", [1, 2]), TokenItem("b", [3], "stop", RequestTimings(decode_s=1.0))],
        emitted_s=3.0,
    )
    assert REPORT_CHANNEL.decode(encode(msg)) == msg


def test_channel_refuses_messages_of_other_channels() -> None:
    with pytest.raises(WireError) as err:
        PREFILL_CHANNEL.decode(encode(_enqueue_decode()))
    assert err.value.code == "unknown_tag"


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\xc1\x00", "malformed"),
        (msgpack.packb([1, 2]), "malformed"),
        (msgpack.packb({"v": WIRE_VERSION + 1, "t": "cancel", "request_id": "x"}), "bad_version"),
        (msgpack.packb({"t": "cancel", "request_id": "x"}), "bad_version"),
        (msgpack.packb({"v": WIRE_VERSION, "t": "nope"}), "unknown_tag"),
        (msgpack.packb({"v": WIRE_VERSION, "t": "cancel"}), "missing_field"),
        (msgpack.packb({"v": WIRE_VERSION, "t": "cancel", "request_id": 5}), "bad_field"),
    ],
)
def test_bad_frames_are_typed_errors(frame: bytes, code: str) -> None:
    with pytest.raises(WireError) as err:
        PREFILL_CHANNEL.decode(frame)
    assert err.value.code == code


def test_nested_type_errors_name_the_path() -> None:
    body = {
        "v": WIRE_VERSION,
        "t": "enqueue_prefill",
        "request_id": "r",
        "model": "m",
        "group_id": 1,
        "prompt_token_ids": [1, "two"],
        "sampling": {},
        "arrival_s": 0,
    }
    with pytest.raises(WireError) as err:
        PREFILL_CHANNEL.decode(msgpack.packb(body))
    assert "prompt_token_ids[1]" in err.value.detail


def test_bool_is_not_an_int_and_int_widens_to_float() -> None:
    body = {"v": WIRE_VERSION, "t": "cancel", "request_id": True}
    with pytest.raises(WireError):
        PREFILL_CHANNEL.decode(msgpack.packb(body))
    msg = EnqueuePrefill("r", "m", 1, [1], SamplingParams(), 3.0)
    frame = msgpack.unpackb(encode(msg))
    frame["arrival_s"] = 3
    decoded = PREFILL_CHANNEL.decode(msgpack.packb(frame))
    assert isinstance(decoded, EnqueuePrefill)
    assert decoded.arrival_s == 3.0


def test_unknown_extra_fields_from_newer_peers_are_ignored() -> None:
    frame = msgpack.unpackb(encode(CancelRequest("r")))
    frame["added_later"] = 1
    assert PREFILL_CHANNEL.decode(msgpack.packb(frame)) == CancelRequest("r")


def test_sampling_a_sampler_cannot_do_is_a_typed_error_naming_the_field() -> None:
    """The one sampling shape checks itself when a frame is decoded, as when it is built."""
    frame = msgpack.unpackb(encode(EnqueuePrefill("r", "m", 1, [1], SamplingParams(), 3.0)))
    frame["sampling"] = {"top_p": 0.0}
    with pytest.raises(WireError) as err:
        PREFILL_CHANNEL.decode(msgpack.packb(frame))
    assert err.value.code == "bad_field" and "SamplingParams.top_p" in err.value.detail
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        SamplingParams(top_p=0.0)
