import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # The single-device references and plans computed in the test process are of tiny models: a
    # second intra-op thread only adds contention with the ranks and the other processes on the
    # shared 2-core machine, where it made a tiny GPT-2's reference steps ~50x slower (10 s
    # against 0.2 s under a load of 3). The forked ranks set their own (run_local's num_threads).
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
