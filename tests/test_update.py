"""The update is one minibatch's loss, however it is computed: split into micro-batches of any size, or
with the rows whose loss is exactly zero left out (`train.skip_zero_loss_rows`), for every algorithm,
on batches where only some trajectories have a context and only some groups have reward variance."""

import copy
from unittest import mock

import pytest
import torch

from conftest import rollouts, session_for
from lopd.algorithms.lopd import RetrievalContext
from lopd.update import update
from lopd.tokens import score_completions

# in make test: the methods whose context covers only some rows; the rest run under -m slow. A name with a
# "+variant" runs the algorithm with the overrides VARIANTS gives it (LOPD's compressor; the residual target).
ALGORITHMS = ["grpo", "sdpo", "lopd", "lopd+compressor", "lopd+warmup", "sdpo+residual", "lopd+rows",
              "lopd+warmup_rows"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("opsd", "skill_sd", "lopd_text",
                                                                                       "opsd+rows")]
ROWS = ["algorithm.distill.rows_per_group=2", "algorithm.distill.pg_weight=1.0"]  # PG-only rows beside distilled ones
VARIANTS = {
    "compressor": ["algorithm.lopd.composer=compressor", "algorithm.lopd.latent_tokens=8", "algorithm.lopd.cd_rows=2",
                   "algorithm.lopd.beta=0.0", "algorithm.lopd.latent_from_kl_ratio=inf"],
    "residual": ["algorithm.distill.target=residual"],
    # the compressor's warm-up: the student follows the text teacher, the compressor distils it on every row
    "warmup": ["algorithm.lopd.composer=compressor", "algorithm.lopd.latent_tokens=8", "algorithm.lopd.beta=0.0"],
    # 2 rows of each group of 4 keep their context: the teachers and pi_0 run on those rows only
    "rows": ROWS,
    "warmup_rows": ["algorithm.lopd.composer=compressor", "algorithm.lopd.latent_tokens=8", "algorithm.lopd.beta=0.0",
                    *ROWS],
}
BASE = ["rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=32",
        "model.lora.enabled=false", "train.threads=1"]
# groups of 4: mixed, no success, mixed, all successes
REWARDS = [1.0, 0.0, 0.0, 0.0] + [0.0] * 4 + [1.0, 1.0, 0.0, 1.0] + [1.0] * 4
WITHOUT_CONTEXT = [2, 8, 9, 10, 11]  # rows whose retrieval "found nothing" (where the method has one)
SUCCESSES = {i for i, r in enumerate(REWARDS) if r == 1.0}


def _session(toolworld, name, overrides=()):
    name, _, variant = name.partition("+")
    return session_for([f"algorithm.name={name}", *BASE, *VARIANTS.get(variant, []), *overrides], env=toolworld)


_SAMPLED: dict = {}  # (model, rollout settings) -> the two batches every session of this file samples alike


def _two_batches(s, toolworld, rewards):
    """The first (remembered) and second batch of real rollouts. Every session here starts from the same
    seeded policy and samples under seed 3, so the batches are sampled once per file and copied."""
    key = (repr(s.cfg.model), repr(s.cfg.rollout))
    if key not in _SAMPLED:
        tasks = list(toolworld.tasks("train")[:4])
        torch.manual_seed(3)
        _SAMPLED[key] = (rollouts(s, tasks), rollouts(s, tasks))
    first, second = copy.deepcopy(_SAMPLED[key])
    for batch, r in ((first, [1.0, 0.0] * 8), (second, rewards)):
        batch.rewards = torch.tensor(r, dtype=torch.float32)[: len(batch)]
        batch.success = batch.rewards > 0.5
    return first, second


def _batch_and_context(s, toolworld, rewards=REWARDS, blank=WITHOUT_CONTEXT):
    """A second batch after a remembered first one (LOPD's bank, Skill-SD's library fill), its context with
    the `blank` rows' context taken away, as when retrieval finds nothing for them."""
    first, batch = _two_batches(s, toolworld, rewards)
    s.algorithm.remember(first, 1)
    ctx = s.algorithm.build_context(batch, 2)
    if ctx.has_context is not None:
        for i in blank:
            ctx.has_context[i] = False
            ctx.privileged[i] = None
            if isinstance(ctx, RetrievalContext) and ctx.retrieved is not None:
                ctx.retrieved[i], ctx.similarity[i] = [], []
    return batch, ctx


def _sgd(s):
    """Plain SGD (lr 0.1) over every parameter group: the update is the gradient itself."""
    s.optimizer = torch.optim.SGD([{"params": g["params"]} for g in s.optimizer.param_groups], lr=0.1)
    s.scheduler = torch.optim.lr_scheduler.LambdaLR(s.optimizer, lambda step: 1.0)


def _trained(s) -> list[torch.Tensor]:
    return [p.detach().clone() for g in s.optimizer.param_groups for p in g["params"]]


def _updated(toolworld, name, overrides=(), **context) -> tuple[list[torch.Tensor], dict, int]:
    s = _session(toolworld, name, overrides)
    batch, ctx = _batch_and_context(s, toolworld, **context)
    _sgd(s)
    rows = []  # the student's forwards: rows per call

    def counted(model, prompt_ids, *args, **kwargs):
        rows.append(len(prompt_ids))
        return score_completions(model, prompt_ids, *args, **kwargs)

    torch.manual_seed(5)
    with mock.patch("lopd.update.score_completions", counted):
        metrics = update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, ctx, s.cfg)
    return _trained(s), metrics, sum(rows)


@pytest.mark.parametrize("name", ALGORITHMS[1:])  # GRPO's: tests/test_grpo.py
def test_micro_batches_of_any_size_give_the_same_update(toolworld, name):
    """Each loss term is divided by its count over the whole minibatch (`Algorithm.units`), so the
    micro-batches add up to the one-batch loss even where the distillation covers only some rows (the
    earlier per-micro-batch mean weighted those rows by how they happened to be split: 1.5e-3 apart here)."""
    pg = ["algorithm.distill.pg_weight=1.0"] if name != "grpo" else []
    whole, _, _ = _updated(toolworld, name, [*pg, "train.micro_batch_size=64"])
    split, _, _ = _updated(toolworld, name, [*pg, "train.micro_batch_size=3"])
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_skipping_zero_loss_rows_gives_the_same_update_with_fewer_rows(toolworld, name):
    full, m_full, rows_full = _updated(toolworld, name)
    skipped, m_skipped, rows_skipped = _updated(toolworld, name, ["train.skip_zero_loss_rows=true"])
    for a, b in zip(full, skipped):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    if name != "opsd":  # OPSD's reference answer is a context for every row: nothing is ever skipped
        assert rows_skipped < rows_full
    # the metric says what the forwards were: every row, then the live rows' share
    assert m_full["update/rows_forwarded"] == 1.0
    assert m_skipped["update/rows_forwarded"] == pytest.approx(rows_skipped / rows_full)


def test_live_rows_by_hand(toolworld):
    """GRPO: the mixed groups (0 and 2); SDPO: the rows with a successful sibling in their group (group 0's
    lone success has none; group 2 was blanked); with the policy gradient mixed in, the union with the
    mixed groups; LOPD: the rows with a context, and under pg also the mixed groups' rows."""
    mixed = set(range(0, 4)) | set(range(8, 12))
    sdpo = {1, 3, 12, 13, 14, 15}
    for name, overrides, want in [
        ("grpo", [], mixed),
        ("sdpo", [], sdpo),
        ("sdpo", ["algorithm.distill.pg_weight=1.0"], sdpo | mixed),
        ("lopd", [], set(range(16)) - set(WITHOUT_CONTEXT)),
        ("lopd", ["algorithm.distill.pg_weight=1.0"], (set(range(16)) - set(WITHOUT_CONTEXT)) | mixed),
        ("grpo", ["algorithm.pg.kl_coef=0.1"], set(range(16))),
        # distill.skip_successes: the successes (0, 8, 9, 11, 12-15) leave the distillation; LOPD's training composer
        # still reads every row with a context
        ("sdpo", ["algorithm.distill.skip_successes=true"], sdpo - SUCCESSES),
        ("lopd", ["algorithm.distill.skip_successes=true", "algorithm.lopd.train_composer=false"],
         set(range(16)) - set(WITHOUT_CONTEXT) - SUCCESSES),
        ("lopd", ["algorithm.distill.skip_successes=true"], set(range(16)) - set(WITHOUT_CONTEXT)),
    ]:
        s = _session(toolworld, name, overrides)
        batch, ctx = _batch_and_context(s, toolworld)
        live = s.algorithm.live_rows(batch, ctx)
        assert set(torch.nonzero(live).flatten().tolist()) == want, (name, overrides)


@pytest.mark.parametrize("variant", ["compressor", "rows"])
def test_a_frozen_composer_measures_every_nth_step_and_updates_the_same(toolworld, variant):
    """`algorithm.lopd.measure_every`: with the composer frozen, pi_0 (Delta) and the compressor's text teacher
    (its context-distillation KL) only measure. On step 2 with measure_every 2 neither runs, every measurement
    of theirs is absent, and the update and every other term are the same, bit for bit, as when they run."""
    frozen = [*VARIANTS[variant], "algorithm.lopd.train_composer=false"]
    results = {}
    for every in (1, 2):
        s = _session(toolworld, "lopd", [*frozen, f"algorithm.lopd.measure_every={every}"])
        batch, ctx = _batch_and_context(s, toolworld)
        assert s.algorithm.measures(ctx) == (every == 1)
        calls = {"initial": 0, "text": 0}

        def counting(name, score):
            def counted(*args, **kwargs):
                calls[name] += 1
                return score(*args, **kwargs)
            return counted

        torch.manual_seed(5)
        with mock.patch.object(s.algorithm.initial_policy, "score", counting("initial", s.algorithm.initial_policy.score)), \
                mock.patch.object(s.algorithm.teacher, "score", counting("text", s.algorithm.teacher.score)):
            metrics = update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, ctx, s.cfg)
        results[every] = _trained(s), metrics, calls
    (weights, measured, calls), (skipped_weights, skipped, skipped_calls) = results[1], results[2]
    assert calls["initial"] > 0 and skipped_calls["initial"] == 0
    assert skipped_calls["text"] == 0 and (calls["text"] > 0) == (variant == "compressor")
    only_measured = {"context/delta_success", "context/delta_failure", "context/constraint", "loss/margin"}
    assert only_measured <= set(measured) - set(skipped)
    assert ("loss/cd" in measured) == (variant == "compressor") and "loss/cd" not in skipped
    for key in skipped:
        assert skipped[key] == measured[key], key
    for a, b in zip(weights, skipped_weights):
        assert torch.equal(a, b)
    s = _session(toolworld, "lopd", [*VARIANTS[variant], "algorithm.lopd.measure_every=2"])
    assert s.algorithm.measures(_batch_and_context(s, toolworld)[1])  # a training composer reads them every step


@pytest.mark.parametrize("name", ["lopd"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("grpo", "sdpo")])
def test_a_batch_with_nothing_to_learn_steps_adamw_exactly_as_before(toolworld, name):
    """After a step that built AdamW's moments, a batch with no reward variance and no context: skipped,
    it still takes the optimizer step (one row's exactly-zero gradient), bit for bit as computing all rows."""
    results = []
    for skip in ("false", "true"):
        s = _session(toolworld, name, [f"train.skip_zero_loss_rows={skip}", "algorithm.distill.pg_weight=1.0",
                                       "optim.lr=1e-2"])
        tasks = list(toolworld.tasks("train")[:4])
        torch.manual_seed(3)
        live = rollouts(s, tasks, [1.0, 0.0] * 8)  # every group mixed: every row live
        update(s.model, s.algorithm, s.optimizer, s.scheduler, live, s.algorithm.build_context(live, 1), s.cfg)
        dead = rollouts(s, tasks, [0.0] * 16)  # no success: no variance, nothing retrieved or demonstrated
        ctx = s.algorithm.build_context(dead, 2)
        assert ctx.has_context is None or not bool(ctx.has_context.any())
        before = _trained(s)
        metrics = update(s.model, s.algorithm, s.optimizer, s.scheduler, dead, ctx, s.cfg)
        after = _trained(s)
        assert metrics["optim/grad_norm"] == 0.0
        assert any(not torch.equal(a, b) for a, b in zip(before, after))  # AdamW's momentum still moves them
        results.append(after)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_dual_ascent_reads_the_whole_minibatch_so_lambda_does_not_depend_on_the_split(toolworld):
    """LOPD's lambda moves by dual_lr x the constraint's mean over the minibatch's constrained trajectories
    (A != 0, with a context). Before, it read a per-micro-batch mean averaged by token weight, so micro-batches
    with no constrained row pulled it toward 0: lambda depended on the split. Here only some rows have a
    context and only two groups are mixed; micro-batches of 1 row and of the whole batch give the same lambda.
    (The 2-rank LOPD equivalence of tests/test_dist.py checks 1 vs 2 ranks with dual ascent on.)"""
    extra = ["algorithm.lopd.dual_lr=0.5", "algorithm.lopd.gate_init=0.5", "algorithm.lopd.latent_tokens=32"]
    lams, constraints = [], []
    for size in (1, 64):
        s = _session(toolworld, "lopd", [*extra, f"train.micro_batch_size={size}"])
        batch, ctx = _batch_and_context(s, toolworld)
        for module in (s.model, s.algorithm.teacher.model, s.algorithm.composer):  # float64: only the split differs
            module.double()
        _sgd(s)
        metrics = update(s.model, s.algorithm, s.optimizer, s.scheduler, batch, ctx, s.cfg)
        lams.append(s.algorithm.lam)
        constraints.append(metrics["context/constraint"])
    assert constraints[0] != 0 and abs(lams[0] - 1.0) > 1e-3  # it moved
    assert abs(lams[0] - lams[1]) < 1e-7 and abs(constraints[0] - constraints[1]) < 1e-7, (lams, constraints)
    assert lams[0] == pytest.approx(1.0 + 0.5 * constraints[0], abs=1e-12)


def test_host_memory_is_returned_only_where_the_activations_make_it_pay(toolworld):
    """`train.return_host_memory` applies when one micro-batch keeps at least `return_host_memory_from_gib`
    of activations (the planner's measure): not this small batch at the default 4 GiB, always at 0, never
    when off, and the update is bit for bit the same every way."""
    calls = []
    real = update.__globals__["host_memory"].activations_returned

    def spy(enabled=True):
        calls.append(enabled)
        return real(enabled)

    results = {}
    for name, overrides in {"default": [], "always": ["train.return_host_memory_from_gib=0"],
                            "off": ["train.return_host_memory=false", "train.return_host_memory_from_gib=0"]}.items():
        with mock.patch("lopd.host_memory.activations_returned", spy):
            results[name] = _updated(toolworld, "grpo", overrides)
    assert calls == [False, True, False]
    assert [r[1]["memory/returned_to_os"] for r in results.values()] == [0.0, 1.0, 0.0]
    for other in ("always", "off"):
        for a, b in zip(results["default"][0], results[other][0]):
            assert torch.equal(a, b)
