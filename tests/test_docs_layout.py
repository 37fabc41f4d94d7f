"""The README's Layout names every module of the package, every kernel and every patch, and nothing
that is not there; docs/architecture.md names every patch (each one a point where the plugin touches
SGLang), every private SGLang name the code reads, and only functions that exist where it lists the
runtime mutations.  Found by listing the folders and parsing the code, not by asking the package."""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section(path, title):
    text = open(os.path.join(ROOT, path)).read()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _modules(folder):
    return sorted(f for f in os.listdir(os.path.join(ROOT, folder))
                  if f.endswith(".py") and f != "__init__.py")


def test_the_readme_layout_names_every_module_kernel_and_patch():
    layout = _section("README.md", "Layout")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)/`[^|]* \| (.*) \|$", layout, re.M)}
    for folder in ("sglang_ddtree", "sglang_ddtree/policy", "kernels", "patches"):
        named = set(re.findall(r"`([A-Za-z0-9_]+\.py)`", rows[folder]))
        have = set(_modules(folder))
        assert have <= named, (folder, sorted(have - named))
        assert named <= have, (folder, sorted(named - have))      # nothing stale


def test_architecture_names_every_patch():
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    missing = [p for p in _modules("patches") if f"`{p[:-3]}`" not in text and f"`{p}`" not in text]
    assert not missing, missing


def _code_files():
    return sorted(glob.glob(os.path.join(ROOT, "sglang_ddtree", "**", "*.py"), recursive=True)
                  + glob.glob(os.path.join(ROOT, "patches", "*.py")))


def _private_sglang_names():
    """{name: files}: single-underscore names the plugin reads that it does not define itself --
    imported from an ``sglang`` module, read as an attribute (``x._name``, ``getattr(x, "_name")``)
    -- so SGLang's.  The worker's ``self._...`` are the DFLASH subclass's (architecture.md, section
    2), not counted."""
    trees = {f: ast.parse(open(f).read()) for f in _code_files()}
    ours = set()
    for t in trees.values():
        for n in ast.walk(t):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                ours.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                ours.add(n.id)
            elif isinstance(n, ast.arg):
                ours.add(n.arg)
            elif (isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)
                  and ast.unparse(n.func) in ("setattr", "object.__setattr__")):
                ours.add(n.args[1].value)
    found = {}
    for f, t in trees.items():
        for n in ast.walk(t):
            names = []
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang.") :
                names = [a.name for a in n.names]
            elif isinstance(n, ast.Attribute):
                if not (f.endswith("worker.py") and ast.unparse(n.value) == "self"):
                    names = [n.attr]
            elif (isinstance(n, ast.Call) and ast.unparse(n.func) in ("getattr", "hasattr")
                  and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)):
                names = [n.args[1].value]
            for nm in names:
                if isinstance(nm, str) and nm.startswith("_") and not nm.startswith("__") and nm not in ours:
                    found.setdefault(nm, set()).add(os.path.relpath(f, ROOT))
    return found


def test_architecture_names_every_private_sglang_name_the_code_reads():
    section = _section(os.path.join("docs", "architecture.md"), "Every point where the plugin touches SGLang")
    private = _private_sglang_names()
    assert "_set_kv_buffer" in private and "_prepare_dflash_draft_block_unchecked" in private  # it finds them
    missing = {n: sorted(fs) for n, fs in private.items() if n not in section}
    assert not missing, missing


def test_the_runtime_mutation_table_names_functions_that_exist():
    """Each row of section 4 starts with where the change is made: ``module.function`` (or
    ``module.Class.method``, ``package.module.function`` for a module of a subpackage,
    ``patches/<file>``); every one of them exists in the code."""
    section = _section(os.path.join("docs", "architecture.md"), "Every point where the plugin touches SGLang")
    table = section[section.index("### 4."):section.index("### 5.")]
    rows = re.findall(r"^\| ([^|]+) \|", table, re.M)[2:]          # after the header and the rule
    assert len(rows) >= 10
    for cell in rows:
        for ref in re.findall(r"`([^`]+)`", cell):
            if ref.startswith("patches/"):
                assert os.path.exists(os.path.join(ROOT, ref + ".py")), ref
                continue
            mod, *names = ref.split(".")
            folder = os.path.join(ROOT, "sglang_ddtree")
            while names and os.path.isdir(os.path.join(folder, mod)):     # a subpackage: policy.x.f
                folder = os.path.join(folder, mod)
                mod, *names = names
            path = os.path.join(folder, mod + ".py")
            assert os.path.exists(path), ref
            defined = {n.name for n in ast.walk(ast.parse(open(path).read()))
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            assert names and all(n in defined for n in names), ref
