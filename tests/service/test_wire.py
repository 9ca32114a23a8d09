"""The protobuf half of the API against the tinker SDK's own encoder and decoder (tinker 0.38.0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from titan_lora.service.wire import (SampledTokens, WireError, read_forward_backward, write_forward_backward,
                                    write_sample)


def _sdk_request(data: list[types.Datum], loss_fn: str = "cross_entropy", config: dict | None = None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0", seq_id=7)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_request_the_sdk_wrote_reads_back_exactly() -> None:
    chunks = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6, 7]), types.EncodedTextChunk(tokens=[8])])
    datum = types.Datum(model_input=chunks, loss_fn_inputs={
        "target_tokens": [6, 7, 8, 9], "logprobs": [0.0, -1.5, -0.25, -2.0], "advantages": [0, 1.0, 1.0, 1.0]})
    call = read_forward_backward(_sdk_request([datum], "ppo", {"clip_low_threshold": 0.7}))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
    assert call.config == {"clip_low_threshold": 0.7}
    (ours,) = call.data
    assert ours.tokens.tolist() == [5, 6, 7, 8] and ours.tokens.dtype == np.int64
    assert ours.inputs["target_tokens"].tolist() == [6, 7, 8, 9]
    np.testing.assert_array_equal(ours.inputs["logprobs"], np.float32([0.0, -1.5, -0.25, -2.0]))


def test_a_sparse_2d_input_the_sdk_sends_is_densified() -> None:
    weights = torch.zeros(3, 4)
    weights[0, 1], weights[2, 3] = 0.5, 2.0
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": weights})
    assert datum.loss_fn_inputs["weights"].sparse_crow_indices is not None  # the SDK sends it as CSR
    (ours,) = read_forward_backward(_sdk_request([datum])).data
    np.testing.assert_array_equal(ours.inputs["weights"], weights.numpy())


def test_results_decode_in_the_sdk_per_datum_in_order() -> None:
    logprobs = [np.float32([-1.0, -2.0]), np.float32([-0.5]), np.float32([-3.0, -0.1, -0.2])]
    out = deserialize_forward_backward_output(write_forward_backward(logprobs, {"loss:sum": 4.5}))
    assert out.metrics == {"loss:sum": 4.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [lp.tolist() for lp in logprobs]


def test_a_body_that_is_not_the_protobuf_is_refused() -> None:
    with pytest.raises(WireError, match="not a ForwardBackwardRequest protobuf"):
        read_forward_backward(b"\xff\xff\xff not protobuf")


def test_top_k_log_probs_decode_in_the_sdk_padded_to_k_with_none_where_not_computed() -> None:
    sequence = SampledTokens([7, 9], [-0.5, -1.25], True, topk=[[(7, -0.5), (3, -2.0)], [(9, -1.25), (1, -1.5)]])
    prompt = [None, [(4, -0.25), (5, -3.0)], [(6, -1.0)]]  # the last position: fewer than k tokens
    out = deserialize_sample_response(write_sample([sequence], [None, -0.25, -1.0], prompt, 2, 2))
    assert out.sequences[0].topk_logprobs == [[(7, -0.5), (3, -2.0)], [(9, -1.25), (1, -1.5)]]
    assert out.topk_prompt_logprobs == prompt
    assert out.prompt_logprobs == [None, -0.25, -1.0]
    plain = deserialize_sample_response(write_sample([SampledTokens([7], [-0.5], False)]))
    assert plain.sequences[0].topk_logprobs is None and plain.topk_prompt_logprobs is None
