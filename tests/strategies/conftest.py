import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny ops: intra-op threads only add contention on the shared 2-core machine.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
