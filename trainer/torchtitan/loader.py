"""The data loader a torchtitan job under ResiHP trains with: torchtitan's loader contract, the
platform's one-number state (trainer/torchtitan/data.py says why).

It is a torchtitan ``Configurable`` (``--dataloader.dataset_path`` names the folder
``trainer.torchtitan.assets.build_assets`` writes), built by torchtitan's trainer with the dp rank
and degree of the layout it runs. Its checkpoint state is ``{"samples_consumed": n}``, the same on
every rank, so DCP keeps one copy and any layout resumes from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader

from trainer.torchtitan.data import PackedStream, batches_done, slot

_STREAMS: dict[tuple[str, int], PackedStream] = {}


def packed_stream(folder: str, tokenizer: Any) -> PackedStream:
    """The corpus of ``folder`` tokenised once per process (``<bos> text <eos>`` per document)."""
    key = (str(Path(folder).resolve()), id(tokenizer))
    if key not in _STREAMS:
        corpus = Path(folder) / "corpus.jsonl"
        if not corpus.exists():
            raise FileNotFoundError(f"no corpus at {corpus}: build it with `python -m trainer.torchtitan.assets "
                                    f"{folder}` (resihp run does this for --dataloader.dataset_path)")
        docs = [tokenizer.encode(json.loads(line)["text"], add_bos=True, add_eos=True)
                for line in corpus.read_text().splitlines() if line.strip()]
        _STREAMS[key] = PackedStream.from_documents(docs)
    return _STREAMS[key]


class PackedCorpusLoader(BaseDataLoader):
    """Batches ``{"input", "positions"}, labels`` of ``local_batch_size`` samples, in the job-wide
    order of trainer/torchtitan/data.py."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "resihp_packed"

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any, seq_len: int,
                 local_batch_size: int, **_unused: Any) -> None:
        if not config.dataset_path:
            raise ValueError("--dataloader.dataset_path is required: the folder with corpus.jsonl "
                             "(trainer/torchtitan/assets.py)")
        self.stream = packed_stream(config.dataset_path, tokenizer)
        self.dp_degree, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.batch_size = seq_len, local_batch_size
        self.batches = 0  # taken by this rank

    @property
    def samples_consumed(self) -> int:
        """Samples the whole job has consumed (every rank takes as many batches per step)."""
        return self.batches * self.dp_degree * self.batch_size

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            first = slot(self.batches, self.dp_rank, self.dp_degree) * self.batch_size
            rows = [self.stream.sample(first + j, self.seq_len) for j in range(self.batch_size)]
            self.batches += 1
            ids, positions, labels = (torch.from_numpy(np.stack([r[i] for r in rows])) for i in range(3))
            yield {"input": ids, "positions": positions}, labels

    def state_dict(self) -> dict[str, Any]:
        return {"samples_consumed": self.samples_consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.batches = batches_done(int(state_dict["samples_consumed"]), self.dp_degree, self.batch_size)
