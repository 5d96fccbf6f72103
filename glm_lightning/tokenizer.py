"""Byte-level tokenizer: ids 0..255 are the raw UTF-8 bytes, specials follow.

A byte vocabulary needs no training, no files and no network, and it round-trips any Unicode string exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class ByteTokenizer:
    """Bytes -> ids 0..255; pad/bos/eos and the three vision specials come after."""

    SPECIALS: tuple[str, ...] = ("pad", "bos", "eos", "image_start", "image", "image_end")
    VOCAB_SIZE: int = 256 + len(SPECIALS)

    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258
    image_start_id: int = 259
    image_id: int = 260
    image_end_id: int = 261

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def special_ids(self) -> dict[str, int]:
        return {name: 256 + i for i, name in enumerate(self.SPECIALS)}

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """UTF-8 bytes of `text`, optionally wrapped in bos/eos."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor, stop_at_eos: bool = True) -> str:
        """Bytes back to text. Stops at eos, skips other specials, replaces invalid UTF-8 (never raises)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if 0 <= i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")

    def left_pad(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The project's one padding convention for prompts: left-padded ids [B, T] and the `valid` mask [B, T]
        (bool, True on real tokens; the model's and `generate`'s `attention_mask`). Left padding puts every row's
        last token in the same column, which cached decoding needs."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for b, r in enumerate(rows):
            if len(r):
                ids[b, width - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
                valid[b, width - len(r):] = True
        return ids, valid

    def encode_batch(self, texts: Sequence[str], bos: bool = True, eos: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`left_pad` of the encoded texts: ids [B, T] and the bool `valid` mask [B, T]."""
        return self.left_pad([self.encode(t, bos=bos, eos=eos) for t in texts])
