"""Prompts: the built-in sets (code windows and prose from the interpreter's standard library; the
text pair's held-out files), prompt files (JSON / JSON lines), tokenizing for --skip-tokenizer-init
servers, the prompts' digest."""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import List, Optional

from . import checkout


# ------------------------------------------------------------------------------------------ prompts
_CODE_FILES = ("heapq.py", "bisect.py", "textwrap.py", "functools.py", "json/decoder.py", "json/encoder.py",
               "argparse.py", "dataclasses.py", "statistics.py", "fractions.py", "random.py", "csv.py",
               "difflib.py", "string.py", "shlex.py", "glob.py", "fnmatch.py", "copy.py", "pprint.py",
               "calendar.py", "colorsys.py", "contextlib.py", "enum.py", "graphlib.py", "ipaddress.py",
               "operator.py", "queue.py", "sched.py", "secrets.py", "selectors.py", "tokenize.py",
               "collections/__init__.py", "concurrent/futures/_base.py", "email/utils.py",
               "http/cookies.py", "logging/__init__.py", "urllib/parse.py", "zipfile.py", "tarfile.py",
               "pathlib.py", "typing.py", "inspect.py", "ast.py", "gettext.py", "wave.py", "base64.py")
_CODE_TASKS = ("Explain what the following Python code does, then suggest one improvement.",
               "Write unit tests for the following Python code.",
               "Continue the following Python code.",
               "Rewrite the following Python code with type hints and docstrings.")
_PROSE_TASKS = ("Summarize the following documentation in plain words.",
                "Continue the following text.",
                "Write three exam questions (with answers) about the following text.",
                "Explain the following passage to a beginner, with an example.")


def textpair_prompts(n: int, template: str = "{prompt}", checkout_root: Optional[str] = None) -> List[dict]:
    """The text pair's A/B prompts: bare code windows and docstrings of its held-out files (in-domain
    for a model trained on the standard library's raw text; 2026-12-01 session 7: before, the
    instruction-wrapped prompts of :func:`make_prompts`)."""
    return make_prompts(n, template, files=textpair_heldout_files(checkout_root), bare=True)


def textpair_heldout_files(checkout_root: Optional[str] = None):
    """The text pair's held-out stdlib files (bench/textpair/corpus_manifest.tsv: sorted file i is
    held out iff i % 20 == 10): prompts for that pair must not come from its training files.
    The manifest is a checkout file (``checkout``: ``checkout_root``, $SGLANG_DDTREE_CHECKOUT, ...)."""
    man = checkout.path("bench", "textpair", "corpus_manifest.tsv", root_dir=checkout_root,
                        what="the text pair's prompts (--pair text, the default without --model-path)")
    rows = [line.split("\t")[0] for line in open(man) if not line.startswith("#")]
    return tuple(p for i, p in enumerate(rows) if i % 20 == 10)


def _stdlib_texts(files=None):
    """Code windows and prose paragraphs from the interpreter's standard library (offline,
    deterministic for a given Python version).  ``files``: restrict to these stdlib files (then
    the pydoc topics prose is used only if pydoc_data/topics.py is among them)."""
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    code = []
    for rel in (files if files is not None else _CODE_FILES):
        p = os.path.join(root, rel)
        if not os.path.isfile(p):
            continue
        lines = open(p, encoding="utf-8", errors="replace").read().splitlines()
        last = -10 ** 9
        for start, line in enumerate(lines):  # windows that start at a def / class, >= 40 lines apart
            if start - last < 40 or not line.lstrip().startswith(("def ", "class ")):
                continue
            chunk = "\n".join(lines[start:start + 32]).strip("\n")
            if len(chunk) > 400:
                code.append((f"stdlib/{rel}:{start + 1}", chunk))
                last = start
    prose = []
    try:
        if files is not None and "pydoc_data/topics.py" not in files:
            raise ImportError("pydoc topics not among the allowed files")
        from pydoc_data.topics import topics  # the language reference, as prose
        for key in sorted(topics):
            paras = [q.strip() for q in topics[key].split("\n\n")]
            buf = ""
            for q in paras:
                if len(q) < 80 or q.count("   ") > 6:  # skip headings and code/grammar blocks
                    continue
                buf = (buf + "\n\n" + q).strip()
                if len(buf) > 700:
                    prose.append((f"pydoc_data/topics:{key}", buf[:1600]))
                    buf = ""
    except Exception:  # noqa: BLE001 - an interpreter without pydoc_data: module docstrings only
        pass
    if len(prose) < 50:  # module docstrings, then (if still few: a restricted file set) class / function ones
        import ast
        module_docs, node_docs = [], []
        for rel in (files if files is not None else _CODE_FILES):
            p = os.path.join(root, rel)
            if not os.path.isfile(p):
                continue
            try:
                tree = ast.parse(open(p, encoding="utf-8", errors="replace").read())
            except (SyntaxError, ValueError):  # e.g. lib2to3's Python 2 test data
                continue
            doc = ast.get_docstring(tree)
            if doc and len(doc) > 200:
                module_docs.append((f"stdlib/{rel}:docstring", doc[:1600]))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 300:
                        node_docs.append((f"stdlib/{rel}:{node.lineno}:docstring", doc[:1600]))
        prose += module_docs
        if len(prose) < 50:
            prose += node_docs
    return code, prose


def _stride(size: int) -> int:
    """A step through a pool of ``size`` that visits every entry before repeating (coprime with
    ``size``), spreading neighbours apart.  A fixed step of 7 sent every prose prompt to the same
    docstring on Python 3.12's held-out files (7 module docstrings): the text-pair A/B reports
    before 2026-12-01 session 7 repeat one prose prompt in every other request."""
    return next(k for k in (7, 11, 13, 17, 19, 23, 1) if math.gcd(k, size) == 1)


def make_prompts(n: int, template: str = "{prompt}", files=None, bare: bool = False) -> List[dict]:
    """n prompts, code and prose alternating (a few hundred distinct ones), deterministic.
    ``bare``: the source text alone (no task line, no code fence): in-domain prompts for a base model
    trained on such text (the text pair, trained on the standard library's raw files), whose
    continuation of an instruction it never saw says little about a drafter."""
    code, prose = _stdlib_texts(files)
    if not code and not prose:
        raise RuntimeError("no standard-library sources found to build prompts from; pass --prompts")
    out = []
    i = 0
    while len(out) < n:
        pool, tasks, kind = (code, _CODE_TASKS, "code") if i % 2 == 0 or not prose else (prose, _PROSE_TASKS, "prose")
        if not pool:
            pool, tasks, kind = (prose, _PROSE_TASKS, "prose") if prose else (code, _CODE_TASKS, "code")
        j = i // 2
        src, body = pool[(j * _stride(len(pool))) % len(pool)]
        task = tasks[j % len(tasks)]
        if bare:
            text = template.replace("{prompt}", body)
        else:
            fence = f"```python\n{body}\n```" if kind == "code" else body
            text = template.replace("{prompt}", f"{task}\n\n{fence}\n")
        out.append(dict(text=text, source=src, kind=kind))
        i += 1
    return out


def make_long_prompts(n: int, min_chars: int, template: str = "{prompt}", files=None) -> List[dict]:
    """n long-context prompts, deterministic: prompt i joins consecutive standard-library texts (code
    windows and prose paragraphs, alternating) from its own starting point until it holds at least
    ``min_chars`` characters (about 3-4 per token), so the prefix a verify reads is long."""
    if min_chars < 1:
        raise ValueError(f"min_chars must be >= 1, got {min_chars}")
    code, prose = _stdlib_texts(files)
    pool = [x for pair in zip(code, prose) for x in pair] + code[len(prose):] + prose[len(code):]
    if not pool:
        raise RuntimeError("no standard-library sources found to build prompts from; pass --prompts")
    total = sum(len(b) for _, b in pool)
    if total < min_chars:
        raise ValueError(f"the standard library here holds {total} characters of prompt text, fewer than "
                         f"the {min_chars} asked for one prompt; pass --prompts")
    step = _stride(len(pool))
    out = []
    for i in range(n):
        j, parts, size = (i * step) % len(pool), [], 0
        first = pool[j][0]
        while size < min_chars:
            size += len(pool[j][1]) + (2 if parts else 0)   # + the "\n\n" that joins it to the last
            parts.append(pool[j][1])
            j = (j + 1) % len(pool)
        text = template.replace("{prompt}", "\n\n".join(parts))
        out.append(dict(text=text, source=f"long:{first}+{len(parts) - 1}", kind="long"))
    return out


def load_prompts_file(path: str, template: str = "{prompt}") -> List[dict]:
    """JSON list or JSON lines; each item a string, {"text"|"prompt": str} or {"input_ids": [int]}."""
    with open(path) as f:
        raw = f.read()
    try:
        items = json.loads(raw)
        if isinstance(items, dict):
            items = items.get("prompts") or [items]
    except json.JSONDecodeError:
        items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    out = []
    for k, it in enumerate(items):
        if isinstance(it, str):
            it = {"text": it}
        if "input_ids" in it:
            out.append(dict(input_ids=[int(x) for x in it["input_ids"]], source=f"{os.path.basename(path)}:{k}"))
        else:
            text = it.get("text", it.get("prompt"))
            if not isinstance(text, str):
                raise ValueError(f"{path} item {k}: needs text, prompt or input_ids")
            out.append(dict(text=template.replace("{prompt}", text), source=f"{os.path.basename(path)}:{k}"))
    return out


def tokenize_prompts(prompts: List[dict], model_path: str, max_input_tokens: int, vocab: Optional[int] = None):
    """Token-id prompts for --skip-tokenizer-init servers: the model's tokenizer.json (tokenizers
    package) when present, else bytes + 3.  Truncated to max_input_tokens (the tail is kept)."""
    tok = None
    tj = os.path.join(model_path, "tokenizer.json")
    if os.path.isfile(tj):
        try:
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(tj)
        except Exception:  # noqa: BLE001
            tok = None
    how = "tokenizer.json" if tok is not None else "bytes+3"
    for p in prompts:
        if "input_ids" in p:
            ids = p["input_ids"]
        elif tok is not None:
            ids = tok.encode(p["text"]).ids
        else:
            ids = [b + 3 for b in p["text"].encode("utf-8")]
        if vocab:
            ids = [i % vocab for i in ids]
        p["input_ids"] = ids[-max_input_tokens:] if max_input_tokens else ids
    return how


GOLDEN = 0.6180339887498949


def spread_new_tokens(prompts: List[dict], spread: float) -> List[dict]:
    """Each prompt i gets ``new_tokens_scale = 1 - spread + 2 spread u_i``, u_i = frac((i + 1) * golden
    ratio): a low-discrepancy spread over [1 - spread, 1 + spread], fixed by the prompt's position, so
    every arm asks the same lengths (outputs stay comparable token by token).  With one output length
    for every request, requests admitted together finish together: at c = 64 the server then runs in
    lockstep waves whose last stragglers decode alone (measured on the H200, session 15: base's c=64
    repeats spread 7802-9394 tok/s).  ``spread`` 0 leaves the prompts alone.  Returns new dicts."""
    spread = float(spread)
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"--new-tokens-spread must be in [0, 1), got {spread}")
    if spread == 0.0:
        return prompts
    return [dict(p, new_tokens_scale=1.0 - spread + 2.0 * spread * (((i + 1) * GOLDEN) % 1.0))
            for i, p in enumerate(prompts)]


def prompt_digest(prompts: List[dict]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p.get("input_ids") if "input_ids" in p else p["text"]).encode())
    return h.hexdigest()[:16]

