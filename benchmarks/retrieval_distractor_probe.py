"""Does LOPD's retrieval hand the teacher the task's distractor tool's calls, and can request similarity tell?

ToolWorld tasks offer two tools, one of them a distractor; `retrieval.key: task_tools` may find the successful
calls of either. For each finished LOPD run given (its final experience bank, read-only) and the first N tasks
of a split, the retrieval as training does it (`ExperienceMemory.search`); each retrieved experience is "right"
when it called the task's own tool (its category). Prints how many are wrong, the AUC of request similarity
(right above wrong), and what a similarity floor (`algorithm.lopd.min_similarity`) would keep of each
(benchmarks/RESULTS.md section 21e).

    python benchmarks/retrieval_distractor_probe.py runs/compare_toolworld_r3/lopd/seed{0,1,2,3,4} --split val
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    from lopd.algorithms import build_algorithm
    from lopd.envs import build_env
    from lopd.latent.experience_bank import ExperienceBank
    from lopd.runs import open_run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="finished LOPD (or lopd_text) run directories")
    ap.add_argument("--split", default="val")
    ap.add_argument("--tasks", type=int, default=200)
    args = ap.parse_args()
    right, wrong, empty = [], [], 0
    for run_dir in args.runs:
        opened = open_run(run_dir)
        env = build_env(opened.cfg.env)
        model, tokenizer = opened.load_model("cpu")
        algorithm = build_algorithm(opened.cfg)
        algorithm.setup(policy=model, tokenizer=tokenizer, env=env, run=None)
        bank = algorithm.memory.bank = ExperienceBank(algorithm.memory.embedder.dim, opened.run.bank_dir, readonly=True)
        tasks = list(env.tasks(args.split))[: args.tasks]
        found = algorithm.memory.search(tasks)
        for task, ids, sims in zip(tasks, found.index, found.similarity):
            empty += not ids
            for i, s in zip(ids, sims):
                (right if bank.entries[i].category == task.category else wrong).append(float(s))
    auc = sum((a > b) + 0.5 * (a == b) for a in right for b in wrong) / max(len(right) * len(wrong), 1)
    print(f"{args.split}, {len(args.runs)} banks x {args.tasks} tasks: {len(right) + len(wrong)} retrieved, "
          f"{len(right)} of the task's own tool, {len(wrong)} of another; {empty} tasks found nothing; "
          f"similarity AUC (own above other) {auc:.3f}; median {statistics.median(right):.2f} against "
          f"{statistics.median(wrong) if wrong else float('nan'):.2f}")
    for floor in (0.3, 0.4, 0.5, 0.6):
        print(f"  min_similarity {floor}: keeps {sum(s >= floor for s in right) / len(right):.0%} of the own tool's, "
              f"{sum(s >= floor for s in wrong) / max(len(wrong), 1):.0%} of the other's")


if __name__ == "__main__":
    main()
