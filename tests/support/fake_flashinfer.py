"""A stand-in for the flashinfer module, for testing tuner's wrapper logic on the CPU.

Its plan() schedules as FlashInfer 0.6's decode planner does in outline (split a request's
pages into chunks of a fixed length once any request is longer than one chunk) and writes
the plan into a page-locked-style host buffer in FlashInfer's DecodePlanInfo layout. It
records every plan and what run() read, so tests can check when tuner re-plans, which
tensors a run reads, and that no plan got device-resident metadata. Its prefill wrapper
plans likewise, in FA2's PrefillPlanInfo layout (backend "auto" resolves to "fa2").
"""

import types

import numpy as np
import torch

CHUNK_PAGES = 4


class _FakeWrapper:
    """What both fakes share: the buffers a run reads, the plan written into the page-locked
    host buffer in FlashInfer's layout, and the record of plans and runs."""

    def _start(self, indptr_buf, indices_buf, last_page_len_buf) -> None:
        self._pin_memory_int_workspace_buffer = torch.zeros(4096, dtype=torch.uint8)
        self._paged_kv_indptr_buf = indptr_buf
        self._paged_kv_indices_buf = indices_buf
        self._paged_kv_last_page_len_buf = last_page_len_buf
        self.plan_calls: list[dict] = []
        self.runs: list[dict] = []
        type(self).instances.append(self)

    def _write_plan(self, chunks_per_row: np.ndarray, chunk_tokens: int, split: bool, layout: tuple) -> None:
        """layout: (plan info fields, o_indptr's field, chunk size's field, split's field)."""
        size, o_at, chunk_at, split_at = layout
        o_indptr = np.concatenate([[0], np.cumsum(chunks_per_row)]).astype(np.int32)
        raw = self._pin_memory_int_workspace_buffer.numpy()
        raw[64:64 + 4 * len(o_indptr)] = o_indptr.view(np.uint8)
        raw[32:36] = np.array([chunk_tokens], dtype=np.int32).view(np.uint8)
        info = [0] * size
        info[o_at], info[chunk_at], info[split_at] = 64, 32, int(split)
        self._plan_info = info

    def run(self, q, paged_kv_cache, return_lse=False, **kwargs):
        read = {"indptr": self._paged_kv_indptr_buf, "indices": self._paged_kv_indices_buf,
                "last_page_len": self._paged_kv_last_page_len_buf, "return_lse": return_lse, **kwargs}
        self.runs.append(read)
        # a real query: an output of its shape (what paged_attention reshapes); else what it read
        return torch.zeros_like(q) if isinstance(q, torch.Tensor) else read


def _chunks(pages: np.ndarray, chunk: int, split: bool) -> np.ndarray:
    return -(-np.maximum(pages, 1) // chunk) if split else np.ones_like(pages)


class BatchDecodeWithPagedKVCacheWrapper(_FakeWrapper):
    instances: list = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto"):
        self.use_tensor_cores, self._backend, self.use_cuda_graph = use_tensor_cores, backend, use_cuda_graph
        self.forwards: list[str] = []
        self.workspace_resets = 0
        self._start(paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs):
        self.plan_calls.append(dict(kwargs, indptr=indptr.clone(), last_page_len=last_page_len.clone(),
                                    page_size=page_size))
        if self.use_tensor_cores and self._backend == "auto":
            self._backend = "fa2"
        if indptr.device.type != "cpu":  # the standard plan reads device metadata back; not modelled
            self._plan_info = [0] * 10
            self._paged_kv_indptr_buf, self._paged_kv_indices_buf = indptr, indices
            self._paged_kv_last_page_len_buf = last_page_len
            return
        pages = np.diff(indptr.numpy())
        chunk = kwargs.get("fixed_split_size") or CHUNK_PAGES
        split = bool(pages.max() > chunk)
        self._write_plan(_chunks(pages, chunk, split), chunk * page_size, split, (10, 5, 7, 9))  # DecodePlanInfo
        if self.use_cuda_graph:
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf, self._paged_kv_indices_buf = indptr.clone(), indices
            self._paged_kv_last_page_len_buf = last_page_len.clone()

    def forward(self, q, paged_kv_cache, pos_encoding_mode="NONE", **kwargs):
        self.forwards.append(pos_encoding_mode)
        return self.run(q, paged_kv_cache, **kwargs)

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer):
        self.workspace_resets += 1


class BatchPrefillWithPagedKVCacheWrapper(_FakeWrapper):
    instances: list = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 backend="auto", **kwargs):
        self._backend, self.use_cuda_graph = backend, use_cuda_graph
        self._start(paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)

    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
             **kwargs):
        self.plan_calls.append(dict(kwargs, qo_indptr=qo_indptr.clone(), indptr=indptr.clone(),
                                    last_page_len=last_page_len.clone(), page_size=page_size))
        if self._backend == "auto":
            self._backend = "fa2"
        if indptr.device.type != "cpu":  # the standard plan reads device metadata back; not modelled
            self._plan_info = [0] * 15
        else:  # FA2's PrefillPlanInfo: o_indptr counts each request's kv chunks times its query rows
            pages = np.diff(indptr.numpy())
            chunk = kwargs.get("fixed_split_size") or CHUNK_PAGES
            split = bool(pages.max() > chunk) and not kwargs.get("disable_split_kv")
            self._write_plan(_chunks(pages, chunk, split) * np.diff(qo_indptr.numpy()), chunk * page_size, split,
                             (15, 8, 9, 14))
        self._paged_kv_indptr_buf, self._paged_kv_indices_buf = indptr.clone(), indices
        self._paged_kv_last_page_len_buf = last_page_len.clone()


def module() -> types.ModuleType:
    """A fresh stand-in module (hashable, as a module is: tuner keys its wrappers by it)."""
    BatchDecodeWithPagedKVCacheWrapper.instances = []
    BatchPrefillWithPagedKVCacheWrapper.instances = []
    stand_in = types.ModuleType("fake_flashinfer_module")
    stand_in.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    stand_in.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return stand_in
