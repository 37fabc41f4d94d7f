"""``sglang.bench_serving`` with prompts given as token ids from a file: the A/B's ``ids`` workload
(issue 52 item 5: "the chain pair on its own chain prompts, 64-256 out").

SGLang 0.5.16's bench_serving sends token ids only for the datasets it generates itself
(``random-ids --tokenize-prompt``); its file datasets (``sharegpt``, ``custom``) read text and assert
``not --tokenize-prompt``, and a pair whose prompts are token ids (the chain pair's permutation
chains, under a tokenizer they do not round-trip through) cannot go through text.  This module keeps
bench_serving's load generation, timing and metrics as they are and adds one thing, the loader:
its ``custom`` dataset also reads a JSON-lines file whose rows are ``{"input_ids": [int, ...]}``
(:data:`IDS_KEY` in the first row marks such a file; any other file goes to SGLang's own loader,
unchanged).  Request ``i`` of ``--num-prompts n`` gets row ``i mod rows`` (the file's order) and an
output length drawn uniformly from ``[max(1, int(L x r)), L]`` (``L`` = ``--random-output-len``, ``r``
= ``--random-range-ratio``, the bounds the ``random-ids`` dataset draws from) with ``--seed``: every
arm's pass of a level sends the same requests.  A prompt given as a list of ints is sent by
bench_serving's ``sglang`` backend as ``input_ids`` (0.5.16 ``benchmark/serving.py``).

    python -m sglang_ddtree.ab.bs_ids <bench_serving's arguments>     # one pass (per-pass client)
    install()                                                         # in the persistent client

:func:`install` replaces ``DATASET_MAPPING["custom"]`` by a subclass of SGLang's class (idempotent).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import List

IDS_KEY = "input_ids"


def is_ids_file(path: str) -> bool:
    """Whether ``path`` is a JSON-lines file whose first row holds :data:`IDS_KEY`."""
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    return isinstance(row, dict) and IDS_KEY in row
    except (OSError, ValueError):
        return False
    return False


def write_ids_rows(rows: List[List[int]], path: str) -> str:
    """The file :func:`read_ids_rows` reads: one ``{"input_ids": [...]}`` line per prompt."""
    with open(path, "w") as f:
        for ids in rows:
            f.write(json.dumps({IDS_KEY: [int(x) for x in ids]}) + "\n")
    return path


def read_ids_rows(path: str) -> List[List[int]]:
    """Every row's token ids; ValueError naming the row when one is not a non-empty list of ints >= 0."""
    rows = []
    with open(path) as f:
        for k, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            ids = row.get(IDS_KEY) if isinstance(row, dict) else None
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)):
                raise ValueError(f"{path} line {k + 1}: {IDS_KEY!r} must be a non-empty list of token ids >= 0")
            rows.append(ids)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def output_lengths(n: int, output_len: int, range_ratio: float, seed: int) -> List[int]:
    """n output lengths, uniform in ``[max(1, int(output_len x range_ratio)), output_len]``, from ``seed``."""
    if output_len < 1 or not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"output length {output_len} must be >= 1 and the range ratio {range_ratio} in [0, 1]")
    lo = max(1, int(output_len * range_ratio))
    rng = random.Random(int(seed))
    return [rng.randint(lo, output_len) for _ in range(int(n))]


def install() -> None:
    """bench_serving's ``custom`` dataset reads token-id files too (module docstring)."""
    from sglang.benchmark import datasets as D
    from sglang.benchmark.datasets.common import BaseDataset, DatasetRow

    base = D.DATASET_MAPPING["custom"]
    if getattr(base, "reads_token_ids", False):
        return

    @dataclass
    class TokenIdsDataset(BaseDataset):
        path: str
        num_requests: int
        output_len: int
        range_ratio: float
        seed: int

        @classmethod
        def from_args(cls, args) -> "TokenIdsDataset":
            return cls(path=args.dataset_path, num_requests=int(args.num_prompts),
                       output_len=int(args.random_output_len), range_ratio=float(args.random_range_ratio),
                       seed=int(args.seed))

        def load(self, tokenizer=None, model_id=None) -> list:
            rows = read_ids_rows(self.path)
            outs = output_lengths(self.num_requests, self.output_len, self.range_ratio, self.seed)
            picked = [rows[i % len(rows)] for i in range(self.num_requests)]     # the file's order, cycled
            return [DatasetRow(prompt=list(ids), prompt_len=len(ids), output_len=out)
                    for ids, out in zip(picked, outs)]

    class CustomOrTokenIds(base):
        """SGLang's ``custom`` dataset, or :class:`TokenIdsDataset` for a token-id file."""
        reads_token_ids = True

        @classmethod
        def from_args(cls, args):
            if getattr(args, "dataset_path", None) and is_ids_file(args.dataset_path):
                return TokenIdsDataset.from_args(args)
            return base.from_args(args)

    D.DATASET_MAPPING["custom"] = CustomOrTokenIds


def main() -> None:
    import sglang.bench_serving as bs
    install()
    bs.cli_main()


if __name__ == "__main__":
    main()
