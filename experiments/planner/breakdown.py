"""Where a timed row's step goes: the profiler's self CPU time of one rank over steps 4-5 of a ``Trainer.fit``
(``run.py``'s rows), by kind of work, next to the planner's parts (a diagnostic of the step-time model; the
profiler's own cost inflates the many small ops).

    OMP_NUM_THREADS=1 /work/coord/cpu_all python -m experiments.planner.breakdown 0 3   # time_rows() indices
"""

from __future__ import annotations

import json
import os
import sys

KINDS = (("attention kernel", ("scaled_dot_product",)),
         ("attention layer's own (Python, merges, waits)", ("BlockAttentionFunction", "HeadGroups", "SeqToHead")),
         ("communication", ("c10d::",)),
         ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")))


def _worker(rank: int, world: int, row: dict) -> dict:
    import lightning as L
    import torch

    from experiments.planner import run

    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world)

    class Profile(L.Callback):
        def __init__(self):
            self.step, self.prof = 0, None

        def on_train_batch_start(self, *a):
            self.step += 1
            if self.step == 4:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()

        def on_train_batch_end(self, *a):
            if self.step == 5:
                self.prof.__exit__(None, None, None)

    cb = Profile()
    run._fit(row, steps=6, callbacks=[cb])
    out = dict.fromkeys([k for k, _ in KINDS] + ["other ops"], 0.0)
    other: dict[str, float] = {}
    for e in cb.prof.key_averages():
        kind = next((k for k, keys in KINDS if any(e.key.startswith(s) or s in e.key for s in keys)), "other ops")
        out[kind] += e.self_cpu_time_total / 2e6  # seconds per step
        if kind == "other ops":
            other[e.key] = e.self_cpu_time_total / 2e6
    out["largest other ops"] = dict(sorted(other.items(), key=lambda kv: -kv[1])[:12])
    return out


def main(argv: list[str]) -> int:
    from experiments.common.launch import run_on_ranks
    from experiments.planner import run

    overhead = json.loads(run.OVERHEAD.read_text())
    for i in map(int, argv):
        row = run.time_rows()[i]
        per_rank = run_on_ranks(_worker, row["world"], (row,), timeout_s=300)
        pred = run.predict(row, run.cpu_profile(), overhead)["time"]
        print(json.dumps({"row": row, "profiled_s_per_step_rank0": per_rank[0],
                          "predicted": pred}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
