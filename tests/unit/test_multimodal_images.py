"""Images inside a causal stream (``MultimodalDecoder(image_attention=)``, the data's ``image_spans``), in one
process. The sharded model against dense float64 attention with the same spans is
``tests/distributed/test_masks.py::test_multimodal_decoder_with_bidirectional_images_matches_dense_fp64``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_sp.data.multimodal import (
    DigitSequenceDataset,
    MultimodalDataConfig,
    MultimodalVocab,
    collate_stack,
    image_patch_spans,
)
from lightning_sp.models import MultimodalDecoder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def samples():
    ds = DigitSequenceDataset(MultimodalDataConfig(n_images=3, samples_per_epoch=2), split="train")
    return [ds[0], ds[1]]


def _model(image_attention):
    torch.manual_seed(0)
    return MultimodalDecoder(d_model=32, n_layers=2, n_heads=2, image_attention=image_attention).double().eval()


def test_image_spans_are_each_images_patch_tokens_and_hold_no_target(samples):
    v = MultimodalVocab()
    s = samples[0]
    spans = s["image_spans"]
    assert spans.tolist() == [[2, 18], [23, 39], [44, 60]]
    is_patch = s["input_ids"] >= v.patch0
    inside = torch.zeros_like(is_patch)
    for start, end in spans.tolist():
        inside[start:end] = True
        # no position sees its own target: only the last patch is supervised-adjacent, and it predicts </img> (outside)
        assert (s["labels"][start:end - 1] == -100).all() and s["input_ids"][end].item() == v["</img>"]
    assert torch.equal(inside, is_patch)  # exactly the patch tokens, markers excluded
    # truncated: the kept tail's coordinates; a cut-through image keeps its visible patches, a cut-off one is dropped
    assert image_patch_spans(3, truncate_to=40).tolist() == [[0, 7], [12, 28]]
    t = DigitSequenceDataset(MultimodalDataConfig(n_images=3, samples_per_epoch=2, truncate_to=40))[0]
    assert torch.equal(t["image_spans"], image_patch_spans(3, truncate_to=40))
    assert (t["input_ids"][0:7] >= v.patch0).all() and (t["input_ids"][7] < v.patch0)
    assert image_patch_spans(3, truncate_to=8).shape == (0, 2)  # only the question is left
    assert collate_stack(samples)["image_spans"].shape == (2, 3, 2)


@pytest.mark.parametrize("image_attention", ["bidirectional", "causal"])
def test_a_patch_sees_the_later_patches_of_its_own_image_only_when_bidirectional(image_attention, samples):
    model = _model(image_attention)
    batch = collate_stack(samples[:1])
    ids = batch["input_ids"]
    changed = ids.clone()
    changed[0, 30] = MultimodalVocab().patch0 + (int(ids[0, 30]) - MultimodalVocab().patch0 + 1) % 256  # image 2's 8th patch
    with torch.no_grad():
        a, b = model(ids, image_spans=batch["image_spans"]), model(changed, image_spans=batch["image_spans"])
    moved = (a - b).abs().amax(dim=-1)[0]  # [S]
    assert moved[:23].max() == 0  # text and the first image before it: causal either way
    earlier_patches = moved[23:30].max()
    if image_attention == "bidirectional":
        assert earlier_patches > 1e-6  # patches 1..7 of image 2 see patch 8
    else:
        assert earlier_patches == 0
    assert moved[30:].min() > 0  # the changed token and everything after it
    with torch.no_grad():  # without spans (a bare forward) every token is causal
        assert torch.equal(_model(image_attention)(ids), _model("causal")(ids))


def test_bad_image_inputs_raise_clear_errors(samples):
    with pytest.raises(ValueError, match="image_attention must be one of"):
        MultimodalDecoder(image_attention="full")
    assert MultimodalDecoder(d_model=16, n_layers=1, n_heads=2).image_attention == "causal"  # batches without spans train
    model = _model("bidirectional")
    model.log = lambda *args, **kwargs: None
    batch = collate_stack(samples)
    no_spans = {k: t for k, t in batch.items() if k != "image_spans"}
    with pytest.raises(ValueError, match="needs the batch's image_spans"):
        model._step(no_spans, "train")
    shifted = dict(batch, image_spans=batch["image_spans"].clone())
    shifted["image_spans"][1] += 1
    with pytest.raises(ValueError, match="image_spans differ between the samples"):
        model._step(shifted, "train")
    with pytest.raises(ValueError, match=r"must be \[B, n, 2\] or \[n, 2\]"):
        model.image_mask(torch.zeros(2, 3, 3, dtype=torch.long))
    leaking = dict(batch, labels=batch["labels"].clone())
    leaking["labels"][:, 2:17] = batch["input_ids"][:, 3:18]  # 15 patches per row see their target
    with pytest.raises(ValueError, match="30 supervised positions lie inside a bidirectional image span"):
        model._step(leaking, "train")
    causal = _model("causal")
    causal.log = model.log
    assert torch.isfinite(causal._step(no_spans, "train")) and torch.isfinite(causal._step(leaking, "train"))
    assert torch.isfinite(model._step(batch, "train"))


def test_demo_uses_bidirectional_images_and_the_study_keeps_the_causal_arm():
    demo = yaml.safe_load((ROOT / "experiments/multimodal_demo/config.yaml").read_text())
    assert demo["model"]["init_args"]["image_attention"] == "bidirectional"
    study = yaml.safe_load((ROOT / "experiments/context_matters/base.yaml").read_text())
    assert study["model"]["init_args"]["image_attention"] == "causal"
    from experiments.context_matters.run import arm_command, arm_name

    assert arm_name(None, 4, "bidirectional") == "full_sp4_bidir" and arm_name(None, 4) == "full_sp4"
    cmd = arm_command(truncate=None, seed=0, steps=1, log_root=Path("/tmp"), full_ranks=4, val_batches=None,
                      image_attention="bidirectional")
    assert cmd[cmd.index("--model.init_args.image_attention") + 1] == "bidirectional"
