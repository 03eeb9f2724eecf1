"""Token merging (ToMe, Bolya et al., ICLR 2023): the training-free baseline amod is compared against.

``amod.tome.apply(model, cost=0.56)`` (or ``r=8``, or one r per block) makes a dense timm ViT merge
tokens in place; ``set_schedule`` changes the tokens merged per block; ``schedule_for_cost`` finds
the schedule closest to a share of the dense MACs. See ``amod.tome.merging``. PiToMe, the peer that
protects isolated tokens: ``amod.pitome.apply(model, cost=0.56)`` (``amod.tome.pitome``).
"""
from . import pitome
from .merging import (ToMeBlock, ToMeConfig, ToMeSettings, apply, schedule_for_cost, set_schedule, token_counts,
                      tome_block_macs, tome_macs)

__all__ = ["pitome", "apply", "set_schedule", "schedule_for_cost", "token_counts", "tome_macs", "tome_block_macs",
           "ToMeConfig", "ToMeSettings", "ToMeBlock"]
