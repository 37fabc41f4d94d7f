"""The README's Layout names every module of the package, every kernel and every patch, and nothing
that is not there; docs/architecture.md names every patch (each one a point where the plugin touches
SGLang).  Found by listing the folders, not by asking the package."""
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
    for folder in ("sglang_ddtree", "kernels", "patches"):
        named = set(re.findall(r"`([A-Za-z0-9_]+\.py)`", rows[folder]))
        have = set(_modules(folder))
        assert have <= named, (folder, sorted(have - named))
        assert named <= have, (folder, sorted(named - have))      # nothing stale


def test_architecture_names_every_patch():
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    missing = [p for p in _modules("patches") if f"`{p[:-3]}`" not in text and f"`{p}`" not in text]
    assert not missing, missing
