"""``AutoParallelPlugin(mesh=[...])``: candidate meshes planned on rank 0, the plan estimated
fastest trained by every rank -- equal to one device, on the mesh the estimates pick."""

from __future__ import annotations

import pytest

from tests.booster.test_plugin_matrix import _check_fp32


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_candidate_meshes_train_the_fastest_plan_equal_to_one_device():
    # (4,) is priced with 1000x slower links than (2, 2): the plan on (2, 2) is chosen
    # (``_check_fp32`` asserts the mesh), and 5 AdamW steps equal one device.
    _check_fp32("auto-meshes", "gpt2")
