"""FSDP2 (lopd/fsdp.py, `train.fsdp`): two gloo ranks with every decoder layer sharded equal one unsharded
process with the same global batch and seed (parameters to 1e-6, the same bank, the same metrics), for
GRPO, OPSD (a sharded frozen teacher copy) and LOPD (gradients into the composer through a sharded frozen
teacher); a sharded run resumes on one process from its full checkpoint; the layers really are sharded;
what FSDP does not cover is refused in one line. Real processes, real collectives, real fully_shard."""

import os

import pytest
import torch

import zygote
from conftest import small_overrides
from test_dist import _free_port, _overrides, _state, assert_equivalent, run_ranks, run_single

from lopd.runs import RunDir

STEPS = {"grpo": 2, "opsd": 2, "lopd": 3}


# Unclipped, the sharded run makes the same float additions as the single process (g_rank0 + g_rank1 per
# element), and the weights come out identical. Clipped, the global norm is added up in another order
# (shards, then ranks; in float64) than torch's float32 per-tensor norms: the clip coefficient then differs
# in its last bits, which AdamW's first steps amplify in near-zero gradients. The clip is tested on its own
# below, against a float64 reference.
UNCLIPPED = {"optim.grad_clip": 0}
# Shared prompts (`train.share_prompts`) off here: a prompt run once for its group sums its rows' gradients in one
# index_add on one process, but in two partial sums (one per rank's rows) when the group is split across ranks, and
# the last bits differ for the same reason as the clip's. The sharing itself is tested against the unshared
# forward in tests/test_tokens.py, and the 2-rank equivalence with it on in tests/test_dist.py.
EXACT = {**UNCLIPPED, "train.share_prompts": "false"}


def _sharded(algorithm, run_dir, steps=None, **extra):
    return _overrides(algorithm, run_dir, steps=steps or STEPS[algorithm], **{"train.fsdp": "true", **EXACT, **extra})


# Under `slow`, run by CI after `make test` (`make test-faults`): LOPD's covers the policy, a sharded frozen copy,
# the composer and the encoder's union. `make test` keeps the sharding layout and the sharded clip (below) and the
# 2-rank LOPD equivalence without sharding (tests/test_dist.py).
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "opsd", "lopd"])
def test_two_sharded_ranks_equal_one_process(tmp_path, algorithm):
    run_single(_overrides(algorithm, tmp_path / "one", steps=STEPS[algorithm], **EXACT))
    run_ranks(_sharded(algorithm, tmp_path / "two"))
    one, two = _state(tmp_path / "one"), _state(tmp_path / "two")
    assert_equivalent(one, two)
    if algorithm == "lopd":
        assert any(r.get("context/retrieved_per_task", 0) > 0 for r in one["rows"])


@pytest.mark.slow
def test_a_sharded_run_resumes_on_one_process(tmp_path):
    run_ranks(_sharded("lopd", tmp_path / "whole", steps=4))
    stopped = _sharded("lopd", tmp_path / "stopped", steps=4)
    run_ranks(stopped, stop_after=3)  # the checkpoint is step 2's (every 2 steps)
    assert RunDir(tmp_path / "stopped").latest_checkpoint().name == "step_000002"
    run_single(stopped)  # one process: train.fsdp has no effect, the full checkpoint loads as it is
    assert_equivalent(_state(tmp_path / "whole"), _state(tmp_path / "stopped"))


def _shapes(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    from torch.distributed.tensor import DTensor

    from lopd import dist
    from lopd.config import load_config
    from lopd.session import build

    session = build(load_config(None, overrides))
    try:
        from lopd.models import copies_of

        shapes = {}
        for name, module in [("policy", session.model), *[(f"copy{i}", m) for i, m in enumerate(copies_of(session.model))]]:
            layer = module.model.layers[0].self_attn.q_proj.weight
            embed = module.model.embed_tokens.weight
            shapes[name] = (isinstance(layer, DTensor), tuple(layer.to_local().shape) if isinstance(layer, DTensor)
                            else tuple(layer.shape), isinstance(embed, DTensor))
        torch.save(shapes, f"{out}.{rank}")
    finally:
        session.run.release()
        dist.close(dist.World(rank, world))


def test_the_layers_are_sharded_and_the_embeddings_replicated(tmp_path):
    overrides = _sharded("opsd", tmp_path / "run")
    zygote.start_processes(_shapes, args=(2, _free_port(), overrides, str(tmp_path / "shapes")), nprocs=2)
    for rank in (0, 1):
        shapes = torch.load(tmp_path / f"shapes.{rank}")
        assert set(shapes) == {"policy", "copy0"}  # OPSD's frozen teacher is a copy, sharded too
        for sharded, local, embed_sharded in shapes.values():
            assert sharded and local == (96, 192) and not embed_sharded  # q_proj [192, 192]: half the rows


def _clip(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lopd.fsdp import clip_grad_norm_

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(7, 3, generator=g) * 3, torch.randn(5, generator=g), torch.randn(4, 2, generator=g)]
        params = []
        for i, t in enumerate(full):  # two sharded (7 rows: uneven over 2 ranks), one replicated
            p = torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)]) if i < 2 else t.clone())
            p.grad = distribute_tensor(t.clone(), mesh, [Shard(0)]) if i < 2 else t.clone()
            params.append(p)
        norm = clip_grad_norm_(params, 1.0)
        grads = [p.grad.full_tensor() if i < 2 else p.grad for i, p in enumerate(params)]
        torch.save({"norm": norm, "grads": grads, "full": full}, f"{out}.{rank}")
    finally:
        tdist.destroy_process_group()


def test_the_sharded_clip_is_the_global_clip(tmp_path):
    zygote.start_processes(_clip, args=(2, _free_port(), str(tmp_path / "clip")), nprocs=2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"clip.{rank}")
        full = [t.double() for t in got["full"]]
        norm = torch.sqrt(sum((t ** 2).sum() for t in full))  # float64, each element once
        assert float(got["norm"]) == pytest.approx(float(norm), rel=1e-6)
        for g, t in zip(got["grads"], full):
            torch.testing.assert_close(g.double(), t / (norm + 1e-6), atol=1e-6, rtol=1e-6)
        reference = [t.float().clone().requires_grad_() for t in full]
        for r in reference:
            r.grad = r.detach().clone()
        assert float(got["norm"]) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(reference, 1.0)), rel=1e-6)


def test_what_fsdp_does_not_cover_is_refused(tmp_path):
    from lopd.config import load_config
    from lopd.envs import build_env
    from lopd.errors import ConfigError
    from lopd.session import check_shardable

    cfg = load_config(None, small_overrides(tmp_path, **{"model.lora.enabled": "true", "train.fsdp": "true"}))
    with pytest.raises(ConfigError, match="train.fsdp: shards full fine-tunes"):
        check_shardable(cfg, build_env(cfg.env))
    cfg = load_config(None, small_overrides(tmp_path, **{"rollout.engine": "vllm", "train.fsdp": "true"}))
    with pytest.raises(ConfigError, match="rollout.engine=hf"):
        check_shardable(cfg, build_env(cfg.env))
    cfg = load_config(None, small_overrides(tmp_path, **{"env.name": "toolworld_episodes", "train.fsdp": "true"}))
    with pytest.raises(ConfigError, match="multi-turn"):
        check_shardable(cfg, build_env(cfg.env))
