"""Run by torchrun (tests/test_pipeline.py), one launch for every DDP check: an amod command with its own DDP
(argv), then two DDP steps of a learned router on a converted DETR and a converted CLIP vision encoder, and of a
calibrated A-MoD fold (a tilted shape) on a timm ViT, each rank on its own images; prints each model's parameter and
router checksums, gathered from both ranks."""
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import transformers

import timm

import amod
from amod.cli import main
from amod.mod.calibrate import tilt_shape
from amod.detect.models import small_detr
from amod.train.engine import teardown_distributed


def detr() -> torch.nn.Module:
    return small_detr(d_model=32, ffn=64, heads=4, encoder_layers=4, decoder_layers=1, num_queries=4)


def clip() -> torch.nn.Module:
    config = transformers.CLIPVisionConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                           intermediate_size=64, image_size=32, patch_size=8)
    return transformers.CLIPVisionModel(config)


def vit() -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3,
                             embed_dim=32, num_heads=2, num_classes=4)


# how each model is converted: the learned router (it must stay the same on both ranks), or A-MoD's calibrated fold
CONVERSIONS = {"detr": dict(router="standard", capacity=0.5), "hf-clip": dict(router="standard", capacity=0.5),
               "timm-calibrated-fold": dict(router="attention", capacity=0.8, skipped="fold", protect=0.1,
                                            shape=tilt_shape(-1.0, 3))}


def loss_of(name: str, model: torch.nn.Module, rank: int, g: torch.Generator) -> torch.Tensor:
    if name == "timm-calibrated-fold":
        return model(torch.rand(2, 3, 32, 32, generator=g)).square().mean()
    if name == "detr":
        labels = [{"class_labels": torch.tensor([rank]), "boxes": torch.tensor([[0.4, 0.5, 0.2, 0.3]])}] * 2
        return model(pixel_values=torch.rand(2, 3, 64, 64, generator=g), labels=labels).loss
    return model(pixel_values=torch.rand(2, 3, 32, 32, generator=g)).pooler_output.square().mean()


def checksums(name: str, build, rank: int) -> list[list[float]]:
    torch.manual_seed(0)
    model = amod.convert(build(), **CONVERSIONS[name]).train()
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # no find_unused_parameters: every parameter trains
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        loss = loss_of(name, ddp, rank, g)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    router = sum(p.detach().abs().sum() for n, p in model.named_parameters() if ".router." in n)
    mine = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters())), float(router)],
                        dtype=torch.float64)
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [s.tolist() for s in gathered]


if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    try:
        code = main(sys.argv[1:])  # sets up and tears down its own process group
        # A second default group on torchrun's store would reuse the first group's keys ("default_pg/0/...")
        # and could read a closed peer address from them; its own prefix gives it keys of its own.
        store = dist.PrefixStore("checks", dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                         is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
        sums = {name: checksums(name, build, rank) for name, build in (("detr", detr), ("hf-clip", clip),
                                                                   ("timm-calibrated-fold", vit))}
    except BaseException:  # torchrun shows the first failing rank's traceback only in part: print it whole
        print(f"RANK {rank} FAILED\n{traceback.format_exc()}", flush=True)
        raise
    if rank == 0:
        print("CHECKSUMS", json.dumps({"train": code, **sums}), flush=True)
    teardown_distributed()  # barrier, then destroy: a rank that leaves first can make the other abort at exit
