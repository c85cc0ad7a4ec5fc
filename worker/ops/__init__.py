"""Vectorised tensor kernels of the sampler and the built-in processors (pure functions)."""

from worker.ops.draw import draw_rows, draw_weights, uniforms
from worker.ops.scratch import Buffer
from worker.ops.select import exact_topk, row_argmax, sort_by_value_then_id, topk_candidates
from worker.ops.topk_topp import top_p_histogram_, top_p_keep, top_p_probe

__all__ = [
    "Buffer",
    "draw_rows",
    "draw_weights",
    "exact_topk",
    "row_argmax",
    "sort_by_value_then_id",
    "top_p_histogram_",
    "top_p_keep",
    "top_p_probe",
    "topk_candidates",
    "uniforms",
]
