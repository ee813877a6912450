"""Interleaved image-patch / text sequences from real handwritten digits, with a long-range question.

Images: scikit-learn's 1,797 8x8 digits (ships with the package, values 0..16). Each image is cut
into 2x2 patches (16 per image); each patch is quantised to 4 grey levels per pixel and becomes one
of 256 discrete *patch tokens* (a tiny fixed "VQ" codebook), so image and text share one vocabulary.

One sequence, ``n_images`` images (``T`` text tokens, ``p`` patch tokens)::

    <bos> | <img> p p ... p </img> this is 7 | <img> p ... p </img> this is 2 | ... |
          what was the first image ? 7 <eos>

Targets are next tokens (labels are already shifted, so shards need no neighbour exchange). Only
text tokens are targets: captions (``this is D``: a *local* task, classify the image just seen) and
the final answer (the *long-range* task: the label of the first image, ``~21 * n_images`` tokens
back). A model that cannot see the first image answers at chance (~10%).

Each sample also carries ``image_spans [n, 2]``: the global ``[start, end)`` positions of each image's 16 patch
tokens (markers excluded), for a model that lets an image's patches see each other (``AttentionMask``'s
``bidirectional_spans``). They are the sample's structure before any sharding, so they are the same on every
rank; the strategy passes them whole (they are not a ``sequence_keys`` tensor). No target lies inside a span:
the last patch predicts ``</img>``, which is outside it, so a bidirectional span leaks no label.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100
TEXT_TOKENS = ("<pad>", "<bos>", "<eos>", "<img>", "</img>", "this", "is", "what", "was", "the", "first", "image", "?")
DIGIT_TOKENS = tuple(str(d) for d in range(10))
N_LEVELS, PATCH = 4, 2
N_PATCH_CODES = N_LEVELS ** (PATCH * PATCH)  # 256
TOKENS_PER_IMAGE = 21
"""``<img>``, 16 patches, ``</img>``, ``this``, ``is``, the digit."""
PATCHES_PER_IMAGE = 16


class MultimodalVocab:
    """Ids: text tokens, then digit words ``0..9``, then 256 patch codes."""

    def __init__(self) -> None:
        self.tokens = list(TEXT_TOKENS) + list(DIGIT_TOKENS) + [f"<p{c}>" for c in range(N_PATCH_CODES)]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.digit0 = self.index["0"]
        self.patch0 = self.index["<p0>"]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def __getitem__(self, token: str) -> int:
        return self.index[token]


def image_to_patch_codes(image: np.ndarray) -> np.ndarray:
    """``[8, 8]`` image with values 0..16 -> ``[16]`` patch codes in ``0..255`` (row-major patches)."""
    if image.shape != (8, 8):
        raise ValueError(f"expected an 8x8 digit image, got shape {image.shape}")
    levels = np.clip((image.astype(np.int64) * N_LEVELS) // 17, 0, N_LEVELS - 1)  # [8, 8]
    p = levels.reshape(4, PATCH, 4, PATCH).transpose(0, 2, 1, 3).reshape(16, PATCH * PATCH)  # [16 patches, 4 px]
    weights = N_LEVELS ** np.arange(PATCH * PATCH)
    return p @ weights  # [16]


def load_digits_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Digits ``(images [n, 8, 8], labels [n])``; ``train`` = first 1,500, ``val`` = the other 297."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("multimodal data needs scikit-learn: `pip install -e '.[data]'`") from e
    d = load_digits()
    if split == "train":
        return d.images[:1500], d.target[:1500]
    if split == "val":
        return d.images[1500:], d.target[1500:]
    raise ValueError(f"split must be 'train' or 'val', got {split!r}")


@dataclass(kw_only=True)
class MultimodalDataConfig:
    n_images: int = 16
    """Images per sequence; sequence length is ``21 * n_images + 9``."""
    samples_per_epoch: int = 256
    """Sequences per epoch (drawn deterministically from ``seed`` and the index)."""
    truncate_to: int | None = None
    """Keep only the last ``truncate_to`` tokens (the truncated-context baseline); ``None``: full."""
    seed: int = 0
    """Seeds image choice: sample ``i`` is identical on every rank."""

    def __post_init__(self) -> None:
        if self.n_images < 2:
            raise ValueError(f"n_images must be >= 2 (the question is about an image far back), got {self.n_images}")
        if self.samples_per_epoch < 1:
            raise ValueError(f"samples_per_epoch must be >= 1, got {self.samples_per_epoch}")
        if self.truncate_to is not None and self.truncate_to < 8:
            raise ValueError(f"truncate_to must be >= 8 tokens (the question itself is 8), got {self.truncate_to}")

    @property
    def seq_len(self) -> int:
        full = 21 * self.n_images + 9
        return full if self.truncate_to is None else min(full, self.truncate_to)


def image_patch_spans(n_images: int, truncate_to: int | None = None) -> torch.Tensor:
    """``[n, 2]`` int64: the ``[start, end)`` positions of each image's patch tokens in a sequence of
    ``n_images`` images, in the kept tail when ``truncate_to`` cuts the front (spans cut off are dropped, a
    span cut through keeps its visible patches)."""
    starts = 2 + TOKENS_PER_IMAGE * torch.arange(n_images)  # <bos>, then each image's <img>
    spans = torch.stack([starts, starts + PATCHES_PER_IMAGE], dim=1)  # [n_images, 2]
    full = TOKENS_PER_IMAGE * n_images + 9
    if truncate_to is not None and truncate_to < full:
        spans = (spans - (full - truncate_to)).clamp(min=0)
        spans = spans[spans[:, 1] > spans[:, 0]]
    return spans


class DigitSequenceDataset(Dataset):
    """Sample ``i``: ``input_ids, labels, position_ids [S]``, ``answer_mask [S]`` (bool: the answer target) and
    ``image_spans [n, 2]`` (each image's patch tokens, ``[start, end)``; ``image_patch_spans``).

    ``S = config.seq_len``. ``labels[t]`` is the target for the token after ``input_ids[t]``.
    """

    def __init__(self, config: MultimodalDataConfig, *, split: str = "train") -> None:
        self.cfg = config
        self.vocab = MultimodalVocab()
        images, self.labels = load_digits_split(split)
        self.codes = torch.from_numpy(np.stack([image_to_patch_codes(im) for im in images])).long()  # [n, 16]
        self.split = split

    def __len__(self) -> int:
        return self.cfg.samples_per_epoch

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        v = self.vocab
        offset = 0 if self.split == "train" else 7_919
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + offset + i)
        picks = torch.randint(len(self.labels), (self.cfg.n_images,), generator=g).tolist()
        toks: list[int] = [v["<bos>"]]
        supervised: list[bool] = [False]
        for j in picks:
            toks += [v["<img>"], *(v.patch0 + self.codes[j]).tolist(), v["</img>"], v["this"], v["is"], v.digit0 + int(self.labels[j])]
            supervised += [False] * 17 + [True] * 4  # "</img>", "this", "is", digit are predicted
        answer = v.digit0 + int(self.labels[picks[0]])
        toks += [v[w] for w in ("what", "was", "the", "first", "image", "?")] + [answer, v["<eos>"]]
        supervised += [True] * 8
        ids = torch.tensor(toks)  # [S_full]
        sup = torch.tensor(supervised)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:-1] = torch.where(sup[1:], ids[1:], IGNORE_INDEX)  # target of position t is token t+1
        answer_mask = torch.zeros_like(sup)
        answer_mask[len(toks) - 3] = True  # position of "?" predicts the answer
        position_ids = torch.arange(ids.numel())
        if self.cfg.truncate_to is not None and ids.numel() > self.cfg.truncate_to:
            keep = slice(ids.numel() - self.cfg.truncate_to, None)
            ids, labels, answer_mask = ids[keep], labels[keep], answer_mask[keep]
            position_ids = torch.arange(ids.numel())
        return {"input_ids": ids, "labels": labels, "position_ids": position_ids, "answer_mask": answer_mask,
                "image_spans": image_patch_spans(self.cfg.n_images, self.cfg.truncate_to)}


def collate_stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Equal-length samples ``[S] -> [B, S]``."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
