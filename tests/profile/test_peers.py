"""The links between ranks: every pair measured once, with the backend in use, gathered on rank 0."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetero.profile import peers

SIZES = (4 * 2**10, 256 * 2**10)


def test_one_process_has_no_peers():
    assert not dist.is_initialized()
    assert peers.measure(torch.device("cpu")) == []


def _worker(rank: int, world: int, rdzv: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    found = peers.measure(torch.device("cpu"), sizes=SIZES, repeats=3)
    torch.save({"rank": peers.rank(), "peers": found}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_pair_of_three_ranks_is_measured_once_and_rank_0_has_them_all(tmp_path):
    mp.spawn(_worker, args=(3, str(tmp_path / "rdzv"), str(tmp_path)), nprocs=3, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert results[1]["peers"] == results[2]["peers"] == []
    found = results[0]["peers"]
    assert [(p.src, p.dst, p.backend) for p in found] == [(0, 1, "gloo"), (0, 2, "gloo"), (1, 2, "gloo")]
    for p in found:
        assert [c.size_bytes for c in p.transfer] == list(SIZES)
        assert all(c.time_s > 0 for c in p.transfer)
