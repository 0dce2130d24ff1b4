"""The tokenizer and corpus a torchtitan job trains on here, made from text the platform generates.

torchtitan reads a Hugging Face tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json``) and
a dataset; its debug configs point at files of its source tree that the PyPI wheel does not carry, and
this machine downloads nothing at run time. So the platform writes both: a corpus of synthetic
documents whose lengths are heavy-tailed (a lognormal; the packed batches then carry the length mix
that makes attention cost vary, which the detector must explain), and a byte-level BPE tokenizer
trained on that corpus with the ``tokenizers`` library, its vocabulary no larger than the debug
model's 2,048 rows.

Everything is a pure function of ``seed``: two machines (or two incarnations of one job) that build
the assets get the same bytes, so a job restarted at a new layout reads the same token stream.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
DEBUG_VOCAB_SIZE = 2048  # torchtitan's llama3 debugmodel embeds 2,048 tokens

_WORDS = ("pipeline stage replica tensor shard gradient optimizer checkpoint layer token attention "
          "sequence batch rank device link straggler heartbeat reshape plan epoch loss step micro "
          "warmup schedule bubble activation weight bias norm embedding head vocabulary corpus "
          "document packing window kernel memory bandwidth latency throughput cluster node spare "
          "quorum lighthouse heal evict restart resume layout mesh group collective reduce gather "
          "scatter broadcast send receive forward backward fused timer wait compute predict").split()


@dataclass(frozen=True)
class CorpusSpec:
    """How many documents, and how long: lengths in words from a lognormal (median ``e^mu``)."""

    documents: int = 2000
    mu: float = 4.0
    sigma: float = 1.0
    max_words: int = 3000
    seed: int = 0


def documents(spec: CorpusSpec) -> list[str]:
    """The corpus's documents, a pure function of ``spec``."""
    rng = random.Random(spec.seed)
    docs = []
    for _ in range(spec.documents):
        n = max(2, min(spec.max_words, int(rng.lognormvariate(spec.mu, spec.sigma))))
        words = [rng.choice(_WORDS) for _ in range(n)]
        sentences, i = [], 0
        while i < n:
            k = rng.randint(4, 14)
            sentences.append(" ".join(words[i:i + k]).capitalize() + ".")
            i += k
        docs.append(" ".join(sentences))
    return docs


def build_assets(folder: str | os.PathLike[str], spec: CorpusSpec = CorpusSpec(),
                 vocab_size: int = 512) -> Path:
    """Write ``corpus.jsonl`` and the tokenizer files into ``folder`` (kept if already there for the
    same spec) and return the folder, the value for torchtitan's ``--hf_assets_path`` and our
    data loader's ``--dataloader.dataset_path``."""
    if vocab_size > DEBUG_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} exceeds the debug model's {DEBUG_VOCAB_SIZE} embedding rows")
    root = Path(folder)
    stamp = root / "assets.json"
    wanted = {"spec": spec.__dict__, "vocab_size": vocab_size, "format": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return root
    root.mkdir(parents=True, exist_ok=True)
    docs = documents(spec)
    _write_atomic(root / "corpus.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs))
    _train_tokenizer(docs, root, vocab_size)
    _write_atomic(stamp, json.dumps(wanted))
    return root


def _train_tokenizer(docs: list[str], root: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(docs, trainer=trainer)
    _write_atomic(root / "tokenizer.json", tokenizer.to_str())
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True,
              "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"}
    _write_atomic(root / "tokenizer_config.json", json.dumps(config, indent=1))


def _write_atomic(path: Path, text: str) -> None:
    """Several ranks may build the same assets at once: each writes its own temporary file and
    renames it, so a reader sees a whole file or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.torchtitan.assets FOLDER``: write the assets a torchtitan job here reads."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer.torchtitan.assets", description=__doc__)
    p.add_argument("folder", help="where corpus.jsonl and the tokenizer files go (kept if already built)")
    p.add_argument("--documents", type=int, default=CorpusSpec.documents, help="documents in the corpus")
    p.add_argument("--vocab-size", type=int, default=512, help=f"tokenizer vocabulary (at most {DEBUG_VOCAB_SIZE})")
    args = p.parse_args(argv)
    folder = build_assets(args.folder, CorpusSpec(documents=args.documents), vocab_size=args.vocab_size)
    print(f"{folder}: pass --hf_assets_path {folder} --dataloader.dataset_path {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
