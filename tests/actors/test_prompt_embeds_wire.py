"""Prompt embeddings as bytes (actors/protocol/prompt_embeds.py): safetensors files and raw
buffers decode to the same rows; pickles, malformed headers, wrong shapes, dtypes and
non-finite values are refused before anything is allocated for them; the engine core takes
rows only where they are enabled, of the model's width, one per prompt position."""

from __future__ import annotations

import io
import json
import pickle
import struct

import numpy as np
import pytest
import torch
from safetensors.numpy import save as save_numpy
from safetensors.torch import save as save_torch

from actors.core.kv_cache_manager import KVCacheManager
from actors.core.scheduler import Scheduler
from actors.core.scheduler_config import SchedulerConfig
from actors.protocol.codec import Codec
from actors.protocol.messages import EngineRequest
from actors.protocol.prompt_embeds import (
    MAX_HEADER_BYTES,
    PromptEmbedsError,
    check_embeds,
    from_raw,
    from_safetensors,
    last_rows,
)
from actors.protocol.sampling_params import SamplingParams
from gpu.prompt_embeds import embeds_from_tensor, embeds_tensor

HIDDEN = 8


def _rows(num_tokens: int = 3) -> np.ndarray:
    return np.arange(num_tokens * HIDDEN, dtype=np.float32).reshape(num_tokens, HIDDEN) / 7


def _file(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def test_safetensors_and_raw_decode_to_the_same_rows() -> None:
    rows = _rows()
    from_file = from_safetensors(save_numpy({"embeds": rows}, metadata={"by": "test"}))
    raw = from_raw(rows.tobytes(), "float32", [3, HIDDEN])
    assert from_file == raw
    assert (from_file.num_tokens, from_file.hidden_size, from_file.dtype) == (3, HIDDEN, "float32")
    np.testing.assert_array_equal(embeds_tensor(from_file, torch.float32).numpy(), rows)
    check_embeds(from_file, HIDDEN, max_num_tokens=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_float_dtype_round_trips_through_the_engine_tensor(dtype: torch.dtype) -> None:
    tensor = torch.from_numpy(_rows()).to(dtype)
    embeds = from_safetensors(save_torch({"t": tensor.unsqueeze(0)}))  # [1, n, h] is squeezed
    assert (embeds.num_tokens, embeds.hidden_size) == (3, HIDDEN)
    assert torch.equal(embeds_tensor(embeds, dtype), tensor)
    assert embeds_from_tensor(tensor) == embeds
    check_embeds(embeds, HIDDEN, 3)


def test_the_digest_tells_rows_apart_and_truncation_keeps_the_last_rows() -> None:
    rows = _rows(4)
    embeds = from_raw(rows.tobytes(), "float32", rows.shape)
    other = from_raw((rows + 1).tobytes(), "float32", rows.shape)
    assert embeds.digest != other.digest
    assert from_raw(rows.tobytes(), "float32", rows.shape).digest == embeds.digest
    tail = last_rows(embeds, 2)
    assert tail == from_raw(rows[2:].tobytes(), "float32", (2, HIDDEN))
    assert last_rows(embeds, 10) is embeds


def test_a_request_with_rows_crosses_the_process_codec_intact() -> None:
    embeds = from_raw(_rows().tobytes(), "float32", (3, HIDDEN))
    request = EngineRequest("r", (0, 0, 0), SamplingParams(), 0.0, prompt_embeds=embeds)
    codec = Codec()
    assert codec.decode_to_core(codec.encode(request)) == request


def _torch_save(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


RAW_F32 = _rows().tobytes()
GOOD_HEADER = {"e": {"dtype": "F32", "shape": [3, HIDDEN], "data_offsets": [0, len(RAW_F32)]}}
BAD_FILES = {
    "torch.save": _torch_save(torch.zeros(3, HIDDEN)),
    "pickle": pickle.dumps(np.zeros((3, HIDDEN), dtype=np.float32)),
    "garbage": b"\x13\x37" * 50,
    "short": b"\x01\x02",
    "huge header length": struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}",
    "header past the end": struct.pack("<Q", 4096) + b'{"a": 1}',
    "header not json": struct.pack("<Q", 4) + b"{{{{",
    "header a list": _file([], b""),  # type: ignore[arg-type]
    "two tensors": _file(
        {
            "a": {"dtype": "F32", "shape": [1, HIDDEN], "data_offsets": [0, 32]},
            "b": {"dtype": "F32", "shape": [2, HIDDEN], "data_offsets": [32, 96]},
        },
        RAW_F32,
    ),
    "no tensor": _file({"__metadata__": {}}, b""),
    "offsets past the data": _file(
        {"e": {"dtype": "F32", "shape": [3, HIDDEN], "data_offsets": [0, 10**9]}}, RAW_F32
    ),
    "trailing bytes": _file(GOOD_HEADER, RAW_F32 + b"\x00" * 4),
    "offsets not from 0": _file(
        {"e": {"dtype": "F32", "shape": [3, HIDDEN], "data_offsets": [4, len(RAW_F32) + 4]}},
        b"\x00" * 4 + RAW_F32,
    ),
    "int dtype": save_numpy({"e": np.zeros((3, HIDDEN), dtype=np.int32)}),
    "float64": save_numpy({"e": np.zeros((3, HIDDEN), dtype=np.float64)}),
    "1-D": save_numpy({"e": np.zeros(HIDDEN, dtype=np.float32)}),
    "3-D batch of 2": save_numpy({"e": np.zeros((2, 3, HIDDEN), dtype=np.float32)}),
    "4-D": save_numpy({"e": np.zeros((1, 1, 3, HIDDEN), dtype=np.float32)}),
    "shape disagrees with bytes": _file(
        {"e": {"dtype": "F32", "shape": [4, HIDDEN], "data_offsets": [0, len(RAW_F32)]}}, RAW_F32
    ),
    "negative size": _file(
        {"e": {"dtype": "F32", "shape": [-3, -HIDDEN], "data_offsets": [0, len(RAW_F32)]}},
        RAW_F32,
    ),
    "entry without offsets": _file({"e": {"dtype": "F32", "shape": [3, HIDDEN]}}, RAW_F32),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_anything_but_one_float_tensor_in_safetensors_is_refused(name: str) -> None:
    with pytest.raises(PromptEmbedsError) as refused:
        from_safetensors(BAD_FILES[name])
    if name in ("torch.save", "pickle"):
        assert "never loads" in str(refused.value)


def _checked(rows: np.ndarray, hidden_size: int = HIDDEN, max_num_tokens: int = 16) -> None:
    check_embeds(from_raw(rows.tobytes(), "float32", rows.shape), hidden_size, max_num_tokens)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(value: float) -> None:
    rows = _rows()
    rows[2, 5] = value
    with pytest.raises(PromptEmbedsError, match="NaN or an infinity"):
        _checked(rows)


def test_non_finite_half_precision_values_are_refused() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        tensor = torch.from_numpy(_rows()).to(dtype)
        tensor[1, 1] = float("nan")
        with pytest.raises(PromptEmbedsError, match="NaN"):
            check_embeds(embeds_from_tensor(tensor), HIDDEN, 16)


def test_shapes_the_model_cannot_run_are_refused() -> None:
    with pytest.raises(PromptEmbedsError, match="hidden size is 16"):
        _checked(_rows(), hidden_size=16)
    with pytest.raises(PromptEmbedsError, match="no rows"):
        _checked(np.zeros((0, HIDDEN), dtype=np.float32))
    with pytest.raises(PromptEmbedsError, match="more than the 2"):
        _checked(_rows(3), max_num_tokens=2)
    with pytest.raises(PromptEmbedsError, match="not one of"):
        from_raw(b"\x00" * 8, "int32", [1, 2])
    with pytest.raises(TypeError):
        embeds_from_tensor(_rows())  # a numpy array is not the offline API's tensor
    with pytest.raises(PromptEmbedsError, match="not one of"):
        embeds_from_tensor(torch.zeros(2, HIDDEN, dtype=torch.int64))


def _scheduler(hidden_size: int | None) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=16,
        prompt_embeds_hidden_size=hidden_size,
    )
    return Scheduler(config, KVCacheManager(num_blocks=16, block_size=16))


def test_the_engine_core_takes_rows_only_where_enabled_and_of_the_models_width() -> None:
    embeds = from_raw(_rows().tobytes(), "float32", (3, HIDDEN))
    request = EngineRequest("r", (0, 0, 0), SamplingParams(), 0.0, prompt_embeds=embeds)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        _scheduler(None).add_request(request)
    with pytest.raises(ValueError, match="hidden size is 16"):
        _scheduler(16).add_request(request)
    with pytest.raises(ValueError, match="3 embedding rows for 2 prompt positions"):
        _scheduler(HIDDEN).add_request(
            EngineRequest("r", (0, 0), SamplingParams(), 0.0, prompt_embeds=embeds)
        )
    with pytest.raises(ValueError, match="prompt logprobs"):
        _scheduler(HIDDEN).add_request(
            EngineRequest(
                "r", (0, 0, 0), SamplingParams(prompt_logprobs=1), 0.0, prompt_embeds=embeds
            )
        )
    scheduler = _scheduler(HIDDEN)
    scheduler.add_request(request)
    new = scheduler.schedule().new_requests[0]
    assert new.prompt_embeds == embeds and new.token_ids == (0, 0, 0)
