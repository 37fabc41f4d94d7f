"""Files the wheel carries (package data under ``sglang_ddtree/data/``), by path.

``FIXTURES_DIR``: captured DFlash drafter top-k (``topk_text_dflash_rNN.npz``, format in its
README.md), the main job's first part and the kernel tests' fixtures.
``TEXTPAIR_DIR``: the text pair of :mod:`sglang_ddtree.textpair` (``target.safetensors``,
``drafter.safetensors``, ``heldout_prompts.json``), the main job's second part; in a checkout the two
weight files are ``.safetensors.xz`` (:func:`sglang_ddtree.textpair.read_weights` reads either).
"""
import os

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FIXTURES_DIR = os.path.join(DATA_DIR, "fixtures")
TEXTPAIR_DIR = os.path.join(DATA_DIR, "textpair")
TEXTPAIR_PROMPTS = os.path.join(TEXTPAIR_DIR, "heldout_prompts.json")
