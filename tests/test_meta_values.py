"""The values a forward reads on the meta device (engine/modules/meta_values.py)."""
import torch

from engine.modules.meta_values import MetaValues

META = torch.device("meta")


def test_a_mask_of_ones_selects_everything_its_negation_and_zeros_nothing():
    x = torch.empty(4, 3, device=META)
    with MetaValues() as values:
        ones = torch.ones(4, device=META).bool()  # as the synthesized inputs' masks: all ones
        zeros = torch.zeros(4, dtype=torch.long, device=META).bool()
        assert x[ones].shape == (4, 3) and x[~ones].shape == (0, 3)
        assert x[zeros].shape == (0, 3) and x[~zeros].shape == (4, 3)
        assert torch.cat([x[ones], x[~ones]]).shape == (4, 3)  # valid tokens, then padding
        assert x[torch.full((4,), False, device=META)].shape == (0, 3)
        assert x[torch.zeros_like(ones)[:2].expand(2, 2).reshape(4)].shape == (0, 3)  # views keep the zeros
        assert x[ones.unsqueeze(1).expand(4, 3)].shape == (12,)
        assert ones.nonzero().shape == (4, 1) and (~ones).nonzero().shape == (0, 1)
        assert bool(ones.any()) and bool((~ones).any())  # a truth test reads True, whatever the mask
        for row in torch.zeros(2, 4, dtype=torch.bool, device=META):  # iterating keeps the zeros
            assert x[row].shape == (0, 3)
    assert len(values.syncs) == 1 and torch.autocast is torch.amp.autocast  # every read at one position
