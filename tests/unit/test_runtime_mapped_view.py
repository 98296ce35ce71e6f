"""`MappedModel.view`: a region's tensors as the engine laid them out."""

from __future__ import annotations

import torch
from aegaeon_common.messages.cache import TensorEntry
from aegaeon_gpumem.shm import ShmRegion, unique_name
from aegaeon_runtime.cacheclient.mapped import MappedModel


def test_float_tensors_are_typed_and_quantized_ones_are_rows_of_blocks() -> None:
    # a 4 x 64 Q4_1 projection (2 blocks of 20 bytes a row) beside 64 bfloat16 norms
    entries = (TensorEntry("proj", "q4_1", [4, 64], 0, 4 * 40),
               TensorEntry("norm", "bfloat16", [64], 160, 128))  # fmt: skip
    region = ShmRegion.create(unique_name("test-view"), 4096)
    try:
        region.tensor[:160] = torch.arange(160, dtype=torch.int64).to(torch.uint8)
        model = MappedModel("m", region, 288, "q4_1", entries)
        proj = model.view("proj")
        assert proj.dtype == torch.uint8 and tuple(proj.shape) == (4, 40)
        assert int(proj[1, 0]) == 40 and int(proj[3, 39]) == 159  # row r starts at r x 40
        norm = model.view("norm")
        assert norm.dtype == torch.bfloat16 and tuple(norm.shape) == (64,)
    finally:
        region.close()
