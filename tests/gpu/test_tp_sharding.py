"""How the model splits over tensor-parallel ranks, and that every loader reads exactly a
rank's slice of each weight (equal to the same slice of the whole model's weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpu.weights.hf_loader as hf_loader
from gpu.models.config import ModelConfig, UnsupportedModelError
from gpu.models.parallel_layers import (
    check_tensor_parallel_size,
    head_shard,
    intermediate_shard,
    vocab_shard,
)
from gpu.models.presets import PRESETS
from gpu.sampling.batch_shard import shard_plan, to_owner_major
from gpu.weights.dummy import dummy_weights
from gpu.weights.gguf_file import GGUFFile
from gpu.weights.gguf_loader import hf_weight_name, load_gguf, read_gguf_config
from gpu.weights.gguf_shard import (
    BLOCK_COLUMNS,
    DEQUANTIZE_THEN_SLICE,
    ROWS,
    WHOLE,
    read_gguf_shard,
    shard_read_mode,
)
from gpu.weights.hf_loader import load_hf_dir
from gpu.weights.layout import EMBED_NAME, LM_HEAD_NAME
from gpu.weights.shard_layout import (
    WHOLE_TENSOR,
    ShardSlice,
    expected_shard_shapes,
    take_shard,
    weight_shard_slices,
)
from tests._embedded_model import embedded_gguf_path
from tests.gpu._tiny_checkpoints import (
    save_sharded,
    tiny_hf_model,
    write_gguf_with_tensor,
    write_tiny_gguf,
)


def _heads(num_heads: int, num_kv_heads: int) -> ModelConfig:
    return PRESETS["llama-3.1-8b"].replace(
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=1536
    )


def _assert_shards_of(
    full: dict[str, torch.Tensor],
    config: ModelConfig,
    tp_rank: int,
    tp_size: int,
    shard: dict[str, torch.Tensor],
) -> None:
    slices = weight_shard_slices(config, tp_rank, tp_size)
    assert {k: tuple(v.shape) for k, v in shard.items()} == expected_shard_shapes(
        config, tp_rank, tp_size
    )
    for name, tensor in shard.items():
        assert torch.equal(tensor, take_shard(full[name], slices[name])), name


# ---- the partition --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tp_size"),
    [
        (32, 8, 2),
        (32, 8, 4),
        (32, 8, 8),
        (32, 8, 16),
        (4, 1, 2),
        (9, 3, 3),
        (16, 16, 4),
        (14, 2, 2),
    ],
)
def test_each_rank_holds_the_kv_head_its_query_heads_read(num_heads, num_kv_heads, tp_size) -> None:
    config = _heads(num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    covered = []
    for rank in range(tp_size):
        shard = head_shard(config, rank, tp_size)
        assert shard.num_heads * tp_size == num_heads
        local_group = shard.num_heads // shard.num_kv_heads
        for local_head in range(shard.num_heads):
            global_head = shard.head_start + local_head
            assert shard.kv_head_start + local_head // local_group == global_head // group
            covered.append(global_head)
        if num_kv_heads < tp_size:
            assert shard.num_kv_heads == 1  # replicated
    assert covered == list(range(num_heads))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_heads": 9, "num_kv_heads": 3}, "9 attention heads"),
        ({"num_heads": 24, "num_kv_heads": 6}, "6 KV heads"),
        ({"num_heads": 32, "num_kv_heads": 8, "intermediate_size": 1001}, "MLP width 1001"),
    ],
)
def test_sizes_that_do_not_split_are_refused(changes, message) -> None:
    config = PRESETS["llama-3.1-8b"].replace(**changes)
    with pytest.raises(UnsupportedModelError, match=message):
        check_tensor_parallel_size(config, 4 if "intermediate_size" not in changes else 2)


@pytest.mark.parametrize(("vocab_size", "tp_size"), [(1001, 2), (128256, 4), (151936, 8), (5, 4)])
def test_vocab_shards_cover_the_vocabulary_once(vocab_size, tp_size) -> None:
    shards = [vocab_shard(vocab_size, rank, tp_size) for rank in range(tp_size)]
    assert len({s.num_rows for s in shards}) == 1
    assert sum(s.num_real_rows for s in shards) == vocab_size
    assert [s.start for s in shards] == [rank * shards[0].num_rows for rank in range(tp_size)]


def test_intermediate_shards_tile_the_mlp() -> None:
    config = PRESETS["llama-3.1-8b"]
    spans = [intermediate_shard(config, rank, 4) for rank in range(4)]
    assert spans == [(rank * 3584, 3584) for rank in range(4)]


def test_shard_plan_is_owner_major_with_padding() -> None:
    plan = shard_plan(5, 2)
    assert (plan.rows_per_rank, plan.owner_major_rows_np.tolist()) == (3, [0, 2, 4, 1, 3, 0])
    assert [plan.num_owned(r) for r in (0, 1)] == [3, 2]
    assert list(range(5)[plan.owned_rows(1)]) == [1, 3]
    logits = torch.arange(10.0).view(5, 2)
    assert to_owner_major(logits, plan)[:, 0].tolist() == [0, 4, 8, 2, 6, 0]
    assert shard_plan(1, 4).owner_major_rows_np.tolist() == [0, 0, 0, 0]


# ---- loaders --------------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-0.6b"])
def test_dummy_shards_are_slices_of_the_whole_dummy_model(preset, tp_size) -> None:
    config = PRESETS[preset].replace(
        vocab_size=1003, hidden_size=64, intermediate_size=600, num_layers=2, head_dim=16
    )
    full = dummy_weights(config, torch.float32, seed=9)
    for rank in range(tp_size):
        shard = dummy_weights(config, torch.float32, seed=9, tp_rank=rank, tp_size=tp_size)
        _assert_shards_of(full, config, rank, tp_size, shard)
        if config.tie_word_embeddings:
            assert shard[LM_HEAD_NAME] is shard[EMBED_NAME]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_safetensors_ranks_read_only_their_slices(tmp_path, monkeypatch, architecture) -> None:
    save_sharded(tiny_hf_model(architecture), str(tmp_path))
    config, full, _ = load_hf_dir(str(tmp_path), torch.float32)
    whole_reads: list[str] = []
    real_safe_open = hf_loader.safe_open

    class RecordingFile:
        def __init__(self, *args, **kwargs) -> None:
            self._file = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_slice(self, name):
            return self._inner.get_slice(name)

        def get_tensor(self, name):
            whole_reads.append(name)
            return self._inner.get_tensor(name)

    monkeypatch.setattr(hf_loader, "safe_open", RecordingFile)
    for rank in range(2):
        whole_reads.clear()
        _, shard, _ = load_hf_dir(str(tmp_path), torch.float32, "cpu", rank, 2)
        _assert_shards_of(full, config, rank, 2, shard)
        slices = weight_shard_slices(config, rank, 2)
        assert whole_reads and all(slices[name].dim is None for name in whole_reads)


@pytest.mark.parametrize(
    ("architecture", "tensor_type"), [("llama", "F32"), ("qwen2", "F16"), ("qwen3", "F32")]
)
def test_gguf_shards_equal_slices_of_the_whole_model(tmp_path, architecture, tensor_type) -> None:
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_hf_model(architecture), path, tensor_type)
    config, full = load_gguf(GGUFFile(path), torch.float32)
    for rank in range(2):
        _, shard = load_gguf(GGUFFile(path), torch.float32, "cpu", rank, 2)
        _assert_shards_of(full, config, rank, 2, shard)


@pytest.mark.slow
def test_embedded_gguf_shards_read_rows_and_whole_quantization_blocks() -> None:
    gguf = GGUFFile(embedded_gguf_path())  # Q4_1 matrices, a Q8_0 embedding
    config = read_gguf_config(gguf)
    tp_size = 3  # 9 query heads, 3 KV heads
    expected_modes = {
        "token_embd.weight": ROWS,
        "blk.0.attn_q.weight": ROWS,
        "blk.0.attn_k.weight": ROWS,
        "blk.0.ffn_up.weight": ROWS,
        "blk.0.attn_output.weight": BLOCK_COLUMNS,
        "blk.0.ffn_down.weight": BLOCK_COLUMNS,
        "blk.0.attn_norm.weight": WHOLE,
    }
    full = {name: read_gguf_shard(gguf, name, WHOLE_TENSOR, "cpu") for name in expected_modes}
    for rank in range(tp_size):
        slices = weight_shard_slices(config, rank, tp_size)
        for name, mode in expected_modes.items():
            shard = slices[hf_weight_name(name)]
            assert shard_read_mode(gguf, name, shard) == mode, name
            expected = take_shard(full[name], shard)
            assert torch.equal(read_gguf_shard(gguf, name, shard, "cpu"), expected), name


def test_column_slices_through_quantization_blocks_dequantize_then_slice(tmp_path) -> None:
    import gguf as gguf_lib

    values = np.random.default_rng(3).standard_normal((4, 96)).astype(np.float32)
    raw = gguf_lib.quants.quantize(values, gguf_lib.GGMLQuantizationType.Q8_0)
    path = str(tmp_path / "q8.gguf")
    write_gguf_with_tensor(
        path,
        "llama",
        "blk.0.ffn_down.weight",
        raw,
        gguf_lib.GGMLQuantizationType.Q8_0,
        embedding_length=4,
    )
    gguf = GGUFFile(path)
    full = read_gguf_shard(gguf, "blk.0.ffn_down.weight", WHOLE_TENSOR, "cpu")
    for shard, mode in [
        (ShardSlice(1, 32, 64, 32), BLOCK_COLUMNS),
        (ShardSlice(1, 16, 48, 32), DEQUANTIZE_THEN_SLICE),
        (ShardSlice(0, 1, 3, 3), ROWS),
    ]:
        assert shard_read_mode(gguf, "blk.0.ffn_down.weight", shard) == mode
        got = read_gguf_shard(gguf, "blk.0.ffn_down.weight", shard, "cpu")
        assert torch.equal(got, take_shard(full, shard)), mode
