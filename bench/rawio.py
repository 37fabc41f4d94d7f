"""Reading the committed raw records (``bench/results/raw/``), the larger of which are stored gzipped.

``open_maybe_gz(path)`` opens ``x.gz`` through gzip, and also a plain ``x`` that is not there while
``x.gz`` is (so a command or a report naming the record as it was written, ``x.json`` /
``x.jsonl``, still reads the committed ``x.json.gz`` / ``x.jsonl.gz``).  ``record_name(path)`` is
the name a report gives the record: its base name without the storage ``.gz``, so a report renders
the same from the plain and the gzipped file.  Standard library only (the GPU host runs these too)."""
import gzip
import os


def open_maybe_gz(path: str, mode: str = "rt"):
    """A raw record opened for reading: through gzip when ``path`` (or, when ``path`` is missing,
    ``path + '.gz'``) ends in ``.gz``, else as a plain file."""
    if not path.endswith(".gz") and not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    return gzip.open(path, mode) if path.endswith(".gz") else open(path, mode)


def record_name(path: str) -> str:
    """The record's base name without a storage ``.gz``."""
    b = os.path.basename(path)
    return b[:-3] if b.endswith(".gz") else b
