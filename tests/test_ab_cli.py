"""The installed A/B command ``sglang-ddtree-ab`` (sglang_ddtree.ab.cli:main): declared in pyproject,
importable, ``--help`` without a GPU, torch, SGLang or a checkout, ``--dry-run`` prints the planned
server commands for the user's own model and starts nothing; bench/ab_serve.py runs the same CLI.
(The benchmark itself is tested against a fake server in test_ab_serve.py.)"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import load_bench  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = "sglang_ddtree.ab.cli:main"


def test_entry_point_is_declared_and_importable():
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        pp = tomllib.load(f)
    assert pp["project"]["scripts"]["sglang-ddtree-ab"] == ENTRY
    assert "sglang_ddtree.ab" in pp["tool"]["setuptools"]["packages"]  # the wheel carries the package
    import importlib
    mod, _, fn = ENTRY.partition(":")
    assert callable(getattr(importlib.import_module(mod), fn))


def test_installed_metadata_has_the_console_script():
    from importlib import metadata
    try:
        eps = metadata.distribution("sglang-ddtree").entry_points
    except metadata.PackageNotFoundError:
        pytest.skip("sglang-ddtree is not installed (only the checkout is on the path)")
    scripts = {e.name: e.value for e in eps if e.group == "console_scripts"}
    if "sglang-ddtree-ab" not in scripts:
        pytest.skip("the installed metadata predates the entry point: pip install -e . again")
    assert scripts["sglang-ddtree-ab"] == ENTRY
    exe = shutil.which("sglang-ddtree-ab", path=os.path.dirname(sys.executable)) or shutil.which("sglang-ddtree-ab")
    if exe:  # the generated script itself
        r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "--draft-model-path" in r.stdout, r.stderr[-2000:]


def test_help_exits_zero(capsys):
    from sglang_ddtree.ab.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "A/B serving benchmark" in out and "--model-path" in out and "--draft-model-path" in out


def test_dry_run_plans_the_servers_and_starts_nothing(tmp_path, monkeypatch, capsys):
    from sglang_ddtree.ab import cli, servers

    def no_start(*a, **k):
        raise AssertionError("a dry run started a process")
    monkeypatch.setattr(servers, "PopenServer", no_start)
    monkeypatch.setattr(servers.subprocess, "Popen", no_start)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["--model-path", "/models/T", "--draft-model-path", "/models/D", "--num-prompts", "8",
                   "--arms", "base,dflash,ddtree_b16,ddtreecpu_b8", "--concurrency", "1,8", "--dry-run",
                   "--no-env-probe", "--workdir", str(tmp_path / "work"), "--python", "PY"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = {ln.split("]", 1)[0][1:]: ln.split("] ", 1)[1] for ln in lines if ln.startswith("[")}
    assert list(cmds) == ["base", "dflash", "ddtree_b16", "ddtreecpu_b8"]
    for name, cmd in cmds.items():
        assert cmd.startswith("PY -m sglang.launch_server --model-path /models/T --attention-backend triton"), cmd
        assert "--max-running-requests 8" in cmd and "--cuda-graph-max-bs-decode 8" in cmd
        assert "--skip-tokenizer-init" not in cmd  # text prompts: the server tokenizes
    assert "--speculative" not in cmds["base"]
    assert "--speculative-algorithm DFLASH --speculative-draft-model-path /models/D" in cmds["dflash"]
    assert "--speculative-num-draft-tokens" not in cmds["dflash"]
    assert cmds["ddtree_b16"].endswith("--speculative-algorithm DDTREE-GPU --speculative-draft-model-path "
                                       "/models/D --speculative-num-draft-tokens 17")
    assert "--speculative-algorithm DDTREE-CPU" in cmds["ddtreecpu_b8"] and cmds["ddtreecpu_b8"].endswith(" 9")
    assert [int(p) for p in (c.split("--port ")[1].split()[0] for c in cmds.values())] == [31000, 31010, 31020,
                                                                                           31030]
    summary = json.loads(lines[-1])
    assert summary["count"] == 8 and summary["kind"] == "text" and summary["kinds"] == {"code": 4, "prose": 4}
    assert not os.listdir(tmp_path / "work") and not (tmp_path / "ab_serve.json").exists()  # nothing written


def test_dry_run_puts_pinned_arms_on_their_adaptive_arms_server(tmp_path, monkeypatch, capsys):
    """The dry run lists the servers a run starts: a pinned arm (``_pin<B>``) starts none of its own."""
    from sglang_ddtree.ab import cli, servers

    def no_start(*a, **k):
        raise AssertionError("a dry run started a process")
    monkeypatch.setattr(servers, "PopenServer", no_start)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["--model-path", "/models/T", "--draft-model-path", "/models/D", "--num-prompts", "4",
                   "--arms", "ddtree_auto,ddtree_auto_pin7,base,ddtree_auto_pin15", "--concurrency", "1",
                   "--dry-run", "--no-env-probe", "--workdir", str(tmp_path / "work"), "--python", "PY"])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
    # (the reference arm base is run first)
    assert [ln.split("]", 1)[0][1:] for ln in lines] == ["base", "ddtree_auto", "ddtree_auto_pin7",
                                                        "ddtree_auto_pin15"]
    assert "--port 31000" in lines[0] and "--port 31010" in lines[1]      # two servers, two ports
    assert lines[2].endswith("on ddtree_auto's server, every request with custom_params.ddtree_budget=7")
    assert lines[3].endswith("custom_params.ddtree_budget=15") and "launch_server" not in lines[2] + lines[3]


def test_wrapper_runs_the_same_cli():
    """bench/ab_serve.py: the package's parser (only --out's default differs) and the package's functions."""
    ab = load_bench("ab_serve")
    from sglang_ddtree.ab import cli, report, runner, servers

    def opts(p):
        return {a.dest: (tuple(a.option_strings), a.default, a.nargs, a.help) for a in p._actions}
    w, c = opts(ab.build_parser()), opts(cli.build_parser())
    assert w.pop("out")[1] == os.path.join(REPO, "bench", "results", "ab_h200") and c.pop("out")[1] == "ab_serve"
    assert w == c
    assert ab.render_markdown is report.render_markdown and ab.run is runner.run
    assert ab.build_server_cmd is servers.build_server_cmd and ab.popen_launcher is servers.popen_launcher


def _copy_installed_layout(dst):
    """sglang_ddtree/__init__.py, switches.py + sglang_ddtree/ab/ as a wheel lays them out, with no
    checkout around."""
    pkg = dst / "sglang_ddtree"
    (pkg / "ab").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "sglang_ddtree", "__init__.py"), pkg)
    shutil.copy(os.path.join(REPO, "sglang_ddtree", "switches.py"), pkg)   # the arms' switches (pure Python)
    for f in os.listdir(os.path.join(REPO, "sglang_ddtree", "ab")):
        if f.endswith(".py"):
            shutil.copy(os.path.join(REPO, "sglang_ddtree", "ab", f), pkg / "ab")
    return dst


def _run_isolated(site, cwd, argv):
    """The CLI under ``python -I -S`` (no site-packages: no torch, no SGLang, no installed sglang_ddtree)."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(site)!r})
        from sglang_ddtree.ab import checkout, cli
        try:
            rc = cli.main({argv!r})
        except SystemExit as e:
            rc = e.code
        print(json.dumps(dict(rc=rc, file=cli.__file__, checkout=checkout.root(),
                              heavy=[m for m in ("torch", "sglang", "triton", "numpy") if m in sys.modules])))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_DDTREE_CHECKOUT", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=str(cwd), env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r


def test_without_the_checkout(tmp_path):
    site = _copy_installed_layout(tmp_path / "site")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    res, r = _run_isolated(site, cwd, ["--help"])
    assert res["rc"] == 0 and "--draft-model-path" in r.stdout
    assert res["file"].startswith(str(site)) and res["checkout"] is None and res["heavy"] == []
    # the user's own model: planned without the checkout
    res, r = _run_isolated(site, cwd, ["--model-path", "T", "--draft-model-path", "D", "--num-prompts", "4",
                                       "--arms", "base,ddtree_b8", "--dry-run", "--no-env-probe",
                                       "--workdir", str(tmp_path / "w")])
    assert res["rc"] == 0, r.stdout + r.stderr
    assert "--speculative-algorithm DDTREE-GPU --speculative-draft-model-path D --speculative-num-draft-tokens 9" \
        in r.stdout
    # the text pair's prompts live in the checkout: a clear message, no traceback
    res, r = _run_isolated(site, cwd, ["--dry-run", "--no-env-probe", "--num-prompts", "4",
                                       "--workdir", str(tmp_path / "w")])
    assert res["rc"] not in (0, None)
    msg = str(res["rc"])
    assert "bench/textpair/corpus_manifest.tsv" in msg and "SGLANG_DDTREE_CHECKOUT" in msg and "--pair text" in msg
    assert "Traceback" not in r.stderr
    # a report needs no checkout either, the PNG included (matplotlib permitting)
    doc = os.path.join(tmp_path, "one.json")
    shutil.copy(os.path.join(REPO, "bench", "results", "ab_h200.json"), doc)
    res, r = _run_isolated(site, cwd, ["--merge", str(tmp_path / "m"), doc])
    assert res["rc"] == 0, r.stdout + r.stderr
    try:
        import matplotlib  # noqa: F401
        assert "wrote " + str(tmp_path / "m") + ".png" in r.stdout and (tmp_path / "m.png").stat().st_size > 10000
    except ImportError:
        assert "no plot (" in r.stdout and "python -m sglang_ddtree.ab.plot" in r.stdout, r.stdout
    assert (tmp_path / "m.md").read_text().startswith("# A/B serving benchmark")


def test_checkout_is_found_from_the_environment(tmp_path, monkeypatch):
    from sglang_ddtree.ab import checkout, prompts
    monkeypatch.setenv(checkout.ENV, str(tmp_path))  # a folder that is not a checkout: the message says so
    with pytest.raises(checkout.CheckoutMissing, match="not in the checkout .*SGLANG_DDTREE_CHECKOUT is set"):
        prompts.textpair_heldout_files()
    monkeypatch.setenv(checkout.ENV, REPO)
    held = prompts.textpair_heldout_files()
    assert held and all(f.endswith(".py") for f in held)
    assert prompts.textpair_heldout_files(checkout_root=REPO) == held


def test_long_prompts_for_a_long_context_arm(tmp_path, monkeypatch, capsys):
    """--long-prompts CHARS: every prompt at least CHARS characters, distinct, deterministic; the dry run
    reports them; combined with --prompts it is refused."""
    from sglang_ddtree.ab import cli, prompts as PR, servers

    ps = PR.make_long_prompts(6, 40000)
    assert ps == PR.make_long_prompts(6, 40000)
    assert all(len(p["text"]) >= 40000 and p["kind"] == "long" for p in ps)
    assert len({p["text"][:2000] for p in ps}) == 6 and len({p["source"] for p in ps}) == 6
    short = PR.make_long_prompts(3, 10)
    assert all("+0" in p["source"] for p in short)          # one text already holds 10 characters
    with pytest.raises(ValueError):
        PR.make_long_prompts(1, 0)
    with pytest.raises(ValueError):
        PR.make_long_prompts(1, 10 ** 12)                    # more than the whole library

    def no_start(*a, **k):
        raise AssertionError("a dry run started a process")
    monkeypatch.setattr(servers, "PopenServer", no_start)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["--model-path", "/models/T", "--draft-model-path", "/models/D", "--num-prompts", "4",
                   "--arms", "base,ddtree_b16", "--concurrency", "1", "--dry-run", "--no-env-probe",
                   "--long-prompts", "30000", "--workdir", str(tmp_path / "work"), "--python", "PY"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["count"] == 4 and {k: n for k, n in summary["kinds"].items() if n} == {"long": 4}
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError):
        cli.main(["--model-path", "/models/T", "--num-prompts", "1", "--arms", "base", "--dry-run",
                  "--no-env-probe", "--long-prompts", "100", "--prompts", str(f), "--python", "PY"])


def test_a_count_per_concurrency_must_list_every_level_before_any_server(tmp_path, monkeypatch):
    """--requests-per-level C:n,...: a concurrency it leaves out is refused by the CLI, one line, no server."""
    from sglang_ddtree.ab import cli, servers

    def no_start(*a, **k):
        raise AssertionError("a server was started")
    monkeypatch.setattr(servers, "PopenServer", no_start)
    with pytest.raises(SystemExit, match="no count for concurrency 16"):
        cli.main(["--model-path", "/models/T", "--arms", "base", "--concurrency", "1,16", "--num-prompts", "4",
                  "--requests-per-level", "1:8,4:8", "--dry-run", "--no-env-probe",
                  "--workdir", str(tmp_path / "w")])
