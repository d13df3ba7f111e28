"""The seam every runtime mechanism sits behind: no-op defaults, and finding one by its type."""

import torch

from hetero.run.mechanism import Mechanism, Patches, Phase, find


class Counting(Mechanism):
    def __init__(self):
        self.bound = 0

    def bind(self, model) -> None:
        self.bound += 1


def test_a_mechanism_defines_only_the_calls_it_uses():
    m = Counting()
    m.install(Patches(), lambda optimizer: None)
    m.bind(torch.nn.Linear(1, 1))
    m.close()
    assert (m.bound, m.summary(), m.resident_bytes(), m.explain(RuntimeError())) == (1, [], {}, None)


def test_a_mechanism_is_found_by_its_type_never_its_position():
    other, counting = Mechanism(), Counting()
    assert find([other, counting], Counting) is counting
    assert find([other], Counting) is None


def test_phases_are_ordered_and_the_recorder_comes_last():
    assert sorted(Phase) == list(Phase) and max(Phase) is Phase.RECORD and min(Phase) is Phase.MEMORY


def test_patches_are_restored_in_reverse_order():
    class Owner:
        x = 1
    patches = Patches()
    patches.set(Owner, "x", 2)
    patches.set(Owner, "x", 3)
    patches.restore()
    assert Owner.x == 1
