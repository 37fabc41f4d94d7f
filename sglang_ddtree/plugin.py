"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] ddtree``).

SGLang calls :func:`register` in every one of its processes (CLI, Engine, one scheduler per TP
rank, DP controller, detokenizer).  The DDTREE-GPU speculative worker is not written yet (see
docs/NOTES.md), so nothing is registered: asking SGLang for ``--speculative-algorithm
DDTREE-GPU`` fails at argument resolution with SGLang's own "Unknown speculative algorithm name"
error rather than at some later point.
"""
import logging

logger = logging.getLogger(__name__)


def register() -> None:
    logger.debug("sglang_ddtree plugin loaded: no speculative algorithm registered yet")
