"""FlashInfer's paged decode and prefill wrappers with their plan arguments from the tuning
DB: tuner.ops.flashinfer_wrappers' plan-reuse wrappers, choosing each plan's config by the runtime's
lookup (exact run key, else a neighbour's by the borrowing rule, else FlashInfer's
default)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from tuner.keys import static_key_from_tuple
from tuner.ops.base import TUNED, Config
from tuner.ops.flashinfer import DECODE_RULES, OP_NAME, PREFILL_RULES
from tuner.ops.flashinfer_wrappers import PlanReuseDecodeWrapper, PlanReusePrefillWrapper
from tuner.ops.rules import config_error
from tuner.runtime import ConfigLookup


def _static_json(static: tuple) -> str:
    return static_key_from_tuple(static).to_json()


def _accepts(config: Config, static: Any, q_len: int) -> bool:
    """A stored config the wrapper can plan: a decode config for one query token, a prefill
    config for more (a borrowed q_len-2 record is a prefill config)."""
    return config_error(config, DECODE_RULES if q_len == 1 else PREFILL_RULES) is None


@functools.cache
def _lookup() -> ConfigLookup:
    """Made on the first plan, so importing this module registers nothing with the runtime."""
    return ConfigLookup(OP_NAME, _static_json, accepts=_accepts)


def choose(static: tuple, batch: int, q_len: int, kv_len: int, default: Config) -> Config:
    """The tuning DB's config for a plan (the wrappers' `choose`)."""
    return _lookup().get(static, batch, q_len, kv_len, default)


class BatchDecodeWithPagedKVCacheWrapper(PlanReuseDecodeWrapper):
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper with tuned plan arguments.

    use_tensor_cores and backend left as TUNED come from the DB per plan (per kv-length
    bucket), as do fixed_split_size and disable_split_kv in plan(); a value the caller
    passes wins. Under use_cuda_graph the config is fixed by the first plan.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: Any = TUNED, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: Any = TUNED,
                 *, config: Config | None = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                         paged_kv_indices_buffer, paged_kv_last_page_len_buffer, backend, config=config,
                         choose=choose)


class BatchPrefillWithPagedKVCacheWrapper(PlanReusePrefillWrapper):
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper with tuned plan arguments (backend,
    fixed_split_size, disable_split_kv), for few query tokens per request over a paged kv
    cache, e.g. speculative-decoding verification. Host lengths: seq_lens (kv) and
    qo_indptr on the CPU."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None, backend: Any = TUNED,
                 *, config: Config | None = None, **flashinfer_kwargs: Any) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, paged_kv_indptr_buf,
                         paged_kv_indices_buf, paged_kv_last_page_len_buf, backend, config=config, choose=choose,
                         **flashinfer_kwargs)
