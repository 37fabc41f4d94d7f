"""Test-bed plugin for SGLang 0.5.16 (entry point group `sglang.srt.plugins`, name `ddtree_testbed`).

run_stages.sh installs it without pip: it copies this file next to a generated
`ddtree_testbed-0.0.1.dist-info/entry_points.txt` in a folder on PYTHONPATH.  SGLang calls
`register()` in every process that loads plugins (Engine/launcher, scheduler, detokenizer), so:

* with DDTREE_SWITCHES set (stage.py's test switches: nospec, cycle, nomaskpatch, maskcap<N>), it
  applies them (`sglang_ddtree.switches.register_from_environment`) in every process;
* every call prints `[ddtree-testbed] register pid=<pid> ppid=<parent> proc=<cmdline>`; run_stages.sh
  counts distinct pids per stage log (2 for an Engine: the launcher and the spawned scheduler, whose
  command line starts with `python3 -B -c from multiprocessing.spawn ...`).  The capture hook's line
  `capture hook on DFlashWorkerV2 pid=<pid>` names the scheduler's pid, which proves the entry point
  reached the scheduler (2026-11-30 run: it matched the spawned pid);
* with DDTREE_CAPTURE_DIR set, it wraps DFlashWorkerV2's draft model runner so every DFLASH draft
  forward (forward mode TARGET_VERIFY on the draft runner) dumps the block input ids, positions, the
  draft hidden states of the whole block and (once) the target lm_head weight into that folder as
  torch files `draft_<pid>_<n>.pt` (at most DDTREE_CAPTURE_MAX, default 64).  capture_fixtures.py
  turns them into the top-k fixtures.  Run capture stages eagerly (disable_cuda_graph): under a
  CUDA graph the draft runner output buffers are graph-owned.
"""
import os
import sys


def _proc_name():
    try:
        import setproctitle  # SGLang sets titles like "sglang::scheduler"
        return setproctitle.getproctitle()[:60].replace("\n", " ")
    except Exception:
        return os.path.basename(sys.argv[0])[:60]


def _install_capture(out_dir):
    import torch
    from sglang.srt.speculative import dflash_worker_v2 as m

    max_n = int(os.environ.get("DDTREE_CAPTURE_MAX", "64"))
    orig_init = m.DFlashWorkerV2.__init__
    if getattr(orig_init, "_ddtree_wrapped", False):
        return

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        runner = self.draft_model_runner
        orig_fwd = runner.forward
        worker = self
        state = {"n": 0, "head_saved": False}
        os.makedirs(out_dir, exist_ok=True)

        def fwd(forward_batch, *aa, **kk):
            out = orig_fwd(forward_batch, *aa, **kk)
            try:
                if state["n"] < max_n and forward_batch.forward_mode.is_target_verify():
                    hs = out.logits_output.hidden_states
                    if hs is not None and hs.numel() > 0:
                        bs = int(forward_batch.batch_size)
                        rec = {
                            "input_ids": forward_batch.input_ids.detach().view(bs, -1).cpu(),
                            "positions": forward_batch.positions.detach().view(bs, -1).cpu(),
                            "hidden": hs.detach().view(bs, -1, hs.shape[-1]).clone().cpu(),
                            "block_size": int(worker.block_size),
                            "mask_token_id": int(worker._mask_token_id),
                        }
                        if not state["head_saved"]:
                            lm = worker.target_worker.model_runner.model.lm_head.weight
                            rec["lm_head"] = lm.detach().cpu()
                            state["head_saved"] = True
                        p = os.path.join(out_dir, f"draft_{os.getpid()}_{state['n']:04d}.pt")
                        torch.save(rec, p)
                        state["n"] += 1
            except Exception as e:  # never break the server for a capture
                print(f"[ddtree-testbed] capture failed: {e!r}", flush=True)
            return out

        runner.forward = fwd
        print(f"[ddtree-testbed] capture hook on DFlashWorkerV2 pid={os.getpid()} -> {out_dir}", flush=True)

    init._ddtree_wrapped = True
    m.DFlashWorkerV2.__init__ = init


def register():
    print(f"[ddtree-testbed] register pid={os.getpid()} ppid={os.getppid()} proc={_proc_name()}", flush=True)
    if os.environ.get("DDTREE_SWITCHES"):   # stage.py's test switches (sglang_ddtree/switches.py)
        try:
            from sglang_ddtree import switches
            switches.register_from_environment()
            print(f"[ddtree-testbed] switches pid={os.getpid()}: {switches.describe()}", flush=True)
        except Exception as e:   # kept in switches.ERROR: the launcher's check refuses the stage
            print(f"[ddtree-testbed] switches refused: {e!r}", flush=True)
    d = os.environ.get("DDTREE_CAPTURE_DIR")
    if d:
        try:
            _install_capture(d)
        except Exception as e:
            print(f"[ddtree-testbed] could not install capture hook: {e!r}", flush=True)
