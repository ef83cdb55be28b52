"""The connector's gather of captured states, on real torch tensors shaped like each vLLM
release's hidden-states cache view (fast tier: no engine)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hsx_service.engine import hidden_cache, vllm_compat

NUM_BLOCKS, BLOCK, LAYERS, HIDDEN = 12, 16, 4, 8


def write_states(kv: torch.Tensor, block_axis: int, slots: torch.Tensor, states: torch.Tensor) -> None:
    """The scatter vLLM's cache-only layer does (basic_cache) in that release's view."""
    bs = kv.shape[block_axis]
    if block_axis == 2:  # 0.29+: kv_cache[slot // bs, :, slot % bs] = to_cache
        kv[slots // bs, :, slots % bs] = states
    else:  # 0.26 - 0.28: kv_cache[slot // bs, slot % bs] = to_cache
        kv[slots // bs, slots % bs] = states


def view_for(block_axis: int, physical: str = "LBNHC", block: int = BLOCK) -> torch.Tensor:
    """A cache view like the one vLLM hands the connector: logical shape of the release,
    physical order as named."""
    if block_axis == 1:
        return torch.zeros(NUM_BLOCKS, block, LAYERS, HIDDEN)
    if physical == "LBNHC":  # token-major pages: [B, N, H, C] in memory, viewed as [B, H, N, C]
        return torch.zeros(NUM_BLOCKS, block, LAYERS, HIDDEN).permute(0, 2, 1, 3)
    return torch.zeros(NUM_BLOCKS, LAYERS, block, HIDDEN)  # LBHNC: identity


def request(seed: int, num_tokens: int):
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-num_tokens // BLOCK)
    block_ids = (torch.randperm(NUM_BLOCKS - 1, generator=g)[:n_blocks] + 1).tolist()  # block 0 is the null block
    states = torch.randn(num_tokens, LAYERS, HIDDEN, generator=g)
    return block_ids, states


@pytest.mark.parametrize(
    "version,physical",
    [("0.26.0", "NHD"), ("0.28.0", "NHD"), ("0.29.0", "LBNHC"), ("0.33.0", "LBNHC"), ("0.33.0", "LBHNC")],
)
def test_gather_returns_exactly_what_the_layer_wrote(version, physical):
    axis = vllm_compat.hidden_states_block_axis(version)
    kv = view_for(axis, physical)
    hidden_cache.check_view(tuple(kv.shape), axis, LAYERS, HIDDEN, BLOCK)
    for seed, num_tokens in enumerate([1, 15, 16, 17, 100]):
        block_ids, states = request(seed, num_tokens)
        slots = hidden_cache.slot_ids(block_ids, BLOCK, num_tokens)
        write_states(kv, axis, slots, states)
        got = hidden_cache.gather(kv, slots, axis, list(range(LAYERS)))
        assert torch.equal(got, states)
        sub = hidden_cache.gather(kv, slots, axis, [1, 3])
        assert torch.equal(sub, states[:, [1, 3]])


def test_a_view_in_the_other_releases_layout_is_refused():
    old_view = view_for(1)  # [blocks, 16, 4, 8] read with 0.33's rules
    with pytest.raises(ValueError, match="does not match this vLLM release's layout"):
        hidden_cache.check_view(tuple(old_view.shape), vllm_compat.hidden_states_block_axis("0.33.0"), LAYERS, HIDDEN,
                                BLOCK)
    with pytest.raises(ValueError, match="not 4-D"):
        hidden_cache.check_view((NUM_BLOCKS, BLOCK, LAYERS * HIDDEN), 2, LAYERS, HIDDEN, BLOCK)
    # A hybrid model's hidden-states group keeps a smaller block than the bumped global
    # cache_config.block_size (vLLM PR #46301): slots numbered with the global one read zeros.
    hybrid_view = view_for(2, block=22)
    with pytest.raises(ValueError, match="block size 528 of the hidden-states cache group"):
        hidden_cache.check_view(tuple(hybrid_view.shape), 2, LAYERS, HIDDEN, 528)
    hidden_cache.check_view(tuple(hybrid_view.shape), 2, LAYERS, HIDDEN, 22)


def test_slots_are_cut_to_the_prompt_and_too_few_blocks_are_an_error():
    assert hidden_cache.slot_ids([3, 1], 4, 6).tolist() == [12, 13, 14, 15, 4, 5]
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        hidden_cache.slot_ids([3, 1], 4, 9)


def test_versions_and_runner_names():
    axis = vllm_compat.hidden_states_block_axis
    assert [axis(v) for v in ("0.26.0", "0.28.0", "0.29.0", "0.32.0", "0.33.0", "0.33.0rc1.dev5+g1")] == [1, 1, 2, 2, 2, 2]
    assert [vllm_compat.cuda_default_runner(v) for v in ("0.26.0", "0.28.0", "0.29.0", "0.33.0")] == ["v1", "v1", "v2", "v2"]
    assert vllm_compat.model_runner_name("vllm.v1.worker.gpu.kv_connector") == "Model Runner V2"
    assert vllm_compat.model_runner_name("vllm.v1.worker.gpu_model_runner") == "V1 model runner"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_gather_agrees_with_the_installed_vllms_own_reader():
    """The installed release's ExampleHiddenStatesConnector reads its cache with
    extract_from_kv_cache: hsx's gather must agree on a view in that release's layout."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import extract_from_kv_cache

    axis = vllm_compat.hidden_states_block_axis(vllm.__version__)
    kv = view_for(axis)
    block_ids, states = request(7, 40)
    slots = hidden_cache.slot_ids(block_ids, BLOCK, 40)
    write_states(kv, axis, slots, states)
    all_slots = hidden_cache.slot_ids(block_ids, BLOCK, len(block_ids) * BLOCK)
    theirs = extract_from_kv_cache(kv, all_slots, 40)
    assert torch.equal(hidden_cache.gather(kv, slots, axis, list(range(LAYERS))), theirs)
